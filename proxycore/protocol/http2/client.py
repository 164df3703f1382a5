"""The client side of one HTTP/2 connection to an upstream: the h2 package's state machine,
wrapped once (the server side is `connection.H2Server`).

Theory of operation
-------------------
`H2Client` is sans-IO: the adapter (proxycore/io/upstream_h2.py) feeds it what the upstream
sent (`receive_data`), gets back our own events (`events.py`: `ResponseReceived`,
`DataReceived`, `TrailersReceived`, `StreamEnded`, `StreamReset`, `WindowOpened`,
`ConnectionEnded`...), calls commands (`open_stream`, `send_data`, `send_trailers`, `reset`,
`acknowledge`) and writes out `data_to_send()`. Nothing outside this module, `endpoint.py` and
`connection.py` touches h2; its exceptions end here, converted to `Http2ConnectionError` (the
connection must end: a GOAWAY is queued) or to a refused command (a stream the upstream already
closed or reset: never written, RFC 9113 5.1).

The upstream is not trusted more than an agent: before h2 sees a frame, it is counted as on the
agent side (`endpoint.H2Endpoint` holds that accounting for both), with the same limits
(limits.py): one header block's bytes and CONTINUATION frames (the 2024 CONTINUATION flood),
SETTINGS and PING floods (CVE-2019-9515, CVE-2019-9512), PRIORITY frames, frames with empty
payloads (CVE-2019-9518). h2 enforces HPACK's decoded header list size (the HPACK bomb,
CVE-2016-6581; `max_header_list_size`), the frame size, and the receive windows we advertise:
a response body is acknowledged (`acknowledge`) only as the adapter hands it on, so what the
proxy holds of a stream never exceeds `initial_stream_window`, of a connection
`connection_window`. Server push is refused (SETTINGS_ENABLE_PUSH 0: a PUSH_PROMISE is a
connection error, RFC 9113 8.4). Over a limit the connection ends with GOAWAY
ENHANCE_YOUR_CALM; a response h2 finds malformed (RFC 9113 8.1.1) ends it with PROTOCOL_ERROR.

Streams: at most min(the upstream's SETTINGS_MAX_CONCURRENT_STREAMS, `max_concurrent_streams`)
open at once (`can_open`). A GOAWAY from the upstream (`ConnectionEnded`) stops new streams;
those above its last stream identifier were never processed (RFC 9113 6.8) and are reported
reset with `refused=True` (safe to send again), as are those reset with REFUSED_STREAM.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from proxycore.protocol.http2.endpoint import HEADERS, PUSH_PROMISE, H2Endpoint, advertised_settings
from proxycore.protocol.http2.events import (
    ConnectionEnded,
    H2Event,
    ResponseReceived,
    StreamReset,
    TrailersReceived,
)
from proxycore.protocol.http2.fields import CONNECTION_SPECIFIC, FIELD_NAME, FIELD_VALUE
from proxycore.protocol.http2.hpack_out import StatelessEncoder
from proxycore.protocol.http2.limits import MAX_STREAM_ID, H2Limits

__all__ = ["H2Client", "RequestUnsendable"]

ErrorCode = h2.errors.ErrorCodes

# Request fields are checked (fields.py) before h2 encodes anything: h2 changes the HPACK
# encoder's state before some of its own checks, which would leave the upstream's decoder out
# of step.
_REQUEST_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path"})


class RequestUnsendable(Exception):
    """Internal: a request head (or trailer section) that cannot be written as HTTP/2."""


class H2Client(H2Endpoint):
    """One HTTP/2 client connection (see the module docstring)."""

    # A PUSH_PROMISE carries a header block too (counted before h2 refuses it, RFC 9113 8.4).
    _BLOCK_STARTS = frozenset({HEADERS, PUSH_PROMISE})

    def __init__(self, limits: H2Limits) -> None:
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_inbound_headers=True,
            normalize_inbound_headers=True,
            # Our own heads, checked by _check_fields before h2 sees them and encoded by the
            # stateless encoder (hpack_out.py): an injected credential is never indexed, and
            # nothing the agent sends on one stream shares a compression context with it.
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        h2c = h2.connection.H2Connection(config)
        h2c.encoder = StatelessEncoder()  # type: ignore[assignment]
        h2c.local_settings = h2.settings.Settings(
            client=True,
            initial_values={
                **advertised_settings(limits),
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0,
            },
        )
        super().__init__(limits, h2c)
        self._reserved = 0  # streams promised to callers (`reserve`) not opened yet
        # The upstream's GOAWAY: its last stream identifier (None: none received).
        self.last_stream_id: int | None = None

    # -- starting -------------------------------------------------------------------------------

    def initiate(self) -> None:
        """Queue the client preface and SETTINGS, and the connection window (RFC 9113 6.9.2)."""
        if self._started:
            return
        self._started = True
        self._h2.initiate_connection()
        self._open_connection_window()

    # -- capacity -------------------------------------------------------------------------------

    @property
    def max_streams(self) -> int:
        """min(the upstream's SETTINGS_MAX_CONCURRENT_STREAMS, ours)."""
        peer = self._h2.remote_settings.max_concurrent_streams
        return min(int(peer), self.limits.max_concurrent_streams)

    @property
    def open_streams(self) -> int:
        return len(self._live) + self._reserved

    def can_open(self) -> bool:
        """Whether one more stream may be opened now (not going away, a stream identifier
        left, under the concurrency bound)."""
        if self.closed or self.last_stream_id is not None:
            return False
        highest = self._h2.highest_outbound_stream_id or 0
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
        buffer = self._buffer
        buffer += data
        events: list[H2Event] = []
        self._receive_frames(events, now)
        return events

    def _convert_own(self, event: h2.events.Event, events: list[H2Event]) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            stream_id = event.stream_id
            assert stream_id is not None
            if stream_id in self._live:
                status, fields = _split_response(event.headers or [])
                events.append(
                    ResponseReceived(stream_id, status, fields, event.stream_ended is not None)
                )
        elif isinstance(event, h2.events.TrailersReceived):
            stream_id = event.stream_id
            assert stream_id is not None
            if stream_id in self._live:
                _, fields = _split_response(event.headers or [])
                events.append(TrailersReceived(stream_id, fields))
        elif isinstance(event, h2.events.StreamReset):
            stream_id = event.stream_id
            code = int(event.error_code or 0)
            if self._end(stream_id):
                refused = code == ErrorCode.REFUSED_STREAM
                events.append(StreamReset(stream_id, code, by_peer=True, refused=refused))
        elif isinstance(event, h2.events.ConnectionTerminated):
            last = int(event.last_stream_id or 0)
            self.last_stream_id = last
            code = int(event.error_code or 0)
            # RFC 9113 6.8: streams above `last` were not processed: they may be sent again.
            for stream_id in sorted(self._live):
                if stream_id > last:
                    self._end(stream_id)
                    events.append(
                        StreamReset(
                            stream_id, code, by_peer=True, why="upstream GOAWAY", refused=True
                        )
                    )
            if code != ErrorCode.NO_ERROR:
                # An error GOAWAY: h2 closed its state machine; the rest cannot finish.
                self.closed = True
                for stream_id in sorted(self._live):
                    self._end(stream_id)
                    events.append(StreamReset(stream_id, code, by_peer=True, why="upstream GOAWAY"))
            events.append(ConnectionEnded(code, last))
        # Informational responses (1xx, dropped as the HTTP/1.1 path drops them), priority,
        # ALTSVC, unknown frames, acknowledgements: nothing to do.

    # -- commands -------------------------------------------------------------------------------

    def open_stream(self, fields: list[tuple[bytes, bytes]], *, end: bool) -> int:
        """Send a request head (pseudo-headers first); returns its stream identifier. Raises
        RequestUnsendable for fields HTTP/2 cannot carry (checked before h2 encodes)."""
        _check_fields(fields, pseudo=_REQUEST_PSEUDO)
        if self.closed or self.last_stream_id is not None:
            raise RequestUnsendable("the connection is going away")
        self.initiate()
        stream_id = self._h2.get_next_available_stream_id()
        try:
            self._h2.send_headers(stream_id, fields, end_stream=end)
        except h2.exceptions.ProtocolError as exc:
            raise RequestUnsendable(str(exc)) from None
        self.unreserve()
        self._live.add(stream_id)
        self._unacked[stream_id] = 0
        return stream_id

    def send_data(self, stream_id: int, data: bytes | memoryview, *, end: bool) -> int:
        """Send as much of `data` as the windows allow (one frame); the bytes taken, -1 when
        the stream is gone. `end` ends our side once all of `data` went."""
        if stream_id not in self._live:
            return -1
        take = min(len(data), self.send_window(stream_id))
        if take == 0 and (data or not end):
            return 0
        last = end and take == len(data)
        chunk = bytes(data[:take])
        if not self._send(lambda: self._h2.send_data(stream_id, chunk, end_stream=last)):
            return -1
        return take

    def send_trailers(self, stream_id: int, fields: list[tuple[bytes, bytes]]) -> bool:
        """A trailer section, ending our side (RFC 9113 8.1); False when the stream is gone."""
        _check_fields(fields, pseudo=frozenset())
        if stream_id not in self._live:
            return False
        return self._send(lambda: self._h2.send_headers(stream_id, fields, end_stream=True))

    def reset(self, stream_id: int, code: int = ErrorCode.CANCEL) -> None:
        """RST_STREAM, if the stream is still open (never on a closed one, RFC 9113 5.1)."""
        if stream_id in self._live:
            stream = self._h2.streams.get(stream_id)
            if stream is not None and not stream.closed:
                self._send(lambda: self._h2.reset_stream(stream_id, code))
            self._end(stream_id)

    def finish(self, stream_id: int) -> None:
        """The stream is over for the adapter (its response was read whole): forget it; a
        stream the upstream has not closed is reset (NO_ERROR: nothing went wrong)."""
        if stream_id in self._live:
            stream = self._h2.streams.get(stream_id)
            if stream is not None and not stream.closed:
                self._send(lambda: self._h2.reset_stream(stream_id, ErrorCode.NO_ERROR))
            self._end(stream_id)

    def goaway(self, code: int = ErrorCode.NO_ERROR) -> None:
        if self.closed:
            return
        self.closed = True
        self._live.clear()
        try:
            self._h2.close_connection(code)
        except h2.exceptions.ProtocolError:
            pass


def _split_response(
    headers: list[tuple[bytes, bytes]],
) -> tuple[int, tuple[tuple[bytes, bytes], ...]]:
    """:status (0 when absent, as in trailers) and the regular fields, lowercase names."""
    status = 0
    fields: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        name, value = bytes(name), bytes(value)
        if name == b":status":
            status = int(value) if value.isdigit() and len(value) == 3 else 0
        elif name[:1] != b":":
            fields.append((name, value))
    return status, tuple(fields)


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
        if not FIELD_NAME.fullmatch(name) or not FIELD_VALUE.fullmatch(value):
            raise RequestUnsendable("a field HTTP/2 cannot carry")
        if name in CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            raise RequestUnsendable("a connection-specific field (RFC 9113 8.2.2)")
