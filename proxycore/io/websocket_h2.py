"""WebSocket over an HTTP/2 stream from the agent (RFC 8441 extended CONNECT).

Theory of operation
-------------------
`H2Session` (proxycore/io/http2.py) serves a stream whose request is an extended CONNECT with a
`WebSocketPipe` instead of a plain `StreamPipe`, fed the head `stream_head` writes: the
HTTP/1.1 handshake (proxycore/protocol/http2/websocket.py), with a Sec-WebSocket-Key the proxy
makes. The stream's `ClientConnection` then serves it as it serves any HTTP/1.1 handshake:
`plan_request` (journal, name policy, injection on a provider host), `serve_websocket`
(proxycore/io/websocket.py: a fresh upstream dialled through the SSRF guard, the HTTP/1.1
Upgrade, the upstream's 101 checked against RFC 6455 4.1, then the frame relay with its
backpressure, deadlines, limits and scrubber, and one terminal event with the session's counts).

The pipe translates where a stream differs from a socket:

- The response. The 101 the exchange writes to the agent becomes `:status 200` on the stream
  (RFC 8441 5), without END_STREAM, with the 101's fields (already scrubbed) minus those HTTP/2
  forbids and the Accept (not used over HTTP/2). Any other response (a refusal, an upstream's
  ordinary answer) goes out as on every stream, and ends it.
- After the 200, what the relay writes (WebSocket frames) goes out as DATA within the agent's
  flow-control windows, stream and connection: while they are closed the relay's writer waits,
  so it reads no more from the upstream (backpressure reaches the upstream's TCP), and a window
  closed for longer than `stall_timeout` resets the stream. What the relay reads is the stream's
  DATA, acknowledged to the agent only as the relay takes it: the proxy holds at most the stream
  window of the agent's frames. END_STREAM from the agent reads as its end of stream (a TCP FIN,
  RFC 8441 5).
- The end (RFC 8441 5). Once the agent was sent its Close (the close handshake, or a Close the
  proxy sent for a limit, an error or a deadline) and it all went out, the stream ends with
  END_STREAM; the agent's own END_STREAM is left to the agent (what it still sends is
  discarded). Otherwise (the agent reset the stream, the connection broke, the agent ended its
  stream without a Close, a write was cut) RST_STREAM CANCEL. A stream's end never touches its
  siblings.

DATA the agent sends before the 200 waits within the stream window and is relayed after the
switch, as bytes behind an HTTP/1.1 handshake are; if the handshake is refused it is dropped with
the stream (RST_STREAM NO_ERROR after the response, RFC 9113 8.1).
"""

from __future__ import annotations

import base64
import os
from typing import TYPE_CHECKING

import trio

from proxycore.errors import HttpProtocolError
from proxycore.io.h2_stream import StreamPipe
from proxycore.protocol import http1
from proxycore.protocol.http2 import ErrorCode, RequestReceived, response_fields
from proxycore.protocol.http2.websocket import websocket_head

if TYPE_CHECKING:
    from proxycore.io.http2 import H2Session

__all__ = ["WebSocketPipe", "stream_head"]

# Not carried into the 200: RFC 8441 5 (no Accept over HTTP/2).
_SWITCH_DROP = frozenset({b"sec-websocket-accept"})


def stream_head(request: RequestReceived, gateway: str, *, origin_form: bool = False) -> bytes:
    """The HTTP/1.1 handshake for an extended CONNECT stream, with a fresh key (RFC 6455 4.1:
    16 random bytes, base64). Raises MessageRefused."""
    key = base64.b64encode(os.urandom(16))
    return websocket_head(request, gateway, key, origin_form=origin_form)


class WebSocketPipe(StreamPipe):
    """An extended CONNECT stream as the byte stream of an HTTP/1.1 WebSocket connection (see
    the module docstring)."""

    __slots__ = ("_cut", "_switched")

    def __init__(self, session: H2Session, stream_id: int, method: bytes = b"GET") -> None:
        # The exchange's request is the HTTP/1.1 handshake: a GET, whatever the stream's method.
        super().__init__(session, stream_id, b"GET")
        self._switched = False  # the 200 went out: bytes written are frames
        self._cut = False  # a write of frames did not finish

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._switched:
            if self.broken is not None:
                raise trio.BrokenResourceError(self.broken)
            if data:
                self._cut = True
                await self._data(bytes(data), end=False)
                self._cut = False
            return
        if self._reader is None and not self._done and await self._switch(data):
            return
        await super().send_all(data)

    async def _switch(self, data: bytes | bytearray | memoryview) -> bool:
        """If `data` completes a 101, answer 200 and switch; False: an ordinary response."""
        buffered = bytes(self._out) + bytes(data)
        try:
            parsed = http1.parse_response_head(
                buffered, self._session.runtime.http_limits, request_method=b"GET"
            )
        except HttpProtocolError:
            return False  # StreamPipe reads it again and resets the stream
        if parsed is None or parsed[0].status != 101:
            return False
        head, used = parsed
        self._out.clear()
        fields = [(n, v) for n, v in response_fields(head) if n not in _SWITCH_DROP]
        await self._headers(200, fields, end=False)
        self._switched = True
        if used < len(buffered):
            await self.send_all(buffered[used:])
        return True

    def session_ended(self, in_order: bool) -> None:
        """The relay is over (io/websocket.py `SessionCarrier`): END_STREAM if the agent was
        sent its Close whole, else RST_STREAM CANCEL (RFC 8441 5)."""
        server = self._session.server
        if self._done:
            return
        orderly = in_order and self._switched and not self._cut and self.broken is None
        if orderly and server.end_stream(self.stream_id):
            self._done = True
        else:
            server.reset(self.stream_id, ErrorCode.CANCEL)
        self._session.kick()

    def close(self) -> None:
        if self._switched and self._done:
            # Ended in order: the agent's END_STREAM is the agent's to send (RFC 8441 5);
            # the connection discards what it still sends on the stream.
            self._closing = True
            self._session.kick()
            return
        super().close()
