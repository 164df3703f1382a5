"""What RFC 9112 asks a recipient to accept, accepted within bounds, and nothing beyond.

- 2.2: empty lines (CRLF) before a request line are skipped, at most `max_empty_lines`;
- 7.1.1: chunk extensions are parsed by their grammar, bounded by the chunk-line limit, ignored;
- 7.1.2: trailer fields are parsed as field lines, bounded like the header section, dropped.

Each accepted case is also read by h11 (the oracle of fuzz/fuzz_http1_differential.py) to the
same body, and read the same whether it arrives at once or byte by byte.
"""

from __future__ import annotations

import h11
import pytest

from proxycore.errors import HttpProtocolError
from proxycore.protocol.http1 import (
    DEFAULT_LIMITS,
    BodyReader,
    Limits,
    RequestHead,
    parse_request_head,
    parse_response_head,
    reference_parse_request_head,
)

_GET = b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"
_CHUNKED = b"POST /up HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"


def read_all(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[tuple[RequestHead, bytes]]:
    """Every request in `data` (heads and decoded bodies), fed at once."""
    out = []
    buf = data
    while buf:
        parsed = parse_request_head(buf, limits)
        assert parsed is not None, buf
        head, used = parsed
        reader = BodyReader.for_request(head, limits)
        body = reader.feed(buf[used:])
        assert reader.done
        out.append((head, body))
        buf = reader.take_leftover()
    return out


def read_bytewise(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[tuple[RequestHead, bytes]]:
    """The same, one byte at a time (as a peer trickling its request would send it)."""
    out = []
    buf = bytearray()
    reader: BodyReader | None = None
    head: RequestHead | None = None
    body = bytearray()
    for byte in data:
        if reader is None:
            buf.append(byte)
            parsed = parse_request_head(buf, limits)
            if parsed is None:
                continue
            head, used = parsed
            assert used == len(buf)
            buf.clear()
            reader = BodyReader.for_request(head, limits)
        else:
            body += reader.feed(bytes([byte]))
        if reader.done:
            assert head is not None
            out.append((head, bytes(body)))
            assert reader.take_leftover() == b""
            reader, body = None, bytearray()
    assert reader is None and not buf
    return out


def h11_bodies(data: bytes) -> list[bytes]:
    """The bodies h11 reads from `data`, once the empty lines it refuses are gone."""
    bodies = []
    buf = data
    while buf:
        buf = buf.lstrip(b"\r\n")
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(buf)
        body = bytearray()
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            assert event is not h11.NEED_DATA
        bodies.append(bytes(body))
        buf = conn.trailing_data[0]
    return bodies


def refused(data: bytes, limits: Limits = DEFAULT_LIMITS) -> int:
    with pytest.raises(HttpProtocolError) as info:
        read_all(data, limits)
    with pytest.raises(HttpProtocolError) as bytewise:
        read_bytewise(data, limits)
    assert bytewise.value.status_hint == info.value.status_hint
    return info.value.status_hint


ACCEPTED = {
    # RFC 9112 2.2
    "one leading CRLF": b"\r\n" + _GET,
    "four leading CRLF": b"\r\n" * 4 + _GET,
    "CRLF between pipelined requests": _GET + b"\r\n" + _GET + b"\r\n\r\n" + _GET,
    "CRLF after a body": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nok\r\n" + _GET,
    # RFC 9112 7.1.1
    "ext name": _CHUNKED + b"5;a\r\nhello\r\n0\r\n\r\n",
    "ext token value": _CHUNKED + b"5;a=b\r\nhello\r\n0\r\n\r\n",
    "ext BWS": _CHUNKED + b"5;\ta = b ;c\r\nhello\r\n0\r\n\r\n",
    "ext quoted": _CHUNKED + b'5;a="b; c=d \\" e"\r\nhello\r\n0\r\n\r\n',
    "ext quoted obs-text": _CHUNKED + b'5;a="caf\xc3\xa9"\r\nhello\r\n0\r\n\r\n',
    "ext several": _CHUNKED + b'5;a;b=c;d=""\r\nhello\r\n0;last=1\r\n\r\n',
    "ext on last chunk": _CHUNKED + b"0;a=b\r\n\r\n",
    "ext filling the line": _CHUNKED + b"5;a=" + b"x" * 1018 + b"\r\nhello\r\n0\r\n\r\n",
    # RFC 9112 7.1.2
    "one trailer": _CHUNKED + b"5\r\nhello\r\n0\r\nX-Checksum: abc\r\n\r\n",
    "trailers, then a request": _CHUNKED + b"0\r\nA: 1\r\nB:\r\nC: \t x \r\n\r\n" + _GET,
    "trailer with obs-text": _CHUNKED + b"0\r\nX: caf\xc3\xa9\r\n\r\n",
    "100 trailers": _CHUNKED + b"0\r\n" + b"T: x\r\n" * 100 + b"\r\n",
    "ext and trailer": _CHUNKED + b"3;x\r\nabc\r\n0;y\r\nT: 1\r\n\r\n",
}


@pytest.mark.parametrize("data", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_accepted_as_h11_reads_it_whatever_the_segmentation(data: bytes) -> None:
    whole = read_all(data)
    assert [body for _, body in whole] == h11_bodies(data)
    assert read_bytewise(data) == whole


def test_empty_lines_are_not_part_of_the_head() -> None:
    data = b"\r\n\r\n" + _GET + b"tail"
    for parse in (parse_request_head, reference_parse_request_head):
        parsed = parse(data)
        assert parsed is not None
        head, used = parsed
        assert head.raw == _GET and head.start_len == len(b"GET / HTTP/1.1")
        assert used == 4 + len(_GET) and data[used:] == b"tail"
    # Incomplete: wait for more, never refuse early.
    for prefix in (b"\r", b"\r\n", b"\r\n\r", b"\r\n\r\nGET / HT"):
        assert parse_request_head(prefix) is None


def test_empty_lines_are_bounded() -> None:
    assert refused(b"\r\n" * 5 + _GET) == 400
    assert refused(b"\r\n\r\n" + _GET, Limits(max_empty_lines=1)) == 400
    read_all(b"\r\n" + _GET, Limits(max_empty_lines=1))
    with pytest.raises(HttpProtocolError, match="empty lines"):
        parse_request_head(b"\r\n" * 5)  # refused as soon as the bound is passed


@pytest.mark.parametrize(
    "data",
    [
        b"\n" + _GET,  # bare LF (h11 skips it: we do not)
        b"\r" + _GET,
        b"\r\r\n" + _GET,
        b"\r\n\n" + _GET,
        b"\r\n " + _GET,
    ],
)
def test_only_crlf_empty_lines(data: bytes) -> None:
    assert refused(data) == 400


def test_responses_never_skip_empty_lines() -> None:
    # RFC 9112 2.2 speaks of a request-line; an upstream sending CRLF before a status line is
    # broken.
    with pytest.raises(HttpProtocolError) as info:
        parse_response_head(b"\r\nHTTP/1.1 200 OK\r\n\r\n", request_method=b"GET")
    assert info.value.status_hint == 502


BAD_EXTENSIONS = {
    "BWS before the first ;": b"5 ;a",
    "empty name": b"5;",
    "name missing": b"5;=b",
    "value missing": b"5;a=",
    "space in value": b"5;a=b c",
    "trailing space": b"5;a=b ",
    "unterminated quote": b'5;a="b',
    "text after quote": b'5;a="b"c',
    "bare CR": b"5;a\rb",
    "CR CR": b"5;a\r",
    "NUL": b"5;a=\x00",
    "control in quotes": b'5;a="\x01"',
    "DEL": b"5;a\x7f",
    "obs-text token": b"5;a\xe9",
    "escaped CR": b'5;a="\\\r"',
    "17 hex digits": b"00000000000000005;a",
}


@pytest.mark.parametrize("line", BAD_EXTENSIONS.values(), ids=BAD_EXTENSIONS.keys())
def test_extensions_outside_the_grammar_are_refused(line: bytes) -> None:
    assert refused(_CHUNKED + line + b"\r\nhello\r\n0\r\n\r\n") == 400


def test_extension_line_limit() -> None:
    line = b"5;a=" + b"x" * 1019 + b"\r\n"  # 1025 bytes with its CRLF: one over
    assert refused(_CHUNKED + line + b"hello\r\n0\r\n\r\n") == 400
    assert refused(_CHUNKED + b"5;a=xxxx\r\nhello\r\n0\r\n\r\n", Limits(max_chunk_line=8)) == 400


def test_extension_control_refused_before_the_line_ends() -> None:
    parsed = parse_request_head(_CHUNKED)
    assert parsed is not None
    reader = BodyReader.for_request(parsed[0])
    reader.feed(b"5;a=b")
    with pytest.raises(HttpProtocolError):
        reader.feed(b"\x00")
    reader = BodyReader.for_request(parsed[0])
    reader.feed(b"5;a\r")
    with pytest.raises(HttpProtocolError):
        reader.feed(b"x")  # a CR not followed by LF


BAD_TRAILERS = {
    "Content-Length": b"Content-Length: 5\r\n",
    "Transfer-Encoding": b"transfer-encoding: chunked\r\n",
    "obs-fold": b"X: a\r\n b\r\n",
    "space before colon": b"X : a\r\n",
    "no colon": b"X\r\n",
    "bare LF": b"X: a\n",
    "bare CR": b"X: a\rY: b\r\n",
    "control": b"X: a\x01\r\n",
    "NUL": b"X: \x00\r\n",
}


@pytest.mark.parametrize("lines", BAD_TRAILERS.values(), ids=BAD_TRAILERS.keys())
def test_trailers_outside_the_grammar_are_refused(lines: bytes) -> None:
    assert refused(_CHUNKED + b"0\r\n" + lines + b"\r\n") == 400


def test_trailer_section_ending_in_bare_lf_is_refused() -> None:
    assert refused(_CHUNKED + b"0\r\nX: 1\r\n\n") == 400


def test_trailers_are_bounded_like_the_header_section() -> None:
    limits = Limits(max_header_count=3, max_header_bytes=64)
    read_all(_CHUNKED + b"0\r\n" + b"T: x\r\n" * 3 + b"\r\n", limits)
    assert refused(_CHUNKED + b"0\r\n" + b"T: x\r\n" * 4 + b"\r\n", limits) == 400
    section = b"T: " + b"x" * 57 + b"\r\n\r\n"  # 64 bytes: at the limit
    read_all(_CHUNKED + b"0\r\n" + section, limits)
    assert refused(_CHUNKED + b"0\r\nT: " + b"x" * 58 + b"\r\n\r\n", limits) == 400
    # A line that never ends is refused at the limit, not when it ends.
    parsed = parse_request_head(_CHUNKED)
    assert parsed is not None
    reader = BodyReader.for_request(parsed[0], limits)
    reader.feed(b"0\r\nT: ")
    with pytest.raises(HttpProtocolError, match="trailer section larger"):
        reader.feed(b"x" * 100)


def test_response_extensions_and_trailers_are_read_and_dropped() -> None:
    parsed = parse_response_head(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", request_method=b"GET"
    )
    assert parsed is not None
    reader = BodyReader.for_response(parsed[0])
    body = reader.feed(b'4;sig="x"\r\nbody\r\n0\r\nServer-Timing: db;dur=53\r\n\r\nNEXT')
    assert body == b"body" and reader.done and reader.take_leftover() == b"NEXT"
    reader = BodyReader.for_response(parsed[0])
    with pytest.raises(HttpProtocolError) as info:
        reader.feed(b"0\r\nContent-Length: 4\r\n\r\n")
    assert info.value.status_hint == 502
