"""The known HTTP/2 floods as raw frames (hyperframe, one HPACK encoder per connection), shared
by the attack tests against one worker (tests/test_proxy_http2_attacks.py) and the chaos suite
(tests/chaos_attacks_h2.py). Each builder returns the bytes to send after the preface."""

from __future__ import annotations

from collections.abc import Callable

import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from proxycore.protocol.http2 import ErrorCode


class FrameMaker:
    """Header blocks for one connection (its own HPACK encoder), counting the HEADERS frames
    it made: an upper bound of the streams a server may have started."""

    def __init__(self, authority: bytes, path: bytes = b"/_appliance/health") -> None:
        self.encoder = hpack.Encoder()
        self.authority = authority
        self.path = path
        self.streams = 0

    def request(self, path: bytes | None = None) -> list[tuple[bytes, bytes]]:
        return [
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":authority", self.authority),
            (b":path", path or self.path),
        ]

    def headers(self, stream_id: int, *, end: bool = True, path: bytes | None = None) -> bytes:
        self.streams += 1
        flags = ["END_HEADERS", "END_STREAM"] if end else ["END_HEADERS"]
        block = self.encoder.encode(self.request(path))
        return HeadersFrame(stream_id, block, flags=flags).serialize()


def rapid_reset(make: FrameMaker) -> bytes:
    """CVE-2023-44487: open a stream and reset it at once, over and over."""
    return b"".join(
        make.headers(i) + RstStreamFrame(i, error_code=ErrorCode.CANCEL).serialize()
        for i in range(1, 1201, 2)
    )


def continuation_flood(make: FrameMaker) -> bytes:
    """2024: a header block that never ends, CONTINUATION after CONTINUATION."""
    block = make.encoder.encode(make.request())
    return HeadersFrame(1, block[:3]).serialize() + b"".join(
        ContinuationFrame(1, b"\x00" * 1000).serialize() for _ in range(200)
    )


def hpack_bomb(make: FrameMaker) -> bytes:
    """A large field in the dynamic table, referenced again and again: a tiny block that
    decodes to megabytes."""
    block = make.encoder.encode([*make.request(), *[(b"x-bomb", b"a" * 4000)] * 500])
    assert len(block) < 5000
    make.streams += 1
    return HeadersFrame(1, block, flags=["END_HEADERS", "END_STREAM"]).serialize()


def settings_flood(make: FrameMaker) -> bytes:
    return SettingsFrame(0, settings={SettingsFrame.ENABLE_PUSH: 0}).serialize() * 5000


def ping_flood(make: FrameMaker) -> bytes:
    return PingFrame(0, b"flooding").serialize() * 5000


def too_many_streams(make: FrameMaker) -> bytes:
    """101 streams held open (no END_STREAM) on a connection that allows 100."""
    return b"".join(make.headers(i, end=False) for i in range(1, 203, 2))


def empty_frames(make: FrameMaker) -> bytes:
    return make.headers(1, end=False) + DataFrame(1, b"").serialize() * 100


# name: (the frames, the GOAWAY code the attack earns, the rule the journal names)
FLOODS: dict[str, tuple[Callable[[FrameMaker], bytes], int, str]] = {
    "rapid_reset": (rapid_reset, ErrorCode.ENHANCE_YOUR_CALM, "h2_rapid_reset"),
    "continuation_flood": (continuation_flood, ErrorCode.ENHANCE_YOUR_CALM, "h2_continuation"),
    "hpack_bomb": (hpack_bomb, ErrorCode.ENHANCE_YOUR_CALM, "h2_header_list"),
    "settings_flood": (settings_flood, ErrorCode.ENHANCE_YOUR_CALM, "h2_settings_flood"),
    "ping_flood": (ping_flood, ErrorCode.ENHANCE_YOUR_CALM, "h2_ping_flood"),
    "too_many_streams": (too_many_streams, ErrorCode.PROTOCOL_ERROR, "h2_max_concurrent_streams"),
    "empty_frames": (empty_frames, ErrorCode.ENHANCE_YOUR_CALM, "h2_empty_frames"),
}
