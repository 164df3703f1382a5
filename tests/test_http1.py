"""Tests of the strict HTTP/1.1 parser and serializer (proxycore.protocol.http1).

Table-driven: what we read (and exactly how), what we refuse (and with which status_hint),
then hypothesis properties: serialize -> parse round trips, h11 agreement on generated valid
messages, segmentation independence, and "only HttpProtocolError escapes".
"""

from __future__ import annotations

import contextlib

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxycore.errors import HttpProtocolError
from proxycore.protocol.http1 import (
    DEFAULT_LIMITS,
    HOP_BY_HOP,
    LAST_CHUNK,
    BodyKind,
    BodyReader,
    Limits,
    RequestHead,
    ResponseHead,
    encode_chunk,
    parse_request_head,
    parse_response_head,
    serialize_request_head,
    serialize_response_head,
    strip_hop_by_hop,
)


def parse_request(data: bytes) -> tuple[RequestHead, bytes, bytes]:
    """Head, decoded body and leftover of one complete request."""
    parsed = parse_request_head(data)
    assert parsed is not None, "head incomplete"
    head, used = parsed
    reader = BodyReader.for_request(head)
    body = reader.feed(data[used:])
    assert reader.done, "body incomplete"
    return head, body, reader.take_leftover()


def refusal(data: bytes, limits: Limits = DEFAULT_LIMITS) -> int:
    """The status_hint with which `data` (head and body) is refused."""
    with pytest.raises(HttpProtocolError) as info:
        parsed = parse_request_head(data, limits)
        assert parsed is not None, "head incomplete, not refused"
        head, used = parsed
        reader = BodyReader.for_request(head, limits)
        reader.feed(data[used:])
        reader.feed_eof()
    return info.value.status_hint


# ---------------------------------------------------------------------------------------------
# Requests we read
# ---------------------------------------------------------------------------------------------


def test_get_with_host() -> None:
    head, body, leftover = parse_request(
        b"GET /v1/models?x=1 HTTP/1.1\r\nHost: api.example\r\nAccept: */*\r\n\r\n"
    )
    assert head.method == b"GET"
    assert head.target == b"/v1/models?x=1"
    assert head.http_version == b"1.1"
    assert head.headers == ((b"host", b"api.example"), (b"accept", b"*/*"))
    assert head.body_kind is BodyKind.NONE
    assert head.content_length == 0
    assert head.keep_alive is True
    assert head.expect_continue is False
    assert head.get(b"host") == b"api.example"
    assert head.get(b"missing") is None
    assert body == b"" and leftover == b""


def test_consumed_is_the_head_length() -> None:
    data = b"GET / HTTP/1.1\r\nHost: a\r\n\r\nrest"
    parsed = parse_request_head(data)
    assert parsed is not None
    assert parsed[1] == len(data) - 4


def test_post_with_content_length() -> None:
    head, body, leftover = parse_request(
        b"POST /v1/messages HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
    )
    assert (head.body_kind, head.content_length) == (BodyKind.LENGTH, 5)
    assert body == b"hello" and leftover == b""


def test_content_length_zero_is_an_empty_length_body() -> None:
    head, body, _ = parse_request(b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
    assert (head.body_kind, head.content_length, body) == (BodyKind.LENGTH, 0, b"")
    assert BodyReader.for_request(head).done


def test_chunked_body() -> None:
    head, body, leftover = parse_request(
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\nA\r\n, world!!!\r\n0\r\n\r\n"
    )
    assert head.body_kind is BodyKind.CHUNKED
    assert body == b"hello, world!!!" and leftover == b""


def test_transfer_encoding_value_is_normalized_like_h11() -> None:
    # Coding names are case-insensitive (RFC 9112 7); h11 reads the value lowercased.
    head, _, _ = parse_request(
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked \r\n\r\n0\r\n\r\n"
    )
    assert head.get(b"transfer-encoding") == b"chunked"


def test_pipelined_requests_leave_the_second_as_leftover() -> None:
    second = b"GET /b HTTP/1.1\r\nHost: a\r\n\r\n"
    head, body, leftover = parse_request(
        b"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc" + second
    )
    assert head.target == b"/a" and body == b"abc"
    assert leftover == second
    head2, _, leftover2 = parse_request(leftover)
    assert head2.target == b"/b" and leftover2 == b""


def test_pipelined_after_chunked_body() -> None:
    second = b"GET /b HTTP/1.1\r\nHost: a\r\n\r\n"
    _, body, leftover = parse_request(
        b"POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"
        + second
    )
    assert body == b"x" and leftover == second


def test_http10_request_does_not_keep_alive() -> None:
    head, _, _ = parse_request(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert head.http_version == b"1.0"
    assert head.keep_alive is False  # as h11: 1.0 keep-alive is not honoured


def test_connection_close() -> None:
    head, _, _ = parse_request(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, CLOSE\r\n\r\n")
    assert head.keep_alive is False
    head, _, _ = parse_request(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: closed\r\n\r\n")
    assert head.keep_alive is True


def test_absolute_form_target() -> None:
    head, _, _ = parse_request(
        b"GET http://example.com:8080/a?b=c HTTP/1.1\r\nHost: example.com:8080\r\n\r\n"
    )
    assert head.target == b"http://example.com:8080/a?b=c"


def test_connect_authority_form() -> None:
    head, _, _ = parse_request(
        b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\n\r\n"
    )
    assert (head.method, head.target, head.body_kind) == (
        b"CONNECT",
        b"api.anthropic.com:443",
        BodyKind.NONE,
    )


def test_expect_100_continue() -> None:
    head, _, _ = parse_request(
        b"PUT /x HTTP/1.1\r\nHost: a\r\nExpect: 100-Continue\r\nContent-Length: 1\r\n\r\nx"
    )
    assert head.expect_continue is True
    # RFC 9110 10.1.1: ignored in an HTTP/1.0 request.
    head, _, _ = parse_request(b"PUT /x HTTP/1.0\r\nExpect: 100-continue\r\n\r\n")
    assert head.expect_continue is False


@pytest.mark.parametrize(
    ("line", "value"),
    [
        (b"X: a b", b"a b"),
        (b"X:a", b"a"),
        (b"X: \t padded \t ", b"padded"),
        (b"X:", b""),
        (b"X:   ", b""),
        (b"X: caf\xc3\xa9", b"caf\xc3\xa9"),  # obs-text: opaque, as h11 reads it
        (b"X: a\tb", b"a\tb"),
        (b"Content-Length:  5", b"5"),  # leading OWS is not part of the value
        (b"X-Mixed-CASE: Value", b"Value"),
    ],
)
def test_field_values(line: bytes, value: bytes) -> None:
    body = b"12345" if line.startswith(b"Content-Length") else b""
    head, _, _ = parse_request(b"POST / HTTP/1.1\r\nHost: a\r\n" + line + b"\r\n\r\n" + body)
    assert head.headers[1] == (line.split(b":")[0].lower(), value)


def test_empty_host_is_accepted() -> None:
    # RFC 9112 3.2: a target without authority is sent with an empty Host.
    head, _, _ = parse_request(b"OPTIONS * HTTP/1.1\r\nHost:\r\n\r\n")
    assert head.get(b"host") == b""


def test_bytearray_input() -> None:
    parsed = parse_request_head(bytearray(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"))
    assert parsed is not None
    head, _ = parsed
    assert type(head.method) is bytes and type(head.headers[0][1]) is bytes


def test_every_prefix_of_a_valid_request_needs_more() -> None:
    data = (
        b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
        b"X-Long: " + b"v" * 100 + b"\r\n\r\n"
    )
    for i in range(len(data)):
        assert parse_request_head(data[:i]) is None, i
    assert parse_request_head(data) is not None


# ---------------------------------------------------------------------------------------------
# Requests we refuse, and with which status
# ---------------------------------------------------------------------------------------------

_H = b"POST / HTTP/1.1\r\nHost: a\r\n"

SMUGGLING: list[tuple[str, bytes, int]] = [
    ("CL+CL conflicting", _H + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400),
    ("CL+CL identical", _H + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\nhello", 400),
    ("CL list", _H + b"Content-Length: 5,5\r\n\r\nhello", 400),
    ("CL list with space", _H + b"Content-Length: 5, 5\r\n\r\nhello", 400),
    ("CL plus sign", _H + b"Content-Length: +5\r\n\r\nhello", 400),
    ("CL minus", _H + b"Content-Length: -1\r\n\r\n", 400),
    ("CL inner space", _H + b"Content-Length: 5 5\r\n\r\nhello", 400),
    ("CL hex", _H + b"Content-Length: 0x5\r\n\r\nhello", 400),
    ("CL empty", _H + b"Content-Length:\r\n\r\n", 400),
    ("CL 20 digits", _H + b"Content-Length: 00000000000000000005\r\n\r\nhello", 400),
    ("CL 2**63", _H + b"Content-Length: 9223372036854775808\r\n\r\n", 400),
    ("CL 2**64", _H + b"Content-Length: 18446744073709551616\r\n\r\n", 400),
    ("CL Arabic-Indic digit", _H + "Content-Length: \u0665\r\n\r\n".encode(), 400),
    ("TE+CL", _H + b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n", 400),
    ("CL+TE", _H + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("TE chunked, identity", _H + b"Transfer-Encoding: chunked, identity\r\n\r\n", 501),
    ("TE chunked, chunked", _H + b"Transfer-Encoding: chunked, chunked\r\n\r\n", 501),
    ("TE gzip, chunked", _H + b"Transfer-Encoding: gzip, chunked\r\n\r\n", 501),
    ("TE xchunked", _H + b"Transfer-Encoding: xchunked\r\n\r\n", 501),
    ("TE identity", _H + b"Transfer-Encoding: identity\r\n\r\n", 501),
    ("TE chunked;param", _H + b"Transfer-Encoding: chunked;q=1\r\n\r\n", 501),
    ("TE empty", _H + b"Transfer-Encoding:\r\n\r\n", 501),
    ("TE twice", _H + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    ("TE in 1.0", b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    ("obs-fold", _H + b"X: a\r\n b\r\n\r\n", 400),
    ("obs-fold tab", _H + b"X: a\r\n\tb\r\n\r\n", 400),
    ("obs-fold first line", b"POST / HTTP/1.1\r\n Host: a\r\n\r\n", 400),
    ("bare LF line ends", b"GET / HTTP/1.1\nHost: a\n\n", 400),
    ("bare LF in fields", _H + b"X: a\nY: b\r\n\r\n", 400),
    ("bare LF head end", _H + b"X: a\r\n\n", 400),
    ("bare CR", _H + b"X: a\rY: b\r\n\r\n", 400),
    ("CR CR LF", _H + b"X: a\r\r\n\r\n", 400),
    ("space before colon", _H + b"Content-Length : 5\r\n\r\nhello", 400),
    ("tab before colon", _H + b"Content-Length\t: 5\r\n\r\nhello", 400),
    ("no colon", _H + b"Content-Length 5\r\n\r\n", 400),
    ("empty name", _H + b": x\r\n\r\n", 400),
    ("non-token name", _H + b"X@Y: x\r\n\r\n", 400),
    ("obs-text name", _H + b"X\xe9: x\r\n\r\n", 400),
    ("NUL in value", _H + b"X: a\x00b\r\n\r\n", 400),
    ("NUL at value end", _H + b"X: a\x00\r\n\r\n", 400),
    ("CTL in value", _H + b"X: a\x01b\r\n\r\n", 400),
    ("VT in value", _H + b"X: a\x0bb\r\n\r\n", 400),
    ("DEL in value", _H + b"X: a\x7fb\r\n\r\n", 400),
    ("no Host in 1.1", b"GET / HTTP/1.1\r\n\r\n", 400),
    ("two Hosts", b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    ("two Hosts in 1.0", b"GET / HTTP/1.0\r\nHost: a\r\nhost: a\r\n\r\n", 400),
    # RFC 9112 2.2: up to max_empty_lines leading CRLFs are skipped (test_http1_accept.py)
    ("leading LF", b"\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("leading CR", b"\rGET / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("leading CRLF LF", b"\r\n\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("five leading CRLF", b"\r\n" * 5 + b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("leading space", b" GET / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("double space", b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("tab separator", b"GET\t/ HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("trailing space", b"GET / HTTP/1.1 \r\nHost: a\r\n\r\n", 400),
    ("lowercase version", b"GET / http/1.1\r\nHost: a\r\n\r\n", 400),
    ("no version", b"GET /\r\nHost: a\r\n\r\n", 400),
    ("space in target", b"GET /a b HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("DEL in target", b"GET /a\x7f HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("obs-text in target", b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("non-token method", b"G@T / HTTP/1.1\r\nHost: a\r\n\r\n", 400),
    ("HTTP/2.0", b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505),
    ("HTTP/1.2", b"GET / HTTP/1.2\r\nHost: a\r\n\r\n", 505),
    ("HTTP/0.9", b"GET / HTTP/0.9\r\n\r\n", 505),
    ("TLS on a plaintext port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),
    # Chunked framing (RFC 9112 7.1)
    # Chunk extensions are read by their grammar (test_http1_accept.py); outside it, refused.
    (
        "chunk ext BWS first",
        _H + b"Transfer-Encoding: chunked\r\n\r\n5 ;a\r\nhello\r\n0\r\n\r\n",
        400,
    ),
    ("chunk ext bare CR", _H + b"Transfer-Encoding: chunked\r\n\r\n0;a\rb\r\n\r\n", 400),
    ("chunk ext bare LF", _H + b"Transfer-Encoding: chunked\r\n\r\n0;a\nb\r\n\r\n", 400),
    ("chunk ext open quote", _H + b'Transfer-Encoding: chunked\r\n\r\n0;a="b\r\n\r\n', 400),
    ("chunk ext NUL", _H + b"Transfer-Encoding: chunked\r\n\r\n0;a=\x00\r\n\r\n", 400),
    ("chunk size 0x", _H + b"Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n", 400),
    ("chunk size space", _H + b"Transfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n0\r\n\r\n", 400),
    ("chunk size lead sp", _H + b"Transfer-Encoding: chunked\r\n\r\n 5\r\nhello\r\n0\r\n\r\n", 400),
    ("chunk size empty", _H + b"Transfer-Encoding: chunked\r\n\r\n\r\nhello\r\n0\r\n\r\n", 400),
    ("chunk size 17 hex", _H + b"Transfer-Encoding: chunked\r\n\r\n" + b"0" * 16 + b"1\r\n", 400),
    ("chunk size bare LF", _H + b"Transfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n", 400),
    ("no CRLF after data", _H + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n", 400),
    ("LF after chunk data", _H + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\n0\r\n\r\n", 400),
    (
        "data longer than size",
        _H + b"Transfer-Encoding: chunked\r\n\r\n3\r\nhello\r\n0\r\n\r\n",
        400,
    ),
    # Trailer fields are read and dropped (test_http1_accept.py); framing among them refused.
    ("trailer CL", _H + b"Transfer-Encoding: chunked\r\n\r\n0\r\nContent-Length: 1\r\n\r\n", 400),
    ("trailer obs-fold", _H + b"Transfer-Encoding: chunked\r\n\r\n0\r\nX: 1\r\n 2\r\n\r\n", 400),
    ("LF ends chunked", _H + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\n", 400),
    ("truncated chunked", _H + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhel", 400),
    ("truncated length", _H + b"Content-Length: 5\r\n\r\nhel", 400),
]


@pytest.mark.parametrize(
    ("data", "status"), [(d, s) for _, d, s in SMUGGLING], ids=[n for n, _, _ in SMUGGLING]
)
def test_refused(data: bytes, status: int) -> None:
    assert refusal(data) == status


def test_refusal_while_incomplete_is_immediate() -> None:
    # No need to wait for the end of the head to refuse these.
    for data, status in [
        (b"\x16\x03", 400),
        (b"\r\n\n", 400),
        (b"\r\r", 400),
        (b"\r\n" * 5, 400),
        (b"GET / HTTP/2.0\r\n", 505),
        (b"GET  / HTTP/1.1\r\n", 400),
        (b"GET / HTTP/1.1\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\n\n", 400),
    ]:
        with pytest.raises(HttpProtocolError) as info:
            parse_request_head(data)
        assert info.value.status_hint == status, data


# ---------------------------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------------------------


def test_request_line_too_long_is_414() -> None:
    long_target = b"/" + b"a" * 8192
    assert refusal(b"GET " + long_target + b" HTTP/1.1\r\nHost: a\r\n\r\n") == 414
    # Incomplete: refused as soon as the line is over the limit, without waiting for its end.
    assert refusal(b"GET " + long_target) == 414


def test_request_line_at_the_limit_is_read() -> None:
    line = b"GET /" + b"a" * (8192 - len(b"GET / HTTP/1.1")) + b" HTTP/1.1"
    assert len(line) == 8192
    head, _, _ = parse_request(line + b"\r\nHost: a\r\n\r\n")
    assert len(head.target) == 8192 - len(b"GET  HTTP/1.1")


def test_too_many_headers_is_431() -> None:
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(100))
    parse_request(b"GET / HTTP/1.1\r\n" + fields[: -len(b"X-99: v\r\n")] + b"Host: a\r\n\r\n")
    assert refusal(b"GET / HTTP/1.1\r\nHost: a\r\n" + fields + b"\r\n") == 431


def test_oversize_head_is_431() -> None:
    big = b"X-Big: " + b"v" * 32768 + b"\r\n"
    assert refusal(b"GET / HTTP/1.1\r\nHost: a\r\n" + big + b"\r\n") == 431


def test_incomplete_head_beyond_the_limit_is_431_not_a_wait() -> None:
    data = b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: " + b"v" * 40000
    assert refusal(data) == 431
    # ... and exactly at the limit, not one byte later.
    limits = Limits(max_header_bytes=64)
    head = b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"v" * 64
    assert parse_request_head(head[:63], limits) is None
    assert refusal(head[:64], limits) == 431


def test_head_exactly_at_the_size_limit_is_read() -> None:
    data = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
    assert parse_request_head(data, Limits(max_header_bytes=len(data))) is not None
    assert refusal(data, Limits(max_header_bytes=len(data) - 1)) == 431


def test_syntax_error_before_the_size_limit_wins() -> None:
    # The first error in stream order is reported, whatever the segmentation.
    data = b"GET / HTTP/1.1\r\nHost: a\r\nBad Name: x\r\nX: " + b"v" * 40000
    assert refusal(data) == 400


def test_chunk_line_limit() -> None:
    # The limit counts the whole chunk-size line, CRLF included.
    head = _H + b"Transfer-Encoding: chunked\r\n\r\n"
    wire = head + b"ff\r\n" + b"x" * 255 + b"\r\n0\r\n\r\n"
    assert refusal(wire, Limits(max_chunk_line=3)) == 400
    parsed = parse_request_head(wire)
    assert parsed is not None
    reader = BodyReader.for_request(parsed[0], Limits(max_chunk_line=4))
    assert reader.feed(wire[parsed[1] :]) == b"x" * 255 and reader.done


def test_largest_chunk_size_is_read_as_a_number() -> None:
    parsed = parse_request_head(_H + b"Transfer-Encoding: chunked\r\n\r\n")
    assert parsed is not None
    reader = BodyReader.for_request(parsed[0])
    assert reader.feed(b"ffffffffffffffff\r\nabc") == b"abc"
    assert not reader.done


# ---------------------------------------------------------------------------------------------
# BodyReader details
# ---------------------------------------------------------------------------------------------


def _reader(kind_line: bytes) -> BodyReader:
    parsed = parse_request_head(_H + kind_line + b"\r\n\r\n")
    assert parsed is not None
    return BodyReader.for_request(parsed[0])


def test_length_reader_byte_by_byte() -> None:
    reader = _reader(b"Content-Length: 3")
    out = [reader.feed(bytes([c])) for c in b"abcNEXT"]
    assert out == [b"a", b"b", b"c", b"", b"", b"", b""]
    assert reader.done and reader.bytes_read == 3
    assert reader.take_leftover() == b"NEXT"
    assert reader.take_leftover() == b""


def test_chunked_reader_byte_by_byte() -> None:
    reader = _reader(b"Transfer-Encoding: chunked")
    data = b"3\r\nabc\r\n10\r\n" + b"z" * 16 + b"\r\n0\r\n\r\nNEXT"
    body = b"".join(reader.feed(bytes([c])) for c in data)
    assert body == b"abc" + b"z" * 16
    assert reader.done and reader.bytes_read == 19
    assert reader.take_leftover() == b"NEXT"


def test_feed_empty_and_eof() -> None:
    reader = _reader(b"Content-Length: 2")
    assert reader.feed(b"") == b""
    with pytest.raises(HttpProtocolError, match="truncated"):
        reader.feed_eof()
    done = _reader(b"Content-Length: 0")
    done.feed_eof()  # nothing missing: fine


def test_take_leftover_before_done_is_a_programming_error() -> None:
    with pytest.raises(RuntimeError):
        _reader(b"Content-Length: 2").take_leftover()


def test_until_close_reader_for_responses() -> None:
    parsed = parse_response_head(b"HTTP/1.0 200 OK\r\n\r\nabc", request_method=b"GET")
    assert parsed is not None
    head, _ = parsed
    assert head.body_kind is BodyKind.UNTIL_CLOSE and head.keep_alive is False
    reader = BodyReader.for_response(head)
    assert reader.feed(b"abc") == b"abc"
    assert not reader.done
    reader.feed_eof()
    assert reader.done and reader.bytes_read == 3 and reader.take_leftover() == b""


def test_response_body_errors_hint_502() -> None:
    parsed = parse_response_head(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", request_method=b"GET"
    )
    assert parsed is not None
    reader = BodyReader.for_response(parsed[0])
    with pytest.raises(HttpProtocolError) as info:
        reader.feed(b"5 ;ext\r\n")
    assert info.value.status_hint == 502


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def parse_response(data: bytes, method: bytes = b"GET") -> tuple[ResponseHead, int]:
    parsed = parse_response_head(data, request_method=method)
    assert parsed is not None
    return parsed


@pytest.mark.parametrize(
    ("data", "method", "kind", "length", "keep_alive"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b"GET", BodyKind.LENGTH, 2, True),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET",
            BodyKind.CHUNKED,
            0,
            True,
        ),
        (b"HTTP/1.1 200 OK\r\n\r\n", b"GET", BodyKind.UNTIL_CLOSE, 0, False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n", b"GET", BodyKind.LENGTH, 2, False),
        (
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n",
            b"GET",
            BodyKind.LENGTH,
            2,
            False,
        ),
        # RFC 9112 6.3 item 1: no body whatever the fields say.
        (b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n", b"HEAD", BodyKind.NONE, 0, True),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b"GET", BodyKind.NONE, 0, True),
        (b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n", b"GET", BodyKind.NONE, 0, True),
        (b"HTTP/1.1 100 Continue\r\n\r\n", b"POST", BodyKind.NONE, 0, True),
        (b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", b"GET", BodyKind.NONE, 0, True),
        # RFC 9112 6.3 item 2: a tunnel follows.
        (b"HTTP/1.1 200 Connection established\r\n\r\n", b"CONNECT", BodyKind.NONE, 0, True),
        (b"HTTP/1.1 407 Auth\r\nContent-Length: 1\r\n\r\n", b"CONNECT", BodyKind.LENGTH, 1, True),
    ],
)
def test_response_framing(
    data: bytes, method: bytes, kind: BodyKind, length: int, keep_alive: bool
) -> None:
    head, used = parse_response(data, method)
    assert used == len(data)
    assert (head.body_kind, head.content_length, head.keep_alive) == (kind, length, keep_alive)


def test_status_line_details() -> None:
    head, _ = parse_response(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    assert (head.status, head.reason, head.http_version) == (404, b"Not Found", b"1.1")
    assert head.get(b"content-length") == b"0"
    # Empty reason, with or without the SP (h11 reads both).
    assert parse_response(b"HTTP/1.1 200 \r\n\r\n")[0].reason == b""
    assert parse_response(b"HTTP/1.1 200\r\n\r\n")[0].reason == b""
    assert parse_response(b"HTTP/1.1 200 caf\xc3\xa9\r\n\r\n")[0].reason == b"caf\xc3\xa9"


def test_interim_then_final_response() -> None:
    data = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"
    first, used = parse_response(data, b"POST")
    assert first.status == 100
    second, _ = parse_response(data[used:], b"POST")
    assert second.status == 201


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 99 Low\r\n\r\n",
        b"HTTP/1.1 099 Low\r\n\r\n",
        b"HTTP/1.1 600 High\r\n\r\n",
        b"HTTP/1.1 20 Short\r\n\r\n",
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.2 200 OK\r\n\r\n",
        b"http/1.1 200 OK\r\n\r\n",
        b"HTTP/1.1  200 OK\r\n\r\n",
        b"HTTP/1.1 200 O\x00K\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n",
        b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded\r\n\r\n",
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
        b"\r\nHTTP/1.1 200 OK\r\n\r\n",
    ],
)
def test_response_refusals_hint_502(data: bytes) -> None:
    with pytest.raises(HttpProtocolError) as info:
        parse_response_head(data, request_method=b"GET")
    assert info.value.status_hint == 502


def test_response_limits() -> None:
    limits = Limits(max_header_bytes=64)
    with pytest.raises(HttpProtocolError) as info:
        parse_response_head(b"HTTP/1.1 200 OK\r\nX: " + b"v" * 80, limits, request_method=b"GET")
    assert info.value.status_hint == 502


# ---------------------------------------------------------------------------------------------
# Serialization and hop-by-hop fields
# ---------------------------------------------------------------------------------------------


def test_serialize_request_head() -> None:
    out = serialize_request_head(
        b"POST", b"/v1/messages", [(b"host", b"api.example"), (b"content-length", b"2")]
    )
    assert out == (b"POST /v1/messages HTTP/1.1\r\nhost: api.example\r\ncontent-length: 2\r\n\r\n")
    head, _, _ = parse_request(out + b"{}")
    assert head.headers == ((b"host", b"api.example"), (b"content-length", b"2"))


def test_serialize_response_head() -> None:
    out = serialize_response_head(200, b"OK", [(b"Content-Length", b"0")])
    assert out == b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    assert serialize_response_head(204, b"", []) == b"HTTP/1.1 204 \r\n\r\n"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (b"X", b"a\r\nInjected: 1"),
        (b"X", b"a\nb"),
        (b"X", b"a\rb"),
        (b"X", b"a\x00b"),
        (b"X", b"a\x7fb"),
        (b"X\r\nY", b"v"),
        (b"X: Y", b"v"),
        (b"", b"v"),
        (b"X\x00", b"v"),
        (b"X Y", b"v"),
    ],
)
def test_serializers_refuse_injection(name: bytes, value: bytes) -> None:
    with pytest.raises(HttpProtocolError):
        serialize_request_head(b"GET", b"/", [(name, value)])
    with pytest.raises(HttpProtocolError):
        serialize_response_head(200, b"OK", [(name, value)])


def test_serializers_refuse_bad_start_lines() -> None:
    for method, target in [
        (b"GET /", b"/"),
        (b"GET", b"/a b"),
        (b"GET", b"/\r\nX: y"),
        (b"", b"/"),
    ]:
        with pytest.raises(HttpProtocolError):
            serialize_request_head(method, target, [])
    for status, reason in [(99, b"x"), (600, b"x"), (200, b"OK\r\nX: y")]:
        with pytest.raises(HttpProtocolError):
            serialize_response_head(status, reason, [])


def test_encode_chunk() -> None:
    assert encode_chunk(b"") == b""
    assert encode_chunk(b"hello") == b"5\r\nhello\r\n"
    assert encode_chunk(b"x" * 255) == b"ff\r\n" + b"x" * 255 + b"\r\n"
    assert LAST_CHUNK == b"0\r\n\r\n"


def test_strip_hop_by_hop() -> None:
    headers = [
        (b"host", b"a"),
        (b"connection", b"keep-alive, X-Secret , x-other"),
        (b"keep-alive", b"timeout=5"),
        (b"proxy-authorization", b"Basic abc"),
        (b"te", b"trailers"),
        (b"x-secret", b"1"),
        (b"X-Other", b"2"),
        (b"transfer-encoding", b"chunked"),
        (b"upgrade", b"websocket"),
        (b"content-length", b"3"),
        (b"x-kept", b"3"),
    ]
    assert strip_hop_by_hop(headers) == [
        (b"host", b"a"),
        (b"content-length", b"3"),
        (b"x-kept", b"3"),
    ]
    assert {b"connection", b"proxy-connection", b"trailer", b"trailers"} <= HOP_BY_HOP


def test_connection_cannot_strip_framing_or_routing_fields() -> None:
    # "Connection: content-length" would strip the length of a body we still forward.
    headers = [
        (b"host", b"a"),
        (b"connection", b"close, Content-Length, HOST"),
        (b"content-length", b"3"),
    ]
    assert strip_hop_by_hop(headers) == [(b"host", b"a"), (b"content-length", b"3")]


# ---------------------------------------------------------------------------------------------
# Properties (hypothesis)
# ---------------------------------------------------------------------------------------------

_TCHARS = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
tokens = st.binary(min_size=1, max_size=12).map(
    lambda b: bytes(_TCHARS[c % len(_TCHARS)] for c in b)
)
targets = st.binary(min_size=1, max_size=40).map(lambda b: bytes(0x21 + c % 94 for c in b))
_VALUE_ALPHABET = bytes([0x09, *range(0x20, 0x7F), *range(0x80, 0x100)])
values = (
    st.binary(max_size=30)
    .map(lambda b: bytes(_VALUE_ALPHABET[c % len(_VALUE_ALPHABET)] for c in b))
    .map(lambda v: v.strip(b" \t"))
)
_RESERVED = {b"host", b"content-length", b"transfer-encoding", b"connection", b"expect"}
fields = st.lists(
    st.tuples(tokens, values).filter(lambda f: f[0].lower() not in _RESERVED), max_size=8
)
bodies = st.lists(st.binary(min_size=1, max_size=40), max_size=4)


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]], bytes]:
    """(wire bytes, method, target, headers as parsed, body) of a valid HTTP/1.1 request."""
    method = draw(tokens)
    target = draw(targets)
    headers = [(b"host", draw(tokens).lower()), *draw(fields)]
    chunks = draw(bodies)
    framing = draw(st.sampled_from(["none", "length", "chunked"]))
    body = b"".join(chunks)
    if framing == "length":
        headers.append((b"content-length", b"%d" % len(body)))
        wire_body = body
    elif framing == "chunked":
        headers.append((b"transfer-encoding", b"chunked"))
        wire_body = b"".join(encode_chunk(c) for c in chunks) + LAST_CHUNK
    else:
        body = wire_body = b""
    wire = serialize_request_head(method, target, headers) + wire_body
    parsed = [(name.lower(), value) for name, value in headers]
    return wire, method, target, parsed, body


@given(requests())
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_roundtrip_serialize_parse(
    case: tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]], bytes],
) -> None:
    wire, method, target, headers, body = case
    head, parsed_body, leftover = parse_request(wire)
    assert (head.method, head.target, head.http_version) == (method, target, b"1.1")
    assert list(head.headers) == headers
    assert parsed_body == body and leftover == b""


@given(requests())
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_generated_requests_read_like_h11(
    case: tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]], bytes],
) -> None:
    wire, _, _, _, body = case
    head, parsed_body, _ = parse_request(wire)
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(wire)
    event = conn.next_event()
    assert isinstance(event, h11.Request)
    assert (event.method, event.target, list(event.headers)) == (
        head.method,
        head.target,
        list(head.headers),
    )
    h11_body = b""
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Data):
            h11_body += event.data
        else:
            assert isinstance(event, h11.EndOfMessage)
            break
    assert h11_body == parsed_body == body


@given(
    st.integers(min_value=100, max_value=599),
    values,
    fields,
    st.sampled_from([b"GET", b"HEAD", b"POST"]),
)
@settings(max_examples=300)
def test_roundtrip_response_head(
    status: int, reason: bytes, headers: list[tuple[bytes, bytes]], method: bytes
) -> None:
    wire = serialize_response_head(status, reason, headers)
    head, used = parse_response(wire, method)
    assert used == len(wire)
    assert (head.status, head.reason, head.http_version) == (status, reason, b"1.1")
    assert list(head.headers) == [(name.lower(), value) for name, value in headers]
    no_body = method == b"HEAD" or status < 200 or status in (204, 304)
    assert head.body_kind is (BodyKind.NONE if no_body else BodyKind.UNTIL_CLOSE)


def _read_in_pieces(wire: bytes, cuts: list[int]) -> tuple[object, ...]:
    """Drive head parser and body reader over `wire` cut at `cuts`, like the adapter does."""
    points = sorted({c % (len(wire) + 1) for c in cuts} | {len(wire)})
    pieces, start = [], 0
    for p in points:
        pieces.append(wire[start:p])
        start = p
    buf = bytearray()
    reader: BodyReader | None = None
    head: RequestHead | None = None
    body = bytearray()
    try:
        for piece in pieces:
            if reader is None:
                buf += piece
                parsed = parse_request_head(buf)
                if parsed is None:
                    continue
                head, used = parsed
                reader = BodyReader.for_request(head)
                body += reader.feed(bytes(buf[used:]))
            else:
                body += reader.feed(piece)
    except HttpProtocolError as exc:
        return ("refused", exc.status_hint)
    return (head, bytes(body), reader is not None and reader.done)


@given(requests(), st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_segmentation_does_not_change_the_reading(
    case: tuple[bytes, bytes, bytes, list[tuple[bytes, bytes]], bytes], cuts: list[int]
) -> None:
    wire = case[0]
    assert _read_in_pieces(wire, cuts) == _read_in_pieces(wire, [])


@given(st.binary(max_size=200), st.lists(st.integers(min_value=0, max_value=400), max_size=8))
@settings(max_examples=500)
def test_arbitrary_bytes_only_raise_protocol_errors(data: bytes, cuts: list[int]) -> None:
    # Prefixed with a valid head so the body readers see arbitrary bytes too.
    for prefix in (b"", _H + b"Transfer-Encoding: chunked\r\n\r\n"):
        wire = prefix + data
        assert _read_in_pieces(wire, cuts) == _read_in_pieces(wire, [])
        with contextlib.suppress(HttpProtocolError):
            parse_response_head(data, request_method=b"GET")


@given(bodies, st.lists(st.integers(min_value=0, max_value=500), max_size=10))
def test_encode_chunk_roundtrip(chunks: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(encode_chunk(c) for c in chunks) + LAST_CHUNK + b"NEXT"
    reader = _reader(b"Transfer-Encoding: chunked")
    points = sorted({c % (len(wire) + 1) for c in cuts} | {len(wire)})
    out, start = b"", 0
    for p in points:
        out += reader.feed(wire[start:p])
        start = p
    assert reader.done and out == b"".join(chunks) and reader.take_leftover() == b"NEXT"
