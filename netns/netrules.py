"""A crew's address rules as the kernel holds them: parsed from their one spelling, checked
against the pool, and cut into the disjoint elements of the crew's nftables sets. Pure.

A rule is `ACTION:PROTOCOL:RANGE:PORTS` ("allow:tcp:10.9.0.0/24:5432"); the control plane
validates what the operator typed (proxycore/protocol/netrules.py, whose `spec` is the one
spelling) and hands the specs to `CrewNetworks`, which keeps them in its state file. This package
imports nothing from proxycore/ (docs/architecture.md), so it reads the specs again here, and
refuses any that is not spelled exactly as the control plane writes it: two readings of a rule
that disagree are how a filter is bypassed, and a refusal is loud.

Why disjoint elements: the crew's sets are interval sets over a concatenated key (`ipv4_addr .
inet_proto . inet_service`, the kernel's pipapo set). Such a set refuses an element that
overlaps one it holds (EEXIST), and deleting an element that overlaps another can remove the
other (seen on 6.x kernels), so rules such as `allow:tcp:10.0.0.0/8:*` and `allow:tcp:10.9.0.0/
24:5432` cannot each be an element. `elements` cuts the union of a crew's rules of one action
into disjoint boxes (an address interval by a port interval, per protocol); a rule change
replaces the crew's sets whole (flush and add, one transaction), so nothing is ever deleted
element by element.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import NetnsError

ACTIONS = ("allow", "deny")
PROTOCOLS = ("tcp", "udp")
# As proxycore/protocol/netrules.py MAX_NET_RULES: the disjoint cut of n rules has O(n^2) boxes
# at worst, so n stays small.
MAX_RULES = 64


@dataclass(frozen=True, slots=True, order=True)
class Box:
    """One set element: addresses first..last (as integers), a protocol, ports low..high."""

    protocol: str
    first: int
    last: int
    low: int
    high: int


@dataclass(frozen=True, slots=True)
class NetRule:
    action: str
    protocol: str
    network: ipaddress.IPv4Network
    low: int
    high: int

    @property
    def spec(self) -> str:
        if (self.low, self.high) == (1, 65535):
            ports = "*"
        elif self.low == self.high:
            ports = str(self.low)
        else:
            ports = f"{self.low}-{self.high}"
        return f"{self.action}:{self.protocol}:{self.network}:{ports}"


def parse_rule(spec: str) -> NetRule:
    """A rule in its one spelling; NetnsError for anything else."""
    try:
        action, protocol, cidr, ports = spec.split(":")
        network = ipaddress.IPv4Network(cidr, strict=True)
        if ports == "*":
            low, high = 1, 65535
        else:
            first, _, last = ports.partition("-")
            low = int(first)
            high = int(last) if last else low
    except ValueError:
        raise NetnsError(f"address rule {spec!r}: not ACTION:PROTOCOL:CIDR:PORTS") from None
    rule = NetRule(action, protocol, network, low, high)
    if action not in ACTIONS or protocol not in PROTOCOLS or not 1 <= low <= high <= 65535:
        raise NetnsError(f"address rule {spec!r}: not ACTION:PROTOCOL:CIDR:PORTS")
    if rule.spec != spec:
        raise NetnsError(f"address rule {spec!r} is not in its one spelling {rule.spec!r}")
    return rule


def parse_rules(specs: Iterable[str], pool: ipaddress.IPv4Network) -> tuple[NetRule, ...]:
    """A crew's rules; refuses an allow rule that reaches into the crews' pool (a crew must
    not reach another crew, nor another crew's gateway, its identity at the proxy)."""
    rules = tuple(parse_rule(spec) for spec in dict.fromkeys(specs))
    if len(rules) > MAX_RULES:
        raise NetnsError(f"over {MAX_RULES} address rules")
    for rule in rules:
        if rule.action == "allow" and rule.network.overlaps(pool):
            raise NetnsError(f"address rule {rule.spec!r} reaches into the crews' pool {pool}")
    return rules


def _merge(intervals: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(intervals):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return tuple(merged)


def elements(rules: Iterable[NetRule], action: str) -> tuple[Box, ...]:
    """The union of the rules of one action as disjoint boxes, sorted (the same rules in any
    order give the same boxes: reconcile compares them with what the kernel holds)."""
    boxes: list[Box] = []
    for protocol in PROTOCOLS:
        chosen = [r for r in rules if r.action == action and r.protocol == protocol]
        if not chosen:
            continue
        spans = [
            (int(r.network.network_address), int(r.network.broadcast_address), r.low, r.high)
            for r in chosen
        ]
        # Cut the address line at every rule's edges; within each piece the same rules apply.
        cuts = sorted({first for first, _, _, _ in spans} | {last + 1 for _, last, _, _ in spans})
        pieces: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
        for start, end in itertools.pairwise(cuts):
            ports = _merge(
                (low, high) for first, last, low, high in spans if first <= start <= last
            )
            if not ports:
                continue
            if pieces and pieces[-1][1] + 1 == start and pieces[-1][2] == ports:
                pieces[-1] = (pieces[-1][0], end - 1, ports)  # adjacent, same ports: one piece
            else:
                pieces.append((start, end - 1, ports))
        boxes += [
            Box(protocol, first, last, low, high)
            for first, last, ports in pieces
            for low, high in ports
        ]
    return tuple(sorted(boxes))
