"""One agent-side HTTP/2 stream as the byte stream of one HTTP/1.1 exchange.

Theory of operation: proxycore/io/http2.py (the session that owns the connection). A
`StreamPipe` is what the stream's `ClientConnection` reads and writes where it would use a
socket. Its input: the stream's request written as an HTTP/1.1 head
(proxycore/protocol/http2/messages.py), handed to the exchange whole (`take_head`: the
exchange reads it with the same parser as a socket's), then the body, each piece acknowledged
to the client's flow control as the exchange takes it. Its output: a whole response the
exchange decided comes as status and fields (`send_response`, no HTTP/1.1 in between); any
other (streamed bodies, refusals, local answers) is the HTTP/1.1 the exchange writes, read
back with the strict parser. Both become HEADERS, DATA and trailers within the client's windows
(at most `stall_timeout` waiting for one). The frames that end a response are only queued and
the session's writer woken (`H2Session.batched`). `proxycore/io/websocket_h2.py` extends it for
RFC 8441 WebSocket streams.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import trio

from proxycore.errors import HttpProtocolError
from proxycore.io.fastio import PlainStream
from proxycore.protocol import http1
from proxycore.protocol.http2 import ErrorCode, response_fields
from proxycore.protocol.trailers import relayable, section

if TYPE_CHECKING:
    from collections.abc import Callable

    from proxycore.io.connection import ClientConnection
    from proxycore.io.http2 import H2Session
    from proxycore.protocol.http2.endpoint import H2Endpoint
    from proxycore.protocol.responses import ResponsePlan

__all__ = ["StreamPipe", "take_piece"]


def take_piece(
    inbox: collections.deque[tuple[bytes, int]],
    endpoint: H2Endpoint,
    stream_id: int,
    kick: Callable[[], None],
) -> bytes | None:
    """The next bytes a stream received (None: nothing yet), each piece's flow-controlled
    length acknowledged to the peer as it is taken (`kick` has the window update written), so
    that what a stream holds never exceeds the window we advertised. Used on both sides: the
    agent's request bodies here, an upstream's responses in proxycore/io/upstream_h2_stream.py."""
    while inbox:
        data, flow = inbox.popleft()
        if flow:
            endpoint.acknowledge(stream_id, flow)
            kick()
        if data:
            return data
    return None


class StreamPipe(PlainStream):
    """One stream as the byte stream of an HTTP/1.1 connection that carries one exchange.

    Reads give the request head and body as HTTP/1.1 (acknowledging each piece to the client's
    flow control as it is taken); writes take the HTTP/1.1 response and send it as HEADERS and
    DATA, within the client's windows. Not a socket: `sock` is never set (the tunnel path,
    which needs one, is refused for streams before it is planned).
    """

    __slots__ = (
        "_body",
        "_chunked",
        "_closed",
        "_closing",
        "_done",
        "_eof",
        "_head",
        "_method",
        "_out",
        "_readable",
        "_reader",
        "_session",
        "_writable",
        "broken",
        "exchange",
        "stream_id",
    )

    def __init__(self, session: H2Session, stream_id: int, method: bytes) -> None:
        # No socket (PlainStream's __init__ is not called): every method is overridden.
        self._session = session
        self.stream_id = stream_id
        self._method = method
        self._head: bytes | None = None
        self._body: collections.deque[tuple[bytes, int]] = collections.deque()
        self._chunked = False
        self._eof = False
        self._closing = False
        self._closed = False
        self._done = False  # the response's END_STREAM went out
        self._out = bytearray()  # a response head not yet complete
        self._reader: http1.BodyReader | None = None
        # Created when a side has to wait (most streams never do).
        self._readable: trio.Event | None = None
        self._writable: trio.Event | None = None
        self.broken: str | None = None
        self.exchange: ClientConnection | None = None

    # -- the request side (fed by the session, read by the exchange) --------------------------

    def feed_head(self, head: bytes, *, chunked: bool) -> None:
        """The request head, held for the exchange to take whole (`take_head`); what the
        stream reads is its body."""
        self._chunked = chunked
        self._head = head

    def take_head(self) -> bytes | None:
        """The request head as HTTP/1.1 (once; None after), for the exchange's parser."""
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        head, self._head = self._head, None
        return head

    def feed_body(self, data: bytes, flow_length: int, *, ended: bool) -> None:
        if self._chunked:
            data = http1.encode_chunk(data)
        if data or flow_length:
            self._body.append((data, flow_length))
        if ended:
            self.end_body()
        self._wake_reader()

    def feed_trailers(self, fields: tuple[tuple[bytes, bytes], ...]) -> None:
        """The request's trailer section: it ends a chunked body (a body with a length has
        nowhere to carry it: dropped, RFC 9110 6.5.1)."""
        if not self._eof:
            self._eof = True
            if self._chunked:
                self._body.append((section(relayable(fields, request=True)), 0))
        self._wake_reader()

    def end_body(self) -> None:
        if not self._eof:
            self._eof = True
            if self._chunked:
                self._body.append((http1.LAST_CHUNK, 0))
        self._wake_reader()

    def input_closed(self) -> None:
        """The agent will send nothing more on the connection: reads end (b"") once what
        arrived is taken; a body not ended by END_STREAM is short, and its reader says so."""
        self._eof = True
        self._wake_reader()

    def break_off(self, why: str) -> None:
        """The stream (or the whole connection) is gone: the exchange ends, naming why."""
        if self.broken is None:
            self.broken = why
        self._wake_reader()
        self.wake_sender()
        if self.exchange is not None and not self._done:
            self.exchange.end(why)

    def _wake_reader(self) -> None:
        if self._readable is not None:
            self._readable.set()

    def wake_sender(self) -> None:
        if self._writable is not None:
            self._writable.set()

    def try_receive(self, max_bytes: int) -> bytes | None:
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        if self._closing:
            return b""
        session = self._session
        data = take_piece(self._body, session.server, self.stream_id, session.kick)
        if data is not None:
            return data
        return b"" if self._eof else None

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

    # -- the response side (written by the exchange) -------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        if self._done:
            return  # nothing follows a complete response (the exchange wrote its last bytes)
        session = self._session
        limits = session.runtime.http_limits
        try:
            if self._reader is None:
                self._out += data
                while True:
                    parsed = http1.parse_response_head(
                        self._out, limits, request_method=self._method
                    )
                    if parsed is None:
                        return
                    head, used = parsed
                    del self._out[:used]
                    fields = response_fields(head)
                    if 100 <= head.status < 200:
                        if head.status != 101:  # RFC 9113 8.6: no 101 in HTTP/2
                            await self._headers(head.status, fields, end=False)
                        continue
                    if head.body_kind is http1.BodyKind.NONE or (
                        head.body_kind is http1.BodyKind.LENGTH and not head.content_length
                    ):
                        # No body: END_STREAM on the head (a gRPC "trailers-only" response).
                        await self._headers(head.status, fields, end=True)
                        return
                    # Queued, and written with the first DATA (one write for a small answer).
                    await self._headers(head.status, fields, end=False, flush=False)
                    self._reader = http1.BodyReader.for_response(head, limits)
                    data = bytes(self._out)
                    self._out.clear()
                    break
            piece = self._reader.feed(bytes(data))
        except HttpProtocolError as exc:
            # Our own exchange wrote it: a bug, not the agent's doing. The stream ends.
            self._session.server.reset(self.stream_id, ErrorCode.INTERNAL_ERROR)
            self._session.kick()
            raise trio.BrokenResourceError(f"unreadable response: {exc}") from None
        trailers = self._reader.trailers if self._reader.done else None
        if trailers:
            # RFC 9113 8.1: the trailer section is a HEADERS frame that ends the stream.
            if piece:
                await self._data(piece, end=False)
            await self._trailers(trailers)
        elif piece or self._reader.done:
            await self._data(piece, end=self._reader.done)
        else:
            await self._session.flush()  # a head whose body has not begun

    async def send_response(
        self, decided: ResponsePlan, content_length: int | None, body: bytes
    ) -> None:
        """A response the exchange decided, whole (no body, or its scrubbed body of
        `content_length` bytes): sent as HEADERS and DATA without being written as HTTP/1.1
        and read back, the same frames `send_all` would make of `decided.head()` and `body`."""
        if self._reader is not None or self._out:
            # Something was written as bytes before (never, after an interim 100 is whole):
            # the rest goes the same way.
            out = decided.head(content_length)
            out += body
            await self.send_all(out)
            return
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        if self._done:
            return
        session = self._session
        # The endpoint's state changes at once (no await), as in `_headers`.
        if not session.server.send_decided_head(
            self.stream_id,
            decided.status,
            decided.start,
            content_length,
            closes=not decided.keep_client,
            end=not body,
        ):
            raise trio.BrokenResourceError(self.broken or "stream closed by the agent")
        if not body:
            # No body: END_STREAM on the head (a HEAD, 204 or 304 answer, or an empty one).
            self._done = True
            await session.batched()
            return
        # Queued, and written with the DATA (one write for a small answer).
        if len(body) <= session.server.send_window(self.stream_id):
            # The whole body in one frame (most small answers): `_data`'s first round, without
            # its slicing.
            if session.server.send_data(self.stream_id, body, end=True) < 0:
                raise trio.BrokenResourceError(self.broken or "stream closed")
            self._done = True
            await session.batched()
            return
        await self._data(body, end=True)

    async def _headers(
        self, status: int, fields: list[tuple[bytes, bytes]], *, end: bool, flush: bool = True
    ) -> None:
        # The endpoint's state changes at once (no await); what it queued goes out in order, with
        # the writer's next round (a whole response) or now (`flush`).
        session = self._session
        if not session.server.send_headers(self.stream_id, status, fields, end=end):
            raise trio.BrokenResourceError(self.broken or "stream closed by the agent")
        if end:
            self._done = True
            await session.batched()
        elif flush:
            await session.flush()

    async def _trailers(self, fields: list[tuple[bytes, bytes]]) -> None:
        session = self._session
        if not session.server.send_trailers(self.stream_id, fields):
            raise trio.BrokenResourceError(self.broken or "stream closed by the agent")
        # The response is whole: written with its siblings' in the writer's round.
        self._done = True
        await session.batched()

    async def _data(self, piece: bytes, *, end: bool) -> None:
        session, server = self._session, self._session.server
        view = memoryview(piece)
        while view or end:
            window = server.send_window(self.stream_id)
            if not server.is_live(self.stream_id):
                raise trio.BrokenResourceError(self.broken or "stream closed by the agent")
            if window or not view:
                take = min(len(view), window)
                last = end and take == len(view)
                if server.send_data(self.stream_id, view[:take], end=last) < 0:
                    raise trio.BrokenResourceError(self.broken or "stream closed")
                view = view[take:]
                if last:
                    # The response is whole: written with its siblings' in the writer's round.
                    self._done = True
                    await session.batched()
                    return
                await session.flush()  # a frame at a time: the client's pace
                continue
            writable = self._writable = trio.Event()
            await session.flush()  # what is queued (a head) goes out meanwhile
            await self._wait_for_window(writable)

    async def _wait_for_window(self, writable: trio.Event) -> None:
        """A zero window: wait for the client to open it, at most `stall_timeout`."""
        session = self._session
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        with trio.move_on_after(session.limits.stall_timeout) as scope:
            await writable.wait()
        if self.broken is not None:
            raise trio.BrokenResourceError(self.broken)
        if scope.cancelled_caught:
            session.server.reset(self.stream_id, ErrorCode.CANCEL)
            session.kick()
            self.broken = "send window stalled (the agent never opened it)"
            raise trio.BrokenResourceError(self.broken)

    # -- closing ------------------------------------------------------------------------------

    def shutdown_write(self) -> None:
        self._closing = True

    def close(self) -> None:
        """The exchange is over: a response it did not finish is reset (the agent must not
        take a cut body for a whole one); a request body it did not read is stopped
        (RFC 9113 8.1: RST_STREAM NO_ERROR after a complete response)."""
        if self._closed:
            return  # the exchange closed it, then the session (one reset, one kick)
        self._closed = self._closing = True
        server = self._session.server
        if not self._done:
            server.reset(self.stream_id, ErrorCode.CANCEL)
        elif not self._eof:
            server.stop_receiving(self.stream_id)
        self._session.kick()
