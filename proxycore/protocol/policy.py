"""Network policy: modes, host normalization, the exact-match allowlist and the egress decision.

Theory of operation
-------------------
Every destination an agent names (a CONNECT target, an absolute-form request URI, a Host header)
goes through one normalizer before anything compares it with anything. `normalize_host` accepts
exactly one spelling of each host and refuses everything else with `PolicyDenied(rule=
"malformed_host")`: it lowercases ASCII, strips a valid port and the brackets around an IPv6
literal, and nothing more. It does not trim whitespace, drop a trailing dot, decode IDN or
percent-escapes, or guess at userinfo, because every such "helpful" step is a second reading of
the same bytes, and a second reading is how a filter is bypassed (the allowlist compares one
string while the resolver or the upstream sees another: CVE-2023-24329, where a URL with
leading blanks parsed differently in urllib.parse than in the client that fetched it, and
Orange Tsai's "A New Era of SSRF", 2017).

The allowlist is an exact-match set of normalized names: no suffix, parent, child or substring
matching. `decide_egress` applies the crew's mode to a normalized host and returns a frozen
`EgressDecision` naming the rule that decided; it never raises for bad input, so a caller cannot
forget to catch. This is only the *name* policy: the adapter resolves the name afterwards and the
SSRF guard (`proxycore.protocol.ssrf`) checks every resolved address in every mode, including FREE.

IPv4 shorthand ("127.1", "2130706433", "0x7f.1", "0177.0.0.1") is not a dotted quad, so the
normalizer treats it as a name; but `inet_aton` and `getaddrinfo` read it as an address, so
`looks_like_ip_shorthand` flags it and `decide_egress` refuses it in every mode (rule
"ip_shorthand"), and `Allowlist` refuses it as an entry.

This module is pure: no trio, no sockets, no DNS.
"""

from __future__ import annotations

import enum
import ipaddress
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from proxycore.errors import PolicyDenied
from proxycore.protocol.l7 import L7Rules
from proxycore.protocol.netrules import NetRules

__all__ = [
    "DEFAULT_ALLOWED_HOSTS",
    "RULE_ALLOWLISTED",
    "RULE_APPROVED",
    "RULE_IP_SHORTHAND",
    "RULE_MALFORMED_HOST",
    "RULE_MODE_FREE",
    "RULE_MODE_NONE",
    "RULE_NET_ALLOW",
    "RULE_NOT_IN_ALLOWLIST",
    "Allowlist",
    "CrewPolicy",
    "EgressDecision",
    "NetworkMode",
    "decide_egress",
    "is_ip_literal",
    "looks_like_ip_shorthand",
    "normalize_host",
    "parse_authority",
    "parse_mode",
]


class NetworkMode(enum.Enum):
    """A crew's egress mode. The name policy only; the SSRF guard applies in every mode."""

    NONE = "none"
    RESTRICTED = "restricted"
    FREE = "free"


def parse_mode(value: str | None) -> tuple[NetworkMode, str | None]:
    """Read a configured mode; returns the mode and a warning for the caller to report.

    None or "" (no mode named) is RESTRICTED. The source design made "no policy" mean FREE; this
    appliance deliberately defaults to RESTRICTED so that forgetting a key never widens egress.
    Matching is exact and case-sensitive: "none", "restricted", "free". Nothing is lowercased or
    trimmed, so there is one spelling per mode; anything else ("Free", " free", "open") becomes
    RESTRICTED (fail closed, so a typo can never grant unrestricted access) plus a warning that
    names the bad value and the valid ones.
    """
    if value is None or value == "":
        return NetworkMode.RESTRICTED, None
    if isinstance(value, str):
        for mode in NetworkMode:
            if value == mode.value:
                return mode, None
        shown = _printable(value, limit=64)
    else:
        shown = _printable(repr(value), limit=64)
    valid = ", ".join(repr(mode.value) for mode in NetworkMode)
    return NetworkMode.RESTRICTED, (
        f"unknown network mode '{shown}' (valid: {valid}); using 'restricted' (fail closed)"
    )


# The shipped default of `[policy] default_allow` (proxycore/config.py, docs/proxy.md "The
# default allowlist"): the source design's default allowlist (internal/sidecar/allowlist.go),
# the LLM provider endpoints and the OAuth/login hosts their CLIs need. Every crew in restricted
# mode may reach these besides its own `allow`, unless the operator configures another list
# (`default_allow = []` for none). In the order `appliancectl crew show` lists them.
DEFAULT_ALLOWED_HOSTS: tuple[str, ...] = (
    # Anthropic: the API; console.* serves the OAuth refresh callback (Claude Code's login).
    "api.anthropic.com",
    "console.anthropic.com",
    # OpenAI / Codex: the API; auth.* is the ChatGPT-subscription login, chatgpt.com its routing.
    "api.openai.com",
    "auth.openai.com",
    "chatgpt.com",
    # Google / Gemini: the API, its OAuth token endpoint and the OAuth consent UI (redirects).
    "generativelanguage.googleapis.com",
    "oauth2.googleapis.com",
    "accounts.google.com",
    # Cursor: api2.* is the primary model gateway since 2026-Q1, api.* the previous one.
    "api.cursor.sh",
    "api2.cursor.sh",
    # Factory Droid: api.* is legacy, app.* the CLI installer and API base.
    "api.factory.ai",
    "app.factory.ai",
)

RULE_MODE_FREE = "mode_free"
RULE_ALLOWLISTED = "allowlisted"
# Allowed by an operator's grant for a while (`appliancectl approvals allow --once`).
RULE_APPROVED = "approved"
RULE_MODE_NONE = "mode_none"
RULE_NOT_IN_ALLOWLIST = "not_in_allowlist"
RULE_MALFORMED_HOST = "malformed_host"
RULE_IP_SHORTHAND = "ip_shorthand"
# An IP literal covered by one of the crew's TCP allow rules (proxycore.protocol.netrules).
RULE_NET_ALLOW = "net_allow"

# RFC 1035 §2.3.4: 63 octets per label, 255 per name on the wire, which is 253 characters in
# dotted text without the trailing dot.
_MAX_LABEL = 63
_MAX_NAME = 253
# "[" + 45-character IPv6 text (RFC 4291 §2.2 with an embedded dotted quad) + "]:65535".
_MAX_AUTHORITY = _MAX_NAME + len(":65535")

_NAME_CHARS = re.compile(r"[a-z0-9.-]+")
_IPV6_CHARS = re.compile(r"[0-9a-f:.]+")
# RFC 3986 §3.2.3 allows any run of digits; we take one spelling of each port (no leading zero)
# and bound the length before int() sees it.
_PORT = re.compile(r"[1-9][0-9]{0,4}")
_DOTTED_QUAD = re.compile(r"[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}")
# WHATWG URL Standard, "ends in a number checker": a last label of decimal digits, or "0x"
# followed by hex digits (possibly none), makes browsers parse the host as IPv4.
_IPV4_NUMBER = re.compile(r"[0-9]+|0x[0-9a-f]*")


def _printable(raw: str, *, limit: int = 200) -> str:
    """An ASCII, single-line rendering of untrusted text for messages, logs and headers."""
    clipped = raw[:limit]
    shown = clipped.encode("unicode_escape", "backslashreplace").decode("ascii")
    return shown + ("..." if len(raw) > limit else "")


def _malformed(raw: object, why: str) -> PolicyDenied:
    shown = _printable(raw if isinstance(raw, str) else repr(raw))
    return PolicyDenied(f"malformed host '{shown}': {why}", host=shown, rule=RULE_MALFORMED_HOST)


def _parse_port(raw: str, text: str) -> int:
    if _PORT.fullmatch(raw) is None:
        raise _malformed(raw=text, why="the port must be 1-65535 in decimal digits")
    port = int(raw)
    if port > 65535:
        raise _malformed(raw=text, why="the port must be 1-65535 in decimal digits")
    return port


def _normalize_ipv6(literal: str, text: str) -> str:
    # The character check runs first so that zone IDs ("%eth0", RFC 6874) and IPvFuture
    # ("v1.x", RFC 3986 §3.2.2) are refused rather than passed to ipaddress, which accepts a
    # scope: a destination does not get to pick our interface.
    if _IPV6_CHARS.fullmatch(literal) is None:
        raise _malformed(text, "not an IPv6 address")
    try:
        address = ipaddress.IPv6Address(literal)
    except ValueError:
        raise _malformed(text, "not an IPv6 address") from None
    # RFC 5952 §4 canonical text, so that every spelling of an address compares equal.
    return address.compressed


def _normalize_name(name: str, text: str) -> str:
    if not name:
        raise _malformed(text, "empty host")
    if len(name) > _MAX_NAME:
        raise _malformed(text, "the name is longer than 253 characters")
    if _NAME_CHARS.fullmatch(name) is None:
        raise _malformed(text, "a host name may only contain letters, digits, '-' and '.'")
    for label in name.split("."):
        # An empty label is a leading dot, a trailing dot (the DNS root; "a.com." is a different
        # string from "a.com" to every comparison after us) or "a..com".
        if not label:
            raise _malformed(text, "empty label")
        if len(label) > _MAX_LABEL:
            raise _malformed(text, "a label is longer than 63 characters")
        # RFC 952 / RFC 1123 §2.1 LDH rule: no hyphen at either end of a label.
        if label[0] == "-" or label[-1] == "-":
            raise _malformed(text, "a label starts or ends with '-'")
    if _DOTTED_QUAD.fullmatch(name) is not None:
        try:
            # Python >= 3.9.5 refuses leading zeros here (CVE-2021-29921), so "127.000.0.1"
            # stays a name and is caught by looks_like_ip_shorthand instead.
            return str(ipaddress.IPv4Address(name))
        except ValueError:
            pass
    return name


def _split(raw: object, *, bare_ipv6: bool) -> tuple[str, int | None]:
    """Normalize `raw` into (host, port or None); raises PolicyDenied(rule="malformed_host")."""
    if not isinstance(raw, str):
        raise _malformed(raw, "not a string")
    if len(raw) > _MAX_AUTHORITY:
        raise _malformed(raw, "too long")
    # IDN is refused rather than converted: the resolver and the TLS peer must see the same
    # ASCII (punycode, "xn--") string the allowlist holds, and Unicode look-alikes
    # ("api" spelt with U+0430 CYRILLIC SMALL LETTER A) must never normalize to an allowlisted name.
    if not raw.isascii():
        raise _malformed(raw, "non-ASCII host; write IDN as punycode (xn--)")
    # ASCII-only lowercase: str.lower() on ASCII input cannot produce non-ASCII.
    text = raw.lower()
    port: int | None = None
    if text.startswith("["):
        # RFC 3986 §3.2.2: IP-literal = "[" IPv6address "]", then an optional ":" port.
        close = text.find("]")
        if close < 0:
            raise _malformed(raw, "unclosed '['")
        rest = text[close + 1 :]
        if rest.startswith(":"):
            port = _parse_port(rest[1:], raw)
        elif rest:
            raise _malformed(raw, "unexpected text after ']'")
        return _normalize_ipv6(text[1:close], raw), port
    if text.count(":") > 1:
        # An unbracketed IPv6 literal has no room for a port: "::1:443" is itself an address.
        # Allowlist entries and our own normalized output may be written this way; wire
        # authorities (RFC 3986, RFC 9110 §7.2) must use brackets.
        if not bare_ipv6:
            raise _malformed(raw, "an IPv6 literal must be in brackets")
        return _normalize_ipv6(text, raw), None
    name, colon, port_text = text.partition(":")
    if colon:
        port = _parse_port(port_text, raw)
    return _normalize_name(name, raw), port


def normalize_host(raw: str) -> str:
    """Return the one canonical spelling of a host, or raise PolicyDenied("malformed_host").

    Used for allowlist entries and request hosts alike. Lowercases ASCII; strips a ":port"
    (digits only, 1-65535, no leading zero); "[::1]:443" and "::1" give "::1" (RFC 5952 text).
    Refuses: surrounding whitespace, a trailing dot, userinfo ("evil.com@allowed"), empty labels,
    non-ASCII (IDN must be punycode), characters outside [a-z0-9.-] in names, labels over 63 or
    names over 253 characters, zone IDs. An unbracketed string with two or more colons is read
    as a whole IPv6 literal, never as host:port. The result is a fixed point:
    normalize_host(normalize_host(x)) == normalize_host(x).
    """
    host, _ = _split(raw, bare_ipv6=True)
    return host


def parse_authority(raw: bytes | str, default_port: int) -> tuple[str, int]:
    """Split a CONNECT target or Host header value into (normalized host, port).

    `default_port` is used when the authority names no port; -1 means a port is required
    (CONNECT, RFC 9110 §9.3.6) and its absence is malformed. Unlike `normalize_host`, an IPv6
    literal must be bracketed. Bytes must be ASCII. Raises PolicyDenied(rule="malformed_host")
    for bad input; raises ValueError only for a `default_port` outside -1 and 1-65535, which is
    the caller's bug.
    """
    if isinstance(default_port, bool) or not (default_port == -1 or 1 <= default_port <= 65535):
        raise ValueError(f"default_port must be -1 (required) or 1-65535, got {default_port!r}")
    if isinstance(raw, bytes | bytearray | memoryview):
        try:
            text = bytes(raw).decode("ascii")
        except UnicodeDecodeError:
            raise _malformed(bytes(raw).decode("latin-1"), "non-ASCII bytes") from None
    else:
        text = raw
    host, port = _split(text, bare_ipv6=False)
    if port is None:
        if default_port == -1:
            raise _malformed(text, "a port is required (host:port)")
        port = default_port
    return host, port


def is_ip_literal(host: str) -> bool:
    """True if `host` is a normalized IP literal: a dotted quad or unbracketed IPv6 text.

    Shorthand IPv4 ("127.1") and zone IDs are not literals here; see looks_like_ip_shorthand.
    """
    if not isinstance(host, str) or not host.isascii() or "%" in host:
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def looks_like_ip_shorthand(host: str) -> bool:
    """True if a resolver could read `host` as an IPv4 address that is not a canonical quad.

    inet_aton(3), and so getaddrinfo(3), accept one to four parts in decimal, octal ("0177") or
    hex ("0x7f"), the last part filling the remaining bytes: "2130706433", "127.1", "0x7f.1" and
    "0177.0.0.1" all mean 127.0.0.1. We use the WHATWG URL Standard's broader "ends in a number"
    test (a last label that is all digits, or 0x plus hex digits): no real TLD is numeric, so
    anything that ends in a number and is not a canonical dotted quad is refused outright in
    every mode. Never raises.
    """
    if not isinstance(host, str) or not host.isascii() or ":" in host:
        return False
    text = host.lower()
    # The WHATWG checker ignores one trailing empty label, and so does the resolver.
    if text.endswith("."):
        text = text[:-1]
    if not text:
        return False
    if _IPV4_NUMBER.fullmatch(text.rpartition(".")[2]) is None:
        return False
    if _DOTTED_QUAD.fullmatch(text) is not None:
        try:
            return str(ipaddress.IPv4Address(text)) != text
        except ValueError:
            return True
    return True


class Allowlist:
    """An exact-match set of normalized host names (and IP literals).

    No suffix, parent/child or substring matching: "api.anthropic.com" admits neither
    "anthropic.com" nor "x.api.anthropic.com". Entries are normalized with `normalize_host`, so
    "API.Anthropic.com:443" is stored as "api.anthropic.com" (the source design stores domains
    lowercase and strips ports). Entries that `looks_like_ip_shorthand` flags are refused, since
    the adapter refuses such hosts in every mode and an entry for one can only be a mistake.

    A plain set: trio runs every task on one thread, so add() needs no lock.
    """

    __slots__ = ("_hosts",)

    def __init__(self, hosts: Iterable[str]) -> None:
        if isinstance(hosts, str | bytes):
            # A lone string is iterable too, and would become an allowlist of its characters.
            raise TypeError("Allowlist takes an iterable of host names, not a single string")
        self._hosts: set[str] = set()
        for host in hosts:
            self._hosts.add(self._entry(host))

    @staticmethod
    def _entry(host: str) -> str:
        try:
            normalized = normalize_host(host)
        except PolicyDenied as exc:
            raise ValueError(f"invalid allowlist entry {host!r}: {exc}") from None
        if looks_like_ip_shorthand(normalized):
            raise ValueError(
                f"invalid allowlist entry {host!r}: a resolver reads it as an IPv4 address;"
                " write the address as a dotted quad"
            )
        return normalized

    def add(self, host: str) -> bool:
        """Normalize and add `host`; True if it was not already present. ValueError if bad."""
        entry = self._entry(host)
        if entry in self._hosts:
            return False
        self._hosts.add(entry)
        return True

    def __contains__(self, host: object) -> bool:
        # `host` must already be normalized: membership is exact string equality.
        return isinstance(host, str) and host in self._hosts

    def __iter__(self) -> Iterator[str]:
        # Sorted, so logs and `appliancectl` output are stable; a snapshot, so add() during
        # iteration is safe.
        return iter(sorted(self._hosts))

    def __len__(self) -> int:
        return len(self._hosts)

    def __repr__(self) -> str:
        return f"Allowlist({sorted(self._hosts)!r})"


@dataclass(frozen=True, slots=True)
class EgressDecision:
    """The name policy's answer for one destination.

    `host` is the normalized host (for a malformed host, a printable rendering of the input);
    `rule` is one of the RULE_* names.
    """

    allowed: bool
    host: str
    port: int
    rule: str
    mode: NetworkMode

    def raise_if_denied(self) -> None:
        """Raise PolicyDenied (status 403) naming the host and rule if this is a refusal."""
        if not self.allowed:
            raise PolicyDenied(
                f"{_REASONS.get(self.rule, self.rule)}: {self.host} (mode {self.mode.value})",
                host=self.host,
                rule=self.rule,
            )


_REASONS = {
    RULE_MODE_NONE: "network access is disabled for this crew",
    RULE_NOT_IN_ALLOWLIST: "host is not in the crew's allowlist",
    RULE_MALFORMED_HOST: "malformed host",
    RULE_IP_SHORTHAND: "shorthand IPv4 address refused; use a host name or a dotted quad",
}


def decide_egress(
    mode: NetworkMode, allowlist: Allowlist, raw_host: str, port: int
) -> EgressDecision:
    """Apply the name policy to one destination; never raises.

    `raw_host` is normalized here (a ":port" in it must equal `port`). Order: malformed host or
    port -> "malformed_host"; IPv4 shorthand -> "ip_shorthand" in every mode; NONE ->
    "mode_none"; FREE -> "mode_free"; RESTRICTED -> "allowlisted" iff the normalized host is
    an exact member, else "not_in_allowlist". An IP literal is allowed in RESTRICTED only if
    that exact literal is allowlisted. The SSRF guard still runs after resolution in every mode.
    """
    try:
        host, embedded_port = _split(raw_host, bare_ipv6=True)
    except PolicyDenied as exc:
        return EgressDecision(False, exc.host, port, RULE_MALFORMED_HOST, mode)
    if (
        isinstance(port, bool)
        or not isinstance(port, int)
        or not 1 <= port <= 65535
        or (embedded_port is not None and embedded_port != port)
    ):
        # A host that carries one port while the caller dials another is a caller bug or a
        # confusion attempt; either way it is not a destination we can describe honestly.
        return EgressDecision(False, host, port, RULE_MALFORMED_HOST, mode)
    if looks_like_ip_shorthand(host):
        return EgressDecision(False, host, port, RULE_IP_SHORTHAND, mode)
    if mode is NetworkMode.FREE:
        return EgressDecision(True, host, port, RULE_MODE_FREE, mode)
    if mode is NetworkMode.RESTRICTED:
        if host in allowlist:
            return EgressDecision(True, host, port, RULE_ALLOWLISTED, mode)
        return EgressDecision(False, host, port, RULE_NOT_IN_ALLOWLIST, mode)
    # NONE, and (fail closed) anything that is not a known mode.
    return EgressDecision(False, host, port, RULE_MODE_NONE, mode)


# A crew's decisions are memoized; bounded, cleared whole when full.
MEMO_SIZE = 4096


@dataclass(slots=True, eq=False)
class CrewPolicy:
    """A crew's name policy: its mode, its exact allowlist, and a memo of decisions.

    The memo is cleared whenever the allowlist changes (a crew's mode never does), so a cached
    decision is always the current one. Bounded: cleared whole at `MEMO_SIZE` entries.

    `grants` (host -> wall-clock end) are the operator's temporary approvals: they are read
    after the memo, against the clock, at every decision, so that a grant ends on time with no
    message and no memo to clear. Only a `not_in_allowlist` refusal consults them: a grant never
    opens a crew in mode none, a malformed host or an IP shorthand. `denied` (host -> end) and
    `approval_window` only shape what the refusal says (exchange.py).
    """

    name: str
    mode: NetworkMode
    allowlist: Allowlist
    # Method and path rules for some hosts (proxycore.protocol.l7): they only narrow what the
    # name policy allows, on the routes where the proxy reads the requests.
    rules: L7Rules = field(default_factory=L7Rules)
    # Address rules (proxycore.protocol.netrules): in restricted mode, an IP literal that a TCP
    # allow rule covers passes without being allowlisted (the kernel lets the crew reach it
    # directly anyway); deny rules are applied to every resolved address by the dialer.
    net: NetRules = field(default_factory=NetRules)
    decisions: dict[tuple[str, int], EgressDecision] = field(default_factory=dict)
    grants: dict[str, float] = field(default_factory=dict)
    denied: dict[str, float] = field(default_factory=dict)
    # Seconds an approval request stays pending (None: approvals are off for this proxy).
    approval_window: float | None = None
    clock: Callable[[], float] = time.time
    # Bumped by every change of what `decide` answers (the allowlist, grants and denials, the
    # address rules): whoever remembers decisions elsewhere (the crew's DNS responder) compares
    # it with the value it saw, and forgets them when it moved.
    generation: int = 0

    def decide(self, host: str, port: int) -> EgressDecision:
        key = (host, port)
        decision = self.decisions.get(key)
        if decision is None:
            if len(self.decisions) >= MEMO_SIZE:
                self.decisions.clear()
            decision = decide_egress(self.mode, self.allowlist, host, port)
            if decision.rule == RULE_NOT_IN_ALLOWLIST and self.net.allow:
                literal = is_ip_literal(decision.host)
                rule = self.net.verdict(decision.host, port) if literal else None
                if rule is not None and rule.action == "allow":
                    decision = EgressDecision(True, decision.host, port, RULE_NET_ALLOW, self.mode)
            self.decisions[key] = decision
        if self.grants and decision.rule == RULE_NOT_IN_ALLOWLIST:
            until = self.grants.get(decision.host)
            if until is not None and self.clock() < until:
                return EgressDecision(True, decision.host, port, RULE_APPROVED, self.mode)
        return decision

    def denied_until(self, host: str) -> float | None:
        """When the operator's refusal of `host` ends, if it has not yet."""
        until = self.denied.get(host)
        return until if until is not None and self.clock() < until else None

    def allow(self, host: str) -> bool:
        added = self.allowlist.add(host)
        self.changed()
        return added

    def changed(self) -> None:
        """What `decide` answers changed (see `generation`)."""
        self.decisions.clear()
        self.generation += 1
