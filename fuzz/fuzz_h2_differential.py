"""Differential fuzzing of our HTTP/2 server core (proxycore/protocol/http2) against the h2
package's server, on the same client frames.

The input is a sequence of client frames, fed one frame at a time to both: well-formed
requests from an HPACK encoder (one HEADERS frame, or HEADERS and CONTINUATION), request bodies,
trailers, RST_STREAM, SETTINGS, PING, WINDOW_UPDATE, PRIORITY, unknown frame types, and raw
frames of any type with any payload. Both servers advertise the same settings; ours gets limits
too high for its flood accounting to refuse anything (that accounting is tested on its own in
tests/test_http2_sansio.py), so what is compared is the protocol.

Invariant: both deliver the same requests (stream, method, scheme, authority, path, fields in
order, cookies joined as RFC 9113 8.2.3 says), the same body bytes per request, and refuse the
connection at the same frame (or neither does).

What the generator never sends, because there the two differ by design (ours follows RFC 9113,
h2 ends the whole connection): a header block on a stream the client already ended, trailers
without END_STREAM, a content-length the body does not match (RFC 9113 8.1.1 makes these
stream errors, which end one stream only), a WINDOW_UPDATE of 0 on a stream (6.9: a stream
error), RST_STREAM on an idle stream once a stream was opened (5.1: a connection error; h2
ignores it then), an ALTSVC frame (RFC 7838 4: a server ignores it; h2 refuses one it cannot
parse), and anything after a GOAWAY (h2 then refuses every frame; ours stops reading).
"""

from __future__ import annotations

import os
import sys

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fuzz.h2_frames import Reader
from proxycore.errors import Http2ConnectionError
from proxycore.protocol.http2 import (
    PREFACE,
    DataReceived,
    H2Limits,
    H2Server,
    RequestReceived,
)

# The protocol's own limits small enough to be reached; the flood accounting out of the way.
LIMITS = H2Limits(
    max_concurrent_streams=4,
    initial_stream_window=4096,
    connection_window=65535 + 8192,
    max_header_list_size=2048,
    max_header_block_bytes=1 << 20,
    max_continuation_frames=60,
    reset_burst=1 << 20,
    settings_burst=1 << 20,
    ping_burst=1 << 20,
    priority_burst=1 << 20,
    max_consecutive_empty_frames=1 << 20,
    max_outbound_control_frames=1 << 20,
    extended_connect=False,
)
_PATHS = (b"/", b"/v1/messages", b"/a?b=c")
_NAMES = (b"x-a", b"cookie", b"user-agent", b"accept", b"x-b")
Request = tuple[int, bytes, bytes, bytes, bytes, tuple[tuple[bytes, bytes], ...]]


class _Reference:
    """The h2 package's server, configured as the proxy's agent side was before it had its own
    core (no header validation of requests, cookies joined)."""

    def __init__(self) -> None:
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            validate_inbound_headers=False,
            normalize_inbound_headers=True,
        )
        conn = h2.connection.H2Connection(config)
        codes = h2.settings.SettingCodes
        conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                codes.MAX_CONCURRENT_STREAMS: LIMITS.max_concurrent_streams,
                codes.MAX_HEADER_LIST_SIZE: LIMITS.max_header_list_size,
                codes.INITIAL_WINDOW_SIZE: LIMITS.initial_stream_window,
                codes.MAX_FRAME_SIZE: LIMITS.max_frame_size,
                codes.HEADER_TABLE_SIZE: LIMITS.header_table_size,
                codes.ENABLE_PUSH: 0,
            },
        )
        conn.decoder.max_header_list_size = LIMITS.max_header_list_size
        conn.decoder.max_allowed_table_size = LIMITS.header_table_size
        conn.max_inbound_frame_size = LIMITS.max_frame_size
        conn.initiate_connection()
        conn.increment_flow_control_window(LIMITS.connection_window - 65535)
        self.conn = conn
        self.requests: list[Request] = []
        self.bodies: dict[int, bytes] = {}

    def feed(self, data: bytes) -> bool:
        """False: the connection was refused."""
        try:
            events = self.conn.receive_data(data)
        except Exception:
            return False
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                assert event.stream_id is not None
                self.requests.append(_request_of_fields(event.stream_id, event.headers or []))
                self.bodies[event.stream_id] = b""
            elif isinstance(event, h2.events.DataReceived):
                assert event.stream_id is not None
                if event.stream_id in self.bodies:
                    self.bodies[event.stream_id] += event.data or b""
                self.conn.acknowledge_received_data(
                    event.flow_controlled_length or 0, event.stream_id
                )
        self.conn.data_to_send()
        return True


class _Ours:
    def __init__(self) -> None:
        self.server = H2Server(LIMITS)
        self.requests: list[Request] = []
        self.bodies: dict[int, bytes] = {}
        self.now = 1000.0

    def feed(self, data: bytes) -> bool:
        self.now += 0.001
        try:
            events = self.server.receive_data(data, self.now)
        except Http2ConnectionError:
            return False
        for event in events:
            if isinstance(event, RequestReceived):
                fields = [
                    (b":method", event.method),
                    (b":scheme", event.scheme),
                    (b":authority", event.authority),
                    (b":path", event.path),
                    *event.headers,
                ]
                self.requests.append(_request_of_fields(event.stream_id, fields))
                self.bodies[event.stream_id] = b""
            elif isinstance(event, DataReceived):
                self.bodies[event.stream_id] += event.data
                self.server.acknowledge(event.stream_id, event.flow_length)
        self.server.data_to_send()
        return True


def _request_of_fields(stream_id: int, fields: object) -> Request:
    """A request as both sides can state it: pseudo-headers, then the regular fields in order
    with the cookie fields joined into one at the end (RFC 9113 8.2.3)."""
    pseudo: dict[bytes, bytes] = {}
    regular: list[tuple[bytes, bytes]] = []
    cookies: list[bytes] = []
    for name, value in fields:  # type: ignore[attr-defined]
        name, value = bytes(name), bytes(value)
        if name[:1] == b":":
            pseudo.setdefault(name, value)
        elif name == b"cookie":
            cookies.append(value)
        else:
            regular.append((name, value))
    if cookies:
        regular.append((b"cookie", b"; ".join(cookies)))
    authority = pseudo.get(b":authority")
    if authority is None:
        authority = next((v for n, v in regular if n == b"host"), b"")
    return (
        stream_id,
        pseudo.get(b":method", b""),
        pseudo.get(b":scheme", b""),
        authority,
        pseudo.get(b":path", b""),
        tuple(regular),
    )


class _Client:
    """The frames the input chooses, and what the generator must remember to avoid the
    differences by design (see the module docstring)."""

    def __init__(self, r: Reader) -> None:
        self.r = r
        self.encoder = hpack.Encoder()
        self.ended: set[int] = set()  # streams whose END_STREAM was sent
        self.opened: set[int] = set()

    def frames(self) -> list[bytes] | None:
        """The next step's frames; None at a GOAWAY (the end of the sequence)."""
        r = self.r
        kind = r.byte() % 16
        sid = (r.byte() % 12) * 2 + 1
        flags = r.byte()
        if kind <= 4:
            if not flags & 0x40:
                # Mostly the next stream (or trailers on the last): opened in order.
                sid = max(self.opened, default=-1) + 2 * (1 - (flags & 0x80) // 0x80)
                sid = max(sid, 1)
            return self._headers(sid, flags)
        open_streams = sorted(self.opened - self.ended)
        if not flags & 0x40:
            # Mostly where a frame is expected: on a stream the client has open.
            if not open_streams:
                return []
            sid = open_streams[sid % len(open_streams)]
        kind = (3, 3, 3, 3, 4, 5, 6, 7, 8, 9, 10)[kind - 5]
        if kind == 3:  # a request body piece
            if sid in self.ended:
                if not flags & 0x40:
                    return []
                sid += 2 * 12  # an idle stream (or one ended too: skipped below)
                if sid in self.ended:
                    return []
            end = bool(flags & 1)
            padded = flags & 2
            data = b"d" * (r.byte() * 4)
            frame = DataFrame(sid, data, flags=["END_STREAM"] if end else [])
            if padded:
                frame.flags.add("PADDED")
                frame.pad_length = r.byte() % 32
            if end:
                self.ended.add(sid)
            return [frame.serialize()]
        if kind == 4:
            if self._idle_after_open(sid):
                return []
            self.ended.add(sid)
            return [RstStreamFrame(sid, error_code=flags % 14).serialize()]
        if kind == 5:
            if flags & 1:
                return [SettingsFrame(0, flags=["ACK"]).serialize()]
            setting = 1 + r.byte() % 8
            value = int.from_bytes(r.bytes(4).ljust(4, b"\0"), "big")
            return [SettingsFrame(0, settings={setting: value}).serialize()]
        if kind == 6:
            data = r.bytes(8).ljust(8, b"\0")
            return [PingFrame(0, data, flags=["ACK"] if flags & 1 else []).serialize()]
        if kind == 7:
            stream = 0 if flags & 1 else sid
            increment = 1 + int.from_bytes(r.bytes(3).ljust(3, b"\0"), "big")
            return [WindowUpdateFrame(stream, window_increment=increment).serialize()]
        if kind == 8:
            return [PriorityFrame(sid, depends_on=r.byte(), stream_weight=r.byte()).serialize()]
        if kind == 9:  # an unknown type, ignored by both (RFC 9113 5.5); not ALTSVC (0xA)
            length = r.byte() % 16
            header = length.to_bytes(3, "big") + bytes([0xB + r.byte() % 5, flags])
            return [header + sid.to_bytes(4, "big") + r.bytes(length).ljust(length, b"\0")]
        return self._raw(sid, flags)

    def _headers(self, sid: int, flags: int) -> list[bytes]:
        r = self.r
        if sid in self.ended:
            sid += 2 * 12
            if sid in self.ended:
                return []
        fields: list[tuple[bytes, bytes]] = []
        trailers = sid in self.opened
        if not trailers:
            fields = [
                (b":method", (b"GET", b"POST", b"CONNECT", b"")[flags % 4]),
                (b":scheme", b"http"),
                (b":authority", b"10.0.0.1:9119"),
                (b":path", _PATHS[(flags >> 2) % len(_PATHS)]),
            ]
        for _ in range(r.byte() % 4):
            name = _NAMES[r.byte() % len(_NAMES)]
            fields.append((name, r.bytes(r.byte() % 12)))
        block = self.encoder.encode(fields)
        end = trailers or bool(flags & 0x10)
        if end:
            self.ended.add(sid)
        self.opened.add(sid)
        head_flags = ["END_STREAM"] if end else []
        if flags & 0x20 and len(block) > 1:
            half = len(block) // 2
            return [
                HeadersFrame(sid, block[:half], flags=head_flags).serialize(),
                ContinuationFrame(sid, block[half:], flags=["END_HEADERS"]).serialize(),
            ]
        return [HeadersFrame(sid, block, flags=[*head_flags, "END_HEADERS"]).serialize()]

    def _idle_after_open(self, sid: int) -> bool:
        """RST_STREAM on an idle stream: RFC 9113 5.1 makes it a connection error (ours);
        h2 refuses it only before the first stream, and ignores it after."""
        return bool(self.opened) and sid not in self.opened

    def _raw(self, sid: int, flags: int) -> list[bytes]:
        """A frame of a known type other than HEADERS, CONTINUATION and GOAWAY (whose contents
        decide the HPACK state or end the sequence), with any payload."""
        r = self.r
        kind = (0, 2, 3, 4, 5, 6, 8)[r.byte() % 7]
        length = r.byte() % 24
        if kind == 0:
            if sid in self.ended:
                return []
            if flags & 1:
                self.ended.add(sid)
        if kind == 3:
            if self._idle_after_open(sid) and not flags & 0x40:
                return []
            self.ended.add(sid)
        if kind == 8 and length == 4:
            return []  # a WINDOW_UPDATE of 0 on a stream is possible here
        if kind == 5:
            # h2 holds a PUSH_PROMISE until its header block ends, ours refuses it at once.
            flags |= 0x4
        stream = 0 if flags & 0x40 else sid
        header = length.to_bytes(3, "big") + bytes([kind, flags])
        return [header + stream.to_bytes(4, "big") + r.bytes(length).ljust(length, b"\0")]


def TestOneInput(data: bytes) -> None:
    r = Reader(data)
    ours, reference = _Ours(), _Reference()
    start = PREFACE + SettingsFrame(0).serialize()
    assert ours.feed(start) and reference.feed(start)
    client = _Client(r)
    step = 0
    while r.left:
        frames = client.frames()
        if frames is None:
            return
        for frame in frames:
            step += 1
            ours_alive, reference_alive = ours.feed(frame), reference.feed(frame)
            assert ours.requests == reference.requests, (step, ours.requests, reference.requests)
            assert ours_alive == reference_alive, (step, frame, ours_alive, reference_alive)
            if not ours_alive:
                return
            for stream_id, body in reference.bodies.items():
                assert ours.bodies.get(stream_id) == body, (step, stream_id)


def _seed(*parts: bytes) -> bytes:
    return b"".join(parts)


SEEDS = [
    b"",
    _seed(b"\x00\x00\x10\x00"),  # a GET that ends at its head
    _seed(b"\x00\x00\x01\x00", b"\x03\x00\x00\x10", b"\x03\x00\x01\x04"),  # a POST and its body
    _seed(b"\x01\x01\x21\x02\x00\x03\x04x=1\x00\x02y2"),  # HEADERS + CONTINUATION, cookies
    _seed(*[b"\x00" + bytes([i]) + b"\x01\x00" for i in range(6)]),  # over the concurrency
    _seed(b"\x00\x00\x01\x00", b"\x00\x00\x00\x01\x04\x00"),  # trailers
    _seed(b"\x05\x00\x00\x04\x00\x00\x00\x00", b"\x07\x00\x00\x01\x00\x00"),  # SETTINGS, window
    _seed(b"\x00\x00\x01\x00", b"\x03\x00\x02\x40\x05"),  # padded DATA
    _seed(b"\x0a\x00\x00\x00\x05", b"\x0a\x00\x00\x02\x10"),  # raw frames
]


if __name__ == "__main__":
    from seeded import fuzz

    fuzz("h2-differential", SEEDS, TestOneInput)
