"""The name policy: modes, host normalization, the exact-match allowlist, the egress decision."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxycore.errors import PolicyDenied
from proxycore.protocol.policy import (
    DEFAULT_ALLOWED_HOSTS,
    Allowlist,
    EgressDecision,
    NetworkMode,
    decide_egress,
    is_ip_literal,
    looks_like_ip_shorthand,
    normalize_host,
    parse_authority,
    parse_mode,
)

RESTRICTED = NetworkMode.RESTRICTED


@pytest.fixture
def allowlist() -> Allowlist:
    return Allowlist(DEFAULT_ALLOWED_HOSTS)


# --- modes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        (None, NetworkMode.RESTRICTED),
        ("", NetworkMode.RESTRICTED),
        ("none", NetworkMode.NONE),
        ("restricted", NetworkMode.RESTRICTED),
        ("free", NetworkMode.FREE),
    ],
)
def test_parse_mode_known(value: str | None, mode: NetworkMode) -> None:
    assert parse_mode(value) == (mode, None)


@pytest.mark.parametrize("value", ["Free", "FREE", " free", "free ", "open", "all", "none\n", "x"])
def test_parse_mode_unknown_fails_closed(value: str) -> None:
    # Matching is exact: anything else is RESTRICTED, never FREE, plus a warning naming it.
    mode, warning = parse_mode(value)
    assert mode is NetworkMode.RESTRICTED
    assert warning is not None
    assert "restricted" in warning
    assert value.strip() in warning


def test_parse_mode_warning_is_single_line() -> None:
    _, warning = parse_mode("free\r\nX-Injected: 1")
    assert warning is not None
    assert "\n" not in warning and "\r" not in warning


def test_default_allowed_hosts_match_the_design() -> None:
    assert {
        "api.anthropic.com",
        "console.anthropic.com",
        "api.openai.com",
        "auth.openai.com",
        "chatgpt.com",
        "generativelanguage.googleapis.com",
        "oauth2.googleapis.com",
        "accounts.google.com",
        "api.cursor.sh",
        "api2.cursor.sh",
        "api.factory.ai",
        "app.factory.ai",
    } == set(DEFAULT_ALLOWED_HOSTS)
    assert len(set(DEFAULT_ALLOWED_HOSTS)) == len(DEFAULT_ALLOWED_HOSTS)  # no host twice
    assert all(normalize_host(host) == host for host in DEFAULT_ALLOWED_HOSTS)


# --- normalize_host ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("api.anthropic.com", "api.anthropic.com"),
        # Lowercasing is part of exact matching (DNS names are case-insensitive, RFC 4343).
        ("API.ANTHROPIC.COM", "api.anthropic.com"),
        ("Api.Anthropic.Com", "api.anthropic.com"),
        ("api.anthropic.com:443", "api.anthropic.com"),
        ("api.anthropic.com:65535", "api.anthropic.com"),
        ("api.anthropic.com:1", "api.anthropic.com"),
        ("[::1]", "::1"),
        ("[::1]:443", "::1"),
        ("::1", "::1"),
        ("[0:0:0:0:0:0:0:1]", "::1"),
        ("[2001:DB8::0:1]:8443", "2001:db8::1"),
        # Python 3.13 renders IPv4-mapped text differently (gh-87799); ask this Python.
        ("[::ffff:127.0.0.1]", ipaddress.IPv6Address("::ffff:7f00:1").compressed),
        ("127.0.0.1", "127.0.0.1"),
        ("10.1.2.3:80", "10.1.2.3"),
        ("xn--80ak6aa92e.com", "xn--80ak6aa92e.com"),
        ("1password.com", "1password.com"),
        ("localhost", "localhost"),
        ("a" * 63 + ".com", "a" * 63 + ".com"),
        # Shorthand IPv4 stays a name here; looks_like_ip_shorthand and decide_egress refuse it.
        ("2130706433", "2130706433"),
        ("127.1", "127.1"),
        ("0x7f.1", "0x7f.1"),
        ("0177.0.0.1", "0177.0.0.1"),
    ],
)
def test_normalize_host_accepts(raw: str, expected: str) -> None:
    assert normalize_host(raw) == expected


MALFORMED = [
    "",
    "api.anthropic.com.",
    ".api.anthropic.com",
    "api..anthropic.com",
    "evil.com@api.anthropic.com",
    "user:pass@api.anthropic.com",
    " api.anthropic.com",
    "api.anthropic.com ",
    "api.anthropic.com\t",
    "api.anthropic.com\n",
    "api.anthropic.com\r\nHost: evil.com",
    "api.anthropic.com\x00",
    "api.anthropic.com%00",
    "api%2eanthropic.com",
    "api.anthropic.com:0",
    "api.anthropic.com:00443",
    "api.anthropic.com:0443",
    "api.anthropic.com:99999",
    "api.anthropic.com:65536",
    "api.anthropic.com:",
    "api.anthropic.com:+443",
    "api.anthropic.com:-1",
    "api.anthropic.com: 443",
    "api.anthropic.com:4_43",
    "api.anthropic.com:\u0664\u0664\u0663",  # Arabic-Indic digits: int() would accept them.
    "api.anthropic.com:443:443",
    "api.anthropic.com:http",
    "\u0430pi.anthropic.com",  # Cyrillic a
    "api.anthropic.\u0441om",  # Cyrillic es
    "api.anthropic.com\u3002",  # ideographic full stop
    "\uff41pi.anthropic.com",  # fullwidth a: NFKC would fold it to "a"
    "b\u00fccher.de",
    "api.anthropic.com\\",
    "api.anthropic.com\\@evil.com",
    "evil.com\\api.anthropic.com",
    "api.anthropic.com/",
    "api.anthropic.com/path",
    "api.anthropic.com?x",
    "api.anthropic.com#x",
    "api_anthropic.com",
    "-api.anthropic.com",
    "api-.anthropic.com",
    "a" * 64 + ".com",
    ".".join(["a" * 63] * 4),  # 255 characters
    "[::1",
    "::1]",
    "[::1]x",
    "[::1]:",
    "[::1]:0",
    "[::1]:99999",
    "[fe80::1%eth0]",
    "[fe80::1%25eth0]",
    "fe80::1%eth0",
    "[v1.fe]",
    "[127.0.0.1]",
    "[api.anthropic.com]",
    "[::1]]",
    "[[::1]]",
    ":::",
    "1:2:3:4:5:6:7:8:9",
    ":443",
    "*.anthropic.com",
    "api.anthropic.com;evil.com",
    "api.anthropic.com,evil.com",
    "api anthropic.com",
]


@pytest.mark.parametrize("raw", MALFORMED)
def test_normalize_host_refuses(raw: str) -> None:
    with pytest.raises(PolicyDenied) as info:
        normalize_host(raw)
    assert info.value.rule == "malformed_host"
    assert info.value.status_hint == 403
    # The refused input is echoed to the agent: it must be one printable ASCII line.
    assert info.value.host.isascii() and info.value.host.isprintable()


def test_normalize_host_refuses_non_strings() -> None:
    with pytest.raises(PolicyDenied):
        normalize_host(b"api.anthropic.com")  # type: ignore[arg-type]


def test_normalize_host_bounds_long_input() -> None:
    with pytest.raises(PolicyDenied) as info:
        normalize_host("a" * 1_000_000)
    assert len(str(info.value)) < 400


def test_name_of_exactly_253_characters() -> None:
    name = ".".join(["a" * 63] * 3 + ["a" * 61])
    assert len(name) == 253
    assert normalize_host(name) == name
    assert normalize_host(name + ":443") == name


def test_bare_ipv6_is_never_split_into_host_and_port() -> None:
    # "::1:443" is itself a valid address; a port needs brackets.
    assert normalize_host("::1:443") == "::1:443"
    assert normalize_host("[::1]:443") == "::1"


# --- parse_authority ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "default_port", "expected"),
    [
        (b"api.anthropic.com:443", -1, ("api.anthropic.com", 443)),
        ("api.anthropic.com:443", -1, ("api.anthropic.com", 443)),
        (b"API.Anthropic.com:8443", -1, ("api.anthropic.com", 8443)),
        (b"[::1]:443", -1, ("::1", 443)),
        (b"[2001:db8::1]", 443, ("2001:db8::1", 443)),
        (b"api.anthropic.com", 80, ("api.anthropic.com", 80)),
        (bytearray(b"api.anthropic.com"), 80, ("api.anthropic.com", 80)),
        (b"10.0.0.1:22", -1, ("10.0.0.1", 22)),
    ],
)
def test_parse_authority_accepts(
    raw: bytes | str, default_port: int, expected: tuple[str, int]
) -> None:
    assert parse_authority(raw, default_port) == expected


@pytest.mark.parametrize(
    ("raw", "default_port"),
    [
        (b"api.anthropic.com", -1),  # CONNECT needs a port (RFC 9110 §9.3.6)
        (b"[::1]", -1),
        (b"api.anthropic.com:", -1),
        (b"api.anthropic.com:", 443),
        (b"::1", 443),  # an IPv6 literal must be bracketed in an authority
        (b"::1:443", -1),
        (b"\xd0\xb0pi.anthropic.com:443", -1),
        (b"api.anthropic.com:443\r\n", -1),
        (b"evil.com@api.anthropic.com:443", -1),
        (b"api.anthropic.com.:443", -1),
        (b"", 443),
        (b":443", -1),
    ],
)
def test_parse_authority_refuses(raw: bytes, default_port: int) -> None:
    with pytest.raises(PolicyDenied) as info:
        parse_authority(raw, default_port)
    assert info.value.rule == "malformed_host"
    assert info.value.host.isascii() and info.value.host.isprintable()


@pytest.mark.parametrize("default_port", [0, -2, 65536, True])
def test_parse_authority_bad_default_port_is_a_caller_bug(default_port: int) -> None:
    with pytest.raises(ValueError, match="default_port"):
        parse_authority(b"a.com:1", default_port)


# --- IP literals and shorthand -----------------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["0x7f.1", "2130706433", "0177.0.0.1", "127.1", "0x7f000001", "017700000001"]
)
def test_ip_shorthand_detected(host: str) -> None:
    assert looks_like_ip_shorthand(host)
    assert not is_ip_literal(host)


@pytest.mark.parametrize(
    "host",
    [
        "127.000.0.1",
        "127.0.0.01",
        "0x7f.0x0.0x0.0x1",
        "0X7F.1",
        "1.2.3.4.5",
        "256.1.1.1",
        "0",
        "0x",
        "127.1.",
        "evil.com.127",
        "evil.com.0x7f",
    ],
)
def test_ip_shorthand_detected_more_forms(host: str) -> None:
    assert looks_like_ip_shorthand(host)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "8.8.8.8",
        "api.anthropic.com",
        "1password.com",
        "123.example",
        "0x7f.example",
        "::1",
        "2001:db8::1",
        "",
        "\u0661\u0662\u0667.1",  # non-ASCII digits are malformed elsewhere, not shorthand
    ],
)
def test_not_ip_shorthand(host: str) -> None:
    assert not looks_like_ip_shorthand(host)


@pytest.mark.parametrize("host", ["127.0.0.1", "8.8.8.8", "::1", "2001:db8::1", "::ffff:7f00:1"])
def test_is_ip_literal(host: str) -> None:
    assert is_ip_literal(host)


@pytest.mark.parametrize(
    "host", ["[::1]", "127.1", "api.anthropic.com", "fe80::1%eth0", "01.2.3.4", "", "1.2.3.4 "]
)
def test_is_not_ip_literal(host: str) -> None:
    assert not is_ip_literal(host)


# --- Allowlist ---------------------------------------------------------------------------------


def test_allowlist_is_exact_match(allowlist: Allowlist) -> None:
    assert "api.anthropic.com" in allowlist
    assert "anthropic.com" not in allowlist
    assert "x.api.anthropic.com" not in allowlist
    assert "api.anthropic.com.evil.com" not in allowlist
    assert "pi.anthropic.com" not in allowlist
    assert "api.anthropic.co" not in allowlist
    # __contains__ takes normalized hosts: it does not normalize for the caller.
    assert "API.ANTHROPIC.COM" not in allowlist
    assert "api.anthropic.com:443" not in allowlist
    assert 1 not in allowlist


def test_allowlist_normalizes_entries() -> None:
    allowlist = Allowlist(["GitHub.com", "registry.npmjs.org:443", "[2001:DB8::1]", "10.0.0.5"])
    assert list(allowlist) == ["10.0.0.5", "2001:db8::1", "github.com", "registry.npmjs.org"]
    assert len(allowlist) == 4


@pytest.mark.parametrize(
    "entry", ["github.com.", " github.com", "*.github.com", "git\u0068ub.com\u200b", "2130706433"]
)
def test_allowlist_refuses_bad_entries(entry: str) -> None:
    with pytest.raises(ValueError, match="allowlist entry") as info:
        Allowlist(["api.anthropic.com", entry])
    assert repr(entry) in str(info.value)


def test_allowlist_refuses_a_lone_string() -> None:
    with pytest.raises(TypeError):
        Allowlist("github.com")


def test_allowlist_add_at_run_time(allowlist: Allowlist) -> None:
    before = len(allowlist)
    assert allowlist.add("GitHub.com") is True
    assert allowlist.add("github.com") is False
    assert "github.com" in allowlist
    assert len(allowlist) == before + 1
    with pytest.raises(ValueError, match=r"0x7f\.1"):
        allowlist.add("0x7f.1")
    with pytest.raises(ValueError):
        allowlist.add("evil.com@github.com")
    assert len(allowlist) == before + 1


def test_allowlist_iteration_is_a_snapshot(allowlist: Allowlist) -> None:
    for host in allowlist:
        allowlist.add("z" + host)
    assert len(allowlist) == 2 * len(DEFAULT_ALLOWED_HOSTS)


# --- decide_egress -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "rule"),
    [
        ("api.anthropic.com.", "malformed_host"),
        ("anthropic.com", "not_in_allowlist"),
        ("x.api.anthropic.com", "not_in_allowlist"),
        ("evil.com@api.anthropic.com", "malformed_host"),
        ("api.anthropic.com.evil.com", "not_in_allowlist"),
        (" api.anthropic.com", "malformed_host"),
        ("api.anthropic.com ", "malformed_host"),
        ("api.anthropic.com\t", "malformed_host"),
        ("[::1]", "not_in_allowlist"),
        ("::1", "not_in_allowlist"),
        ("127.0.0.1", "not_in_allowlist"),
        ("api.anthropic.com:0", "malformed_host"),
        ("api.anthropic.com:99999", "malformed_host"),
        ("api.anthropic.com:", "malformed_host"),
        ("api..anthropic.com", "malformed_host"),
        ("\u0430pi.anthropic.com", "malformed_host"),
        ("api.anthropic.com%00", "malformed_host"),
        ("api.anthropic.com\\", "malformed_host"),
        ("api.anthropic.com\\@evil.com", "malformed_host"),
        ("evil.com\\api.anthropic.com", "malformed_host"),
        ("api.anthropic.com:8443", "malformed_host"),  # embedded port != dialled port
        ("2130706433", "ip_shorthand"),
        ("0x7f.1", "ip_shorthand"),
    ],
)
def test_restricted_refuses(allowlist: Allowlist, raw: str, rule: str) -> None:
    decision = decide_egress(RESTRICTED, allowlist, raw, 443)
    assert decision.allowed is False
    assert decision.rule == rule
    assert decision.mode is RESTRICTED
    assert decision.host.isascii() and decision.host.isprintable()


@pytest.mark.parametrize(
    "raw", ["api.anthropic.com", "API.ANTHROPIC.COM", "api.anthropic.com:443", "Chatgpt.com"]
)
def test_restricted_allows_members(allowlist: Allowlist, raw: str) -> None:
    decision = decide_egress(RESTRICTED, allowlist, raw, 443)
    assert decision == EgressDecision(
        True, raw.lower().partition(":")[0], 443, "allowlisted", RESTRICTED
    )


def test_ip_literal_needs_exact_allowlist_entry() -> None:
    allowlist = Allowlist(["10.0.0.5", "2001:db8::1"])
    assert decide_egress(RESTRICTED, allowlist, "10.0.0.5", 80).allowed
    assert decide_egress(RESTRICTED, allowlist, "[2001:db8:0::1]:80", 80).allowed
    assert not decide_egress(RESTRICTED, allowlist, "10.0.0.6", 80).allowed
    assert not decide_egress(RESTRICTED, allowlist, "10.0.5", 80).allowed
    assert decide_egress(RESTRICTED, allowlist, "10.0.5", 80).rule == "ip_shorthand"


def test_mode_none_refuses_everything(allowlist: Allowlist) -> None:
    decision = decide_egress(NetworkMode.NONE, allowlist, "api.anthropic.com", 443)
    assert (decision.allowed, decision.rule) == (False, "mode_none")


def test_mode_free_allows_any_well_formed_name(allowlist: Allowlist) -> None:
    decision = decide_egress(NetworkMode.FREE, allowlist, "Example.ORG", 443)
    assert decision == EgressDecision(True, "example.org", 443, "mode_free", NetworkMode.FREE)


@pytest.mark.parametrize("mode", list(NetworkMode))
def test_shorthand_and_malformed_refused_in_every_mode(
    allowlist: Allowlist, mode: NetworkMode
) -> None:
    assert decide_egress(mode, allowlist, "0x7f.1", 443).rule == "ip_shorthand"
    assert decide_egress(mode, allowlist, "017700000001", 443).rule == "ip_shorthand"
    assert decide_egress(mode, allowlist, "a.com.", 443).rule == "malformed_host"


@pytest.mark.parametrize("port", [0, -1, 65536, True])
def test_bad_port_is_malformed(allowlist: Allowlist, port: int) -> None:
    decision = decide_egress(NetworkMode.FREE, allowlist, "api.anthropic.com", port)
    assert (decision.allowed, decision.rule) == (False, "malformed_host")


def test_decision_never_raises_on_non_strings(allowlist: Allowlist) -> None:
    decision = decide_egress(RESTRICTED, allowlist, None, 443)  # type: ignore[arg-type]
    assert (decision.allowed, decision.rule) == (False, "malformed_host")


def test_raise_if_denied(allowlist: Allowlist) -> None:
    decide_egress(RESTRICTED, allowlist, "api.anthropic.com", 443).raise_if_denied()
    with pytest.raises(PolicyDenied) as info:
        decide_egress(RESTRICTED, allowlist, "evil.com", 443).raise_if_denied()
    assert (info.value.host, info.value.rule, info.value.status_hint) == (
        "evil.com",
        "not_in_allowlist",
        403,
    )
    assert "allowlist" in str(info.value)


def test_decision_is_frozen(allowlist: Allowlist) -> None:
    decision = decide_egress(RESTRICTED, allowlist, "api.anthropic.com", 443)
    with pytest.raises(AttributeError):
        decision.allowed = False  # type: ignore[misc]


# --- properties --------------------------------------------------------------------------------

_LABEL = st.from_regex(r"[a-zA-Z0-9]([a-zA-Z0-9-]{0,8}[a-zA-Z0-9])?", fullmatch=True)
_NAMES = st.lists(_LABEL, min_size=1, max_size=5).map(".".join)
_HOSTISH = st.one_of(
    _NAMES,
    _NAMES.map(lambda name: name + ":443"),
    st.ip_addresses().map(str),
    st.ip_addresses(v=6).map(lambda a: f"[{a}]:8443"),
    st.text(alphabet="aA0.-:[]@%\\ \t\u0430x", max_size=30),
    st.text(max_size=30),
    st.sampled_from(sorted(DEFAULT_ALLOWED_HOSTS))
    .map(lambda host: st.sampled_from([host, host.upper(), host + ".", "x." + host, host + ":443"]))
    .flatmap(lambda s: s),
)


@given(_HOSTISH)
def test_normalize_host_is_idempotent(raw: str) -> None:
    try:
        host = normalize_host(raw)
    except PolicyDenied:
        return
    assert normalize_host(host) == host
    assert normalize_host(host.upper()) == host


@given(_HOSTISH, st.sampled_from(list(NetworkMode)))
def test_restricted_allowed_implies_exact_membership(raw: str, mode: NetworkMode) -> None:
    allowlist = Allowlist([*DEFAULT_ALLOWED_HOSTS, "10.0.0.5", "::1"])
    decision = decide_egress(mode, allowlist, raw, 443)
    if decision.allowed:
        assert mode is not NetworkMode.NONE
        assert decision.host == normalize_host(raw)
        if mode is RESTRICTED:
            assert decision.host in set(allowlist)
            assert decision.host.encode() in {host.encode() for host in allowlist}


@given(_NAMES)
def test_every_valid_name_round_trips_lowercased(name: str) -> None:
    assert normalize_host(name) == name.lower()
    assert parse_authority(f"{name}:443".encode(), -1) == (name.lower(), 443)
