"""A gRPC request through the forward path: its body up as it comes, the response down meanwhile.

Theory of operation: the connection (proxycore/io/connection.py) carries a Forward plan out here
instead of in proxycore/io/forward.py when the request's body is chunked and its content-type is
gRPC's (`takes_duplex`). A gRPC body is a stream of messages the server may answer one by
one (bidirectional streaming), so it cannot be read whole (or held back to be replayable)
before the response begins. On an HTTP/2 upstream (proxycore/io/upstream_h2.py), `serve_duplex`
sends the head, then one task (`_pump_body`) writes the body to the stream as it arrives while
this one reads the response and relays it (forward.py `relay_response`, each message scrubbed
whole by proxycore/protocol/grpc.py); RFC 9113 8.1 lets either side stream while the other does.
A failure of the body's side ends the upstream stream only, which the response side then sees.
On an HTTP/1.1 upstream the body takes forward.py's streaming path, as any long body does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import trio

from proxycore.errors import HttpProtocolError
from proxycore.io import forward
from proxycore.io.progress import RECV_SIZE, Refused
from proxycore.io.upstream_h2_stream import H2Stream
from proxycore.protocol import http1
from proxycore.protocol.grpc import is_grpc
from proxycore.protocol.plans import Forward
from proxycore.protocol.trailers import relayable, section

if TYPE_CHECKING:
    from proxycore.io.connection import ClientConnection

__all__ = ["serve_duplex", "takes_duplex"]


def takes_duplex(head: http1.RequestHead) -> bool:
    """Whether a Forward plan for `head` is served here: a gRPC request with a chunked body."""
    return head.body_kind is http1.BodyKind.CHUNKED and is_grpc(head.get(b"content-type"))


async def serve_duplex(conn: ClientConnection, plan: Forward, head: http1.RequestHead) -> bool:
    """A gRPC request: its body is a stream of messages the server may answer one by one
    (bidirectional streaming), so on an HTTP/2 upstream the body goes up as it comes while the
    response comes down (RFC 9113 8.1 lets either side stream while the other does); never
    held back to be replayable. On an HTTP/1.1 upstream: the streaming path as for any body.
    Returns whether the agent's connection stays open (as forward.py `serve_forward`)."""
    progress = conn.progress
    assert progress is not None
    if plan.provider is not None:
        progress.rule = "provider"
    reader = http1.BodyReader.for_request(head, conn.runtime.http_limits)
    if plan.expect_continue:
        await conn.stream.send_all(forward.CONTINUE)
    upstream = await forward._open(conn, plan, head)
    if not isinstance(upstream.stream, H2Stream):
        upstream_, response = await forward._send_streaming(conn, plan, head, reader, b"", upstream)
        return await forward.relay_response(conn, plan, head, upstream_, response)
    try:
        await forward._send_upstream(conn, upstream, plan.upstream_head(None, chunked=True))
    except forward._UpstreamBroken as exc:
        raise Refused(forward._upstream_closed(plan, upstream, exc)) from None
    failure: Exception | None = None
    keep = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_pump_body, conn, upstream.stream, reader)
        try:
            try:
                response = await forward._read_response_head(
                    conn, plan, upstream, head.method, time.monotonic() + conn.limits.read_timeout
                )
            except forward._UpstreamBroken as exc:
                raise Refused(forward._upstream_closed(plan, upstream, exc)) from None
            keep = await forward.relay_response(conn, plan, head, upstream, response)
        except Exception as exc:
            # Raised outside the nursery, as it is (a refusal, the agent gone...): never
            # wrapped in a group the connection would not recognize.
            failure = exc
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    # An HTTP/1.1 agent whose body was not read to its end cannot send another request.
    return keep and progress.body_consumed


async def _pump_body(conn: ClientConnection, stream: H2Stream, reader: http1.BodyReader) -> None:
    """The agent's request body to the upstream stream as it arrives (within `max_body_bytes`);
    a failure ends the upstream stream (the response side then sees it), never more."""
    progress = conn.progress
    assert progress is not None
    limit = conn.limits.max_body_bytes
    sent = 0
    try:
        while not reader.done:
            if conn.buffer:
                data = bytes(conn.buffer)
                conn.buffer.clear()
            else:
                data = await conn.stream.receive(RECV_SIZE)
            if not data:
                reader.feed_eof()
            piece = reader.feed(data)
            sent += len(piece)
            progress.bytes_up = sent
            if sent > limit:
                raise HttpProtocolError(f"request body over {limit} bytes")
            if piece:
                await stream.send_all(http1.encode_chunk(piece))
        trailers = relayable(reader.trailers, request=True)
        await stream.send_all(section(trailers) if trailers else http1.LAST_CHUNK)
        conn.buffer[:0] = reader.take_leftover()
        progress.body_consumed = True
    except HttpProtocolError as exc:
        stream.abort(f"request body: {exc}")
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        stream.abort(f"request body: {exc}")
