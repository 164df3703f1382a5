"""A crew's address rules: allow or deny by protocol, IPv4 range and port, beyond host names.

Theory of operation
-------------------
A rule is written `ACTION:PROTOCOL:RANGE:PORTS`, one shell word:

    allow:tcp:10.9.0.0/24:5432        a database on the LAN
    allow:udp:10.9.0.53/32:53         a resolver (UDP leaves only where an allow rule names udp)
    deny:tcp:10.9.0.66/32:*           one host of that range refused, every port
    allow:tcp:192.168.1.10/32:8000-8100

ACTION is `allow` or `deny`; PROTOCOL `tcp` or `udp`; RANGE an IPv4 network in CIDR notation
(a bare address means /32; host bits set are refused, "10.1.2.3/8" is likelier a typo than a
decision); PORTS one port, a range `LOW-HIGH`, or `*` for every port. `parse_net_rule` reads
that and gives back a `NetRule` whose `spec` is the one spelling of it (the range with its
length, the port range collapsed: "1-65535" is written "*", "53-53" is "53"); everything that
stores or compares rules stores and compares the spec.

The same rules are applied twice (docs/netns.md, "Address rules"): by the kernel, to the
packets a crew sends past the proxy (netns/nft.py: named sets, deny before allow), and by the
proxy, to the address a CONNECT or a request resolves to (`NetRules.verdict`, through
proxycore/io/upstream.py). In both, deny wins: over a wider allow rule, over the host-name
allowlist, over `ssrf_allow`. An allow rule lets the crew reach that range directly, so the
proxy does not refuse what the kernel would let through anyway: an address covered by a TCP
allow rule passes the SSRF guard for that crew and port, and in restricted mode an IP literal
in it passes the name policy (a host name still needs the allowlist: the rule is about
addresses, and a name's answers are not the operator's to vouch for).

Only IPv4: the crews have no IPv6 at all (netns/kernel.py switches it off in their namespaces).

Limits on allow rules, because an allow rule is egress that bypasses the proxy (no scrubbing,
no journal of requests): no broader than /8 (as `ssrf_allow`); no part of the blocks that are
never a destination (this-network, loopback, multicast, the former class E, broadcast); a cloud
metadata address only by a rule that is exactly that /32, as in the SSRF guard. The crews'
own pool is refused by the caller, which knows it (appliance/daemon/crews.py, netns/nft.py
drops it in the kernel whatever the sets hold). Deny rules have no such limits: `deny:tcp:
0.0.0.0/0:*` is a valid, if redundant, rule.

Pure: no sockets, no DNS.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "ACTIONS",
    "MAX_NET_RULES",
    "NET_RULE_SYNTAX",
    "PROTOCOLS",
    "NetRule",
    "NetRules",
    "parse_net_rule",
    "parse_net_rules",
]

ACTIONS = ("allow", "deny")
PROTOCOLS = ("tcp", "udp")
NET_RULE_SYNTAX = "allow|deny:tcp|udp:CIDR:PORT|LOW-HIGH|*"
# The kernel cuts a crew's rules into disjoint set elements, O(n^2) of them at worst, and the
# proxy scans them per address (a crew has a handful): the cap keeps both bounded (netns/
# netrules.py MAX_RULES is the same).
MAX_NET_RULES = 64
_MIN_ALLOW_PREFIX = 8
# Never a destination: an allow rule may not touch them (0.0.0.0/8 is the local host to
# Linux, 127/8 is martian on a crew's interface, 224/4 and up are not unicast).
_NEVER = tuple(
    ipaddress.IPv4Network(text)
    for text in ("0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4")
)
# The SSRF guard's IPv4 metadata addresses (proxycore/protocol/ssrf.py).
_METADATA = tuple(
    ipaddress.IPv4Address(text)
    for text in (
        "169.254.169.254",
        "169.254.170.2",
        "169.254.170.23",
        "100.100.100.200",
        "168.63.129.16",
    )
)


@dataclass(frozen=True, slots=True)
class NetRule:
    action: str
    protocol: str
    network: ipaddress.IPv4Network
    first_port: int
    last_port: int

    @property
    def ports(self) -> str:
        if (self.first_port, self.last_port) == (1, 65535):
            return "*"
        if self.first_port == self.last_port:
            return str(self.first_port)
        return f"{self.first_port}-{self.last_port}"

    @property
    def spec(self) -> str:
        """The one spelling of this rule (what `parse_net_rule` reads back to an equal rule)."""
        return f"{self.action}:{self.protocol}:{self.network}:{self.ports}"

    def covers(self, address: ipaddress.IPv4Address, protocol: str, port: int) -> bool:
        return (
            protocol == self.protocol
            and self.first_port <= port <= self.last_port
            and address in self.network
        )


def _port(text: str, spec: str) -> int:
    # Digits only: int() would take "+53", " 53" and "5_3".
    if not text.isdigit() or not text.isascii() or len(text) > 5:
        raise ValueError(f"{spec!r}: port {text!r} is not a number from 1 to 65535")
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError(f"{spec!r}: port {value} is not in 1-65535")
    return value


def parse_net_rule(text: object) -> NetRule:
    """Read one rule; ValueError saying what is wrong with it (the caller names the argument)."""
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a rule: write {NET_RULE_SYNTAX}")
    # The range is read between the second colon and the last, so that an IPv6 range (which
    # has colons of its own) is refused for what it is, not as a malformed rule.
    action, _, rest = text.partition(":")
    protocol, _, rest = rest.partition(":")
    cidr, colon, ports = rest.rpartition(":")
    if not colon or not cidr:
        raise ValueError(f"{text!r}: write {NET_RULE_SYNTAX}, e.g. allow:tcp:10.9.0.0/24:5432")
    if action not in ACTIONS:
        raise ValueError(f"{text!r}: action {action!r} is not allow or deny")
    if protocol not in PROTOCOLS:
        raise ValueError(f"{text!r}: protocol {protocol!r} is not tcp or udp")
    if not cidr.isascii() or cidr.strip() != cidr:
        raise ValueError(f"{text!r}: {cidr!r} is not an IPv4 network")
    try:
        network = ipaddress.ip_network(cidr, strict=True)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {cidr!r} is not a network address: {exc}") from None
    if not isinstance(network, ipaddress.IPv4Network):
        raise ValueError(f"{text!r}: {cidr!r} is IPv6; crews have IPv4 only")
    if ports == "*":
        first, last = 1, 65535
    else:
        low, dash, high = ports.partition("-")
        first = _port(low, text)
        last = _port(high, text) if dash else first
        if last < first:
            raise ValueError(f"{text!r}: port range {ports!r} runs backwards")
    rule = NetRule(action, protocol, network, first, last)
    if action == "allow":
        _check_allow(rule, text)
    return rule


def _check_allow(rule: NetRule, text: str) -> None:
    network = rule.network
    if network.prefixlen < _MIN_ALLOW_PREFIX:
        raise ValueError(
            f"{text!r}: an allow rule broader than /{_MIN_ALLOW_PREFIX} would let the crew "
            "past the proxy to a large part of the internet"
        )
    for block in _NEVER:
        if network.overlaps(block):
            raise ValueError(f"{text!r}: {network} overlaps {block}, which is never a destination")
    for address in _METADATA:
        if address in network and network.prefixlen != 32:
            raise ValueError(
                f"{text!r}: {network} holds the cloud metadata address {address}; only a rule "
                f"for exactly {address}/32 opens it"
            )


def parse_net_rules(texts: Iterable[object]) -> tuple[NetRule, ...]:
    """Several rules, each once (by its spec), in order; ValueError names the rule's index."""
    seen: dict[str, NetRule] = {}
    for index, text in enumerate(texts):
        try:
            rule = parse_net_rule(text)
        except ValueError as exc:
            raise ValueError(f"[{index}]: {exc}") from None
        seen.setdefault(rule.spec, rule)
    if len(seen) > MAX_NET_RULES:
        raise ValueError(f"over {MAX_NET_RULES} rules")
    return tuple(seen.values())


class NetRules:
    """One crew's rules, as the proxy consults them for each resolved address."""

    __slots__ = ("allow", "deny")

    def __init__(self, rules: Iterable[NetRule] = ()) -> None:
        rules = tuple(rules)
        self.deny = tuple(rule for rule in rules if rule.action == "deny")
        self.allow = tuple(rule for rule in rules if rule.action == "allow")

    def __bool__(self) -> bool:
        return bool(self.deny or self.allow)

    def verdict(self, address: str, port: int, protocol: str = "tcp") -> NetRule | None:
        """The rule that decides `address:port`: a deny rule first (deny wins), else an allow
        rule, else None (no rule speaks: the name policy and the SSRF guard decide)."""
        if not self:
            return None
        try:
            parsed = ipaddress.ip_address(address.partition("%")[0])
        except ValueError:
            return None
        if not isinstance(parsed, ipaddress.IPv4Address):
            return None
        for rule in self.deny:
            if rule.covers(parsed, protocol, port):
                return rule
        for rule in self.allow:
            if rule.covers(parsed, protocol, port):
                return rule
        return None
