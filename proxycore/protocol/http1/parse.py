"""Head parsing: the C scanner for the common case, the Python reference for everything else.

`parse_request_head` / `parse_response_head` first ask the C scanner (native/src/headscan.c);
whatever it does not accept outright goes to `reference_parse_*_head`, which defines the
behaviour: one regex `fullmatch` validates the whole head, one pass over the lowercased head
reads the fields that decide framing, and `diagnose.walk_head` names the first error when the
regex fails.
"""

from __future__ import annotations

import re

from native import headscan as _native
from proxycore.protocol.http1.diagnose import (
    REQUEST_SIDE,
    RESPONSE_SIDE,
    Side,
    check_incomplete,
    refuse_at,
)
from proxycore.protocol.http1.grammar import (
    CONNECTION,
    CONTENT_LENGTH,
    DEFAULT_LIMITS,
    HOP_BY_HOP,
    HOST,
    MAX_CONTENT_LENGTH,
    REQUEST_HEAD_RE,
    RESPONSE_HEAD_RE,
    TRANSFER_ENCODING,
    BodyKind,
    Limits,
    comma_tokens,
    refuse,
)
from proxycore.protocol.http1.heads import RequestHead, ResponseHead

__all__ = [
    "parse_request_head",
    "parse_response_head",
    "reference_parse_request_head",
    "reference_parse_response_head",
]

_NONE = BodyKind.NONE
_LENGTH = BodyKind.LENGTH
_CHUNKED = BodyKind.CHUNKED
_UNTIL_CLOSE = BodyKind.UNTIL_CLOSE


# The fields that decide framing and connection handling, found in one pass over the lowercased
# head (their values are compared case-insensitively anyway). Only these are looked at on the hot
# path; the full field list is split out lazily, if someone asks for `headers`.
_SPECIAL_FIELD_RE = re.compile(
    rb"\r\n(c(?:ontent-length|onnection)|transfer-encoding|host|expect):[ \t]*+([^\r]*)"
)


def _read_fields(
    head: bytes, limits: Limits, side: Side
) -> tuple[bytes, bytes, bool, int, bool, bool, int, bool]:
    """Check the limits of a head that passed the fast regex and read its framing fields.

    Returns (start line, HTTP version, chunked, content_length or -1, "Connection: close",
    "Expect: 100-continue", number of Host fields, whether a Connection field nominates other
    fields). One function for both directions, so that requests and responses can never be
    framed by different rules.
    """
    first_eol = head.find(b"\r\n")
    start = head if first_eol < 0 else head[:first_eol]
    # The fast regex fixed the layout: "... HTTP/1.x" or "HTTP/1.x ...".
    http_version = start[-3:] if side.is_request else start[5:8]
    # Each field line takes at least 4 bytes ("\r\nX:"): short heads cannot be over the count.
    if len(start) > limits.max_request_line or (
        len(head) > 4 * limits.max_header_count and head.count(b"\r\n") > limits.max_header_count
    ):
        refuse_at(head + b"\r\n", len(head) + 2, limits, side, "head over limits", 431)
    bad = side.bad_status
    chunked = False
    content_length = -1
    close = False
    expect_continue = False
    host_count = 0
    nominates = False
    for name, value in _SPECIAL_FIELD_RE.findall(head.lower()):
        # RFC 9112 5: OWS around the value is not part of it (the regex took the leading OWS).
        value = value.rstrip(b" \t")
        if name == HOST:
            host_count += 1
        elif name == CONNECTION:
            # RFC 9112 9.6. The two common values first, then the general list.
            if value == b"keep-alive":
                continue
            if value == b"close":
                close = True
                continue
            for token in comma_tokens(value):
                if token == b"close":
                    close = True
                elif token != b"keep-alive" and token not in HOP_BY_HOP:
                    nominates = True
        elif name == CONTENT_LENGTH:
            # RFC 9112 6.3 item 5: several Content-Length values, or a list, are an
            # unrecoverable framing error. Unlike h11 we refuse identical duplicates too
            # ("5, 5", or two lines).
            if content_length >= 0:
                raise refuse("more than one Content-Length field", bad)
            # Content-Length = 1*DIGIT (RFC 9110 8.6): no sign, no inner whitespace, no
            # list; at most 19 digits and below 2**63 (h11 allows 20 digits).
            # (bytes.isdigit is ASCII-only.)
            if not value.isdigit() or len(value) > 19:
                raise refuse("invalid Content-Length value", bad)
            content_length = int(value)
            if content_length > MAX_CONTENT_LENGTH:
                raise refuse("Content-Length too large", bad)
        elif name == TRANSFER_ENCODING:
            if chunked:
                raise refuse("more than one Transfer-Encoding field", bad)
            # RFC 9112 6.1: we understand only the chunked coding, alone; a server answers
            # an unknown coding with 501. "chunked, chunked" and "gzip, chunked" included.
            # Coding names are case-insensitive (RFC 9112 7).
            if value != b"chunked":
                raise refuse(
                    "unsupported Transfer-Encoding (only 'chunked')",
                    501 if side.is_request else bad,
                )
            chunked = True
        elif b"100-continue" in comma_tokens(value):
            expect_continue = True  # Expect, RFC 9110 10.1.1
    if chunked:
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding MUST be treated as having
        # faulty framing. RFC 9112 6.3 item 3: TE together with CL "ought to be handled as an
        # error" -- the classic smuggling vector, refused.
        if http_version == b"1.0":
            raise refuse("Transfer-Encoding in an HTTP/1.0 message", bad)
        if content_length >= 0:
            raise refuse("both Transfer-Encoding and Content-Length", bad)
    return (
        start,
        http_version,
        chunked,
        content_length,
        close,
        expect_continue,
        host_count,
        nominates,
    )


def parse_request_head(
    buf: bytes | bytearray, limits: Limits = DEFAULT_LIMITS
) -> tuple[RequestHead, int] | None:
    """Parse a request head from the start of `buf`.

    Returns None while more bytes are needed, else the head and the number of bytes it took
    (through the final CRLFCRLF). Raises HttpProtocolError (400, 414, 431, 501 or 505) on
    anything it will not read, including an incomplete head already past the limits.

    The C scanner (native/src/headscan.c) reads the common case; whatever it does not accept
    outright goes to `reference_parse_request_head`, which defines the behaviour.
    """
    facts = _native.scan_head(
        buf, True, limits.max_request_line, limits.max_header_count, limits.max_header_bytes
    )
    if facts is None:
        return reference_parse_request_head(buf, limits)
    head_len, start_len, token_end, target_end, content_length, _, minor, flags = facts
    raw = bytes(buf[: head_len + 4])
    return _request_head(
        raw,
        start_len,
        raw[:token_end],
        raw[token_end + 1 : target_end],
        b"1.1" if minor else b"1.0",
        bool(flags & _native.FLAG_CHUNKED),
        content_length,
        bool(flags & _native.FLAG_CLOSE),
        bool(flags & _native.FLAG_EXPECT_CONTINUE),
        bool(flags & _native.FLAG_NOMINATES),
    ), head_len + 4


def reference_parse_request_head(
    buf: bytes | bytearray, limits: Limits = DEFAULT_LIMITS
) -> tuple[RequestHead, int] | None:
    """`parse_request_head` in Python alone: the behaviour the C scanner is held to."""
    # RFC 9112 2.2: the head ends at the first empty line. Search only where a head within the
    # size limit could end.
    idx = buf.find(b"\r\n\r\n", 0, limits.max_header_bytes)
    # Leading empty lines (RFC 9112 2.2) fail both the search and the regex below (a request
    # line starts with a tchar), so they cost the common case nothing.
    if idx < 0:
        if buf[:1] == b"\r":
            return _after_empty_lines(buf, limits)
        check_incomplete(buf, limits, REQUEST_SIDE)
        return None
    if REQUEST_HEAD_RE.fullmatch(buf, 0, idx + 2) is None:
        if buf[:1] == b"\r":
            return _after_empty_lines(buf, limits)
        refuse_at(buf, idx + 2, limits, REQUEST_SIDE, "invalid request head", 400)
    raw = bytes(buf[: idx + 4])
    start, http_version, chunked, content_length, close, expect_continue, host_count, nominates = (
        _read_fields(raw[:idx], limits, REQUEST_SIDE)
    )
    # RFC 9112 3.2: a 1.1 request without Host, or any request with more than one, gets 400.
    if host_count != 1 and (host_count > 1 or http_version == b"1.1"):
        raise refuse(f"{host_count} Host fields (RFC 9112 3.2: exactly one)", 400)
    method, target, _ = start.split(b" ")
    return _request_head(
        raw,
        len(start),
        method,
        target,
        http_version,
        chunked,
        content_length,
        close,
        expect_continue,
        nominates,
    ), idx + 4


def _after_empty_lines(buf: bytes | bytearray, limits: Limits) -> tuple[RequestHead, int] | None:
    """The request after the empty lines that lead `buf` (the C scanner defers on these).

    RFC 9112 2.2: "a server that is expecting to receive and parse a request-line SHOULD ignore
    at least one empty line (CRLF) received prior to the request-line" (a client may send one
    after a POST body). We skip up to `limits.max_empty_lines` CRLFs and refuse more, and a bare
    CR or LF, as everywhere in a head. The head's `raw` does not hold them; the count of bytes
    used does. Each verdict is taken on a prefix every segmentation reaches (a complete CRLF).
    """
    skip = 0
    n = len(buf)
    while skip < n and buf[skip] == 0x0D:
        if skip + 1 == n:
            return None
        if buf[skip + 1] != 0x0A:
            raise refuse("invalid request line: bare CR in message head (RFC 9112 2.2)", 400)
        skip += 2
        if skip > 2 * limits.max_empty_lines:
            raise refuse(
                f"more than {limits.max_empty_lines} empty lines before the request line", 400
            )
    parsed = reference_parse_request_head(buf[skip:], limits)
    if parsed is None:
        return None
    head, used = parsed
    return head, used + skip


def _request_head(
    raw: bytes,
    start_len: int,
    method: bytes,
    target: bytes,
    http_version: bytes,
    chunked: bool,
    content_length: int,
    close: bool,
    expect_continue: bool,
    nominates: bool,
) -> RequestHead:
    """The request head from the facts of an accepted head (either parser)."""
    if chunked:
        kind, length = _CHUNKED, 0
    elif content_length >= 0:
        kind, length = _LENGTH, content_length
    else:
        # RFC 9112 6.3 item 7: a request with neither field has no body.
        kind, length = _NONE, 0
    is_11 = http_version == b"1.1"
    return RequestHead(
        raw,
        start_len,
        method,
        target,
        http_version,
        kind,
        length,
        # RFC 9112 9.3: 1.1 is persistent unless "close"; 1.0 keep-alive is not honoured
        # (as in h11): the connection closes after the response.
        is_11 and not close,
        # RFC 9110 10.1.1: a server MUST ignore 100-continue in an HTTP/1.0 request.
        is_11 and expect_continue,
        nominates,
    )


def parse_response_head(
    buf: bytes | bytearray, limits: Limits = DEFAULT_LIMITS, *, request_method: bytes
) -> tuple[ResponseHead, int] | None:
    """Parse a response head from the start of `buf`; `request_method` decides its framing.

    Returns None while more bytes are needed, else the head and the number of bytes it took.
    1xx interim responses come back as heads with BodyKind.NONE: the caller loops for the final
    response (and handles 101, and a 2xx answer to CONNECT, after which the bytes are no longer
    HTTP). Raises HttpProtocolError (status_hint 502) on anything it will not read. The status
    line is held to `max_request_line`. As for requests, the C scanner reads the common case
    and `reference_parse_response_head` everything else.
    """
    facts = _native.scan_head(
        buf, False, limits.max_request_line, limits.max_header_count, limits.max_header_bytes
    )
    if facts is None:
        return reference_parse_response_head(buf, limits, request_method=request_method)
    head_len, start_len, _, _, content_length, status, minor, flags = facts
    raw = bytes(buf[: head_len + 4])
    return _response_head(
        raw,
        start_len,
        status,
        b"1.1" if minor else b"1.0",
        bool(flags & _native.FLAG_CHUNKED),
        content_length,
        bool(flags & _native.FLAG_CLOSE),
        bool(flags & _native.FLAG_NOMINATES),
        request_method,
    ), head_len + 4


def reference_parse_response_head(
    buf: bytes | bytearray, limits: Limits = DEFAULT_LIMITS, *, request_method: bytes
) -> tuple[ResponseHead, int] | None:
    """`parse_response_head` in Python alone: the behaviour the C scanner is held to."""
    side = RESPONSE_SIDE
    idx = buf.find(b"\r\n\r\n", 0, limits.max_header_bytes)
    if idx < 0:
        check_incomplete(buf, limits, side)
        return None
    if RESPONSE_HEAD_RE.fullmatch(buf, 0, idx + 2) is None:
        refuse_at(buf, idx + 2, limits, side, "invalid response head", 502)
    raw = bytes(buf[: idx + 4])
    start, http_version, chunked, content_length, close, _, _, nominates = _read_fields(
        raw[:idx], limits, side
    )
    status = int(start[9:12])
    if not 100 <= status <= 599:
        raise refuse(f"status code {status} out of range", 502)
    return _response_head(
        raw,
        len(start),
        status,
        http_version,
        chunked,
        content_length,
        close,
        nominates,
        request_method,
    ), idx + 4


def _response_head(
    raw: bytes,
    start_len: int,
    status: int,
    http_version: bytes,
    chunked: bool,
    content_length: int,
    close: bool,
    nominates: bool,
    request_method: bytes,
) -> ResponseHead:
    """The response head from the facts of an accepted head (either parser)."""
    # "HTTP/1.1 200" (no SP, no reason) is read as an empty reason, as h11 does; RFC 9112 4
    # says a client SHOULD ignore the reason anyway.
    reason = raw[13:start_len]
    # RFC 9112 6.3, in order: item 1 (HEAD, 1xx, 204, 304: no body whatever the fields say),
    # item 2 (2xx to CONNECT: a tunnel follows, the caller takes over the bytes), items 4, 5, 8.
    if (
        request_method == b"HEAD"
        or status < 200
        or status == 204
        or status == 304
        or (request_method == b"CONNECT" and status < 300)
    ):
        kind, length = _NONE, 0
    elif chunked:
        kind, length = _CHUNKED, 0
    elif content_length >= 0:
        kind, length = _LENGTH, content_length
    else:
        kind, length = _UNTIL_CLOSE, 0
    keep_alive = http_version == b"1.1" and not close and kind is not _UNTIL_CLOSE
    return ResponseHead(
        raw, start_len, status, reason, http_version, kind, length, keep_alive, nominates
    )
