"""The limits of one HTTP/2 connection, and the token buckets that enforce the rate limits.

Every limit here is counted per connection (docs/proxy.md "HTTP/2" lists the defaults next to
Envoy's edge values). `proxycore.protocol.http2.endpoint` enforces them: the protocol's own
(concurrent streams, frame size, HPACK's decoded header list size, flow-control windows) as it
handles each frame, the rest counted frame by frame before the frame is handled.
"""

from __future__ import annotations

import msgspec

__all__ = ["H2Limits", "TokenBucket"]

# RFC 9113 5.1.1: stream identifiers are 31-bit; a client's are odd, the last is 2**31 - 1.
MAX_STREAM_ID = 2**31 - 1


class H2Limits(msgspec.Struct, frozen=True, kw_only=True):
    # RFC 9113 6.5.2 SETTINGS_MAX_CONCURRENT_STREAMS; Envoy edge: 100. A stream over it is
    # refused with a connection error (PROTOCOL_ERROR), as RFC 9113 5.1.2 allows.
    max_concurrent_streams: int = 100
    # SETTINGS_INITIAL_WINDOW_SIZE; Envoy edge initial_stream_window_size: 65536 (64 KiB). What
    # the proxy holds of one stream's request body never exceeds it.
    initial_stream_window: int = 65536
    # The connection's receive window (a WINDOW_UPDATE on stream 0 after the preface); Envoy
    # edge initial_connection_window_size: 1048576 (1 MiB). Bounds a connection's buffered
    # request bodies together.
    connection_window: int = 1024 * 1024
    # SETTINGS_MAX_FRAME_SIZE: the RFC's minimum and default.
    max_frame_size: int = 16384
    # SETTINGS_MAX_HEADER_LIST_SIZE, enforced by HPACK while it decodes (RFC 7541 4.1 sizes:
    # name + value + 32 per field): the HPACK bomb (CVE-2016-6581) ends in GOAWAY
    # ENHANCE_YOUR_CALM. As the HTTP/1.1 header section limit; Envoy: 60 KiB.
    max_header_list_size: int = 32768
    # SETTINGS_HEADER_TABLE_SIZE: HPACK's dynamic table (the RFC default).
    header_table_size: int = 4096
    # One header block (HEADERS plus its CONTINUATION frames), counted before it is buffered:
    # the CONTINUATION flood of 2024 (CVE-2024-27316 and siblings) sends endless CONTINUATION
    # frames that are buffered before any decoding; we stop at these.
    max_header_block_bytes: int = 65536
    max_continuation_frames: int = 16
    # Rapid reset (CVE-2023-44487): streams the client resets, as a token bucket (burst, refill
    # per second). nghttp2's fix: 1000 burst, 33/s; Envoy closes a connection when over half of
    # at least 500 streams were reset before 1 s.
    reset_burst: int = 200
    reset_rate: float = 33.0
    # SETTINGS and PING floods (CVE-2019-9515, CVE-2019-9512): frames the proxy must answer.
    settings_burst: int = 16
    settings_rate: float = 2.0
    ping_burst: int = 32
    ping_rate: float = 10.0
    # PRIORITY frames (CVE-2019-9513 "resource loop"): parsed and ignored, but each costs.
    priority_burst: int = 200
    priority_rate: float = 100.0
    # Frames with an empty payload that do nothing (CVE-2019-9518): Envoy
    # max_consecutive_inbound_frames_with_empty_payload is 1.
    max_consecutive_empty_frames: int = 1
    # Control frames (SETTINGS and PING acknowledgements, RST_STREAM, WINDOW_UPDATE) the proxy
    # has queued and the client has not read: Envoy max_outbound_control_frames 1000.
    max_outbound_control_frames: int = 1000
    # A stream whose response waits for the client to open its flow-control window (a
    # zero-window stall) is reset after this many seconds.
    stall_timeout: float = 30.0
    # Streams with a higher identifier are refused and the connection is told to go away
    # (GOAWAY NO_ERROR): a client that exhausts the identifiers opens a new connection.
    max_stream_id: int = MAX_STREAM_ID
    # RFC 8441 SETTINGS_ENABLE_CONNECT_PROTOCOL: WebSocket over a stream (extended CONNECT).
    extended_connect: bool = True


class TokenBucket:
    """`burst` tokens, refilled at `rate` per second; `take` says whether one was left."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, burst: int, rate: float) -> None:
        self.burst = float(burst)
        self.rate = rate
        self.tokens = float(burst)
        self.stamp = 0.0

    def take(self, now: float) -> bool:
        if self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True
