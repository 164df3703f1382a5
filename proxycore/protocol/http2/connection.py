"""The server side of one HTTP/2 connection: our own sans-IO core (endpoint.py) as the agent
sees it.

Theory of operation
-------------------
`H2Server` is sans-IO like the HTTP/1.1 parser: the adapter (proxycore/io/http2.py) feeds it the
bytes the client sent (`receive_data`), gets back our own events (`events.py`), calls commands
(`send_headers`, `send_data`, `reset`, `acknowledge`...) and writes out `data_to_send()`. A
connection error raises `Http2ConnectionError` (the connection must end; a GOAWAY is queued); a
command on a stream the client already closed or reset is a no-op (RFC 9113 5.1 forbids most
frames on a closed stream, so we never send them).

What both sides share is in `endpoint.H2Endpoint`: the frames, their accounting against the
limits (limits.py), flow control, the stream states. On this side the client's resets are
counted too (rapid reset, CVE-2023-44487), a client opens odd, increasing stream identifiers
(RFC 9113 5.1.1) and at most `max_concurrent_streams` at once (beyond: PROTOCOL_ERROR, as RFC
9113 5.1.2 allows), and a request head is read here (`_request`): its pseudo-header fields
(RFC 9113 8.3.1), extended CONNECT's :protocol (RFC 8441 4). A malformed request is a stream
error answered 400 by the adapter (RFC 9113 8.1.1), never a connection error that would end its
sibling streams; messages.py checks the fields themselves.

Flow control: a stream's request body is acknowledged (`acknowledge`) only once the adapter has
consumed it, so what the proxy holds never exceeds the windows it advertised (a stream's
`initial_stream_window`, a connection's `connection_window`). What the client does not consume
of a stream that ends (reset, refused) is credited back to the connection window.

A graceful GOAWAY (stream identifiers used up, the proxy stopping, an idle connection) leaves
the open streams to finish; only a GOAWAY with an error closes the connection at once.
"""

from __future__ import annotations

import base64
import binascii

from proxycore.errors import Http2ConnectionError
from proxycore.protocol.http2.endpoint import Fields, H2Endpoint, Stream, advertised_settings
from proxycore.protocol.http2.events import (
    ConnectionEnded,
    H2Event,
    RequestReceived,
    StreamEnded,
    StreamReset,
)
from proxycore.protocol.http2.fields import CONNECTION_SPECIFIC, well_formed
from proxycore.protocol.http2.frames import ErrorCode, Setting, data_frame, goaway_frame
from proxycore.protocol.http2.hpack_out import SENSITIVE
from proxycore.protocol.http2.limits import H2Limits
from proxycore.protocol.http2.messages import decided_fields

__all__ = ["PREFACE", "ErrorCode", "H2Server", "preface_state"]

# RFC 9113 3.4: the client connection preface.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Request pseudo-header fields (RFC 9113 8.3.1, RFC 8441 4); response fields HTTP/2 forbids
# (fields.py), and never TE.
_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path", b":protocol"})
_CONNECTION_SPECIFIC = CONNECTION_SPECIFIC | {b"te"}


class H2Server(H2Endpoint):
    """One HTTP/2 server connection (see the module docstring)."""

    # The client's resets are rate limited (rapid reset, CVE-2023-44487).
    _COUNT_RESETS = True
    _PEER = "client"

    def __init__(self, limits: H2Limits) -> None:
        super().__init__(limits)
        self._preface_seen = False
        # Streams whose final response head went out.
        self._responded: set[int] = set()
        # After a graceful GOAWAY: the last stream served; higher ones are refused.
        self._last_stream: int | None = None

    # -- starting -------------------------------------------------------------------------------

    def initiate(self) -> None:
        """Queue the server preface: SETTINGS, and the connection window (RFC 9113 6.9.2)."""
        self._started = True
        limits = self.limits
        self._preface(
            {
                Setting.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                **advertised_settings(limits),
                # RFC 8441 3: extended CONNECT (WebSocket over a stream, websocket.py).
                Setting.ENABLE_CONNECT_PROTOCOL: int(limits.extended_connect),
            }
        )

    def initiate_upgrade(self, settings_header: bytes) -> None:
        """`Upgrade: h2c` (RFC 7540 3.2): stream 1 is the request that asked, half closed; the
        client's preface follows the 101. Raises Http2ConnectionError on a bad HTTP2-Settings
        (base64url of a SETTINGS payload, RFC 7540 3.2.1)."""
        self.initiate()
        try:
            payload = base64.urlsafe_b64decode(settings_header)
            if len(payload) % 6:
                raise ValueError("not a SETTINGS payload")
            for at in range(0, len(payload), 6):
                code = int.from_bytes(payload[at : at + 2], "big")
                self._apply_setting(code, int.from_bytes(payload[at + 2 : at + 6], "big"))
        except (binascii.Error, ValueError, Http2ConnectionError) as exc:
            raise Http2ConnectionError(
                f"bad HTTP2-Settings: {exc}", error_code=ErrorCode.PROTOCOL_ERROR, rule="h2_upgrade"
            ) from None
        stream = self._new_stream(1)
        stream.head_received = stream.remote_closed = True
        self._highest_inbound = 1
        self._live.add(1)
        self._unacked[1] = 0

    # -- input ----------------------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float) -> list[H2Event]:
        """Feed bytes from the client; returns what happened. Raises Http2ConnectionError when
        the connection must end (a GOAWAY is queued in data_to_send())."""
        if self.closed:
            return []
        if not self._started:
            self.initiate()
        buffer = self._buffer
        buffer += data
        events: list[H2Event] = []
        if not self._preface_seen:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    self._fail("not an HTTP/2 connection preface", ErrorCode.PROTOCOL_ERROR, "h2")
                return events
            if buffer[: len(PREFACE)] != PREFACE:
                self._fail("not an HTTP/2 connection preface", ErrorCode.PROTOCOL_ERROR, "h2")
            self._preface_seen = True
            del buffer[: len(PREFACE)]
        self._receive_frames(events, now)
        return events

    def _on_header_block(
        self, stream_id: int, fields: Fields, end_stream: bool, events: list[H2Event]
    ) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._trailers(stream_id, fields, end_stream, events)
            return
        if stream_id % 2 == 0:
            self._protocol_error("a client stream with an even identifier")  # RFC 9113 5.1.1
        if stream_id <= self._highest_inbound:
            if stream_id in self._reset_streams:
                return  # trailers sent before the client saw our reset
            # RFC 9113 5.1: a closed stream (or one skipped, closed implicitly) is not reopened.
            self._fail("HEADERS on a closed stream", ErrorCode.STREAM_CLOSED, "h2_protocol_error")
        if len(self._streams) >= self.limits.max_concurrent_streams:
            self._fail(
                f"more than {self.limits.max_concurrent_streams} concurrent streams",
                ErrorCode.PROTOCOL_ERROR,
                "h2_max_concurrent_streams",
            )
        self._highest_inbound = stream_id
        stream = self._new_stream(stream_id)
        stream.head_received = True
        request = self._request(stream_id, fields, end_stream)
        if request is None:
            return
        for name, value in request.headers:
            if name == b"content-length":
                if value.isdigit():
                    stream.expected_length = int(value)
                break
        self._live.add(stream_id)
        self._unacked[stream_id] = 0
        events.append(request)
        if end_stream:
            if stream.expected_length:
                self._stream_error(
                    stream_id, ErrorCode.PROTOCOL_ERROR, "no body, and a content-length", events
                )
                return
            self._remote_end(stream_id, stream)
            events.append(StreamEnded(stream_id))

    def _trailers(
        self, stream_id: int, fields: Fields, end_stream: bool, events: list[H2Event]
    ) -> None:
        """A second header block on a stream: request trailers (RFC 9113 8.1), relayed to an
        HTTP/2 upstream (proxycore/protocol/trailers.py); StreamEnded follows."""
        stream = self._streams[stream_id]
        if stream.remote_closed:
            self._stream_error(
                stream_id, ErrorCode.STREAM_CLOSED, "HEADERS after END_STREAM", events
            )
            return
        if not end_stream:
            # RFC 9113 8.1: a trailer section ends the stream, else the request is malformed.
            self._stream_error(
                stream_id, ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM", events
            )
            return
        trailers = tuple((n, v) for n, v in fields if n[:1] != b":")
        self._end_with_trailers(stream_id, stream, trailers, events)

    def _on_peer_reset(self, stream_id: int, code: int, events: list[H2Event]) -> None:
        if self._end(stream_id):
            events.append(StreamReset(stream_id, code, by_peer=True))

    def _on_goaway_received(self, last_stream_id: int, code: int, events: list[H2Event]) -> None:
        # The client goes away: nothing more is sent on this connection.
        self._out.clear()
        self.closed = True
        events.append(ConnectionEnded(code, last_stream_id))

    def _request(self, stream_id: int, headers: Fields, ended: bool) -> RequestReceived | None:
        limits = self.limits
        if stream_id > limits.max_stream_id or (
            self._last_stream is not None and stream_id > self._last_stream
        ):
            self._graceful_goaway(self._last_stream or max(self._live, default=0))
            self._reset(stream_id, ErrorCode.REFUSED_STREAM)
            return None
        if stream_id >= limits.max_stream_id - 1 and self._last_stream is None:
            # No client stream identifier is left after this one (RFC 9113 5.1.1): tell the
            # client to open a new connection for its next requests.
            self._graceful_goaway(stream_id)
        pseudo: dict[bytes, bytes] = {}
        regular: list[tuple[bytes, bytes]] = []
        malformed = ""
        for name, value in headers:
            if name[:1] == b":":
                # RFC 9113 8.3: known pseudo-headers, each once, before the regular fields.
                if name not in _PSEUDO or name in pseudo or regular:
                    malformed = malformed or f"pseudo-header {name[:32]!r} not allowed here"
                pseudo[name] = value
            else:
                regular.append((name, value))
        method = pseudo.get(b":method", b"")
        if method == b"CONNECT" and b":protocol" not in pseudo:
            # RFC 9113 8.5: :authority only.
            if b":scheme" in pseudo or b":path" in pseudo or b":authority" not in pseudo:
                malformed = malformed or "CONNECT with :scheme or :path, or without :authority"
        elif not (method and pseudo.get(b":scheme") and pseudo.get(b":path")):
            malformed = malformed or "a request without :method, :scheme or :path"
        if b":protocol" in pseudo and (method != b"CONNECT" or not self.limits.extended_connect):
            # RFC 8441 4: :protocol only on CONNECT, and only once the setting was advertised.
            malformed = malformed or ":protocol without CONNECT or SETTINGS_ENABLE_CONNECT_PROTOCOL"
        authority = pseudo.get(b":authority")
        if authority is None:
            authority = next((v for n, v in regular if n == b"host"), b"")
        return RequestReceived(
            stream_id=stream_id,
            method=method,
            scheme=pseudo.get(b":scheme", b""),
            authority=authority,
            path=pseudo.get(b":path", b""),
            headers=tuple(regular),
            ended=ended,
            protocol=pseudo.get(b":protocol", b""),
            malformed=malformed,
        )

    # -- commands -------------------------------------------------------------------------------

    @property
    def live_streams(self) -> int:
        return len(self._live)

    def send_headers(
        self, stream_id: int, status: int, headers: list[tuple[bytes, bytes]], *, end: bool
    ) -> bool:
        """The response head (or an interim 1xx one, RFC 9113 8.1); False when the stream is
        gone or the head is not one the client may receive now (a second final head, an
        interim one after it or with END_STREAM, 101). Fields HTTP/2 forbids are dropped."""
        stream = self._head_stream(stream_id, status, end)
        if stream is None:
            return False
        self._send_head(stream_id, stream, response_head_fields(status, headers), end)
        self._headed(stream_id, status, end)
        return True

    def send_decided_head(
        self,
        stream_id: int,
        status: int,
        start: bytes,
        content_length: int | None,
        *,
        closes: bool,
        end: bool,
    ) -> bool:
        """`send_headers` for a final head the exchange decided (`messages.decided_fields` of
        its `ResponsePlan.start`): the same frames, the HPACK block taken from a bounded
        process-wide cache when the same head was sent before (a busy upstream answers many
        streams with the same head within a second; building and encoding its fields was a
        tenth of what a small response costs this side)."""
        stream = self._head_stream(stream_id, status, end)
        if stream is None:
            return False
        key = (status, start, content_length, closes)
        block = _decided_blocks.get(key)
        if block is None:
            fields = response_head_fields(
                status, decided_fields(start, content_length, closes=closes)
            )
            block = self._encoder.encode(fields)
            if len(start) <= _DECIDED_START_BYTES and not any(
                name in SENSITIVE for name, _ in fields
            ):
                if len(_decided_blocks) >= _DECIDED_LIMIT:
                    _decided_blocks.clear()
                _decided_blocks[key] = block
        self._send_block(stream_id, stream, block, end)
        self._headed(stream_id, status, end)
        return True

    def _head_stream(self, stream_id: int, status: int, end: bool) -> Stream | None:
        """The stream a head with `status` may be sent on now, or None (see `send_headers`)."""
        if stream_id not in self._live or stream_id in self._responded or self.closed:
            return None
        interim = 100 <= status < 200
        if not 100 <= status <= 999 or status == 101 or (interim and end):
            return None
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_closed:
            return None
        return stream

    def _headed(self, stream_id: int, status: int, end: bool) -> None:
        if not 100 <= status < 200:
            self._responded.add(stream_id)
        if end:
            self._end(stream_id)

    def send_data(self, stream_id: int, data: bytes | memoryview, *, end: bool) -> int:
        """Send as much of `data` as the windows allow (one frame); returns the bytes taken.
        `end` ends the stream once all of `data` went. -1: the stream is gone."""
        window = self.send_window(stream_id)
        if stream_id not in self._live or stream_id not in self._responded:
            return -1  # gone, or no final head yet (RFC 9113 8.1: DATA follows it)
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_closed or self.closed:
            return -1
        take = min(len(data), window)
        if take == 0 and (data or not end):
            return 0
        last = end and take == len(data)
        self._send_data(stream_id, stream, bytes(data[:take]), last)
        if last:
            self._end(stream_id)
        return take

    def end_stream(self, stream_id: int) -> bool:
        """END_STREAM (an empty DATA frame); False when the stream is gone."""
        if stream_id not in self._live or stream_id not in self._responded:
            return False
        stream = self._streams.get(stream_id)
        sent = stream is not None and not stream.local_closed and not self.closed
        if sent:
            assert stream is not None
            self._out += data_frame(stream_id, b"", end=True)
            self._local_end(stream_id, stream)
        self._end(stream_id)
        return sent

    def send_trailers(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> bool:
        """A trailer section ending the response (RFC 9113 8.1); fields HTTP/2 forbids are
        dropped. False when the stream is gone or has no final head yet."""
        if stream_id not in self._live or stream_id not in self._responded:
            return False
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_closed or self.closed:
            return False
        fields = [(n, v) for n, v in headers if n not in _CONNECTION_SPECIFIC and well_formed(n, v)]
        self._send_head(stream_id, stream, fields, True)
        self._end(stream_id)
        return True

    def stop_receiving(self, stream_id: int) -> None:
        """The response is complete and the request body is not wanted: RST_STREAM NO_ERROR
        (RFC 9113 8.1), unless the stream is closed already (the client ended its side)."""
        if stream_id in self._streams:
            self._reset(stream_id, ErrorCode.NO_ERROR)

    def reset(self, stream_id: int, code: int = ErrorCode.CANCEL) -> None:
        """RST_STREAM (only on a stream that is still open on our side)."""
        if stream_id in self._live:
            self._reset(stream_id, code)

    def graceful_goaway(self) -> None:
        """No new streams (the proxy is stopping, the connection idled): GOAWAY NO_ERROR, the
        open streams finish."""
        if not self.closed and self._last_stream is None:
            self._graceful_goaway(self._highest_inbound)

    # -- internals ------------------------------------------------------------------------------

    def _graceful_goaway(self, last_stream_id: int) -> None:
        if self._last_stream is not None or self.closed:
            return
        self._last_stream = last_stream_id
        self._out += goaway_frame(last_stream_id, ErrorCode.NO_ERROR)

    def _reset(self, stream_id: int, code: int) -> None:
        self._send_reset(stream_id, code)
        self._end(stream_id)

    def _end(self, stream_id: int) -> bool:
        self._responded.discard(stream_id)
        return super()._end(stream_id)


def response_head_fields(
    status: int, headers: list[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """A response head's fields as sent: :status first, then the fields HTTP/2 allows."""
    fields = [(b":status", b"%d" % status)]
    fields += [(n, v) for n, v in headers if n not in _CONNECTION_SPECIFIC and well_formed(n, v)]
    return fields


# `send_decided_head`'s cache: HPACK blocks by (status, start, content length, closes), for the
# process (the stateless encoder makes a block a function of the head alone, whatever the
# connection), emptied when full. Heads that carry a secret (hpack_out.SENSITIVE: cookies,
# credentials) are never kept, nor long ones.
_DECIDED_LIMIT = 256
_DECIDED_START_BYTES = 2048
_decided_blocks: dict[tuple[int, bytes, int | None, bool], bytes] = {}


def preface_state(buffer: bytes | bytearray) -> bool | None:
    """Whether `buffer` (where an HTTP/1.1 head would start) opens with the HTTP/2 client
    preface (RFC 9113 3.4, prior knowledge): True, False, or None while it is still a prefix."""
    if len(buffer) >= len(PREFACE):
        return buffer[: len(PREFACE)] == PREFACE
    return None if PREFACE.startswith(bytes(buffer)) else False
