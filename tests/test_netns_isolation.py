"""A crew's namespace reaches its proxy port and nothing else: proven with real packets.

The lab (tests/test_netns_support.py): two crews attached by `CrewNetworks`; an "internet"
namespace (198.51.100.10, 2001:db8:10::10) with listeners on TCP 80 and 53 and UDP 53; a control
namespace (203.0.113.10) that is not a crew; on the host, a stand-in for the proxy listening on
0.0.0.0 (so every host address would answer if the rules let it), a second port, and DNS
listeners on the gateways. The host ends of the internet, the control and the crews have IPv4
forwarding on, as on a Docker host: only the appliance's rules stand in the way.

Every listener records every hit; the assertions are on both the probes' outcome and the
listeners' records (nothing arrived), and on the kernel's counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_netns_support import (
    CONTROL_GATEWAY,
    CONTROL_HOST,
    INTERNET_GATEWAY,
    INTERNET_GATEWAY6,
    INTERNET_HOST,
    INTERNET_HOST6,
    NEEDS_KERNEL,
    Lab,
    Probe,
    host_ipv4_addresses,
    host_mac,
    in_namespace,
    make_lab,
    packet_ipv4,
    raw_udp,
    run_probes,
    set_sysctl,
    sh,
)

pytestmark = NEEDS_KERNEL


@dataclass
class World:
    lab: Lab
    net: object  # CrewNetworks
    a: object  # CrewNetwork
    b: object
    crew_a: str
    crew_b: str
    internet: str
    control: str


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    from netns import CrewNetworks

    with make_lab(tmp_path) as lab:
        internet = lab.wire("inet", INTERNET_GATEWAY, INTERNET_HOST)
        sh("ip", "addr", "add", f"{INTERNET_GATEWAY6}/64", "dev", lab.links[-1], "nodad")
        sh("ip", "-n", internet, "addr", "add", f"{INTERNET_HOST6}/64", "dev", "eth0", "nodad")
        control = lab.wire("ctl", CONTROL_GATEWAY, CONTROL_HOST)
        crew_a = lab.namespace("crewa")
        crew_b = lab.namespace("crewb")
        net = CrewNetworks(lab.config(log_drops=True), lab.state_dir)
        try:
            net.reconcile()
            a = net.attach("crew-a", f"/run/netns/{crew_a}")
            b = net.attach("crew-b", f"/run/netns/{crew_b}")
            # As on a Docker host (ip_forward=1): only the rules stop forwarding.
            for network in (a, b):
                set_sysctl(f"net.ipv4.conf.{network.ifname}.forwarding", "1")
            listen = lab.listener
            listen.tcp("0.0.0.0", lab.port, label="proxy")
            listen.tcp("0.0.0.0", lab.other_port, label="other port")
            listen.tcp("::", lab.port, label="proxy v6")
            for network, name in ((a, "a"), (b, "b")):
                listen.tcp(network.gateway, 53, label=f"gateway {name} tcp/53")
                listen.udp(network.gateway, 53, label=f"gateway {name} udp/53")
            for port in (80, 53):
                listen.tcp(INTERNET_HOST, port, netns=internet, label=f"internet tcp/{port}")
                listen.tcp(INTERNET_HOST6, port, netns=internet, label=f"internet6 tcp/{port}")
            listen.udp(INTERNET_HOST, 53, netns=internet, label="internet udp/53")
            listen.tcp("0.0.0.0", 8080, netns=crew_b, label="crew b service")
            listen.tcp("0.0.0.0", 8080, netns=crew_a, label="crew a service")
            yield World(lab, net, a, b, crew_a, crew_b, internet, control)
        finally:
            net.close()


def test_the_lab_would_let_traffic_through_without_the_rules(world: World) -> None:
    """Control: from a namespace that is not a crew, the same targets answer (but a crew's
    gateway: the pool is the crews' alone, tests/test_netns_gateway.py)."""
    lab = world.lab
    results = run_probes(
        world.control,
        [
            Probe("tcp", INTERNET_HOST, 80),  # forwarded by the host
            Probe("udp", INTERNET_HOST, 53),
            Probe("tcp", CONTROL_GATEWAY, lab.other_port),  # a host address, another port
        ],
    )
    assert set(results.values()) == {"connected", "reply"}, results


def test_crew_reaches_its_proxy_port_and_nothing_else(world: World) -> None:
    lab, a = world.lab, world.a
    others = [
        address
        for address in host_ipv4_addresses()
        if address != a.gateway and not address.startswith("127.")
    ]
    assert world.b.gateway in others and INTERNET_GATEWAY in others
    allowed = Probe("tcp", a.gateway, lab.port)
    blocked = [
        Probe("tcp", a.gateway, lab.other_port),  # another port on its own gateway
        Probe("tcp", a.gateway, 22),
        *(Probe("tcp", address, lab.port) for address in others),  # host's other addresses
        Probe("tcp", INTERNET_HOST, 80),  # a host on "the internet", bypassing the proxy
        Probe("tcp", INTERNET_HOST, 53),  # DNS over TCP
        Probe("udp", INTERNET_HOST, 53),  # DNS over UDP
        Probe("tcp", a.gateway, 53),
        Probe("udp", a.gateway, 53),  # no resolver on the gateway either
        Probe("tcp", world.b.address, 8080),  # the other crew itself
        Probe("icmp", a.gateway),
        Probe("icmp", INTERNET_HOST),
        Probe("icmp", world.b.gateway),
    ]
    before = _crew_status(world, "crew-a")
    results = run_probes(world.crew_a, [allowed, *blocked])
    assert results[allowed] == "connected"
    for probe in blocked:
        expected = "timeout" if probe.kind == "tcp" else "no reply"
        assert results[probe] == expected, (str(probe), results[probe])
    # Only the proxy stand-in saw anything, and only from crew a's own address.
    lab.listener.wait_for("proxy")
    assert lab.listener.labels() == ["proxy"], lab.listener.hits
    assert lab.listener.hits[0][2][0] == a.address
    after = _crew_status(world, "crew-a")
    # Every blocked probe sent at least one packet, and each was counted as a drop.
    assert after.dropped_packets - before.dropped_packets >= len(blocked)
    assert after.accepted_packets > before.accepted_packets
    log = [rule for rule in after.rules if rule.role == "log"]
    assert len(log) == 1  # log_drops: a rate-limited log rule naming the crew


def test_crew_has_no_ipv6(world: World) -> None:
    a = world.a
    status = _crew_status(world, "crew-a")
    assert status.crew_end is not None and status.crew_end.ipv6_disabled
    for device in ("all", "default", "eth0"):
        for key, value in (("disable_ipv6", "1"), ("accept_ra", "0")):
            path = Path(f"/proc/sys/net/ipv6/conf/{device}/{key}")
            read = in_namespace(f"/run/netns/{world.crew_a}", path.read_text)
            assert read.strip() == value, (device, key)
    inner = sh("ip", "-n", world.crew_a, "-6", "addr", "show").stdout
    assert "inet6" not in inner  # not even ::1 or a link-local address
    host_end = sh("ip", "-6", "addr", "show", "dev", a.ifname).stdout
    assert "inet6" not in host_end
    results = run_probes(
        world.crew_a,
        [
            Probe("tcp", "fe80::1%eth0", world.lab.port),  # link-local, on the crew's link
            Probe("tcp", INTERNET_GATEWAY6, world.lab.port),
            Probe("tcp", INTERNET_HOST6, 80),  # global
            Probe("udp", INTERNET_HOST6, 53),
        ],
    )
    assert all(result.startswith("error:") for result in results.values()), results
    assert world.lab.listener.hits == []


def test_ipv6_is_dropped_even_if_the_crew_turns_it_back_on(world: World) -> None:
    """Defence in depth: a crew with CAP_NET_ADMIN re-enables IPv6 on both ends of its link."""
    a, ns = world.a, world.crew_a
    for key in ("disable_ipv6", "accept_dad"):
        for device in ("all", "default", "eth0"):
            set_sysctl(f"net.ipv6.conf.{device}.{key}", "0", netns=ns)
        set_sysctl(f"net.ipv6.conf.{a.ifname}.{key}", "0")
    sh("ip", "addr", "add", "2001:db8:aa::1/64", "dev", a.ifname, "nodad")
    sh("ip", "-n", ns, "addr", "add", "2001:db8:aa::2/64", "dev", "eth0", "nodad")
    sh("ip", "-n", ns, "-6", "route", "add", "default", "via", "2001:db8:aa::1")
    link_local = next(
        line.split()[1].split("/")[0]
        for line in sh("ip", "-6", "addr", "show", "dev", a.ifname).stdout.splitlines()
        if "fe80::" in line
    )
    before = _crew_status(world, "crew-a").dropped_packets
    results = run_probes(
        ns,
        [
            Probe("tcp", "2001:db8:aa::1", world.lab.port),
            Probe("tcp", f"{link_local}%eth0", world.lab.port),
            Probe("tcp", INTERNET_HOST6, 80),
            Probe("udp", INTERNET_HOST6, 53),
        ],
    )
    assert set(results.values()) <= {"timeout", "no reply"}, results
    assert world.lab.listener.hits == []
    assert _crew_status(world, "crew-a").dropped_packets - before >= 4


def test_raw_sockets_reach_nothing(world: World) -> None:
    a, port = world.a, world.lab.port
    before = _crew_status(world, "crew-a")
    raw_udp(world.crew_a, INTERNET_HOST, 53)
    raw_udp(world.crew_a, a.gateway, 53)
    mac = host_mac(a.ifname)
    # Whole frames with spoofed sources: the control namespace's address, the other crew's,
    # the gateway's own; to the internet, to the gateway's DNS port and, as TCP SYNs, to the
    # proxy port itself (accepted only from the crew's own address).
    spoofed = (CONTROL_HOST, world.b.address, a.gateway)
    for source in spoofed:
        packet_ipv4(world.crew_a, "eth0", mac, source, INTERNET_HOST, 53)
        packet_ipv4(world.crew_a, "eth0", mac, source, a.gateway, 53)
        packet_ipv4(world.crew_a, "eth0", mac, source, a.gateway, port, protocol="tcp")
    run_probes(world.crew_a, [], timeout=0.3)  # let the packets land
    middle = _crew_status(world, "crew-a")
    assert world.lab.listener.hits == []
    assert middle.dropped_packets - before.dropped_packets == 2 + 3 * len(spoofed)
    assert middle.accepted_packets == before.accepted_packets
    # Control: the same frame with the crew's own source is accepted, so the frames above did
    # reach the rules and were dropped for what they were.
    packet_ipv4(world.crew_a, "eth0", mac, a.address, a.gateway, port, protocol="tcp")
    run_probes(world.crew_a, [], timeout=0.3)
    # (the SYN, then the RST the crew's own kernel sends for the unexpected SYN-ACK)
    assert _crew_status(world, "crew-a").accepted_packets > middle.accepted_packets


def test_nothing_is_forwarded_to_a_crew(world: World) -> None:
    """From outside (the control namespace, routed through the host), a crew is unreachable:
    dropped in prerouting as traffic to the pool from elsewhere, and without that rule by the
    forward chain, a second layer of its own."""
    net, lab = world.net, world.lab
    probe = Probe("tcp", world.a.address, 8080)
    before = dict((c.role, c.packets) for c in net.show().counters)
    assert run_probes(world.control, [probe]) == {probe: "timeout"}
    middle = dict((c.role, c.packets) for c in net.show().counters)
    assert middle["foreign_to_pool"] > before["foreign_to_pool"]
    assert middle["forward_to_crews"] == before["forward_to_crews"]
    listing = sh("nft", "-a", "list", "chain", "inet", lab.table, "prerouting").stdout
    for line in listing.splitlines():
        if 'comment "foreign ' in line:
            handle = line.rsplit("# handle ", 1)[1]
            sh("nft", "delete", "rule", "inet", lab.table, "prerouting", "handle", handle)
    assert run_probes(world.control, [probe]) == {probe: "timeout"}
    assert world.lab.listener.hits == []
    after = dict((c.role, c.packets) for c in net.show().counters)
    assert after["forward_to_crews"] > middle["forward_to_crews"]


def test_two_crews_are_isolated_and_teardown_of_one_leaves_the_other(world: World) -> None:
    lab, a, b, net = world.lab, world.a, world.b, world.net
    probes_a = run_probes(
        world.crew_a, [Probe("tcp", a.gateway, lab.port), Probe("tcp", b.gateway, lab.port)]
    )
    probes_b = run_probes(
        world.crew_b,
        [
            Probe("tcp", b.gateway, lab.port),
            Probe("tcp", a.gateway, lab.port),
            Probe("tcp", a.address, 8080),
        ],
    )
    assert list(probes_a.values()) == ["connected", "timeout"]
    assert list(probes_b.values()) == ["connected", "timeout", "timeout"]
    lab.listener.wait_for("proxy", count=2)
    assert sorted(hit[2][0] for hit in lab.listener.hits) == sorted([a.address, b.address])

    b_rules = [(r.comment) for r in _crew_status(world, "crew-b").rules]
    net.detach("crew-a")
    assert sh("ip", "link", "show", a.ifname, check=False).returncode != 0
    report = net.show()
    assert f"crew_{a.ifname}" not in sh("nft", "list", "table", "inet", lab.table).stdout
    status_b = next(c for c in report.crews if c.crew == "crew-b")
    assert status_b.in_map and [r.comment for r in status_b.rules] == b_rules
    assert status_b.host_end is not None and status_b.host_end.up
    lab.listener.hits.clear()
    after = run_probes(world.crew_b, [Probe("tcp", b.gateway, lab.port)])
    assert list(after.values()) == ["connected"]
    # Crew a's namespace is now cut off entirely: no interface but lo.
    assert "eth0" not in sh("ip", "-n", world.crew_a, "link").stdout
    status_a = next(c for c in report.crews if c.crew == "crew-a")
    assert status_a.phase == "detached" and not status_a.in_map


def test_show_reports_addresses_rules_and_counters_from_the_kernel(world: World) -> None:
    report = world.net.show()
    assert report.table_present and report.base_differences == ()
    assert report.orphan_links == () and report.orphan_chains == ()
    status = _crew_status(world, "crew-a")
    assert status.phase == "ready" and status.namespace_alive and status.in_map
    assert status.host_end is not None
    assert status.host_end.addresses == (f"{world.a.gateway}/30",)
    assert status.crew_end is not None
    assert status.crew_end.addresses == (f"{world.a.address}/30",)
    assert status.crew_end.default_gateway == world.a.gateway
    assert [rule.role for rule in status.rules] == [
        "allow",
        "to-pool",
        "net-deny",
        "net-allow",
        "log",
        "drop",
    ]
    assert {c.role for c in report.counters} == {
        "unmapped_drops",
        "forward_from_crews",
        "forward_to_crews",
        "foreign_to_pool",
    }


def _crew_status(world: World, crew: str):  # type: ignore[no-untyped-def]
    return next(c for c in world.net.show().crews if c.crew == crew)
