"""The chaos suite's network: three namespaces of the test's own and the peers inside one.

    crew A   100.127.T.2/30  --veth-->  host 100.127.T.1 (crew A's gateway)
    crew B   100.127.T.6/30  --veth-->  host 100.127.T.5 (crew B's gateway)
    peers    198.19.T.2/30   --veth-->  host 198.19.T.1  (tests/chaos_peers.py listens on .2)

T is picked at random among values the host does not route yet. Nothing is forwarded: a crew
talks to its gateway, the workers (in the host namespace) talk to the peers, all on connected
/30s. The addresses come from the shared address space (RFC 6598) and the benchmarking range
(RFC 2544, 198.18.0.0/15), neither routed off a machine.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

HERE = Path(__file__).resolve().parent


def sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


def _routed(prefix: str) -> bool:
    out = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True
    ).stdout
    return prefix in out


@dataclass
class ChaosWorld:
    tag: str
    third: int
    log_path: Path
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    peer_process: subprocess.Popen[bytes] | None = None

    @property
    def gateway_a(self) -> str:
        return f"100.127.{self.third}.1"

    @property
    def gateway_b(self) -> str:
        return f"100.127.{self.third}.5"

    @property
    def peer(self) -> str:
        return f"198.19.{self.third}.2"

    @property
    def ns_a(self) -> str:
        return f"chaos-{self.tag}-a"

    @property
    def ns_b(self) -> str:
        return f"chaos-{self.tag}-b"

    @property
    def ns_peer(self) -> str:
        return f"chaos-{self.tag}-p"

    def _wire(self, ns: str, link: str, host: str, inside: str) -> None:
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.links.append(link)
        sh("ip", "addr", "add", f"{host}/30", "dev", link)
        sh("ip", "link", "set", link, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "addr", "add", f"{inside}/30", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", host)

    def create(self) -> None:
        t = self.third
        self._wire(self.ns_a, f"chx{self.tag}a", f"100.127.{t}.1", f"100.127.{t}.2")
        self._wire(self.ns_b, f"chx{self.tag}b", f"100.127.{t}.5", f"100.127.{t}.6")
        self._wire(self.ns_peer, f"chx{self.tag}p", f"198.19.{t}.1", self.peer)
        self.peer_process = subprocess.Popen(
            [
                "ip", "netns", "exec", self.ns_peer,
                sys.executable, str(HERE / "chaos_peers.py"), self.peer, str(self.log_path),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )  # fmt: skip
        assert self.peer_process.stdout is not None
        line = self.peer_process.stdout.readline()
        if line.strip() != b"ready":
            raise RuntimeError(f"the chaos peers did not start: {line!r}")

    def delete(self) -> None:
        process = self.peer_process
        if process is not None:
            assert process.stdin is not None
            process.stdin.close()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def peer_log(self) -> list[str]:
        return self.log_path.read_text().splitlines() if self.log_path.exists() else []


@contextlib.contextmanager
def chaos_world(tmp: Path) -> Iterator[ChaosWorld]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, a worker pool dropping to UID 1002)")
    for _ in range(50):
        third = random.randrange(256)
        if not _routed(f"100.127.{third}.") and not _routed(f"198.19.{third}."):
            break
    else:
        pytest.skip("no free test range in 100.127.0.0/16 and 198.19.0.0/16")
    world = ChaosWorld(uuid.uuid4().hex[:4], third, tmp / "peers.log")
    try:
        world.create()
        yield world
    finally:
        world.delete()


def crew_sockets(ns: str, count: int = 1) -> list[socket.socket]:
    """TCP sockets created inside namespace `ns` (a socket stays in the namespace it was made
    in, whichever thread then uses it)."""
    from netns.kernel import run_in_namespace

    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        return run_in_namespace(
            fd, lambda: [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
        )
    finally:
        os.close(fd)


def reset_close(sock: socket.socket | trio.socket.SocketType) -> None:
    """Abort with RST (SO_LINGER 0), as `curl --max-time` does when it gives up."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
