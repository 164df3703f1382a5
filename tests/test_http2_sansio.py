"""The sans-IO HTTP/2 layer (proxycore/protocol/http2): requests, flow control, and each known
attack sent as raw frames, refused with the right frame and bounded memory."""

from __future__ import annotations

import h2.config
import h2.connection
import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from proxycore.errors import Http2ConnectionError
from proxycore.protocol import http2
from proxycore.protocol.http2 import ErrorCode, H2Limits, H2Server

NOW = 1000.0
REQUEST = [
    (b":method", b"GET"),
    (b":scheme", b"http"),
    (b":authority", b"10.0.0.1:9119"),
    (b":path", b"/anthropic/v1/models"),
    (b"user-agent", b"t"),
]


def frames(data: bytes) -> list[Frame]:
    out = []
    view = memoryview(data)
    while len(view) >= 9:
        frame, length = Frame.parse_frame_header(view[:9])
        frame.parse_body(view[9 : 9 + length])
        out.append(frame)
        view = view[9 + length :]
    return out


def goaway(data: bytes) -> GoAwayFrame:
    found = [f for f in frames(data) if isinstance(f, GoAwayFrame)]
    assert found, frames(data)
    return found[-1]


def client() -> h2.connection.H2Connection:
    c = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    c.initiate_connection()
    return c


def started(**limits: object) -> tuple[H2Server, h2.connection.H2Connection]:
    server = H2Server(H2Limits(**limits))  # type: ignore[arg-type]
    c = client()
    server.receive_data(c.data_to_send(), NOW)
    c.receive_data(server.data_to_send())
    server.receive_data(c.data_to_send(), NOW)  # the client's SETTINGS ACK
    server.data_to_send()
    return server, c


def raw(frame: Frame) -> bytes:
    return frame.serialize()


def block(headers: list[tuple[bytes, bytes]]) -> bytes:
    return hpack.Encoder().encode(headers)


def test_request_data_and_response() -> None:
    server, c = started()
    c.send_headers(1, [*REQUEST[:3], (b":path", b"/x"), (b"content-length", b"5")])
    c.send_data(1, b"hello", end_stream=True)
    events = server.receive_data(c.data_to_send(), NOW)
    request, data, ended = events
    assert isinstance(request, http2.RequestReceived)
    assert (request.method, request.path, request.authority) == (b"GET", b"/x", b"10.0.0.1:9119")
    assert request.headers == ((b"content-length", b"5"),)
    assert isinstance(data, http2.DataReceived) and data.data == b"hello" and data.ended
    assert isinstance(ended, http2.StreamEnded)
    assert server.send_headers(1, 200, [(b"content-type", b"text/plain")], end=False)
    assert server.send_data(1, b"ok", end=False) == 2
    server.end_stream(1)
    received = c.receive_data(server.data_to_send())
    names = [type(e).__name__ for e in received]
    assert names[0] == "ResponseReceived" and names[-1] == "StreamEnded"
    assert not server.is_live(1)


def test_request_head_origin_and_absolute_form() -> None:
    own = http2.RequestReceived(1, b"POST", b"http", b"10.0.0.1:9119", b"/anthropic/v1", (), False)
    assert http2.request_head(own, "10.0.0.1") == (
        b"POST /anthropic/v1 HTTP/1.1\r\nhost: 10.0.0.1:9119\r\n"
        b"transfer-encoding: chunked\r\nte: trailers\r\nconnection: close\r\n\r\n"
    )
    other = http2.RequestReceived(
        3,
        b"GET",
        b"http",
        b"example.com",
        b"/a?b",
        ((b"cookie", b"a=1"), (b"cookie", b"b=2")),
        True,
    )
    assert http2.request_head(other, "10.0.0.1") == (
        b"GET http://example.com/a?b HTTP/1.1\r\nhost: example.com\r\n"
        b"cookie: a=1; b=2\r\nte: trailers\r\nconnection: close\r\n\r\n"
    )
    # Inside a terminated tunnel: origin-form whatever the :authority (the exchange holds the
    # Host it becomes to the tunnel's host).
    tls = http2.RequestReceived(5, b"GET", b"https", b"other.test:443", b"/x", (), True)
    assert http2.request_head(tls, "10.0.0.1", origin_form=True) == (
        b"GET /x HTTP/1.1\r\nhost: other.test:443\r\nte: trailers\r\nconnection: close\r\n\r\n"
    )


@pytest.mark.parametrize(
    "headers",
    [
        ((b"x-a", b"1\r\nx-b: 2"),),
        ((b"x-a", b" padded"),),
        ((b"x a", b"1"),),
        ((b"x-a", b"1\x00"),),
    ],
)
def test_request_head_refuses_what_http1_cannot_carry(headers: tuple[tuple[bytes, bytes]]) -> None:
    request = http2.RequestReceived(1, b"GET", b"http", b"example.com", b"/", headers, True)
    with pytest.raises(http2.MessageRefused):
        http2.request_head(request, "10.0.0.1")


def test_connect_refused_readably() -> None:
    request = http2.RequestReceived(1, b"CONNECT", b"", b"example.com:443", b"", (), False)
    with pytest.raises(http2.MessageRefused) as caught:
        http2.request_head(request, "10.0.0.1")
    assert caught.value.status == 501


def test_flow_control_bounds_what_is_buffered() -> None:
    """Nothing is acknowledged until consumed: the client's window closes at 64 KiB, and a
    client that sends past it is refused with FLOW_CONTROL_ERROR."""
    server, c = started()
    c.send_headers(1, [*REQUEST[:3], (b":path", b"/up")])
    server.receive_data(c.data_to_send(), NOW)
    chunk = b"x" * 16384
    received = 0
    for _ in range(3):
        c.send_data(1, chunk)
        for event in server.receive_data(c.data_to_send(), NOW):
            if isinstance(event, http2.DataReceived):
                received += event.flow_length
    c.send_data(1, chunk[:-1])  # 65535: the client's view of the window, used up
    server.receive_data(c.data_to_send(), NOW)
    assert not [f for f in frames(server.data_to_send()) if isinstance(f, WindowUpdateFrame)]
    # One byte more than the window, as raw frames the h2 client would not send.
    over = DataFrame(1, b"y" * 2)
    with pytest.raises(Http2ConnectionError) as caught:
        server.receive_data(raw(over), NOW)
    assert goaway(server.data_to_send()).error_code == ErrorCode.FLOW_CONTROL_ERROR
    assert caught.value.rule == "h2_flow_control"


def test_acknowledge_reopens_the_window() -> None:
    server, c = started()
    c.send_headers(1, [*REQUEST[:3], (b":path", b"/up")])
    for _ in range(3):
        c.send_data(1, b"x" * 13000)
    events = server.receive_data(c.data_to_send(), NOW)
    data = [e for e in events if isinstance(e, http2.DataReceived)]
    server.acknowledge(1, sum(e.flow_length for e in data))
    updates = [f for f in frames(server.data_to_send()) if isinstance(f, WindowUpdateFrame)]
    assert {f.stream_id for f in updates} == {1}


def test_rapid_reset_is_refused_with_enhance_your_calm() -> None:
    """CVE-2023-44487: streams opened and reset at once, over and over."""
    server, _ = started()
    encoder = hpack.Encoder()
    with pytest.raises(Http2ConnectionError) as caught:
        for stream_id in range(1, 2001, 2):
            headers = HeadersFrame(stream_id, encoder.encode(REQUEST), flags=["END_HEADERS"])
            reset = RstStreamFrame(stream_id, error_code=ErrorCode.CANCEL)
            server.receive_data(raw(headers) + raw(reset), NOW)
            server.data_to_send()
    assert caught.value.rule == "h2_rapid_reset"
    assert caught.value.error_code == ErrorCode.ENHANCE_YOUR_CALM
    assert stream_id < 2 * 210  # the burst (200) and not much more
    assert server.live_streams == 0


def test_continuation_flood_is_refused_before_buffering() -> None:
    """The 2024 CONTINUATION flood: a header block that never ends."""
    server, _ = started()
    data = raw(HeadersFrame(1, block(REQUEST)[:4]))
    data += b"".join(raw(ContinuationFrame(1, b"\x00" * 100)) for _ in range(40))
    with pytest.raises(Http2ConnectionError) as caught:
        server.receive_data(data, NOW)
    assert caught.value.rule == "h2_continuation"
    assert goaway(server.data_to_send()).error_code == ErrorCode.ENHANCE_YOUR_CALM


def test_header_block_bytes_are_bounded() -> None:
    server, _ = started()
    data = raw(HeadersFrame(1, b"\x00" * 16000))
    data += b"".join(raw(ContinuationFrame(1, b"\x00" * 16000)) for _ in range(5))
    with pytest.raises(Http2ConnectionError) as caught:
        server.receive_data(data, NOW)
    assert caught.value.rule == "h2_header_block"
    assert len(server._buffer) < 6 * 16400  # nothing past the refusal is kept


def test_hpack_bomb_is_refused() -> None:
    """A large value in the dynamic table, referenced many times: the decoded list is bounded
    (RFC 7541 4.1 sizes) although the block is tiny."""
    server, _ = started()
    bomb = block([*REQUEST, *[(b"x-bomb", b"a" * 4000)] * 12])
    assert len(bomb) < 4300
    with pytest.raises(Http2ConnectionError) as caught:
        server.receive_data(raw(HeadersFrame(1, bomb, flags=["END_HEADERS", "END_STREAM"])), NOW)
    assert caught.value.error_code == ErrorCode.ENHANCE_YOUR_CALM
    assert goaway(server.data_to_send()).error_code == ErrorCode.ENHANCE_YOUR_CALM


@pytest.mark.parametrize(
    ("frame", "rule"),
    [
        (SettingsFrame(0, settings={SettingsFrame.ENABLE_PUSH: 0}), "h2_settings_flood"),
        (PingFrame(0, b"12345678"), "h2_ping_flood"),
        (PriorityFrame(1, depends_on=0, stream_weight=16), "h2_priority_flood"),
    ],
)
def test_control_frame_floods_are_refused(frame: Frame, rule: str) -> None:
    server, _ = started()
    with pytest.raises(Http2ConnectionError) as caught:
        server.receive_data(raw(frame) * 1000, NOW)
    assert caught.value.rule == rule
    assert goaway(server.data_to_send()).error_code == ErrorCode.ENHANCE_YOUR_CALM


def test_unread_control_frames_are_bounded() -> None:
    """A client that sends PINGs it may (by rate) but never reads the answers."""
    server, _ = started(ping_burst=10_000, ping_rate=10_000.0, max_outbound_control_frames=50)
    with pytest.raises(Http2ConnectionError) as caught:
        server.receive_data(raw(PingFrame(0, b"12345678")) * 100, NOW)
    assert caught.value.rule == "h2_outbound"


def test_pings_within_the_rate_are_answered() -> None:
    server, c = started()
    c.ping(b"abcdefgh")
    server.receive_data(c.data_to_send(), NOW)
    acks = [f for f in frames(server.data_to_send()) if isinstance(f, PingFrame)]
    assert acks and "ACK" in acks[0].flags


def test_too_many_concurrent_streams() -> None:
    server, _ = started(max_concurrent_streams=10)
    encoder = hpack.Encoder()
    with pytest.raises(Http2ConnectionError) as caught:
        for stream_id in range(1, 40, 2):
            headers = HeadersFrame(stream_id, encoder.encode(REQUEST), flags=["END_HEADERS"])
            server.receive_data(raw(headers), NOW)
    assert caught.value.rule == "h2_max_concurrent_streams"
    assert stream_id == 21  # the 11th
    assert goaway(server.data_to_send()).error_code == ErrorCode.PROTOCOL_ERROR


def test_empty_frames_are_refused() -> None:
    """CVE-2019-9518: frames with empty payloads that cost work and do nothing."""
    server, c = started()
    c.send_headers(1, REQUEST)
    server.receive_data(c.data_to_send(), NOW)
    with pytest.raises(Http2ConnectionError) as caught:
        server.receive_data(raw(DataFrame(1, b"")) * 3, NOW)
    assert caught.value.rule == "h2_empty_frames"


def test_stream_id_exhaustion_goaway_and_refusal() -> None:
    """Past `max_stream_id` the client is told to go away (NO_ERROR, so the streams it has
    finish) and a stream above it is refused (REFUSED_STREAM: safe to retry elsewhere)."""
    server, c = started(max_stream_id=5)
    for stream_id in (1, 3):
        c.send_headers(stream_id, REQUEST, end_stream=True)
    events = server.receive_data(c.data_to_send(), NOW)
    assert [e.stream_id for e in events if isinstance(e, http2.RequestReceived)] == [1, 3]
    assert not [f for f in frames(server.data_to_send()) if isinstance(f, GoAwayFrame)]
    c.send_headers(5, REQUEST, end_stream=True)
    events = server.receive_data(c.data_to_send(), NOW)
    assert [e.stream_id for e in events if isinstance(e, http2.RequestReceived)] == [5]
    away = goaway(server.data_to_send())
    assert (away.error_code, away.last_stream_id) == (ErrorCode.NO_ERROR, 5)
    encoder = hpack.Encoder()
    encoder.encode(REQUEST)  # keep in step with nothing: a fresh table for raw frames
    late = HeadersFrame(7, hpack.Encoder().encode(REQUEST), flags=["END_HEADERS", "END_STREAM"])
    # The client's own encoder state: use the h2 client for a consistent HPACK table.
    c.send_headers(7, REQUEST, end_stream=True)
    events = server.receive_data(c.data_to_send(), NOW)
    assert not [e for e in events if isinstance(e, http2.RequestReceived)]
    resets = [f for f in frames(server.data_to_send()) if isinstance(f, RstStreamFrame)]
    assert [(f.stream_id, f.error_code) for f in resets] == [(7, ErrorCode.REFUSED_STREAM)]
    del late
    # The streams it had go on: a response on stream 5 still goes out.
    assert server.send_headers(5, 200, [], end=True)


def test_no_frame_on_a_stream_the_client_reset() -> None:
    server, c = started()
    c.send_headers(1, REQUEST, end_stream=True)
    server.receive_data(c.data_to_send(), NOW)
    c.reset_stream(1, ErrorCode.CANCEL)
    (event,) = server.receive_data(c.data_to_send(), NOW)
    assert isinstance(event, http2.StreamReset) and event.by_peer
    assert not server.send_headers(1, 200, [], end=False)
    assert server.send_data(1, b"late", end=False) == -1
    server.reset(1)
    assert server.data_to_send() == b""


def test_zero_window_stall_is_visible() -> None:
    """The client never opens its window: nothing more can be sent (the adapter's deadline
    then resets the stream)."""
    server, c = started()
    c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    c.send_headers(1, REQUEST, end_stream=True)
    server.receive_data(c.data_to_send(), NOW)
    assert server.send_headers(1, 200, [], end=False)
    assert server.send_window(1) == 0
    assert server.send_data(1, b"x", end=False) == 0


def test_not_a_preface() -> None:
    assert http2.preface_state(b"PRI * HTTP/2.0\r\n") is None
    assert http2.preface_state(http2.PREFACE + b"x") is True
    assert http2.preface_state(b"GET / HTTP/1.1\r\n") is False
    server = H2Server(H2Limits())
    with pytest.raises(Http2ConnectionError):
        server.receive_data(b"PRI * HTTP/1.1\r\n\r\nxxxxxxxxxxxxx", NOW)
