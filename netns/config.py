"""The network configuration of the crews: one frozen msgspec Struct, validated with key names.

Theory of operation: the control plane embeds a `NetConfig` in its own configuration (or builds
one in code); `validate_config` checks what the types cannot express and raises
`NetConfigError` naming the key, in the manner of `proxycore/config.py`. Nothing here touches
the kernel: whether the pool collides with the host is checked by `CrewNetworks.reconcile` at
every start, against the host as it is then.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

import msgspec

from .errors import NetConfigError

# The proxy core's default port (proxycore/config.py DEFAULT_PORT); repeated here because netns/
# imports nothing from proxycore/ (docs/architecture.md).
DEFAULT_PROXY_PORT = 9119
# A /16 inside the shared address space of RFC 6598 (100.64.0.0/10): never routed on the public
# internet, rarely used on a LAN. The top /16 of the range, because carrier-grade NAT and
# overlay networks (Tailscale) hand out addresses from the bottom or at random; `reconcile`
# refuses the pool if the host uses any part of it anyway.
DEFAULT_POOL = "100.127.0.0/16"
# Between conntrack (-200, so `ct state` is known) and destination NAT (-100, so a crew's packet
# is judged by the address it was sent to, before any DNAT rule of Docker or another tool could
# rewrite it). -150 is the "mangle" priority; see nft(8), "CHAINS", standard priority names.
DEFAULT_PRIORITY = -150
# One below it: the capture chain's (the destination NAT of a crew's captured ports to the
# proxy), which orders it before other nat chains (Docker's DNAT at -100) inside the kernel's
# NAT hook, and must stay after conntrack.
PRIORITY_RANGE = (-198, -101)
# TCP ports whose connections from a crew to anywhere go to the proxy (transparent capture,
# docs/netns.md "Transparent capture"): HTTP and HTTPS.
DEFAULT_CAPTURE_PORTS = (80, 443)

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]

# IFNAMSIZ is 16 bytes with the terminating NUL (include/uapi/linux/if.h): 15 usable characters.
IFNAME_MAX = 15
_PREFIX = re.compile(r"[a-z][a-z0-9]{1,5}")
_TABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
_IFNAME = re.compile(r"[A-Za-z0-9_.-]{1,15}")


class NetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # IPv4 network the per-crew /30 subnets are cut from.
    pool: str = DEFAULT_POOL
    # TCP ports a crew may reach on its own gateway address (the proxy's listeners).
    proxy_ports: tuple[Port, ...] = (DEFAULT_PROXY_PORT,)
    # The nftables table (family inet) owned by the appliance; tests use their own.
    table: str = "appliance"
    # Host-side interface names are this prefix plus a hash of the crew id; every interface
    # with this prefix is the appliance's (orphans are deleted at start).
    ifname_prefix: str = "apx"
    # The crew end's name inside its namespace.
    inner_ifname: str = "eth0"
    # Priority of the prerouting and forward base chains.
    priority: int = DEFAULT_PRIORITY
    # A crew's TCP to these ports, anywhere but its own allow rules and the pool, is redirected
    # to the proxy on its gateway (the first of `proxy_ports`); () turns capture off.
    capture_ports: tuple[Port, ...] = DEFAULT_CAPTURE_PORTS
    # Each crew resolves names through its own DNS responder on its gateway, port 53 (UDP and
    # TCP), served by the proxy workers: the crew's filter lets that in, and applianced binds
    # the port and points the crew's /etc/resolv.conf at it (docs/proxy.md "DNS").
    dns: bool = True
    # Log dropped packets to the kernel log with a prefix naming the crew, rate limited.
    log_drops: bool = False
    log_rate_per_minute: Annotated[int, msgspec.Meta(ge=1, le=600)] = 6


def validate_config(config: NetConfig) -> NetConfig:
    """Check what the types cannot; returns the config, or raises NetConfigError naming the key."""

    def fail(key: str, why: str) -> NetConfigError:
        return NetConfigError(f"network config: `{key}`: {why}")

    try:
        pool = ipaddress.ip_network(config.pool, strict=True)
    except ValueError as exc:
        raise fail("pool", f"not a network address: {exc}") from None
    if not isinstance(pool, ipaddress.IPv4Network):
        # Crews get no IPv6 at all (docs/netns.md, threat model).
        raise fail("pool", "must be an IPv4 network")
    if pool.prefixlen > 29:
        raise fail("pool", "must hold at least two /30 subnets (prefix length <= 29)")
    if not config.proxy_ports:
        raise fail("proxy_ports", "needs at least one port")
    if len(set(config.proxy_ports)) != len(config.proxy_ports):
        raise fail("proxy_ports", "duplicate port")
    if len(set(config.capture_ports)) != len(config.capture_ports):
        raise fail("capture_ports", "duplicate port")
    if set(config.capture_ports) & set(config.proxy_ports):
        raise fail("capture_ports", "a proxy port cannot be captured (it is the proxy's own)")
    if not _TABLE.fullmatch(config.table):
        raise fail("table", "must be 1-32 letters, digits or '_', not starting with a digit")
    if not _PREFIX.fullmatch(config.ifname_prefix):
        raise fail("ifname_prefix", "must be 2-6 lowercase letters or digits, starting a letter")
    if not _IFNAME.fullmatch(config.inner_ifname) or config.inner_ifname in {".", ".."}:
        raise fail("inner_ifname", "must be a valid interface name (1-15 characters)")
    low, high = PRIORITY_RANGE
    if not low <= config.priority <= high:
        raise fail(
            "priority",
            f"must be in [{low}, {high}]: after conntrack (-200) and the capture chain (one "
            "below it), before destination NAT (-100)",
        )
    return config
