"""Method and path rules per crew and host (proxycore/protocol/l7.py): the canonical path, the
bypass table, the matcher's invariant under every reading a server may apply, the config's
errors, the exchange's plans, and the rules through the real proxy with curl."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxycore.config import parse_config
from proxycore.errors import ConfigError
from proxycore.protocol import http1
from proxycore.protocol.events import RequestDenied
from proxycore.protocol.exchange import plan_request
from proxycore.protocol.l7 import (
    RULE_METHOD,
    RULE_NOT_CANONICAL,
    RULE_PATH,
    RULE_REQUIRES_TERMINATION,
    HostRule,
    L7Rules,
    NotCanonical,
    RuleError,
    canonical_path,
    compile_pattern,
)
from proxycore.protocol.plans import Forward, OpenTunnel, Refuse
from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode
from tests.conftest import FakeServer, RunningProxy
from tests.test_exchange import routes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

from fuzz_l7 import readings

HOST = "api.example.test"
RULES = L7Rules(
    [
        HostRule.make(HOST, preset="read-only", paths=["/repos/acme/**", "/user"]),
        HostRule.make(HOST, methods=["POST"], paths=["/repos/acme/*/issues"]),
    ]
)

# (method, target, the rule that denies it or None). Every bypass an allowlist of paths is
# known to meet: each one either is refused as not canonical or does not match.
TABLE = [
    ("GET", "/repos/acme", None),
    ("GET", "/repos/acme/", None),
    ("GET", "/repos/acme/widgets/pulls?state=open", None),
    ("HEAD", "/user", None),
    ("POST", "/repos/acme/widgets/issues", None),
    ("GET", "/rep%6Fs/acme/x", None),  # an escaped unreserved letter is that letter
    ("GET", "/repos/acme/x%20y", None),  # other escapes stay escapes
    ("GET", "/repos/acmex", RULE_PATH),  # a prefix is not a segment
    ("GET", "/user/", RULE_PATH),
    ("GET", "/User", RULE_PATH),  # case-sensitive: only ever denies
    ("GET", "/", RULE_PATH),
    ("DELETE", "/repos/acme/x", RULE_METHOD),
    ("get", "/user", RULE_METHOD),  # methods are case-sensitive
    ("POST", "/repos/acme/a/b/issues", RULE_METHOD),  # * is one segment; ** allows GET only
    ("POST", "/repos/acme/issues", RULE_METHOD),  # ** allows GET there, not POST
    ("GET", "/repos/acme/../admin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/./x", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/..", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/%2e%2e/admin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/.%2E/admin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/..;/admin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/..;x=1/admin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme%2F..%2F..%2Fadmin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme%2f..%2fadmin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/..%5Cadmin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/..\\admin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/%252e%252e/admin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/%25252e/admin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/%C0%AE%C0%AE/admin", RULE_NOT_CANONICAL),  # overlong UTF-8 dots
    ("GET", "/repos/acme/%E0%80%AE/admin", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/%EF%BC%8E%EF%BC%8E/admin", RULE_NOT_CANONICAL),  # fullwidth dots
    ("GET", "/repos/acme/%EF%BC%8F/admin", RULE_NOT_CANONICAL),  # fullwidth solidus
    ("GET", "/repos/acme/%00/x", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/%0a", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme//x", RULE_NOT_CANONICAL),
    ("GET", "//repos/acme/x", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/x%", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/x%4", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/x%zz", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/x#frag", RULE_NOT_CANONICAL),
    ("GET", "/repos/acme/\u00e9", RULE_NOT_CANONICAL),  # raw non-ASCII
    ("GET", "/repos/acme/a b", RULE_NOT_CANONICAL),
]


@pytest.mark.parametrize(("method", "target", "rule"), TABLE)
def test_the_bypass_table(method: str, target: str, rule: str | None) -> None:
    got = RULES.check(HOST, method.encode(), target.encode("utf-8"))
    assert (got.rule if got else None) == rule, got


def test_a_host_without_rules_is_not_restricted_and_its_tunnel_opens() -> None:
    assert RULES.check("other.test", b"DELETE", b"/../x") is None
    assert RULES.tunnel_denied("other.test") is None
    denied = RULES.tunnel_denied(HOST)
    assert denied is not None and denied.rule == RULE_REQUIRES_TERMINATION


@pytest.mark.parametrize(
    "field", [b"x-http-method-override", b"x-http-method", b"x-method-override"]
)
def test_a_method_override_must_be_allowed_too(field: bytes) -> None:
    denied = RULES.check(HOST, b"GET", b"/user", [(field, b"DELETE")])
    assert denied is not None and denied.rule == RULE_METHOD
    assert "overridden to DELETE" in denied.message
    assert RULES.check(HOST, b"GET", b"/user", [(field, b"HEAD")]) is None


def test_refusals_say_what_the_rules_allow() -> None:
    denied = RULES.check(HOST, b"DELETE", b"/repos/acme/x")
    assert denied is not None
    assert denied.message == (
        "DELETE /repos/acme/x on api.example.test refused: this crew's rules for "
        "api.example.test allow GET, HEAD, OPTIONS on /repos/acme/**, /user; POST on "
        "/repos/acme/*/issues"
    )


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("repos", "must start with /"),
        ("/a/**x", "** must be a whole segment"),
        ("/a/../b", "dot-segment"),
        ("/a//b", "empty segment"),
        ("/a?x=1", "the path only"),
        ("/%7euser", "write escapes"),
        ("/caf\u00e9", "non-ASCII"),
    ],
)
def test_bad_patterns_are_refused_with_a_reason(pattern: str, why: str) -> None:
    with pytest.raises(RuleError, match=re.escape(why)):
        HostRule.make(HOST, paths=[pattern])


def test_bad_methods_and_presets_are_refused() -> None:
    with pytest.raises(RuleError, match="not an HTTP method"):
        HostRule.make(HOST, methods=["GE T"])
    with pytest.raises(RuleError, match="CONNECT"):
        HostRule.make(HOST, methods=["CONNECT"])
    with pytest.raises(RuleError, match="unknown"):
        HostRule.make(HOST, preset="read-mostly")


def test_the_config_names_the_rule_that_is_wrong() -> None:
    base = '[[crew]]\nname = "a"\ngateway = "10.0.0.1"\n'
    good = parse_config(base + '[[crew.rules]]\nhost = "API.Example.test"\npreset = "read-only"\n')
    assert good.crew[0].rules[0].preset == "read-only"
    with pytest.raises(ConfigError, match=r"crew\[0\]\.rules\[1\].*must start with /"):
        parse_config(
            base
            + '[[crew.rules]]\nhost = "a.test"\n'
            + '[[crew.rules]]\nhost = "b.test"\npaths = ["nope"]\n'
        )
    with pytest.raises(ConfigError, match=r"crew\[0\]\.rules\[0\].*not a valid host"):
        parse_config(base + '[[crew.rules]]\nhost = "bad host"\n')
    with pytest.raises(ConfigError, match="rules"):
        parse_config(base + '[[crew.rules]]\nhost = "a.test"\nverbs = ["GET"]\n')


# -- the invariant: whatever a server does with an allowed path, it stays under the prefix -----


PIECES = st.sampled_from(
    [
        "a", "acme", "safe", ".", "..", "/", "//", "%2e", "%2E", "%2f", "%2F", "%5c", "\\", "%25",
        "%252e", ";", ";x", "%3b", "%C0%AE", "%EF%BC%8E", "%EF%BC%8F", "%00", "%41", "~", "%7e",
        "*", ":", "@", "?", "#", "%", "%4", "x%2", " ", "\u00e9",
    ]
)  # fmt: skip


@settings(max_examples=1000, deadline=None)
@given(st.lists(PIECES, max_size=12))
def test_an_allowed_path_stays_under_its_prefix_under_every_reading(pieces: list[str]) -> None:
    rules = L7Rules([HostRule.make(HOST, paths=["/safe/**"])])
    target = ("/safe/" + "".join(pieces)).encode("utf-8")
    if rules.check(HOST, b"GET", target) is not None:
        return
    path = target.split(b"?", 1)[0]
    for reading in readings(path):
        assert reading == "/safe" or reading.startswith("/safe/"), (target, reading)


@given(st.binary(max_size=64))
def test_canonical_path_is_idempotent_and_never_fails_otherwise(raw: bytes) -> None:
    try:
        once = canonical_path(b"/" + raw)
    except NotCanonical:
        return
    assert canonical_path(once) == once


# -- the exchange -------------------------------------------------------------------------------


def _crew() -> CrewPolicy:
    rules = L7Rules(
        [
            HostRule.make("allowed.test", preset="read-only", paths=["/docs/**"]),
            HostRule.make("api.anthropic.com", methods=["POST"], paths=["/v1/messages"]),
        ]
    )
    return CrewPolicy(
        "alpha",
        NetworkMode.RESTRICTED,
        Allowlist(["allowed.test", "free.test", "api.anthropic.com"]),
        rules,
    )


def _plan(data: bytes) -> object:
    data = data.replace(b"\r\n", b"\r\nHost: x\r\n", 1) if b"Host:" not in data else data
    parsed = http1.parse_request_head(data)
    assert parsed is not None
    return plan_request(parsed[0], _crew(), routes(), audit_blocked=False, max_body=1000)


def test_the_exchange_holds_forward_reverse_and_tunnel_requests_to_the_rules() -> None:
    ok = _plan(b"GET http://allowed.test/docs/a HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    assert isinstance(ok, Forward)
    denied = _plan(b"POST http://allowed.test/docs/a HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert isinstance(denied, Refuse) and denied.status == 403
    assert isinstance(denied.event, RequestDenied) and denied.event.rule == RULE_METHOD
    assert denied.body.rule == RULE_METHOD
    assert "GET, HEAD, OPTIONS on /docs/**" in denied.body.message
    sneaky = _plan(b"GET http://allowed.test/docs/%2e%2e/admin HTTP/1.1\r\n\r\n")
    assert isinstance(sneaky, Refuse) and sneaky.event.rule == RULE_NOT_CANONICAL  # type: ignore[union-attr]
    # The reverse route: the path checked is the one the provider serves (prefix included).
    messages = _plan(b"POST /anthropic/v1/messages HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    assert isinstance(messages, Forward)
    models = _plan(b"GET /anthropic/v1/models HTTP/1.1\r\n\r\n")
    assert isinstance(models, Refuse) and models.event.rule == RULE_PATH  # type: ignore[union-attr]
    # A tunnel to a host with rules is refused; to another host it opens as before.
    tunnel = _plan(b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n")
    assert isinstance(tunnel, Refuse) and tunnel.status == 403 and tunnel.close
    assert tunnel.event.rule == RULE_REQUIRES_TERMINATION  # type: ignore[union-attr]
    assert isinstance(_plan(b"CONNECT free.test:443 HTTP/1.1\r\n\r\n"), OpenTunnel)
    # Rules only narrow: a host off the allowlist stays refused by the name policy.
    off = _plan(b"GET http://elsewhere.test/docs/a HTTP/1.1\r\n\r\n")
    assert isinstance(off, Refuse) and off.event.rule == "not_in_allowlist"  # type: ignore[union-attr]


# -- through the real proxy -----------------------------------------------------------------------

RULES_TOML = """
[[crew.rules]]
host = "plain.test"
preset = "read-only"
paths = ["/docs/**"]

[[crew.rules]]
host = "api.anthropic.test"
methods = ["POST"]
paths = ["/v1/messages"]
"""


def _curl(proxy: RunningProxy, *args: str) -> tuple[int, str]:
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "10", "-x", proxy.url, "-w", "\n%{http_code}", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    body, _, code = done.stdout.rpartition("\n")
    return int(code or 0), body


def test_rules_through_the_proxy_with_curl(
    make_proxy, plain_host: FakeServer, provider: FakeServer, tmp_path: Path
) -> None:
    plain_host.clear()
    proxy = make_proxy(allow=["plain.test"], extra=RULES_TOML)
    base = f"http://plain.test:{plain_host.port}"
    assert _curl(proxy, f"{base}/docs/readme")[0] == 200
    code, body = _curl(proxy, "-X", "DELETE", f"{base}/docs/readme")
    assert code == 403
    refusal = json.loads(body)
    assert refusal["rule"] == RULE_METHOD and "GET, HEAD, OPTIONS on /docs/**" in refusal["message"]
    code, body = _curl(proxy, "--path-as-is", f"{base}/docs/%2e%2e/secret")
    assert code == 403 and json.loads(body)["rule"] == RULE_NOT_CANONICAL
    assert _curl(proxy, f"{base}/secret")[0] == 403
    # The reverse route to the provider: only POST /v1/messages.
    reverse = f"http://127.0.0.1:{proxy.port}/anthropic"
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}", f"{reverse}/v1/models"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.stdout.rsplit("\n", 1)[1] == "403", done.stdout
    # CONNECT to a host with rules is refused; curl reports the proxy's 403.
    tunnel = subprocess.run(
        ["curl", "-sS", "--max-time", "10", "-p", "-x", proxy.url, f"{base}/docs/readme"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert tunnel.returncode != 0 and "403" in tunnel.stderr, tunnel.stderr
    seen = [f"{r.method} {r.path}" for r in plain_host.received]
    assert seen == ["GET /docs/readme"], seen  # nothing refused reached the host
    denied = [e for e in proxy.events() if isinstance(e, RequestDenied)]
    assert sorted(e.rule for e in denied) == sorted(
        [RULE_METHOD, RULE_NOT_CANONICAL, RULE_PATH, RULE_PATH, RULE_REQUIRES_TERMINATION]
    )


def _regex_oracle(pattern: str) -> re.Pattern[bytes]:
    """The patterns' meaning written as a regex (what the matcher once was): `*` is `[^/]+`,
    a `**` segment `(?:/[^/]+)*`, or `(?:/.*)?` when it is the last. Fine on short input."""
    parts = []
    segments = pattern.split("/")[1:]
    for index, segment in enumerate(segments):
        if segment == "**":
            parts.append("(?:/.*)?" if index == len(segments) - 1 else "(?:/[^/]+)*")
        else:
            parts.append("/" + "[^/]+".join(re.escape(p) for p in segment.split("*")))
    return re.compile("".join(parts).encode())


SEGMENT_PIECES = st.sampled_from(["a", "b", "ab", "-", "*", "x"])
PATTERN_SEGMENTS = st.one_of(
    st.just("**"), st.lists(SEGMENT_PIECES, min_size=1, max_size=4).map("".join)
).filter(lambda s: "**" not in s or s == "**")


@settings(max_examples=1500, deadline=None)
@given(
    st.lists(PATTERN_SEGMENTS, min_size=1, max_size=4),
    st.lists(st.sampled_from(["a", "b", "ab", "a-b", "x", "-", "ba-x"]), max_size=5),
    st.booleans(),
)
def test_the_matcher_means_what_the_regex_says(
    pattern_segments: list[str], path_segments: list[str], trailing_slash: bool
) -> None:
    pattern = "/" + "/".join(pattern_segments)
    path = ("/" + "/".join(path_segments) + ("/" if trailing_slash else "")).encode()
    if b"//" in path:
        return  # not canonical: refused before any pattern is tried
    expected = _regex_oracle(pattern).fullmatch(path) is not None
    assert compile_pattern(pattern).fullmatch(path) == expected, (pattern, path)


@pytest.mark.parametrize("pattern", ["/*-*-*-*-x", "/**/**/**/x", "/a/**/*-*-*/**/b"])
def test_patterns_cannot_hold_the_worker_on_a_long_path(pattern: str) -> None:
    """A regex took seconds on these (backtracking): the matcher is linear per segment."""
    rules = L7Rules([HostRule.make(HOST, paths=[pattern])])
    for path in (b"/" + b"-" * 16000, b"/a" * 5000 + b"/y"):
        started = time.perf_counter()
        assert rules.check(HOST, b"GET", path) is not None
        assert time.perf_counter() - started < 0.5
