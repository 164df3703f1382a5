"""Fuzz the whole request path: arbitrary agent bytes into a real ClientConnection.

Invariants, for any input delivered as one chunk, byte by byte, or in random splits:
- the connection task never raises: every error becomes a refusal or a close;
- whatever the proxy writes back is a sequence of well-formed HTTP/1.1 responses (h11 reads it
  as a client would) — a refusal is never garbage;
- no event and no response carries the appliance's credential.

The proxy is the real one, configured in-process. The only upstream is a tiny server on
127.0.0.1 inside this process (the name `upstream.fuzz` resolves to it through the split-horizon
table); every other name is refused before any connection, so the fuzzer never sends a packet
anywhere else.

Run: python fuzz/fuzz_request_path.py -runs=2000 (atheris); the regression test replays seeds.
"""

from __future__ import annotations

import os
import random
import socket
import sys

import h11
import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from proxycore.config import parse_config
from proxycore.errors import PolicyDenied
from proxycore.io.connection import ClientConnection
from proxycore.io.fastio import PlainStream
from proxycore.io.sinks import MemorySink
from proxycore.protocol.http2 import PREFACE
from proxycore.runtime import ProxyRuntime

SECRET = "sk-ant-api03-FUZZ-SECRET-never-echo-0000000000"
os.environ.setdefault("FUZZ_ANTHROPIC_KEY", SECRET)

_UPSTREAM_RESPONSES = [
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n\r\nuntil close",
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello!",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
    b"garbage\r\n\r\n",
    b"",
]


def _config_text(upstream_port: int) -> str:
    return """
[[crew]]
name = "fuzz"
gateway = "127.0.0.1"
mode = "restricted"
allow = ["upstream.fuzz"]
# The upstream is on this host's loopback: only a range the crew names reaches it.
ssrf_allow = ["127.0.0.1/32"]

[providers.anthropic]
base_url = "https://provider.fuzz"
credential_env = "FUZZ_ANTHROPIC_KEY"

[upstream]
ssrf_allow = ["127.0.0.1/32"]
resolve = { "upstream.fuzz" = "127.0.0.1" }

[limits]
head_timeout = 0.5
read_timeout = 0.5
idle_keepalive_timeout = 0.5
connect_timeout = 0.5
tunnel_idle_timeout = 0.5
"""


def _split(data: bytes, how: int, rng: random.Random) -> list[bytes]:
    if how == 0 or not data:
        return [data]
    if how == 1:
        return [data[i : i + 1] for i in range(len(data))]
    pieces, i = [], 0
    while i < len(data):
        n = rng.randint(1, 16)
        pieces.append(data[i : i + n])
        i += n
    return pieces


async def _run_one(data: bytes, how: int, seed: int) -> tuple[bytes, MemorySink]:
    rng = random.Random(seed)
    sink = MemorySink()
    upstream_reply = _UPSTREAM_RESPONSES[seed % len(_UPSTREAM_RESPONSES)]

    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    upstream_port = listener.getsockname()[1]

    async def upstream_server() -> None:
        while True:
            conn, _ = await listener.accept()
            with conn:
                with trio.move_on_after(0.3):
                    await conn.recv(65536)
                if upstream_reply:
                    await conn.send(upstream_reply)

    runtime = ProxyRuntime(parse_config(_config_text(upstream_port)), sink)
    real_resolve = runtime.dialer.resolve

    async def resolve(host: str, port: int, *args: object) -> list[str]:
        # Only the in-process upstream is reachable; everything else is refused up front.
        if host != "upstream.fuzz" or port != upstream_port:
            raise PolicyDenied("fuzz: not reachable", host=host, rule="fuzz_unreachable")
        return await real_resolve(host, port, *args)  # type: ignore[arg-type]

    runtime.dialer.resolve = resolve  # type: ignore[method-assign]

    agent, proxy_side = socket.socketpair()
    stream = PlainStream(proxy_side)
    agent.setblocking(False)
    received = bytearray()

    async def feed() -> None:
        for piece in _split(data.replace(b"UPSTREAMPORT", b"%d" % upstream_port), how, rng):
            try:
                agent.send(piece)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                return
            await trio.sleep(0)
        agent.shutdown(socket.SHUT_WR)

    drained = trio.Event()

    async def drain() -> None:
        try:
            while True:
                await trio.lowlevel.wait_readable(agent)
                try:
                    chunk = agent.recv(65536)
                except OSError:
                    return
                if not chunk:
                    return
                received.extend(chunk)
        finally:
            drained.set()

    with trio.move_on_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(upstream_server)
            nursery.start_soon(runtime.reap_expired)
            nursery.start_soon(drain)
            nursery.start_soon(feed)
            connection = ClientConnection(runtime, stream, runtime.crews["127.0.0.1"])
            await connection.run()  # must not raise
            with trio.move_on_after(1):
                await drained.wait()  # the proxy closed its end: the agent reads to EOF
            nursery.cancel_scope.cancel()
    agent.close()
    listener.close()
    return bytes(received), sink


def _check_responses(data: bytes) -> None:
    """Every byte the proxy wrote must read as complete, well-formed responses."""
    client = h11.Connection(h11.CLIENT)
    # Pretend an endless series of GETs was sent so h11 accepts any number of responses.
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    client.receive_data(b"")
    while True:
        try:
            event = client.next_event()
        except h11.RemoteProtocolError as exc:
            raise AssertionError(
                f"the proxy wrote a malformed response: {exc}: {data[:300]!r}"
            ) from exc
        if event in (h11.NEED_DATA, h11.PAUSED) or isinstance(event, h11.ConnectionClosed):
            if event is h11.PAUSED and client.our_state is h11.DONE:
                try:
                    client.start_next_cycle()
                except h11.LocalProtocolError:
                    return
                client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                client.send(h11.EndOfMessage())
                continue
            return


def TestOneInput(data: bytes) -> None:
    if len(data) < 2:
        return
    how, seed = data[0] % 3, data[1]
    received, sink = trio.run(_run_one, data[2:], how, seed)
    assert SECRET.encode() not in received
    for event in sink.events:
        assert SECRET not in repr(event)
    if received and not data[2:].startswith(PREFACE):
        # (A connection that opens with the HTTP/2 preface is answered in HTTP/2 frames:
        # fuzz/fuzz_h2.py holds that path to its own invariants.)
        _check_responses(received)


SEEDS = [
    b"\x00\x00GET http://upstream.fuzz:UPSTREAMPORT/ HTTP/1.1\r\nHost: u\r\n\r\n",
    b"\x01\x01GET http://upstream.fuzz:UPSTREAMPORT/ HTTP/1.1\r\nHost: u\r\n\r\n",
    b"\x02\x03POST http://upstream.fuzz:UPSTREAMPORT/ HTTP/1.1\r\nHost: u\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"\x00\x04GET http://upstream.fuzz:UPSTREAMPORT/ HTTP/1.1\r\nHost: u\r\n\r\n"
    b"GET http://upstream.fuzz:UPSTREAMPORT/ HTTP/1.1\r\nHost: u\r\n\r\n",
    b"\x00\x05GET http://other.fuzz/ HTTP/1.1\r\nHost: u\r\n\r\n",
    b"\x00\x06CONNECT upstream.fuzz:UPSTREAMPORT HTTP/1.1\r\nHost: u\r\n\r\nhello",
    b"\x00\x07POST /anthropic/v1/messages HTTP/1.1\r\nHost: u\r\nContent-Length: 2\r\n\r\n{}",
    b"\x00\x02GET /_appliance/health HTTP/1.1\r\nHost: u\r\n\r\n",
    b"\x00\x06GET http://upstream.fuzz:UPSTREAMPORT/ HTTP/1.0\r\n\r\n",
    b"\x00\x00GET / HTTP/1.1\r\nHost: u\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"\x01\x00\r\n\r\n",
]


if __name__ == "__main__":
    from seeded import fuzz

    fuzz("request-path", SEEDS, TestOneInput)
