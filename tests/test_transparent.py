"""Transparent capture (proxycore/io/transparent.py) with real packets and a real DNAT.

Two network namespaces made by this test, neither with a route off the machine: "host", where
the proxy runs with crew "alpha" served on 127.0.0.1, and "internet" behind a veth, with an HTTP
server on port 80 and a TLS server on port 443 at two addresses (the upstream and a canary) and
a scripted DNS server (tests/dns_server.py). A tool that ignores any proxy runs in "host" as
UID 65534; an nftables rule there sends its TCP to ports 80 and 443 to the proxy (DNAT in the
output hook, as the appliance's crew rules do in prerouting), and nothing else of it anywhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from appliance.crew_ca import new_ca
from tests.conftest import ROOT, RunningProxy, free_port, leaf_toml, start_proxy

pytestmark = pytest.mark.netns

UPSTREAM, CANARY, DNS = "1.1.2.2", "1.1.2.3", "1.1.2.53"
TOOL_UID = 65534
PLAN = {"allowed.test": [[UPSTREAM]], "other.test": [[UPSTREAM]], "leafed.test": [[UPSTREAM]]}

# HTTP on 80 and TLS on 443 at each address; every request is logged "ADDRESS:PORT <- LINE"
# and answered with the address and the Host it named.
SERVERS = r"""
import socket, ssl, sys, threading
log, cert, key = sys.argv[1], sys.argv[2], sys.argv[3]
context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
context.load_cert_chain(cert, key)
def serve(address, port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port)); s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=answer, args=(c, address, port), daemon=True).start()
def answer(c, address, port):
    try:
        c.settimeout(5)
        if port == 443:
            c = context.wrap_socket(c, server_side=True)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk: break
            data += chunk
        line = data.split(b"\r\n")[0].decode(errors="replace")
        lines = data.split(b"\r\n")
        host = [l.split(b":", 1)[1].strip() for l in lines if l.lower().startswith(b"host:")]
        with open(log, "a") as f:
            f.write(f"{address}:{port} <- {line}\n")
        body = address.encode() + b" " + (host[0] if host else b"-")
        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                  % (len(body), body))
    except (OSError, ssl.SSLError):
        pass
    finally:
        c.close()
for address in sys.argv[4:]:
    for port in (80, 443):
        threading.Thread(target=serve, args=(address, port), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""

# The tool: connects straight to ADDRESS:PORT (no proxy), optionally over TLS with SNI; prints
# what it read, or "TLSERROR <reason>" / "ERROR <reason>".
TOOL = r"""
import socket, ssl, sys
address, port, sni, ca, raw = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
try:
    s = socket.create_connection((address, port), timeout=10)
    if port == 443:
        context = ssl.create_default_context(cafile=ca)
        if sni == "-":
            context.check_hostname = False
        s = context.wrap_socket(s, server_hostname=None if sni == "-" else sni)
    s.sendall(raw.encode().decode("unicode_escape").encode("latin-1"))
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk: break
        out += chunk
    sys.stdout.write(out.decode("latin-1"))
except ssl.SSLError as exc:
    print("TLSERROR", exc.reason or exc)
except OSError as exc:
    print("ERROR", exc)
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class World:
    host: str
    tmp: Path
    proxy: RunningProxy
    log: Path
    ca: Path
    crew_ca: Path

    def tool(
        self, address: str, port: int, raw: str, sni: str = "-", ca: Path | None = None
    ) -> str:
        """The proxy-ignoring tool, as UID 65534 in the host namespace."""
        done = subprocess.run(
            [
                "ip", "netns", "exec", self.host,
                "setpriv", f"--reuid={TOOL_UID}", f"--regid={TOOL_UID}", "--clear-groups",
                sys.executable, "-c", TOOL, address, str(port), sni, str(ca or self.ca), raw,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )  # fmt: skip
        return done.stdout

    def recorded(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def events(self, after: int = 0) -> list[dict[str, object]]:
        time.sleep(0.3)  # the proxy flushes its events every 0.05 s
        path = self.proxy.events_path
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(line) for line in lines[after:]]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nft"):
        pytest.skip("needs root, iproute2 and nft")
    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv (util-linux)")
    tmp = tmp_path_factory.mktemp("transparent")
    ca = trustme.CA()
    leaf = ca.issue_cert("allowed.test", "other.test", "leafed.test")
    # The tool (UID 65534) reads the CA: a directory of its own outside pytest's (0700) tree.
    readable = Path(tempfile.mkdtemp(prefix="apx-transparent-"))
    readable.chmod(0o755)
    cert, key, ca_path = tmp / "cert.pem", tmp / "key.pem", readable / "ca.pem"
    leaf.private_key_and_cert_chain_pem.write_to_path(str(cert))
    leaf.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_path))
    # The crew's own CA, and its leaf for leafed.test: that host's captured TLS is terminated.
    crew_ca = new_ca("alpha")
    crew_ca_path = readable / "crew-ca.pem"
    crew_ca_path.write_bytes(crew_ca.cert_pem)
    for path in (readable / "ca.pem", crew_ca_path):
        path.touch()
        path.chmod(0o644)
    os.chmod(ca_path, 0o644)
    tag = uuid.uuid4().hex[:6]
    host, internet = f"apx-tph-{tag}", f"apx-tpi-{tag}"
    processes: list[subprocess.Popen[bytes]] = []
    ip("netns", "add", host)
    ip("netns", "add", internet)
    try:
        for ns in (host, internet):
            ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "add", f"h{tag}", "type", "veth", "peer", "name", f"i{tag}")
        ip("link", "set", f"h{tag}", "netns", host)
        ip("link", "set", f"i{tag}", "netns", internet)
        ip("-n", host, "addr", "add", "1.1.2.1/24", "dev", f"h{tag}")
        for address in (UPSTREAM, CANARY, DNS):
            ip("-n", internet, "addr", "add", f"{address}/24", "dev", f"i{tag}")
        ip("-n", host, "link", "set", f"h{tag}", "up")
        ip("-n", internet, "link", "set", f"i{tag}", "up")

        def start(ns: str, *argv: str) -> None:
            process = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, *argv],
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            processes.append(process)
            assert process.stdout is not None and process.stdout.readline().strip() == b"ready"

        log, plan = tmp / "recorded.log", tmp / "plan.json"
        plan.write_text(json.dumps(PLAN))
        start(internet, "-c", SERVERS, str(log), str(cert), str(key), UPSTREAM, CANARY)
        start(
            internet,
            str(ROOT / "tests" / "dns_server.py"),
            DNS,
            "53",
            str(plan),
            str(tmp / "dns.log"),
        )

        port = free_port()
        # The capture: the tool's TCP to 80 and 443 anywhere goes to the proxy on alpha's
        # gateway; the proxy's own connections (root) are not touched.
        rules = textwrap.dedent(f"""
            table ip capture {{
                chain output {{
                    type nat hook output priority -100;
                    meta skuid {TOOL_UID} tcp dport {{ 80, 443 }} dnat to 127.0.0.1:{port}
                }}
            }}
        """)
        subprocess.run(
            ["ip", "netns", "exec", host, "nft", "-f", "-"], input=rules, text=True, check=True
        )
        events = tmp / "events.jsonl"
        config = tmp / "proxy.toml"
        config.write_text(f"""
[listen]
port = {port}
[[crew]]
name = "alpha"
gateway = "127.0.0.1"
mode = "restricted"
allow = ["allowed.test", "leafed.test"]
{leaf_toml(crew_ca, tmp, "leafed.test")}
[[crew.rules]]
host = "leafed.test"
methods = ["GET"]
paths = ["/ok"]
[upstream]
nameservers = ["{DNS}"]
dns_timeout = 2.0
ca_file = "{ca_path}"
ssrf_allow = ["1.1.2.0/24"]
[limits]
connect_timeout = 2.0
[events]
path = "{events}"
flush_interval = 0.05
""")
        proxy = start_proxy(config, host="127.0.0.1", port=port, events=events, netns=host)
        try:
            yield World(host, tmp, proxy, log, ca_path, crew_ca_path)
        finally:
            proxy.stop()
    finally:
        for process in processes:
            process.kill()
            process.wait()
        subprocess.run(["ip", "netns", "del", host], check=False)
        subprocess.run(["ip", "netns", "del", internet], check=False)
        shutil.rmtree(readable, ignore_errors=True)


def refused(events: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in events if e.get("event") in ("request_denied", "request_refused")]


def test_captured_http_reaches_an_allowed_host(world: World) -> None:
    out = world.tool(
        UPSTREAM, 80, "GET /x HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n"
    )
    assert out.startswith("HTTP/1.1 200") and out.endswith(f"{UPSTREAM} allowed.test"), out
    assert f"{UPSTREAM}:80 <- GET /x HTTP/1.1" in world.recorded()


def test_captured_http_to_a_host_not_allowed_is_refused_readably(world: World) -> None:
    before = len(world.events())
    out = world.tool(
        UPSTREAM, 80, "GET /y HTTP/1.1\\r\\nHost: other.test\\r\\nConnection: close\\r\\n\\r\\n"
    )
    assert out.startswith("HTTP/1.1 403") and "other.test" in out, out
    assert not [line for line in world.recorded() if "GET /y" in line]
    assert [e["rule"] for e in refused(world.events(before))] == ["not_in_allowlist"]


def test_an_allowed_host_sent_to_another_address_is_refused(world: World) -> None:
    before = len(world.events())
    out = world.tool(
        CANARY, 80, "GET /z HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n"
    )
    assert out.startswith("HTTP/1.1 403") and "destination_mismatch" in out, out
    assert not [line for line in world.recorded() if line.startswith(CANARY)]
    assert [e["rule"] for e in refused(world.events(before))] == ["destination_mismatch"]


def test_a_second_host_on_a_captured_connection_is_refused(world: World) -> None:
    raw = (
        "GET /1 HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n"
        "GET /2 HTTP/1.1\\r\\nHost: other.test\\r\\nConnection: close\\r\\n\\r\\n"
    )
    out = world.tool(UPSTREAM, 80, raw)
    assert "tunnel_host_mismatch" in out, out
    assert not [line for line in world.recorded() if "GET /2" in line]


def test_captured_tls_is_relayed_untouched_to_an_allowed_name(world: World) -> None:
    out = world.tool(
        UPSTREAM,
        443,
        "GET /t HTTP/1.1\\r\\nHost: allowed.test\\r\\nConnection: close\\r\\n\\r\\n",
        "allowed.test",
    )
    # The tool trusts the test CA only and verified allowed.test: its TLS ended at the server.
    assert out.startswith("HTTP/1.1 200") and out.endswith(f"{UPSTREAM} allowed.test"), out
    assert f"{UPSTREAM}:443 <- GET /t HTTP/1.1" in world.recorded()
    opened = [e for e in world.events() if e.get("event") == "tunnel_opened"]
    assert opened and opened[-1]["host"] == "allowed.test" and opened[-1]["port"] == 443


def test_captured_tls_to_a_host_with_a_leaf_is_terminated_and_held_to_its_rules(
    world: World,
) -> None:
    # The tool trusts the crew's CA only: a success proves the proxy terminated its TLS, and the
    # request went on to the upstream over TLS the proxy verified.
    ok = "GET /ok HTTP/1.1\\r\\nHost: leafed.test\\r\\nConnection: close\\r\\n\\r\\n"
    out = world.tool(UPSTREAM, 443, ok, "leafed.test", world.crew_ca)
    assert out.startswith("HTTP/1.1 200") and out.endswith(f"{UPSTREAM} leafed.test"), out
    assert f"{UPSTREAM}:443 <- GET /ok HTTP/1.1" in world.recorded()
    # Inside, the method and path rules hold, and their refusal is HTTP the tool can read.
    before = len(world.events())
    post = (
        "POST /ok HTTP/1.1\\r\\nHost: leafed.test\\r\\ncontent-length: 0\\r\\n"
        "Connection: close\\r\\n\\r\\n"
    )
    out = world.tool(UPSTREAM, 443, post, "leafed.test", world.crew_ca)
    assert out.startswith("HTTP/1.1 403") and "method" in out, out
    assert not [line for line in world.recorded() if "POST /ok" in line]
    assert [e["rule"] for e in refused(world.events(before))] == ["l7_method"]


@pytest.mark.parametrize(
    ("address", "sni", "rule"),
    [
        (UPSTREAM, "other.test", "not_in_allowlist"),
        (UPSTREAM, "-", "captured_unreadable"),
        (CANARY, "allowed.test", "destination_mismatch"),
    ],
)
def test_captured_tls_refusals_are_alerts_and_journaled(
    world: World, address: str, sni: str, rule: str
) -> None:
    before = len(world.events())
    out = world.tool(address, 443, "GET /r HTTP/1.1\\r\\nConnection: close\\r\\n\\r\\n", sni)
    assert out.startswith("TLSERROR"), out
    assert "ACCESS_DENIED" in out.upper() or "access denied" in out.lower(), out
    assert not [line for line in world.recorded() if "GET /r" in line]
    assert [e["rule"] for e in refused(world.events(before))] == [rule]


def test_ports_not_captured_stay_dropped_and_the_explicit_proxy_still_serves(world: World) -> None:
    # Port 8080 is not captured: the tool's connection goes nowhere (the namespace has a route
    # to the "internet" but nothing listens there on 8080).
    out = world.tool(UPSTREAM, 8080, "GET / HTTP/1.1\\r\\n\\r\\n")
    assert out.startswith("ERROR"), out
    done = subprocess.run(
        [
            "ip", "netns", "exec", world.host, "curl", "-s", "--max-time", "10",
            "-x", f"http://127.0.0.1:{world.proxy.port}", "http://allowed.test/explicit",
        ],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.stdout == f"{UPSTREAM} allowed.test", done
