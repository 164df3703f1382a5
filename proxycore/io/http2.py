"""HTTP/2 over cleartext (h2c) on the agent side: one connection, many streams, one exchange each.

Theory of operation
-------------------
`proxycore/io/connection.py` hands a connection over here when it opens with the HTTP/2 client
preface (prior knowledge, RFC 9113 3.3), and a terminated CONNECT tunnel whose agent selected
ALPN h2 (proxycore/io/terminate.py): then the session reads and writes the tunnel's TLS, and
every stream is planned against the tunnel's (host, port) as an HTTP/1.1 request in it is.
`H2Session` then owns the socket: one task reads it and feeds the sans-IO `H2Server`
(proxycore/protocol/http2), which enforces the connection's limits (an attack ends the
connection with GOAWAY and a `request_refused` event, route "connection", naming the rule);
every write goes through one lock, so its queued frames go out in order and never piles up: a
stream queues one frame and writes it before the next. The frames that end a response (its last
DATA, or a head with END_STREAM) are only queued and the writer task is woken: it writes
everything the streams queued in the same scheduling round with one send (one syscall for many
streams), unless more than `BATCH_BYTES` are queued, when the stream writes them itself and so
waits for the client (backpressure, as before).

Each stream is served by its own `ClientConnection` (the same class as an HTTP/1.1 connection)
over a `StreamPipe` (proxycore/io/h2_stream.py): its input is the stream's request written as an
HTTP/1.1 head (proxycore/protocol/http2/messages.py), which the exchange takes whole and reads
with the strict parser as it reads a socket's, and the body; its output is a whole response as
the exchange decided it (status and scrubbed fields), or the HTTP/1.1 the exchange writes, which
the pipe reads back (the strict parser again), as HEADERS and DATA frames. So every stream goes
through `plan_request` and the forward path unchanged: policy, SSRF
checks, credential injection, header scrubbing, the response scrubber, refusals, fairness,
deadlines, fault containment, and exactly one terminal event with byte counts (an HTTP/2
upstream, too, is reached through the forward path: proxycore/io/upstream_h2.py).

Survival: a stream's failure ends that stream (RST_STREAM after whatever was sent), never its
siblings; only a broken connection (the socket, a GOAWAY) ends them all, each with its own
terminal event naming why. Memory: a stream's request body is acknowledged to the client only
as its exchange reads it, so a stream holds at most the stream window and a connection at most
the connection window (limits.py); each open stream counts as one of the crew's connections
(`max_connections_per_crew`), so a crew's streams are bounded as its HTTP/1.1 requests are; a
response waits for the client's flow-control window at most `stall_timeout`.
"""

from __future__ import annotations

import math
import socket
import time
from typing import TYPE_CHECKING

import trio

from proxycore.errors import Http2ConnectionError
from proxycore.io.h2_stream import StreamPipe
from proxycore.io.h2_writer import OrderedWriter
from proxycore.io.progress import RECV_SIZE
from proxycore.io.terminate import TerminatedStream
from proxycore.io.websocket_h2 import WebSocketPipe, stream_head
from proxycore.protocol import http1
from proxycore.protocol.events import RequestRefused
from proxycore.protocol.http2 import (
    DataReceived,
    ErrorCode,
    H2Event,
    H2Limits,
    H2Server,
    MessageRefused,
    RequestReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowOpened,
    request_head,
)
from proxycore.protocol.http2.websocket import is_extended_connect
from proxycore.protocol.plans import Request

if TYPE_CHECKING:
    from proxycore.config import LimitsConfig
    from proxycore.io.connection import ClientConnection

__all__ = [
    "H2Session",
    "PrefaceReceived",
    "StreamPipe",
    "h2_limits",
    "h2c_settings",
    "serve_http2",
    "serve_http2_upgrade",
]


# Above this many queued bytes a stream writes them itself instead of leaving them to the writer.
BATCH_BYTES = 65536
_STREAM_TASK = "proxycore.io.http2.H2Session._serve_stream"


class PrefaceReceived(Exception):
    """Internal: the connection opened with the HTTP/2 client preface (connection.py)."""


def h2_limits(limits: LimitsConfig) -> H2Limits:
    """The connection limits: the configured ones, the header list bounded as HTTP/1.1 heads
    are, the rest at their defaults (proxycore/protocol/http2/limits.py)."""
    return H2Limits(
        max_concurrent_streams=limits.h2_max_concurrent_streams,
        stall_timeout=limits.h2_stall_timeout,
        max_header_list_size=limits.max_header_bytes,
    )


async def serve_http2(conn: ClientConnection) -> None:
    """Serve the rest of `conn` as HTTP/2 (its buffer starts with the client preface)."""
    await H2Session(conn).run()


_SWITCHING = b"HTTP/1.1 101 Switching Protocols\r\nconnection: Upgrade\r\nupgrade: h2c\r\n\r\n"


def h2c_settings(head: http1.RequestHead) -> bytes | None:
    """The HTTP2-Settings of a request that asks to upgrade to h2c (RFC 7540 3.2) and can: no
    body (its bytes would sit between the 101 and the client preface), exactly one
    HTTP2-Settings, both nominated by Connection. None: answer it in HTTP/1.1 (the Upgrade is
    ignored, as RFC 7540 3.2 lets a server; RFC 9113 3.1 deprecates the upgrade)."""
    if head.body_kind is not http1.BodyKind.NONE or head.http_version != b"1.1":
        return None
    upgrade = connection = b""
    settings: list[bytes] = []
    for name, value in head.headers:
        if name == b"upgrade":
            upgrade += b"," + value.lower()
        elif name == b"connection":
            connection += b"," + value.lower()
        elif name == b"http2-settings":
            settings.append(value)
    tokens = {token.strip() for token in connection.split(b",")}
    if (
        b"h2c" not in {token.strip() for token in upgrade.split(b",")}
        or not {b"upgrade", b"http2-settings"} <= tokens
        or len(settings) != 1
    ):
        return None
    return settings[0]


async def serve_http2_upgrade(
    conn: ClientConnection, head: http1.RequestHead, settings: bytes
) -> bool:
    """Switch to HTTP/2 (RFC 7540 3.2): the request that asked becomes stream 1, answered in
    HTTP/2 after the 101. False: the settings were unreadable, serve it as HTTP/1.1."""
    session = H2Session(conn)
    try:
        session.server.initiate_upgrade(settings)
    except Http2ConnectionError:
        return False
    session.upgraded = head
    conn.response_started = True
    await conn.stream.send_all(_SWITCHING)
    await session.run()
    return True


class H2Session(OrderedWriter):
    """One HTTP/2 connection from an agent (see the module docstring)."""

    def __init__(self, conn: ClientConnection) -> None:
        self.conn = conn
        self.runtime = conn.runtime
        self.crew = conn.crew
        self.sock = conn.stream
        # Inside a terminated tunnel (ALPN h2): the agent's TLS, written through
        # `send_nowait`/`send_records` (the frames are encrypted first), and every stream is
        # planned as a request to the tunnel's (host, port), its target in origin-form.
        self.tls = conn.stream if isinstance(conn.stream, TerminatedStream) else None
        self.tunnel = conn.tunnel
        if self.tls is not None:
            self.tls.writer_flushes = True
        self.limits = h2_limits(conn.limits)
        self.server = H2Server(self.limits)
        self.pipes: dict[int, StreamPipe] = {}
        self.lock = trio.Lock()
        self.dirty = trio.Event()
        self.nursery: trio.Nursery | None = None
        self.streams_done = trio.Event()
        self.dead = False  # a write was cut mid-frame: nothing more may be written
        # Upgrade: h2c: the HTTP/1.1 request that asked, served as stream 1.
        self.upgraded: http1.RequestHead | None = None
        self.heard = 0.0  # when the agent last sent something (the idle timeout runs from it)

    async def run(self) -> None:
        conn = self.conn
        # From here on nothing HTTP/1.1 is written on this connection (connection.py reads
        # response_started as "too late for an HTTP/1.1 answer").
        conn.response_started = True
        conn.deadline = math.inf
        data = bytes(conn.buffer)
        conn.buffer.clear()
        why = "agent_closed"
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self._write_loop)
            if self.upgraded is not None:
                self._start_upgraded(self.upgraded)
            try:
                why = await self._read_loop(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                why = f"connection broken: {exc}"
            finally:
                for pipe in list(self.pipes.values()):
                    if why == "agent_closed":
                        # A clean close (or half-close) of the agent's side: the responses
                        # still go out; a request body cut short reads as cut (never as whole).
                        pipe.input_closed()
                    else:
                        pipe.break_off(why)
            # The streams finish (each writes its terminal event); then the writer goes.
            if self.pipes:
                self.streams_done = trio.Event()
                await self.streams_done.wait()
            nursery.cancel_scope.cancel()

    async def _read_loop(self, data: bytes) -> str:
        """Read the agent's frames until the connection ends; returns why it did.

        The idle timeout (no frame from the agent for `idle_keepalive_timeout` while no stream
        is open) is one cancel scope for many reads, not one per read: entering and leaving a
        trio cancel scope cost about as much as a stream's HTTP/2 framing. The scope's deadline
        is where the connection would be idle if nothing more arrived; when it passes, the time
        of the last read decides: earlier reads (or open streams, which have their own
        deadlines) arm the next scope; otherwise the connection is idle (GOAWAY, RFC 9113 6.8).
        """
        idle = self.conn.limits.idle_keepalive_timeout
        self.heard = time.monotonic()
        while True:
            # `heard` is on the endpoint's clock (time.monotonic), a deadline on trio's.
            left = self.heard + idle - time.monotonic()
            with trio.CancelScope(deadline=trio.current_time() + left) as scope:
                why = await self._read_frames(data)
            if not scope.cancelled_caught:
                return why
            # What was read before the deadline is already handed to the endpoint.
            data = b""
            now = time.monotonic()
            if self.pipes:
                self.heard = max(self.heard, now)  # the streams have their own deadlines
            elif self.heard + idle <= now:
                self.server.graceful_goaway()
                await self.flush()
                return "idle"

    async def _read_frames(self, data: bytes) -> str:
        """The reads of `_read_loop` while its deadline holds. A cancellation can only reach
        this at a wait: the flush of queued frames (which leaves them queued for the next one)
        or before a read (nothing read yet); what a read returned is handed over before
        either."""
        server, sock = self.server, self.sock
        while True:
            if data:
                now = self.heard = time.monotonic()
                try:
                    events = server.receive_data(data, now)
                except Http2ConnectionError as exc:
                    self._journal(exc)
                    with trio.CancelScope(shield=True):
                        await self.flush()  # the GOAWAY, whatever the deadline
                    return f"h2 connection error: {exc.rule}"
                self._dispatch(events)
            await self.flush()
            if server.closed and not self.pipes:
                return "agent_goaway"
            # A read that did not fill the buffer drained the socket: the next waits for the
            # client first instead of a recv that fails with EAGAIN (in a request/response rhythm
            # the client is waiting for our answer and has not written yet). Otherwise a
            # checkpoint (the other tasks' turn) comes before the read, never after it: the
            # deadline's cancellation must not fall between a read and its handing over.
            if 0 < len(data) < RECV_SIZE:
                data = await sock.receive_after_wait(RECV_SIZE)
            else:
                await trio.lowlevel.checkpoint()
                got = sock.try_receive(RECV_SIZE)
                data = got if got is not None else await sock.receive_after_wait(RECV_SIZE)
            if not data:
                return "agent_closed"

    async def _write_loop(self) -> None:
        """Writes what the pipes queued without awaiting (window updates as bodies are read)."""
        while True:
            await self.dirty.wait()
            self.dirty = trio.Event()
            try:
                await self.flush()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return  # the reader sees the broken socket and ends the session

    def kick(self) -> None:
        """Wake the writer if anything is queued: a stream that ended with its frames already
        written (most do) costs the writer no scheduling round of its own."""
        if self.server.pending:
            self.dirty.set()

    async def batched(self) -> None:
        """A stream queued frames that may wait for the writer's next round: wake it, or write
        them now when too much is queued (the stream then waits for the client)."""
        if len(self.pipes) <= 1 or self.lock.locked() or self.server.pending > BATCH_BYTES:
            await self.flush()  # alone (nothing to batch with), or too much queued
        else:
            self.kick()

    def _send_now(self) -> bytes:
        """Hand the queued frames to the kernel without waiting; returns what it did not take (the
        caller holds the lock, or no write is waiting for the client)."""
        if self.dead:
            raise trio.BrokenResourceError("the connection is broken")
        data = self.server.data_to_send()
        tls = self.tls
        if tls is not None:
            if not data and not tls.records_waiting:
                return b""
            try:
                return tls.send_nowait(data)
            except trio.BrokenResourceError:
                self._die()
                raise
        if not data:
            return b""
        try:
            sent = self.sock.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._die()
            raise trio.BrokenResourceError(str(exc)) from None
        return data[sent:]

    async def _send_rest(self, data: bytes) -> None:
        """Write what the kernel did not take at once (the caller holds the lock). A client that
        reads nothing for `read_timeout` ends the connection."""
        # Shielded: a frame cut in the middle (a stream's exchange cancelled while it writes)
        # would break the connection for every stream.
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.conn.limits.read_timeout) as scope:
                try:
                    if self.tls is not None:
                        await self.tls.send_records(data)  # already encrypted
                    else:
                        await self.sock.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    self._die()
                    raise
        if scope.cancelled_caught:
            self._die()
            raise trio.BrokenResourceError("the agent stopped reading")

    def _die(self) -> None:
        """Writing failed: end the reader too (it sees EOF) and every stream with it."""
        self.dead = True
        raw = self.tls.plain.sock if self.tls is not None else self.sock.sock
        try:
            raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- events -------------------------------------------------------------------------------

    def _dispatch(self, events: list[H2Event]) -> None:
        for event in events:
            if isinstance(event, RequestReceived):
                self._start_stream(event)
            elif isinstance(event, DataReceived):
                pipe = self.pipes.get(event.stream_id)
                if pipe is None:
                    self.server.acknowledge(event.stream_id, event.flow_length)
                else:
                    pipe.feed_body(event.data, event.flow_length, ended=event.ended)
            elif isinstance(event, StreamEnded):
                pipe = self.pipes.get(event.stream_id)
                if pipe is not None:
                    pipe.end_body()
            elif isinstance(event, TrailersReceived):
                pipe = self.pipes.get(event.stream_id)
                if pipe is not None:
                    pipe.feed_trailers(event.headers)
            elif isinstance(event, StreamReset):
                pipe = self.pipes.get(event.stream_id)
                if pipe is not None:
                    pipe.break_off("agent_reset" if event.by_peer else event.why or "reset")
            elif isinstance(event, WindowOpened):
                if event.stream_id == 0:
                    for pipe in self.pipes.values():
                        pipe.wake_sender()
                else:
                    pipe = self.pipes.get(event.stream_id)
                    if pipe is not None:
                        pipe.wake_sender()

    def _start_stream(self, event: RequestReceived) -> None:
        crew, runtime = self.crew, self.runtime
        assert self.nursery is not None
        method = event.method.decode("ascii", "replace")
        pipe: StreamPipe
        if is_extended_connect(event):
            # RFC 8441: WebSocket over this stream.
            pipe, write_head = WebSocketPipe(self, event.stream_id), stream_head
        else:
            pipe, write_head = StreamPipe(self, event.stream_id, event.method), request_head
        self.pipes[event.stream_id] = pipe
        crew.connections += 1
        refusal = None
        if crew.connections > runtime.limits.max_connections_per_crew:
            # Each stream is one of the crew's requests in flight, as a connection is.
            refusal = Request(crew.name, crew.mode, method=method).refused(
                503,
                "overloaded",
                f"crew {crew.name} has {crew.connections - 1} connections and streams open; "
                "try again shortly",
                rule="max_connections_per_crew",
                close=False,
            )
        else:
            try:
                head = write_head(event, crew.gateway, origin_form=self.tunnel is not None)
            except MessageRefused as exc:
                request = Request(crew.name, crew.mode, method=method)
                refusal = request.refused(exc.status, exc.error, exc.message, close=False)
            else:
                pipe.feed_head(head, chunked=b"\r\ntransfer-encoding: chunked\r\n" in head)
                if event.ended:
                    pipe.end_body()
        if refusal is not None:
            runtime.sink.emit(refusal.event)
            self.nursery.start_soon(self._answer, pipe, refusal.response())
        else:
            # A fixed name: trio would otherwise format one from the function for every task.
            self.nursery.start_soon(self._serve_stream, pipe, method, name=_STREAM_TASK)

    def _start_upgraded(self, head: http1.RequestHead) -> None:
        """Stream 1 of an upgraded connection: the HTTP/1.1 request as it was read."""
        assert self.nursery is not None
        pipe = StreamPipe(self, 1, head.method)
        self.pipes[1] = pipe
        self.crew.connections += 1
        # Its head again without the upgrade (never asked twice) and as the one exchange of
        # the stream; an accepted head, so nothing here can fail to serialize.
        fields = [
            (name, value)
            for name, value in head.headers
            if name not in (b"connection", b"upgrade", b"http2-settings", b"keep-alive")
        ]
        fields.append((b"connection", b"close"))
        pipe.feed_head(
            http1.serialize_request_head(head.method, head.target, fields), chunked=False
        )
        pipe.end_body()
        self.nursery.start_soon(self._serve_stream, pipe, head.method.decode("ascii", "replace"))

    async def _serve_stream(self, pipe: StreamPipe, method: str) -> None:
        try:
            if pipe.broken is not None:
                # Reset (or the connection lost) before its exchange began: its terminal event.
                crew = self.crew
                request = Request(crew.name, crew.mode, method=method)
                self.runtime.sink.emit(request.errored(pipe.broken, 0))
                return
            conn = type(self.conn)(self.runtime, pipe, self.crew)
            conn.pipe = pipe
            conn.tunnel = self.tunnel
            pipe.exchange = conn
            await conn.run()
        finally:
            self._stream_done(pipe)

    async def _answer(self, pipe: StreamPipe, response: bytes) -> None:
        """A stream refused before its exchange: the refusal is its answer."""
        try:
            await pipe.send_all(response)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self._stream_done(pipe)

    def _stream_done(self, pipe: StreamPipe) -> None:
        self.crew.connections -= 1
        self.pipes.pop(pipe.stream_id, None)
        pipe.close()
        self.kick()
        if not self.pipes:
            self.streams_done.set()

    def _journal(self, exc: Http2ConnectionError) -> None:
        crew = self.crew
        why = f"h2 connection error: {exc.rule}"
        for event in exc.events:
            # Requests that arrived with the input that broke the connection: never started,
            # each still ends in its own terminal event.
            if isinstance(event, RequestReceived):
                method = event.method.decode("ascii", "replace")
                request = Request(crew.name, crew.mode, method=method)
                self.runtime.sink.emit(request.errored(why, 0))
        self.runtime.sink.emit(
            RequestRefused(
                crew=crew.name,
                mode=crew.mode,
                route="connection",
                method="",
                host="",
                port=0,
                rule=exc.rule,
                status=0,
                message=f"HTTP/2 GOAWAY {ErrorCode(exc.error_code).name}: {exc}"[:300],
            )
        )
