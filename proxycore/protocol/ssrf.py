"""SSRF guard: classify a resolved address as globally routable unicast or refuse it.

Theory of operation
-------------------
The name policy (`proxycore.protocol.policy`) decides which *names* a crew may reach; it cannot
know where a name points. After the adapter resolves a name (or is handed an IP literal) it
passes every resulting address through `AddressGuard.check` before connecting, in every network
mode, and connects only to addresses that were checked. Otherwise an agent could point a name
it controls (or an allowlisted name whose DNS it can influence) at the loopback interface, the
Docker host, the LAN or a cloud metadata service (the Capital One breach, 2019, was an SSRF against
169.254.169.254).

Only globally routable unicast passes. The guard classifies with explicit tables built from the
IANA special-purpose address registries (RFC 6890 and its updates) using longest-prefix match,
rather than trusting `ipaddress.is_global` alone, whose answers changed across Python releases
(for example 3.11 calls the IPv4-compatible "::127.0.0.1" global). `is_global` still runs last
as a belt-and-braces check that can only refuse more.

Operator-allowed ranges (for example a LAN model server at 10.0.0.0/8) are checked first and
override the tables, with two limits decided here: a cloud metadata address is reachable only if
an allowed range is exactly that address (/32 or /128), because allowing a LAN-ish block such as
169.254.0.0/16 or Tailscale's 100.64.0.0/10 must not silently expose instance credentials; and
ranges that would disable the guard (broader than /8 for IPv4 or /7 for IPv6, or overlapping an
IPv6 block that embeds IPv4 addresses) are refused at construction with ValueError.

Pure functions over strings: no sockets, no DNS.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["AddressGuard", "AddressVerdict"]

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Longer than any numeric address getaddrinfo returns, zone ID included (IFNAMSIZ is 16).
_MAX_ADDRESS_TEXT = 64

# Instance metadata services. They sit inside ranges the tables refuse anyway; naming them
# separately gives a precise reason and keeps them refused under a broad operator range.
_METADATA: frozenset[_Address] = frozenset(
    ipaddress.ip_address(text)
    for text in (
        # AWS, GCP, Azure IMDS, OCI, DigitalOcean, OpenStack, ...
        "169.254.169.254",
        # AWS IMDS over IPv6 (Nitro instances).
        "fd00:ec2::254",
        # AWS ECS task credentials endpoint and EKS Pod Identity agent.
        "169.254.170.2",
        "169.254.170.23",
        "fd00:ec2::23",
        # Alibaba Cloud ECS metadata (inside CGNAT 100.64.0.0/10, RFC 6598).
        "100.100.100.200",
        # Azure WireServer: a public-looking address that only answers inside Azure, where it
        # serves the VM agent's goal state and extension configuration to anything on the VM.
        "168.63.129.16",
    )
)


def _table(entries: Iterable[tuple[str, str]]) -> tuple[tuple[_Network, str], ...]:
    return tuple((ipaddress.ip_network(cidr), reason) for cidr, reason in entries)


# IANA IPv4 Special-Purpose Address Registry (RFC 6890 §2.2.2 and updates), plus multicast and
# the former class E space. Blocks the registry marks globally reachable but that no agent needs
# (192.0.0.9/32, 192.0.0.10/32 inside 192.0.0.0/24) are refused with their parent block.
_IPV4_TABLE = _table(
    (
        # RFC 1122 §3.2.1.3 "this network". Linux treats a connect() to 0.0.0.0 as the local
        # host, so this is loopback in disguise.
        ("0.0.0.0/8", "unspecified"),
        ("10.0.0.0/8", "private"),  # RFC 1918
        ("100.64.0.0/10", "cgnat"),  # RFC 6598 shared address space (carrier NAT, Tailscale)
        ("127.0.0.0/8", "loopback"),  # RFC 1122 §3.2.1.3
        ("169.254.0.0/16", "link_local"),  # RFC 3927
        ("172.16.0.0/12", "private"),  # RFC 1918
        ("192.0.0.0/24", "reserved"),  # RFC 6890 IETF protocol assignments (DS-Lite, PCP, ...)
        ("192.0.2.0/24", "documentation"),  # RFC 5737 TEST-NET-1
        # RFC 3068 6to4 relay anycast, deprecated by RFC 7526: a relay, never a destination.
        ("192.88.99.0/24", "6to4"),
        ("192.168.0.0/16", "private"),  # RFC 1918
        ("198.18.0.0/15", "benchmarking"),  # RFC 2544
        ("198.51.100.0/24", "documentation"),  # RFC 5737 TEST-NET-2
        ("203.0.113.0/24", "documentation"),  # RFC 5737 TEST-NET-3
        ("224.0.0.0/4", "multicast"),  # RFC 5771
        ("240.0.0.0/4", "reserved"),  # RFC 1112 §4 former class E
        ("255.255.255.255/32", "broadcast"),  # RFC 919 limited broadcast
    )
)

# IANA IPv6 Special-Purpose Address Registry (RFC 6890 §2.2.3 and updates). The blocks that
# embed an IPv4 address are refused outright, whatever the embedded address is: the kernel
# (IPv4-mapped and -compatible on a dual-stack socket) or a translator, relay or gateway (SIIT,
# NAT64, 6to4, Teredo) turns the packet into IPv4 towards the embedded address, which may be
# 127.0.0.1 or 169.254.169.254 from that box's point of view. A real destination is reachable at
# its native address, so refusing the wrapped forms costs nothing; decoding them instead would
# make this guard's correctness depend on every translator's reading of the format.
_IPV6_TABLE = _table(
    (
        ("::/128", "unspecified"),  # RFC 4291 §2.5.2
        ("::1/128", "loopback"),  # RFC 4291 §2.5.3
        ("::/96", "ipv4_compatible"),  # RFC 4291 §2.5.5.1, deprecated
        ("::ffff:0:0/96", "ipv4_mapped"),  # RFC 4291 §2.5.5.2
        ("::ffff:0:0:0/96", "ipv4_translated"),  # RFC 2765 §2.1 SIIT
        ("::/8", "reserved"),  # RFC 4291 §2.4, reserved by the IETF
        ("64:ff9b::/96", "nat64"),  # RFC 6052 §2.1 well-known prefix
        ("64:ff9b:1::/48", "nat64"),  # RFC 8215 local-use translation prefix
        ("100::/64", "reserved"),  # RFC 6666 discard-only
        ("100:0:0:1::/64", "reserved"),  # RFC 9780 dummy prefix
        ("2001::/23", "reserved"),  # RFC 2928 IETF protocol assignments (ORCHID, AMT, ...)
        ("2001::/32", "teredo"),  # RFC 4380
        ("2001:2::/48", "benchmarking"),  # RFC 5180
        ("2001:db8::/32", "documentation"),  # RFC 3849
        ("2002::/16", "6to4"),  # RFC 3056
        ("3fff::/20", "documentation"),  # RFC 9637
        ("5f00::/16", "reserved"),  # RFC 9602 SRv6 SIDs
        ("fc00::/7", "unique_local"),  # RFC 4193 ULA
        ("fe80::/10", "link_local"),  # RFC 4291 §2.5.6
        ("fec0::/10", "site_local"),  # RFC 3879, deprecated but still routed by some stacks
        ("ff00::/8", "multicast"),  # RFC 4291 §2.7
    )
)

# RFC 4291 §2.4 / IANA IPv6 Address Space: only 2000::/3 is allocated as global unicast.
_IPV6_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")

# The blocks that embed IPv4 (see _IPV6_TABLE). An operator range may not overlap them, because
# allowing the wrapper would allow every IPv4 address behind it, metadata included.
_IPV6_EMBEDS_IPV4 = tuple(
    network
    for network, reason in _IPV6_TABLE
    if reason in {"ipv4_compatible", "ipv4_mapped", "ipv4_translated", "nat64", "6to4", "teredo"}
)

# The broadest operator range accepted: 10.0.0.0/8 and fc00::/7 are the widest blocks an
# operator plausibly needs; anything broader starts to swallow the guard (0.0.0.0/0, ::/0).
_MIN_ALLOWED_PREFIX = {4: 8, 6: 7}


@dataclass(frozen=True, slots=True)
class AddressVerdict:
    """The guard's answer for one address.

    `address` is the text that was checked (zone ID included); `reason` is "global",
    "operator_allowed" or the name of the refused class ("loopback", "metadata", "ipv4_mapped",
    "invalid", ...), stable enough to build rule names from.
    """

    allowed: bool
    address: str
    reason: str


def _longest_match(address: _Address, table: tuple[tuple[_Network, str], ...]) -> str | None:
    best: tuple[int, str] | None = None
    for network, reason in table:
        if address in network and (best is None or network.prefixlen > best[0]):
            best = (network.prefixlen, reason)
    return None if best is None else best[1]


def _classify(address: _Address) -> str:
    """The reason `address` is refused, or "global" if it is globally routable unicast."""
    if address in _METADATA:
        return "metadata"
    if isinstance(address, ipaddress.IPv4Address):
        reason = _longest_match(address, _IPV4_TABLE)
    else:
        reason = _longest_match(address, _IPV6_TABLE)
        if reason is None and address not in _IPV6_GLOBAL_UNICAST:
            reason = "reserved"
    if reason is not None:
        return reason
    # Belt and braces: whatever this Python's registry copy says is not global is refused too.
    if not address.is_global or address.is_multicast:
        return "reserved"
    return "global"


def _parse_range(entry: object) -> _Network:
    if not isinstance(entry, str):
        raise ValueError(f"allowed range {entry!r} is not a string")
    try:
        # strict: "10.1.2.3/8" has host bits set and is more likely a typo than a decision.
        network = ipaddress.ip_network(entry, strict=True)
    except ValueError as exc:
        raise ValueError(f"allowed range {entry!r} is not a CIDR network: {exc}") from None
    if network.prefixlen < _MIN_ALLOWED_PREFIX[network.version]:
        raise ValueError(
            f"allowed range {entry!r} is broader than /{_MIN_ALLOWED_PREFIX[network.version]}"
            " and would disable the SSRF guard"
        )
    if isinstance(network, ipaddress.IPv6Network):
        for block in _IPV6_EMBEDS_IPV4:
            if network.overlaps(block):
                raise ValueError(
                    f"allowed range {entry!r} overlaps {block}, which embeds IPv4 addresses;"
                    " allow the IPv4 range itself instead"
                )
    return network


class AddressGuard:
    """Checks resolved addresses; construct once from the operator's config and share."""

    __slots__ = ("_allowed",)

    def __init__(self, allowed_ranges: Iterable[str] = ()) -> None:
        if isinstance(allowed_ranges, str | bytes):
            # A lone "10.0.0.0/8" would iterate as "1", "0", ... and each is a valid /32.
            raise TypeError("AddressGuard takes an iterable of CIDR strings, not one string")
        self._allowed: tuple[_Network, ...] = tuple(_parse_range(e) for e in allowed_ranges)

    @property
    def allowed_ranges(self) -> tuple[str, ...]:
        return tuple(str(network) for network in self._allowed)

    def check(self, address: str) -> AddressVerdict:
        """Classify one numeric address as returned by getaddrinfo; never raises.

        Anything that is not a strict IPv4 dotted quad or IPv6 text (with an optional
        "%zone") is refused with reason "invalid". A zone ID is ignored for classification,
        but a zone on an address that would otherwise pass is refused ("scoped"): only
        link-local and multicast addresses carry zones, and a zone picks an interface.
        """
        if not isinstance(address, str) or len(address) > _MAX_ADDRESS_TEXT:
            shown = repr(address)[:_MAX_ADDRESS_TEXT]
            return AddressVerdict(False, shown, "invalid")
        if not address.isascii():
            return AddressVerdict(
                False, address.encode("ascii", "backslashreplace").decode(), "invalid"
            )
        base, percent, zone = address.partition("%")
        try:
            parsed = ipaddress.ip_address(base)
        except ValueError:
            return AddressVerdict(False, address, "invalid")
        if percent and (not zone or parsed.version != 6 or not zone.isprintable() or " " in zone):
            return AddressVerdict(False, address, "invalid")
        for network in self._allowed:
            if parsed in network:
                if parsed in _METADATA and network.prefixlen != network.max_prefixlen:
                    # Only an allowed range that is exactly the metadata address opens it.
                    continue
                return AddressVerdict(True, address, "operator_allowed")
        reason = _classify(parsed)
        if reason != "global":
            return AddressVerdict(False, address, reason)
        if percent:
            return AddressVerdict(False, address, "scoped")
        return AddressVerdict(True, address, "global")
