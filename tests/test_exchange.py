"""The sans-IO exchange (proxycore/protocol/exchange.py, responses.py): every decision from bytes,
no socket. Each plan carries the request's identity, and every refusal its terminal event."""

from __future__ import annotations

import pytest

from native.scrub import Scrubber
from native.scrub_patterns import DEFAULT_SHAPES
from proxycore.protocol import http1
from proxycore.protocol.credentials import Credential, Provider, Routes, route_for
from proxycore.protocol.events import KeeperCallRefused, RequestDenied, RequestRefused
from proxycore.protocol.exchange import (
    DRAIN_LIMIT,
    check_keeper_call,
    close_after_refusal,
    keeper_refused_event,
    plan_request,
)
from proxycore.protocol.keeper import Action
from proxycore.protocol.plans import Forward, OpenTunnel, Refuse, ServeKeeper, ServeLocal
from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode
from proxycore.protocol.responses import BodyMode, ResponsePlan, plan_response

KEY = "sk-ant-api03-EXCHANGE-test-key-0123456789abcdef"
STORE_KEY = "sk-ant-api03-STORE-crew-key-9876543210fedcba"


def head(data: bytes) -> http1.RequestHead:
    parsed = http1.parse_request_head(data)
    assert parsed is not None
    return parsed[0]


def routes(store: dict[str, dict[Provider, Credential]] | None = None) -> Routes:
    anthropic = route_for("https://api.anthropic.com", Provider.ANTHROPIC, Credential(KEY))
    openai = route_for("https://api.openai.com/v1", Provider.OPENAI, None)
    return Routes(
        {b"anthropic": anthropic, b"openai": openai},
        {anthropic.host: anthropic, openai.host: openai},
        store or {},
    )


def crew(mode: NetworkMode = NetworkMode.RESTRICTED, *allow: str) -> CrewPolicy:
    return CrewPolicy("alpha", mode, Allowlist(["api.anthropic.com", "api.openai.com", *allow]))


def plan(data: bytes, *, policy: CrewPolicy | None = None, audit: bool = False, **kw: object):
    return plan_request(
        head(data),
        policy or crew(NetworkMode.RESTRICTED, "allowed.test"),
        kw.get("routes", routes()),  # type: ignore[arg-type]
        audit_blocked=audit,
        max_body=1000,
    )


def test_forward_to_an_allowed_host_keeps_the_agents_fields_minus_hop_by_hop() -> None:
    got = plan(
        b"GET http://allowed.test:8080/p?q=1#frag HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n"
        b"Connection: keep-alive\r\nProxy-Authorization: Basic eA==\r\n\r\n"
    )
    assert isinstance(got, Forward)
    assert (got.host, got.port, got.tls, got.provider) == ("allowed.test", 8080, False, None)
    assert got.request.route == "forward" and got.request.crew == "alpha"
    sent = got.upstream_head(None)
    assert sent.startswith(b"GET /p?q=1 HTTP/1.1\r\nhost: allowed.test:8080\r\n")
    assert b"X-A: 1" in sent and b"frag" not in sent
    assert b"roxy-" not in sent and b"onnection" not in sent
    assert sent.endswith(b"accept-encoding: identity\r\n\r\n")


def test_a_provider_host_goes_over_tls_with_the_key_injected_and_the_agents_removed() -> None:
    got = plan(
        b"POST http://api.anthropic.com/v1/messages HTTP/1.1\r\nHost: x\r\n"
        b"x-api-key: sk-agent-own\r\nAuthorization: Bearer stolen\r\nContent-Length: 2\r\n\r\n"
    )
    assert isinstance(got, Forward)
    assert got.tls and got.port == 443 and got.provider is Provider.ANTHROPIC
    sent = got.upstream_head(2)
    assert f"x-api-key: {KEY}".encode() in sent
    assert b"sk-agent-own" not in sent and b"stolen" not in sent
    assert sent.endswith(b"content-length: 2\r\n\r\n")


def test_the_crews_store_credential_wins_over_the_configured_one() -> None:
    store = {"alpha": {Provider.ANTHROPIC: Credential(STORE_KEY)}}
    got = plan(b"POST /anthropic/v1/messages HTTP/1.1\r\nHost: x\r\n\r\n", routes=routes(store))
    assert isinstance(got, Forward) and got.request.route == "reverse"
    sent = got.upstream_head(None)
    assert STORE_KEY.encode() in sent and KEY.encode() not in sent
    # A POST without a body still says so: RFC 9110 8.6.
    assert sent.endswith(b"content-length: 0\r\n\r\n")


def test_a_lookalike_of_a_provider_host_gets_no_credential() -> None:
    """Provider hosts match exactly: a suffix, a prefix or a subdomain is another host."""
    for host in (b"api.anthropic.com.evil.test", b"evilapi.anthropic.com", b"x.api.anthropic.com"):
        policy = crew(NetworkMode.FREE)
        got = plan(b"GET http://" + host + b"/ HTTP/1.1\r\nHost: x\r\n\r\n", policy=policy)
        assert isinstance(got, Forward), host
        assert got.provider is None and not got.tls, host
        assert KEY.encode() not in got.upstream_head(None), host


def test_refusals_carry_their_terminal_event() -> None:
    denied = plan(b"GET http://other.test/ HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(denied, Refuse) and denied.status == 403
    assert isinstance(denied.event, RequestDenied)
    assert denied.event.rule == "not_in_allowlist" and denied.event.host == "other.test"
    paused = plan(b"GET http://allowed.test/ HTTP/1.1\r\nHost: x\r\n\r\n", audit=True)
    assert isinstance(paused, Refuse) and paused.status == 503
    assert isinstance(paused.event, RequestRefused) and paused.event.rule == "audit_unavailable"
    big = plan(b"POST http://allowed.test/ HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n")
    assert isinstance(big, Refuse) and big.status == 413 and big.close
    assert isinstance(big.event, RequestRefused) and big.event.rule == "body_too_large"
    https = plan(b"GET https://allowed.test/ HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(https, Refuse) and https.status == 400
    missing = plan(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(missing, Refuse) and missing.status == 404


@pytest.mark.parametrize(
    "authority",
    [
        b"allowed.test.:443",
        b"evil.test@allowed.test:443",
        b"[fe80::1%25eth0]:443",
        b"allowed.test",
        b"allowed.test:0",
        b"allowed.test:99999",
        b"allowed.test:0443",
        b"127.1:443",
        b"%61llowed.test:443",
        b"[::1:443",
        b":443",
    ],
)
def test_odd_connect_authorities_are_refused_readably(authority: bytes) -> None:
    got = plan(b"CONNECT " + authority + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(got, Refuse) and got.status == 403 and got.close
    assert got.event.rule in {"malformed_host", "ip_shorthand"}
    body = got.response()
    assert body.startswith(b"HTTP/1.1 403 Forbidden\r\n") and b'"egress_denied"' in body


def test_connect_with_an_absolute_uri_is_no_forward_request() -> None:
    got = plan(b"CONNECT http://allowed.test:80/ HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(got, Refuse) and got.status == 403 and got.close
    assert got.event.route == "tunnel" and got.event.rule == "malformed_host"


def test_connect_to_an_allowed_host_opens_a_tunnel() -> None:
    got = plan(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
    assert isinstance(got, OpenTunnel) and (got.host, got.port) == ("allowed.test", 443)
    with_body = plan(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n")
    assert isinstance(with_body, Refuse) and with_body.status == 400


def test_local_api_and_keeper_routes() -> None:
    health = plan(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(health, ServeLocal) and b'"crew":"alpha"' in health.response
    keeper = plan(b"POST /keeper/request HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
    assert isinstance(keeper, ServeKeeper) and keeper.action is Action.REQUEST
    get = plan(b"GET /keeper/execute HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(get, Refuse) and get.status == 405
    huge = plan(b"POST /keeper/request HTTP/1.1\r\nHost: x\r\nContent-Length: 99999\r\n\r\n")
    assert isinstance(huge, Refuse) and huge.status == 413


def test_a_refusal_keeps_the_connection_only_when_the_body_can_be_drained() -> None:
    small = head(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
    large = head(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (DRAIN_LIMIT + 1))
    chunked = head(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    expect = head(
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nExpect: 100-continue\r\n\r\n"
    )
    closing = head(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert not close_after_refusal(small)
    assert close_after_refusal(large) and close_after_refusal(chunked)
    assert close_after_refusal(expect) and close_after_refusal(closing)


def test_upstream_head_framing() -> None:
    got = plan(
        b"PUT http://allowed.test/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    assert isinstance(got, Forward)
    assert got.upstream_head(None, chunked=True).endswith(b"transfer-encoding: chunked\r\n\r\n")
    assert got.upstream_head(5).count(b"content-length") == 1
    # The agent's own framing never travels: the proxy frames what it sends itself.
    assert b"Transfer-Encoding" not in got.upstream_head(5)


def test_deep_json_is_refused_at_its_first_bracket() -> None:
    """The keeper's body is read against a flat schema: a nested value is refused where it
    starts, so no decoder recurses into 1 KiB (or 10 KiB) of brackets."""
    request = plan(b"POST /keeper/request HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
    assert isinstance(request, ServeKeeper)
    for deep in (
        b"[" * 5000 + b"]" * 5000,
        b'{"intent": ' + b"[" * 6000 + b"]" * 6000 + b"}",
        b'{"intent": "x", "credential": "c", "k": ' + b"{" * 4000 + b"}" * 4000 + b"}",
        b'{"a":' * 2500 + b"1" + b"}" * 2500,
    ):
        refused = check_keeper_call(request.request, Action.REQUEST, deep, close=False)
        assert refused is not None and refused.status == 400, deep[:40]
        assert refused.event.rule == "bad_body", refused
        event = keeper_refused_event(request.request, Action.REQUEST, deep, "bad_body")
        assert isinstance(event, KeeperCallRefused) and event.credential == ""
    ok = check_keeper_call(
        request.request, Action.REQUEST, b'{"intent":"read the repository","credential":"gh"}',
        close=False,
    )  # fmt: skip
    assert ok is None
    named = keeper_refused_event(request.request, Action.REQUEST, b'{"credential":"gh"}', "x")
    assert named.credential == "gh"
    flat = check_keeper_call(request.request, Action.REQUEST, b"[1]", close=False)
    assert flat is not None and flat.event.rule == "bad_body"


def response(data: bytes, method: bytes = b"GET") -> http1.ResponseHead:
    parsed = http1.parse_response_head(data, request_method=method)
    assert parsed is not None
    return parsed[0]


def forward_plan() -> tuple[Forward, http1.RequestHead]:
    request = head(b"GET http://allowed.test/ HTTP/1.1\r\nHost: x\r\n\r\n")
    got = plan_request(
        request,
        crew(NetworkMode.RESTRICTED, "allowed.test"),
        routes(),
        audit_blocked=False,
        max_body=1000,
    )
    assert isinstance(got, Forward)
    return got, request


def test_reason_phrase_and_field_names_are_scrubbed() -> None:
    scrubber = Scrubber([("anthropic", KEY.encode())], DEFAULT_SHAPES)
    forward, request = forward_plan()
    upstream = response(
        b"HTTP/1.1 200 OK " + KEY.encode() + b"\r\nx-" + KEY.encode() + b": v\r\n"
        b"x-echo: " + KEY.encode() + b"\r\nX-Fine: 1\r\ncontent-length: 3\r\n\r\n"
    )
    got = plan_response(forward, request, upstream, scrubber)
    assert isinstance(got, ResponsePlan) and got.mode is BodyMode.WHOLE
    out = bytes(got.head(3))
    assert KEY.encode() not in out
    assert out.startswith(b"HTTP/1.1 200 OK [REDACTED:anthropic]\r\n")
    assert b"x-echo: [REDACTED:anthropic]" in out and b"X-Fine: 1" in out
    assert b"x-[REDACTED" not in out  # the field with a secret for a name is dropped
    assert out.endswith(b"content-length: 3\r\n\r\n")
    # The general path (a Connection field nominating another one) does the same.
    nominating = response(
        b"HTTP/1.1 200 " + KEY.encode() + b"\r\nConnection: x-drop\r\nx-drop: 1\r\nx-"
        + KEY.encode() + b": v\r\ncontent-length: 0\r\n\r\n"
    )  # fmt: skip
    general = plan_response(forward, request, nominating, scrubber)
    assert isinstance(general, ResponsePlan)
    out = bytes(general.head(0))
    assert KEY.encode() not in out and b"x-drop" not in out and b"x-[REDACTED" not in out


def test_response_modes_and_encodings() -> None:
    scrubber = Scrubber([], DEFAULT_SHAPES)
    forward, request = forward_plan()
    streamed = plan_response(
        forward,
        request,
        response(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"),
        scrubber,
    )
    assert isinstance(streamed, ResponsePlan) and streamed.mode is BodyMode.STREAM
    assert streamed.rechunk and b"transfer-encoding: chunked" in streamed.head()
    no_room = plan_response(
        forward, request, response(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n"), scrubber,
        whole_limit=0,
    )  # fmt: skip
    assert isinstance(no_room, ResponsePlan) and no_room.mode is BodyMode.STREAM
    # A compressed body is decoded around the scrubber, so it streams (its length changes).
    gzip = plan_response(
        forward,
        request,
        response(b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: 9\r\n\r\n"),
        scrubber,
    )
    assert isinstance(gzip, ResponsePlan) and gzip.mode is BodyMode.STREAM
    assert gzip.coding == b"gzip" and b"content-encoding: gzip" in gzip.head()
    brotli = plan_response(
        forward,
        request,
        response(b"HTTP/1.1 200 OK\r\ncontent-encoding: br\r\ncontent-length: 9\r\n\r\n"),
        scrubber,
    )
    assert isinstance(brotli, ResponsePlan) and brotli.coding == b"br"
    for coding in (b"gzip, gzip", b"zstd", b"br, gzip"):
        refused = plan_response(
            forward,
            request,
            response(
                b"HTTP/1.1 200 OK\r\ncontent-encoding: %s\r\ncontent-length: 9\r\n\r\n" % coding
            ),
            scrubber,
        )
        assert isinstance(refused, Refuse) and refused.status == 502
        assert refused.event.rule == "unscrubbable_encoding"
