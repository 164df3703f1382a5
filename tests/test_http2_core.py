"""Our HTTP/2 core (proxycore/protocol/http2/endpoint.py, frames.py): what RFC 9113 asks of each
frame, the stream errors that end one stream only, and the header block decode cache that must
never serve fields decoded against another state of the dynamic table."""

from __future__ import annotations

import base64

import hpack
import pytest
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PushPromiseFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from proxycore.errors import Http2ConnectionError
from proxycore.protocol import http2
from proxycore.protocol.http2 import ErrorCode, H2Client, H2Limits, H2Server, fields, frames
from proxycore.protocol.http2.hpack_out import StatelessEncoder
from tests.h2_client import parse_frames

NOW = 1000.0
REQUEST = [
    (b":method", b"GET"),
    (b":scheme", b"http"),
    (b":authority", b"10.0.0.1:9119"),
    (b":path", b"/"),
]


def started(**limits: object) -> H2Server:
    server = H2Server(H2Limits(**limits))  # type: ignore[arg-type]
    server.receive_data(http2.PREFACE + SettingsFrame(0).serialize(), NOW)
    server.data_to_send()
    return server


def headers(stream_id: int, block: bytes, *, end: bool = True) -> bytes:
    flags = ["END_HEADERS", "END_STREAM"] if end else ["END_HEADERS"]
    return HeadersFrame(stream_id, block, flags=flags).serialize()


def requests(events: list[http2.H2Event]) -> list[http2.RequestReceived]:
    return [e for e in events if isinstance(e, http2.RequestReceived)]


def refused(server: H2Server, data: bytes) -> Http2ConnectionError:
    with pytest.raises(Http2ConnectionError) as caught:
        server.receive_data(data, NOW)
    (away,) = [f for f in parse_frames(server.data_to_send()) if isinstance(f, GoAwayFrame)]
    assert away.error_code == caught.value.error_code
    return caught.value


# -- the decode cache -------------------------------------------------------------------------


def test_a_block_is_never_served_for_another_table_state() -> None:
    """The same bytes (indexes into the dynamic table) mean other fields once the table
    changed: decoded again, never taken from the cache. A decoder fed the same blocks says
    what each means."""
    server = started()
    encoder, reference = hpack.Encoder(), hpack.Decoder()

    def send(stream_id: int, block: bytes) -> list[tuple[bytes, bytes]]:
        (request,) = requests(server.receive_data(headers(stream_id, block), NOW))
        expected = reference.decode(block, raw=True)
        assert request.headers == tuple((n, v) for n, v in expected if n[:1] != b":")
        assert request.authority == dict(expected).get(b":authority", b"")
        return [(b":authority", request.authority), *request.headers]

    send(1, encoder.encode([*REQUEST, (b"x-a", b"1")]))
    # Indexes only now: the static table, and the two dynamic entries (x-a: 1 at 62).
    indexed = encoder.encode([*REQUEST, (b"x-a", b"1")])
    assert indexed[-1:] == b"\xbe"
    first = send(3, indexed)
    assert send(5, indexed) == first == [(b":authority", b"10.0.0.1:9119"), (b"x-a", b"1")]
    assert indexed in server._decoded  # served from the cache the second time
    # x-b: 2 is inserted: index 62 is now x-b: 2, and every older entry moved up by one.
    send(7, encoder.encode([*REQUEST, (b"x-b", b"2")]))
    assert not server._decoded
    assert send(9, indexed) != first


def test_a_block_that_changes_the_table_is_never_cached() -> None:
    """A block that inserts a field must be decoded each time it comes: its second arrival
    inserts again in the client's encoder's view, so the decoder must too."""
    server = started()
    block = hpack.Encoder().encode([*REQUEST, (b"x-a", b"1")])  # literals with indexing
    table = server._decoder.header_table.dynamic_entries
    sizes = []
    for stream_id in (1, 3):
        (request,) = requests(server.receive_data(headers(stream_id, block), NOW))
        assert request.headers == ((b"x-a", b"1"),)
        sizes.append(len(table))
    assert block not in server._decoded
    assert sizes == [2, 4]  # :authority and x-a inserted each time


def test_a_table_size_update_empties_the_cache() -> None:
    server = started()
    indexed = StatelessEncoder().encode(REQUEST)  # never indexed: the table unchanged
    server.receive_data(headers(1, indexed), NOW)
    assert indexed in server._decoded
    server.receive_data(headers(3, b"\x20" + indexed), NOW)  # size update to 0 (RFC 7541 6.3)
    assert not server._decoded


# -- stream errors: one stream ends, the connection goes on -----------------------------------


def test_a_body_longer_than_content_length_resets_its_stream_only() -> None:
    """RFC 9113 8.1.1: malformed, a stream error; the stream beside it is served."""
    server = started()
    encoder = hpack.Encoder()
    data = headers(1, encoder.encode([*REQUEST, (b"content-length", b"3")]), end=False)
    data += headers(3, encoder.encode(REQUEST), end=False)
    data += DataFrame(1, b"toolong").serialize() + DataFrame(3, b"fine").serialize()
    events = server.receive_data(data, NOW)
    (reset,) = [e for e in events if isinstance(e, http2.StreamReset)]
    assert (reset.stream_id, reset.error_code, reset.by_peer) == (
        1,
        ErrorCode.PROTOCOL_ERROR,
        False,
    )
    assert [e.data for e in events if isinstance(e, http2.DataReceived)] == [b"fine"]
    out = parse_frames(server.data_to_send())
    assert [(f.stream_id, f.error_code) for f in out if isinstance(f, RstStreamFrame)] == [
        (1, ErrorCode.PROTOCOL_ERROR)
    ]
    assert server.is_live(3) and not server.is_live(1)


def test_a_body_shorter_than_content_length_resets_its_stream() -> None:
    server = started()
    block = hpack.Encoder().encode([*REQUEST, (b"content-length", b"10")])
    data = headers(1, block, end=False) + DataFrame(1, b"short", flags=["END_STREAM"]).serialize()
    events = server.receive_data(data, NOW)
    assert [type(e).__name__ for e in events] == ["RequestReceived", "StreamReset"]


def test_window_update_of_zero() -> None:
    """RFC 9113 6.9: a stream error on a stream, a connection error on the connection."""
    server = started()
    server.receive_data(headers(1, hpack.Encoder().encode(REQUEST)), NOW)
    zero = b"\x00\x00\x04\x08\x00" + (1).to_bytes(4, "big") + b"\x00\x00\x00\x00"
    (reset,) = server.receive_data(zero, NOW)
    assert isinstance(reset, http2.StreamReset) and reset.error_code == ErrorCode.PROTOCOL_ERROR
    error = refused(server, b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x00\x00\x00\x00")
    assert (error.error_code, error.rule) == (ErrorCode.PROTOCOL_ERROR, "h2_protocol_error")


def test_connection_window_overflow_is_a_flow_control_error() -> None:
    server = started()
    error = refused(server, WindowUpdateFrame(0, window_increment=2**31 - 1).serialize())
    assert (error.error_code, error.rule) == (ErrorCode.FLOW_CONTROL_ERROR, "h2_flow_control")


# -- settings -----------------------------------------------------------------------------------


def test_initial_window_changes_apply_to_open_streams() -> None:
    """RFC 9113 6.9.2: SETTINGS_INITIAL_WINDOW_SIZE moves every open stream's window by the
    difference (below zero too); one over 2^31-1 is a FLOW_CONTROL_ERROR."""
    server = started()
    server.receive_data(headers(1, hpack.Encoder().encode(REQUEST)), NOW)
    assert server.send_headers(1, 200, [], end=False)
    assert server.send_data(1, b"x" * 1000, end=False) == 1000
    settings = SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 500}).serialize()
    events = server.receive_data(settings, NOW)
    assert isinstance(events[0], http2.SettingsReceived)
    assert server._streams[1].send_window == -500
    assert server.send_window(1) == 0
    acks = [f for f in parse_frames(server.data_to_send()) if isinstance(f, SettingsFrame)]
    assert acks and "ACK" in acks[0].flags
    server.receive_data(WindowUpdateFrame(1, window_increment=2**31 - 1).serialize(), NOW)
    big = SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1}).serialize()
    error = refused(server, big)
    assert error.error_code == ErrorCode.FLOW_CONTROL_ERROR


@pytest.mark.parametrize(
    ("setting", "value", "code"),
    [
        (SettingsFrame.INITIAL_WINDOW_SIZE, 2**31, ErrorCode.FLOW_CONTROL_ERROR),
        (SettingsFrame.MAX_FRAME_SIZE, 16383, ErrorCode.PROTOCOL_ERROR),
        (SettingsFrame.ENABLE_PUSH, 2, ErrorCode.PROTOCOL_ERROR),
    ],
)
def test_settings_out_of_range(setting: int, value: int, code: int) -> None:
    server = started()
    error = refused(server, SettingsFrame(0, settings={setting: value}).serialize())
    assert error.error_code == code


def test_upgrade_applies_the_http2_settings() -> None:
    """RFC 7540 3.2.1: HTTP2-Settings is a SETTINGS payload in base64url; stream 1 is the
    request that asked, half closed."""
    payload = SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 1000}).serialize()[9:]
    header = base64.urlsafe_b64encode(payload)
    server = H2Server(H2Limits())
    server.initiate_upgrade(header)
    assert server.is_live(1)
    assert server.send_headers(1, 200, [], end=False)
    assert server.send_window(1) == 1000
    with pytest.raises(Http2ConnectionError) as caught:
        H2Server(H2Limits()).initiate_upgrade(base64.urlsafe_b64encode(b"\x00\x04\x00"))
    assert caught.value.rule == "h2_upgrade"


# -- frames -------------------------------------------------------------------------------------


def test_padding_longer_than_the_frame() -> None:
    server = started()
    server.receive_data(headers(1, hpack.Encoder().encode(REQUEST), end=False), NOW)
    padded = b"\x00\x00\x03\x00\x08" + (1).to_bytes(4, "big") + b"\x05ab"
    assert refused(server, padded).error_code == ErrorCode.PROTOCOL_ERROR


def test_padding_is_flow_controlled_and_stripped() -> None:
    server = started()
    server.receive_data(headers(1, hpack.Encoder().encode(REQUEST), end=False), NOW)
    padded = b"\x00\x00\x06\x00\x08" + (1).to_bytes(4, "big") + b"\x03abxxx"
    (data,) = server.receive_data(padded, NOW)
    assert isinstance(data, http2.DataReceived) and (data.data, data.flow_length) == (b"ab", 6)


def test_nothing_may_interleave_a_header_block() -> None:
    server = started()
    block = hpack.Encoder().encode(REQUEST)
    data = HeadersFrame(1, block[:2]).serialize() + PingFrame(0, b"12345678").serialize()
    assert refused(server, data).error_code == ErrorCode.PROTOCOL_ERROR


def test_a_header_block_in_continuation_frames() -> None:
    server = started()
    block = hpack.Encoder().encode([*REQUEST, (b"x-long", b"v" * 100)])
    data = HeadersFrame(1, block[:10], flags=["END_STREAM"]).serialize()
    data += ContinuationFrame(1, block[10:50]).serialize()
    data += ContinuationFrame(1, block[50:], flags=["END_HEADERS"]).serialize()
    request, ended = server.receive_data(data, NOW)
    assert isinstance(request, http2.RequestReceived) and request.ended
    assert request.headers == ((b"x-long", b"v" * 100),)
    assert isinstance(ended, http2.StreamEnded)


def test_unknown_frame_types_are_ignored() -> None:
    server = started()
    unknown = b"\x00\x00\x03\xfa\x00\x00\x00\x00\x01abc"
    assert server.receive_data(unknown, NOW) == []
    assert not server.closed


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (PushPromiseFrame(1, promised_stream_id=2, flags=["END_HEADERS"]).serialize(), 1),
        (headers(2, hpack.Encoder().encode(REQUEST)), 1),  # a client's streams are odd
        (DataFrame(1, b"x").serialize(), 1),  # an idle stream
        (RstStreamFrame(5, error_code=8).serialize(), 1),  # an idle stream
        (b"\x00\x00\x07\x06\x00\x00\x00\x00\x00" + b"1234567", 6),  # PING of 7 octets
    ],
)
def test_connection_errors(data: bytes, code: int) -> None:
    assert refused(started(), data).error_code == code


def test_stream_identifiers_only_increase() -> None:
    """RFC 9113 5.1.1: a stream below the highest opened is closed; a new head on it is a
    connection error."""
    server = started()
    encoder = hpack.Encoder()
    server.receive_data(headers(5, encoder.encode(REQUEST)), NOW)
    error = refused(server, headers(3, encoder.encode(REQUEST)))
    assert error.error_code == ErrorCode.STREAM_CLOSED


def test_a_large_response_head_goes_in_continuation_frames() -> None:
    server = started()
    server.receive_data(headers(1, hpack.Encoder().encode(REQUEST)), NOW)
    assert server.send_headers(1, 200, [(b"x-big", b"v" * 40000)], end=True)
    frames = parse_frames(server.data_to_send())
    assert [type(f).__name__ for f in frames] == [
        "HeadersFrame",
        "ContinuationFrame",
        "ContinuationFrame",
    ]
    assert all(len(f.data) <= 16384 for f in frames)
    fields = hpack.Decoder().decode(b"".join(f.data for f in frames), raw=True)
    assert fields == [(b":status", b"200"), (b"x-big", b"v" * 40000)]


def test_a_graceful_goaway_lets_open_streams_finish() -> None:
    server = started()
    server.receive_data(headers(1, hpack.Encoder().encode(REQUEST)), NOW)
    server.graceful_goaway()
    assert server.send_headers(1, 200, [], end=True)
    away, head = parse_frames(server.data_to_send())
    assert isinstance(away, GoAwayFrame) and (away.last_stream_id, away.error_code) == (1, 0)
    assert isinstance(head, HeadersFrame)


# -- the client side ----------------------------------------------------------------------------


def client_with_stream() -> tuple[H2Client, int]:
    client = H2Client(H2Limits())
    client.receive_data(SettingsFrame(0).serialize(), NOW)
    stream_id = client.open_stream([*REQUEST, (b"te", b"trailers")], end=True)
    client.data_to_send()
    return client, stream_id


def test_client_reads_a_response_drops_interim_ones_and_reads_trailers() -> None:
    client, stream_id = client_with_stream()
    encoder = hpack.Encoder()
    data = headers(stream_id, encoder.encode([(b":status", b"103")]), end=False)
    data += headers(stream_id, encoder.encode([(b":status", b"200"), (b"x-a", b"1")]), end=False)
    data += DataFrame(stream_id, b"body").serialize()
    data += headers(stream_id, encoder.encode([(b"x-sum", b"9")]))
    events = client.receive_data(data, NOW)
    assert [type(e).__name__ for e in events] == [
        "ResponseReceived",
        "DataReceived",
        "TrailersReceived",
        "StreamEnded",
    ]
    response = events[0]
    assert isinstance(response, http2.ResponseReceived)
    assert (response.status, response.headers) == (200, ((b"x-a", b"1"),))


@pytest.mark.parametrize(
    "fields",
    [
        [(b"x-a", b"1")],  # no :status
        [(b":status", b"200"), (b":status", b"200")],
        [(b"x-a", b"1"), (b":status", b"200")],  # a pseudo-header after a field
        [(b":status", b"20x")],
        [(b":status", b"200"), (b":path", b"/")],  # a request's pseudo-header
        [(b":status", b"200"), (b"connection", b"close")],  # RFC 9113 8.2.2
    ],
)
def test_client_refuses_malformed_response_heads(fields: list[tuple[bytes, bytes]]) -> None:
    client, stream_id = client_with_stream()
    with pytest.raises(Http2ConnectionError) as caught:
        client.receive_data(headers(stream_id, hpack.Encoder().encode(fields)), NOW)
    assert caught.value.error_code == ErrorCode.PROTOCOL_ERROR


def test_client_stream_identifiers_and_concurrency() -> None:
    client = H2Client(H2Limits())
    settings = SettingsFrame(0, settings={SettingsFrame.MAX_CONCURRENT_STREAMS: 2}).serialize()
    client.receive_data(settings, NOW)
    assert client.max_streams == 2
    assert [client.open_stream(REQUEST, end=True) for _ in range(2)] == [1, 3]
    assert not client.can_open()
    with pytest.raises(http2.RequestUnsendable):
        client.open_stream(REQUEST, end=True)
    client.finish(1)
    assert client.can_open()
    assert client.open_stream(REQUEST, end=True) == 5


def test_client_goaway_refuses_the_streams_above_its_last() -> None:
    client = H2Client(H2Limits())
    for _ in range(3):
        client.open_stream(REQUEST, end=True)
    events = client.receive_data(GoAwayFrame(0, last_stream_id=1).serialize(), NOW)
    resets = [(e.stream_id, e.refused) for e in events if isinstance(e, http2.StreamReset)]
    assert resets == [(3, True), (5, True)]
    assert isinstance(events[-1], http2.ConnectionEnded)
    assert not client.closed and client.is_live(1)  # NO_ERROR: stream 1 may finish
    data = headers(1, hpack.Encoder().encode([(b":status", b"204")]))
    assert isinstance(client.receive_data(data, NOW)[0], http2.ResponseReceived)


# -- the field checks -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "good"),
    [
        (b"content-type", b"text/plain", True),
        (b"Content-Type", b"text/plain", False),
        (b"x-a", b" padded", False),
        (b"x-a", b"a\r\nb", False),
        (b"x-a", b"", True),
        (b"x a", b"1", False),
    ],
)
def test_field_checks_answer_the_same_when_kept(name: bytes, value: bytes, good: bool) -> None:
    fields._checked.clear()
    assert [fields.well_formed(name, value) for _ in range(2)] == [good, good]
    assert fields._checked == {(name, value): good}


def test_field_checks_keep_no_secret_and_no_long_value() -> None:
    fields._checked.clear()
    assert fields.well_formed(b"authorization", b"Bearer sk-ant-secret")
    assert fields.well_formed(b"cookie", b"session=secret")
    assert fields.well_formed(b"x-long", b"v" * 129)
    assert not fields._checked


@pytest.mark.parametrize("length", [0, 1, 255, 256, 16384, 65535, 65536, 2**24 - 1])
@pytest.mark.parametrize("stream_id", [1, 255, 2**31 - 1])
def test_a_frame_header_is_packed_and_read_as_rfc_9113_4_1_lays_it_out(
    length: int, stream_id: int
) -> None:
    """The header packed with one struct call (frames.FRAME_HEADER) is the 24-bit length, type,
    flags and 31-bit identifier, as hyperframe lays them out; DATA appended header and payload
    apart is the same bytes as `data_frame`."""
    payload = bytes(length)
    data = frames.frame(frames.DATA, frames.END_STREAM, stream_id, payload)
    expected = DataFrame(stream_id, payload, flags=["END_STREAM"]).serialize()
    assert data == expected
    high, low, kind, flags, read_id = frames.FRAME_HEADER.unpack_from(data, 0)
    assert ((high << 8) | low, kind, flags, read_id) == (length, 0, 1, stream_id)
    # The reserved bit is ignored on receipt (RFC 9113 4.1).
    server = started()
    ping = PingFrame(0, b"12345678").serialize()
    server.receive_data(ping[:5] + bytes([0x80 | ping[5]]) + ping[6:], NOW)
    (pong,) = parse_frames(server.data_to_send())
    assert isinstance(pong, PingFrame) and "ACK" in pong.flags
