"""Address rules through applianced end to end: `crew create --net`, a real crew (Docker, runc),
real packets from inside it, the proxy's 403, and a daemon restart.

The destination is one of the host's own private addresses (docker0's, say): a crew's packet
accepted for it goes to the host's input path, so no forwarding and no other firewall of the
host is involved; tests/test_netns_netrules.py covers the forwarded case in namespaces.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess

import pytest

from tests.daemon_support import REACH_TEST_HOSTS, Appliance
from tests.test_daemon_e2e import HostListener

pytestmark = pytest.mark.docker

PRIVATE = [ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")]


def host_private_address(pool: str) -> str | None:
    out = subprocess.run(
        ["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    for line in out.splitlines():
        address = ipaddress.IPv4Address(line.split()[3].split("/")[0])
        if any(address in n for n in PRIVATE) and address not in ipaddress.IPv4Network(pool):
            return str(address)
    return None


def test_address_rules_end_to_end(appliance: Appliance) -> None:
    app = appliance
    host = host_private_address(app.pool)
    if host is None:
        pytest.skip("the host has no private IPv4 address to aim at")
    allowed, denied, other = HostListener(), HostListener(), HostListener()
    try:
        app.start()
        name = app.crew("net")
        code, created = app.ctl_json(
            "crew",
            "create",
            name,
            *REACH_TEST_HOSTS,
            "--allow",
            host,
            "--net",
            f"allow:tcp:{host}:{allowed.port}",
            "--net",
            f"allow:tcp:{host}/32:{denied.port}",
            "--net",
            f"deny:tcp:{host}/32:{denied.port}",
        )
        assert code == 0, (created, app.log_text())
        crew = created["crew"]
        assert crew["net"] == [
            f"allow:tcp:{host}/32:{allowed.port}",
            f"allow:tcp:{host}/32:{denied.port}",
            f"deny:tcp:{host}/32:{denied.port}",
        ]
        gateway = crew["gateway"]

        def direct(port: int) -> int:
            done = app.ctl(
                "run", name, "--timeout", "20", "--", "sh", "-c", f"echo hi | nc -w 3 {host} {port}"
            )
            return done.returncode

        def check() -> None:
            before = (allowed.hits, denied.hits, other.hits)
            assert direct(allowed.port) == 0
            assert direct(denied.port) != 0  # deny wins over the allow rule for the same port
            assert direct(other.port) != 0  # no rule
            assert (allowed.hits, denied.hits, other.hits) == (
                before[0] + 1,
                before[1],
                before[2],
            )
            # Through the proxy, the deny rule is the proxy's answer too.
            raw = (
                f"printf 'GET http://{host}:{denied.port}/ HTTP/1.1\\r\\nHost: {host}\\r\\n"
                f"Connection: close\\r\\n\\r\\n' | nc {gateway} {app.port}"
            )
            refused = app.ctl("run", name, "--", "sh", "-c", raw)
            assert "403" in refused.stdout.splitlines()[0], refused.stdout
            assert "net_deny" in refused.stdout
            assert denied.hits == before[1]

        check()
        # A restart: the rules come back from the state, in the kernel and in the proxy.
        app.stop()
        app.start()
        check()
        code, shown = app.ctl_json("crew", "show", name)
        assert code == 0 and shown["crew"]["net"] == crew["net"]

        # Replaced at run time: only `other` now.
        code, result = app.ctl_json("crew", "net", name, "--net", f"allow:tcp:{host}:{other.port}")
        assert code == 0 and result["changed"], result
        assert result["net"] == [f"allow:tcp:{host}/32:{other.port}"]
        before = (allowed.hits, other.hits)
        assert direct(other.port) == 0 and direct(allowed.port) != 0
        assert (allowed.hits, other.hits) == (before[0], before[1] + 1)
        code, shown = app.ctl_json("crew", "show", name)
        assert shown["crew"]["net"] == result["net"]
        done = app.ctl("--json", "journal", "tail", "-n", "200", "--type", "crew.net_changed")
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        assert [json.loads(row["payload"])["net"] for row in rows] == [result["net"]]
        created = app.ctl("--json", "journal", "tail", "-n", "200", "--type", "crew.created")
        payloads = [json.loads(json.loads(line)["payload"]) for line in created.stdout.splitlines()]
        assert [p["net"] for p in payloads if p["crew"] == name] == [crew["net"]]

        code, _ = app.ctl_json("crew", "rm", name)
        assert code == 0
        table = subprocess.run(
            ["nft", "-j", "list", "table", "inet", app.table], capture_output=True, text=True
        ).stdout
        sets = [i["set"] for i in json.loads(table or '{"nftables": []}')["nftables"] if "set" in i]
        # The crew's sets went with it; the pool's free slots keep theirs, empty.
        assert [s["name"] for s in sets if s.get("elem")] == []
        assert len(sets) == 2 * len(app.links(include_pool=True))
    finally:
        for listener in (allowed, denied, other):
            listener.close()
