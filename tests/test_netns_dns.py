"""A crew's DNS in the kernel, with real packets: with `NetConfig.dns` a crew reaches its own
gateway's port 53 over UDP and TCP (the proxy workers serve its DNS responder there), never
another crew's gateway; without it, port 53 on the gateway is dropped like any other port.

The lab: tests/test_netns_support.py; listeners on the gateways stand in for the responder.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_netns_support import NEEDS_KERNEL, Probe, make_lab, run_probes

pytestmark = NEEDS_KERNEL


def test_crew_reaches_its_own_gateway_port_53_only(tmp_path: Path) -> None:
    from netns import CrewNetworks

    with make_lab(tmp_path) as lab:
        crew_a, crew_b = lab.namespace("crewa"), lab.namespace("crewb")
        with CrewNetworks(lab.config(dns=True), lab.state_dir) as net:
            net.reconcile()
            a = net.attach("crew-a", f"/run/netns/{crew_a}", ())
            b = net.attach("crew-b", f"/run/netns/{crew_b}", ())
            for crew in (a, b):
                lab.listener.tcp(crew.gateway, 53, label=f"tcp {crew.crew}")
                lab.listener.udp(crew.gateway, 53, label=f"udp {crew.crew}")
            got = run_probes(
                crew_a,
                [
                    Probe("udp", a.gateway, 53),
                    Probe("tcp", a.gateway, 53),
                    Probe("udp", b.gateway, 53),  # the pool: another crew's gateway
                    Probe("tcp", b.gateway, 53),
                    Probe("udp", a.gateway, 54),  # not the DNS port
                ],
            )
            assert {str(k): v for k, v in got.items()} == {
                f"udp {a.gateway}:53": "reply",
                f"tcp {a.gateway}:53": "connected",
                f"udp {b.gateway}:53": "no reply",
                f"tcp {b.gateway}:53": "timeout",
                f"udp {a.gateway}:54": "no reply",
            }
    with make_lab(tmp_path / "off") as lab:
        crew_a = lab.namespace("crewa")
        with CrewNetworks(lab.config(), lab.state_dir) as net:  # the lab's default: dns off
            net.reconcile()
            a = net.attach("crew-a", f"/run/netns/{crew_a}", ())
            lab.listener.tcp(a.gateway, 53)
            lab.listener.udp(a.gateway, 53)
            got = run_probes(crew_a, [Probe("udp", a.gateway, 53), Probe("tcp", a.gateway, 53)])
            assert sorted(got.values()) == ["no reply", "timeout"]
