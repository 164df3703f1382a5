"""Instances on one host, on a real kernel: two appliances configured alike (one table name, one
interface prefix, crews of one name) that never touch each other's table or links; state from
before instance ids renamed at the next start; and the starts that must be refused.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_netns_reconcile import assert_policy, link_exists
from tests.test_netns_support import (
    INTERNET_GATEWAY,
    INTERNET_HOST,
    NEEDS_KERNEL,
    Lab,
    _host_routes_any,
    make_lab,
    sh,
)

pytestmark = NEEDS_KERNEL


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    with make_lab(tmp_path) as lab:
        lab.wire("inet", INTERNET_GATEWAY, INTERNET_HOST)
        lab.listener.tcp("0.0.0.0", lab.port, label="proxy")
        lab.listener.tcp("0.0.0.0", lab.other_port, label="other port")
        lab.listener.tcp(INTERNET_HOST, 80, netns=lab.namespaces[0], label="internet")
        tables: list[str] = []
        lab.instance_tables = tables  # type: ignore[attr-defined]
        yield lab
        for table in tables:
            sh("nft", "delete", "table", "inet", table, check=False)


def other_pool(lab: Lab) -> str:
    for _ in range(20):
        pool = f"100.90.{random.randrange(256)}.0/24"
        if pool != lab.pool and not _host_routes_any([pool]):
            return pool
    pytest.skip("no second free test pool")


def instance(lab: Lab, name: str, state: str, pool: str | None = None, **kwargs: Any):  # type: ignore[no-untyped-def]
    from netns import CrewNetworks, naming

    config = lab.config(pool=pool or lab.pool)
    lab.instance_tables.append(naming(config.table, config.ifname_prefix, name).table)  # type: ignore[attr-defined]
    return CrewNetworks(config, lab.state_dir.parent / state, instance=name, **kwargs)


def table_of(table: str) -> str:
    """The table as nft lists it, without counter values (-s): what the appliance wrote."""
    return sh("nft", "-s", "list", "table", "inet", table, check=False).stdout


def test_two_instances_configured_alike_never_touch_each_other(lab: Lab) -> None:
    """One table name, one interface prefix and one crew name in both; each reconciles, and
    releases its crew, without a change to the other's table, chain or link."""
    ns_one, ns_two = lab.namespace("one"), lab.namespace("two")
    with (
        instance(lab, "one", "s1") as one,
        instance(lab, "two", "s2", pool=other_pool(lab)) as two,
    ):
        assert one.naming.table != two.naming.table and one.prefix != two.prefix
        one.reconcile()
        two.reconcile()
        a = one.attach("crew-x", f"/run/netns/{ns_one}")
        b = two.attach("crew-x", f"/run/netns/{ns_two}")
        assert a.ifname != b.ifname and a.ifname.startswith(one.prefix)
        before = (table_of(one.naming.table), table_of(two.naming.table))
        # Restarts of either: nothing of the other is an orphan to it.
        assert one.reconcile().changes == ()
        assert two.reconcile().changes == ()
        assert (table_of(one.naming.table), table_of(two.naming.table)) == before
        assert link_exists(a.ifname) and link_exists(b.ifname)
        assert_policy(lab, ns_one, a.gateway, proxy="connected")
        assert_policy(lab, ns_two, b.gateway, proxy="connected")
        # Each table's catch-all matches only its own interfaces.
        assert f'iifname "{one.prefix}*"' in before[0] and f'"{two.prefix}*"' not in before[0]
        one.release("crew-x")
        assert not link_exists(a.ifname) and link_exists(b.ifname)
        assert table_of(two.naming.table) == before[1]
        assert_policy(lab, ns_two, b.gateway, proxy="connected")


def legacy_state(
    lab: Lab, state: str, crews: dict[str, str], *, reconcile: bool = True
) -> dict[str, Any]:
    """What an appliance from before instance ids leaves: its table and links under the
    configured names, and a version 1 state file. (`reconcile=False` for a second one
    configured alike: its reconcile would take the first one's links for orphans, the very
    bug instance ids fix.)"""
    from netns import CrewNetworks

    directory = lab.state_dir.parent / state
    with CrewNetworks(lab.config(), directory) as bare:
        if reconcile:
            bare.reconcile()
        networks = {crew: bare.attach(crew, f"/run/netns/{ns}") for crew, ns in crews.items()}
    path = directory / "netns-state.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({"pool": data["pool"], "crews": data["crews"], "version": 1}))
    return networks


def test_state_from_before_instance_ids_is_renamed(lab: Lab) -> None:
    ns_a, ns_b = lab.namespace("a"), lab.namespace("b")
    old = legacy_state(lab, "s", {"crew-a": ns_a, "crew-b": ns_b})
    assert f"crew_{old['crew-a'].ifname}" in table_of(lab.table)
    with instance(lab, "prod", "s") as net:
        # Nothing may be attached under the new names before the old ones are gone.
        with pytest.raises(Exception, match="reconcile first"):
            net.attach("crew-c", f"/run/netns/{ns_a}")
        report = net.reconcile()
        actions = [(c.action, c.crew) for c in report.changes]
        assert ("deleted link", "crew-a") in actions and ("deleted link", "crew-b") in actions
        assert ("deleted table", None) in actions
        assert table_of(lab.table) == ""  # the former table is gone
        for crew, ns in (("crew-a", ns_a), ("crew-b", ns_b)):
            plan = net.plan(crew)
            assert plan is not None and plan.ifname.startswith(net.prefix)
            # Same subnet, so the same gateway: the proxy knows the crew by it.
            assert plan.gateway == old[crew].gateway
            assert not link_exists(old[crew].ifname) and link_exists(plan.ifname)
            assert f"crew_{plan.ifname}" in table_of(net.naming.table)
            assert_policy(lab, ns, plan.gateway, proxy="connected")
        assert net.reconcile().changes == ()
    data = json.loads((lab.state_dir.parent / "s" / "netns-state.json").read_text())
    assert data["version"] == 3 and data["naming"]["instance"] == "prod"


def test_a_former_table_that_another_appliance_shares_stops_the_start(lab: Lab) -> None:
    """Two appliances from before instance ids configured alike shared one table (the bug that
    instance ids fix). The one upgraded first cannot rename: the other's rules in that table
    (`iifname "<prefix>*" drop`) would drop its crews' traffic. It refuses, changing nothing."""
    ns_a, ns_b = lab.namespace("a"), lab.namespace("b")
    mine = legacy_state(lab, "s1", {"crew-a": ns_a})
    theirs = legacy_state(lab, "s2", {"crew-b": ns_b}, reconcile=False)
    before = table_of(lab.table)
    from netns import InstanceConflictError

    with instance(lab, "prod", "s1") as net, pytest.raises(InstanceConflictError):
        net.reconcile()
    assert table_of(lab.table) == before
    assert link_exists(mine["crew-a"].ifname) and link_exists(theirs["crew-b"].ifname)
    assert_policy(lab, ns_a, mine["crew-a"].gateway, proxy="connected")


def test_one_instance_id_in_two_state_directories_is_refused(lab: Lab) -> None:
    from netns import InstanceConflictError

    ns = lab.namespace("a")
    with instance(lab, "prod", "s1") as first:
        first.reconcile()
        network = first.attach("crew-a", f"/run/netns/{ns}")
        before = table_of(first.naming.table)
        with (
            instance(lab, "prod", "s2", pool=other_pool(lab)) as second,
            pytest.raises(InstanceConflictError, match="two state directories"),
        ):
            second.reconcile()
        assert table_of(first.naming.table) == before
        assert_policy(lab, ns, network.gateway, proxy="connected")
    # The same directory, emptied and started again in its place, takes its table back.
    (lab.state_dir.parent / "s1" / "netns-state.json").unlink()
    with instance(lab, "prod", "s1") as again:
        report = again.reconcile()
        assert ("deleted link", network.ifname) in [(c.action, c.detail) for c in report.changes]


def test_a_table_that_claims_this_instances_interfaces_is_refused(lab: Lab) -> None:
    """Another table whose rules match this instance's interface prefix (two tags that
    collide, or a hand-made table) stops the start before anything is changed."""
    from netns import InstanceConflictError, naming

    prefix = naming(lab.table, lab.prefix, "prod").ifname_prefix
    foreign = f"{lab.table}_foreign"
    lab.instance_tables.append(foreign)  # type: ignore[attr-defined]
    sh("nft", "add", "table", "inet", foreign)
    sh("nft", "add", "chain", "inet", foreign, "c")
    sh("nft", "add", "rule", "inet", foreign, "c", "iifname", f"{prefix[:-1]}*", "drop")
    with instance(lab, "prod", "s") as net:
        with pytest.raises(InstanceConflictError, match=f"table inet {foreign}"):
            net.reconcile()
        assert table_of(net.naming.table) == ""
