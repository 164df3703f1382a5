"""Strict sans-IO HTTP/1.1 head parser, body decoder and serializer (the proxy's hot path).

Theory of operation
-------------------
A message head is parsed from the caller's receive buffer in one call, statelessly:
``parse_request_head(buf)`` returns ``None`` while the head is incomplete, the parsed head and the
number of bytes it used once ``buf`` holds the blank line that ends it, or raises
`HttpProtocolError`. The body that follows is decoded by a `BodyReader`, a small state machine
fed with whatever bytes arrive; bytes beyond the end of the message are kept as leftover for the
next (pipelined) message.

Strictness is the point. This parser sits in front of other HTTP implementations (the upstream
server, the agent's client), and request smuggling happens when two parsers read the same bytes
differently. So every input this module is unsure about is *refused*, never repaired and never
handed to a second parser: bare LF or CR, obs-fold, duplicate or conflicting framing headers,
transfer codings other than a single ``chunked``, chunk extensions, trailers. The differential
fuzzer (``fuzz/fuzz_http1_differential.py``) holds the parser to one invariant against h11 as an
oracle: for every input we either refuse, or read exactly what h11 reads.

Speed comes from doing the common case in C: one ``bytes.find`` for the end of the head, one
precompiled regex ``fullmatch`` that validates the whole head at once, one ``split`` into lines.
Only when that fast check fails does `_walk_head` go through the head line by line to find the
first offending byte and say what is wrong with it (the slow path runs only on refusals).

Refusals do not depend on how the input was segmented. An incomplete head is judged only at
points that every segmentation reaches with the same bytes (the first byte, the end of the start
line, the start-line limit, an "LF LF", the head-size limit), and at each of them `_walk_head`
reports the error that comes first in stream order; so the same bytes get the same verdict and
the same status_hint, whether they arrived at once or one by one. The price: an error inside the
field section of a head still arriving (a bare CR, a bad name) is reported when the head ends or
hits its size limit, not at the offending byte. ``fuzz/fuzz_http1_chunking.py`` checks all this.
All scans of an incomplete head are bounded finds, so a peer trickling bytes cannot make the
parser spend quadratic Python time.

A `BodyReader` decodes one body: Content-Length (count down), chunked (a four-state machine:
size line, data, the CRLF after data, the CRLF after the last chunk) or until-close; it returns
decoded bytes as soon as they arrive and refuses bad framing at the first byte that cannot be
extended into valid framing.

Status hints: request-side refusals carry the status to answer the client with (400, 414 for a
long request line, 431 for too many or too large header fields, 501 for an unknown transfer
coding, 505 for an unsupported HTTP version). Response-side refusals (a broken upstream) carry 502
throughout, the status the proxy answers its own client with.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NoReturn

from native import headscan as _native
from proxycore.errors import HttpProtocolError

__all__ = [
    "DEFAULT_LIMITS",
    "HOP_BY_HOP",
    "LAST_CHUNK",
    "BodyKind",
    "BodyReader",
    "Limits",
    "RequestHead",
    "ResponseHead",
    "encode_chunk",
    "parse_request_head",
    "parse_response_head",
    "serialize_request_head",
    "serialize_response_head",
    "strip_hop_by_hop",
]


# ---------------------------------------------------------------------------------------------
# Limits and result types
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limits:
    """Size limits on a message head and chunk-size lines.

    The defaults follow the servers this proxy stands in front of: nginx answers a request line
    over ``large_client_header_buffers`` (8 KiB) with 414; Envoy caps ``max_headers_count`` at 100;
    the whole head is capped between nginx (4 x 8 KiB) and Envoy (60 KiB).
    """

    max_request_line: int = 8192  # start line, without its CRLF -> 414 (responses: 502)
    max_header_count: int = 100  # field lines -> 431
    max_header_bytes: int = 32768  # whole head, start line through the final CRLFCRLF -> 431
    max_chunk_line: int = 1024  # a chunk-size line with its CRLF -> 400 (sizes: <= 16 hex digits)


DEFAULT_LIMITS = Limits()


class BodyKind(enum.Enum):
    """How the end of a message body is found (RFC 9112 section 6.3)."""

    NONE = "none"  # no body at all
    LENGTH = "length"  # exactly `content_length` bytes
    CHUNKED = "chunked"  # chunked transfer coding, RFC 9112 section 7.1
    UNTIL_CLOSE = "until_close"  # responses only: the body ends when the server closes


_NONE = BodyKind.NONE
_LENGTH = BodyKind.LENGTH
_CHUNKED = BodyKind.CHUNKED
_UNTIL_CLOSE = BodyKind.UNTIL_CLOSE


class _Head:
    """What request and response heads share: the bytes as received, and fields split lazily.

    Read-only by convention (plain slots, not a frozen dataclass: building one per message is on
    the hot path, and the relay fast path never needs the field list, only `raw`).
    """

    __slots__ = (
        "_headers",
        "body_kind",
        "content_length",
        "http_version",
        "keep_alive",
        "nominates",
        "raw",
        "start_len",
    )

    raw: bytes  # the head exactly as received, start line through the final CRLF CRLF
    start_len: int  # length of the start line (without its CRLF)
    http_version: bytes
    body_kind: BodyKind
    content_length: int
    keep_alive: bool
    # A Connection field names fields beyond close, keep-alive and the hop-by-hop set: the
    # relay must take the general path (`strip_hop_by_hop`) rather than `relay_fields`.
    nominates: bool
    _headers: tuple[tuple[bytes, bytes], ...] | None

    @property
    def headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """(lowercased name, value) pairs in order; Transfer-Encoding values lowercased."""
        headers = self._headers
        if headers is None:
            headers = self._headers = _split_fields(self.raw[:-4])
        return headers

    def get(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lowercase), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def _key(self) -> tuple[object, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        # Heads compare by what was read, as the frozen dataclasses they replace did.
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Head)
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]


class RequestHead(_Head):
    """A parsed request line and header section."""

    __slots__ = ("expect_continue", "method", "target")

    def __init__(
        self,
        raw: bytes,
        start_len: int,
        method: bytes,
        target: bytes,
        http_version: bytes,
        body_kind: BodyKind,
        content_length: int,
        keep_alive: bool,
        expect_continue: bool,
        nominates: bool,
    ) -> None:
        self.raw = raw
        self.start_len = start_len
        self.method = method
        self.target = target
        self.http_version = http_version
        self.body_kind = body_kind
        self.content_length = content_length
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.nominates = nominates
        self._headers = None

    def _key(self) -> tuple[object, ...]:
        return (
            self.method,
            self.target,
            self.http_version,
            self.headers,
            self.body_kind,
            self.content_length,
            self.keep_alive,
            self.expect_continue,
        )

    def __repr__(self) -> str:
        return f"RequestHead({self.method!r}, {self.target!r}, {self.http_version!r})"


class ResponseHead(_Head):
    """A parsed status line and header section."""

    __slots__ = ("reason", "status")

    def __init__(
        self,
        raw: bytes,
        start_len: int,
        status: int,
        reason: bytes,
        http_version: bytes,
        body_kind: BodyKind,
        content_length: int,
        keep_alive: bool,
        nominates: bool,
    ) -> None:
        self.raw = raw
        self.start_len = start_len
        self.status = status
        self.reason = reason
        self.http_version = http_version
        self.body_kind = body_kind
        self.content_length = content_length
        self.keep_alive = keep_alive
        self.nominates = nominates
        self._headers = None

    def _key(self) -> tuple[object, ...]:
        return (
            self.status,
            self.reason,
            self.http_version,
            self.headers,
            self.body_kind,
            self.content_length,
            self.keep_alive,
        )

    def __repr__(self) -> str:
        return f"ResponseHead({self.status}, {self.reason!r}, {self.http_version!r})"


# ---------------------------------------------------------------------------------------------
# Grammar (RFC 9110 section 5.6.2, RFC 9112 sections 3, 4 and 5)
# ---------------------------------------------------------------------------------------------

# tchar = "!" / "#" / "$" / "%" / "&" / "'" / "*" / "+" / "-" / "." / "^" / "_" / "`" / "|" / "~"
#       / DIGIT / ALPHA                                              (RFC 9110 section 5.6.2)
_TCHAR = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]"
_TOKEN = _TCHAR + rb"+"
# request-target: whatever its form (origin, absolute, authority, asterisk; RFC 9112 3.2), it is
# made of visible ASCII only. No obs-text, no whitespace, no controls.
_TARGET = rb"[\x21-\x7e]+"
# field-value characters: VCHAR / obs-text / SP / HTAB (RFC 9110 section 5.5). No other control
# character and no DEL: h11 lets most controls through (its issue #57), we do not. obs-text is
# accepted as opaque bytes, as RFC 9110 5.5 says a recipient SHOULD, and as h11 does.
_VALUE_CHARS = rb"[\t\x20-\x7e\x80-\xff]*"
# field-line = field-name ":" OWS field-value OWS (RFC 9112 section 5). The name is a token and
# nothing may sit between it and the colon (RFC 9112 5.1: "No whitespace is allowed between the
# field name and colon"). A line that starts with SP or HTAB is obs-fold (RFC 9112 5.2), which the
# grammar below refuses because a field line must start with a tchar.
_FIELD_LINE = _TOKEN + rb":" + _VALUE_CHARS
# reason-phrase = 1*( HTAB / SP / VCHAR / obs-text ) (RFC 9112 section 4), possibly empty.
_REASON = rb"[\t\x20-\x7e\x80-\xff]*"

# The hot path: a whole head, start line through the CRLF of its last field line, in one match.
# Possessive quantifiers (Python 3.11): the classes never overlap their delimiters, so there is
# nothing to backtrack into, and not recording backtrack points is measurably faster.
_FAST_FIELD_LINES = rb"(?:" + _TCHAR + rb"++:[\t\x20-\x7e\x80-\xff]*+\r\n)*+"
_REQUEST_HEAD_RE = re.compile(_TCHAR + rb"++ [\x21-\x7e]++ HTTP/1\.[01]\r\n" + _FAST_FIELD_LINES)
_RESPONSE_HEAD_RE = re.compile(
    rb"HTTP/1\.[01] [0-9]{3}(?: [\t\x20-\x7e\x80-\xff]*+)?\r\n" + _FAST_FIELD_LINES
)

# Start lines, complete (without CRLF). The version is captured loosely here so that a
# well-formed but unsupported version gets 505 rather than 400.
_REQUEST_LINE_RE = re.compile(rb"(" + _TOKEN + rb") (" + _TARGET + rb") HTTP/([0-9]\.[0-9])")
_STATUS_LINE_RE = re.compile(rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: (" + _REASON + rb"))?")


def _prefix_pattern(pieces: list[bytes], tail: bytes) -> bytes:
    """A pattern matching every prefix of pieces[0] pieces[1] ... tail (each piece atomic)."""
    pattern = tail
    for piece in reversed(pieces):
        pattern = piece + rb"(?:" + pattern + rb")?"
    return rb"(?:" + pattern + rb")?"


# Every prefix of "<start line>\r": what `_walk_head` holds an unfinished start line to, so that
# it can name the first bad byte of a line whose end has not arrived.
_VERSION_PIECES = [b"H", b"T", b"T", b"P", b"/", rb"[0-9]", rb"\.", rb"[0-9]"]
_REQUEST_LINE_PREFIX_RE = re.compile(
    _prefix_pattern([_TOKEN, b" ", _TARGET, b" ", *_VERSION_PIECES], rb"\r?")
)
_STATUS_LINE_PREFIX_RE = re.compile(
    _prefix_pattern(
        [*_VERSION_PIECES, b" ", rb"[0-9]", rb"[0-9]", rb"[0-9]"],
        rb"(?: " + _REASON + rb")?\r?",
    )
)
_FIELD_LINE_RE = re.compile(_FIELD_LINE)
# Every prefix of "<field line>\r", or "\r" (the start of the blank line that ends the head).
_FIELD_LINE_PREFIX_RE = re.compile(rb"(?:" + _TOKEN + rb"(?::" + _VALUE_CHARS + rb"\r?)?|\r)?")

_TCHARS = frozenset(
    b"-!#$%&'*+.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)
# chunk-size = 1*HEXDIG (RFC 9112 section 7.1). We allow at most 16 digits (2**64 - 1) and no
# chunk-ext at all (RFC 9112 7.1.1): extensions are where parsers have disagreed
# (quoted strings, bare LF inside them), and no client we serve sends them.
_CHUNK_SIZE_RE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CHUNK_SIZE_PREFIX_RE = re.compile(rb"(?:[0-9A-Fa-f]{1,16}\r?)?")
_MAX_CONTENT_LENGTH = 2**63 - 1

# Field names whose values decide framing, routing or connection handling.
_CONTENT_LENGTH = b"content-length"
_TRANSFER_ENCODING = b"transfer-encoding"
_HOST = b"host"
_CONNECTION = b"connection"


def _refuse(message: str, status: int) -> HttpProtocolError:
    return HttpProtocolError(message, status_hint=status)


# ---------------------------------------------------------------------------------------------
# Head parsing
# ---------------------------------------------------------------------------------------------


class _Side:
    """Per-direction constants for the shared head walker (requests vs responses)."""

    __slots__ = (
        "bad_status",
        "first_bytes",
        "head_too_large",
        "is_request",
        "line_prefix_re",
        "line_too_long",
        "what",
    )

    def __init__(self, *, is_request: bool) -> None:
        self.is_request = is_request
        self.what = "request" if is_request else "status"
        # A request line starts with a method (a token), a status line with "HTTP/".
        self.first_bytes = _TCHARS if is_request else frozenset(b"H")
        self.line_prefix_re = _REQUEST_LINE_PREFIX_RE if is_request else _STATUS_LINE_PREFIX_RE
        # A refused response means a broken upstream: the proxy answers its client 502.
        self.bad_status = 400 if is_request else 502
        self.line_too_long = 414 if is_request else 502
        self.head_too_large = 431 if is_request else 502


_REQUEST_SIDE = _Side(is_request=True)
_RESPONSE_SIDE = _Side(is_request=False)


def _describe_bad_line(line: bytes, *, field: bool) -> str:
    """Say what is wrong with a start line or field line that failed its grammar (slow path)."""
    if b"\n" in line:
        return "bare LF in message head (RFC 9112 2.2: lines end with CRLF)"
    stripped = line[:-1] if line.endswith(b"\r") else line
    if b"\r" in stripped:
        return "bare CR in message head (RFC 9112 2.2)"
    if b"\x00" in line:
        return "NUL byte in message head"
    if field:
        if line[:1] in (b" ", b"\t"):
            return "obs-fold (line folding) is not accepted (RFC 9112 5.2)"
        name, colon, _ = line.partition(b":")
        if not colon:
            return "field line without a colon"
        if name[-1:] in (b" ", b"\t"):
            return "whitespace between field name and colon (RFC 9112 5.1)"
        if not name or any(c not in _TCHARS for c in name):
            return "field name is not a token (RFC 9110 5.1)"
        return "invalid character in field value (RFC 9110 5.5)"
    return "malformed start line (RFC 9112 3 and 4)"


def _check_start_line(line: bytes, side: _Side) -> None:
    """Validate a complete start line (without its CRLF); raise on anything but the grammar."""
    if side.is_request:
        m = _REQUEST_LINE_RE.fullmatch(line)
        if m is None:
            raise _refuse(
                f"invalid request line: {_describe_bad_line(line, field=False)}", side.bad_status
            )
        version = m.group(3)
    else:
        m = _STATUS_LINE_RE.fullmatch(line)
        if m is None:
            raise _refuse(
                f"invalid status line: {_describe_bad_line(line, field=False)}", side.bad_status
            )
        version = m.group(1)
        status = int(m.group(2))
        # RFC 9110 section 15: valid status codes are 100 to 599.
        if not 100 <= status <= 599:
            raise _refuse(f"status code {status} out of range", side.bad_status)
    if version not in (b"1.0", b"1.1"):
        # RFC 9110 15.6.6: 505 HTTP Version Not Supported. HTTP/1.2+ or 0.9 is refused outright.
        raise _refuse(
            f"unsupported HTTP version {version.decode('ascii')}",
            505 if side.is_request else side.bad_status,
        )


def _walk_head(buf: bytes | bytearray, end: int, limits: Limits, side: _Side) -> None:
    """Go through buf[:end] line by line, in stream order, and raise the first error found.

    `end` is either the end of a complete head's last field line (just before the final CRLF)
    or the end of the bytes available so far; then the last line may be incomplete and is held
    to be a valid prefix. Used as the single source of truth for refusals, so that a refusal and
    its status hint are the same whatever the segmentation of the input (see module docstring).
    Returns normally if no error is found in buf[:end].
    """
    max_line = limits.max_request_line
    line_window = min(end, max_line + 2)
    eol = buf.find(b"\r\n", 0, line_window)
    if eol < 0:
        partial = bytes(buf[:line_window])
        if side.line_prefix_re.fullmatch(partial) is None:
            raise _refuse(
                f"invalid {side.what} line: {_describe_bad_line(partial, field=False)}",
                side.bad_status,
            )
        if line_window >= max_line + 2:
            raise _refuse(f"{side.what} line longer than {max_line} bytes", side.line_too_long)
        return
    _check_start_line(bytes(buf[:eol]), side)
    pos = eol + 2
    count = 0
    while pos < end:
        nl = buf.find(b"\r\n", pos, end)
        if nl < 0:
            partial = bytes(buf[pos:end])
            if _FIELD_LINE_PREFIX_RE.fullmatch(partial) is None:
                raise _refuse(
                    f"invalid field line: {_describe_bad_line(partial, field=True)}",
                    side.bad_status,
                )
            return
        line = bytes(buf[pos:nl])
        if _FIELD_LINE_RE.fullmatch(line) is None:
            raise _refuse(
                f"invalid field line: {_describe_bad_line(line, field=True)}", side.bad_status
            )
        count += 1
        if count > limits.max_header_count:
            raise _refuse(f"more than {limits.max_header_count} header fields", side.head_too_large)
        pos = nl + 2


def _refuse_at(
    buf: bytes | bytearray, end: int, limits: Limits, side: _Side, message: str, status: int
) -> NoReturn:
    """Raise the first error in buf[:end] (via `_walk_head`), or else `message`."""
    _walk_head(buf, end, limits, side)
    raise _refuse(message, status)


def _check_incomplete(buf: bytes | bytearray, limits: Limits, side: _Side) -> None:
    """Refuse an incomplete head now if it can already be refused; else return (need more).

    Checks, each at a point that does not depend on how the bytes were segmented (module
    docstring): a bad first byte (a TLS ClientHello on a plaintext port is refused at once, as
    h11 does), a bare LF or a bad start line once its line end arrives, a start line over its
    limit, an "LF LF" (an LF-only client gets a 400 now rather than a timeout), and a head over
    its size limit. All scans are bounded finds at memchr speed, so a peer trickling one byte at
    a time cannot make this quadratic in Python code.
    """
    n = len(buf)
    if n == 0:
        return
    if buf[0] not in side.first_bytes:
        # A message never starts with CR, LF, SP or a control. RFC 9112 2.2 allows a server to
        # skip empty lines before a request line; we refuse them (so does h11).
        _refuse_at(buf, 1, limits, side, f"invalid {side.what} line", side.bad_status)
    max_line = limits.max_request_line
    lf = buf.find(b"\n", 0, min(n, max_line + 2))
    if lf >= 0:
        if lf == 0 or buf[lf - 1] != 0x0D:
            _refuse_at(buf, lf + 1, limits, side, "bare LF in start line", side.bad_status)
        _check_start_line(bytes(buf[: lf - 1]), side)
    elif n >= max_line + 2:
        # 414 unless a syntax error comes first.
        _refuse_at(
            buf,
            max_line + 2,
            limits,
            side,
            f"{side.what} line longer than {max_line} bytes",
            side.line_too_long,
        )
    window = min(n, limits.max_header_bytes)
    lflf = buf.find(b"\n\n", 0, window)
    if lflf >= 0:
        _refuse_at(buf, lflf + 2, limits, side, "bare LF in message head", side.bad_status)
    if n >= limits.max_header_bytes:
        # No head end within the limit: refuse with whichever error comes first in the stream
        # (a syntax error inside the window, too many fields, or else the size itself).
        _refuse_at(
            buf,
            window,
            limits,
            side,
            f"message head larger than {limits.max_header_bytes} bytes",
            side.head_too_large,
        )


def _comma_tokens(value: bytes) -> list[bytes]:
    """Lowercased members of a comma-separated list field (RFC 9110 5.6.1), empties dropped."""
    return [t for t in (p.strip(b" \t") for p in value.lower().split(b",")) if t]


# The fields that decide framing and connection handling, found in one pass over the lowercased
# head (their values are compared case-insensitively anyway). Only these are looked at on the hot
# path; the full field list is split out lazily, if someone asks for `headers`.
_SPECIAL_FIELD_RE = re.compile(
    rb"\r\n(c(?:ontent-length|onnection)|transfer-encoding|host|expect):[ \t]*+([^\r]*)"
)


def _split_fields(head: bytes) -> tuple[tuple[bytes, bytes], ...]:
    """All field lines of an accepted head (without its final CRLF CRLF) as (lowercased name,
    value without surrounding OWS); Transfer-Encoding values lowercased, as h11 reads them."""
    fields: list[tuple[bytes, bytes]] = []
    append = fields.append
    lines = head.split(b"\r\n")
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.lower()
        # RFC 9112 5: OWS around the value is not part of it.
        value = value.strip(b" \t")
        if name == _TRANSFER_ENCODING:
            value = value.lower()
        append((name, value))
    return tuple(fields)


def _read_fields(
    head: bytes, limits: Limits, side: _Side
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
        _refuse_at(head + b"\r\n", len(head) + 2, limits, side, "head over limits", 431)
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
        if name == _HOST:
            host_count += 1
        elif name == _CONNECTION:
            # RFC 9112 9.6. The two common values first, then the general list.
            if value == b"keep-alive":
                continue
            if value == b"close":
                close = True
                continue
            for token in _comma_tokens(value):
                if token == b"close":
                    close = True
                elif token != b"keep-alive" and token not in HOP_BY_HOP:
                    nominates = True
        elif name == _CONTENT_LENGTH:
            # RFC 9112 6.3 item 5: several Content-Length values, or a list, are an
            # unrecoverable framing error. Unlike h11 we refuse identical duplicates too
            # ("5, 5", or two lines).
            if content_length >= 0:
                raise _refuse("more than one Content-Length field", bad)
            # Content-Length = 1*DIGIT (RFC 9110 8.6): no sign, no inner whitespace, no
            # list; at most 19 digits and below 2**63 (h11 allows 20 digits).
            # (bytes.isdigit is ASCII-only.)
            if not value.isdigit() or len(value) > 19:
                raise _refuse("invalid Content-Length value", bad)
            content_length = int(value)
            if content_length > _MAX_CONTENT_LENGTH:
                raise _refuse("Content-Length too large", bad)
        elif name == _TRANSFER_ENCODING:
            if chunked:
                raise _refuse("more than one Transfer-Encoding field", bad)
            # RFC 9112 6.1: we understand only the chunked coding, alone; a server answers
            # an unknown coding with 501. "chunked, chunked" and "gzip, chunked" included.
            # Coding names are case-insensitive (RFC 9112 7).
            if value != b"chunked":
                raise _refuse(
                    "unsupported Transfer-Encoding (only 'chunked')",
                    501 if side.is_request else bad,
                )
            chunked = True
        elif b"100-continue" in _comma_tokens(value):
            expect_continue = True  # Expect, RFC 9110 10.1.1
    if chunked:
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding MUST be treated as having
        # faulty framing. RFC 9112 6.3 item 3: TE together with CL "ought to be handled as an
        # error" -- the classic smuggling vector, refused.
        if http_version == b"1.0":
            raise _refuse("Transfer-Encoding in an HTTP/1.0 message", bad)
        if content_length >= 0:
            raise _refuse("both Transfer-Encoding and Content-Length", bad)
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
    if idx < 0:
        _check_incomplete(buf, limits, _REQUEST_SIDE)
        return None
    if _REQUEST_HEAD_RE.fullmatch(buf, 0, idx + 2) is None:
        _refuse_at(buf, idx + 2, limits, _REQUEST_SIDE, "invalid request head", 400)
    raw = bytes(buf[: idx + 4])
    start, http_version, chunked, content_length, close, expect_continue, host_count, nominates = (
        _read_fields(raw[:idx], limits, _REQUEST_SIDE)
    )
    # RFC 9112 3.2: a 1.1 request without Host, or any request with more than one, gets 400.
    if host_count != 1 and (host_count > 1 or http_version == b"1.1"):
        raise _refuse(f"{host_count} Host fields (RFC 9112 3.2: exactly one)", 400)
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
    side = _RESPONSE_SIDE
    idx = buf.find(b"\r\n\r\n", 0, limits.max_header_bytes)
    if idx < 0:
        _check_incomplete(buf, limits, side)
        return None
    if _RESPONSE_HEAD_RE.fullmatch(buf, 0, idx + 2) is None:
        _refuse_at(buf, idx + 2, limits, side, "invalid response head", 502)
    raw = bytes(buf[: idx + 4])
    start, http_version, chunked, content_length, close, _, _, nominates = _read_fields(
        raw[:idx], limits, side
    )
    status = int(start[9:12])
    if not 100 <= status <= 599:
        raise _refuse(f"status code {status} out of range", 502)
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


# ---------------------------------------------------------------------------------------------
# Body decoding
# ---------------------------------------------------------------------------------------------


class _Chunk(enum.Enum):
    """States of the chunked decoder (RFC 9112 section 7.1)."""

    SIZE = 0  # reading a chunk-size line
    DATA = 1  # inside chunk data
    DATA_CRLF = 2  # expecting the CRLF after chunk data
    LAST_CRLF = 3  # after "0\r\n": expecting the CRLF that ends an empty trailer section
    DONE = 4


class BodyReader:
    """Sans-IO decoder for one message body.

    Feed it bytes as they arrive; `feed` returns the decoded body bytes now available. Once
    `done`, bytes that were fed beyond the end of the message are in `take_leftover()`.
    """

    __slots__ = (
        "_chunk_remaining",
        "_chunk_state",
        "_crlf_seen",
        "_done",
        "_kind",
        "_leftover",
        "_limits",
        "_line",
        "_remaining",
        "_status",
        "bytes_read",
    )

    def __init__(self, kind: BodyKind, content_length: int, limits: Limits, status: int) -> None:
        self._kind = kind
        self._limits = limits
        self._status = status
        self._remaining = content_length
        self._done = kind is BodyKind.NONE or (kind is BodyKind.LENGTH and content_length == 0)
        self._leftover = bytearray()
        self._chunk_state = _Chunk.SIZE
        self._chunk_remaining = 0
        self._line = bytearray()
        self._crlf_seen = 0
        self.bytes_read = 0

    @classmethod
    def for_request(cls, head: RequestHead, limits: Limits = DEFAULT_LIMITS) -> BodyReader:
        """A decoder for the body of `head` (refusals carry status_hint 400)."""
        return cls(head.body_kind, head.content_length, limits, 400)

    @classmethod
    def for_response(cls, head: ResponseHead, limits: Limits = DEFAULT_LIMITS) -> BodyReader:
        """A decoder for the body of `head` (refusals carry status_hint 502)."""
        return cls(head.body_kind, head.content_length, limits, 502)

    @property
    def done(self) -> bool:
        """True once the end of the message body has been read."""
        return self._done

    def take_leftover(self) -> bytes:
        """Bytes fed beyond the end of this message (the start of the next one)."""
        if not self._done:
            raise RuntimeError("take_leftover() before the body is done")
        out = bytes(self._leftover)
        self._leftover.clear()
        return out

    def feed_eof(self) -> None:
        """The peer closed its side: the end of an UNTIL_CLOSE body, a truncation otherwise."""
        if self._done:
            return
        if self._kind is BodyKind.UNTIL_CLOSE:
            self._done = True
            return
        raise _refuse(
            "truncated body: connection closed before the end of the message", self._status
        )

    def feed(self, data: bytes) -> bytes:
        """Consume `data`; return the decoded body bytes it completes (possibly b"")."""
        if self._done:
            self._leftover += data
            return b""
        kind = self._kind
        if kind is BodyKind.LENGTH:
            remaining = self._remaining
            if len(data) < remaining:
                self._remaining = remaining - len(data)
                self.bytes_read += len(data)
                return data
            self._remaining = 0
            self._done = True
            self._leftover += data[remaining:]
            self.bytes_read += remaining
            return data[:remaining]
        if kind is BodyKind.UNTIL_CLOSE:
            self.bytes_read += len(data)
            return data
        return self._feed_chunked(data)

    def _feed_chunked(self, data: bytes) -> bytes:
        out: list[bytes] = []
        pos = 0
        n = len(data)
        status = self._status
        while pos < n:
            state = self._chunk_state
            if state is _Chunk.DATA:
                take = min(self._chunk_remaining, n - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._chunk_remaining -= take
                if self._chunk_remaining == 0:
                    self._chunk_state = _Chunk.DATA_CRLF
                    self._crlf_seen = 0
            elif state is _Chunk.SIZE:
                # Accumulate the chunk-size line up to its LF, refusing as soon as it cannot
                # be "1*16HEXDIG CRLF" any more (so a refusal never waits for more input).
                lf = data.find(b"\n", pos)
                stop = n if lf < 0 else lf + 1
                self._line += data[pos:stop]
                pos = stop
                line = self._line
                if len(line) > self._limits.max_chunk_line:
                    raise _refuse("chunk-size line too long", status)
                if lf < 0:
                    # Still a prefix of "1*16HEXDIG CR"? Refuse now if it cannot become one.
                    if _CHUNK_SIZE_PREFIX_RE.fullmatch(line) is None:
                        raise _refuse(_describe_chunk_line(bytes(line)), status)
                    continue
                if (
                    not line.endswith(b"\r\n")
                    or _CHUNK_SIZE_RE.fullmatch(line, 0, len(line) - 2) is None
                ):
                    raise _refuse(_describe_chunk_line(bytes(line)), status)
                size = int(line[:-2], 16)
                self._line = bytearray()
                if size == 0:
                    self._chunk_state = _Chunk.LAST_CRLF
                    self._crlf_seen = 0
                else:
                    self._chunk_state = _Chunk.DATA
                    self._chunk_remaining = size
            else:
                # DATA_CRLF / LAST_CRLF: exactly CRLF, byte by byte. CVE-2025-43859 was h11
                # accepting any two bytes after chunk data; a non-empty trailer section
                # (RFC 9112 7.1.2) is refused rather than parsed, as is a bare LF.
                expected = b"\r\n"[self._crlf_seen]
                if data[pos] != expected:
                    if state is _Chunk.LAST_CRLF and self._crlf_seen == 0:
                        raise _refuse("trailer fields are not accepted", status)
                    raise _refuse("chunk data not followed by CRLF", status)
                pos += 1
                self._crlf_seen += 1
                if self._crlf_seen == 2:
                    if state is _Chunk.LAST_CRLF:
                        self._chunk_state = _Chunk.DONE
                        self._done = True
                        self._leftover += data[pos:]
                        break
                    self._chunk_state = _Chunk.SIZE
        result = b"".join(out)
        self.bytes_read += len(result)
        return result


def _describe_chunk_line(line: bytes) -> str:
    if b";" in line:
        return "chunk extensions are not accepted (RFC 9112 7.1.1)"
    if line.endswith(b"\n") and not line.endswith(b"\r\n"):
        return "bare LF in chunk-size line"
    digits = len(line) - len(line.lstrip(b"0123456789abcdefABCDEF"))
    if digits > 16:
        return "chunk size too large"
    return f"invalid chunk-size line {line[:40]!r}"


# ---------------------------------------------------------------------------------------------
# Serialization
# ---------------------------------------------------------------------------------------------

_TOKEN_RE = re.compile(_TOKEN)
_TARGET_RE = re.compile(_TARGET)
_FIELD_VALUE_RE = re.compile(_VALUE_CHARS)

LAST_CHUNK = b"0\r\n\r\n"


def _serialize_fields(out: list[bytes], headers: Iterable[tuple[bytes, bytes]]) -> None:
    for name, value in headers:
        # Refuse anything our own parser would refuse: above all CR, LF and NUL, so a value
        # that arrived somewhere can never inject a field line or end the head early.
        if _TOKEN_RE.fullmatch(name) is None:
            raise _refuse(f"refusing to send invalid field name {name[:40]!r}", 500)
        if _FIELD_VALUE_RE.fullmatch(value) is None:
            raise _refuse(f"refusing to send invalid value for field {name[:40]!r}", 500)
        out.append(name)
        out.append(b": ")
        out.append(value)
        out.append(b"\r\n")
    out.append(b"\r\n")


def serialize_request_head(
    method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> bytes:
    """Encode an HTTP/1.1 request head. Framing fields are the caller's business."""
    if _TOKEN_RE.fullmatch(method) is None:
        raise _refuse(f"refusing to send invalid method {method[:40]!r}", 500)
    if _TARGET_RE.fullmatch(target) is None:
        raise _refuse("refusing to send invalid request target", 500)
    out = [method, b" ", target, b" HTTP/1.1\r\n"]
    _serialize_fields(out, headers)
    return b"".join(out)


def serialize_response_head(
    status: int, reason: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> bytes:
    """Encode an HTTP/1.1 response head."""
    if not 100 <= status <= 599:
        raise _refuse(f"refusing to send status code {status}", 500)
    if _FIELD_VALUE_RE.fullmatch(reason) is None:
        raise _refuse("refusing to send invalid reason phrase", 500)
    out = [b"HTTP/1.1 %d " % status, reason, b"\r\n"]
    _serialize_fields(out, headers)
    return b"".join(out)


def encode_chunk(data: bytes) -> bytes:
    """Encode `data` as one chunk; b"" gives b"" (an empty chunk would end the body)."""
    if not data:
        return b""
    return b"%x\r\n%b\r\n" % (len(data), data)


# RFC 9110 7.6.1 (Connection and the fields it lists), plus the de-facto hop-by-hop fields:
# Keep-Alive, Proxy-Connection (RFC 9110 7.6.1 names both), TE, Trailer(s), Transfer-Encoding,
# Upgrade, and Proxy-Authenticate/-Authorization (RFC 9110 11.7: consumed by the proxy).
HOP_BY_HOP: frozenset[bytes] = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Fields a peer cannot turn hop-by-hop by naming them in Connection: dropping them would change
# where the message goes or where it ends ("Connection: content-length" would strip the length
# of a body we still forward -- a smuggling primitive). RFC 9110 7.6.1 forbids a sender to name
# such fields; we ignore those tokens rather than refuse, so this never raises, on either side.
# The Connection field itself is always dropped, so the next hop never sees the nomination.
_NEVER_NOMINATED = frozenset({b"content-length", b"host"})


def strip_hop_by_hop(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Drop hop-by-hop fields and every field named in a Connection field (RFC 9110 7.6.1).

    Names are compared case-insensitively. Connection cannot remove Content-Length or Host.
    """
    items = list(headers)
    drop = set(HOP_BY_HOP)
    for name, value in items:
        if name.lower() == b"connection":
            drop.update(_comma_tokens(value))
    drop -= _NEVER_NOMINATED
    return [(name, value) for name, value in items if name.lower() not in drop]


# ---------------------------------------------------------------------------------------------
# The relay fast path: header lines forwarded as they arrived, minus the ones we drop
# ---------------------------------------------------------------------------------------------
#
# Parsing a head into tuples, stripping and re-serializing it costs more than the rest of a
# forward exchange. A head that `parse_*_head` accepted is already known to be clean: CRLF line
# endings, no obs-fold, token names directly followed by ":", no CR, LF or NUL in values. So its
# field block can be forwarded as bytes, with the dropped fields cut out by one regex pass in C.
# `relay_fields` is equivalent to `strip_hop_by_hop` (tests/test_http1_relay.py holds the two to
# each other); when a Connection field nominates other fields it returns None and the caller
# takes the general path.


class DropSet:
    """Field names `relay_fields` cuts out: a regex for the reference path, a mask for C."""

    __slots__ = ("mask", "names", "pattern")

    def __init__(self, names: Iterable[bytes]) -> None:
        self.names = frozenset(name.lower() for name in names)
        alternatives = b"|".join(
            re.escape(name) for name in sorted(self.names, key=len, reverse=True)
        )
        # Whole field lines (with their leading CRLF) of the given names.
        self.pattern = re.compile(rb"\r\n(?:" + alternatives + rb"):[^\r]*", re.IGNORECASE)
        # None when a name is beyond what the C relay knows: the regex serves.
        self.mask = _native.drop_mask(self.names) if _native.AVAILABLE else None


def compile_drop(names: Iterable[bytes]) -> DropSet:
    """The drop set for `relay_fields` of these field names (case-insensitive)."""
    return DropSet(names)


RESPONSE_DROP = compile_drop(HOP_BY_HOP)


def relay_fields(head: RequestHead | ResponseHead, drop: DropSet) -> bytes | None:
    """The field lines of a parsed head minus those in `drop`, each led by CRLF.

    The caller writes: start line + result + its own `\r\nname: value` lines + CRLF CRLF.

    The result holds neither the start line nor the final blank line. None when a Connection
    field names a field beyond close/keep-alive and the hop-by-hop set (`head.nominates`).
    """
    if drop.mask is not None and not head.nominates:
        fields = _native.relay_fields(head.raw, head.start_len, drop.mask)
        if fields is not None:
            return fields
    return reference_relay_fields(head, drop)


def reference_relay_fields(head: RequestHead | ResponseHead, drop: DropSet) -> bytes | None:
    """`relay_fields` by regex alone: the behaviour the C relay is held to."""
    if head.nominates:
        return None
    raw = head.raw
    return drop.pattern.sub(b"", raw[head.start_len : len(raw) - 4])
