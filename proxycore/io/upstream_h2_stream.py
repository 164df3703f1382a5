"""One request on an upstream HTTP/2 connection, as the byte stream of one HTTP/1.1 exchange.

Theory of operation: proxycore/io/upstream_h2.py (the connections, their pool and their reader
tasks). An `H2Stream` is what forward.py writes the request to and reads the response from,
where it would use a socket: the request head it writes is read back with the strict parser and
sent as HEADERS (proxycore/protocol/http2/outbound.py), the body as DATA within the upstream's
windows (at most `h2_stall_timeout` waiting for one), a chunked body's trailer section as
trailers; the response's HEADERS, DATA and trailers, which the connection's reader task hands
over (`on_response`, `on_data`, `on_trailers`, `on_end`, `break_off`), become an HTTP/1.1
response: its head read by the strict parser on arrival and taken whole by forward.py
(`take_response`), its body read as bytes, each piece acknowledged to the upstream's flow
control as it is taken.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, NoReturn

import trio

from proxycore.errors import HttpProtocolError
from proxycore.io.h2_stream import take_piece
from proxycore.io.upstream import UpstreamConnection
from proxycore.protocol import http1
from proxycore.protocol.http2 import ErrorCode
from proxycore.protocol.http2.client import RequestUnsendable
from proxycore.protocol.http2.events import ResponseReceived
from proxycore.protocol.http2.outbound import request_fields, response_head
from proxycore.protocol.trailers import relayable, section

if TYPE_CHECKING:
    from proxycore.io.upstream_h2 import H2Upstream

__all__ = ["H2Stream"]


class H2Stream:
    """One request on an upstream HTTP/2 connection, as the byte stream of one HTTP/1.1
    exchange (see the module docstring). Not a socket."""

    def __init__(self, connection: H2Upstream) -> None:
        self.connection = connection
        self.wrapper: UpstreamConnection | None = None
        self.stream_id = 0
        self._head = bytearray()
        self._method = b""
        self._request: http1.BodyReader | None = None
        self._sent_end = False
        self._inbox: collections.deque[tuple[bytes, int]] = collections.deque()
        self._chunked = False
        self._trailers: list[tuple[bytes, bytes]] = []
        self._responded = False
        # The response head, parsed as it arrived (or why it could not be), for forward.py.
        self._response: http1.ResponseHead | None = None
        self._malformed: HttpProtocolError | None = None
        self._eof = False
        self._closed = False
        self.broken: str | None = None
        # Created when a side has to wait (most streams wait once, for the response).
        self._readable: trio.Event | None = None
        self._writable: trio.Event | None = None
        connection.opening.add(self)

    def _opened(self) -> None:
        self.connection.opening.discard(self)

    # -- the request (written by forward.py) --------------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        limits = self.connection.pool.http_limits
        try:
            if self._request is None:
                self._head += data
                parsed = http1.parse_request_head(self._head, limits)
                if parsed is None:
                    return
                head, used = parsed
                data = bytes(self._head[used:])
                self._head.clear()
                self._method = head.method
                self._request = http1.BodyReader.for_request(head, limits)
                self._open(request_fields(head, tls=self.connection.key[1]))
                if self._request.done:
                    return
            piece = self._request.feed(bytes(data))
        except HttpProtocolError as exc:
            # Our own exchange wrote it: a bug, never the agent's doing.
            self._fail_request(f"unreadable request: {exc}")
        if self._request.done:
            trailers = relayable(self._request.trailers, request=True)
            await self._send_body(piece, end=not trailers)
            if trailers:
                await self._send_trailers(trailers)
        elif piece:
            await self._send_body(piece, end=False)

    def _fail_request(self, why: str) -> NoReturn:
        if self.wrapper is not None:
            self.wrapper.reused = False  # never sent again: it would fail the same way
        self.break_off(why, refused=False)
        raise trio.BrokenResourceError(why)

    def _open(self, fields: list[tuple[bytes, bytes]]) -> None:
        connection = self.connection
        end = self._request is not None and self._request.done
        # The endpoint's state changes at once (no await): the stream's identifier is the next one
        # whoever writes the queue; the writer's next round sends the heads the streams opened
        # in this round with one write (a body's first DATA sends it sooner, `_send_body`).
        if connection.broken is not None or not connection.client.can_open_now():
            # The connection went away (or a GOAWAY came) before this head was sent: the
            # request was never seen upstream and may go on another connection.
            self._opened()
            connection.client.unreserve()
            self.break_off(connection.broken or "upstream GOAWAY", refused=True)
            raise trio.BrokenResourceError(self.broken)
        try:
            self.stream_id = connection.client.open_stream(fields, end=end)
        except RequestUnsendable as exc:
            connection.client.unreserve()
            self._opened()
            self._fail_request(f"the request cannot be sent over HTTP/2: {exc}")
        self._opened()
        connection.streams[self.stream_id] = self
        if end:
            self._sent_end = True
        connection.batched()

    async def _send_body(self, piece: bytes, *, end: bool) -> None:
        connection, client = self.connection, self.connection.client
        view = memoryview(piece)
        while view or (end and not self._sent_end):
            if self.broken is not None:
                raise trio.BrokenResourceError(self.broken)
            window = client.send_window(self.stream_id)
            if window or not view:
                take = min(len(view), window)
                last = end and take == len(view)
                if client.send_data(self.stream_id, view[:take], end=last) < 0:
                    raise trio.BrokenResourceError(self.broken or "stream closed upstream")
                view = view[take:]
                if last:
                    self._sent_end = True
                await connection.flush()  # a frame at a time: the upstream's pace
                continue
            writable = self._writable = trio.Event()
            await connection.flush()  # what is queued (the head) goes out meanwhile
            await self._wait_for_window(writable)

    async def _send_trailers(self, fields: list[tuple[bytes, bytes]]) -> None:
        connection = self.connection
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        try:
            sent = connection.client.send_trailers(self.stream_id, fields)
        except RequestUnsendable as exc:
            self._fail_request(f"request trailers cannot be sent: {exc}")
        if not sent:
            raise trio.BrokenResourceError(self.broken or "stream closed upstream")
        self._sent_end = True
        await connection.flush()

    async def _wait_for_window(self, writable: trio.Event) -> None:
        """A zero send window: wait for the upstream to open it, at most `stall_timeout`."""
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        with trio.move_on_after(self.connection.pool.limits.stall_timeout) as scope:
            await writable.wait()
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        if scope.cancelled_caught:
            self.connection.client.reset(self.stream_id, ErrorCode.CANCEL)
            self.connection.kick()
            self._fail_request("send window stalled (the upstream never opened it)")

    def wake_sender(self) -> None:
        if self._writable is not None:
            self._writable.set()

    def _wake_reader(self) -> None:
        if self._readable is not None:
            self._readable.set()

    def abort(self, why: str) -> None:
        """The request cannot be completed (its body failed): reset the stream; the response
        side reads the failure."""
        if self.stream_id:
            self.connection.client.reset(self.stream_id, ErrorCode.CANCEL)
            self.connection.streams.pop(self.stream_id, None)
            self.connection.kick()
        self.break_off(why, refused=False)

    # -- the response (read by forward.py) ----------------------------------------------------

    def on_response(self, event: ResponseReceived) -> None:
        rendered = response_head(event, self._method)
        if rendered is None:
            self.connection.client.reset(self.stream_id, ErrorCode.PROTOCOL_ERROR)
            self.connection.streams.pop(self.stream_id, None)
            self.break_off("the upstream sent a malformed response head", refused=False)
            return
        head, self._chunked = rendered
        self._responded = True
        # Read by the strict parser as any upstream's head is (forward.py answers 502 for
        # what it refuses), here rather than from the stream's bytes: the exchange takes it
        # whole (`take_response`) and reads only the body from the stream.
        try:
            parsed = http1.parse_response_head(
                head, self.connection.pool.http_limits, request_method=self._method
            )
            if parsed is None:
                raise HttpProtocolError("closed inside a response head")
            self._response = parsed[0]
        except HttpProtocolError as exc:
            self._malformed = exc
        self._wake_reader()
        if event.ended:
            self.on_end()

    def on_data(self, data: bytes, flow: int, *, ended: bool) -> None:
        if data and self._chunked:
            data = http1.encode_chunk(data)
        self._inbox.append((data, flow))
        self._wake_reader()
        if ended:
            self.on_end()

    def on_trailers(self, fields: tuple[tuple[bytes, bytes], ...]) -> None:
        self._trailers = relayable(fields, request=False)

    def on_end(self) -> None:
        if self._eof:
            return
        if self._chunked:
            self._inbox.append((section(self._trailers) if self._trailers else http1.LAST_CHUNK, 0))
        self._eof = True
        self._wake_reader()

    def break_off(self, why: str, *, refused: bool) -> None:
        if self.broken is None and not self._eof:
            self.broken = why
            if self.wrapper is not None and refused and not self._responded:
                self.wrapper.reused = True  # never processed upstream: safe to send again
        self._wake_reader()
        self.wake_sender()

    def take_response(self) -> http1.ResponseHead | None:
        """The response head once it arrived (None: not yet); HttpProtocolError if the
        parser refused it, BrokenResourceError if the stream ended without one."""
        response = self._response
        if response is not None:
            return response
        if self._malformed is not None:
            raise self._malformed
        if self._eof:
            raise trio.BrokenResourceError("closed before a response")
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        return None

    async def wait_readable(self) -> None:
        """Until something arrives on the stream (or it breaks)."""
        readable = self._readable = trio.Event()
        await readable.wait()

    def try_receive(self, max_bytes: int) -> bytes | None:
        connection = self.connection
        data = take_piece(self._inbox, connection.client, self.stream_id, connection.kick)
        if data is not None:
            return data
        if self._eof:
            return b""
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        return None

    async def receive_after_wait(self, max_bytes: int) -> bytes:
        await trio.lowlevel.checkpoint()
        while True:
            data = self.try_receive(max_bytes)
            if data is not None:
                return data
            readable = self._readable = trio.Event()
            await readable.wait()

    async def receive(self, max_bytes: int) -> bytes:
        return await self.receive_after_wait(max_bytes)

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """The exchange is over: a response not read whole (or a request not sent whole) is
        reset (CANCEL); after a whole response the stream is forgotten (RST_STREAM NO_ERROR if
        the upstream has not closed it, RFC 9113 8.1)."""
        if self._closed:
            return
        self._closed = True
        connection = self.connection
        complete = self._eof and not self._inbox and self.broken is None
        if not self.stream_id:
            if self in connection.opening:
                connection.client.unreserve()
                self._opened()
        elif complete and self._sent_end:
            connection.client.finish(self.stream_id)
        else:
            connection.client.reset(
                self.stream_id, ErrorCode.CANCEL if not complete else ErrorCode.NO_ERROR
            )
        connection.stream_done(self, complete=complete)
