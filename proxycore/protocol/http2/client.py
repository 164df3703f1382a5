"""The client side of one HTTP/2 connection to an upstream: our own sans-IO core (endpoint.py)
as an upstream sees it (the server side is `connection.H2Server`).

Theory of operation
-------------------
`H2Client` is sans-IO: the adapter (proxycore/io/upstream_h2.py) feeds it what the upstream
sent (`receive_data`), gets back our own events (`events.py`: `ResponseReceived`,
`DataReceived`, `TrailersReceived`, `StreamEnded`, `StreamReset`, `WindowOpened`,
`ConnectionEnded`...), calls commands (`open_stream`, `send_data`, `send_trailers`, `reset`,
`acknowledge`) and writes out `data_to_send()`. A connection error raises `Http2ConnectionError`
(the connection must end: a GOAWAY is queued); a command on a stream the upstream already closed
or reset is refused (never written, RFC 9113 5.1).

The upstream is not trusted more than an agent: every frame is counted as on the agent side
(`endpoint.H2Endpoint` holds that accounting for both), with the same limits (limits.py): one
header block's bytes and CONTINUATION frames (the 2024 CONTINUATION flood), SETTINGS and PING
floods (CVE-2019-9515, CVE-2019-9512), PRIORITY frames, frames with empty payloads
(CVE-2019-9518). The core enforces HPACK's decoded header list size (the HPACK bomb,
CVE-2016-6581; `max_header_list_size`), the frame size, and the receive windows we advertise: a
response body is acknowledged (`acknowledge`) only as the adapter hands it on, so what the proxy
holds of a stream never exceeds `initial_stream_window`, of a connection `connection_window`.
Server push is refused (SETTINGS_ENABLE_PUSH 0: a PUSH_PROMISE is a connection error, RFC 9113
8.4). Over a limit the connection ends with GOAWAY ENHANCE_YOUR_CALM. A response head whose
pseudo-header fields are wrong (RFC 9113 8.3.2: :status alone, first, three digits), or that
carries a connection-specific field (8.2.2), ends the connection with PROTOCOL_ERROR; the field
grammar is checked where the head is written as HTTP/1.1 (outbound.py: a stream the exchange
answers 502). A body whose length differs from the content-length is a stream error (8.1.1).

Streams: at most min(the upstream's SETTINGS_MAX_CONCURRENT_STREAMS, `max_concurrent_streams`)
open at once (`can_open`). A GOAWAY from the upstream (`ConnectionEnded`) stops new streams;
those above its last stream identifier were never processed (RFC 9113 6.8) and are reported
reset with `refused=True` (safe to send again), as are those reset with REFUSED_STREAM.
"""

from __future__ import annotations

from proxycore.protocol.http2.endpoint import Fields, H2Endpoint, advertised_settings
from proxycore.protocol.http2.events import (
    ConnectionEnded,
    H2Event,
    ResponseReceived,
    StreamEnded,
    StreamReset,
)
from proxycore.protocol.http2.fields import CONNECTION_SPECIFIC, well_formed
from proxycore.protocol.http2.frames import HEADERS, PUSH_PROMISE, ErrorCode, Setting
from proxycore.protocol.http2.limits import MAX_STREAM_ID, H2Limits

__all__ = ["H2Client", "RequestUnsendable"]

# RFC 9113 3.4: the client connection preface.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Request fields are checked (fields.py) before anything is encoded: a head refused halfway
# must not have been partly written.
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path"})


class RequestUnsendable(Exception):
    """Internal: a request head (or trailer section) that cannot be written as HTTP/2."""


class H2Client(H2Endpoint):
    """One HTTP/2 client connection (see the module docstring)."""

    # A PUSH_PROMISE carries a header block too (counted before it is refused, RFC 9113 8.4).
    _BLOCK_STARTS = frozenset({HEADERS, PUSH_PROMISE})
    _PEER_IS_CLIENT = False

    def __init__(self, limits: H2Limits) -> None:
        super().__init__(limits)
        self._reserved = 0  # streams promised to callers (`reserve`) not opened yet
        # The upstream's GOAWAY: its last stream identifier (None: none received).
        self.last_stream_id: int | None = None

    # -- starting -------------------------------------------------------------------------------

    def initiate(self) -> None:
        """Queue the client preface and SETTINGS, and the connection window (RFC 9113 6.9.2)."""
        if self._started:
            return
        self._started = True
        self._out += _PREFACE
        self._preface({**advertised_settings(self.limits), Setting.MAX_CONCURRENT_STREAMS: 0})

    # -- capacity -------------------------------------------------------------------------------

    @property
    def max_streams(self) -> int:
        """min(the upstream's SETTINGS_MAX_CONCURRENT_STREAMS, ours)."""
        return min(self._peer_max_streams, self.limits.max_concurrent_streams)

    @property
    def open_streams(self) -> int:
        return len(self._live) + self._reserved

    def can_open(self) -> bool:
        """Whether one more stream may be opened now (not going away, a stream identifier
        left, under the concurrency bound)."""
        if self.closed or self.last_stream_id is not None:
            return False
        highest = self._highest_outbound
        # RFC 9113 5.1.1: a client's identifiers are odd and increase; 2**31 - 1 is the last.
        if (highest + 2 if highest else 1) + 2 * self._reserved > MAX_STREAM_ID:
            return False
        return self.open_streams < self.max_streams

    def can_open_now(self) -> bool:
        """Whether a stream already reserved may be opened (not closed, no GOAWAY)."""
        return not self.closed and self.last_stream_id is None

    def reserve(self) -> None:
        """Count a stream that will be opened shortly (its head is being written)."""
        self._reserved += 1

    def unreserve(self) -> None:
        self._reserved = max(0, self._reserved - 1)

    # -- input ----------------------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float) -> list[H2Event]:
        """Feed bytes from the upstream; returns what happened. Raises Http2ConnectionError
        when the connection must end (a GOAWAY is queued in data_to_send())."""
        if self.closed:
            return []
        self.initiate()
        self._buffer += data
        events: list[H2Event] = []
        self._receive_frames(events, now)
        return events

    def _on_header_block(
        self, stream_id: int, fields: Fields, end_stream: bool, events: list[H2Event]
    ) -> None:
        stream = self._streams.get(stream_id)
        if stream is None:
            if self._is_idle(stream_id):
                self._protocol_error("HEADERS on a stream we never opened")
            if stream_id in self._reset_streams:
                return  # sent before the upstream saw our reset
            self._fail("HEADERS on a closed stream", ErrorCode.STREAM_CLOSED, "h2_protocol_error")
        if stream.remote_closed:
            self._stream_error(
                stream_id, ErrorCode.STREAM_CLOSED, "HEADERS after END_STREAM", events
            )
            return
        if stream.head_received:
            self._trailers(stream_id, fields, end_stream, events)
            return
        status, regular = self._response_fields(fields)
        if status < 200:
            # Informational (RFC 9113 8.1): dropped, as the HTTP/1.1 path drops them.
            if end_stream:
                self._protocol_error("END_STREAM on an informational response")
            return
        stream.head_received = True
        if stream.expected_length is None and status not in (204, 304):
            for name, value in regular:
                if name == b"content-length":
                    if not value.isdigit():
                        self._protocol_error("a content-length that is not a number")
                    stream.expected_length = int(value)
                    break
        if end_stream and stream.expected_length:
            self._stream_error(
                stream_id, ErrorCode.PROTOCOL_ERROR, "no body, and a content-length", events
            )
            return
        if end_stream:
            self._remote_end(stream_id, stream)
        if stream_id in self._live:
            events.append(ResponseReceived(stream_id, status, regular, end_stream))
            if end_stream:
                events.append(StreamEnded(stream_id))

    def _trailers(
        self, stream_id: int, fields: Fields, end_stream: bool, events: list[H2Event]
    ) -> None:
        """A trailer section (RFC 9113 8.1): it ends the stream and has no pseudo-headers."""
        if not end_stream:
            self._protocol_error("trailers without END_STREAM")
        for name, value in fields:
            self._check_regular(name, value)
        self._end_with_trailers(stream_id, self._streams[stream_id], fields, events)

    def _response_fields(self, fields: Fields) -> tuple[int, Fields]:
        """:status and the regular fields of a response head (RFC 9113 8.3.2): :status once,
        three digits, before the rest; no other pseudo-header; no connection-specific field."""
        status = 0
        regular: list[tuple[bytes, bytes]] = []
        for name, value in fields:
            if name[:1] == b":":
                if name != b":status" or status or regular:
                    self._protocol_error(f"pseudo-header {name[:32]!r} not allowed here")
                if len(value) != 3 or not value.isdigit():
                    self._protocol_error("a :status that is not three digits")
                status = int(value)
            else:
                self._check_regular(name, value)
                regular.append((name, value))
        if not status:
            self._protocol_error("a response without :status")
        return status, tuple(regular)

    def _check_regular(self, name: bytes, value: bytes) -> None:
        if not name or name[:1] == b":":
            self._protocol_error("an empty name or a pseudo-header in trailers")
        if name in CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            self._protocol_error("a connection-specific field (RFC 9113 8.2.2)")

    def _on_peer_reset(self, stream_id: int, code: int, events: list[H2Event]) -> None:
        if self._end(stream_id):
            refused = code == ErrorCode.REFUSED_STREAM
            events.append(StreamReset(stream_id, code, by_peer=True, refused=refused))

    def _on_goaway_received(self, last_stream_id: int, code: int, events: list[H2Event]) -> None:
        self.last_stream_id = last_stream_id
        # RFC 9113 6.8: streams above `last` were not processed: they may be sent again.
        for stream_id in sorted(self._live):
            if stream_id > last_stream_id:
                self._forget(stream_id)
                self._end(stream_id)
                events.append(
                    StreamReset(stream_id, code, by_peer=True, why="upstream GOAWAY", refused=True)
                )
        if code != ErrorCode.NO_ERROR:
            # An error GOAWAY: the connection is over, the rest cannot finish.
            self._out.clear()
            self.closed = True
            for stream_id in sorted(self._live):
                self._end(stream_id)
                events.append(StreamReset(stream_id, code, by_peer=True, why="upstream GOAWAY"))
        events.append(ConnectionEnded(code, last_stream_id))

    # -- commands -------------------------------------------------------------------------------

    def open_stream(self, fields: list[tuple[bytes, bytes]], *, end: bool) -> int:
        """Send a request head (pseudo-headers first); returns its stream identifier. Raises
        RequestUnsendable for fields HTTP/2 cannot carry (checked before anything is encoded)."""
        _check_fields(fields, pseudo=_REQUEST_PSEUDO)
        if self.closed or self.last_stream_id is not None:
            raise RequestUnsendable("the connection is going away")
        self.initiate()
        highest = self._highest_outbound
        stream_id = highest + 2 if highest else 1
        if stream_id > MAX_STREAM_ID:
            raise RequestUnsendable("no stream identifier left (RFC 9113 5.1.1)")
        if len(self._streams) >= self._peer_max_streams:
            raise RequestUnsendable("the upstream's SETTINGS_MAX_CONCURRENT_STREAMS")
        self._highest_outbound = stream_id
        stream = self._new_stream(stream_id)
        if (b":method", b"HEAD") in fields:
            stream.expected_length = 0  # RFC 9110 9.3.2: no content, whatever content-length says
        self._send_head(stream_id, stream, fields, end)
        self.unreserve()
        self._live.add(stream_id)
        self._unacked[stream_id] = 0
        return stream_id

    def send_data(self, stream_id: int, data: bytes | memoryview, *, end: bool) -> int:
        """Send as much of `data` as the windows allow (one frame); the bytes taken, -1 when
        the stream is gone. `end` ends our side once all of `data` went."""
        if stream_id not in self._live:
            return -1
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_closed or self.closed:
            return -1
        take = min(len(data), self.send_window(stream_id))
        if take == 0 and (data or not end):
            return 0
        self._send_data(stream_id, stream, bytes(data[:take]), end and take == len(data))
        return take

    def send_trailers(self, stream_id: int, fields: list[tuple[bytes, bytes]]) -> bool:
        """A trailer section, ending our side (RFC 9113 8.1); False when the stream is gone."""
        _check_fields(fields, pseudo=frozenset())
        if stream_id not in self._live:
            return False
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_closed or self.closed:
            return False
        self._send_head(stream_id, stream, fields, True)
        return True

    def reset(self, stream_id: int, code: int = ErrorCode.CANCEL) -> None:
        """RST_STREAM, if the stream is still open (never on a closed one, RFC 9113 5.1)."""
        if stream_id in self._live:
            self._send_reset(stream_id, code)
            self._end(stream_id)

    def finish(self, stream_id: int) -> None:
        """The stream is over for the adapter (its response was read whole): forget it; a
        stream the upstream has not closed is reset (NO_ERROR: nothing went wrong)."""
        if stream_id in self._live:
            self._send_reset(stream_id, ErrorCode.NO_ERROR)
            self._end(stream_id)

    def goaway(self, code: int = ErrorCode.NO_ERROR) -> None:
        if self.closed:
            return
        super().goaway(code)
        self._live.clear()


def _check_fields(fields: list[tuple[bytes, bytes]], *, pseudo: frozenset[bytes]) -> None:
    regular = False
    for name, value in fields:
        if name[:1] == b":":
            if name not in pseudo or regular:
                raise RequestUnsendable(f"pseudo-header {name[:32]!r} not allowed here")
            if not value:
                raise RequestUnsendable(f"empty {name.decode()}")
            continue
        regular = True
        if not well_formed(name, value):
            raise RequestUnsendable("a field HTTP/2 cannot carry")
        if name in CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            raise RequestUnsendable("a connection-specific field (RFC 9113 8.2.2)")
