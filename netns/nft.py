"""The appliance's nftables table: its layout, its transactions and how it is read back.

Theory of operation
-------------------
Everything the appliance does to nftables is one JSON document (libnftables-json(5)) applied as
one transaction: libnftables sends the whole batch to the kernel, which commits all of it or
none of it (nf_tables keeps two generations of the ruleset and switches between them at commit),
so a packet sees either the old ruleset or the new one and a refused batch leaves the old one in
place. Nothing outside the table named in the configuration is ever touched; the ruleset is
never flushed.

Layout (family inet, so one table sees IPv4 and IPv6)::

    map   crew_ingress   ifname : verdict        "apx3f2a..." : jump crew_apx3f2a...
    chain prerouting     hook prerouting, priority -150
            iifname vmap @crew_ingress                           one hash lookup per packet
            iifname "apx*" counter name unmapped_drops drop      a crew interface with no chain
            iifname "lo" ip daddr <pool> icmp type destination-unreachable
                icmp code admin-prohibited ct state related accept      the refusal, going back
            iifname "lo" ip daddr <pool> counter name foreign_to_pool
                reject with icmpx admin-prohibited                     the host is not a crew
            ip daddr <pool> counter name foreign_to_pool drop          nor is anything else
    chain forward        hook forward, priority -150
            iifname vmap @crew_ingress                           the crew's chain, again
            iifname "apx*" counter name forward_from_crews drop
            oifname "apx*" ct direction reply ct state {established, related} accept
            oifname "apx*" counter name forward_to_crews drop
    chain postrouting    type nat hook postrouting, priority 100 (srcnat)
            ip saddr <pool> oifname != "apx*" masquerade           the pool is not routable
    set   allow_<ifname>, deny_<ifname>   (two per crew)
            type ipv4_addr . inet_proto . inet_service; flags interval
    chain crew_<ifname>  (one per crew, reached only through the map)
            ip saddr <crew> ip daddr <gateway> tcp dport {ports} ct state {new, established}
                counter accept
            ip daddr <pool> counter drop                         no crew reaches another
            ip daddr . meta l4proto . th dport @deny_<ifname> counter drop
            ip saddr <crew> ip daddr . meta l4proto . th dport @allow_<ifname>
                ct state {new, established} counter accept
            [limit rate N/minute log prefix "<prefix> drop <crew>: "]
            counter drop

Address rules (docs/netns.md "Address rules", netns/netrules.py): a crew's allow and deny rules
are the elements of its two sets, deny looked up first (deny wins), and the pool dropped before
either (no rule reaches another crew). A packet the crew's chain accepts for an address that is
not the host's own is forwarded: the forward chain sends it through the same map to the same
chain, which judges it the same way (its counters count it twice), and masquerades it on the
way out (the pool is not routable; the reply is de-masqueraded by conntrack after the
prerouting chain has seen it addressed to the host, so the pool rules do not catch it). Replies
go back to a crew only for connections the crew opened (conntrack's reply direction). UDP and
any port other than the proxy's leave only where an allow rule names them. A rule change
replaces the crew's two sets (flush, add: `Layout.set_rules`), a batch whose size depends on
the crew's own rules, not on how many crews there are; no chain is rebuilt. Forwarding also
needs the host end's `forwarding` sysctl, set on only for a crew with an allow rule (kernel.py),
and a host that forwards replies on its uplink (`net.ipv4.ip_forward=1`, as on a Docker host).

A packet from a crew interface is judged in prerouting, before the routing decision: the same
rules therefore stop traffic to the host's own addresses (which would go to the input hook) and
traffic to anywhere else (which would be forwarded), nothing depends on whether the host has
IP forwarding on, every dropped packet is counted, and the host never answers with an ICMP
error from its routing code. The forward chain is a second, independent layer: nothing is ever
forwarded from or to an interface with the appliance's prefix, whatever the map holds.

The pool belongs to the crews alone. A crew's gateway is an address of the host, and the proxy
knows a crew by the gateway its connection arrives on; but the kernel accepts a packet for a
local address on any interface (the weak host model, RFC 1122 3.3.4.2), so without more any
process on the host (its packets to a local address come in on "lo") or any machine with a route
to the pool could reach a gateway and be served as that crew. Every packet from a crew interface
has had its verdict from the crew's chain or the catch-all by the time the last three rules see
a packet, so whatever they see came in on some other interface: addressed to the pool, it is
refused. From the host itself, rejected, so that a client there fails at once instead of waiting
out its connect timeout: ICMP destination unreachable, code 13, communication administratively
prohibited (RFC 1812 5.2.7.1), which says "filtered" where a TCP reset would say "nothing
listens here", covers every protocol with one rule, and makes Linux abort a connect in SYN-SENT
with EHOSTUNREACH (tcp_v4_err). That error comes back in on "lo" addressed to the pool (for a
local destination the host picks that address as the source, unless the client bound another),
so the rule before it lets exactly those through: ICMP errors of that code that conntrack
relates to a connection it knows, which an unprivileged process cannot forge (no raw sockets)
and which carry no byte to a listener. From anywhere else (the LAN, another appliance's crews),
dropped like everything a crew may not send: nothing is sent back, neither to the LAN nor into
another appliance's crew. Each table covers its own pool only, so an appliance never judges
another's crews' traffic to their own gateways; `pool_claims` reads the pool back from the
rules, so that an appliance whose pool overlaps another's refuses to start.

Every other packet the host receives meets the map lookup and four comparisons (the input
interface's name three times, the destination once) and leaves the table accepted.

The per-packet cost is one hash lookup plus the crew's own three rules, and adding or removing a
crew is a constant-size batch (its chain and one map element), so neither grows with the number
of crews (the issue's benchmark target).

Every batch starts with the same idempotent prelude (add table, map, counters and base chains;
flush the base chains and re-add their rules): a batch that adds a crew can therefore never leave
that crew's interface unfiltered, even if the table was deleted behind the appliance's back.
Named counters keep the base counts across these re-adds.

Every rule carries a comment "<role> ... v=<fingerprint of its expression>", so reconciliation
compares comments, not nft's normalized rendering of expressions: a rule changed, added or
removed by hand shows up as a different list of comments.

Backends: libnftables through ctypes (the library every `nft` binary links; the same calls as
Debian's python3-nftables binding), or the `nft -j -f -` command if the library cannot be loaded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import ipaddress
import json
import shutil
import subprocess
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .addressing import CrewPlan, capture_chain_name, chain_name
from .errors import NftError
from .netrules import ACTIONS, Box, NetRule, elements

Json = dict[str, Any]

FAMILY = "inet"
MAP = "crew_ingress"
PREROUTING = "prerouting"
FORWARD = "forward"
POSTROUTING = "postrouting"
CREW_CHAIN_PREFIX = "crew_"
# Transparent capture: a nat base chain dispatching, through its own map, to one chain per crew
# that redirects the crew's captured ports to the proxy on its gateway.
CAPTURE = "capture"
CAPTURE_MAP = "crew_capture"
CAPTURE_CHAIN_PREFIX = "capture_"
# A crew's address rules: two interval sets per crew, "allow_<ifname>" and "deny_<ifname>".
SET_PREFIXES = tuple(f"{action}_" for action in ACTIONS)
SET_TYPE = ("ipv4_addr", "inet_proto", "inet_service")
COUNTERS = ("unmapped_drops", "forward_from_crews", "forward_to_crews", "foreign_to_pool")
# The roles of the rules that refuse packets to the pool from elsewhere: from anywhere (its
# comment names the pool, read by `pool_claims`), and from the host itself.
FOREIGN_ROLE = "foreign"
LOCAL_ROLE = "foreign-local"
# Bumped when the layout changes, so that reconciliation rebuilds tables of an older layout
# (2: the pool refused to everything but the crews' own interfaces; 3: address rules, their
# sets, the forward dispatch and the masquerade; 4: transparent capture).
LAYOUT_VERSION = 4
# The port of a crew's DNS on its gateway (NetConfig.dns). Its rule is one more in the crew's
# chain: reconciliation compares a chain's comments, so adding or removing it rebuilds the chain
# without a new layout version.
DNS_PORT = 53


class NftBackend(Protocol):
    """Applies one JSON batch atomically; returns the `nftables` array of its output."""

    def run(self, commands: Sequence[Json]) -> list[Json]: ...


def _decode_output(text: str) -> list[Json]:
    if not text.strip():
        return []
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise NftError(f"unreadable JSON output from nftables: {exc}") from None
    items = document.get("nftables", []) if isinstance(document, dict) else []
    return [item for item in items if isinstance(item, dict)]


class LibNftables:
    """libnftables through ctypes; one context, used under a lock (it is not thread-safe)."""

    # include/nftables/libnftables.h: enum nft_output_flags.
    _OUTPUT_JSON = 1 << 4

    def __init__(self, library: str | None = None) -> None:
        name = library or ctypes.util.find_library("nftables") or "libnftables.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            raise NftError(f"cannot load libnftables ({name}): {exc}") from None
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        ctx = lib.nft_ctx_new(0)  # NFT_CTX_DEFAULT
        if not ctx:
            raise NftError("nft_ctx_new failed")
        # With JSON output set, libnftables also parses its input as JSON (libnftables(3)).
        lib.nft_ctx_output_set_flags(ctx, self._OUTPUT_JSON)
        if lib.nft_ctx_buffer_output(ctx) != 0 or lib.nft_ctx_buffer_error(ctx) != 0:
            lib.nft_ctx_free(ctx)
            raise NftError("cannot buffer libnftables output")
        self._lib = lib
        self._ctx: int | None = ctx
        self._lock = threading.Lock()

    def run(self, commands: Sequence[Json]) -> list[Json]:
        payload = json.dumps({"nftables": list(commands)}).encode()
        with self._lock:
            if self._ctx is None:
                raise NftError("libnftables context is closed")
            rc = self._lib.nft_run_cmd_from_buffer(self._ctx, payload)
            output = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode()
            error = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode()
        if rc != 0:
            raise NftError(error or f"libnftables returned {rc}")
        return _decode_output(output)

    def close(self) -> None:
        with self._lock:
            if self._ctx is not None:
                self._lib.nft_ctx_free(self._ctx)
                self._ctx = None


class NftCli:
    """The `nft` command, reading the batch as JSON on standard input."""

    def __init__(self, binary: str = "nft") -> None:
        path = shutil.which(binary)
        if path is None:
            raise NftError(f"{binary} not found on PATH")
        self.binary = path

    def run(self, commands: Sequence[Json]) -> list[Json]:
        payload = json.dumps({"nftables": list(commands)})
        try:
            done = subprocess.run(
                [self.binary, "-j", "-f", "-"],
                input=payload,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NftError(f"cannot run {self.binary}: {exc}") from None
        if done.returncode != 0:
            raise NftError(done.stderr or f"{self.binary} exited with {done.returncode}")
        return _decode_output(done.stdout)

    def close(self) -> None:
        pass


def default_backend() -> LibNftables | NftCli:
    try:
        return LibNftables()
    except NftError:
        return NftCli()


# --- building batches -----------------------------------------------------------------------------


def _fingerprint(value: object) -> str:
    canonical = json.dumps([LAYOUT_VERSION, value], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def _match(left: Json, right: object) -> Json:
    return {"match": {"op": "==", "left": left, "right": right}}


def _in(left: Json, right: object) -> Json:
    """A flag match: `ct state related`, `ct state { new, established }`."""
    return {"match": {"op": "in", "left": left, "right": right}}


def _ct(key: str) -> Json:
    return {"ct": {"key": key}}


def _meta(key: str) -> Json:
    return {"meta": {"key": key}}


def _payload(protocol: str, name: str) -> Json:
    return {"payload": {"protocol": protocol, "field": name}}


def set_name(action: str, ifname: str) -> str:
    return f"{action}_{ifname}"


def _element(box: Box) -> Json:
    """One set element as libnftables-json writes it: the address range (a prefix when it is
    one, as the kernel lists it back), the protocol, the port range."""
    first, last = ipaddress.IPv4Address(box.first), ipaddress.IPv4Address(box.last)
    address: object
    if first == last:
        address = str(first)
    else:
        networks = list(ipaddress.summarize_address_range(first, last))
        if len(networks) == 1:
            address = {
                "prefix": {"addr": str(networks[0].network_address), "len": networks[0].prefixlen}
            }
        else:
            address = {"range": [str(first), str(last)]}
    port: object = box.low if box.low == box.high else {"range": [box.low, box.high]}
    return {"concat": [address, box.protocol, port]}


def _read_address(value: object) -> tuple[int, int]:
    if isinstance(value, str):
        number = int(ipaddress.IPv4Address(value))
        return number, number
    if isinstance(value, dict) and isinstance(value.get("prefix"), dict):
        network = ipaddress.IPv4Network(
            f"{value['prefix']['addr']}/{value['prefix']['len']}", strict=False
        )
        return int(network.network_address), int(network.broadcast_address)
    if isinstance(value, dict) and isinstance(value.get("range"), list):
        low, high = value["range"]
        return int(ipaddress.IPv4Address(low)), int(ipaddress.IPv4Address(high))
    raise ValueError(f"address {value!r}")


def _read_port(value: object) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    if isinstance(value, dict) and isinstance(value.get("range"), list):
        low, high = value["range"]
        return int(low), int(high)
    raise ValueError(f"port {value!r}")


def read_element(value: object) -> Box | None:
    """A set element as the kernel lists it, or None if it is not one the appliance writes."""
    if isinstance(value, dict) and isinstance(value.get("elem"), dict):
        value = value["elem"].get("val")  # an element listed with its own attributes
    if not isinstance(value, dict) or not isinstance(value.get("concat"), list):
        return None
    try:
        address, protocol, port = value["concat"]
        first, last = _read_address(address)
        low, high = _read_port(port)
    except (ValueError, TypeError, KeyError):
        return None
    return Box(str(protocol), first, last, low, high)


@dataclass(frozen=True)
class RuleSpec:
    """A rule as the appliance writes it: its expression and the comment that identifies it."""

    role: str
    expr: tuple[Json, ...]
    label: str = ""

    @property
    def comment(self) -> str:
        label = f" {self.label}" if self.label else ""
        return f"{self.role}{label} v={_fingerprint(self.expr)}"


@dataclass(frozen=True)
class Layout:
    """The table's desired shape for one configuration; builds every batch."""

    table: str
    priority: int
    ifname_prefix: str
    proxy_ports: tuple[int, ...]
    # The crews' pool (an IPv4 network, "100.127.0.0/16"): refused to everything but the
    # crews' own interfaces.
    pool: str
    log_drops: bool = False
    log_rate_per_minute: int = 6
    # TCP ports captured to the proxy (NetConfig.capture_ports); () for none.
    capture_ports: tuple[int, ...] = ()
    # The crew's DNS on its gateway, port 53 (NetConfig.dns).
    dns: bool = False
    # Written into the dispatch rule's comment ("instance=<id> owner=<token>"): whose table
    # this is, read back by `table_claim` (nftables 1.0.6 neither writes nor reads a table's
    # own comment through JSON, rule comments it does).
    claim: str = ""

    def _obj(self, **fields: object) -> Json:
        return {"family": FAMILY, "table": self.table, **fields}

    def _pool_match(self) -> Json:
        network = ipaddress.IPv4Network(self.pool)
        return _match(
            _payload("ip", "daddr"),
            {"prefix": {"addr": str(network.network_address), "len": network.prefixlen}},
        )

    # The base: table, map, counters, hooked chains.

    def base_rules(self) -> dict[str, tuple[RuleSpec, ...]]:
        wildcard = self.ifname_prefix + "*"  # nft(8): a trailing '*' matches by prefix
        network = ipaddress.IPv4Network(self.pool)
        to_pool = _match(
            _payload("ip", "daddr"),
            {"prefix": {"addr": str(network.network_address), "len": network.prefixlen}},
        )
        return {
            PREROUTING: (
                RuleSpec(
                    "dispatch",
                    ({"vmap": {"key": _meta("iifname"), "data": "@" + MAP}},),
                    self.claim,
                ),
                # An interface with the appliance's prefix whose crew has no chain (yet, or
                # any more): fail closed.
                RuleSpec(
                    "unmapped",
                    (_match(_meta("iifname"), wildcard), {"counter": COUNTERS[0]}, {"drop": None}),
                ),
                # Whatever reaches the rules below did not come in on one of this table's
                # crew interfaces (their packets have had their verdict): nothing else may
                # reach the pool, its gateways above all (the proxy knows a crew by them).
                # First, the refusal of the next rule on its way back to a client on the
                # host: it comes in on "lo" addressed to the pool too (the module's docstring).
                RuleSpec(
                    "refusals",
                    (
                        _match(_meta("iifname"), "lo"),
                        to_pool,
                        _match(_payload("icmp", "type"), "destination-unreachable"),
                        _match(_payload("icmp", "code"), "admin-prohibited"),
                        _in(_ct("state"), "related"),
                        {"accept": None},
                    ),
                ),
                # From the host itself (in on "lo"): refused, so that the client fails at once.
                RuleSpec(
                    LOCAL_ROLE,
                    (
                        _match(_meta("iifname"), "lo"),
                        to_pool,
                        {"counter": COUNTERS[3]},
                        {"reject": {"type": "icmpx", "expr": "admin-prohibited"}},
                    ),
                    str(network),
                ),
                # From anywhere else (the LAN, another appliance's crews): dropped, like
                # everything a crew may not send.
                RuleSpec(
                    FOREIGN_ROLE,
                    (to_pool, {"counter": COUNTERS[3]}, {"drop": None}),
                    str(network),
                ),
            ),
            FORWARD: (
                # A crew's packet to be forwarded meets its chain again: accepted only where
                # one of its allow rules names the destination (an interface without a chain
                # falls through to the drop below).
                RuleSpec("forward", ({"vmap": {"key": _meta("iifname"), "data": "@" + MAP}},)),
                RuleSpec(
                    "from-crews",
                    (_match(_meta("iifname"), wildcard), {"counter": COUNTERS[1]}, {"drop": None}),
                ),
                # Back to a crew: only the replies of connections it opened (and their ICMP
                # errors), which an allow rule let out.
                RuleSpec(
                    "replies",
                    (
                        _match(_meta("oifname"), wildcard),
                        _match(_ct("direction"), "reply"),
                        _in(_ct("state"), ["established", "related"]),
                        {"accept": None},
                    ),
                ),
                RuleSpec(
                    "to-crews",
                    (_match(_meta("oifname"), wildcard), {"counter": COUNTERS[2]}, {"drop": None}),
                ),
            ),
            CAPTURE: (
                RuleSpec(
                    "capture", ({"vmap": {"key": _meta("iifname"), "data": "@" + CAPTURE_MAP}},)
                ),
            ),
            # The pool is not routable beyond this host: what a crew sends out, forwarded, leaves
            # with the host's address. Matched by source (postrouting knows no input interface);
            # only crews' packets that their chain accepted are forwarded from the pool.
            POSTROUTING: (
                RuleSpec(
                    "masquerade",
                    (
                        _match(
                            _payload("ip", "saddr"),
                            {
                                "prefix": {
                                    "addr": str(network.network_address),
                                    "len": network.prefixlen,
                                }
                            },
                        ),
                        {"match": {"op": "!=", "left": _meta("oifname"), "right": wildcard}},
                        {"masquerade": None},
                    ),
                ),
            ),
        }

    def base_chain_spec(self, name: str) -> Json:
        if name == CAPTURE:
            # The kernel runs every nat chain inside its own NAT hook (at -100, after the
            # crew's filter chain at `priority`, whatever this number says: see `_captured`);
            # among the nat chains, this one comes first (before Docker's DNAT at -100), so a
            # crew's captured connection goes to the proxy on its gateway, which reads where it
            # was going from conntrack (SO_ORIGINAL_DST).
            return self._obj(
                name=name, type="nat", hook="prerouting", prio=self.priority - 1, policy="accept"
            )
        if name == POSTROUTING:
            # srcnat (nft(8)): after the filter chains, where the source NAT hooks belong.
            return self._obj(name=name, type="nat", hook="postrouting", prio=100, policy="accept")
        hook = {PREROUTING: "prerouting", FORWARD: "forward"}[name]
        return self._obj(name=name, type="filter", hook=hook, prio=self.priority, policy="accept")

    def prelude(self) -> list[Json]:
        """Idempotent: creates what is missing and rewrites the base chains' rules."""
        commands: list[Json] = [
            {"add": {"table": {"family": FAMILY, "name": self.table}}},
            {"add": {"map": self._obj(name=MAP, type="ifname", map="verdict")}},
            {"add": {"map": self._obj(name=CAPTURE_MAP, type="ifname", map="verdict")}},
        ]
        commands += [{"add": {"counter": self._obj(name=name)}} for name in COUNTERS]
        for chain, rules in self.base_rules().items():
            commands.append({"add": {"chain": self.base_chain_spec(chain)}})
            commands.append({"flush": {"chain": self._obj(name=chain)}})
            commands += [self._rule(chain, rule) for rule in rules]
        return commands

    def _rule(self, chain: str, rule: RuleSpec) -> Json:
        return {"add": {"rule": self._obj(chain=chain, comment=rule.comment, expr=list(rule.expr))}}

    # One crew.

    def crew_rules(self, plan: CrewPlan) -> tuple[RuleSpec, ...]:
        ports: object = (
            self.proxy_ports[0] if len(self.proxy_ports) == 1 else {"set": list(self.proxy_ports)}
        )
        allow = RuleSpec(
            "allow",
            (
                # The crew's own source address: a crew cannot speak for another one, even
                # with raw sockets (the proxy identifies crews by gateway, this is defence in
                # depth against blind spoofing).
                _match(_payload("ip", "saddr"), plan.address),
                _match(_payload("ip", "daddr"), plan.gateway),
                _match(_payload("tcp", "dport"), ports),
                # New connections and the rest of the connections they open; "invalid" and
                # "related" (ICMP errors, helpers) are not needed by a TCP client of the proxy.
                _in(_ct("state"), ["new", "established"]),
                {"counter": None},
                {"accept": None},
            ),
            plan.crew,
        )
        lookup = {"concat": [_payload("ip", "daddr"), _meta("l4proto"), _payload("th", "dport")]}
        rules = [allow]
        if self.dns:
            # The crew's DNS responder (served by the proxy workers on its gateway), UDP and
            # TCP, as for the proxy's port: only from the crew's own address, and only what the
            # crew opens (no "related": it has no use for ICMP errors to its resolver).
            rules.append(
                RuleSpec(
                    "dns",
                    (
                        _match(_payload("ip", "saddr"), plan.address),
                        _match(_payload("ip", "daddr"), plan.gateway),
                        _match(_meta("l4proto"), {"set": ["tcp", "udp"]}),
                        _match(_payload("th", "dport"), DNS_PORT),
                        _in(_ct("state"), ["new", "established"]),
                        {"counter": None},
                        {"accept": None},
                    ),
                    plan.crew,
                )
            )
        rules += [
            # No crew reaches another crew or its gateway, whatever its rules say (they are
            # refused at input too: netrules.parse_rules).
            RuleSpec("to-pool", (self._pool_match(), {"counter": None}, {"drop": None}), plan.crew),
            RuleSpec(
                "net-deny",
                (
                    _match(lookup, "@" + set_name("deny", plan.ifname)),
                    {"counter": None},
                    {"drop": None},
                ),
                plan.crew,
            ),
            RuleSpec(
                "net-allow",
                (
                    _match(_payload("ip", "saddr"), plan.address),
                    _match(lookup, "@" + set_name("allow", plan.ifname)),
                    _in(_ct("state"), ["new", "established"]),
                    {"counter": None},
                    {"accept": None},
                ),
                plan.crew,
            ),
        ]
        if self.capture_ports:
            rules.append(self._captured(plan))
        if self.log_drops:
            rules.append(
                RuleSpec(
                    "log",
                    (
                        {"limit": {"rate": self.log_rate_per_minute, "per": "minute", "burst": 5}},
                        {
                            "log": {
                                "prefix": f"{self.ifname_prefix} drop {plan.crew}: ",
                                "level": "info",
                            }
                        },
                    ),
                    plan.crew,
                )
            )
        rules.append(RuleSpec("drop", ({"counter": None}, {"drop": None}), plan.crew))
        return tuple(rules)

    def _captured(self, plan: CrewPlan) -> RuleSpec:
        """The filter's side of capture: a crew's TCP to a captured port is let on to the
        destination NAT (the capture chain, which the kernel runs inside its NAT hook at -100,
        after this chain), which sends it to the proxy. Only before routing: the output
        interface is known in the forward hook and nowhere before it, so `oif 0` holds in
        prerouting only, and a packet the NAT did not redirect (its capture chain gone) meets
        this chain again in forward and is dropped there, never forwarded (fail closed)."""
        ports: object = (
            self.capture_ports[0]
            if len(self.capture_ports) == 1
            else {"set": list(self.capture_ports)}
        )
        return RuleSpec(
            "captured",
            (
                _match(_meta("oif"), 0),
                # Not to an address of the host itself: such a packet goes to local input, not
                # forward, and this table has no input chain, so without the NAT (its capture
                # chain gone) it would reach whatever listens there on 80 or 443. The host's
                # services are for no crew (their own allow rules aside, judged above).
                {
                    "match": {
                        "op": "!=",
                        "left": {"fib": {"result": "type", "flags": ["daddr"]}},
                        "right": "local",
                    }
                },
                _match(_payload("ip", "saddr"), plan.address),
                _match(_payload("tcp", "dport"), ports),
                _in(_ct("state"), ["new", "established"]),
                {"counter": None},
                {"accept": None},
            ),
            plan.crew,
        )

    def capture_rules(self, plan: CrewPlan) -> tuple[RuleSpec, ...]:
        """The crew's capture chain: its own allow rules first (what they name is reached
        directly, not through the proxy), then its deny rules (left to the filter chain, which
        drops them: deny wins in the kernel too), then the captured ports to anywhere but the
        pool, redirected to the proxy on the crew's gateway. Nothing captured without ports."""
        if not self.capture_ports:
            return ()
        lookup = {"concat": [_payload("ip", "daddr"), _meta("l4proto"), _payload("th", "dport")]}
        ports: object = (
            self.capture_ports[0]
            if len(self.capture_ports) == 1
            else {"set": list(self.capture_ports)}
        )
        return (
            RuleSpec(
                "capture-direct",
                (_match(lookup, "@" + set_name("allow", plan.ifname)), {"return": None}),
                plan.crew,
            ),
            RuleSpec(
                "capture-denied",
                (_match(lookup, "@" + set_name("deny", plan.ifname)), {"return": None}),
                plan.crew,
            ),
            RuleSpec(
                "capture",
                (
                    _match(_payload("ip", "saddr"), plan.address),
                    {"match": {"op": "!=", "left": _payload("ip", "daddr"), "right": self._pool()}},
                    _match(_payload("tcp", "dport"), ports),
                    {"counter": None},
                    {"dnat": {"family": "ip", "addr": plan.gateway, "port": self.proxy_ports[0]}},
                ),
                plan.crew,
            ),
        )

    def _pool(self) -> Json:
        network = ipaddress.IPv4Network(self.pool)
        return {"prefix": {"addr": str(network.network_address), "len": network.prefixlen}}

    def _capture_objects(self, plan: CrewPlan) -> list[Json]:
        chain = capture_chain_name(plan.ifname)
        commands: list[Json] = [
            {"add": {"chain": self._obj(name=chain)}},
            {"flush": {"chain": self._obj(name=chain)}},
        ]
        commands += [self._rule(chain, rule) for rule in self.capture_rules(plan)]
        commands.append(
            {
                "add": {
                    "element": self._obj(
                        name=CAPTURE_MAP, elem=[[plan.ifname, {"jump": {"target": chain}}]]
                    )
                }
            }
        )
        return commands

    def _set_objects(self, ifname: str, rules: Sequence[NetRule]) -> list[Json]:
        """The crew's two sets, created if missing and given exactly the rules' elements."""
        commands: list[Json] = []
        for action in ACTIONS:
            name = set_name(action, ifname)
            commands += [
                {"add": {"set": self._obj(name=name, type=list(SET_TYPE), flags=["interval"])}},
                {"flush": {"set": self._obj(name=name)}},
            ]
            boxes = elements(rules, action)
            if boxes:
                elem = [_element(box) for box in boxes]
                commands.append({"add": {"element": self._obj(name=name, elem=elem)}})
        return commands

    def set_rules(self, plan: CrewPlan, rules: Sequence[NetRule]) -> list[Json]:
        """A rule change: the crew's sets replaced in one transaction, nothing else touched.
        At most six commands, whatever the number of crews (no prelude: a table that is gone
        makes the batch fail, and reconcile rebuilds it)."""
        return self._set_objects(plan.ifname, rules)

    def _crew_objects(self, plan: CrewPlan, rules: Sequence[NetRule] = ()) -> list[Json]:
        chain = plan.chain
        # The sets before the rules that look them up.
        commands: list[Json] = self._set_objects(plan.ifname, rules)
        commands += [
            {"add": {"chain": self._obj(name=chain)}},
            {"flush": {"chain": self._obj(name=chain)}},
        ]
        commands += [self._rule(chain, rule) for rule in self.crew_rules(plan)]
        commands.append(
            {
                "add": {
                    "element": self._obj(
                        name=MAP, elem=[[plan.ifname, {"jump": {"target": chain}}]]
                    )
                }
            }
        )
        # After the sets its rules look up.
        return commands + self._capture_objects(plan)

    def install_crew(self, plan: CrewPlan, rules: Sequence[NetRule] = ()) -> list[Json]:
        """The crew's sets, chain and map element, with the prelude: one atomic batch."""
        return [*self.prelude(), *self._crew_objects(plan, rules)]

    def _remove_objects(self, ifname: str) -> list[Json]:
        chain = chain_name(ifname)
        # add-then-delete makes the removal idempotent: it succeeds whether or not the chain and
        # the element exist. The chain is flushed before it is deleted because kernels before
        # 5.x refuse to delete a chain that still has rules (EBUSY).
        # The sets go after the chain whose rules refer to them (a set in use cannot go).
        commands: list[Json] = [
            {"add": {"chain": self._obj(name=chain)}},
            {"add": {"element": self._obj(name=MAP, elem=[[ifname, {"jump": {"target": chain}}]])}},
            {"delete": {"element": self._obj(name=MAP, elem=[ifname])}},
            {"flush": {"chain": self._obj(name=chain)}},
            {"delete": {"chain": self._obj(name=chain)}},
        ]
        capture = capture_chain_name(ifname)
        commands += [
            {"add": {"chain": self._obj(name=capture)}},
            {
                "add": {
                    "element": self._obj(
                        name=CAPTURE_MAP, elem=[[ifname, {"jump": {"target": capture}}]]
                    )
                }
            },
            {"delete": {"element": self._obj(name=CAPTURE_MAP, elem=[ifname])}},
            {"flush": {"chain": self._obj(name=capture)}},
            {"delete": {"chain": self._obj(name=capture)}},
        ]
        for action in ACTIONS:
            name = set_name(action, ifname)
            commands += [
                {"add": {"set": self._obj(name=name, type=list(SET_TYPE), flags=["interval"])}},
                {"delete": {"set": self._obj(name=name)}},
            ]
        return commands

    def remove_crew(self, ifname: str) -> list[Json]:
        return [*self.prelude(), *self._remove_objects(ifname)]

    def rebuild(
        self, plans: Iterable[CrewPlan], rules: Mapping[str, Sequence[NetRule]] | None = None
    ) -> list[Json]:
        """Replace the whole table in one transaction (add, delete, re-create)."""
        commands: list[Json] = [
            {"add": {"table": {"family": FAMILY, "name": self.table}}},
            {"delete": {"table": {"family": FAMILY, "name": self.table}}},
            *self.prelude(),
        ]
        for plan in plans:
            commands += self._crew_objects(plan, (rules or {}).get(plan.crew, ()))
        return commands

    def repair(
        self,
        install: Iterable[CrewPlan],
        remove: Iterable[str],
        rules: Mapping[str, Sequence[NetRule]] | None = None,
        refill: Iterable[CrewPlan] = (),
    ) -> list[Json]:
        """Remove crews' objects, install crews whole, and give crews whose chain is right
        but whose sets are not their rules' elements again (`refill`)."""
        commands = self.prelude()
        for ifname in remove:
            commands += self._remove_objects(ifname)
        for plan in install:
            commands += self._crew_objects(plan, (rules or {}).get(plan.crew, ()))
        for plan in refill:
            commands += self._set_objects(plan.ifname, (rules or {}).get(plan.crew, ()))
        return commands

    def drop_table(self, table: str) -> list[Json]:
        """Delete another table of this appliance (its names before a rename), idempotently."""
        return [
            {"add": {"table": {"family": FAMILY, "name": table}}},
            {"delete": {"table": {"family": FAMILY, "name": table}}},
        ]

    def remove_from(self, table: str, ifnames: Iterable[str]) -> list[Json]:
        """Remove crews' chains and map elements from another table of this appliance (one
        that other crews still use: the state of an appliance from before instance ids)."""
        other = Layout(table, self.priority, self.ifname_prefix, self.proxy_ports, self.pool)
        # A table from before transparent capture has no capture map: the removal below adds
        # and deletes an element in it, so it is made first (empty, it captures nothing).
        commands: list[Json] = [
            {"add": {"map": other._obj(name=CAPTURE_MAP, type="ifname", map="verdict")}}
        ]
        for ifname in ifnames:
            commands += other._remove_objects(ifname)
        return commands

    def list_table(self) -> list[Json]:
        return [{"list": {"table": {"family": FAMILY, "name": self.table}}}]

    def delete_table(self) -> list[Json]:
        return [
            {"add": {"table": {"family": FAMILY, "name": self.table}}},
            {"delete": {"table": {"family": FAMILY, "name": self.table}}},
        ]


# --- reading the table back -----------------------------------------------------------------------


@dataclass(frozen=True)
class RuleState:
    handle: int
    comment: str
    # Sum of the anonymous counters in the rule; named counters are in TableState.counters.
    packets: int
    bytes: int
    counter_name: str | None = None


@dataclass(frozen=True)
class ChainState:
    name: str
    hook: str | None = None
    type: str | None = None
    prio: int | None = None
    policy: str | None = None
    rules: tuple[RuleState, ...] = ()


@dataclass(frozen=True)
class TableState:
    chains: dict[str, ChainState] = field(default_factory=dict)
    # map name -> (key type, data type, {key: jump target or verdict text})
    maps: dict[str, tuple[str, str, dict[str, str]]] = field(default_factory=dict)
    counters: dict[str, tuple[int, int]] = field(default_factory=dict)
    # set name -> (its type and flags, its elements as the appliance reads them; None among
    # them for an element of a shape the appliance never writes)
    sets: dict[str, tuple[tuple[str, ...], tuple[Box | None, ...]]] = field(default_factory=dict)
    # Objects of kinds the appliance never creates (flowtables, quotas...).
    foreign: tuple[str, ...] = ()


def _verdict_text(value: object) -> str:
    if isinstance(value, dict):
        for verdict in ("jump", "goto"):
            if verdict in value and isinstance(value[verdict], dict):
                return f"{verdict} {value[verdict].get('target')}"
        return " ".join(sorted(value))
    return str(value)


def parse_table(items: Sequence[Json]) -> TableState:
    chains: dict[str, dict[str, Any]] = {}
    rules: dict[str, list[RuleState]] = {}
    maps: dict[str, tuple[str, str, dict[str, str]]] = {}
    counters: dict[str, tuple[int, int]] = {}
    sets: dict[str, tuple[tuple[str, ...], tuple[Box | None, ...]]] = {}
    foreign: list[str] = []
    for item in items:
        kind, body = next(iter(item.items()))
        if kind in ("metainfo", "table"):
            continue
        if kind == "chain":
            chains[body["name"]] = body
        elif kind == "rule":
            packets = sum(
                int(e["counter"].get("packets", 0))
                for e in body.get("expr", [])
                if isinstance(e.get("counter"), dict)
            )
            nbytes = sum(
                int(e["counter"].get("bytes", 0))
                for e in body.get("expr", [])
                if isinstance(e.get("counter"), dict)
            )
            named = next(
                (e["counter"] for e in body.get("expr", []) if isinstance(e.get("counter"), str)),
                None,
            )
            rules.setdefault(body["chain"], []).append(
                RuleState(
                    int(body.get("handle", 0)), str(body.get("comment", "")), packets, nbytes, named
                )
            )
        elif kind == "map":
            elements: dict[str, str] = {}
            for element in body.get("elem", []):
                if isinstance(element, list) and len(element) == 2:
                    elements[str(element[0])] = _verdict_text(element[1])
            maps[body["name"]] = (str(body.get("type")), str(body.get("map")), elements)
        elif kind == "counter":
            counters[body["name"]] = (int(body.get("packets", 0)), int(body.get("bytes", 0)))
        elif kind == "set":
            kind_of = body.get("type")
            shape = tuple(kind_of) if isinstance(kind_of, list) else (str(kind_of),)
            shape += tuple(f"flag:{flag}" for flag in body.get("flags", ()))
            elems = tuple(read_element(value) for value in body.get("elem", ()))
            sets[body["name"]] = (shape, elems)
        else:
            foreign.append(f"{kind} {body.get('name', '?')}")
    return TableState(
        chains={
            name: ChainState(
                name=name,
                hook=body.get("hook"),
                type=body.get("type"),
                prio=body.get("prio"),
                policy=body.get("policy"),
                rules=tuple(rules.get(name, ())),
            )
            for name, body in chains.items()
        },
        maps=maps,
        counters=counters,
        sets=sets,
        foreign=tuple(foreign),
    )


def read_table(backend: NftBackend, layout: Layout) -> TableState | None:
    """The table as the kernel has it, or None if it does not exist."""
    try:
        items = backend.run(layout.list_table())
    except NftError as exc:
        if "No such file or directory" in exc.message:
            return None
        raise
    return parse_table(items)


def base_differences(layout: Layout, table: TableState) -> list[str]:
    """What makes the table's base differ from the layout (empty: the base is as written)."""
    found: list[str] = []
    for name, specs in layout.base_rules().items():
        chain = table.chains.get(name)
        want = layout.base_chain_spec(name)
        if chain is None:
            found.append(f"chain {name} missing")
            continue
        shape = (chain.type, chain.hook, chain.prio, chain.policy)
        wanted = (want["type"], want["hook"], want["prio"], want["policy"])
        if shape != wanted:
            found.append(f"chain {name} is {shape}, want {wanted}")
        comments = [rule.comment for rule in chain.rules]
        if comments != [spec.comment for spec in specs]:
            found.append(f"chain {name} has rules {comments}")
    for name in table.chains:
        if name not in layout.base_rules() and not name.startswith(
            (CREW_CHAIN_PREFIX, CAPTURE_CHAIN_PREFIX)
        ):
            found.append(f"unknown chain {name}")
    for map_name in (MAP, CAPTURE_MAP):
        mapping = table.maps.get(map_name)
        if mapping is None:
            found.append(f"map {map_name} missing")
        elif mapping[:2] != ("ifname", "verdict"):
            found.append(f"map {map_name} has type {mapping[:2]}")
    for name in table.maps:
        if name not in (MAP, CAPTURE_MAP):
            found.append(f"unknown map {name}")
    for name in table.counters:
        if name not in COUNTERS:
            found.append(f"unknown counter {name}")
    for name in table.sets:
        # A crew's sets are the crew's business (the manager compares them with its rules).
        if not name.startswith(SET_PREFIXES):
            found.append(f"unknown set {name}")
    found += [f"unknown {what}" for what in table.foreign]
    return found


def table_claim(table: TableState) -> dict[str, str]:
    """The `key=value` words of the dispatch rule's comment (`Layout.claim`); {} if none."""
    chain = table.chains.get(PREROUTING)
    if chain is None or not chain.rules:
        return {}
    words = chain.rules[0].comment.split()
    if not words or words[0] != "dispatch":
        return {}
    return dict(word.split("=", 1) for word in words[1:] if "=" in word and word[:2] != "v=")


def interface_patterns(backend: NftBackend) -> dict[str, set[str]]:
    """Every inet table of the host -> the interface name prefixes its rules match with a
    wildcard (`iifname "apx*"`): what a table claims. One listing of the inet ruleset."""
    found: dict[str, set[str]] = {}
    for item in backend.run([{"list": {"ruleset": {"family": FAMILY}}}]):
        kind, body = next(iter(item.items()))
        if kind == "table" and body.get("family") == FAMILY:
            found.setdefault(str(body.get("name")), set())
        if kind != "rule" or body.get("family") != FAMILY:
            continue
        for expr in body.get("expr", []):
            match = expr.get("match") if isinstance(expr, dict) else None
            if not isinstance(match, dict):
                continue
            left, right = match.get("left"), match.get("right")
            key = left.get("meta", {}).get("key") if isinstance(left, dict) else None
            if key in ("iifname", "oifname") and isinstance(right, str) and right.endswith("*"):
                found.setdefault(str(body.get("table")), set()).add(right[:-1])
    return found


def pool_claims(backend: NftBackend) -> dict[str, set[str]]:
    """Every inet table of the host -> the pools its rules refuse to all but their crews (the
    label of the rule whose role is FOREIGN_ROLE): the pools that appliances claim. One listing
    of the inet ruleset. A table of an older layout claims none."""
    found: dict[str, set[str]] = {}
    for item in backend.run([{"list": {"ruleset": {"family": FAMILY}}}]):
        kind, body = next(iter(item.items()))
        if kind != "rule" or body.get("family") != FAMILY:
            continue
        words = str(body.get("comment", "")).split()
        if len(words) == 3 and words[0] == FOREIGN_ROLE and words[2].startswith("v="):
            found.setdefault(str(body.get("table")), set()).add(words[1])
    return found
