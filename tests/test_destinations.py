"""Destinations: the appliance's own addresses, every DNS answer, the address dialled, lookups.

Two network namespaces made by this test, neither with a route off the machine: "host", where
the proxy runs (its veth towards "internet" plays the host's public interface, with global IPv4
and IPv6 addresses), and "internet" behind a veth, with an HTTP upstream, a canary and a
scripted DNS server (tests/dns_server.py). Crews alpha (127.0.0.1) and beta (127.0.0.2) are
served on the host namespace's loopback, as gateways are on a real host's veths.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, RunningProxy, free_port, start_proxy

pytestmark = pytest.mark.netns

NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)

HOST_V4, HOST_V6 = "1.1.1.10", "2a00:1450::10"  # the "public" addresses of the proxy's host
UPSTREAM, CANARY, DNS = "1.1.2.2", "1.1.2.3", "1.1.2.53"
SLOW = [f"slow{i}.test" for i in range(40)]
PLAN = {
    "fast.test": [[UPSTREAM]],
    "multi.test": [[UPSTREAM, "192.168.7.7"]],
    "multi2.test": [["192.168.7.7", UPSTREAM]],
    "rebind.test": [[UPSTREAM], [CANARY]],
    "self.test": [[HOST_V4]],
    **{name: "silent" for name in SLOW},
}

# Answers every connection with 200 and the address it was made to; logs "ADDRESS <- LINE".
RECORDER = r"""
import socket, sys, threading
log = sys.argv[1]
def serve(address):
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    s = socket.socket(family); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, 80)); s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=answer, args=(c, address), daemon=True).start()
def answer(c, address):
    c.settimeout(5); data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk: break
            data += chunk
        with open(log, "a") as f:
            f.write(address + " <- " + data.split(b"\r\n")[0].decode(errors="replace") + "\n")
        body = address.encode()
        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                  % (len(body), body))
    except OSError:
        pass
    finally:
        c.close()
for address in sys.argv[2:]:
    threading.Thread(target=serve, args=(address,), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass
class World:
    host: str
    internet: str
    tmp: Path
    proxy: RunningProxy
    recorder_log: Path
    dns_log: Path

    def request(self, gateway: str, raw: bytes, timeout: float = 15.0) -> str:
        """Send raw bytes to the proxy from the host namespace; the whole answer."""
        code = textwrap.dedent(f"""
            import socket, sys
            s = socket.create_connection(({gateway!r}, {self.proxy.port}), timeout={timeout})
            s.sendall(sys.stdin.buffer.read())
            out = b""
            while True:
                try:
                    chunk = s.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not chunk:
                    break
                out += chunk
            sys.stdout.write(out.decode("latin-1"))
        """)
        done = subprocess.run(
            ["ip", "netns", "exec", self.host, sys.executable, "-c", code],
            input=raw,
            capture_output=True,
            timeout=timeout + 10,
        )
        return done.stdout.decode("latin-1")

    def get(self, gateway: str, url: str) -> tuple[int, dict[str, object] | str]:
        answer = self.request(
            gateway, b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % url.encode()
        )
        status = int(answer.split(" ", 2)[1]) if answer.startswith("HTTP/1.1 ") else 0
        body = answer.split("\r\n\r\n", 1)[1] if "\r\n\r\n" in answer else ""
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body

    def recorded(self) -> list[str]:
        return self.recorder_log.read_text().splitlines() if self.recorder_log.exists() else []

    def queries(self, name: str) -> list[str]:
        """The queries the resolver received for `name`: "NAME TYPE N" each."""
        lines = self.dns_log.read_text().splitlines() if self.dns_log.exists() else []
        return [line.rsplit(" ", 1)[0] for line in lines if line.split()[0] == name]

    def first_asked(self) -> dict[str, float]:
        """When each name was first asked (the resolver's monotonic clock)."""
        first: dict[str, float] = {}
        lines = self.dns_log.read_text().splitlines() if self.dns_log.exists() else []
        for line in lines:
            name, _, _, at = line.split()
            first.setdefault(name, float(at))
        return first


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    tmp = tmp_path_factory.mktemp("destinations")
    tag = uuid.uuid4().hex[:6]
    host, internet = f"apx-dst-{tag}", f"apx-net-{tag}"
    processes: list[subprocess.Popen[bytes]] = []
    ip("netns", "add", host)
    ip("netns", "add", internet)
    try:
        for ns in (host, internet):
            ip("-n", ns, "link", "set", "lo", "up")
        ip("link", "add", f"d{tag}", "type", "veth", "peer", "name", f"n{tag}")
        ip("link", "set", f"d{tag}", "netns", host)
        ip("link", "set", f"n{tag}", "netns", internet)
        ip("-n", host, "addr", "add", "1.1.2.1/24", "dev", f"d{tag}")
        for address in (UPSTREAM, CANARY, DNS):
            ip("-n", internet, "addr", "add", f"{address}/24", "dev", f"n{tag}")
        ip("-n", host, "link", "set", f"d{tag}", "up")
        ip("-n", internet, "link", "set", f"n{tag}", "up")
        # The host's "public" addresses, on its interface towards the internet.
        ip("-n", host, "addr", "add", f"{HOST_V4}/32", "dev", f"d{tag}")
        ip("-n", host, "-6", "addr", "add", f"{HOST_V6}/128", "dev", f"d{tag}", "nodad")
        for ns in (host, internet):
            routes = subprocess.run(
                ["ip", "-n", ns, "route", "show"], capture_output=True, text=True
            ).stdout
            assert "default" not in routes  # nothing leaves the machine

        def start(ns: str, *argv: str) -> None:
            process = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, *argv],
                stdout=subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            processes.append(process)
            assert process.stdout is not None and process.stdout.readline().strip() == b"ready"

        recorder_log, dns_log = tmp / "recorded.log", tmp / "dns.log"
        plan = tmp / "plan.json"
        plan.write_text(json.dumps(PLAN))
        start(internet, "-c", RECORDER, str(recorder_log), UPSTREAM, CANARY)
        start(host, "-c", RECORDER, str(recorder_log), HOST_V4, HOST_V6)
        start(internet, str(ROOT / "tests" / "dns_server.py"), DNS, "53", str(plan), str(dns_log))

        port = free_port()
        events = tmp / "events.jsonl"
        config = tmp / "proxy.toml"
        config.write_text(f"""
[listen]
port = {port}
[[crew]]
name = "alpha"
gateway = "127.0.0.1"
mode = "free"
[[crew]]
name = "beta"
gateway = "127.0.0.2"
mode = "free"
ssrf_allow = ["{HOST_V4}/32"]
[upstream]
nameservers = ["{DNS}"]
dns_timeout = 2.0
# An operator range covering loopback and a LAN: neither opens the appliance's own addresses.
ssrf_allow = ["127.0.0.0/8", "10.0.0.0/8"]
appliance_ranges = ["10.99.0.0/16"]
[limits]
dns_lookups_per_crew = 4
connect_timeout = 2.0
[events]
path = "{events}"
flush_interval = 0.05
""")
        proxy = start_proxy(config, host="127.0.0.1", port=port, events=events, netns=host)
        try:
            yield World(host, internet, tmp, proxy, recorder_log, dns_log)
        finally:
            proxy.stop()
    finally:
        for process in processes:
            process.kill()
            process.wait()
        subprocess.run(["ip", "netns", "del", host], check=False)
        subprocess.run(["ip", "netns", "del", internet], check=False)


@NEEDS_ROOT
def test_the_hosts_own_addresses_are_refused_whatever_ssrf_allow_says(world: World) -> None:
    port = world.proxy.port
    cases = {
        f"http://{HOST_V4}/": "ssrf_local",  # global, but the proxy host's own
        f"http://[{HOST_V6}]/": "ssrf_local",
        "http://self.test/": "ssrf_local",  # a name that resolves to it
        f"http://127.0.0.1:{port}/": "ssrf_local",  # loopback, although ssrf_allow covers it
        f"http://127.0.0.2:{port}/": "ssrf_local",  # another crew's gateway
    }
    for url, rule in cases.items():
        status, body = world.get("127.0.0.1", url)
        assert status == 403 and isinstance(body, dict), (url, body)
        assert body["rule"] == rule, (url, body)
    # CONNECT to another crew's gateway: refused, never served as that crew.
    answer = world.request("127.0.0.1", b"CONNECT 127.0.0.2:%d HTTP/1.1\r\nHost: x\r\n\r\n" % port)
    assert answer.startswith("HTTP/1.1 403") and '"ssrf_local"' in answer, answer
    assert not [line for line in world.recorded() if line.startswith(HOST_V4)]
    # The crew that names the address reaches it; the other still does not.
    status, body = world.get("127.0.0.2", f"http://{HOST_V4}/")
    assert (status, body) == (200, HOST_V4)
    assert [line for line in world.recorded() if line.startswith(HOST_V4)] == [
        f"{HOST_V4} <- GET / HTTP/1.1"
    ]


@NEEDS_ROOT
def test_the_crews_pool_is_refused_but_the_rest_of_an_allowed_range_is_not(world: World) -> None:
    status, body = world.get("127.0.0.1", "http://10.99.3.4/")
    assert status == 403 and isinstance(body, dict) and body["rule"] == "ssrf_appliance", body
    # Same operator range, outside the pool: dialled (and unreachable here: no route at all).
    status, body = world.get("127.0.0.1", "http://10.5.0.1/")
    assert status == 502 and isinstance(body, dict), body
    assert body["rule"] == "upstream_unreachable", body


@NEEDS_ROOT
def test_every_dns_answer_is_checked(world: World) -> None:
    for name in ("multi.test", "multi2.test"):
        status, body = world.get("127.0.0.1", f"http://{name}/")
        assert status == 403 and isinstance(body, dict), (name, body)
        assert body["rule"] == "ssrf_private", (name, body)
    assert not [line for line in world.recorded() if "multi" in line]


@NEEDS_ROOT
def test_the_address_checked_is_the_address_dialled(world: World) -> None:
    """The name answers the upstream first and the canary afterwards: one lookup, and the
    connection goes to the address that lookup returned (a second resolution would have
    dialled the canary)."""
    status, body = world.get("127.0.0.1", "http://rebind.test/hello")
    assert (status, body) == (200, UPSTREAM)
    assert sorted(world.queries("rebind.test")) == ["rebind.test A 1", "rebind.test AAAA 1"]
    assert f"{UPSTREAM} <- GET /hello HTTP/1.1" in world.recorded()
    assert not [line for line in world.recorded() if line.startswith(CANARY)]


@NEEDS_ROOT
def test_one_crews_hanging_lookups_never_stall_another_crew(world: World) -> None:
    """Alpha floods lookups of names the resolver never answers; beta's lookups run in its own
    share and answer at once. Alpha's are refused when their timeout (2 s) runs out, and only
    its share (4) ever reached the resolver at a time."""
    flood = textwrap.dedent(f"""
        import socket, sys, threading
        answers = []
        def one(name):
            try:
                s = socket.create_connection(("127.0.0.1", {world.proxy.port}), timeout=20)
                s.sendall(b"GET http://%s/ HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n"
                          % name.encode())
                answers.append(s.recv(200).split(b"\\r\\n")[0].decode())
            except OSError as exc:
                answers.append("error " + str(exc))
        threads = [threading.Thread(target=one, args=(n,)) for n in {SLOW!r}]
        for t in threads: t.start()
        for t in threads: t.join()
        print("\\n".join(answers))
    """)
    attacker = subprocess.Popen(
        ["ip", "netns", "exec", world.host, sys.executable, "-c", flood],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while not any(world.queries(name) for name in SLOW):
            assert time.monotonic() < deadline, "the flood never reached the resolver"
            time.sleep(0.02)
        for _ in range(5):
            started = time.monotonic()
            status, body = world.get("127.0.0.2", "http://fast.test/")
            assert (status, body) == (200, UPSTREAM)
            assert time.monotonic() - started < 1.5
        out, _ = attacker.communicate(timeout=60)
    finally:
        attacker.kill()
    lines = out.splitlines()
    assert len(lines) == len(SLOW) and all(line.startswith("HTTP/1.1 403") for line in lines), out
    first = {name: at for name, at in world.first_asked().items() if name in SLOW}
    start = min(first.values())
    # The flood's connections arrive within a few milliseconds; each lookup that got one of
    # the share's 4 slots holds it until the resolver's silence times it out (2 s), so in the
    # first second no more than the share's worth of names reaches the resolver.
    early = sorted(name for name, at in first.items() if at < start + 1.0)
    assert 1 <= len(early) <= 4, early
