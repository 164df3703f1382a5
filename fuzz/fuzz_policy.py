"""Fuzz the network policy and the SSRF guard against their invariants.

Run:  python fuzz/fuzz_policy.py -runs=300000 /tmp/corpus_policy
(atheris is imported only here; tests import `TestOneInput` and `SEEDS` without it.)

Invariants, checked on every input:
- normalize_host / parse_authority raise nothing but PolicyDenied (rule "malformed_host"); their
  output is a fixed point of normalize_host, is ASCII [a-z0-9.-] or an IPv6 literal, and
  parse_authority agrees with normalize_host and with itself on bytes and str.
- decide_egress never raises; an allowed decision in RESTRICTED names a host that is
  byte-for-byte a member of the allowlist; NONE never allows; nothing a libc resolver would read
  as a non-canonical IPv4 address (inet_aton, the oracle) is ever allowed in any mode.
- Allowlist and AddressGuard construction raise only ValueError (documented).
- AddressGuard.check never raises, and an allowed verdict is a plain global unicast address by
  the independent reading of `ipaddress`.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxycore.errors import PolicyDenied
from proxycore.protocol.policy import (
    DEFAULT_ALLOWED_HOSTS,
    RULE_ALLOWLISTED,
    RULE_IP_SHORTHAND,
    RULE_MALFORMED_HOST,
    RULE_MODE_FREE,
    RULE_MODE_NONE,
    RULE_NOT_IN_ALLOWLIST,
    Allowlist,
    NetworkMode,
    decide_egress,
    is_ip_literal,
    looks_like_ip_shorthand,
    normalize_host,
    parse_authority,
)
from proxycore.protocol.ssrf import AddressGuard

_ALLOWLIST = Allowlist([*DEFAULT_ALLOWED_HOSTS, "github.com", "10.1.2.3", "::1", "[2001:db8::5]"])
_MEMBERS = frozenset(host.encode("ascii") for host in _ALLOWLIST)
_GUARD = AddressGuard()
_OPERATOR_GUARD = AddressGuard(["127.0.0.0/8", "169.254.0.0/16", "fd00::/8"])
_DENY_RULES = {RULE_MODE_NONE, RULE_NOT_IN_ALLOWLIST, RULE_MALFORMED_HOST, RULE_IP_SHORTHAND}
_PORTS = (443, 80, 8443, 1, 65535, 0, 65536, -1)
_GLOBAL_V6 = ipaddress.IPv6Network("2000::/3")

SEEDS: tuple[bytes, ...] = (
    b"\x00api.anthropic.com",
    b"\x01API.ANTHROPIC.COM:443",
    b"\x02api.anthropic.com.",
    b"\x03evil.com@api.anthropic.com",
    b"\x04[::1]:443",
    b"\x05::1",
    b"\x06[::ffff:127.0.0.1]:80",
    b"\x070x7f.1",
    b"\x082130706433",
    b"\x090177.0.0.1",
    b"\x0a127.1",
    b"\x0b127.0.0.1",
    b"\x0c10.1.2.3:443",
    b"\x0dfe80::1%eth0",
    b"\x0e[fe80::1%25eth0]:443",
    b"\x0f169.254.169.254",
    b"\x10::ffff:7f00:1",
    b"\x1164:ff9b::7f00:1",
    b"\x122001:0:4136:e378:8000:63bf:3fff:fdd2",
    b"\x138.8.8.8",
    b"\x142606:4700:4700::1111",
    b"\x15xn--80ak6aa92e.com",
    b"\x16\xd0\xb0pi.anthropic.com",
    b"\x17api.anthropic.com\\@evil.com",
    b"\x18api.anthropic.com:0443",
    b"\x19127.0.0.0/8,0.0.0.0/0",
    b"\x1a[2001:db8::5]:443",
    b"\x1b0x.0x.0x.0x",
    b"\x1ca-.com",
    b"\x1d" + b"a" * 63 + b".com",
    b"\x1ex.api.anthropic.com",
    b"\x1fanthropic.com",
    b"\x20evilapi.anthropic.com:443",
)


def _require(condition: bool, message: str) -> None:
    # Not `assert`: the invariants must hold under python -O as well.
    if not condition:
        raise AssertionError(message)


def _decode(selector: int, body: bytes) -> str:
    # Two readings of the same bytes: latin-1 reaches every code point below 256 (controls,
    # NBSP, fullwidth-free non-ASCII); utf-8 with surrogateescape reaches homoglyphs and lone
    # surrogates.
    if selector & 1:
        return body.decode("latin-1")
    return body.decode("utf-8", "surrogateescape")


def _check_normalized(host: str, what: str) -> None:
    _require(normalize_host(host) == host, f"{what}: {host!r} is not a fixed point")
    _require(normalize_host(host.upper()) == host, f"{what}: {host!r} is case-sensitive")
    _require(host.isascii() and 0 < len(host) <= 253, f"{what}: {host!r} bad length or non-ASCII")
    if ":" in host:
        _require(is_ip_literal(host), f"{what}: {host!r} has a colon but is not IPv6")
        _require(str(ipaddress.IPv6Address(host)) == host, f"{what}: {host!r} not RFC 5952")
    else:
        _require(
            all(c in "abcdefghijklmnopqrstuvwxyz0123456789.-" for c in host),
            f"{what}: {host!r} has characters outside [a-z0-9.-]",
        )


def _check_normalize(text: str) -> str | None:
    try:
        host = normalize_host(text)
    except PolicyDenied as exc:
        _require(exc.rule == RULE_MALFORMED_HOST, f"unexpected rule {exc.rule!r}")
        _require(exc.host.isascii() and exc.host.isprintable(), f"unsafe host {exc.host!r}")
        return None
    _check_normalized(host, "normalize_host")
    _check_only_lowercased_and_port_stripped(text, host)
    return host


def _check_only_lowercased_and_port_stripped(text: str, host: str) -> None:
    # No implicit trimming: the input is the host (lowercase aside), optionally bracketed if it
    # is IPv6, optionally followed by ":" and the port digits. Nothing else may be dropped.
    lowered = text.lower()
    if ":" in host:
        if lowered.startswith("["):
            literal, _, rest = lowered[1:].partition("]")
        else:
            literal, rest = lowered, ""
        _require(
            ipaddress.IPv6Address(literal) == ipaddress.IPv6Address(host),
            f"{text!r} -> {host!r} changed the address",
        )
    else:
        rest = lowered[len(host) :]
        _require(lowered.startswith(host), f"{text!r} -> {host!r} dropped a prefix")
    _require(
        rest == "" or (rest[0] == ":" and rest[1:].isdigit() and rest[1:].isascii()),
        f"{text!r} -> {host!r} dropped {rest!r}",
    )


def _check_authority(body: bytes, text: str, normalized: str | None) -> None:
    for default_port in (-1, 80):
        results: list[tuple[str, int] | None] = []
        for raw in (body, text):
            try:
                host, port = parse_authority(raw, default_port)
            except PolicyDenied as exc:
                _require(exc.rule == RULE_MALFORMED_HOST, f"unexpected rule {exc.rule!r}")
                results.append(None)
                continue
            _check_normalized(host, "parse_authority")
            _require(1 <= port <= 65535, f"port {port} out of range")
            _require(normalized == host, f"parse_authority {host!r} != normalize_host")
            if default_port == -1:
                _require(f":{port}" in text, f"{text!r}: port {port} not in the authority")
            results.append((host, port))
        if text.isascii():
            # ASCII text decodes the same way from either reading of the bytes.
            _require(results[0] == results[1], f"bytes and str disagree on {text!r}")


def _resolver_reads_as_ipv4(host: str) -> bool:
    # The libc oracle: a pure string parse (no I/O). inet_aton is what getaddrinfo uses for
    # numeric hosts, including the "127.1" / "0x7f.1" / "0177.0.0.1" forms.
    try:
        socket.inet_aton(host)
    except (OSError, ValueError):
        return False
    return True


def _check_decision(text: str, normalized: str | None, port: int) -> None:
    for mode in NetworkMode:
        decision = decide_egress(mode, _ALLOWLIST, text, port)
        _require(decision.mode is mode and decision.port == port, "decision echoes wrong fields")
        if not decision.allowed:
            _require(decision.rule in _DENY_RULES, f"deny rule {decision.rule!r}")
            if decision.rule == RULE_MALFORMED_HOST:
                _require(decision.host.isascii(), f"unsafe host {decision.host!r}")
            continue
        _require(mode is not NetworkMode.NONE, "NONE allowed a destination")
        _require(decision.host == normalized, f"decision host {decision.host!r} != normalized")
        _check_normalized(decision.host, "decide_egress")
        _require(not looks_like_ip_shorthand(decision.host), f"shorthand {decision.host!r}")
        if not is_ip_literal(decision.host):
            _require(
                not _resolver_reads_as_ipv4(decision.host),
                f"{decision.host!r} is allowed but a resolver reads it as an IPv4 address",
            )
        if mode is NetworkMode.RESTRICTED:
            _require(decision.rule == RULE_ALLOWLISTED, f"restricted rule {decision.rule!r}")
            _require(
                decision.host.encode("ascii") in _MEMBERS,
                f"RESTRICTED allowed {decision.host!r}, which is not an allowlist member",
            )
        else:
            _require(decision.rule == RULE_MODE_FREE, f"free rule {decision.rule!r}")


def _check_allowlist(text: str) -> None:
    try:
        allowlist = Allowlist(text.split(","))
    except ValueError:
        return
    for member in allowlist:
        _check_normalized(member, "Allowlist")
        _require(not looks_like_ip_shorthand(member), f"shorthand entry {member!r}")
        decision = decide_egress(NetworkMode.RESTRICTED, allowlist, member, 443)
        _require(decision.allowed and decision.host == member, f"member {member!r} refused")


def _check_verdict_is_global(address: str) -> None:
    _require("%" not in address, f"scoped {address!r} allowed")
    parsed = ipaddress.ip_address(address)
    _require(parsed.is_global and not parsed.is_multicast, f"{address!r} allowed, not global")
    _require(not parsed.is_private and not parsed.is_loopback, f"{address!r} allowed, private")
    if isinstance(parsed, ipaddress.IPv6Address):
        _require(parsed in _GLOBAL_V6, f"{address!r} allowed outside 2000::/3")
        _require(
            parsed.ipv4_mapped is None and parsed.sixtofour is None and parsed.teredo is None,
            f"{address!r} allowed but embeds IPv4",
        )
    else:
        _require(str(parsed) == address, f"{address!r} allowed but not a canonical quad")


def _check_guard(text: str) -> None:
    verdict = _GUARD.check(text)
    _require(isinstance(verdict.reason, str) and verdict.reason != "", "empty reason")
    if verdict.allowed:
        _require(verdict.reason == "global", f"default guard reason {verdict.reason!r}")
        _check_verdict_is_global(text)
    operator = _OPERATOR_GUARD.check(text)
    if operator.allowed and operator.reason == "global":
        _check_verdict_is_global(text)
    if operator.allowed and operator.reason == "operator_allowed":
        _require(_GUARD.check(text).reason != "metadata", f"metadata {text!r} opened by a range")
    try:
        guard = AddressGuard(text.split(","))
    except ValueError:
        return
    for cidr in guard.allowed_ranges:
        network = ipaddress.ip_network(cidr)
        _require(network.prefixlen >= 7, f"range {cidr} accepted but too broad")
        _require(not network.overlaps(ipaddress.ip_network("::ffff:0:0/96")), f"range {cidr}")


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    selector, body = data[0], data[1:]
    text = _decode(selector, body)
    port = _PORTS[(selector >> 1) % len(_PORTS)]
    normalized = _check_normalize(text)
    _check_authority(body, text, normalized)
    _check_decision(text, normalized, port)
    looks_like_ip_shorthand(text)
    is_ip_literal(text)
    _check_allowlist(text)
    _check_guard(text)


def main() -> None:
    import atheris
    from seeded import instrument

    instrument()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
