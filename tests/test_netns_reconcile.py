"""Crash safety, reconciliation, atomic transactions and persistent allocation, on a real kernel.

"Kill the process between steps" is literal: a child process attaches (or detaches) a crew and
SIGKILLs itself from the `on_step` callback right after the named step; the test then checks
what it left behind grants nothing beyond the proxy port, and that the next start repairs it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.test_netns_support import (
    INTERNET_GATEWAY,
    INTERNET_HOST,
    NEEDS_KERNEL,
    ROOT,
    Lab,
    Probe,
    make_lab,
    nft_table_json,
    run_probes,
    sh,
)

pytestmark = NEEDS_KERNEL

CHILD = r"""
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import msgspec
from netns import CrewNetworks, NetConfig

config = msgspec.json.decode(sys.argv[2], type=NetConfig)
state_dir, action, crew, namespace, kill_at = sys.argv[3:8]

def on_step(crew, step):
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)

net = CrewNetworks(config, state_dir, on_step=on_step)
if action == "attach":
    net.attach(crew, namespace)
else:
    net.detach(crew)
sys.exit(3)
"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    with make_lab(tmp_path) as lab:
        lab.wire("inet", INTERNET_GATEWAY, INTERNET_HOST)
        lab.listener.tcp("0.0.0.0", lab.port, label="proxy")
        lab.listener.tcp("0.0.0.0", lab.other_port, label="other port")
        lab.listener.tcp(INTERNET_HOST, 80, netns=lab.namespaces[0], label="internet")
        yield lab


def networks(lab: Lab, **kwargs: Any):  # type: ignore[no-untyped-def]
    from netns import CrewNetworks

    return CrewNetworks(lab.config(), lab.state_dir, **kwargs)


def crash(lab: Lab, action: str, crew: str, namespace: str, kill_at: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(ROOT),
            msgspec.json.encode(lab.config()).decode(),
            str(lab.state_dir),
            action,
            crew,
            f"/run/netns/{namespace}",
            kill_at,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr


def state_of(lab: Lab) -> dict[str, str]:
    data = json.loads((lab.state_dir / "netns-state.json").read_text())
    return {record["crew"]: record["phase"] for record in data["crews"]}


def table_text(lab: Lab) -> str:
    return sh("nft", "list", "table", "inet", lab.table, check=False).stdout


def link_exists(ifname: str) -> bool:
    return sh("ip", "link", "show", ifname, check=False).returncode == 0


def assert_policy(lab: Lab, namespace: str, gateway: str, *, proxy: str) -> None:
    """The crew reaches at most the proxy port on its gateway (`proxy` says what it gets)."""
    results = run_probes(
        namespace,
        [
            Probe("tcp", gateway, lab.port),
            Probe("tcp", gateway, lab.other_port),
            Probe("tcp", INTERNET_HOST, 80),
            Probe("tcp", INTERNET_GATEWAY, lab.port),
        ],
    )
    values = list(results.values())
    assert values[0] == proxy, results
    assert values[1:] == [values[1]] * 3 and values[1] in {"timeout", "error:ENETUNREACH"}, results
    if proxy == "connected":
        lab.listener.wait_for("proxy")
    assert "other port" not in lab.listener.labels()
    assert "internet" not in lab.listener.labels()


# --- crashes --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kill_at", ["record intent", "install rules", "create veth", "configure host end"]
)
def test_crash_during_attach_grants_nothing_and_the_next_start_undoes_it(
    lab: Lab, kill_at: str
) -> None:
    namespace = lab.namespace("crew")
    with networks(lab) as net:
        net.reconcile()
    crash(lab, "attach", "crew-x", namespace, kill_at)
    assert state_of(lab) == {"crew-x": "creating"}
    with networks(lab) as net:
        plan = net.plan("crew-x")
        assert plan is not None
        if kill_at != "record intent":
            assert plan.chain in table_text(lab)
        if kill_at in ("create veth", "configure host end"):
            assert link_exists(plan.ifname)
            # What the crash left grants nothing: the crew end has no address yet.
            assert_policy(lab, namespace, plan.gateway, proxy="error:ENETUNREACH")
        report = net.reconcile()
        assert ("took down", "crew-x") in [(c.action, c.crew) for c in report.changes]
        assert not link_exists(plan.ifname)
        assert plan.chain not in table_text(lab)
        assert state_of(lab) == {"crew-x": "detached"}
        assert net.reconcile().changes == ()  # the repair is complete and stable
        # The subnet stayed reserved; attaching again works and gives the same addresses.
        network = net.attach("crew-x", f"/run/netns/{namespace}")
        assert network.gateway == plan.gateway
        assert_policy(lab, namespace, plan.gateway, proxy="connected")


def test_crash_after_the_crew_end_is_configured_grants_only_the_proxy(lab: Lab) -> None:
    namespace = lab.namespace("crew")
    crash(lab, "attach", "crew-x", namespace, "configure crew end")
    with networks(lab) as net:
        plan = net.plan("crew-x")
        assert plan is not None
        assert_policy(lab, namespace, plan.gateway, proxy="connected")
        net.reconcile()
        assert not link_exists(plan.ifname) and plan.chain not in table_text(lab)


@pytest.mark.parametrize("kill_at", ["delete veth", "remove rules"])
def test_crash_during_detach_is_finished_at_the_next_start(lab: Lab, kill_at: str) -> None:
    namespace = lab.namespace("crew")
    with networks(lab) as net:
        net.reconcile()
        network = net.attach("crew-x", f"/run/netns/{namespace}")
    crash(lab, "detach", "crew-x", namespace, kill_at)
    assert state_of(lab) == {"crew-x": "detaching"}
    assert not link_exists(network.ifname)  # the crew was cut off first
    with networks(lab) as net:
        report = net.reconcile()
        assert "took down" in report.actions()
        assert f"crew_{network.ifname}" not in table_text(lab)
        assert state_of(lab) == {"crew-x": "detached"}


def test_rules_are_in_place_before_the_link_exists(lab: Lab) -> None:
    """Fail closed: when the veth appears, the crew's chain and map element are already there."""
    namespace = lab.namespace("crew")
    seen: dict[str, tuple[bool, bool]] = {}

    def on_step(crew: str, step: str) -> None:
        if step in ("install rules", "create veth"):
            plan = net.plan(crew)
            assert plan is not None
            text = table_text(lab)
            in_map = f'"{plan.ifname}" : jump {plan.chain}' in text
            seen[step] = (plan.chain in text and in_map, link_exists(plan.ifname))

    with networks(lab, on_step=on_step) as net:
        net.reconcile()
        net.attach("crew-x", f"/run/netns/{namespace}")
    assert seen == {"install rules": (True, False), "create veth": (True, True)}


# --- orphans, stale and missing pieces ------------------------------------------------------------


def test_orphan_links_and_rules_are_removed(lab: Lab) -> None:
    from netns import CrewNetworks

    crew = lab.namespace("crew")
    stray = lab.namespace("stray")
    with networks(lab) as net:
        net.reconcile()
        network = net.attach("crew-x", f"/run/netns/{crew}")
    # A veth with the appliance's prefix that no crew owns, with an address on each end...
    orphan = f"{lab.prefix}0rphan"
    sh("ip", "link", "add", orphan, "type", "veth", "peer", "name", "eth0", "netns", stray)
    sh("ip", "addr", "add", "198.18.0.1/30", "dev", orphan)
    sh("ip", "link", "set", orphan, "up")
    sh("ip", "-n", stray, "addr", "add", "198.18.0.2/30", "dev", "eth0")
    sh("ip", "-n", stray, "link", "set", "eth0", "up")
    # ...and rules for a crew that no longer exists.
    ghost = f"{lab.prefix}9h0st"
    sh("nft", "add", "chain", "inet", lab.table, f"crew_{ghost}")
    sh("nft", "add", "rule", "inet", lab.table, f"crew_{ghost}", "accept")
    sh(
        "nft",
        "add",
        "element",
        "inet",
        lab.table,
        "crew_ingress",
        f"{{ {ghost} : jump crew_{ghost} }}",
    )
    # Until the next start, the orphan link is already fail-closed: no chain, so the
    # catch-all rule drops its traffic.
    results = run_probes(stray, [Probe("tcp", "198.18.0.1", lab.port)])
    assert list(results.values()) == ["timeout"]
    with CrewNetworks(lab.config(), lab.state_dir) as net:
        unmapped = {c.role: c.packets for c in net.show().counters}["unmapped_drops"]
        assert unmapped >= 1
        before = net.show()
        assert before.orphan_links == (orphan,)
        assert before.orphan_chains == (f"crew_{ghost}",)
        report = net.reconcile()
        assert ("deleted link", orphan) in [(c.action, c.detail) for c in report.changes]
        assert ("removed rules", f"chain crew_{ghost}") in [
            (c.action, c.detail) for c in report.changes
        ]
        after = net.show()
        assert after.orphan_links == () and after.orphan_chains == ()
        assert not link_exists(orphan)
        assert_policy(lab, crew, network.gateway, proxy="connected")


def test_tampered_table_is_rebuilt(lab: Lab) -> None:
    crew = lab.namespace("crew")
    with networks(lab) as net:
        net.reconcile()
        network = net.attach("crew-x", f"/run/netns/{crew}")
    # An "accept" ahead of the dispatch opens everything: prove it, then let a start repair it.
    sh("nft", "insert", "rule", "inet", lab.table, "prerouting", "accept")
    opened = run_probes(crew, [Probe("tcp", network.gateway, lab.other_port)])
    assert list(opened.values()) == ["connected"]
    lab.listener.wait_for("other port")
    lab.listener.hits.clear()
    with networks(lab) as net:
        report = net.reconcile()
        assert report.actions() == ["rebuilt table"]
        assert "prerouting" in report.changes[0].detail
        assert net.show().base_differences == ()
        assert_policy(lab, crew, network.gateway, proxy="connected")


def test_stale_table_of_another_layout_is_rebuilt(lab: Lab) -> None:
    crew = lab.namespace("crew")
    with networks(lab) as net:
        net.reconcile()
        network = net.attach("crew-x", f"/run/netns/{crew}")
    # A table of the same name as an older version might have left it.
    sh("nft", "delete", "table", "inet", lab.table)
    subprocess.run(
        ["nft", "-f", "-"],
        input=f"""table inet {lab.table} {{
            set crews {{ type ifname; }}
            chain input {{ type filter hook input priority 0; policy accept; }}
        }}""",
        text=True,
        check=True,
    )
    with networks(lab) as net:
        report = net.reconcile()
        assert report.actions() == ["rebuilt table"]
        text = table_text(lab)
        assert "set crews" not in text and "chain input" not in text
        assert f"crew_{network.ifname}" in text
        assert_policy(lab, crew, network.gateway, proxy="connected")


def test_missing_table_rules_and_links_are_restored(lab: Lab) -> None:
    crew = lab.namespace("crew")
    with networks(lab) as net:
        net.reconcile()
        network = net.attach("crew-x", f"/run/netns/{crew}")
        # The table deleted behind the appliance's back.
        sh("nft", "delete", "table", "inet", lab.table)
        report = net.reconcile()
        assert report.actions() == ["created table"]
        assert_policy(lab, crew, network.gateway, proxy="connected")
        # One rule of the crew's chain removed by hand.
        listing = json.loads(nft_table_json(lab.table))["nftables"]
        drop = next(
            item["rule"]["handle"]
            for item in listing
            if "rule" in item and item["rule"].get("comment", "").startswith("drop crew-x")
        )
        sh(
            "nft",
            "delete",
            "rule",
            "inet",
            lab.table,
            f"crew_{network.ifname}",
            "handle",
            str(drop),
        )
        report = net.reconcile()
        assert [(c.action, c.crew) for c in report.changes] == [("restored rules", "crew-x")]
        # The host end deleted (which deletes the crew end too).
        sh("ip", "link", "del", network.ifname)
        report = net.reconcile()
        assert {c.action for c in report.changes} == {"restored"}
        assert any("created veth" in c.detail for c in report.changes)
        assert_policy(lab, crew, network.gateway, proxy="connected")
        # An address added by hand on the crew end is removed.
        sh("ip", "-n", crew, "addr", "add", "100.64.250.1/24", "dev", "eth0")
        report = net.reconcile()
        assert any("removed address 100.64.250.1/24" in c.detail for c in report.changes)
        assert net.reconcile().changes == ()


def test_crew_whose_namespace_died_is_taken_down(lab: Lab) -> None:
    crew = lab.namespace("crew")
    with networks(lab) as net:
        net.reconcile()
        network = net.attach("crew-x", f"/run/netns/{crew}")
    sh("ip", "netns", "del", crew)
    lab.namespaces.remove(crew)
    with networks(lab) as net:
        report = net.reconcile()
        assert (report.changes[0].action, report.changes[0].crew) == ("took down", "crew-x")
        assert f"crew_{network.ifname}" not in table_text(lab)
        assert state_of(lab) == {"crew-x": "detached"}
        # Its subnet is kept: a new namespace for the same crew gets the same gateway (the
        # crew's identity at the proxy).
        again = lab.namespace("crew2")
        assert net.attach("crew-x", f"/run/netns/{again}").gateway == network.gateway


# --- atomicity and rollback -----------------------------------------------------------------------


class InjectBadRule:
    """An nftables backend that appends a rule jumping to a chain that does not exist."""

    def __init__(self, inner: Any, table: str) -> None:
        self.inner = inner
        self.table = table
        self.armed = False

    def run(self, commands: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.armed and not any("list" in c for c in commands):
            bad = {
                "add": {
                    "rule": {
                        "family": "inet",
                        "table": self.table,
                        "chain": "prerouting",
                        "expr": [{"jump": {"target": "no_such_chain"}}],
                    }
                }
            }
            commands = [*commands, bad]
        return self.inner.run(commands)  # type: ignore[no-any-return]


def test_failed_transaction_leaves_the_previous_ruleset_in_place(lab: Lab) -> None:
    from netns import CrewNetworkError, NftError, default_backend

    crew_a, crew_b = lab.namespace("crewa"), lab.namespace("crewb")
    backend = InjectBadRule(default_backend(), lab.table)
    with networks(lab, nft=backend) as net:
        net.reconcile()
        a = net.attach("crew-a", f"/run/netns/{crew_a}")
        before = nft_table_json(lab.table)
        state_before = (lab.state_dir / "netns-state.json").read_bytes()
        backend.armed = True
        with pytest.raises(CrewNetworkError) as caught:
            net.attach("crew-b", f"/run/netns/{crew_b}")
        assert caught.value.crew == "crew-b" and caught.value.step == "install rules"
        assert isinstance(caught.value.cause, NftError)
        assert "crew 'crew-b'" in str(caught.value) and "rolled back" in str(caught.value)
        # Byte for byte the same table (same handles: nothing was committed), the same state.
        assert nft_table_json(lab.table) == before
        assert (lab.state_dir / "netns-state.json").read_bytes() == state_before
        assert "eth0" not in sh("ip", "-n", crew_b, "link").stdout
        # And the batch on its own: the crew's chain plus one bad rule commits nothing.
        plan = net.plan("crew-a")
        assert plan is not None
        with pytest.raises(NftError):
            backend.run(net.layout.install_crew(plan))
        assert nft_table_json(lab.table) == before
        backend.armed = False
        assert_policy(lab, crew_a, a.gateway, proxy="connected")


def test_failure_after_the_rules_rolls_back_rules_link_and_state(lab: Lab) -> None:
    from netns import CrewNetworkError

    crew_a, crew_b = lab.namespace("crewa"), lab.namespace("crewb")
    # The crew end's name is already taken inside crew b's namespace: creating the veth fails
    # after the rules went in.
    sh("ip", "-n", crew_b, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1")
    with networks(lab) as net:
        net.reconcile()
        net.attach("crew-a", f"/run/netns/{crew_a}")
        before = nft_table_json(lab.table)
        with pytest.raises(CrewNetworkError) as caught:
            net.attach("crew-b", f"/run/netns/{crew_b}")
        assert caught.value.step == "create veth" and caught.value.rollback_errors == ()
        assert "File exists" in str(caught.value)
        assert net.plan("crew-b") is None
        assert state_of(lab) == {"crew-a": "ready"}
        after = json.loads(nft_table_json(lab.table))["nftables"]
        chains = {item["chain"]["name"] for item in after if "chain" in item}
        assert chains == {
            c["chain"]["name"] for c in json.loads(before)["nftables"] if "chain" in c
        }
        names = [
            line.split(": ")[1].split("@")[0] for line in sh("ip", "-o", "link").stdout.splitlines()
        ]
        assert [name for name in names if name.startswith(lab.prefix)] == [
            net.plan("crew-a").ifname
        ]  # type: ignore[union-attr]


# --- addresses and state --------------------------------------------------------------------------


def test_allocation_persists_and_never_hands_out_an_address_in_use(lab: Lab) -> None:
    import ipaddress

    names = [lab.namespace(f"c{i}") for i in range(3)]
    with networks(lab) as net:
        net.reconcile()
        first = net.attach("crew-0", f"/run/netns/{names[0]}")
    with networks(lab) as net:  # a restart
        assert net.reconcile().changes == ()
        assert net.plan("crew-0").gateway == first.gateway  # type: ignore[union-attr]
        # The host starts using the next subnet (a route added by someone else).
        pool = ipaddress.IPv4Network(lab.pool)
        taken = ipaddress.IPv4Network((pool.network_address + 4, 30))
        sh("ip", "route", "add", "blackhole", str(taken))
        try:
            second = net.attach("crew-1", f"/run/netns/{names[1]}")
            assert ipaddress.IPv4Address(second.gateway) not in taken
            assert second.subnet == str(ipaddress.IPv4Network((pool.network_address + 8, 30)))
            # At the next start that route collides with the pool: refused, with the reason.
            from netns import PoolConflictError

            with pytest.raises(PoolConflictError, match=f"route {taken}"):
                net.reconcile()
        finally:
            sh("ip", "route", "del", "blackhole", str(taken))
        net.release("crew-0")
        third = net.attach("crew-2", f"/run/netns/{names[2]}")
        assert third.gateway == first.gateway  # the lowest free subnet is reused after release


def test_pool_colliding_with_the_host_is_refused_at_start(lab: Lab) -> None:
    from netns import CrewNetworks, PoolConflictError

    with (
        CrewNetworks(lab.config(pool="198.51.100.0/24"), lab.state_dir) as net,
        pytest.raises(PoolConflictError) as caught,
    ):
        net.reconcile()
    assert any(INTERNET_GATEWAY in c for c in caught.value.conflicts)
    assert sh("nft", "list", "table", "inet", lab.table, check=False).returncode != 0


def test_state_directory_is_locked(lab: Lab) -> None:
    from netns import StateError

    with networks(lab), pytest.raises(StateError, match="in use by another process"):
        networks(lab)
    with networks(lab):
        pass  # released on close


def test_cli_backend_writes_the_same_table_as_the_library(lab: Lab) -> None:
    from netns import LibNftables, NftCli

    crew = lab.namespace("crew")
    with networks(lab, nft=NftCli()) as net:
        net.reconcile()
        network = net.attach("crew-x", f"/run/netns/{crew}")
        assert_policy(lab, crew, network.gateway, proxy="connected")
    with networks(lab, nft=LibNftables()) as net:
        assert net.reconcile().changes == ()
        net.release("crew-x")
        assert f"crew_{network.ifname}" not in table_text(lab)
