"""Transparent capture in the kernel, proven with real packets: a crew's TCP to the captured
ports goes to the proxy on its own gateway (which reads where it was going with SO_ORIGINAL_DST),
what the crew's allow rules name is still reached directly, what its deny rules name is still
dropped (deny wins), other ports and the pool are never captured, and a reconcile restores a
capture chain someone deleted.

The lab (tests/test_netns_support.py): an "internet" namespace (198.51.100.10, TEST-NET-2) behind
a veth of its own, listeners there; crews in namespaces the test creates; a stand-in for the
proxy on each crew's gateway that records every connection's original destination. Nothing
leaves the machine.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from proxycore.io.transparent import original_destination
from tests.test_netns_support import (
    INTERNET_GATEWAY,
    INTERNET_HOST,
    NEEDS_KERNEL,
    Lab,
    Probe,
    make_lab,
    run_probes,
)

pytestmark = NEEDS_KERNEL

OTHER_HOST = "198.51.100.11"  # in the internet namespace's network, where nothing listens


@dataclass
class StandIn:
    """The proxy's place on a gateway: accepts, and records (original address, port)."""

    seen: list[tuple[str, int] | None] = field(default_factory=list)
    sockets: list[socket.socket] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def serve(self, gateway: str, port: int) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((gateway, port))
        sock.listen(64)
        sock.settimeout(0.1)
        self.sockets.append(sock)

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    conn, _ = sock.accept()
                except (TimeoutError, OSError):
                    continue
                captured = original_destination(conn, gateway, port)
                self.seen.append(None if captured is None else (captured.address, captured.port))
                conn.close()

        threading.Thread(target=loop, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        for sock in self.sockets:
            sock.close()


@dataclass
class World:
    lab: Lab
    crew_a: str
    crew_b: str
    standin: StandIn


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    with make_lab(tmp_path) as lab:
        internet = lab.wire("inet", INTERNET_GATEWAY, INTERNET_HOST)
        for port in (80, 443, 8080):
            lab.listener.tcp(INTERNET_HOST, port, netns=internet, label=f"tcp/{port}")
        # A service of the host itself on port 80 (the host's address on the lab's wire): no
        # crew reaches it, captured or not.
        lab.listener.tcp(INTERNET_GATEWAY, 80, label="host/80")
        standin = StandIn()
        try:
            yield World(lab, lab.namespace("crewa"), lab.namespace("crewb"), standin)
        finally:
            standin.close()


def networks(lab: Lab, capture: tuple[int, ...] = (80, 443)):  # type: ignore[no-untyped-def]
    from netns import CrewNetworks

    return CrewNetworks(lab.config(capture_ports=capture), lab.state_dir)


def results(netns: str, probes: list[Probe]) -> dict[str, str]:
    return {str(probe): result for probe, result in run_probes(netns, probes).items()}


def wait_seen(standin: StandIn, count: int) -> None:
    deadline = time.monotonic() + 2
    while len(standin.seen) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def test_captured_ports_go_to_the_proxy_with_their_original_destination(world: World) -> None:
    lab = world.lab
    with networks(lab) as net:
        net.reconcile()
        a = net.attach("crew-a", f"/run/netns/{world.crew_a}", ("allow:tcp:198.51.100.0/24:443",))
        b = net.attach("crew-b", f"/run/netns/{world.crew_b}", ("deny:tcp:198.51.100.10/32:80",))
        for crew in (a, b):
            world.standin.serve(crew.gateway, lab.port)
        got = results(
            world.crew_a,
            [
                Probe("tcp", INTERNET_HOST, 80),  # captured
                Probe("tcp", INTERNET_HOST, 443),  # its allow rule: reached directly
                Probe("tcp", INTERNET_HOST, 8080),  # not a captured port: dropped
                Probe("tcp", b.gateway, 443),  # the pool: never captured, dropped
            ],
        )
        assert got == {
            f"tcp {INTERNET_HOST}:80": "connected",
            f"tcp {INTERNET_HOST}:443": "connected",
            f"tcp {INTERNET_HOST}:8080": "timeout",
            f"tcp {b.gateway}:443": "timeout",
        }
        wait_seen(world.standin, 1)
        assert world.standin.seen == [(INTERNET_HOST, 80)]
        # The captured connection never reached the internet; the allowed one did, directly.
        lab.listener.wait_for("tcp/443")
        assert sorted(set(lab.listener.labels())) == ["tcp/443"]
        # Crew b's deny rule wins over capture: dropped, not redirected; another address is
        # captured as usual.
        got = results(world.crew_b, [Probe("tcp", INTERNET_HOST, 80), Probe("tcp", OTHER_HOST, 80)])
        assert got == {f"tcp {INTERNET_HOST}:80": "timeout", f"tcp {OTHER_HOST}:80": "connected"}
        wait_seen(world.standin, 2)
        assert world.standin.seen == [(INTERNET_HOST, 80), (OTHER_HOST, 80)]
        # A connection straight to the proxy's port is not a captured one.
        assert results(world.crew_a, [Probe("tcp", a.gateway, lab.port)]) == {
            f"tcp {a.gateway}:{lab.port}": "connected"
        }
        wait_seen(world.standin, 3)
        assert world.standin.seen[-1] is None
        status = next(c for c in net.show().crews if c.crew == "crew-a")
        assert status is not None


def test_a_deleted_capture_chain_is_restored_and_capture_can_be_off(world: World) -> None:
    lab = world.lab
    with networks(lab) as net:
        net.reconcile()
        a = net.attach("crew-a", f"/run/netns/{world.crew_a}")
        world.standin.serve(a.gateway, lab.port)
        chain = f"capture_{a.ifname}"
        # Captured or not, the host's own service on 80 is out of reach (no input chain here:
        # the filter must not let such a packet on towards a NAT that sends it elsewhere).
        assert results(world.crew_a, [Probe("tcp", INTERNET_GATEWAY, 80)]) == {
            f"tcp {INTERNET_GATEWAY}:80": "timeout"
        }
        subprocess.run(
            ["nft", "delete", "element", "inet", lab.table, "crew_capture", f"{{ {a.ifname} }}"],
            check=True,
        )
        subprocess.run(["nft", "flush", "chain", "inet", lab.table, chain], check=True)
        assert results(
            world.crew_a, [Probe("tcp", INTERNET_HOST, 80), Probe("tcp", INTERNET_GATEWAY, 80)]
        ) == {
            # Without its capture: dropped, fail closed, both to the internet (in forward) and
            # to the host's own address (the captured rule never takes it).
            f"tcp {INTERNET_HOST}:80": "timeout",
            f"tcp {INTERNET_GATEWAY}:80": "timeout",
        }
        report = net.reconcile()
        assert "restored rules" in report.actions(), report
        assert results(world.crew_a, [Probe("tcp", INTERNET_HOST, 80)]) == {
            f"tcp {INTERNET_HOST}:80": "connected"
        }
    # The same crews under a configuration without capture: the table is rebuilt without it.
    with networks(lab, capture=()) as net:
        net.reconcile()
        assert results(world.crew_a, [Probe("tcp", INTERNET_HOST, 80)]) == {
            f"tcp {INTERNET_HOST}:80": "timeout"
        }
    assert not [label for label in lab.listener.labels() if label in ("tcp/80", "host/80")]
