"""Nobody but a crew reaches the crew's gateway: proven with real packets.

The proxy knows a crew by the gateway address a connection arrives on. A gateway is an address
of the host, and Linux accepts a packet for a local address on any interface (the weak host
model, RFC 1122 3.3.4.2): without the table's `foreign` rule, any process on the host (its
packets to a local address come in on "lo") or any machine routed to the pool would be served
as the crew, its provider key injected and its keeper routes open. The attack is kept here as
it was found (a process of UID 65534 connecting to `<gateway>:<proxy port>`), with root beside
it, a forged source address, and a machine on the "LAN" (the lab's control namespace, routed
through the host); then the crew itself, which must still get its answer on the same port; a
crew that dials another crew's gateway; and a second instance, whose crews the first one's rule
must never touch.

The lab is the one of tests/test_netns_support.py. The stand-ins for the proxy listen on the
gateways themselves, as applianced's listeners do, and answer every connection with a line.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.test_netns_support import (
    CONTROL_GATEWAY,
    CONTROL_HOST,
    NEEDS_KERNEL,
    Lab,
    Probe,
    _host_routes_any,
    in_namespace,
    make_lab,
    ns_path,
    run_probes,
    sh,
)

pytestmark = NEEDS_KERNEL

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
# The Listener's answer to every connection (tests/test_netns_support.py).
ANSWER = b"hello\n"

# One TCP client, run on the host as some user: how its connect ends, how long it took, and
# what it read. argv: host port [source address, bound with IP_FREEBIND (ip(7)): any address,
# local or not, which needs no privilege].
CLIENT = r"""
import errno, json, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
sock = socket.socket()
sock.settimeout(5)
if len(sys.argv) > 3:
    sock.setsockopt(socket.IPPROTO_IP, 15, 1)  # IP_FREEBIND
    sock.bind((sys.argv[3], 0))
start = time.monotonic()
answer = b""
try:
    sock.connect((host, port))
    result = "connected"
    answer = sock.recv(64)
except TimeoutError:
    result = "timeout"
except OSError as exc:
    result = "error:" + errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps({"result": result, "seconds": time.monotonic() - start,
                  "answer": answer.decode(errors="replace")}))
"""


def from_host(host: str, port: int, *, uid: int = 0, source: str | None = None) -> dict[str, Any]:
    """CLIENT on the host, as `uid` (0: root), with no supplementary groups."""

    def become() -> None:
        if uid:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)

    argv = [SYSTEM_PYTHON, "-c", CLIENT, host, str(port), *([source] if source else [])]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=30, preexec_fn=become, cwd="/"
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def from_crew(namespace: str, host: str, port: int) -> bytes:
    """Connect from inside a crew's namespace and read the answer."""

    def work() -> bytes:
        with socket.create_connection((host, port), timeout=3) as sock:
            return sock.recv(64)

    return in_namespace(ns_path(namespace), work)  # type: ignore[no-any-return]


def counters(net: Any) -> dict[str, int]:
    return {c.role: c.packets for c in net.show().counters}


def crew_drops(net: Any, crew: str) -> int:
    return next(c.dropped_packets for c in net.show().crews if c.crew == crew)


@dataclass
class World:
    lab: Lab
    net: Any  # CrewNetworks
    a: Any  # CrewNetwork
    b: Any
    crew_a: str
    crew_b: str
    control: str


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    from netns import CrewNetworks

    with make_lab(tmp_path) as lab:
        # A machine on the LAN with a route to the pool: its default route is the host
        # (`wire`), which forwards for it.
        control = lab.wire("ctl", CONTROL_GATEWAY, CONTROL_HOST)
        crew_a, crew_b = lab.namespace("crewa"), lab.namespace("crewb")
        with CrewNetworks(lab.config(), lab.state_dir) as net:
            net.reconcile()
            a = net.attach("crew-a", ns_path(crew_a))
            b = net.attach("crew-b", ns_path(crew_b))
            lab.listener.tcp(a.gateway, lab.port, label="proxy a")
            lab.listener.tcp(b.gateway, lab.port, label="proxy b")
            yield World(lab, net, a, b, crew_a, crew_b, control)


def test_a_host_process_is_not_the_crew(world: World) -> None:
    """The attack as it was found: a process of UID 65534 connects to the crew's gateway and
    proxy port. Refused at once (ICMP administratively prohibited: EHOSTUNREACH), as is root
    (root on the host is not a crew either), from the gateway's own address, from another
    host address, and (not even sent) from the crew's own address forged with IP_FREEBIND. The
    crew itself connects through the same port and gets its answer."""
    lab, a = world.lab, world.a
    before = counters(world.net)["foreign_to_pool"]
    attempts = {
        "nobody": from_host(a.gateway, lab.port, uid=NOBODY),
        "root": from_host(a.gateway, lab.port),
        "nobody, from 127.0.0.1": from_host(a.gateway, lab.port, uid=NOBODY, source="127.0.0.1"),
        "nobody, from the other crew's gateway": from_host(
            a.gateway, lab.port, uid=NOBODY, source=world.b.gateway
        ),
        "root, to the other crew": from_host(world.b.gateway, lab.port),
    }
    # The crew's own address, forged: the kernel will not even route it (a local destination
    # from a source that is not local), so nothing is sent.
    forged = from_host(a.gateway, lab.port, uid=NOBODY, source=a.address)
    assert forged["result"] == "error:ENETUNREACH", forged
    for who, outcome in attempts.items():
        assert outcome["result"] == "error:EHOSTUNREACH", (who, outcome)
        assert outcome["seconds"] < 1.0, (who, outcome)  # refused, not left to time out
    assert lab.listener.hits == []
    # One SYN each, each counted (the refusal itself is let back in, not counted).
    assert counters(world.net)["foreign_to_pool"] - before == len(attempts)
    # The crew, on the same gateway and port, gets its answer; so does the other crew.
    assert from_crew(world.crew_a, a.gateway, lab.port) == ANSWER
    assert from_crew(world.crew_b, world.b.gateway, lab.port) == ANSWER
    lab.listener.wait_for("proxy a")
    lab.listener.wait_for("proxy b")
    assert [(label, peer[0]) for label, _, peer in lab.listener.hits] == [
        ("proxy a", a.address),
        ("proxy b", world.b.address),
    ]
    assert counters(world.net)["foreign_to_pool"] - before == len(attempts)


def test_a_machine_on_the_lan_is_not_the_crew(world: World) -> None:
    """From outside (routed to the pool through the host): neither a gateway nor a crew, and
    no answer at all."""
    a, lab = world.a, world.lab
    before = counters(world.net)
    probes = [
        Probe("tcp", a.gateway, lab.port),
        Probe("tcp", world.b.gateway, lab.port),
        Probe("tcp", a.address, lab.port),
        Probe("udp", a.gateway, 53),
        Probe("icmp", a.gateway),
    ]
    results = run_probes(world.control, probes)
    # Dropped, not rejected: nothing goes back to the LAN.
    assert [results[p] for p in probes] == ["timeout"] * 3 + ["no reply"] * 2, results
    assert world.lab.listener.hits == []
    after = counters(world.net)
    assert after["foreign_to_pool"] - before["foreign_to_pool"] >= len(probes)
    # Refused before routing: nothing was left for the forward chain to see.
    assert after["forward_to_crews"] == before["forward_to_crews"]


def test_crew_a_cannot_reach_crew_b_gateway(world: World) -> None:
    """Covered by crew a's own chain (only its own gateway is accepted): dropped there, counted
    as crew a's drop, and never seen by the pool rule (its verdict came first)."""
    a, b, lab = world.a, world.b, world.lab
    before = (crew_drops(world.net, "crew-a"), counters(world.net)["foreign_to_pool"])
    results = run_probes(
        world.crew_a,
        [Probe("tcp", b.gateway, lab.port), Probe("tcp", b.address, lab.port)],
    )
    assert set(results.values()) == {"timeout"}, results
    assert lab.listener.hits == []
    drops, foreign = crew_drops(world.net, "crew-a"), counters(world.net)["foreign_to_pool"]
    assert drops - before[0] >= 2 and foreign == before[1]
    # And crew a still reaches its own.
    assert from_crew(world.crew_a, a.gateway, lab.port) == ANSWER


def test_the_rules_survive_reconcile_and_are_restored_if_removed(world: World) -> None:
    net, lab = world.net, world.lab
    assert net.reconcile().changes == ()
    listing = sh("nft", "-a", "list", "chain", "inet", lab.table, "prerouting").stdout
    handles = [
        line.rsplit("# handle ", 1)[1]
        for line in listing.splitlines()
        if 'comment "foreign' in line
    ]
    assert len(handles) == 2  # the host's, and everything else's
    for handle in handles:
        sh("nft", "delete", "rule", "inet", lab.table, "prerouting", "handle", handle)
    # Without the rules, the attack works: this is what they are for.
    assert from_host(world.a.gateway, lab.port, uid=NOBODY)["answer"] == ANSWER.decode()
    report = net.reconcile()
    assert report.actions() == ["rebuilt table"], report
    assert "prerouting" in report.changes[0].detail
    assert from_host(world.a.gateway, lab.port, uid=NOBODY)["result"] == "error:EHOSTUNREACH"
    assert from_crew(world.crew_a, world.a.gateway, lab.port) == ANSWER


# --- instances ------------------------------------------------------------------------------------


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    with make_lab(tmp_path) as lab:
        tables: list[str] = []
        lab.instance_tables = tables  # type: ignore[attr-defined]
        yield lab
        for table in tables:
            sh("nft", "delete", "table", "inet", table, check=False)


def free_pool(lab: Lab, *taken: str) -> str:
    for _ in range(20):
        pool = f"100.90.{random.randrange(256)}.0/24"
        if pool not in (lab.pool, *taken) and not _host_routes_any([pool]):
            return pool
    pytest.skip("no second free test pool")


def instance(lab: Lab, name: str, pool: str):  # type: ignore[no-untyped-def]
    from netns import CrewNetworks, naming

    config = lab.config(pool=pool)
    lab.instance_tables.append(naming(config.table, config.ifname_prefix, name).table)  # type: ignore[attr-defined]
    return CrewNetworks(config, lab.state_dir.parent / name, instance=name)


def test_a_second_instance_is_judged_by_its_own_table_only(lab: Lab) -> None:
    """Two instances configured alike but for their pools, a crew each. Each one's crew gets its
    answer; each table refuses the host only its own pool, and counts only that."""
    ns_one, ns_two = lab.namespace("one"), lab.namespace("two")
    with (
        instance(lab, "one", lab.pool) as one,
        instance(lab, "two", free_pool(lab)) as two,
    ):
        one.reconcile()
        two.reconcile()
        a = one.attach("crew-x", ns_path(ns_one))
        b = two.attach("crew-x", ns_path(ns_two))
        lab.listener.tcp(a.gateway, lab.port, label="proxy one")
        lab.listener.tcp(b.gateway, lab.port, label="proxy two")
        before = (counters(one)["foreign_to_pool"], counters(two)["foreign_to_pool"])
        assert from_crew(ns_two, b.gateway, lab.port) == ANSWER
        assert from_crew(ns_one, a.gateway, lab.port) == ANSWER
        assert (counters(one)["foreign_to_pool"], counters(two)["foreign_to_pool"]) == before
        # The host is refused each gateway by the table of that gateway's pool.
        assert from_host(b.gateway, lab.port, uid=NOBODY)["result"] == "error:EHOSTUNREACH"
        assert counters(one)["foreign_to_pool"] == before[0]
        assert counters(two)["foreign_to_pool"] == before[1] + 1
        assert from_host(a.gateway, lab.port, uid=NOBODY)["result"] == "error:EHOSTUNREACH"
        assert counters(one)["foreign_to_pool"] == before[0] + 1
        # A crew of one dials the other's gateway: dropped (by its own chain, or by the
        # other's table: whichever the kernel runs first), never answered.
        results = run_probes(ns_one, [Probe("tcp", b.gateway, lab.port)])
        assert list(results.values()) == ["timeout"]
        lab.listener.wait_for("proxy one")
        lab.listener.wait_for("proxy two")
        assert sorted(label for label, _, _ in lab.listener.hits) == ["proxy one", "proxy two"]
        # One releases its crew and drops its table: the other's crew is served as before.
        one.release("crew-x")
        one.delete_table()
        assert from_crew(ns_two, b.gateway, lab.port) == ANSWER


def test_an_instance_whose_pool_overlaps_another_ones_does_not_start(lab: Lab) -> None:
    """Its rule would refuse the other's crews their own gateways (and the other's, its). The
    other has no crew, hence no link that `check_pool` would see: its table's claim is what
    stops the start, before anything is changed."""
    from netns import PoolConflictError

    wide = str(ipaddress.IPv4Network(lab.pool).supernet(new_prefix=23))
    with instance(lab, "one", lab.pool) as one, instance(lab, "two", wide) as two:
        one.reconcile()
        with pytest.raises(PoolConflictError, match=f"table inet {one.naming.table}"):
            two.reconcile()
        assert sh("nft", "list", "table", "inet", two.naming.table, check=False).returncode != 0
        # The first one's own reconcile is unaffected by its own claim.
        assert one.reconcile().changes == ()
