"""Fuzz the sans-IO HTTP/2 server (proxycore/protocol/http2) with frames in random splits.

The input is a split mode and a sequence of steps: frames a client sends (well-formed HEADERS
from an HPACK encoder, or anything: CONTINUATION, DATA, RST_STREAM, SETTINGS, PING,
WINDOW_UPDATE, PRIORITY, GOAWAY, raw garbage), and the proxy's own commands on the streams it
was told about (response heads, data, resets, acknowledgements, END_STREAM). The client's
bytes are fed in one chunk, byte by byte, or in splits the input chooses.

Invariants:
- only `Http2ConnectionError` escapes `receive_data`, and nothing escapes a command;
- the server never sends a frame the client's state forbids: HEADERS, DATA and RST_STREAM only
  on a stream the client opened and the server reported; no HEADERS or DATA on a stream after
  its END_STREAM or RST_STREAM (ours or the client's); DATA only after HEADERS; no
  PUSH_PROMISE; nothing after a GOAWAY with an error; DATA within the windows the client gave
  (the connection's: 65535 plus its WINDOW_UPDATEs on stream 0);
- memory stays bounded: at most one incomplete frame held, at most a stream window of
  unacknowledged body per stream;
- an extended CONNECT (RFC 8441) is either refused (`MessageRefused`) or written as one HTTP/1.1
  head that the strict parser reads whole as a WebSocket handshake.
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
from proxycore.protocol import http1
from proxycore.protocol.http2 import (
    PREFACE,
    DataReceived,
    H2Limits,
    H2Server,
    MessageRefused,
    RequestReceived,
    StreamReset,
)
from proxycore.protocol.http2.websocket import is_extended_connect, websocket_head
from proxycore.protocol.websocket import wants_websocket

# Small limits, so that the fuzzer reaches them.
LIMITS = H2Limits(
    max_concurrent_streams=8,
    initial_stream_window=4096,
    connection_window=16384,
    max_header_list_size=2048,
    max_header_block_bytes=4096,
    max_continuation_frames=4,
    reset_burst=8,
    settings_burst=4,
    ping_burst=4,
    priority_burst=8,
    max_outbound_control_frames=16,
    max_stream_id=201,
)
_PATHS = (b"/", b"/anthropic/v1/messages", b"/_appliance/health", b"http://x/")


class _Checker:
    """What the client may receive, from what it sent and what the server told us."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.opened: set[int] = set()  # reported to us as requests
        self.closed: set[int] = set()  # END_STREAM or RST_STREAM sent, or reset by the client
        self.answered: set[int] = set()  # a final response head (status 200 or over) went out
        self.decoder = hpack.Decoder()
        # The client may allow our encoder any table size (SETTINGS_HEADER_TABLE_SIZE).
        self.decoder.max_allowed_table_size = 2**32
        self.goaway_error = False
        self.data_sent = 0
        self.window = 65535  # the connection's send window the client gave

    def client_frame(self, frame: Frame) -> None:
        if isinstance(frame, WindowUpdateFrame) and frame.stream_id == 0:
            self.window += frame.window_increment

    def output(self, data: bytes) -> None:
        self.buffer += data
        for frame in drain_frames(self.buffer):
            self._check(frame)

    def _check(self, frame: Frame) -> None:
        assert not self.goaway_error, f"{frame!r} after a GOAWAY with an error"
        assert not isinstance(frame, PushPromiseFrame)
        sid = frame.stream_id
        if isinstance(frame, GoAwayFrame):
            self.goaway_error = frame.error_code != 0
        elif isinstance(frame, HeadersFrame | DataFrame):
            assert sid in self.opened, f"{frame!r} on a stream the client never opened"
            assert sid not in self.closed, f"{frame!r} on a closed stream"
            if isinstance(frame, DataFrame):
                assert sid in self.answered, "DATA before HEADERS"
                self.data_sent += frame.flow_controlled_length
                assert self.data_sent <= self.window, "DATA beyond the connection window"
            else:
                fields = self.decoder.decode(frame.data, raw=True)
                # Our encoder (hpack_out.py) never indexes: the client's table stays empty.
                assert not self.decoder.header_table.dynamic_entries
                status = dict(fields).get(b":status", b"0")
                assert sid not in self.answered, "a second response head on the stream"
                if int(status) >= 200:
                    self.answered.add(sid)
            if "END_STREAM" in frame.flags:
                self.closed.add(sid)
        elif isinstance(frame, RstStreamFrame):
            assert sid != 0
            self.closed.add(sid)


def _client_frames(r: Reader, encoder: hpack.Encoder) -> bytes:
    kind = r.byte() % 12
    sid = (r.byte() % 64) * 2 + 1
    flags_byte = r.byte()
    if kind == 0:
        fields = [
            (b":method", (b"GET", b"POST", b"CONNECT", b"")[flags_byte % 4]),
            (b":scheme", b"http"),
            (b":authority", b"10.0.0.1:9119"),
            (b":path", _PATHS[(flags_byte >> 2) % len(_PATHS)]),
        ]
        if flags_byte & 0x40:
            # RFC 8441 extended CONNECT (or :protocol where it is malformed).
            fields.append((b":protocol", (b"websocket", b"other")[flags_byte >> 7]))
        for _ in range(r.byte() % 4):
            fields.append((b"x-" + bytes([97 + r.byte() % 26]), r.bytes(r.byte() % 40)))
        block = encoder.encode(fields)
        flags = ["END_HEADERS"]
        if flags_byte & 0x10:
            flags.append("END_STREAM")
        return header_frames(sid, block, flags, split=bool(flags_byte & 0x20))
    if 1 <= kind <= 7:  # CONTINUATION, DATA, RST_STREAM, SETTINGS, PING, WINDOW_UPDATE, PRIORITY
        return peer_frame(kind - 1, r, sid, flags_byte)
    if kind == 8:
        return GoAwayFrame(0, last_stream_id=sid, error_code=flags_byte % 14).serialize()
    if kind == 9:
        return raw_frame(r, sid, flags_byte)
    if kind == 10:
        return HeadersFrame(sid, r.bytes(r.byte()), flags=["END_HEADERS"]).serialize()
    return b""  # 11: a point where the server acts


def _act(r: Reader, server: H2Server, live: list[int], checker: _Checker) -> None:
    for sid in list(live):
        action = r.byte() % 7
        if action == 0:
            name = (b"content-type", b"Bad-Case", b"connection", b"x-y", b"set-cookie")[
                r.byte() % 5
            ]
            value = (b"text/plain", b" padded", b"a\r\nb", b"", b"")[r.byte() % 5]
            value = value or r.bytes(r.byte() % 200)  # any bytes: the stateless encoder's input
            server.send_headers(sid, 200, [(name, value)], end=False)
        elif action == 1:
            server.send_headers(sid, 100 + r.byte() % 400, [], end=r.byte() & 1 == 1)
        elif action == 2:
            server.send_data(sid, b"r" * (r.byte() * 64), end=r.byte() & 1 == 1)
        elif action == 3:
            server.reset(sid)
        elif action == 4:
            server.acknowledge(sid, r.byte() * 16)
        elif action == 5:
            server.end_stream(sid)
        elif action == 6:
            server.stop_receiving(sid)
        checker.output(server.data_to_send())


def _check_websocket(event: RequestReceived) -> None:
    try:
        head = websocket_head(event, "10.0.0.1", b"dGhlIHNhbXBsZSBub25jZQ==")
    except MessageRefused:
        return
    parsed = http1.parse_request_head(head, http1.Limits())
    assert parsed is not None and parsed[1] == len(head), head
    assert wants_websocket(parsed[0]) and not parsed[0].keep_alive, head


def TestOneInput(data: bytes) -> None:
    r = Reader(data)
    mode = r.byte() % 3
    server = H2Server(LIMITS)
    checker = _Checker()
    encoder = hpack.Encoder()
    live: list[int] = []
    pending = bytearray(PREFACE + SettingsFrame(0).serialize())
    now = 1000.0
    while True:
        at_end = not r.left
        piece = b"" if at_end else _client_frames(r, encoder)
        if piece:
            # The checker's view of the windows the client gave (garbage gives none).
            for frame in parsed_frames(bytes(piece)):
                checker.client_frame(frame)
            pending += piece
            continue
        # A point where the client's bytes go in and the server acts.
        for chunk in splits(r, bytes(pending), mode):
            now += 0.001
            try:
                events = server.receive_data(chunk, now)
            except Http2ConnectionError:
                checker.output(server.data_to_send())
                assert server.closed
                return
            for event in events:
                if isinstance(event, RequestReceived):
                    checker.opened.add(event.stream_id)
                    live.append(event.stream_id)
                    if is_extended_connect(event):
                        _check_websocket(event)
                elif isinstance(event, StreamReset):
                    checker.closed.add(event.stream_id)
                elif isinstance(event, DataReceived):
                    assert len(event.data) <= event.flow_length
            checker.output(server.data_to_send())
            assert len(server._buffer) <= 9 + LIMITS.max_frame_size
            assert all(v <= LIMITS.initial_stream_window for v in server._unacked.values())
        pending.clear()
        live = [sid for sid in live if server.is_live(sid)]
        # A stream the server no longer serves is closed for the checker too (ours ended it).
        if at_end:
            return
        _act(r, server, live, checker)


def _seed(*parts: bytes) -> bytes:
    return b"".join(parts)


SEEDS = [
    b"",
    _seed(b"\x00", b"\x00\x00\x10\x00", b"\x0b\x00\x00"),  # one request, then act
    _seed(b"\x02", b"\x00\x01\x10\x00", b"\x02\x01\x01\x05", b"\x0b\x00\x00", b"\x00\x02"),
    _seed(b"\x01", b"\x00\x00\x00\x00", b"\x03\x00\x08", b"\x0b\x00\x00\x00\x03"),
    _seed(b"\x00", *[b"\x03\x00\x08"] * 20, b"\x0b"),
    _seed(b"\x00", b"\x00\x00\x00\x00", *[b"\x01\x00\x00\x10" + b"z" * 16] * 10, b"\x0b"),
    _seed(b"\x02", *[b"\x05\x00\x00" + b"12345678"] * 10, b"\x0b\x07"),
    _seed(b"\x00", b"\x06\x00\x01\x00\x00", b"\x0b\x01"),
    # Extended CONNECT (RFC 8441): the 200, frames both ways, then the client's END_STREAM.
    _seed(
        b"\x00",
        b"\x00\x00\x42\x00",
        b"\x0b",
        b"\x00\x00\x00",
        b"\x02\x00\x00\x04",
        b"\x0b",
        b"\x02\x20\x00",
        b"\x02\x00\x01\x00",
        b"\x0b",
        b"\x05",
    ),
    _seed(b"\x02", b"\x00\x01\xc2\x01\x00\x00", b"\x00\x02\x41\x00", b"\x0b\x03\x03"),
]


if __name__ == "__main__":
    from seeded import fuzz

    fuzz("h2", SEEDS, TestOneInput)
