"""What both ends of an HTTP/2 connection share: the frame accounting and the h2 plumbing.

Theory of operation
-------------------
`H2Endpoint` is the base of `connection.H2Server` (the agent side) and `client.H2Client` (the
upstream side); neither peer is trusted more than the other, so both count frames the same way.
Before h2 sees a frame, `_receive_frames` splits the input into frames itself (the 9-octet
header of RFC 9113 4.1 is enough) and `_account` counts what h2 does not bound (limits.py): one
header block's bytes and CONTINUATION frames (the 2024 CONTINUATION flood: h2 buffers up to 64
frames before decoding), SETTINGS, PING and PRIORITY floods (CVE-2019-9515, CVE-2019-9512,
CVE-2019-9513), frames with empty payloads (CVE-2019-9518), the control frames queued for a
peer that does not read, and, where `_COUNT_RESETS`, the peer's resets (rapid reset,
CVE-2023-44487). Over a limit the connection ends with GOAWAY ENHANCE_YOUR_CALM (RFC 9113 7:
"the endpoint is ... generating excessive load") and `Http2ConnectionError` naming the rule.

Each side says what differs in class attributes (which frames open a header block, whether
resets are counted, who the peer is in a message) and hooks (`_oversized`, `_feed`,
`_convert_own`); the events both sides report alike (DATA, END_STREAM, WINDOW_UPDATE, SETTINGS,
PING) are converted here. Flow control: received bytes are acknowledged (`acknowledge`) only as
the adapter consumes them; what a stream that ends leaves unconsumed is credited back to the
connection window (`_end`).
"""

from __future__ import annotations

from typing import ClassVar

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from proxycore.errors import Http2ConnectionError
from proxycore.protocol.http2.events import (
    DataReceived,
    H2Event,
    PingReceived,
    SettingsReceived,
    StreamEnded,
    WindowOpened,
)
from proxycore.protocol.http2.limits import H2Limits, TokenBucket

__all__ = ["H2Endpoint", "advertised_settings"]

ErrorCode = h2.errors.ErrorCodes

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, CONTINUATION = 0x5, 0x6, 0x9
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
# Frames a peer sends that we answer with a control frame of our own (the outbound count).
_ANSWERED = frozenset({SETTINGS, PING})


def advertised_settings(limits: H2Limits) -> dict[h2.settings.SettingCodes, int]:
    """The SETTINGS both sides advertise alike (each adds its own concurrency bound); push is
    never accepted (RFC 9113 8.4: a PUSH_PROMISE is then a connection error)."""
    return {
        h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: limits.initial_stream_window,
        h2.settings.SettingCodes.MAX_FRAME_SIZE: limits.max_frame_size,
        h2.settings.SettingCodes.HEADER_TABLE_SIZE: limits.header_table_size,
        h2.settings.SettingCodes.ENABLE_PUSH: 0,
    }


class H2Endpoint:
    """One end of an HTTP/2 connection (see the module docstring); never used directly."""

    # Frame types that start a header block (CONTINUATION frames then continue it).
    _BLOCK_STARTS: ClassVar[frozenset[int]] = frozenset({HEADERS})
    # Whether the peer's RST_STREAM frames are rate limited (rapid reset).
    _COUNT_RESETS: ClassVar[bool] = False
    # Who does not read, in the message of the "h2_outbound" rule.
    _PEER: ClassVar[str] = "peer"

    def __init__(self, limits: H2Limits, h2c: h2.connection.H2Connection) -> None:
        self.limits = limits
        self._h2 = h2c
        h2c.decoder.max_header_list_size = limits.max_header_list_size
        h2c.decoder.max_allowed_table_size = limits.header_table_size
        h2c.max_inbound_frame_size = limits.max_frame_size
        self._buffer = bytearray()
        self._started = False
        # The header block in progress: its bytes and CONTINUATION frames so far.
        self._block_bytes = 0
        self._block_frames = 0
        self._empty_frames = 0
        self._resets = (
            TokenBucket(limits.reset_burst, limits.reset_rate) if self._COUNT_RESETS else None
        )
        self._settings = TokenBucket(limits.settings_burst, limits.settings_rate)
        self._pings = TokenBucket(limits.ping_burst, limits.ping_rate)
        self._priorities = TokenBucket(limits.priority_burst, limits.priority_rate)
        # Control frames queued since the adapter last took data_to_send().
        self._queued_control = 0
        # Flow-controlled bytes received and not yet acknowledged, per open stream.
        self._unacked: dict[int, int] = {}
        # Streams the adapter is served or serves (not over for us).
        self._live: set[int] = set()
        self.closed = False  # a fatal GOAWAY was queued or received: nothing more is sent

    def _open_connection_window(self) -> None:
        """After the preface: the connection window we advertise (RFC 9113 6.9.2)."""
        extra = self.limits.connection_window - 65535
        if extra > 0:
            self._h2.increment_flow_control_window(extra)

    # -- input ----------------------------------------------------------------------------------

    def _receive_frames(self, events: list[H2Event], now: float) -> None:
        """Account and feed every whole frame in the buffer; on an Http2ConnectionError, what
        was received before the failing frame rides on it (`exc.events`): the adapter still
        owes each stream its ending."""
        try:
            self._frames(events, now)
        except Http2ConnectionError as exc:
            exc.events = events
            raise

    def _frames(self, events: list[H2Event], now: float) -> None:
        buffer = self._buffer
        limits = self.limits
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if length > limits.max_frame_size:
                self._oversized(bytes(buffer[:9]), events)
                self._fail("frame too large", ErrorCode.FRAME_SIZE_ERROR, "h2_frame_size")
            if len(buffer) < 9 + length:
                break
            frame = bytes(buffer[: 9 + length])
            del buffer[: 9 + length]
            self._account(frame, length, now)
            self._feed(frame, events)

    def _oversized(self, header: bytes, events: list[H2Event]) -> None:
        """A frame over SETTINGS_MAX_FRAME_SIZE is coming (its 9-octet header): the connection
        ends after this hook with FRAME_SIZE_ERROR; its payload is never read."""

    def _account(self, frame: bytes, length: int, now: float) -> None:
        """Count the frame against the limits h2 does not enforce (limits.py)."""
        kind, flags = frame[3], frame[4]
        limits = self.limits
        if kind == CONTINUATION or kind in self._BLOCK_STARTS:
            if kind != CONTINUATION:
                self._block_bytes, self._block_frames = 0, 0
            else:
                self._block_frames += 1
            self._block_bytes += length
            if self._block_frames > limits.max_continuation_frames:
                self._calm(
                    "CONTINUATION flood: too many frames in one header block", "h2_continuation"
                )
            if self._block_bytes > limits.max_header_block_bytes:
                self._calm("header block too large", "h2_header_block")
        empty = length == 0 and (
            (kind == DATA and not flags & _END_STREAM)
            or (kind in (HEADERS, CONTINUATION) and not flags & (_END_HEADERS | _END_STREAM))
        )
        self._empty_frames = self._empty_frames + 1 if empty else 0
        if self._empty_frames > limits.max_consecutive_empty_frames:
            self._calm("frames with an empty payload", "h2_empty_frames")
        resets = self._resets
        if kind == RST_STREAM and resets is not None and not resets.take(now):
            self._calm("too many streams reset by the client (rapid reset)", "h2_rapid_reset")
        elif kind == SETTINGS and not flags & _ACK and not self._settings.take(now):
            self._calm("SETTINGS flood", "h2_settings_flood")
        elif kind == PING and not flags & _ACK and not self._pings.take(now):
            self._calm("PING flood", "h2_ping_flood")
        elif kind == PRIORITY and not self._priorities.take(now):
            self._calm("PRIORITY flood", "h2_priority_flood")
        if kind in _ANSWERED and not flags & _ACK:
            self._queued_control += 1
            if self._queued_control > limits.max_outbound_control_frames:
                self._calm(
                    f"control frames queued for a {self._PEER} that does not read", "h2_outbound"
                )

    def _feed(self, frame: bytes, events: list[H2Event]) -> None:
        """One frame to h2; what it makes of it converted. h2's refusals end the connection
        naming the rule; any other exception from its parsers (hpack's, hyperframe's) is
        unreadable input from the peer and ends this connection alone, the same way."""
        try:
            received = self._h2.receive_data(frame)
        except h2.exceptions.DenialOfServiceError as exc:
            # h2 queued GOAWAY ENHANCE_YOUR_CALM (e.g. HPACK's OversizedHeaderListError).
            self._failed(f"HPACK: {exc}", ErrorCode.ENHANCE_YOUR_CALM, "h2_header_list")
        except h2.exceptions.ProtocolError as exc:
            self._failed(str(exc) or type(exc).__name__, exc.error_code, self._rule_of(exc))
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            self._fail(why, ErrorCode.PROTOCOL_ERROR, "h2_protocol_error")
        for event in received:
            self._convert(event, events)

    def _rule_of(self, exc: h2.exceptions.ProtocolError) -> str:
        """The rule an h2 protocol error is journaled under."""
        return "h2_protocol_error"

    def _convert(self, event: h2.events.Event, events: list[H2Event]) -> None:
        """h2's event as ours: the ones both sides report alike here, the rest by the side."""
        if isinstance(event, h2.events.DataReceived):
            stream_id = event.stream_id
            assert stream_id is not None
            data = event.data or b""
            flow = event.flow_controlled_length or 0
            if stream_id in self._live:
                self._unacked[stream_id] = self._unacked.get(stream_id, 0) + flow
                events.append(DataReceived(stream_id, data, flow, event.stream_ended is not None))
            else:
                # Nobody will consume it: give the connection window back at once.
                self._send(lambda: self._h2.acknowledge_received_data(flow, stream_id))
        elif isinstance(event, h2.events.StreamEnded):
            if event.stream_id in self._live:
                events.append(StreamEnded(event.stream_id))
        elif isinstance(event, h2.events.WindowUpdated):
            events.append(WindowOpened(event.stream_id or 0))
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            changed = tuple(
                (int(code), int(setting.new_value or 0))
                for code, setting in event.changed_settings.items()
            )
            events.append(SettingsReceived(changed))
            # A larger initial window opens every stream's window at once.
            events.append(WindowOpened(0))
        elif isinstance(event, h2.events.PingReceived):
            events.append(PingReceived())
        else:
            self._convert_own(event, events)

    def _convert_own(self, event: h2.events.Event, events: list[H2Event]) -> None:
        raise NotImplementedError

    # -- commands -------------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        self._queued_control = 0
        return self._h2.data_to_send()

    def is_live(self, stream_id: int) -> bool:
        return stream_id in self._live

    def send_window(self, stream_id: int) -> int:
        """Bytes that may be sent on the stream now (0 when it is gone)."""
        if stream_id not in self._live or self.closed:
            return 0
        try:
            window = self._h2.local_flow_control_window(stream_id)
        except (h2.exceptions.ProtocolError, KeyError):
            return 0
        return min(window, self._h2.max_outbound_frame_size)

    def acknowledge(self, stream_id: int, flow_length: int) -> None:
        """The adapter consumed `flow_length` flow-controlled bytes of the stream: open the
        windows again (h2 sends WINDOW_UPDATE once enough is consumed)."""
        if flow_length <= 0 or self.closed:
            return
        unacked = self._unacked.get(stream_id)
        if unacked is None:
            return
        flow_length = min(flow_length, unacked)
        self._unacked[stream_id] = unacked - flow_length
        self._send(lambda: self._h2.acknowledge_received_data(flow_length, stream_id))

    # -- internals ------------------------------------------------------------------------------

    def _send(self, command: object) -> bool:
        """Run an h2 command; a stream or connection already closed makes it a no-op."""
        assert callable(command)
        try:
            command()
        except h2.exceptions.ProtocolError:
            # Closed or reset meanwhile (StreamClosedError, NoSuchStreamError), or the
            # stream's state forbids the frame: never sent (RFC 9113 5.1).
            return False
        return True

    def _end(self, stream_id: int) -> bool:
        """The stream is over for us: credit its unconsumed bytes to the connection window.
        True if it was live."""
        unacked = self._unacked.pop(stream_id, 0)
        if unacked and not self.closed:
            # Stream closed: h2 credits the connection window only.
            self._send(lambda: self._h2.acknowledge_received_data(unacked, stream_id))
        if stream_id in self._live:
            self._live.discard(stream_id)
            return True
        return False

    def goaway(self, code: int = ErrorCode.NO_ERROR) -> None:
        raise NotImplementedError

    def _calm(self, message: str, rule: str) -> None:
        self._fail(message, ErrorCode.ENHANCE_YOUR_CALM, rule)

    def _fail(self, message: str, code: int, rule: str) -> None:
        self.goaway(code)
        self._failed(message, code, rule)

    def _failed(self, message: str, code: int, rule: str) -> None:
        self.closed = True
        self._live.clear()
        self._unacked.clear()
        raise Http2ConnectionError(message, error_code=int(code), rule=rule)
