"""Address rules in the kernel, proven with real packets: a crew reaches what an allow rule names
(TCP and UDP, masqueraded), nothing a deny rule names (deny wins over a wider allow), no UDP
without a rule; a rule change is a small batch that replaces the crew's sets only; and a
manager rebuilt from its state file (a restart) restores the same.

The lab (tests/test_netns_support.py): an "internet" namespace (198.51.100.10, TEST-NET-2) behind
a veth of its own with forwarding on, listeners there; crews in namespaces the test creates.
Nothing leaves the machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_netns_support import (
    INTERNET_GATEWAY,
    INTERNET_HOST,
    NEEDS_KERNEL,
    Lab,
    Probe,
    make_lab,
    run_probes,
    sh,
)

pytestmark = NEEDS_KERNEL

RULES = (
    "allow:tcp:198.51.100.0/24:5432",
    "allow:tcp:198.51.100.0/24:8000-8100",
    # Inside the wider allow above: refused all the same.
    "deny:tcp:198.51.100.10/32:8080",
    "allow:udp:198.51.100.10/32:53",
)
ALLOWED = [
    Probe("tcp", INTERNET_HOST, 5432),
    Probe("tcp", INTERNET_HOST, 8081),
    Probe("udp", INTERNET_HOST, 53),
]
REFUSED = [
    Probe("tcp", INTERNET_HOST, 8080),  # deny wins
    Probe("tcp", INTERNET_HOST, 80),  # no rule
    Probe("udp", INTERNET_HOST, 5353),  # UDP only where a rule names it
    Probe("udp", INTERNET_HOST, 5432),  # the TCP rule does not open UDP
]


@dataclass
class World:
    lab: Lab
    internet: str
    crew_a: str
    crew_b: str


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    with make_lab(tmp_path) as lab:
        internet = lab.wire("inet", INTERNET_GATEWAY, INTERNET_HOST)
        listen = lab.listener
        for port in (5432, 8080, 8081, 80):
            listen.tcp(INTERNET_HOST, port, netns=internet, label=f"tcp/{port}")
        for port in (53, 5353, 5432):
            listen.udp(INTERNET_HOST, port, netns=internet, label=f"udp/{port}")
        yield World(lab, internet, lab.namespace("crewa"), lab.namespace("crewb"))


def networks(lab: Lab):  # type: ignore[no-untyped-def]
    from netns import CrewNetworks

    return CrewNetworks(lab.config(), lab.state_dir)


def outcome(world: World, netns: str, probes: list[Probe]) -> dict[str, str]:
    return {str(probe): result for probe, result in run_probes(netns, probes).items()}


def expect(world: World, netns: str, allowed: list[Probe], refused: list[Probe]) -> None:
    results = outcome(world, netns, allowed + refused)
    want = {str(p): "connected" if p.kind == "tcp" else "reply" for p in allowed}
    want |= {str(p): "timeout" if p.kind == "tcp" else "no reply" for p in refused}
    assert results == want


def test_allow_and_deny_rules_with_real_packets(world: World) -> None:
    lab = world.lab
    with networks(lab) as net:
        net.reconcile()
        a = net.attach("crew-a", f"/run/netns/{world.crew_a}", RULES)
        net.attach("crew-b", f"/run/netns/{world.crew_b}")
        expect(world, world.crew_a, ALLOWED, REFUSED)
        # What arrived came from the host's address on that wire (masqueraded: the pool is not
        # routable), and nothing refused arrived at all.
        lab.listener.wait_for("tcp/5432")
        lab.listener.wait_for("udp/53")
        assert sorted(set(lab.listener.labels())) == ["tcp/5432", "tcp/8081", "udp/53"]
        assert {peer[0] for _, _, peer in lab.listener.hits} == {INTERNET_GATEWAY}
        # Crew b has no rules: it reaches none of it, and its host end does not forward.
        expect(world, world.crew_b, [], ALLOWED + REFUSED)
        forwarding = Path(f"/proc/sys/net/ipv4/conf/{a.ifname}/forwarding")
        assert forwarding.read_text().strip() == "1"
        b_plan = net.plan("crew-b")
        assert b_plan is not None
        b_forwarding = Path(f"/proc/sys/net/ipv4/conf/{b_plan.ifname}/forwarding")
        assert b_forwarding.read_text().strip() == "0"
        status = next(c for c in net.show().crews if c.crew == "crew-a")
        by_role = {rule.role: rule.packets for rule in status.rules}
        assert by_role["net-allow"] > 0 and by_role["net-deny"] > 0


def test_a_rule_change_replaces_the_crews_sets_only(world: World) -> None:
    with networks(world.lab) as net:
        net.reconcile()
        net.attach("crew-a", f"/run/netns/{world.crew_a}", RULES)
        batch = net.set_net_rules("crew-a", RULES[1:])  # the 5432 rule goes
        kinds = {next(iter(body)) for command in batch for body in command.values()}
        assert kinds == {"set", "element"} and len(batch) <= 6
        assert net.net_rules("crew-a") == RULES[1:]
        expect(world, world.crew_a, ALLOWED[1:], [*REFUSED, ALLOWED[0]])
        # No rule left: forwarding goes off with the last allow rule.
        net.set_net_rules("crew-a", ())
        expect(world, world.crew_a, [], ALLOWED + REFUSED)
        plan = net.plan("crew-a")
        assert plan is not None
        forwarding = Path(f"/proc/sys/net/ipv4/conf/{plan.ifname}/forwarding")
        assert forwarding.read_text().strip() == "0"
        # A rule that reaches into the pool is refused, and nothing changes.
        with pytest.raises(Exception, match="pool"):
            net.set_net_rules("crew-a", (f"allow:tcp:{world.lab.pool}:*",))
        assert net.net_rules("crew-a") == ()


def test_the_rules_hold_after_a_restart_and_are_repaired(world: World) -> None:
    lab = world.lab
    with networks(lab) as net:
        net.reconcile()
        a = net.attach("crew-a", f"/run/netns/{world.crew_a}", RULES)
    # A restart: a new manager from the state file; nothing to change.
    with networks(lab) as net:
        assert net.reconcile().changes == ()
        expect(world, world.crew_a, ALLOWED, REFUSED)
        # Sets emptied and tampered with behind the appliance's back: restored.
        sh("nft", "flush", "set", "inet", lab.table, f"allow_{a.ifname}")
        sh(
            "nft",
            "add",
            "element",
            "inet",
            lab.table,
            f"deny_{a.ifname}",
            "{ 198.51.100.0/24 . tcp . 5432 }",
        )
    with networks(lab) as net:
        actions = [(c.action, c.crew) for c in net.reconcile().changes]
        assert actions == [("restored address rules", "crew-a")]
        expect(world, world.crew_a, ALLOWED, REFUSED)
        # The whole table gone: rebuilt, the sets with it.
        sh("nft", "delete", "table", "inet", lab.table)
        assert "created table" in net.reconcile().actions()
        expect(world, world.crew_a, ALLOWED, REFUSED)
    # A state file edited by hand into a rule the kernel's reader refuses: the crew keeps its
    # network without any rule (fail closed), and says so.
    path = lab.state_dir / "netns-state.json"
    state = json.loads(path.read_text())
    state["crews"][0]["net"] = ["allow:tcp:198.51.100.10:80"]  # not its one spelling
    path.write_text(json.dumps(state))
    with networks(lab) as net:
        changes = [(c.action, c.crew) for c in net.reconcile().changes]
        assert ("ignored address rules", "crew-a") in changes
        expect(world, world.crew_a, [], ALLOWED + REFUSED)


def test_a_rule_change_costs_the_same_among_500_crews(world: World) -> None:
    """500 crews' chains and sets in the table (no links: the batch is what is measured): a
    rule change for one is the same six commands as for a crew alone, in milliseconds."""
    from netns.addressing import parse_pool, plan_for
    from netns.netrules import parse_rules
    from netns.nft import default_backend
    from tests.test_netns_support import _host_routes_any

    lab = world.lab
    # The table refuses its pool to all but the crews for as long as it exists: one the host
    # does not use, big enough for 500 /30s.
    if _host_routes_any(["100.93.0.0/21"]):
        pytest.skip("the host uses 100.93.0.0/21")
    with networks(lab) as net:
        pool = parse_pool("100.93.0.0/21")
        layout = type(net.layout)(**{**net.layout.__dict__, "pool": str(pool)})
        plans = [plan_for(pool, lab.prefix, f"crew-{i}", i) for i in range(500)]
        rules = {plan.crew: parse_rules(RULES, pool) for plan in plans}
        backend = default_backend()
        try:
            backend.run(layout.rebuild(plans, rules))
            timings = []
            for step in range(5):
                batch = layout.set_rules(plans[250], parse_rules(RULES[step % 2 :], pool))
                assert len(batch) == 6
                started = time.perf_counter()
                backend.run(batch)
                timings.append(time.perf_counter() - started)
            alone = layout.set_rules(plans[0], parse_rules(RULES, pool))
            assert len(alone) == 6
            # Generous: a whole-table rebuild of 500 crews takes far longer than this.
            assert min(timings) < 0.25, timings
        finally:
            backend.close()
