"""What both ends of an HTTP/2 connection share: the frame accounting and the protocol core.

Theory of operation
-------------------
`H2Endpoint` is the base of `connection.H2Server` (the agent side) and `client.H2Client` (the
upstream side): a sans-IO HTTP/2 connection (RFC 9113) of our own, written for the proxy's
needs. Neither peer is trusted more than the other, so both count frames the same way.

Input: `_frames` splits the bytes into frames (the 9-octet header of RFC 9113 4.1); a frame over
the SETTINGS_MAX_FRAME_SIZE we advertised ends the connection before its payload is read. Each
frame is first counted (`_account`) against what the protocol itself does not bound (limits.py):
one header block's bytes and CONTINUATION frames (the 2024 CONTINUATION flood), SETTINGS, PING
and PRIORITY floods (CVE-2019-9515, CVE-2019-9512, CVE-2019-9513), frames with empty payloads
(CVE-2019-9518), the control frames queued for a peer that does not read (our answers to
SETTINGS and PING, and the RST_STREAM frames that answer its frames), and, where
`_COUNT_RESETS`, the peer's resets (rapid reset, CVE-2023-44487). Over a limit the connection
ends with GOAWAY ENHANCE_YOUR_CALM (RFC 9113 7: "the endpoint is ... generating excessive load")
and `Http2ConnectionError` naming the rule. Then the frame is handled by its type, with the
checks RFC 9113 6 asks of each (lengths, stream 0 or not, padding, flow-control windows, stream
states of 5.1); a connection error queues GOAWAY and raises `Http2ConnectionError` (rule
"h2_protocol_error", "h2_flow_control" or "h2_frame_size"), a stream error resets that stream
alone (RST_STREAM, and a `StreamReset` event for the adapter).

Header blocks (HEADERS, CONTINUATION, RFC 9113 4.3) are decoded by hpack's Decoder, which
enforces the decoded header list size (the HPACK bomb, CVE-2016-6581); every block is decoded,
even on a stream being refused, so that the decoder's dynamic table stays in step with the
peer's encoder. Decoded fields are reused for the same block bytes only while the dynamic table
is unchanged (`_decode`): a client repeats its heads as a few table indexes, decoded once.
Our heads go out through the stateless encoder (hpack_out.py), which never touches the peer's
table.

Each side says what differs in class attributes (which frames open a header block, whether
resets are counted, whether the peer is the client, who the peer is in a message) and hooks
(`_on_header_block`, `_on_peer_reset`, `_on_goaway_received`). Flow control: received bytes are
acknowledged (`acknowledge`) only as the adapter consumes them, and WINDOW_UPDATE frames go out
once half a window is consumed (or a closed window has some room again); what a stream that ends
leaves unconsumed is credited back to the connection window (`_end`). Our sends stay within the
peer's windows (`send_window`).
"""

from __future__ import annotations

from typing import ClassVar, NoReturn

import hpack
from hpack.exceptions import OversizedHeaderListError

from proxycore.errors import Http2ConnectionError
from proxycore.protocol.http2.events import (
    DataReceived,
    H2Event,
    PingReceived,
    SettingsReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowOpened,
)
from proxycore.protocol.http2.frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    FRAME_HEADER,
    HEADERS,
    MAX_FRAME_SIZE_LIMIT,
    MAX_WINDOW,
    PADDED,
    PING,
    PRIORITY,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS,
    ErrorCode,
    Setting,
    frame,
    goaway_frame,
    header_frames,
    rst_stream_frame,
    settings_frame,
    window_update_frame,
)
from proxycore.protocol.http2.hpack_out import StatelessEncoder
from proxycore.protocol.http2.limits import H2Limits, TokenBucket

__all__ = ["ErrorCode", "H2Endpoint", "advertised_settings"]

# Frames a peer sends that we answer with a control frame of our own (the outbound count).
_ANSWERED = frozenset({SETTINGS, PING})
# Header blocks up to this size are kept decoded while the dynamic table is unchanged, at most
# this many per connection (a few hundred bytes of keys: a client's repeated heads).
_CACHEABLE_BLOCK = 512
_DECODE_CACHE_ENTRIES = 16
# Streams we reset, remembered so that frames the peer sent before it saw our RST_STREAM are
# ignored rather than answered (RFC 9113 5.1 "closed"); the oldest are forgotten.
_RESETS_REMEMBERED = 128
Fields = tuple[tuple[bytes, bytes], ...]


def advertised_settings(limits: H2Limits) -> dict[Setting, int]:
    """The SETTINGS both sides advertise alike (each adds its own concurrency bound); push is
    never accepted (RFC 9113 8.4: a PUSH_PROMISE is then a connection error)."""
    return {
        Setting.MAX_HEADER_LIST_SIZE: limits.max_header_list_size,
        Setting.INITIAL_WINDOW_SIZE: limits.initial_stream_window,
        Setting.MAX_FRAME_SIZE: limits.max_frame_size,
        Setting.HEADER_TABLE_SIZE: limits.header_table_size,
        Setting.ENABLE_PUSH: 0,
    }


def _window_increment(window: int, largest: int, consumed: int) -> int:
    """How much of a receive window to give back now (0: not yet): once half of it was
    consumed, or once a closed window has a little room again, so that a peer sending small
    frames does not get a WINDOW_UPDATE for each."""
    if consumed >= largest // 2 or (window == 0 and consumed > min(1024, largest // 4)):
        return min(consumed, largest - window)
    return 0


class Stream:
    """One stream's state (RFC 9113 5.1) and windows; kept while it is not closed."""

    __slots__ = (
        "expected_length",
        "head_received",
        "local_closed",
        "received_length",
        "recv_consumed",
        "recv_largest",
        "recv_window",
        "remote_closed",
        "send_window",
    )

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.send_window = send_window  # what we may send (the peer's window)
        self.recv_window = recv_window  # what the peer may send us
        self.recv_largest = recv_window
        self.recv_consumed = 0  # consumed and not yet given back by WINDOW_UPDATE
        self.local_closed = False  # we sent END_STREAM
        self.remote_closed = False  # the peer sent END_STREAM
        self.head_received = False  # the peer's head (request or final response) arrived
        # RFC 9113 8.1.1: content-length, when the head had one, against the DATA received.
        self.expected_length: int | None = None
        self.received_length = 0


class H2Endpoint:
    """One end of an HTTP/2 connection (see the module docstring); never used directly."""

    # Frame types that start a header block (CONTINUATION frames then continue it).
    _BLOCK_STARTS: ClassVar[frozenset[int]] = frozenset({HEADERS})
    # Whether the peer's RST_STREAM frames are rate limited (rapid reset).
    _COUNT_RESETS: ClassVar[bool] = False
    # Who does not read, in the message of the "h2_outbound" rule.
    _PEER: ClassVar[str] = "peer"
    # Whether the peer is the client (opens odd streams) or the server (never opens any).
    _PEER_IS_CLIENT: ClassVar[bool] = True

    def __init__(self, limits: H2Limits) -> None:
        self.limits = limits
        decoder = hpack.Decoder(max_header_list_size=limits.max_header_list_size)
        decoder.max_allowed_table_size = limits.header_table_size
        self._decoder = decoder
        self._decoded: dict[bytes, Fields] = {}
        self._encoder = StatelessEncoder()
        self._buffer = bytearray()
        self._out = bytearray()
        self._started = False
        self._streams: dict[int, Stream] = {}
        self._reset_streams: dict[int, None] = {}
        self._highest_inbound = 0  # the highest stream identifier the peer opened
        self._highest_outbound = 0  # the highest we opened
        # The peer's settings that bind us (RFC 9113 6.5.2 defaults until its SETTINGS).
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame_size = DEFAULT_FRAME_SIZE
        self._peer_max_streams = 2**32 + 1  # unlimited until said (RFC 9113 6.5.2)
        # Connection windows (RFC 9113 6.9.1): what we may send, what the peer may send.
        self._send_conn = DEFAULT_WINDOW
        self._recv_conn = DEFAULT_WINDOW
        self._recv_conn_largest = DEFAULT_WINDOW
        self._recv_conn_consumed = 0
        # The header block in progress: its stream (0: none), frames' fragments, END_STREAM.
        self._block_stream = 0
        self._block_parts: list[bytes] = []
        self._block_end_stream = False
        # The header block in progress, as counted: its bytes and CONTINUATION frames so far.
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

    def _preface(self, own: dict[Setting, int]) -> None:
        """Our SETTINGS (enforced from now on, not from their acknowledgement), and the
        connection window we advertise (RFC 9113 6.9.2)."""
        self._out += settings_frame(own)
        extra = self.limits.connection_window - DEFAULT_WINDOW
        if extra > 0:
            self._recv_conn += extra
            self._recv_conn_largest = max(self._recv_conn, self._recv_conn_largest)
            self._out += window_update_frame(0, extra)

    # -- input ----------------------------------------------------------------------------------

    def _receive_frames(self, events: list[H2Event], now: float) -> None:
        """Account and handle every whole frame in the buffer; on an Http2ConnectionError, what
        was received before the failing frame rides on it (`exc.events`): the adapter still
        owes each stream its ending."""
        try:
            self._frames(events, now)
        except Http2ConnectionError as exc:
            exc.events = events
            raise

    def _frames(self, events: list[H2Event], now: float) -> None:
        buffer = self._buffer
        data = bytes(buffer)
        size = len(data)
        max_frame_size = self.limits.max_frame_size
        handlers = self._handlers
        read_header = FRAME_HEADER.unpack_from
        pos = 0
        try:
            while size - pos >= 9:
                high, low, kind, flags, stream_id = read_header(data, pos)
                length = (high << 8) | low
                if length > max_frame_size:
                    self._fail("frame too large", ErrorCode.FRAME_SIZE_ERROR, "h2_frame_size")
                end = pos + 9 + length
                if end > size:
                    break
                stream_id &= 0x7FFFFFFF
                payload = data[pos + 9 : end]
                pos = end
                self._account(kind, flags, length, now)
                if self._block_stream and (kind != CONTINUATION or stream_id != self._block_stream):
                    # RFC 9113 4.3: a header block is a contiguous sequence of frames.
                    self._fail(
                        "a frame inside a header block",
                        ErrorCode.PROTOCOL_ERROR,
                        "h2_protocol_error",
                    )
                if kind < len(handlers):
                    handlers[kind](self, flags, stream_id, payload, events)
                # RFC 9113 5.5: frames of unknown types are ignored.
                if self.closed:
                    break  # a GOAWAY was received: nothing more is read
        finally:
            if self.closed:
                buffer.clear()
            else:
                del buffer[:pos]

    def _account(self, kind: int, flags: int, length: int, now: float) -> None:
        """Count the frame against the limits the protocol itself does not bound (limits.py)."""
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
            (kind == DATA and not flags & END_STREAM)
            or (kind in (HEADERS, CONTINUATION) and not flags & (END_HEADERS | END_STREAM))
        )
        self._empty_frames = self._empty_frames + 1 if empty else 0
        if self._empty_frames > limits.max_consecutive_empty_frames:
            self._calm("frames with an empty payload", "h2_empty_frames")
        resets = self._resets
        if kind == RST_STREAM and resets is not None and not resets.take(now):
            self._calm("too many streams reset by the client (rapid reset)", "h2_rapid_reset")
        elif kind == SETTINGS and not flags & ACK and not self._settings.take(now):
            self._calm("SETTINGS flood", "h2_settings_flood")
        elif kind == PING and not flags & ACK and not self._pings.take(now):
            self._calm("PING flood", "h2_ping_flood")
        elif kind == PRIORITY and not self._priorities.take(now):
            self._calm("PRIORITY flood", "h2_priority_flood")
        if kind in _ANSWERED and not flags & ACK:
            self._count_control()

    def _count_control(self) -> None:
        """One more control frame queued for the peer before it reads."""
        self._queued_control += 1
        if self._queued_control > self.limits.max_outbound_control_frames:
            self._calm(
                f"control frames queued for a {self._PEER} that does not read", "h2_outbound"
            )

    # -- frames by type (RFC 9113 6) ------------------------------------------------------------

    def _protocol_error(self, why: str) -> NoReturn:
        self._fail(why, ErrorCode.PROTOCOL_ERROR, "h2_protocol_error")

    def _frame_size_error(self, why: str) -> NoReturn:
        self._fail(why, ErrorCode.FRAME_SIZE_ERROR, "h2_frame_size")

    def _unpad(self, flags: int, payload: bytes, kind: str) -> bytes:
        """RFC 9113 6.1, 6.2: the payload without its padding."""
        if not flags & PADDED:
            return payload
        if not payload:
            self._frame_size_error(f"padded {kind} frame without a pad length")
        pad = payload[0]
        if pad >= len(payload):
            self._protocol_error(f"{kind} padding longer than the frame")
        return payload[1 : len(payload) - pad]

    def _on_data(self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]) -> None:
        if stream_id == 0:
            self._protocol_error("DATA on stream 0")
        flow = len(payload)
        data = self._unpad(flags, payload, "DATA")
        # RFC 9113 6.9.1: a frame beyond the window we gave is a connection error.
        self._recv_conn -= flow
        if self._recv_conn < 0:
            self._fail("DATA beyond the connection window", *_FLOW_CONTROL)
        stream = self._streams.get(stream_id)
        if stream is None:
            self._closed_stream_data(stream_id, flow)
            return
        if not stream.head_received:
            self._protocol_error("DATA before the head of its stream")
        stream.recv_window -= flow
        if stream.recv_window < 0:
            self._fail("DATA beyond the stream window", *_FLOW_CONTROL)
        if stream.remote_closed:
            # RFC 9113 5.1 half-closed (remote): a stream error.
            self._stream_error(stream_id, ErrorCode.STREAM_CLOSED, "DATA after END_STREAM", events)
            self._credit(flow, stream_id)
            return
        ended = bool(flags & END_STREAM)
        if stream.expected_length is not None:
            stream.received_length += len(data)
            if stream.received_length > stream.expected_length or (
                ended and stream.received_length != stream.expected_length
            ):
                # RFC 9113 8.1.1: malformed, a stream error.
                self._stream_error(
                    stream_id,
                    ErrorCode.PROTOCOL_ERROR,
                    "body length differs from content-length",
                    events,
                )
                self._credit(flow, stream_id)
                return
        if ended:
            self._remote_end(stream_id, stream)
        if stream_id in self._live:
            self._unacked[stream_id] = self._unacked.get(stream_id, 0) + flow
            events.append(DataReceived(stream_id, data, flow, ended))
            if ended:
                events.append(StreamEnded(stream_id))
        else:
            # Nobody will consume it: give the windows back at once.
            self._credit(flow, stream_id)

    def _closed_stream_data(self, stream_id: int, flow: int) -> None:
        """DATA on a stream we do not hold: idle is a connection error; closed, a stream error
        (RFC 9113 5.1), unless we reset it ourselves (frames may have been in flight)."""
        if self._is_idle(stream_id):
            self._protocol_error("DATA on an idle stream")
        self._credit(flow, stream_id)
        if stream_id not in self._reset_streams:
            self._answer_reset(stream_id, ErrorCode.STREAM_CLOSED)

    def _on_headers(
        self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]
    ) -> None:
        if stream_id == 0:
            self._protocol_error("HEADERS on stream 0")
        block = self._unpad(flags, payload, "HEADERS")
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                self._frame_size_error("HEADERS too short for its priority")
            if int.from_bytes(block[:4], "big") & 0x7FFFFFFF == stream_id:
                self._protocol_error("a stream depending on itself")  # RFC 9113 5.3.1
            block = block[5:]
        end_stream = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._on_header_block(stream_id, self._decode(block), end_stream, events)
        else:
            self._block_stream = stream_id
            self._block_parts = [block]
            self._block_end_stream = end_stream

    def _on_continuation(
        self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]
    ) -> None:
        if not self._block_stream:
            self._protocol_error("CONTINUATION without a header block")
        self._block_parts.append(payload)
        if flags & END_HEADERS:
            block = b"".join(self._block_parts)
            self._block_stream, self._block_parts = 0, []
            self._on_header_block(stream_id, self._decode(block), self._block_end_stream, events)

    def _decode(self, block: bytes) -> Fields:
        """The block's fields (RFC 7541). Fields decoded while the dynamic table was in its
        present state are reused for the same bytes: a decode that changed the table (an
        insertion, an eviction, a size update) empties the cache, so a cached result always
        belongs to the table as it is."""
        cacheable = len(block) <= _CACHEABLE_BLOCK
        cache = self._decoded
        if cacheable:
            cached = cache.get(block)
            if cached is not None:
                return cached
        table = self._decoder.header_table
        entries = table.dynamic_entries
        # Every change to the table shows in these: an insertion makes a new newest entry, an
        # eviction or a clearing shortens it, a size update changes maxsize (its size in bytes
        # follows from the entries).
        newest = entries[0] if entries else None
        before = (len(entries), table.maxsize)
        try:
            fields: Fields = tuple(self._decoder.decode(block, raw=True))
        except OversizedHeaderListError as exc:
            self._fail(f"HPACK: {exc}", ErrorCode.ENHANCE_YOUR_CALM, "h2_header_list")
        except Exception as exc:  # hpack's errors, and any other on bytes it cannot read
            self._fail(
                f"HPACK: {type(exc).__name__}: {exc}",
                ErrorCode.COMPRESSION_ERROR,
                "h2_protocol_error",
            )
        entries = table.dynamic_entries
        if (entries[0] if entries else None) is not newest or before != (
            len(entries),
            table.maxsize,
        ):
            cache.clear()
        elif cacheable:
            if len(cache) >= _DECODE_CACHE_ENTRIES:
                cache.clear()
            cache[block] = fields
        return fields

    def _on_header_block(
        self, stream_id: int, fields: Fields, end_stream: bool, events: list[H2Event]
    ) -> None:
        raise NotImplementedError

    def _on_priority(
        self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]
    ) -> None:
        # RFC 9113 5.3.2: the priority scheme is deprecated; the frame is checked and ignored.
        if stream_id == 0:
            self._protocol_error("PRIORITY on stream 0")
        if len(payload) != 5:
            self._frame_size_error("PRIORITY of a length other than 5")
        if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == stream_id:
            self._protocol_error("a stream depending on itself")

    def _on_rst_stream(
        self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]
    ) -> None:
        if stream_id == 0:
            self._protocol_error("RST_STREAM on stream 0")
        if len(payload) != 4:
            self._frame_size_error("RST_STREAM of a length other than 4")
        if stream_id not in self._streams:
            if self._is_idle(stream_id):
                self._protocol_error("RST_STREAM on an idle stream")  # RFC 9113 6.4
            return  # closed already: nothing to end
        self._forget(stream_id, reset=True)
        self._on_peer_reset(stream_id, int.from_bytes(payload, "big"), events)

    def _on_peer_reset(self, stream_id: int, code: int, events: list[H2Event]) -> None:
        raise NotImplementedError

    def _on_settings(
        self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]
    ) -> None:
        if stream_id != 0:
            self._protocol_error("SETTINGS on a stream")
        if flags & ACK:
            if payload:
                self._frame_size_error("SETTINGS acknowledgement with a payload")
            return  # ours were enforced from the start
        if len(payload) % 6:
            self._frame_size_error("SETTINGS of a length not a multiple of 6")
        changed = []
        for at in range(0, len(payload), 6):
            code = int.from_bytes(payload[at : at + 2], "big")
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            self._apply_setting(code, value)
            changed.append((code, value))
        self._out += frame(SETTINGS, ACK, 0)
        events.append(SettingsReceived(tuple(changed)))
        # A larger initial window opens every stream's window at once.
        events.append(WindowOpened(0))

    def _apply_setting(self, code: int, value: int) -> None:
        """One of the peer's settings (RFC 9113 6.5.2); unknown ones are ignored."""
        if code == Setting.ENABLE_PUSH:
            # A server may only say 0 (RFC 9113 6.5.2).
            if value > 1 or (value and not self._PEER_IS_CLIENT):
                self._protocol_error("SETTINGS_ENABLE_PUSH out of range")
        elif code == Setting.INITIAL_WINDOW_SIZE:
            if value > MAX_WINDOW:
                self._fail("SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1", *_FLOW_CONTROL)
            # RFC 9113 6.9.2: the change applies to every open stream's window at once.
            delta = value - self._peer_initial_window
            self._peer_initial_window = value
            for stream in self._streams.values():
                stream.send_window += delta
                if stream.send_window > MAX_WINDOW:
                    self._fail("a stream window over 2^31-1", *_FLOW_CONTROL)
        elif code == Setting.MAX_FRAME_SIZE:
            if not DEFAULT_FRAME_SIZE <= value <= MAX_FRAME_SIZE_LIMIT:
                self._protocol_error("SETTINGS_MAX_FRAME_SIZE out of range")
            self._peer_max_frame_size = value
        elif code == Setting.MAX_CONCURRENT_STREAMS:
            self._peer_max_streams = value
        elif code == Setting.ENABLE_CONNECT_PROTOCOL and value > 1:
            self._protocol_error("SETTINGS_ENABLE_CONNECT_PROTOCOL out of range")
        # HEADER_TABLE_SIZE: our encoder never inserts (hpack_out.py), any size will do;
        # MAX_HEADER_LIST_SIZE is advisory (RFC 9113 6.5.2).

    def _on_push_promise(
        self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]
    ) -> None:
        # RFC 9113 8.4: we advertised SETTINGS_ENABLE_PUSH 0 (a client never pushes at all).
        self._protocol_error("PUSH_PROMISE, and push is disabled")

    def _on_ping(self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]) -> None:
        if stream_id != 0:
            self._protocol_error("PING on a stream")
        if len(payload) != 8:
            self._frame_size_error("PING of a length other than 8")
        if not flags & ACK:
            self._out += frame(PING, ACK, 0, payload)
            events.append(PingReceived())

    def _on_goaway(self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]) -> None:
        if stream_id != 0:
            self._protocol_error("GOAWAY on a stream")
        if len(payload) < 8:
            self._frame_size_error("GOAWAY shorter than 8 octets")
        last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
        self._on_goaway_received(last, int.from_bytes(payload[4:8], "big"), events)

    def _on_goaway_received(self, last_stream_id: int, code: int, events: list[H2Event]) -> None:
        raise NotImplementedError

    def _on_window_update(
        self, flags: int, stream_id: int, payload: bytes, events: list[H2Event]
    ) -> None:
        if len(payload) != 4:
            self._frame_size_error("WINDOW_UPDATE of a length other than 4")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                self._protocol_error("WINDOW_UPDATE of 0 on the connection")  # RFC 9113 6.9
            self._send_conn += increment
            if self._send_conn > MAX_WINDOW:
                self._fail("the connection window over 2^31-1", *_FLOW_CONTROL)
            events.append(WindowOpened(0))
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            if self._is_idle(stream_id):
                self._protocol_error("WINDOW_UPDATE on an idle stream")
            return  # closed: RFC 9113 6.9 lets it arrive after
        if not increment:
            self._stream_error(stream_id, ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0", events)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self._stream_error(
                stream_id, ErrorCode.FLOW_CONTROL_ERROR, "a stream window over 2^31-1", events
            )
            return
        events.append(WindowOpened(stream_id))

    def _is_idle(self, stream_id: int) -> bool:
        """Whether a stream we do not hold was never opened (RFC 9113 5.1 "idle")."""
        if stream_id % 2 == (1 if self._PEER_IS_CLIENT else 0):
            return stream_id > self._highest_inbound
        return stream_id > self._highest_outbound

    # -- commands -------------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        self._queued_control = 0
        out = self._out
        if not out:
            return b""
        data = bytes(out)
        out.clear()
        return data

    @property
    def pending(self) -> int:
        """Bytes queued for the peer and not yet taken by data_to_send()."""
        return len(self._out)

    def is_live(self, stream_id: int) -> bool:
        return stream_id in self._live

    def send_window(self, stream_id: int) -> int:
        """Bytes that may be sent on the stream now (0 when it is gone)."""
        if stream_id not in self._live or self.closed:
            return 0
        stream = self._streams.get(stream_id)
        if stream is None or stream.local_closed:
            return 0
        return max(0, min(stream.send_window, self._send_conn, self._peer_max_frame_size))

    def acknowledge(self, stream_id: int, flow_length: int) -> None:
        """The adapter consumed `flow_length` flow-controlled bytes of the stream: open the
        windows again (WINDOW_UPDATE once enough is consumed)."""
        if flow_length <= 0 or self.closed:
            return
        unacked = self._unacked.get(stream_id)
        if unacked is None:
            return
        flow_length = min(flow_length, unacked)
        self._unacked[stream_id] = unacked - flow_length
        self._credit(flow_length, stream_id)

    # -- internals ------------------------------------------------------------------------------

    def _credit(self, flow: int, stream_id: int) -> None:
        """`flow` received bytes are consumed: give them back to the peer's windows, the
        stream's only while the peer may still send on it."""
        if flow <= 0 or self.closed:
            return
        self._recv_conn_consumed += flow
        increment = _window_increment(
            self._recv_conn, self._recv_conn_largest, self._recv_conn_consumed
        )
        if increment:
            self._recv_conn_consumed = 0
            self._recv_conn += increment
            self._out += window_update_frame(0, increment)
        stream = self._streams.get(stream_id)
        if stream is not None and not stream.remote_closed:
            stream.recv_consumed += flow
            increment = _window_increment(
                stream.recv_window, stream.recv_largest, stream.recv_consumed
            )
            if increment:
                stream.recv_consumed = 0
                stream.recv_window += increment
                self._out += window_update_frame(stream_id, increment)

    def _new_stream(self, stream_id: int) -> Stream:
        stream = Stream(self._peer_initial_window, self.limits.initial_stream_window)
        self._streams[stream_id] = stream
        return stream

    def _end_with_trailers(
        self, stream_id: int, stream: Stream, trailers: Fields, events: list[H2Event]
    ) -> None:
        """A trailer section that ends the stream (RFC 9113 8.1), on either side: the body must
        have been as long as its content-length said (8.1.1, else a stream error)."""
        expected = stream.expected_length
        if expected is not None and stream.received_length != expected:
            self._stream_error(
                stream_id,
                ErrorCode.PROTOCOL_ERROR,
                "body length differs from content-length",
                events,
            )
            return
        self._remote_end(stream_id, stream)
        if stream_id in self._live:
            events.append(TrailersReceived(stream_id, trailers))
            events.append(StreamEnded(stream_id))

    def _remote_end(self, stream_id: int, stream: Stream) -> None:
        stream.remote_closed = True
        if stream.local_closed:
            self._forget(stream_id)

    def _local_end(self, stream_id: int, stream: Stream) -> None:
        stream.local_closed = True
        if stream.remote_closed:
            self._forget(stream_id)

    def _forget(self, stream_id: int, *, reset: bool = False) -> None:
        """The stream is closed (RFC 9113 5.1); by a reset, remembered for a while."""
        self._streams.pop(stream_id, None)
        if reset:
            remembered = self._reset_streams
            remembered[stream_id] = None
            if len(remembered) > _RESETS_REMEMBERED:
                del remembered[next(iter(remembered))]

    def _send_head(
        self, stream_id: int, stream: Stream, fields: list[tuple[bytes, bytes]], end: bool
    ) -> None:
        self._send_block(stream_id, stream, self._encoder.encode(fields), end)

    def _send_block(self, stream_id: int, stream: Stream, block: bytes, end: bool) -> None:
        """A head already encoded (by the stateless encoder: the block depends on the fields
        alone, so one made earlier for the same fields is the same bytes)."""
        self._out += header_frames(
            stream_id, block, end=end, max_frame_size=self._peer_max_frame_size
        )
        if end:
            self._local_end(stream_id, stream)

    def _send_data(self, stream_id: int, stream: Stream, chunk: bytes, end: bool) -> None:
        size = len(chunk)
        stream.send_window -= size
        self._send_conn -= size
        # data_frame's bytes, appended as header and payload (no copy of the payload in between).
        out = self._out
        out += FRAME_HEADER.pack(size >> 8, size & 0xFF, DATA, END_STREAM if end else 0, stream_id)
        out += chunk
        if end:
            self._local_end(stream_id, stream)

    def _send_reset(self, stream_id: int, code: int) -> bool:
        """RST_STREAM on a stream that is not closed (RFC 9113 5.1: never on a closed one)."""
        if self.closed or stream_id not in self._streams:
            return False
        self._out += rst_stream_frame(stream_id, code)
        self._forget(stream_id, reset=True)
        return True

    def _answer_reset(self, stream_id: int, code: int) -> None:
        """RST_STREAM in answer to a peer's frame: counted as the answers to SETTINGS and PING
        are (a peer that does not read)."""
        self._out += rst_stream_frame(stream_id, code)
        self._count_control()

    def _stream_error(self, stream_id: int, code: int, why: str, events: list[H2Event]) -> None:
        """RFC 9113 5.4.2: the stream ends (RST_STREAM), the connection goes on."""
        self._send_reset(stream_id, code)
        self._count_control()
        if self._end(stream_id):
            events.append(StreamReset(stream_id, int(code), by_peer=False, why=why))

    def _end(self, stream_id: int) -> bool:
        """The stream is over for us: credit its unconsumed bytes to the connection window.
        True if it was live."""
        unacked = self._unacked.pop(stream_id, 0)
        if unacked and not self.closed:
            self._credit(unacked, stream_id)
        if stream_id in self._live:
            self._live.discard(stream_id)
            return True
        return False

    def goaway(self, code: int = ErrorCode.NO_ERROR) -> None:
        """End the connection: GOAWAY naming the last stream the peer opened."""
        if self.closed:
            return
        self.closed = True
        self._out += goaway_frame(self._highest_inbound, code)

    def _calm(self, message: str, rule: str) -> NoReturn:
        self._fail(message, ErrorCode.ENHANCE_YOUR_CALM, rule)

    def _fail(self, message: str, code: int, rule: str) -> NoReturn:
        self.goaway(code)
        self.closed = True
        self._live.clear()
        self._unacked.clear()
        self._buffer.clear()
        raise Http2ConnectionError(message, error_code=int(code), rule=rule)

    # Indexed by frame type (RFC 9113 6); types past the end are unknown, and ignored.
    _handlers = (
        _on_data,
        _on_headers,
        _on_priority,
        _on_rst_stream,
        _on_settings,
        _on_push_promise,
        _on_ping,
        _on_goaway,
        _on_window_update,
        _on_continuation,
    )


_FLOW_CONTROL = (ErrorCode.FLOW_CONTROL_ERROR, "h2_flow_control")
