"""The address plan: which /30 and which interface name a crew gets. Pure functions, no I/O.

Theory of operation: the pool is cut into /30 subnets numbered from 0. Subnet `i` is
`pool.network_address + 4 * i`; its first host address is the gateway (the host end of the
crew's veth, where the proxy listens and by which it identifies the crew) and its second is the
crew's own address. A /30 rather than a /31 (RFC 3021) because the network and broadcast
addresses of a /30 are never used by anything, so no tool has to understand /31 semantics.

Which index a crew holds is recorded in the state file (`state.py`); this module only computes
plans and checks addresses. Whether an address is used by the host is decided by `kernel.py`
(a FIB lookup); `first_free_index` takes that check as a callback so that it stays pure.

Interface names are derived from the crew id, not from the index, so that a name identifies a
crew across restarts: the interface prefix plus hex digits of SHA-256(crew id), filling
IFNAMSIZ-1 = 15 characters. Collisions are checked anyway (`CrewNetworks` refuses a second crew
whose name would collide).

Instances. Several appliances may share a host; each has an *instance id* (`check_instance_id`:
1-16 lowercase letters, digits or inner '-', which fits a Docker label, a container or volume
name and a namespace name as it is). Its kernel objects carry it (`naming`): the table is
`<table>_<instance>` with '-' written '_' (nft(8) identifiers take no '-'; ids take no '_', so
no two ids give one table), and the interface prefix is the configured prefix plus a
3-character tag of the instance (base32 of SHA-256(instance id), 15 bits): the id itself does
not fit beside a crew hash in 15 characters. With the default prefix "apx" an interface is
`apx` + tag + 9 hex digits of the crew (36 bits). Two instances whose tags collide (about 1 in
32768 for a pair) are told apart at start: `CrewNetworks.reconcile` refuses to run beside
another table whose interface pattern overlaps its own.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
from collections.abc import Callable, Iterable

import msgspec

from .config import IFNAME_MAX
from .errors import NetConfigError, PoolExhaustedError

SUBNET_PREFIXLEN = 30
SUBNET_SIZE = 4
# Crew ids appear in interface comments, nft rule comments and log prefixes: keep them plain.
_CREW_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
# An instance id goes into Docker labels and container, volume and namespace names as it is:
# the characters all of them accept (Docker volume names are case-sensitive where the others are
# not), no '_' and no '.' (nft table names and Docker names use them to set the id apart).
_INSTANCE_ID = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,14}[a-z0-9])?")
INSTANCE_TAG_LENGTH = 3


class CrewPlan(msgspec.Struct, frozen=True):
    """Everything the kernel objects of one crew are built from."""

    crew: str
    index: int
    # Host end of the veth; the key of the crew's nftables rules.
    ifname: str
    # e.g. "100.127.0.4/30"
    subnet: str
    # Host end address: where the proxy listens for this crew, and its identity.
    gateway: str
    # The crew end's address inside its namespace.
    address: str
    prefixlen: int = SUBNET_PREFIXLEN

    @property
    def chain(self) -> str:
        """The crew's nftables chain."""
        return chain_name(self.ifname)


def check_crew_id(crew: str) -> str:
    if not isinstance(crew, str) or not _CREW_ID.fullmatch(crew):
        raise NetConfigError(
            f"crew id {crew!r}: must be 1-63 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return crew


def check_instance_id(instance: str) -> str:
    if not isinstance(instance, str) or not _INSTANCE_ID.fullmatch(instance):
        raise NetConfigError(
            f"instance id {instance!r}: must be 1-16 lowercase letters, digits or '-' "
            "(not first or last)"
        )
    return instance


def instance_tag(instance: str) -> str:
    """The instance's mark in interface names: 3 characters of base32 (a-z, 2-7)."""
    digest = hashlib.sha256(check_instance_id(instance).encode()).digest()
    return base64.b32encode(digest).decode().lower()[:INSTANCE_TAG_LENGTH]


class Naming(msgspec.Struct, frozen=True):
    """The names of an appliance's kernel objects: its nftables table (family inet) and the
    prefix of its interfaces. `instance` is None for names taken from the config as they are
    (a bare `CrewNetworks`, and the state of an appliance from before instance ids)."""

    table: str
    ifname_prefix: str
    instance: str | None = None


def naming(table: str, ifname_prefix: str, instance: str | None) -> Naming:
    """The configured table and prefix, marked with the instance id (if any)."""
    if instance is None:
        return Naming(table, ifname_prefix)
    table = f"{table}_{instance.replace('-', '_')}"
    return Naming(table, ifname_prefix + instance_tag(instance), instance)


def interface_name(prefix: str, crew: str) -> str:
    """Deterministic, length-safe host interface name for a crew."""
    digest = hashlib.sha256(crew.encode()).hexdigest()
    return prefix + digest[: IFNAME_MAX - len(prefix)]


def chain_name(ifname: str) -> str:
    return f"crew_{ifname}"


def capture_chain_name(ifname: str) -> str:
    """The crew's transparent-capture chain (netns/nft.py)."""
    return f"capture_{ifname}"


def parse_pool(pool: str) -> ipaddress.IPv4Network:
    network = ipaddress.ip_network(pool, strict=True)
    assert isinstance(network, ipaddress.IPv4Network)
    return network


def capacity(pool: ipaddress.IPv4Network) -> int:
    return int(pool.num_addresses) // SUBNET_SIZE


def plan_for(pool: ipaddress.IPv4Network, prefix: str, crew: str, index: int) -> CrewPlan:
    if not 0 <= index < capacity(pool):
        raise PoolExhaustedError(f"subnet index {index} is outside pool {pool}")
    base = pool.network_address + SUBNET_SIZE * index
    subnet = ipaddress.IPv4Network((base, SUBNET_PREFIXLEN))
    return CrewPlan(
        crew=crew,
        index=index,
        ifname=interface_name(prefix, crew),
        subnet=str(subnet),
        gateway=str(base + 1),
        address=str(base + 2),
    )


def first_free_index(
    pool: ipaddress.IPv4Network,
    taken: Iterable[int],
    in_use_on_host: Callable[[ipaddress.IPv4Network], bool],
) -> int:
    """The lowest subnet index not recorded in the state and not used by the host.

    Never hands out a subnet that the host already uses (an address, or a route other than the
    default route): such a subnet is skipped, not taken.
    """
    held = set(taken)
    for index in range(capacity(pool)):
        if index in held:
            continue
        subnet = ipaddress.IPv4Network((pool.network_address + SUBNET_SIZE * index, 30))
        if not in_use_on_host(subnet):
            return index
    raise PoolExhaustedError(
        f"address pool {pool} is exhausted ({len(held)} crews allocated, the rest in use)"
    )


class HostUse(msgspec.Struct, frozen=True):
    """One address or route of the host, described for an error message."""

    network: str
    what: str


def pool_conflicts(pool: ipaddress.IPv4Network, uses: Iterable[HostUse]) -> tuple[str, ...]:
    """Descriptions of the host uses that overlap the pool.

    A default route (prefix length 0) overlaps everything and means nothing here: a more
    specific connected route of a crew always wins over it. Any other overlapping route or
    address could capture a crew's traffic or be captured by it, so it is a conflict.
    """
    found: list[str] = []
    for use in uses:
        network = ipaddress.ip_network(use.network, strict=False)
        if not isinstance(network, ipaddress.IPv4Network) or network.prefixlen == 0:
            continue
        if network.overlaps(pool):
            found.append(use.what)
    return tuple(found)
