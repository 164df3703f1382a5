"""HTTP/2 to upstreams: per crew and per host, one connection multiplexes that crew's streams.

Theory of operation
-------------------
The dialer (proxycore/io/upstream.py) offers ALPN ["h2", "http/1.1"] on TLS; when the upstream
picks h2 (or a cleartext upstream is reached with prior knowledge, h2c: docs/proxy.md says
when), `H2Pool.adopt` takes the connection over: an `H2Upstream` owns its socket, one task
reads it and feeds the sans-IO `H2Client` (proxycore/protocol/http2/client.py), another writes
its queued frames; every write goes through one lock. A request head is only queued and the writer
woken: the heads the streams open in one scheduling round go out with one write; a body's DATA
is written by its stream (backpressure: it waits for the upstream).

Each request is one `H2Stream` (proxycore/io/upstream_h2_stream.py): the byte stream the
forward path (proxycore/io/forward.py) uses where it uses a socket. It writes the HTTP/1.1
request the exchange built, which the stream reads back with the strict parser and sends as
HEADERS and DATA (and trailers); the response's HEADERS come back as an HTTP/1.1 head
(proxycore/protocol/http2/outbound.py) read by the strict parser as it arrives and taken whole
by forward.py (`H2Stream.take_response`), its DATA and trailers as an HTTP/1.1 body that
forward.py reads as it reads any upstream's. So every check of the HTTP/1.1 path applies per
stream unchanged: policy, SSRF
checks, credential injection, header and response scrubbing, refusals, deadlines, and one
terminal event per request. The stream is wrapped in an `UpstreamConnection` marked
`multiplexed` (never pooled itself: its connection is).

Sharing: connections are keyed (crew, tls, host, port), exactly as the HTTP/1.1 pool: a crew's
streams never ride another crew's connection. A connection carries at most
min(the upstream's SETTINGS_MAX_CONCURRENT_STREAMS, `h2_max_concurrent_streams`) streams; when
all are busy a new connection is dialled, counted against the crew's upstream connections
(`upstream_connections_per_crew`) like any other. A connection without streams for
`upstream_idle_timeout` is closed by the reaper.

Failure: a connection's failure (socket, protocol error, a hostile frame over a limit) ends its
streams only, each as a broken upstream: 502 before a response byte, a cut response after
(proxycore/io/forward.py). A GOAWAY from the upstream stops new streams on it; the streams it
never processed (above its last stream identifier, or reset REFUSED_STREAM) are marked
`reused`, so forward.py sends a replayable request once more on a fresh connection, as it does
for a stale pooled HTTP/1.1 connection. Memory: a response body is acknowledged to the upstream
only as forward.py reads it, so a stream holds at most its receive window; a request body
waits for the upstream's send window at most `h2_stall_timeout`.
"""

from __future__ import annotations

import logging
import time
from typing import cast

import trio

from proxycore.errors import Http2ConnectionError
from proxycore.io.fastio import PlainStream
from proxycore.io.h2_writer import OrderedWriter
from proxycore.io.progress import RECV_SIZE
from proxycore.io.upstream import PoolKey, UpstreamConnection
from proxycore.io.upstream_h2_stream import H2Stream
from proxycore.protocol import http1
from proxycore.protocol.http2.client import H2Client
from proxycore.protocol.http2.events import (
    ConnectionEnded,
    DataReceived,
    H2Event,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowOpened,
)
from proxycore.protocol.http2.limits import H2Limits

__all__ = ["H2Pool", "H2Stream", "H2Upstream"]

log = logging.getLogger("proxycore")


class H2Pool:
    """The worker's upstream HTTP/2 connections, by (crew, tls, host, port)."""

    def __init__(
        self,
        limits: H2Limits,
        http_limits: http1.Limits,
        *,
        write_timeout: float,
        idle_timeout: float,
    ) -> None:
        self.limits = limits
        self.http_limits = http_limits
        self.write_timeout = write_timeout
        self.idle_timeout = idle_timeout
        self.connections: dict[PoolKey, list[H2Upstream]] = {}
        # Keys being dialled with h2 offered: others wait to share that connection rather
        # than each dial one (concurrent first requests to a host).
        self.dialing: dict[PoolKey, trio.Event] = {}
        self.nursery: trio.Nursery | None = None

    @property
    def running(self) -> bool:
        return self.nursery is not None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the connections' tasks until cancelled (the worker stopping)."""
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.nursery = None
            self.discard()

    def stream(self, key: PoolKey) -> UpstreamConnection | None:
        """A new stream on a connection of `key` with room for one, or None."""
        for connection in self.connections.get(key, ()):
            if connection.can_open():
                return connection.new_stream()
        return None

    async def wait_for_stream(self, key: PoolKey) -> UpstreamConnection | None:
        """A new stream for `key`, waiting for a dial in progress to end first; None: the
        caller dials (and must call `dialed(key)` when done)."""
        while True:
            stream = self.stream(key)
            if stream is not None:
                return stream
            pending = self.dialing.get(key)
            if pending is None:
                self.dialing[key] = trio.Event()
                return None
            await pending.wait()

    def dialed(self, key: PoolKey) -> None:
        pending = self.dialing.pop(key, None)
        if pending is not None:
            pending.set()

    def adopt(self, link: UpstreamConnection) -> UpstreamConnection:
        """Take over a connection that speaks HTTP/2; returns its first stream."""
        assert self.nursery is not None
        connection = H2Upstream(self, link)
        self.connections.setdefault(link.key, []).append(connection)
        self.nursery.start_soon(connection.run)
        return connection.new_stream()

    def remove(self, connection: H2Upstream) -> None:
        group = self.connections.get(connection.key)
        if group is not None and connection in group:
            group.remove(connection)
            if not group:
                del self.connections[connection.key]

    def reap_idle(self) -> int:
        """Close connections without streams for longer than the idle timeout."""
        deadline = time.monotonic() - self.idle_timeout
        reaped = 0
        for group in list(self.connections.values()):
            for connection in list(group):
                idle = not connection.streams and not connection.opening
                if idle and connection.idle_since < deadline:
                    connection.shut("idle")
                    reaped += 1
        return reaped

    def forget_crew(self, crew: str) -> None:
        """A removed crew: its idle connections close, busy ones when their streams end."""
        for group in list(self.connections.values()):
            for connection in list(group):
                if connection.key[0] == crew:
                    connection.retire()

    def discard(self) -> None:
        for group in list(self.connections.values()):
            for connection in list(group):
                connection.shut("proxy stopping")
        self.connections.clear()


class H2Upstream(OrderedWriter):
    """One HTTP/2 connection to an upstream (see the module docstring)."""

    def __init__(self, pool: H2Pool, link: UpstreamConnection) -> None:
        self.pool = pool
        self.link = link
        self.key = link.key
        self.client = H2Client(pool.limits)
        # The preface queued first: a stream may open its head before this connection's tasks
        # have run, and the writer sends both in order.
        self.client.initiate()
        self.streams: dict[int, H2Stream] = {}
        self.opening: set[H2Stream] = set()  # streams whose head is not sent yet
        self.lock = trio.Lock()
        self.dirty = trio.Event()
        # A cleartext connection's socket, written directly while the kernel takes it all.
        self.sock = link.stream.sock if isinstance(link.stream, PlainStream) else None
        self.scope = trio.CancelScope()
        self.broken: str | None = None
        self.retiring = False
        self.completed = 0  # streams that ended with a whole response
        self.idle_since = time.monotonic()

    def can_open(self) -> bool:
        return self.broken is None and not self.retiring and self.client.can_open()

    def new_stream(self) -> UpstreamConnection:
        self.client.reserve()
        stream = H2Stream(self)
        wrapper = UpstreamConnection(
            self.key,
            self.link.address,
            stream,
            self.link.owner,
            # A connection that completed an exchange may have gone stale since: a request
            # that fails on it before any answer is sent once more (as for HTTP/1.1).
            reused=self.completed > 0,
            multiplexed=True,
        )
        stream.wrapper = wrapper
        return wrapper

    # -- the connection's life ----------------------------------------------------------------

    async def run(self) -> None:
        why = "upstream closed the connection"
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_loop)
                    self.kick()
                    why = await self._read_loop()
                    nursery.cancel_scope.cancel()
        except Exception as exc:
            # A bug: it ends this connection (its streams see it broken), never the pool's
            # other connections or the worker. Only the type is logged: a message could quote
            # what the upstream sent.
            failure = exc.exceptions[0] if isinstance(exc, ExceptionGroup) else exc
            log.error("proxy: upstream h2 connection failed: %s", type(failure).__name__)
            why = f"internal error: {type(failure).__name__}"
        finally:
            self._break_contained(self.broken or why)
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                # A GOAWAY queued by a limit goes out if the upstream still reads.
                data = self.client.data_to_send()
                if data:
                    try:
                        await self.link.stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            self.link.close()

    async def _read_loop(self) -> str:
        stream = self.link.stream
        client = self.client
        drained = False
        while True:
            try:
                # After a read that did not fill the buffer (the socket drained) wait for the
                # upstream first instead of a recv that fails with EAGAIN.
                if drained:
                    data = await stream.receive_after_wait(RECV_SIZE)
                else:
                    data = await stream.receive(RECV_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                return f"upstream connection broken: {exc}"
            if not data:
                return "upstream closed the connection"
            drained = len(data) < RECV_SIZE
            try:
                events = client.receive_data(data, time.monotonic())
            except Http2ConnectionError as exc:
                self._dispatch(cast("list[H2Event]", exc.events))
                return f"upstream h2 error ({exc.rule}): {exc}"
            self._dispatch(events)
            self.kick()
            if client.closed:
                return "upstream GOAWAY"
            if self.retiring and not self.streams:
                return "upstream GOAWAY" if client.last_stream_id is not None else "retired"

    async def _write_loop(self) -> None:
        while True:
            await self.dirty.wait()
            self.dirty = trio.Event()
            try:
                await self.flush()
            except trio.BrokenResourceError:
                return

    def kick(self) -> None:
        """Wake the writer if anything is queued (a read that queued no acknowledgement or
        PING answer, or a stream that ended, costs the writer no scheduling round)."""
        if self.client.pending:
            self.dirty.set()

    def batched(self) -> None:
        """A stream queued frames that may wait for the writer's next round (a request head
        whose answer the stream now awaits): wake the writer, which sends what the streams
        queued in the same round with one write."""
        self.dirty.set()

    def _send_now(self) -> bytes:
        """Hand what H2Client queued to a cleartext socket without waiting; returns what it did not
        take (all of it over TLS). The caller holds the lock, or no write is waiting."""
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        data = self.client.data_to_send()
        sock = self.sock
        if not data or sock is None:
            return data
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self.shut(f"upstream connection broken: {exc}")
            raise trio.BrokenResourceError(self.broken) from None
        return data[sent:]

    async def _send_rest(self, data: bytes) -> None:
        """Write what the socket did not take at once (the caller holds the lock); an upstream
        that reads nothing for `write_timeout` ends the connection."""
        # Shielded: a frame cut in the middle would break every stream of the connection.
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.pool.write_timeout) as scope:
                try:
                    await self.link.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    self.shut(f"upstream connection broken: {exc}")
                    raise trio.BrokenResourceError(self.broken) from None
        if scope.cancelled_caught:
            self.shut("the upstream stopped reading")
            raise trio.BrokenResourceError(self.broken)

    def shut(self, why: str) -> None:
        """End the connection now: its streams break, its tasks end, its socket closes."""
        self._break_contained(why)
        self.scope.cancel()

    def _break_contained(self, why: str) -> None:
        """`_break`, whose failure (a bug) stays this connection's: it is called from the
        connection's own task and from the pool's (reaping, stopping), and an exception there
        would end the pool's other connections and the worker. The streams then end by their
        own deadlines; the connection is still closed by its task."""
        try:
            self._break(why)
        except Exception as exc:
            log.error("proxy: ending an upstream h2 connection failed: %s", type(exc).__name__)

    def retire(self) -> None:
        """No new streams; closes once the open ones end."""
        self.retiring = True
        self.pool.remove(self)
        if not self.streams:
            self.shut("retired")

    def _break(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self.pool.remove(self)
        for stream in list(self.streams.values()):
            stream.break_off(why, refused=False)
        self.streams.clear()
        for stream in list(self.opening):
            stream.break_off(why, refused=True)  # never sent: safe to send elsewhere

    # -- events -------------------------------------------------------------------------------

    def _dispatch(self, events: list[H2Event]) -> None:
        streams = self.streams
        for event in events:
            if isinstance(event, DataReceived):
                stream = streams.get(event.stream_id)
                if stream is None:
                    self.client.acknowledge(event.stream_id, event.flow_length)
                else:
                    stream.on_data(event.data, event.flow_length, ended=event.ended)
            elif isinstance(event, ResponseReceived):
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream.on_response(event)
            elif isinstance(event, TrailersReceived):
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream.on_trailers(event.headers)
            elif isinstance(event, StreamEnded):
                stream = streams.get(event.stream_id)
                if stream is not None:
                    stream.on_end()
            elif isinstance(event, StreamReset):
                stream = streams.pop(event.stream_id, None)
                if stream is not None:
                    why = event.why or f"upstream reset the stream (error {event.error_code})"
                    stream.break_off(why, refused=event.refused)
            elif isinstance(event, WindowOpened):
                if event.stream_id == 0:
                    for stream in streams.values():
                        stream.wake_sender()
                else:
                    stream = streams.get(event.stream_id)
                    if stream is not None:
                        stream.wake_sender()
            elif isinstance(event, ConnectionEnded):
                # GOAWAY: no new streams here; the rest finish (or were reset above).
                self.retiring = True
                self.pool.remove(self)

    def stream_done(self, stream: H2Stream, *, complete: bool) -> None:
        if stream.stream_id:
            self.streams.pop(stream.stream_id, None)
        if complete:
            self.completed += 1
        if not self.streams and not self.opening:
            self.idle_since = time.monotonic()
            if self.retiring:
                self.shut("retired")
        self.kick()
