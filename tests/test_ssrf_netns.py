"""SSRF refusals, proven with the proxy inside a network namespace that has no route anywhere.

The proxy, a canary listener and the clients all run in a namespace made by this test with only
`lo` up: even if the guard had a bug, no packet could leave the machine. The canary listens on
the loopback addresses the table targets; it must never see a connection.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import free_port, start_proxy

pytestmark = pytest.mark.netns

NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)

RESOLVE = (
    '"internal.test" = "10.0.0.1", "meta.test" = "169.254.169.254", '
    '"loop.test" = "127.0.0.1", "v6loop.test" = "::1"'
)

CANARY = r"""
import socket, sys, threading, time
path = sys.argv[1]
def serve(family, address):
    s = socket.socket(family)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, 80)); s.listen(16)
    while True:
        c, peer = s.accept()
        with open(path, "a") as f:
            f.write(f"{address} <- {peer}\n")
        c.close()
for fam, addr in [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]:
    threading.Thread(target=serve, args=(fam, addr), daemon=True).start()
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def netns():
    name = f"apx-ssrf-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        routes = subprocess.run(
            ["ip", "-n", name, "route", "show"], capture_output=True, text=True, check=True
        ).stdout
        assert "default" not in routes  # the namespace cannot reach anything but itself
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@NEEDS_ROOT
def test_ssrf_table_refused_with_no_connection(netns: str, tmp_path: Path) -> None:
    canary_log = tmp_path / "canary.log"
    canary = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", CANARY, str(canary_log)],
        stdout=subprocess.PIPE,
    )
    try:
        assert canary.stdout is not None and canary.stdout.readline().strip() == b"ready"
        port = free_port()
        events = tmp_path / "events.jsonl"
        config = tmp_path / "proxy.toml"
        # Free mode: the name policy allows everything, so only the SSRF guard stands between
        # the agent and these targets. No ssrf_allow ranges at all.
        config.write_text(f"""
[listen]
port = {port}
[[crew]]
name = "ssrf"
gateway = "127.0.0.1"
mode = "free"
[upstream]
resolve = {{ {RESOLVE} }}
[events]
path = "{events}"
flush_interval = 0.05
""")
        proxy = start_proxy(config, host="127.0.0.1", port=port, events=events, netns=netns)
        try:
            cases = {
                "http://127.0.0.1/": "ssrf_loopback",
                "http://10.0.0.1/": "ssrf_private",
                "http://169.254.169.254/latest/meta-data/": "ssrf_metadata",
                "http://100.64.0.1/": "ssrf_cgnat",
                "http://[::1]/": "ssrf_loopback",
                "http://[::ffff:127.0.0.1]/": "ssrf_ipv4_mapped",
                "http://0x7f.1/": "ip_shorthand",
                "http://2130706433/": "ip_shorthand",
                "http://0.0.0.0/": "ssrf_unspecified",
                "http://internal.test/": "ssrf_private",
                "http://meta.test/": "ssrf_metadata",
                "http://loop.test/": "ssrf_loopback",
                "http://v6loop.test/": "ssrf_loopback",
            }
            for url, rule in cases.items():
                # Raw request lines: curl would rewrite 0x7f.1 to 127.0.0.1 before sending.
                response = _raw_in_netns(
                    netns,
                    port,
                    b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % url.encode(),
                )
                assert response.startswith("HTTP/1.1 403"), (url, response)
                body = json.loads(response.split("\r\n\r\n", 1)[1])
                assert body["rule"] == rule, (url, body)
            # And one real client, end to end.
            result = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    netns,
                    "curl",
                    "-sS",
                    "-g",
                    "--max-time",
                    "10",
                    "-x",
                    f"http://127.0.0.1:{port}",
                    "-w",
                    "\n%{http_code}",
                    "http://169.254.169.254/latest/meta-data/",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            )
            body, status = result.stdout.rsplit("\n", 1)
            assert status == "403" and json.loads(body)["rule"] == "ssrf_metadata"
            # CONNECT gets the same guard.
            for target, rule in [
                ("10.0.0.1:443", "ssrf_private"),
                ("127.0.0.1:80", "ssrf_loopback"),
                ("[::1]:80", "ssrf_loopback"),
            ]:
                response = _raw_in_netns(
                    netns, port, b"CONNECT %s HTTP/1.1\r\nHost: x\r\n\r\n" % target.encode()
                )
                assert response.startswith("HTTP/1.1 403"), (target, response)
                assert f'"rule":"{rule}"' in response, (target, response)
        finally:
            proxy.stop()
        time.sleep(0.2)
        assert not canary_log.exists(), canary_log.read_text()
    finally:
        canary.kill()
        canary.wait()


def _raw_in_netns(netns: str, port: int, request: bytes) -> str:
    script = (
        "import socket, sys\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=10)\n"
        f"s.sendall({request!r})\n"
        "data = b''\n"
        "while chunk := s.recv(65536):\n"
        "    data += chunk\n"
        "sys.stdout.write(data.decode())\n"
    )
    result = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", script],
        capture_output=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.decode()
