"""Fuzz the sans-IO HTTP/2 client (proxycore/protocol/http2/client.py) against a hostile
upstream, with frames in random splits.

The input is a split mode and a sequence of steps: frames the upstream sends (SETTINGS,
well-formed response heads and trailers from an HPACK encoder, or anything: CONTINUATION,
DATA, RST_STREAM, PING, WINDOW_UPDATE, PRIORITY, GOAWAY, PUSH_PROMISE, raw garbage), and the
proxy's own commands (open a stream, send data or trailers, reset, finish, acknowledge). The
upstream's bytes are fed in one chunk, byte by byte, or in splits the input chooses.

Invariants:
- only `Http2ConnectionError` escapes `receive_data`, and nothing escapes a command (the
  harness sends only fields the client can carry);
- the client never sends a frame the upstream's state forbids: HEADERS opening a stream only
  with a new, increasing odd identifier; no HEADERS or DATA on a stream after our END_STREAM
  or after a RST_STREAM (ours or the upstream's); RST_STREAM only on a stream we opened; no
  PUSH_PROMISE; nothing after our GOAWAY
  with an error; DATA within the connection window the upstream gave (65535 plus its
  WINDOW_UPDATEs on stream 0); never more streams open than the upstream's
  SETTINGS_MAX_CONCURRENT_STREAMS;
- memory stays bounded: at most one incomplete frame held, at most a stream window of
  unacknowledged body per stream.
"""

from __future__ import annotations

import os
import sys

import hpack
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PushPromiseFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fuzz.h2_frames import (
    Reader,
    drain_frames,
    header_frames,
    parsed_frames,
    peer_frame,
    raw_frame,
    splits,
)
from proxycore.errors import Http2ConnectionError
from proxycore.protocol.http2 import H2Client, H2Limits, ResponseReceived, StreamReset

LIMITS = H2Limits(
    max_concurrent_streams=8,
    initial_stream_window=4096,
    connection_window=16384,
    max_header_list_size=2048,
    max_header_block_bytes=4096,
    max_continuation_frames=4,
    settings_burst=4,
    ping_burst=4,
    priority_burst=8,
    max_outbound_control_frames=16,
)
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_REQUEST = [
    (b":method", b"POST"),
    (b":scheme", b"https"),
    (b":authority", b"api.example.test"),
    (b":path", b"/v1/x"),
    (b"te", b"trailers"),
]


class _Checker:
    """What the upstream may receive, from what it sent and what the client sent before."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.preface_seen = False
        self.highest = 0
        self.open: set[int] = set()  # opened by us, not ended by both sides nor reset
        self.ended: set[int] = set()  # our END_STREAM went out
        self.reset: set[int] = set()  # reset by us or by the upstream
        self.goaway_error = False
        self.data_sent = 0
        self.window = 65535
        self.max_streams = 2**31
        self.peer_ended: set[int] = set()

    def upstream_frame(self, frame: Frame) -> None:
        if isinstance(frame, WindowUpdateFrame) and frame.stream_id == 0:
            self.window += frame.window_increment
        elif isinstance(frame, RstStreamFrame) and frame.stream_id in self.open:
            # (On a stream we have not opened it is no reset: the identifier is still idle.)
            self.reset.add(frame.stream_id)
        elif isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
            value = frame.settings.get(SettingsFrame.MAX_CONCURRENT_STREAMS)
            if value is not None:
                self.max_streams = value

    def output(self, data: bytes) -> None:
        self.buffer += data
        if not self.preface_seen:
            if len(self.buffer) < len(_PREFACE):
                return
            assert self.buffer[: len(_PREFACE)] == _PREFACE
            del self.buffer[: len(_PREFACE)]
            self.preface_seen = True
        for frame in drain_frames(self.buffer):
            self._check(frame)

    def _check(self, frame: Frame) -> None:
        assert not self.goaway_error, f"{frame!r} after our GOAWAY with an error"
        assert not isinstance(frame, PushPromiseFrame)
        sid = frame.stream_id
        if isinstance(frame, GoAwayFrame):
            self.goaway_error = frame.error_code != 0
        elif isinstance(frame, HeadersFrame):
            if sid not in self.open:
                assert sid % 2 == 1 and sid > self.highest, f"HEADERS opening {sid}"
                self.highest = sid
                self.open.add(sid)
                live = {s for s in self.open if s not in self.reset and s not in self.ended}
                assert len(live) <= self.max_streams, "more streams than the upstream allows"
            assert sid not in self.ended, "HEADERS after our END_STREAM"
            assert sid not in self.reset, "HEADERS on a reset stream"
        elif isinstance(frame, DataFrame):
            assert sid in self.open, "DATA on a stream never opened"
            assert sid not in self.ended, "DATA after our END_STREAM"
            assert sid not in self.reset, "DATA on a reset stream"
            self.data_sent += frame.flow_controlled_length
            assert self.data_sent <= self.window, "DATA beyond the connection window"
        elif isinstance(frame, RstStreamFrame):
            # Also allowed on a closed stream: the answer to a frame the upstream sent on it
            # after its own reset (RFC 9113 5.1, 5.4.2).
            assert sid != 0 and sid in self.open, "RST_STREAM on a stream never opened"
            self.reset.add(sid)
        if isinstance(frame, HeadersFrame | DataFrame) and "END_STREAM" in frame.flags:
            self.ended.add(sid)


def _upstream_frames(r: Reader, encoder: hpack.Encoder, opened: list[int]) -> bytes:
    kind = r.byte() % 13
    pick = r.byte()
    sid = opened[pick % len(opened)] if opened and pick & 0x80 == 0 else (pick % 32) * 2 + 1
    flags_byte = r.byte()
    if kind in (0, 1):
        if kind == 0:
            fields = [(b":status", (b"200", b"404", b"100", b"abc")[flags_byte % 4])]
        else:
            fields = []  # trailers
        for _ in range(r.byte() % 4):
            name = (b"content-type", b"grpc-status", b"connection", b"x-y", b"content-length")
            fields.append((name[r.byte() % 5], r.bytes(r.byte() % 30)))
        block = encoder.encode(fields)
        flags = ["END_HEADERS"]
        if flags_byte & 0x10 or kind == 1:
            flags.append("END_STREAM")
        return header_frames(sid, block, flags, split=bool(flags_byte & 0x20))
    if 2 <= kind <= 8:  # CONTINUATION, DATA, RST_STREAM, SETTINGS, PING, WINDOW_UPDATE, PRIORITY
        return peer_frame(kind - 2, r, sid, flags_byte)
    if kind == 9:
        last = sid if flags_byte & 1 else 0
        return GoAwayFrame(0, last_stream_id=last, error_code=flags_byte % 14).serialize()
    if kind == 10:
        return PushPromiseFrame(sid, promised_stream_id=2, data=b"\x88").serialize()
    if kind == 11:
        return raw_frame(r, sid, flags_byte)
    return b""  # 12: a point where the client acts


def _act(r: Reader, client: H2Client, opened: list[int]) -> None:
    for _ in range(1 + r.byte() % 3):
        action = r.byte() % 7
        sid = opened[r.byte() % len(opened)] if opened else 1
        if action == 0 and client.can_open():
            client.reserve()
            opened.append(client.open_stream(_REQUEST, end=r.byte() & 1 == 1))
        elif action == 1:
            client.send_data(sid, b"u" * (r.byte() * 64), end=r.byte() & 1 == 1)
        elif action == 2:
            client.send_trailers(sid, [(b"x-checksum", b"abc")])
        elif action == 3:
            client.reset(sid)
        elif action == 4:
            client.finish(sid)
        elif action == 5:
            client.acknowledge(sid, r.byte() * 16)
        elif action == 6:
            client.goaway()


def TestOneInput(data: bytes) -> None:
    r = Reader(data)
    mode = r.byte() % 3
    client = H2Client(LIMITS)
    checker = _Checker()
    encoder = hpack.Encoder()
    opened: list[int] = []
    client.initiate()
    checker.output(client.data_to_send())
    pending = bytearray(SettingsFrame(0).serialize())
    checker.upstream_frame(SettingsFrame(0))
    now = 1000.0
    _act(r, client, opened)
    checker.output(client.data_to_send())
    while True:
        at_end = not r.left
        piece = b"" if at_end else _upstream_frames(r, encoder, opened)
        if piece:
            for frame in parsed_frames(piece):
                checker.upstream_frame(frame)
            pending += piece
            continue
        for chunk in splits(r, bytes(pending), mode):
            now += 0.001
            try:
                events = client.receive_data(chunk, now)
            except Http2ConnectionError:
                checker.output(client.data_to_send())
                assert client.closed
                return
            for event in events:
                if isinstance(event, StreamReset):
                    checker.reset.add(event.stream_id)
                elif isinstance(event, ResponseReceived):
                    assert event.stream_id in opened
            checker.output(client.data_to_send())
            assert len(client._buffer) <= 9 + LIMITS.max_frame_size
            assert all(v <= LIMITS.initial_stream_window for v in client._unacked.values())
        pending.clear()
        if at_end:
            return
        _act(r, client, opened)
        checker.output(client.data_to_send())


def _seed(*parts: bytes) -> bytes:
    return b"".join(parts)


SEEDS = [
    b"",
    # Open a stream; the upstream answers with a head, data and trailers.
    _seed(
        b"\x00", b"\x00\x00\x00\x00", b"\x00\x00\x00\x00", b"\x03\x00\x01\x02", b"\x01\x00\x00\x00"
    ),
    _seed(b"\x02", b"\x00\x00\x00\x00", *[b"\x06\x00\x00" + b"12345678"] * 10, b"\x0c"),
    _seed(b"\x01", b"\x00\x00\x00\x00", b"\x09\x00\x00", b"\x0c\x00\x00\x00"),
    _seed(b"\x00", b"\x00\x00\x00\x00", *[b"\x02\x00\x00\x10" + b"z" * 16] * 10, b"\x0c"),
    _seed(b"\x00", b"\x01\x00\x00\x00", b"\x05\x00\x00\x00\x03\x00\x00\x00\x00", b"\x0c"),
]


if __name__ == "__main__":
    from seeded import fuzz

    fuzz("h2-client", SEEDS, TestOneInput)
