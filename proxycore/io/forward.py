"""The forward exchange: one request to its upstream, and the response back through the scrubber.

Theory of operation: the exchange (proxycore/protocol/exchange.py) has built the upstream
request head and checked the name policy; this module moves the bytes.

Request body, by framing (every one counted against `max_body_bytes` as it passes):
  - none, or a body that ends within `REPLAYABLE_BODY` bytes (Content-Length or chunked): read
    whole (within the crew's `max_buffered_bytes_per_crew`), sent with a Content-Length on a
    pooled connection, and sent again once on a fresh connection if the pooled one had gone stale;
  - anything longer: streamed on a fresh connection as it arrives, with flow control (nothing
    more is read from the agent until the upstream has taken what was read): a Content-Length
    body as it is, a chunked body re-framed chunk by chunk (never the agent's own framing,
    extensions or trailers).

HTTP/2 upstreams (proxycore/io/upstream_h2.py): `_open` takes a stream on the crew's HTTP/2
connection to the host when it has one with room, else dials (TLS offers ALPN h2; a cleartext
host listed in `[upstream] h2c`, or a gRPC request, is reached with prior knowledge); the stream
takes the same HTTP/1.1 bytes as a socket and gives the response's body as one; its response
head comes already parsed, by the same parser (`_take_h2_response_head`). Trailers: a request
body's trailer section reaches an HTTP/2 upstream (an HTTP/1.1 upstream never gets them, as
before); a response's reaches an agent that takes them (proxycore/protocol/trailers.py).

gRPC (a chunked request body with a gRPC content-type) is not served here but by
proxycore/io/forward_grpc.py (its body goes up as it comes while the response comes down), which
builds on this module's steps; the connection hands it there (`takes_duplex`).

Response (proxycore/protocol/responses.py decides): no body; a small body read whole, scrubbed
and sent with its new length (to an agent's HTTP/2 stream as status and fields:
`StreamPipe.send_response`); or a stream through the scrubber. Around the scrubber, by body:
`text/event-stream` goes through the SSE layer (proxycore/protocol/sse_scrub.py: each text
channel scrubbed over its concatenated deltas), gRPC through its message scrubber, and a
compressed body (declared, or gzip/zlib bytes labelled identity) is decoded before and encoded
again after (proxycore/protocol/codings.py). A broken upstream before any
response byte went to the agent is a 502 (or 504) the agent can read; after, the connection is
closed (the only signal left) and the journal names why (`RequestAllowed.ended`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import trio

from proxycore.errors import HttpProtocolError, PolicyDenied, UpstreamError
from proxycore.io.progress import RECV_SIZE, Phase, Refused, upstream_refusal
from proxycore.io.upstream import UpstreamConnection
from proxycore.io.upstream_h2_stream import H2Stream
from proxycore.protocol import http1
from proxycore.protocol.codings import Filter, Recoder, sniffable
from proxycore.protocol.events import CredentialInjected
from proxycore.protocol.exchange import REPLAYABLE_BODY
from proxycore.protocol.grpc import MessageScrubber, is_grpc
from proxycore.protocol.plans import Forward, Refuse
from proxycore.protocol.responses import WHOLE_BODY, BodyMode, ResponsePlan, plan_response
from proxycore.protocol.scrubbing import MarkerCount, redactions
from proxycore.protocol.sse_scrub import SseScrubber, is_event_stream
from proxycore.protocol.trailers import accepts_trailers, relayable, scrubbed_section, section

if TYPE_CHECKING:
    from proxycore.io.connection import ClientConnection

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _UpstreamBroken(Exception):
    """The upstream's socket failed (reset, broken pipe) or closed before a response."""


async def serve_forward(conn: ClientConnection, plan: Forward, head: http1.RequestHead) -> bool:
    """Carry out a Forward plan; returns whether the agent's connection stays open. A refusal
    raised from here leaves `conn.upstream` for the connection to close (never pooled)."""
    progress = conn.progress
    assert progress is not None
    if plan.provider is not None:
        progress.rule = "provider"
    if head.body_kind is http1.BodyKind.NONE:
        # The common case, kept to as few calls as possible: no body to read or hold.
        upstream, response = await _send_replayable(conn, plan, head, None)
    else:
        upstream, response = await _send_with_body(conn, plan, head)
    return await relay_response(conn, plan, head, upstream, response)


async def relay_response(
    conn: ClientConnection,
    plan: Forward,
    head: http1.RequestHead,
    upstream: UpstreamConnection,
    response: http1.ResponseHead,
) -> bool:
    """Relay the response whose head has arrived (proxycore/protocol/responses.py decides how);
    returns whether the agent's connection stays open."""
    crew = conn.crew
    progress = conn.progress
    assert progress is not None
    progress.address = upstream.address
    progress.status = response.status
    if plan.provider is not None:
        conn.emit(CredentialInjected(crew=crew.name, provider=plan.provider.value, host=plan.host))
    budget = crew.buffered
    length = response.content_length
    # A small body is read whole (and scrubbed in one call) only within the crew's budget.
    whole = (
        response.body_kind is http1.BodyKind.LENGTH
        and length <= WHOLE_BODY
        and budget.used + length <= budget.limit
    )
    decided = plan_response(
        plan,
        head,
        response,
        conn.runtime.scrubbers.current,
        whole_limit=WHOLE_BODY if whole else 0,
    )
    if isinstance(decided, Refuse):
        raise Refused(decided)
    if decided.mode is BodyMode.STREAM:
        return await _relay_stream(conn, plan, head, decided, upstream, response)
    buffer = upstream.buffer
    if decided.mode is BodyMode.NONE:
        scrubbed = b""
        sent_length = None
    else:
        budget.used += length
        try:
            if len(buffer) < length:
                await _read_whole(conn, plan, upstream, length)
        finally:
            budget.used -= length
        body = bytes(buffer[:length])
        del buffer[:length]
        scrubbed = _scrub_whole(conn, plan, response, body) if body else body
        progress.bytes_down = sent_length = len(scrubbed)
    conn.response_started = True
    if conn.pipe is None:
        out = decided.head(sent_length)
        out += scrubbed
        await conn.stream.send_all(out)
    else:
        # An HTTP/2 stream takes the status and fields as they are (no HTTP/1.1 in between).
        await conn.pipe.send_response(decided, sent_length, scrubbed)
    # The exchange is complete: back to the crew's pool if it can carry another, else closed.
    conn.upstream = None
    if not (decided.reusable and not buffer and conn.runtime.dialer.checkin(upstream)):
        upstream.close()
    conn.emit_allowed(decided.status)
    return decided.keep_client


def _scrub_whole(
    conn: ClientConnection, plan: Forward, response: http1.ResponseHead, body: bytes
) -> bytes:
    """A body read whole, scrubbed: in one call, or through the SSE layer (an event stream),
    or decoded and encoded again (gzip/zlib bytes labelled identity; refused 502 if they do
    not decode or inflate past a bound)."""
    progress = conn.progress
    assert progress is not None
    scrubber = conn.runtime.scrubbers.current
    content_type = response.get(b"content-type")
    sse = is_event_stream(content_type)
    if not sse and (not sniffable(content_type) or not Recoder.sniffs(body)):
        scrubbed = scrubber.scrub(body)
        progress.redactions = redactions(body, scrubbed)
        return scrubbed
    counted = _Counted(SseScrubber(scrubber) if sse else scrubber.stream())
    recoder = Recoder(None, counted) if sniffable(content_type) else counted
    try:
        scrubbed = recoder.feed(body) + recoder.flush()
    except HttpProtocolError as exc:
        raise Refused(_protocol_error(plan, exc)) from None
    progress.redactions = counted.redactions
    return scrubbed


class _Counted:
    """A body filter with the markers counted on both sides (the redactions it made)."""

    __slots__ = ("_in", "_inner", "_out")

    def __init__(self, inner: Filter) -> None:
        self._inner = inner
        self._in, self._out = MarkerCount(), MarkerCount()

    @property
    def redactions(self) -> int:
        return max(0, self._out.count - self._in.count)

    def feed(self, data: bytes) -> bytes:
        self._in.feed(data)
        out = self._inner.feed(data)
        self._out.feed(out)
        return out

    def flush(self) -> bytes:
        out = self._inner.flush()
        self._out.feed(out)
        return out


async def _read_whole(
    conn: ClientConnection, plan: Forward, upstream: UpstreamConnection, length: int
) -> None:
    """Read a response body of `length` bytes into the upstream's buffer; 502 if it ends
    short (nothing has gone to the agent yet)."""
    buffer = upstream.buffer
    deadline = time.monotonic() + conn.limits.read_timeout
    try:
        while len(buffer) < length:
            data = await _receive_upstream(conn, upstream, Phase.RELAY, deadline)
            if not data:
                raise _UpstreamBroken("closed inside a response body")
            buffer += data
    except _UpstreamBroken:
        raise Refused(
            plan.request.refused(
                502,
                "upstream_failed",
                f"{plan.host} closed the connection inside a response body",
                rule="upstream_closed",
                close=True,
            )
        ) from None


async def _send_with_body(
    conn: ClientConnection, plan: Forward, head: http1.RequestHead
) -> tuple[UpstreamConnection, http1.ResponseHead]:
    """A request with a body: read whole if it ends within REPLAYABLE_BODY bytes and the crew's
    buffer budget has room (then sent replayably), else streamed."""
    if plan.expect_continue:
        # RFC 9110 10.1.1: the policy and the declared size passed; ask for the body.
        await conn.stream.send_all(CONTINUE)
    reader = http1.BodyReader.for_request(head, conn.runtime.http_limits)
    chunked = head.body_kind is http1.BodyKind.CHUNKED
    if not chunked and head.content_length > REPLAYABLE_BODY:
        return await _send_streaming(conn, plan, head, reader, b"")
    want = REPLAYABLE_BODY if chunked else head.content_length
    budget = conn.crew.buffered
    if not budget.take(want):
        return await _send_streaming(conn, plan, head, reader, b"")
    try:
        prefix = await _read_up_to(conn, reader, REPLAYABLE_BODY)
        if reader.done:
            return await _send_replayable(conn, plan, head, prefix, reader.trailers)
        return await _send_streaming(conn, plan, head, reader, prefix)
    finally:
        budget.give_back(want)


# -- the request --------------------------------------------------------------------------------


async def _read_up_to(conn: ClientConnection, reader: http1.BodyReader, limit: int) -> bytes:
    """Read the body until it ends or `limit` bytes are decoded (the rest is streamed)."""
    body = bytearray()
    try:
        while not reader.done and len(body) < limit:
            data = await conn._receive_body()
            if not data:
                reader.feed_eof()
            body += reader.feed(data)
    except HttpProtocolError as exc:
        raise Refused(conn.bad_body(exc)) from None
    if len(body) > conn.limits.max_body_bytes:
        raise Refused(conn.too_large(conn.limits.max_body_bytes))
    if reader.done:
        conn.buffer[:0] = reader.take_leftover()
        assert conn.progress is not None
        conn.progress.body_consumed = True
    return bytes(body)


async def _open(
    conn: ClientConnection, plan: Forward, head: http1.RequestHead, *, fresh: bool = False
) -> UpstreamConnection:
    """An upstream for `plan`: a stream on the crew's HTTP/2 connection to the host (unless
    `fresh`), else a connection dialled within the crew's shares (HTTP/2 if it says so)."""
    crew = conn.crew
    runtime = conn.runtime
    dialer = runtime.dialer
    pool = runtime.h2
    h2 = pool.running and _speaks_h2(runtime.h2c_hosts, plan, head, dialer.tls_h2 is not None)
    conn.phase = Phase.UPSTREAM
    conn.deadline = float("inf")  # the dialer bounds lookups, connects and handshakes itself
    key = (crew.name, plan.tls, plan.host, plan.port)
    if h2 and not fresh:
        stream = await pool.wait_for_stream(key)
        if stream is not None:
            conn.upstream = stream
            return stream
    request = plan.request
    try:
        upstream = await dialer.open(
            crew.name, crew.lookups, crew.guard, plan.tls, plan.host, plan.port, offer_h2=h2
        )
        if h2 and (upstream.alpn == "h2" or not plan.tls):
            upstream = pool.adopt(upstream)
    except PolicyDenied as exc:
        raise Refused(request.denied(exc.rule, str(exc), close=not plan.keep_alive)) from None
    except UpstreamError as exc:
        raise Refused(upstream_refusal(request, exc, close=True)) from None
    finally:
        if h2 and not fresh:
            pool.dialed(key)
    conn.upstream = upstream
    return upstream


def _speaks_h2(
    h2c_hosts: frozenset[str], plan: Forward, head: http1.RequestHead, alpn: bool
) -> bool:
    """Whether to try HTTP/2: over TLS, ALPN decides (if offered at all); in cleartext only
    with prior knowledge: a host the operator listed, or gRPC (RFC 9113 3.3; gRPC has no
    HTTP/1.1 mapping, so nothing is lost by it)."""
    if plan.tls:
        return alpn
    if plan.host in h2c_hosts or f"{plan.host}:{plan.port}" in h2c_hosts:
        return True
    return is_grpc(head.get(b"content-type"))


async def _send_upstream(conn: ClientConnection, upstream: UpstreamConnection, data: bytes) -> None:
    conn.phase = Phase.UPSTREAM
    conn.deadline = time.monotonic() + conn.limits.read_timeout
    try:
        await upstream.stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise _UpstreamBroken(str(exc)) from None


async def _send_replayable(
    conn: ClientConnection,
    plan: Forward,
    head: http1.RequestHead,
    body: bytes | None,
    trailers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[UpstreamConnection, http1.ResponseHead]:
    """Send a request whose body (if any) is in hand: on a pooled connection first, and once
    more on a fresh one if the pooled one turns out stale (closed or reset before answering,
    or an HTTP/2 stream the upstream refused unprocessed)."""
    data = plan.upstream_head(None if body is None else len(body))
    if body:
        data += body
    crew = conn.crew
    upstream = conn.runtime.dialer.checkout(crew.name, plan.tls, plan.host, plan.port)
    fresh = False
    while True:
        if upstream is None:
            upstream = await _open(conn, plan, head, fresh=fresh)
        conn.upstream = upstream
        if trailers and upstream.multiplexed:
            # An HTTP/2 upstream takes the agent's trailer section (a chunked body carries it).
            data = plan.upstream_head(None, chunked=True) + http1.encode_chunk(body or b"")
            data += section(relayable(trailers, request=True))
        # One deadline for sending the request and for its answer's head.
        deadline = time.monotonic() + conn.limits.read_timeout
        conn.phase = Phase.UPSTREAM
        conn.deadline = deadline
        try:
            try:
                await upstream.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _UpstreamBroken(str(exc)) from None
            response = await _read_response_head(conn, plan, upstream, head.method, deadline)
        except _UpstreamBroken as exc:
            upstream.close()
            conn.upstream = None
            if upstream.reused and not fresh:
                upstream = None
                fresh = True
                continue  # the pooled connection had gone stale: once more, fresh
            raise Refused(_upstream_closed(plan, upstream, exc)) from None
        if body:
            assert conn.progress is not None
            conn.progress.bytes_up = len(body)
        return upstream, response


async def _send_streaming(
    conn: ClientConnection,
    plan: Forward,
    head: http1.RequestHead,
    reader: http1.BodyReader,
    prefix: bytes,
    upstream: UpstreamConnection | None = None,
) -> tuple[UpstreamConnection, http1.ResponseHead]:
    limit = conn.limits.max_body_bytes
    chunked = head.body_kind is http1.BodyKind.CHUNKED
    if upstream is None:
        upstream = await _open(conn, plan, head)
    first = plan.upstream_head(None if chunked else head.content_length, chunked=chunked)
    sent = len(prefix)
    progress = conn.progress
    assert progress is not None
    try:
        await _send_upstream(
            conn, upstream, first + (http1.encode_chunk(prefix) if chunked else prefix)
        )
        while not reader.done:
            data = await conn._receive_body()
            try:
                if not data:
                    reader.feed_eof()
                piece = reader.feed(data)
            except HttpProtocolError as exc:
                raise Refused(conn.bad_body(exc)) from None
            sent += len(piece)
            if sent > limit:
                raise Refused(conn.too_large(limit))
            if piece:
                await _send_upstream(
                    conn, upstream, http1.encode_chunk(piece) if chunked else piece
                )
        if chunked:
            last = http1.LAST_CHUNK
            if reader.trailers and upstream.multiplexed:
                last = section(relayable(reader.trailers, request=True))
            await _send_upstream(conn, upstream, last)
        conn.buffer[:0] = reader.take_leftover()
        progress.body_consumed = True
        progress.bytes_up = sent
        response = await _read_response_head(
            conn, plan, upstream, head.method, time.monotonic() + conn.limits.read_timeout
        )
    except _UpstreamBroken as exc:
        raise Refused(_upstream_closed(plan, upstream, exc)) from None
    return upstream, response


def _upstream_closed(
    plan: Forward, upstream: UpstreamConnection | None = None, exc: Exception | None = None
) -> Refuse:
    # An HTTP/2 stream says why it ended (a reset, a GOAWAY, a limit of the connection).
    why = f" ({exc})" if upstream is not None and upstream.multiplexed and str(exc) else ""
    return plan.request.refused(
        502,
        "upstream_failed",
        f"{plan.host} closed the connection{why}",
        rule="upstream_closed",
        close=True,
    )


def _protocol_error(plan: Forward, exc: HttpProtocolError) -> Refuse:
    return plan.request.refused(
        502,
        "upstream_failed",
        f"{plan.host} sent a malformed response: {exc}",
        rule="upstream_protocol_error",
        close=True,
    )


async def _receive_upstream(
    conn: ClientConnection,
    upstream: UpstreamConnection,
    phase: Phase,
    deadline: float,
    *,
    answer_pending: bool = False,
) -> bytes:
    try:
        return await conn._receive(upstream.stream, phase, deadline, answer_pending=answer_pending)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise _UpstreamBroken(str(exc)) from None


async def _read_response_head(
    conn: ClientConnection,
    plan: Forward,
    upstream: UpstreamConnection,
    method: bytes,
    deadline: float,
) -> http1.ResponseHead:
    """The final response head (interim 1xx responses are read and dropped)."""
    if isinstance(upstream.stream, H2Stream):
        return await _take_h2_response_head(conn, plan, upstream.stream, deadline)
    buffer = upstream.buffer
    http_limits = conn.runtime.http_limits
    stream = upstream.stream
    answer_pending = True  # the request was just sent: do not try the kernel before waiting
    while True:
        if buffer:
            try:
                parsed = http1.parse_response_head(buffer, http_limits, request_method=method)
            except HttpProtocolError as exc:
                raise Refused(_protocol_error(plan, exc)) from None
            if parsed is not None:
                response, consumed = parsed
                del buffer[:consumed]
                if 100 <= response.status < 200:
                    if response.status == 101:
                        raise Refused(
                            _protocol_error(plan, HttpProtocolError("unexpected 101 response"))
                        )
                    continue  # interim (100 Continue, 103 Early Hints): not relayed
                return response
        try:
            data = await conn._receive(
                stream, Phase.UPSTREAM, deadline, answer_pending=answer_pending
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _UpstreamBroken(str(exc)) from None
        answer_pending = False
        if not data:
            if buffer:
                closed = HttpProtocolError("closed inside a response head")
                raise Refused(_protocol_error(plan, closed))
            raise _UpstreamBroken("closed before a response")
        buffer += data


async def _take_h2_response_head(
    conn: ClientConnection, plan: Forward, stream: H2Stream, deadline: float
) -> http1.ResponseHead:
    """An HTTP/2 upstream stream's response head, which the stream read with the same parser
    as it arrived (no interim responses reach it: proxycore/protocol/http2/outbound.py)."""
    while True:
        try:
            response = stream.take_response()
        except HttpProtocolError as exc:
            raise Refused(_protocol_error(plan, exc)) from None
        except trio.BrokenResourceError as exc:
            raise _UpstreamBroken(str(exc)) from None
        if response is not None:
            return response
        conn.phase = Phase.UPSTREAM
        conn.deadline = deadline
        await stream.wait_readable()


# -- the response -------------------------------------------------------------------------------


async def _relay_stream(
    conn: ClientConnection,
    plan: Forward,
    head: http1.RequestHead,
    decided: ResponsePlan,
    upstream: UpstreamConnection,
    response: http1.ResponseHead,
) -> bool:
    progress = conn.progress
    assert progress is not None
    scrubber = conn.runtime.scrubbers.current
    content_type = response.get(b"content-type")
    # gRPC: each message scrubbed whole as it completes, never held back (grpc.py).
    messages = (
        MessageScrubber(scrubber, conn.limits.max_body_bytes, conn.crew.buffered)
        if is_grpc(content_type)
        else None
    )
    inner: Filter
    if messages is not None:
        inner = messages
    elif is_event_stream(content_type):
        inner = SseScrubber(scrubber)
    else:
        inner = scrubber.stream()
    # Markers in and out (of the decoded body): their difference is what was redacted.
    counted = _Counted(inner)
    body: Filter = counted
    if decided.coding is not None or (messages is None and sniffable(content_type)):
        body = Recoder(decided.coding, counted)
    reader = http1.BodyReader.for_response(response, conn.runtime.http_limits)
    buffer = upstream.buffer
    rechunk = decided.rechunk
    send_all = conn.stream.send_all
    read_timeout = conn.limits.read_timeout
    # What already arrived is decoded before the head goes out, so framing that is broken from
    # the start is answered 502 rather than cut off after a 200.
    first = bytes(buffer)
    buffer.clear()
    if not first:
        first = upstream.stream.try_receive(RECV_SIZE) or b""
    try:
        piece = reader.feed(first) if first else b""
    except HttpProtocolError as exc:
        raise Refused(_protocol_error(plan, exc)) from None
    out = decided.head()
    ended = "complete"
    try:
        while True:
            if piece:
                # An SSE event comes out with the read that completed it, unless its last
                # bytes could begin a secret (native/scrub_reference.py: the hold-back rule),
                # or its text could (sse_scrub.py).
                piece = body.feed(piece)
            if reader.done:
                piece += body.flush()
            if piece:
                progress.bytes_down += len(piece)
                out += http1.encode_chunk(piece) if rechunk else piece
            if reader.done:
                if rechunk:
                    out += _last_chunk(conn, head, reader)
                conn.response_started = True
                await send_all(out)
                break
            if out:
                conn.response_started = True
                await send_all(out)
                out = bytearray()
            # Each piece re-arms the deadline: a slow stream is fine, a silent one is not.
            data = await _receive_upstream(
                conn, upstream, Phase.RELAY, time.monotonic() + read_timeout
            )
            if data:
                piece = reader.feed(data)
            else:
                reader.feed_eof()
                piece = b""
    except HttpProtocolError as exc:
        if not conn.response_started:
            # Nothing went out yet (a compressed body that does not decode, a bomb in the
            # first read): a 502 the agent can read.
            raise Refused(_protocol_error(plan, exc)) from None
        ended = f"upstream_protocol_error: {exc}"
    except _UpstreamBroken as exc:
        ended = f"upstream_closed: {exc}"
    finally:
        if messages is not None:
            messages.release()
    progress.redactions = counted.redactions
    if ended != "complete":
        # Too late for a refusal: the agent sees the connection end without the last chunk
        # (or short of its length), which every HTTP client reads as a truncated response.
        upstream.close()
        conn.upstream = None
        conn.emit_allowed(decided.status, ended)
        return False
    leftover = reader.take_leftover()
    _release(conn, upstream, decided.reusable and not leftover)
    conn.emit_allowed(decided.status)
    return decided.keep_client


def _last_chunk(conn: ClientConnection, head: http1.RequestHead, reader: http1.BodyReader) -> bytes:
    """The end of a re-chunked response: with the upstream's trailer fields, scrubbed, when
    the agent takes trailers (RFC 9110 6.5.1: otherwise they are dropped)."""
    if reader.trailers and accepts_trailers(head):
        fields = relayable(reader.trailers, request=False)
        if fields:
            return scrubbed_section(fields, conn.runtime.scrubbers.current)
    return http1.LAST_CHUNK


def _release(conn: ClientConnection, upstream: UpstreamConnection, reusable: bool) -> None:
    """After a complete exchange: back to the crew's pool if it can carry another, else closed."""
    conn.upstream = None
    if not (reusable and conn.runtime.dialer.checkin(upstream)):
        upstream.close()
