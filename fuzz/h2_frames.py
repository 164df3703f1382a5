"""What the two HTTP/2 fuzz harnesses share: reading choices from the input, the frames a
hostile peer sends (fuzz_h2.py plays an agent, fuzz_h2_client.py an upstream), and the splits
the bytes are fed in.

Each harness keeps its own numbering of frame kinds (so the inputs it found stay what they
were) and maps its numbers onto `peer_frame`'s kinds; every draw from the input happens in the
same order as when each harness built the frames itself.
"""

from __future__ import annotations

from collections.abc import Iterator

from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

# The kinds `peer_frame` builds, in the order both harnesses number them.
CONTINUATION, DATA, RST_STREAM, SETTINGS, PING, WINDOW_UPDATE, PRIORITY = range(7)


class Reader:
    """Draws from the fuzz input; past its end every byte is 0."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.i = 0

    def byte(self) -> int:
        if self.i >= len(self.data):
            return 0
        self.i += 1
        return self.data[self.i - 1]

    def bytes(self, n: int) -> bytes:
        out = self.data[self.i : self.i + n]
        self.i += n
        return out

    @property
    def left(self) -> bool:
        return self.i < len(self.data)


def header_frames(sid: int, block: bytes, flags: list[str], *, split: bool) -> bytes:
    """A header block as one HEADERS frame with `flags`, or (`split`) cut in two: HEADERS
    without END_HEADERS, then a CONTINUATION frame that ends it."""
    if split:
        half = len(block) // 2
        return (
            HeadersFrame(sid, block[:half], flags=flags[1:]).serialize()
            + ContinuationFrame(sid, block[half:], flags=["END_HEADERS"]).serialize()
        )
    return HeadersFrame(sid, block, flags=flags).serialize()


def peer_frame(kind: int, r: Reader, sid: int, flags_byte: int) -> bytes:
    """One frame of `kind` (CONTINUATION ... PRIORITY above), its contents drawn from `r`."""
    if kind == CONTINUATION:
        flags = ["END_HEADERS"] if flags_byte & 1 else []
        return ContinuationFrame(sid, r.bytes(r.byte()), flags=flags).serialize()
    if kind == DATA:
        flags = ["END_STREAM"] if flags_byte & 1 else []
        return DataFrame(sid, b"d" * (r.byte() * 8), flags=flags).serialize()
    if kind == RST_STREAM:
        return RstStreamFrame(sid, error_code=flags_byte % 14).serialize()
    if kind == SETTINGS:
        if flags_byte & 1:
            return SettingsFrame(0, flags=["ACK"]).serialize()
        setting = 1 + r.byte() % 8
        value = int.from_bytes(r.bytes(4).ljust(4, b"\0"), "big")
        return SettingsFrame(0, settings={setting: value}).serialize()
    if kind == PING:
        return PingFrame(
            0, r.bytes(8).ljust(8, b"\0"), flags=["ACK"] if flags_byte & 1 else []
        ).serialize()
    if kind == WINDOW_UPDATE:
        stream = 0 if flags_byte & 1 else sid
        increment = 1 + int.from_bytes(r.bytes(2).ljust(2, b"\0"), "big")
        return WindowUpdateFrame(stream, window_increment=increment).serialize()
    assert kind == PRIORITY
    return PriorityFrame(sid, depends_on=r.byte(), stream_weight=r.byte()).serialize()


def raw_frame(r: Reader, sid: int, flags_byte: int) -> bytes:
    """A frame header of any type (0-11) and a payload of the length it says: garbage."""
    length = r.byte()
    header = length.to_bytes(3, "big") + bytes([r.byte() % 12, flags_byte])
    return header + sid.to_bytes(4, "big") + r.bytes(length)


def parsed_frames(piece: bytes) -> Iterator[Frame]:
    """The whole, well-formed frames at the start of `piece` (what the checker may assume the
    peer sent); stops at the first one hyperframe cannot read (garbage the receiver refuses)."""
    view = memoryview(piece)
    while len(view) >= 9:
        try:
            frame, length = Frame.parse_frame_header(view[:9])
            if len(view) < 9 + length:
                break
            frame.parse_body(view[9 : 9 + length])
        except Exception:
            break
        yield frame
        view = view[9 + length :]


def drain_frames(buffer: bytearray) -> Iterator[Frame]:
    """The whole frames at the start of `buffer` (what the code under test sent), each removed
    before it is yielded; what it sends must parse (hyperframe raising is a finding)."""
    while len(buffer) >= 9:
        frame, length = Frame.parse_frame_header(memoryview(buffer[:9]))
        if len(buffer) < 9 + length:
            return
        frame.parse_body(memoryview(buffer[9 : 9 + length]))
        del buffer[: 9 + length]
        yield frame


def splits(r: Reader, data: bytes, mode: int) -> list[bytes]:
    """`data` in one chunk (mode 0), byte by byte (1), or in pieces of 1-97 bytes drawn from
    `r` (2)."""
    if mode == 0:
        return [data]
    if mode == 1:
        return [data[i : i + 1] for i in range(len(data))]
    out, i = [], 0
    while i < len(data):
        n = 1 + r.byte() % 97
        out.append(data[i : i + n])
        i += n
    return out
