"""Crew A's attacks, one function per class of fault (driven by tests/test_chaos.py).

Each attack opens its connections from inside crew A's namespace, runs its jobs concurrently
under one deadline, counts every request head it wrote whole (`Attack.requests`: each must end
in exactly one terminal event) and records what the attacker saw that it must not see
(`Attack.problems`: a silent close where a refusal was due, a hang, a wrong status). No
attack raises on what the proxy does; everything it observes becomes a problem line, so one
test reports every broken case at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import trio

from tests import chaos_peers as peers
from tests.chaos_http import Reader, Response, describe
from tests.chaos_support import LIMITS, PEER_NAME, Chaos
from tests.chaos_world import reset_close

OK_URL = f"http://{PEER_NAME}:{peers.OK}"
MARGIN = 3.0  # seconds allowed past a configured timeout before "it never ended" is a problem


class Attack:
    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos
        self.requests = 0
        self.problems: list[str] = []

    def problem(self, label: str, what: str) -> None:
        self.problems.append(f"{label}: {what}")

    async def connect(self) -> tuple[trio.SocketStream, Reader]:
        stream = await self.chaos.connect_a()
        return stream, Reader(stream)

    async def send_request(self, stream: trio.SocketStream, data: bytes) -> bool:
        """Write a request whole; counted only then (a head cut short never reached)."""
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        self.requests += 1
        return True

    async def run(
        self,
        jobs: Iterable[tuple[str, Callable[[], Awaitable[None]]]],
        *,
        concurrency: int = 64,
        timeout: float = 40.0,
    ) -> None:
        limiter = trio.CapacityLimiter(concurrency)

        async def guarded(label: str, job: Callable[[], Awaitable[None]]) -> None:
            async with limiter:
                try:
                    await job()
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self.problem(label, f"the attacker's socket failed: {exc!r}")

        with trio.move_on_after(timeout) as scope:
            async with trio.open_nursery() as nursery:
                for label, job in jobs:
                    nursery.start_soon(guarded, label, job)
        if scope.cancelled_caught:
            self.problems.append(f"the attack did not end within {timeout} s (a hang)")

    def expect_refusal(self, label: str, response: Response | None, statuses: set[int]) -> None:
        if response is None or response.status not in statuses or not response.refusal:
            self.problem(label, f"expected a readable {sorted(statuses)}, got {describe(response)}")


def expect_cut(attack: Attack, label: str, response: Response | None, reader: Reader) -> None:
    """An upstream failed after its head: either the proxy had relayed the head (then the body
    stops short and the connection ends) or it had not yet (then a readable 502)."""
    if response is not None and response.status == 502 and response.refusal:
        return
    if response is None or response.status != 200:
        attack.problem(label, f"expected the relayed 200 head or a 502, got {describe(response)}")
    elif response.complete:
        attack.problem(label, "a response the upstream cut short arrived as complete")
    elif not reader.eof:
        attack.problem(label, "the proxy kept the connection after a truncated response")


def get(url: str, *, extra: str = "", close: bool = False) -> bytes:
    authority = url.split("://", 1)[1].split("/", 1)[0]
    connection = "Connection: close\r\n" if close else ""
    return f"GET {url} HTTP/1.1\r\nHost: {authority}\r\n{extra}{connection}\r\n".encode()


def connect(authority: str) -> bytes:
    return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


# --- RST and EPIPE ------------------------------------------------------------------------------


async def tunnel_resets(attack: Attack, rounds: int = 8) -> None:
    """CONNECT tunnels aborted by the client with RST (data flowing, idle, just opened) and by
    the upstream; every tunnel's client side must see the tunnel end."""

    async def open_tunnel(label: str, port: int) -> tuple[trio.SocketStream, Reader] | None:
        stream, reader = await attack.connect()
        if not await attack.send_request(stream, connect(f"{PEER_NAME}:{port}")):
            attack.problem(label, "CONNECT could not be sent")
            return None
        response = await reader.response(5)
        if response is None or response.status != 200:
            attack.problem(label, f"CONNECT: {describe(response)}")
            reset_close(stream.socket)
            return None
        return stream, reader

    async def echo_then_rst(label: str) -> None:
        opened = await open_tunnel(label, peers.ECHO)
        if opened:
            stream, reader = opened
            await stream.send_all(b"e" * 4096)
            with trio.move_on_after(5):
                while len(reader.buffer) < 4096 and await reader.fill():
                    pass
            reset_close(stream.socket)

    async def firehose_then_rst(label: str, rst: bool) -> None:
        opened = await open_tunnel(label, peers.FIREHOSE)
        if opened:
            stream, reader = opened
            await stream.send_all(b"go")
            with trio.move_on_after(5):
                while len(reader.buffer) < 256 * 1024 and await reader.fill():
                    pass
            if rst:
                reset_close(stream.socket)
            else:
                # A plain close with unread data: the kernel answers the proxy's next bytes
                # with RST, and its write after that fails with EPIPE.
                stream.socket.close()

    async def established_then_rst(label: str) -> None:
        opened = await open_tunnel(label, peers.ECHO)
        if opened:
            reset_close(opened[0].socket)

    async def upstream_resets(label: str) -> None:
        opened = await open_tunnel(label, peers.TUNNEL_RESET)
        if opened:
            stream, reader = opened
            await stream.send_all(b"r" * 100)
            if not await reader.closed(MARGIN + 2):
                attack.problem(
                    label, "the upstream reset the tunnel; the client's side stayed open"
                )
            stream.socket.close()

    jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    for i in range(rounds):
        jobs += [
            (f"echo+rst {i}", lambda i=i: echo_then_rst(f"echo+rst {i}")),
            (f"firehose+rst {i}", lambda i=i: firehose_then_rst(f"firehose+rst {i}", True)),
            (f"firehose+close {i}", lambda i=i: firehose_then_rst(f"firehose+close {i}", False)),
            (f"established+rst {i}", lambda i=i: established_then_rst(f"established+rst {i}")),
            (f"upstream rst {i}", lambda i=i: upstream_resets(f"upstream rst {i}")),
        ]
    await attack.run(jobs)


async def response_resets(attack: Attack, rounds: int = 6) -> None:
    """Forward-proxy responses cut by the client (RST, or a close that makes the proxy's next
    write EPIPE) and by the upstream (RST before, inside and after the head)."""

    async def client_cuts(label: str, path: str, rst: bool) -> None:
        stream, reader = await attack.connect()
        if not await attack.send_request(stream, get(f"{OK_URL}{path}")):
            return
        with trio.move_on_after(5):
            while len(reader.buffer) < 128 * 1024 and await reader.fill():
                pass
        if len(reader.buffer) < 128 * 1024:
            attack.problem(label, f"only {len(reader.buffer)} bytes of the response arrived")
        if rst:
            reset_close(stream.socket)
        else:
            stream.socket.close()

    async def upstream_cuts(label: str, path: str, refusal: bool) -> None:
        stream, reader = await attack.connect()
        url = f"http://{PEER_NAME}:{peers.RESET}{path}"
        if not await attack.send_request(stream, get(url)):
            return
        response = await reader.response(LIMITS["read_timeout"] + MARGIN)
        if refusal:
            # Nothing was relayed yet: the proxy can still say what happened.
            attack.expect_refusal(label, response, {502})
        else:
            expect_cut(attack, label, response, reader)
        await stream.aclose()

    big = f"/bytes/{64 << 20}"
    chunked = f"/chunked/{64 << 20}"
    jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    for i in range(rounds):
        for name, path, rst in (
            ("bytes+rst", big, True),
            ("bytes+close", big, False),
            ("chunked+rst", chunked, True),
            ("slow+close", f"/slow/{16384 * 100}", False),
        ):
            label = f"{name} {i}"
            jobs.append((label, lambda label=label, p=path, r=rst: client_cuts(label, p, r)))
        for name, refusal in (
            ("before", True),
            ("short-body", True),
            ("after-head", False),
            ("mid-chunked", False),
        ):
            label = f"upstream {name} {i}"
            jobs.append(
                (label, lambda label=label, n=name, r=refusal: upstream_cuts(label, f"/{n}", r))
            )
    await attack.run(jobs)


# --- half-open peers ----------------------------------------------------------------------------


async def half_open(attack: Attack, rounds: int = 6) -> None:
    limits = LIMITS

    async def request_then_silent(label: str) -> None:
        # Asks for far more than the socket buffers hold, half-closes and never reads: the
        # proxy's writes stall, and it must give up on its own.
        stream, reader = await attack.connect()
        if not await attack.send_request(stream, get(f"{OK_URL}/bytes/{256 << 20}")):
            return
        await stream.send_eof()
        await trio.sleep(limits["read_timeout"] + MARGIN)
        # The socket buffers hold a few MiB at most: more means the proxy is still writing.
        if not await reader.closed(MARGIN + 5, max_bytes=64 << 20):
            attack.problem(label, "a client that stopped reading held its connection open")
        stream.socket.close()

    async def request_then_half_close(label: str) -> None:
        stream, reader = await attack.connect()
        if not await attack.send_request(stream, get(f"{OK_URL}/ok")):
            return
        await stream.send_eof()
        response = await reader.response(5)
        if response is None or response.status != 200:
            attack.problem(label, f"half-closed after a request: {describe(response)}")
        elif not await reader.closed(MARGIN):
            attack.problem(label, "the proxy did not close after answering a half-closed client")
        await stream.aclose()

    async def tunnel_half_close(label: str, port: int, timeout: float) -> None:
        stream, reader = await attack.connect()
        if not await attack.send_request(stream, connect(f"{PEER_NAME}:{port}")):
            return
        response = await reader.response(5)
        if response is None or response.status != 200:
            attack.problem(label, f"CONNECT: {describe(response)}")
            await stream.aclose()
            return
        await stream.send_all(b"h" * 1000)
        await stream.send_eof()
        if not await reader.closed(timeout):
            attack.problem(label, f"the half-closed tunnel was still open after {timeout} s")
        await stream.aclose()

    async def tunnel_to_silent(label: str) -> None:
        stream, reader = await attack.connect()
        if not await attack.send_request(stream, connect(f"{PEER_NAME}:{peers.SILENT}")):
            return
        response = await reader.response(5)
        if response is None or response.status != 200:
            attack.problem(label, f"CONNECT: {describe(response)}")
        else:
            await stream.send_all(b"anyone there?")
            if not await reader.closed(limits["tunnel_idle_timeout"] + MARGIN):
                attack.problem(label, "an idle tunnel outlived tunnel_idle_timeout")
        await stream.aclose()

    async def forward_to_silent(label: str) -> None:
        stream, reader = await attack.connect()
        url = f"http://{PEER_NAME}:{peers.SILENT}/"
        if await attack.send_request(stream, get(url)):
            response = await reader.response(limits["read_timeout"] + MARGIN)
            attack.expect_refusal(label, response, {504})
        await stream.aclose()

    async def idle_client(label: str) -> None:
        stream, reader = await attack.connect()
        if not await reader.closed(limits["idle_keepalive_timeout"] + MARGIN):
            attack.problem(label, "a connection that never sent a byte was never closed")
        await stream.aclose()

    jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    tunnel_timeout = limits["tunnel_idle_timeout"] + MARGIN
    for i in range(rounds):
        jobs += [
            (f"silent reader {i}", lambda i=i: request_then_silent(f"silent reader {i}")),
            (f"half-close {i}", lambda i=i: request_then_half_close(f"half-close {i}")),
            (
                f"tunnel echo half-close {i}",
                lambda i=i: tunnel_half_close(f"tunnel echo half-close {i}", peers.ECHO, MARGIN),
            ),
            (
                f"tunnel silent half-close {i}",
                lambda i=i: tunnel_half_close(
                    f"tunnel silent half-close {i}", peers.SILENT, tunnel_timeout
                ),
            ),
            (f"tunnel to silent {i}", lambda i=i: tunnel_to_silent(f"tunnel to silent {i}")),
            (f"forward to silent {i}", lambda i=i: forward_to_silent(f"forward to silent {i}")),
            (f"idle client {i}", lambda i=i: idle_client(f"idle client {i}")),
        ]
    await attack.run(jobs)


# --- slowloris ----------------------------------------------------------------------------------


async def dribble(stream: trio.SocketStream, data: bytes, gap: float, until: float) -> int:
    """Send `data` a byte at a time, `gap` seconds apart, until it is all sent or `until`
    (trio time); returns the bytes sent. Stops quietly if the proxy closed."""
    sent = 0
    for byte in data:
        if trio.current_time() >= until:
            break
        try:
            await stream.send_all(bytes([byte]))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            break
        sent += 1
        await trio.sleep(gap)
    return sent


async def slowloris_heads(attack: Attack, dribblers: int = 30, flood: int = 120) -> None:
    """Heads dribbled a byte every 0.3 s (each gap far under head_timeout, the whole head far
    over it), and a flood of connections that send one byte of a head and go silent, more than
    crew A's connection limit admits."""
    head = get(f"{OK_URL}/ok", extra="X-Slow: " + "s" * 60 + "\r\n")
    head_timeout = LIMITS["head_timeout"]

    # The dribblers connect first, so that the flood (not they) meets the connection limit.
    dribbling = [await attack.connect() for _ in range(dribblers)]

    async def dribbler(label: str, stream: trio.SocketStream, reader: Reader) -> None:
        attack.requests += 1  # its first byte makes it a request that reached the proxy
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dribble, stream, head, 0.3, trio.current_time() + 30)
            response = await reader.response(head_timeout + MARGIN)
            nursery.cancel_scope.cancel()
        attack.expect_refusal(label, response, {408})
        await stream.aclose()

    async def one_byte(label: str) -> None:
        stream, reader = await attack.connect()
        if not await attack.send_request(stream, b"G"):
            attack.problem(label, "closed before its first byte")
            return
        response = await reader.response(head_timeout + MARGIN)
        # 408 when its head timed out, 503 when crew A's connection limit refused it at once.
        attack.expect_refusal(label, response, {408, 503})
        await stream.aclose()

    jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        (f"dribbled head {i}", lambda i=i, c=c: dribbler(f"dribbled head {i}", *c))
        for i, c in enumerate(dribbling)
    ]
    jobs += [(f"one byte {i}", lambda i=i: one_byte(f"one byte {i}")) for i in range(flood)]
    await attack.run(jobs, concurrency=dribblers + flood)


async def slowloris_bodies(attack: Attack, rounds: int = 10) -> None:
    """Bodies dribbled under read_timeout (a byte every 0.3 s) for 3 s, then silence: 408.
    And bodies dribbled the same way then abandoned with RST: the request still ends."""
    read_timeout = LIMITS["read_timeout"]

    async def slow_body(label: str, chunked: bool, rst: bool) -> None:
        stream, reader = await attack.connect()
        framing = "Transfer-Encoding: chunked" if chunked else "Content-Length: 1000"
        head = f"POST {OK_URL}/ok HTTP/1.1\r\nHost: {PEER_NAME}\r\n{framing}\r\n\r\n".encode()
        if not await attack.send_request(stream, head):
            return
        body = (b"3e8\r\n" + b"b" * 1000) if chunked else b"b" * 1000
        sent = await dribble(stream, body, 0.3, trio.current_time() + 3)
        if sent < 5:
            attack.problem(label, f"the proxy stopped reading a body after {sent} bytes")
        if rst:
            reset_close(stream.socket)
            return
        response = await reader.response(read_timeout + MARGIN)
        attack.expect_refusal(label, response, {408})
        await stream.aclose()

    jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    for i in range(rounds):
        for name, chunked, rst in (
            ("length", False, False),
            ("chunked", True, False),
            ("length+rst", False, True),
        ):
            label = f"slow body {name} {i}"
            jobs.append((label, lambda label=label, c=chunked, r=rst: slow_body(label, c, r)))
    await attack.run(jobs)


# --- resources ----------------------------------------------------------------------------------


async def many_upstreams(attack: Attack, count: int, connections: int = 16) -> None:
    """`count` requests, each to a distinct peer port, over `connections` kept-alive client
    connections: every answer a 200 or a readable 503, none a close."""
    ports = iter(range(peers.MANY_BASE, peers.MANY_BASE + count))

    async def worker(label: str) -> None:
        stream: trio.SocketStream | None = None
        reader: Reader | None = None
        for port in ports:
            if stream is None:
                stream, reader = await attack.connect()
            assert reader is not None
            if not await attack.send_request(stream, get(f"http://{PEER_NAME}:{port}/ok")):
                attack.problem(label, f"port {port}: the proxy closed before the request")
                stream = None
                continue
            response = await reader.response(10)
            if response is None or not (
                response.status == 200 or (response.status == 503 and response.refusal)
            ):
                attack.problem(label, f"port {port}: {describe(response)}")
            if response is None or reader.eof or response.status != 200:
                await stream.aclose()
                stream = None
        if stream is not None:
            await stream.aclose()

    await attack.run(
        [(f"connection {i}", lambda i=i: worker(f"connection {i}")) for i in range(connections)]
    )


async def dns_flood(attack: Attack, seconds: float, tasks: int = 24) -> None:
    """Crew A asks for names its resolver never answers, `tasks` at a time for `seconds`
    (a refused lookup is retried after 0.1 s, so the pressure lasts however the proxy
    refuses: at once, or after its resolver's timeout)."""
    names = iter(range(1_000_000))
    stop_at = trio.current_time() + seconds

    async def worker(label: str) -> None:
        while trio.current_time() < stop_at:
            n = next(names)
            stream, reader = await attack.connect()
            url = f"http://a{n}.a.chaos.test:{peers.OK}/ok"
            if await attack.send_request(stream, get(url)):
                response = await reader.response(30)
                if response is None or not response.refusal or response.status < 400:
                    attack.problem(label, f"a{n}: {describe(response)}")
            await stream.aclose()
            await trio.sleep(0.1)

    await attack.run([(f"lookups {i}", lambda i=i: worker(f"lookups {i}")) for i in range(tasks)])


async def chunked_uploads(attack: Attack, count: int, size: int) -> None:
    """`count` chunked uploads of `size` bytes each, all in flight at once: every body is sent
    but for its last chunk, which waits until every upload has sent the rest (or, should the
    proxy queue some uploads behind others, for most of read_timeout: then the first ones end
    and make room, before the proxy times their silent bodies out)."""
    all_sent = trio.Event()
    sent = 0
    piece = b"u" * (256 * 1024)
    chunk = b"%x\r\n%s\r\n" % (len(piece), piece)

    async def upload(label: str) -> None:
        nonlocal sent
        stream, reader = await attack.connect()
        head = (
            f"POST {OK_URL}/ok HTTP/1.1\r\nHost: {PEER_NAME}\r\nTransfer-Encoding: chunked\r\n\r\n"
        ).encode()
        if not await attack.send_request(stream, head):
            return
        try:
            for _ in range(size // len(piece)):
                await stream.send_all(chunk)
        finally:
            sent += 1
            if sent == count:
                all_sent.set()
        with trio.move_on_after(LIMITS["read_timeout"] * 0.75):
            await all_sent.wait()
        await stream.send_all(b"0\r\n\r\n")
        response = await reader.response(20)
        if response is None or response.status != 200:
            attack.problem(label, f"upload: {describe(response)}")
        await stream.aclose()

    await attack.run([(f"upload {i}", lambda i=i: upload(f"upload {i}")) for i in range(count)])
