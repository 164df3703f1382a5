"""The known HTTP/2 attacks, each sent as raw frames over a real socket to a real proxy: the
proxy answers with the right frame (GOAWAY or RST_STREAM and its code), the worker survives, a
connection opened before the attack and one opened after are served, and the journal names the
rule."""

from __future__ import annotations

import socket
import time

import hpack
import pytest
from hyperframe.frame import (
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from proxycore.protocol.events import RequestAllowed, RequestErrored, RequestRefused
from proxycore.protocol.http2 import PREFACE, ErrorCode
from tests.conftest import RunningProxy
from tests.h2_client import H2Client, goaway_code, parse_frames, resets
from tests.h2_floods import FLOODS, FrameMaker

MAX_STREAM_ID = 2**31 - 1


class RawConnection(FrameMaker):
    """A client that speaks HTTP/2 frames by hand (one HPACK encoder for its header blocks)."""

    def __init__(self, proxy: RunningProxy) -> None:
        super().__init__(f"{proxy.host}:{proxy.port}".encode())
        self.sock = socket.create_connection((proxy.host, proxy.port), timeout=10)
        self.sock.sendall(PREFACE + SettingsFrame(0).serialize())

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the proxy may close while the flood is still being sent

    def frames_until_close(self, timeout: float = 10.0) -> list:
        self.sock.settimeout(timeout)
        data = bytearray()
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        self.sock.close()
        return parse_frames(bytes(data))


def journal_rule(proxy: RunningProxy, rule: str) -> RequestRefused:
    found = [
        e
        for e in proxy.events()
        if isinstance(e, RequestRefused) and e.route == "connection" and e.rule == rule
    ]
    assert found, rule
    return found[-1]


@pytest.mark.parametrize("name", sorted(FLOODS))
def test_attack_is_refused_and_the_worker_survives(proxy: RunningProxy, name: str) -> None:
    build, code, rule = FLOODS[name]
    with H2Client(proxy) as before:
        assert before.get(1, "/_appliance/health")[0] == 200
        raw = RawConnection(proxy)
        started = time.monotonic()
        raw.send(build(raw))
        frames = raw.frames_until_close()
        assert time.monotonic() - started < 8, "the proxy did not end the connection"
        assert goaway_code(frames) == code, frames[-5:]
        # The connection opened before the attack, and a new one, are served.
        assert before.get(3, "/_appliance/health")[0] == 200
        with H2Client(proxy) as after:
            assert after.get(1, "/_appliance/health")[0] == 200
        assert proxy.process.poll() is None
    event = journal_rule(proxy, rule)
    assert "GOAWAY" in event.message
    if name == "too_many_streams":
        # The 100 streams it had each end in one terminal event, naming the connection's end.
        ended = [
            e
            for e in proxy.events()
            if isinstance(e, RequestErrored) and "h2_max_concurrent_streams" in e.cause
        ]
        assert len(ended) >= 100


def test_stream_id_exhaustion(proxy: RunningProxy) -> None:
    """The last client stream identifier: served, then GOAWAY NO_ERROR naming it (the client
    opens a new connection for what follows)."""
    raw = RawConnection(proxy)
    raw.send(raw.headers(MAX_STREAM_ID))
    raw.sock.shutdown(socket.SHUT_WR)
    frames = raw.frames_until_close()
    responses = [f for f in frames if isinstance(f, HeadersFrame)]
    assert responses and responses[0].stream_id == MAX_STREAM_ID
    away = [f for f in frames if isinstance(f, GoAwayFrame)]
    assert away and (away[0].error_code, away[0].last_stream_id) == (
        ErrorCode.NO_ERROR,
        MAX_STREAM_ID,
    )


def test_malformed_streams_are_refused_alone(proxy: RunningProxy) -> None:
    """Malformed requests (RFC 9113 8.1.1) are stream errors: each is answered 400 on its own
    stream, and the connection goes on serving the well-formed one beside them."""
    raw = RawConnection(proxy)
    request = raw.request()
    malformed = [
        [*request, (b"x-smuggle", b"a\r\ntransfer-encoding: chunked")],  # CR LF in a value
        [*request, (b"x-nul", b"a\x00b")],
        [*request, (b"x-odd", b"a\x01b")],
        [*request, (b"X-Upper", b"1")],  # RFC 9113 8.2.1: lowercase names only
        [*request, (b"connection", b"keep-alive")],  # RFC 9113 8.2.2
        [*request, (b"transfer-encoding", b"chunked")],
        [*request, (b"te", b"gzip")],
        [*request, (b":path", b"/again")],  # a pseudo-header twice
        [*request[:2], (b"x-a", b"1"), *request[2:]],  # a pseudo-header after a field
        request[:3],  # no :path
    ]
    for i, fields in enumerate(malformed):
        block = raw.encoder.encode(fields)
        raw.send(HeadersFrame(2 * i + 1, block, flags=["END_HEADERS", "END_STREAM"]).serialize())
    good = 2 * len(malformed) + 1
    raw.send(raw.headers(good))
    time.sleep(1)
    raw.sock.shutdown(socket.SHUT_WR)
    frames = raw.frames_until_close()
    assert goaway_code(frames) in (None, ErrorCode.NO_ERROR)
    statuses = {}
    decoder = hpack.Decoder()
    for frame in frames:
        if isinstance(frame, HeadersFrame):
            statuses[frame.stream_id] = dict(decoder.decode(frame.data))[":status"]
    expected = {2 * i + 1: "400" for i in range(len(malformed))}
    assert statuses == {**expected, good: "200"}, frames
    refused = [e for e in proxy.events() if isinstance(e, RequestRefused) and e.status == 400]
    assert len(refused) == len(malformed)


def test_zero_window_stall_resets_the_stream(make_proxy, provider) -> None:
    proxy = make_proxy(extra="[limits]\nh2_stall_timeout = 1.0\n")
    raw = RawConnection(proxy)
    raw.send(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 0}).serialize())
    raw.send(raw.headers(1, path=b"/anthropic/size?n=200000"))
    raw.sock.settimeout(10)
    data = bytearray()
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and not resets(parse_frames(bytes(data))):
        data += raw.sock.recv(65536)
    assert (1, ErrorCode.CANCEL) in resets(parse_frames(bytes(data)))
    # The connection lives on: a window opened again, a new stream is answered.
    raw.send(
        SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 65535}).serialize()
        + WindowUpdateFrame(0, window_increment=1 << 20).serialize()
        + raw.headers(3)
    )
    time.sleep(1)
    raw.sock.shutdown(socket.SHUT_WR)
    frames = raw.frames_until_close()
    assert [f for f in frames if isinstance(f, HeadersFrame) and f.stream_id == 3]
    allowed = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
    assert any("send window stalled" in e.ended for e in allowed), allowed


def test_heads_over_the_http1_limits_are_refused_alone(proxy: RunningProxy) -> None:
    """A stream's request head is read by the same parser as an HTTP/1.1 head, with its
    limits: a request line over `max_request_line` (414) and more fields than
    `max_header_count` (431) are each refused on their own stream with a readable answer and
    one terminal event, and the well-formed stream beside them is served."""
    raw = RawConnection(proxy)
    long_path = raw.request(b"/" + b"a" * 9000)
    many_fields = [*raw.request(), *((b"x-f%d" % i, b"1") for i in range(150))]
    for stream_id, fields in ((1, long_path), (3, many_fields)):
        block = raw.encoder.encode(fields)
        raw.send(HeadersFrame(stream_id, block, flags=["END_HEADERS", "END_STREAM"]).serialize())
    raw.send(raw.headers(5))
    time.sleep(1)
    raw.sock.shutdown(socket.SHUT_WR)
    frames = raw.frames_until_close()
    assert goaway_code(frames) in (None, ErrorCode.NO_ERROR)
    statuses = {}
    bodies: dict[int, bytes] = {}
    decoder = hpack.Decoder()
    for frame in frames:
        if isinstance(frame, HeadersFrame):
            statuses[frame.stream_id] = dict(decoder.decode(frame.data))[":status"]
        elif isinstance(frame, DataFrame):
            bodies[frame.stream_id] = bodies.get(frame.stream_id, b"") + frame.data
    assert statuses == {1: "414", 3: "431", 5: "200"}, frames
    assert b"bad_request" in bodies[1] and b"bad_request" in bodies[3]
    refused = [e for e in proxy.events() if isinstance(e, RequestRefused) and e.status >= 414]
    assert sorted(e.status for e in refused) == [414, 431]
