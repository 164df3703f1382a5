"""The ground of the HTTP/1.1 package: limits, framing kinds, the grammar as regexes, refusals.

Everything here is a constant or a pure function; the parser (`parse`, `diagnose`), the body
decoder (`body`) and the serializers (`serialize`, `relay`) are built on it, so that they can
never disagree about what a token, a field line or a hop-by-hop field is.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from proxycore.errors import HttpProtocolError

__all__ = [
    "DEFAULT_LIMITS",
    "HOP_BY_HOP",
    "BodyKind",
    "Limits",
]


# ---------------------------------------------------------------------------------------------
# Limits and framing kinds
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
    # Empty lines (CRLF) skipped before a request line (RFC 9112 2.2) -> 400 beyond. The trailer
    # section of a chunked body is held to max_header_count and max_header_bytes.
    max_empty_lines: int = 4


DEFAULT_LIMITS = Limits()


class BodyKind(enum.Enum):
    """How the end of a message body is found (RFC 9112 section 6.3)."""

    NONE = "none"  # no body at all
    LENGTH = "length"  # exactly `content_length` bytes
    CHUNKED = "chunked"  # chunked transfer coding, RFC 9112 section 7.1
    UNTIL_CLOSE = "until_close"  # responses only: the body ends when the server closes


# ---------------------------------------------------------------------------------------------
# Grammar (RFC 9110 section 5.6.2, RFC 9112 sections 3, 4 and 5)
# ---------------------------------------------------------------------------------------------

# tchar = "!" / "#" / "$" / "%" / "&" / "'" / "*" / "+" / "-" / "." / "^" / "_" / "`" / "|" / "~"
#       / DIGIT / ALPHA                                              (RFC 9110 section 5.6.2)
TCHAR = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]"
TOKEN = TCHAR + rb"+"
# request-target: whatever its form (origin, absolute, authority, asterisk; RFC 9112 3.2), it is
# made of visible ASCII only. No obs-text, no whitespace, no controls.
TARGET = rb"[\x21-\x7e]+"
# field-value characters: VCHAR / obs-text / SP / HTAB (RFC 9110 section 5.5). No other control
# character and no DEL: h11 lets most controls through (its issue #57), we do not. obs-text is
# accepted as opaque bytes, as RFC 9110 5.5 says a recipient SHOULD, and as h11 does.
VALUE_CHARS = rb"[\t\x20-\x7e\x80-\xff]*"
# field-line = field-name ":" OWS field-value OWS (RFC 9112 section 5). The name is a token and
# nothing may sit between it and the colon (RFC 9112 5.1: "No whitespace is allowed between the
# field name and colon"). A line that starts with SP or HTAB is obs-fold (RFC 9112 5.2), which the
# grammar below refuses because a field line must start with a tchar.
_FIELD_LINE = TOKEN + rb":" + VALUE_CHARS
# reason-phrase = 1*( HTAB / SP / VCHAR / obs-text ) (RFC 9112 section 4), possibly empty.
REASON = rb"[\t\x20-\x7e\x80-\xff]*"

# The hot path: a whole head, start line through the CRLF of its last field line, in one match.
# Possessive quantifiers (Python 3.11): the classes never overlap their delimiters, so there is
# nothing to backtrack into, and not recording backtrack points is measurably faster.
_FAST_FIELD_LINES = rb"(?:" + TCHAR + rb"++:[\t\x20-\x7e\x80-\xff]*+\r\n)*+"
REQUEST_HEAD_RE = re.compile(TCHAR + rb"++ [\x21-\x7e]++ HTTP/1\.[01]\r\n" + _FAST_FIELD_LINES)
RESPONSE_HEAD_RE = re.compile(
    rb"HTTP/1\.[01] [0-9]{3}(?: [\t\x20-\x7e\x80-\xff]*+)?\r\n" + _FAST_FIELD_LINES
)

# Start lines, complete (without CRLF). The version is captured loosely here so that a
# well-formed but unsupported version gets 505 rather than 400.
REQUEST_LINE_RE = re.compile(rb"(" + TOKEN + rb") (" + TARGET + rb") HTTP/([0-9]\.[0-9])")
STATUS_LINE_RE = re.compile(rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: (" + REASON + rb"))?")


def _prefix_pattern(pieces: list[bytes], tail: bytes) -> bytes:
    """A pattern matching every prefix of pieces[0] pieces[1] ... tail (each piece atomic)."""
    pattern = tail
    for piece in reversed(pieces):
        pattern = piece + rb"(?:" + pattern + rb")?"
    return rb"(?:" + pattern + rb")?"


# Every prefix of "<start line>\r": what the slow path holds an unfinished start line to, so that
# it can name the first bad byte of a line whose end has not arrived.
_VERSION_PIECES = [b"H", b"T", b"T", b"P", b"/", rb"[0-9]", rb"\.", rb"[0-9]"]
REQUEST_LINE_PREFIX_RE = re.compile(
    _prefix_pattern([TOKEN, b" ", TARGET, b" ", *_VERSION_PIECES], rb"\r?")
)
STATUS_LINE_PREFIX_RE = re.compile(
    _prefix_pattern(
        [*_VERSION_PIECES, b" ", rb"[0-9]", rb"[0-9]", rb"[0-9]"],
        rb"(?: " + REASON + rb")?\r?",
    )
)
FIELD_LINE_RE = re.compile(_FIELD_LINE)
# Every prefix of "<field line>\r", or "\r" (the start of the blank line that ends the head).
FIELD_LINE_PREFIX_RE = re.compile(rb"(?:" + TOKEN + rb"(?::" + VALUE_CHARS + rb"\r?)?|\r)?")

# chunk = chunk-size [ chunk-ext ] CRLF (RFC 9112 section 7.1); chunk-size = 1*HEXDIG, of which
# we allow at most 16 digits (2**64 - 1).
#   chunk-ext      = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS chunk-ext-val ] )   (7.1.1)
#   chunk-ext-name = token ; chunk-ext-val = token / quoted-string
#   quoted-string  = DQUOTE *( qdtext / quoted-pair ) DQUOTE                  (RFC 9110 5.6.4)
#   qdtext         = HTAB / SP / %x21 / %x23-5B / %x5D-7E / obs-text
#   quoted-pair    = "\" ( HTAB / SP / VCHAR / obs-text )
# Extensions are parsed by that grammar and then ignored (never forwarded: the proxy re-frames
# every body it relays). One deliberate restriction: no BWS before the first ";" -- h11 refuses
# "5 ;x", and "size SP" is where parsers have disagreed about where the size ends. No CR, LF or
# other control can occur in an extension, so the first LF ends the line for every reader.
_HEX = rb"[0-9A-Fa-f]"
_BWS = rb"[ \t]*+"
_QDTEXT = rb"[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]"
_QPAIR = rb"\\[\t \x21-\x7e\x80-\xff]"
_QUOTED = rb'"(?:' + _QDTEXT + rb"|" + _QPAIR + rb')*+"'
# Possessive throughout: each piece ends where the next cannot begin, so nothing is given back.
_EXT = (
    _BWS + TCHAR + rb"++(?:" + _BWS + rb"=" + _BWS + rb"(?:" + TCHAR + rb"++|" + _QUOTED + rb"))?+"
)
# A complete chunk line without its CRLF; group 1 is the size.
CHUNK_LINE_RE = re.compile(
    rb"(" + _HEX + rb"{1,16})(?:;" + _EXT + rb"(?:" + _BWS + rb";" + _EXT + rb")*+)?"
)
# While a chunk extension or a trailer line is still arriving, only its new bytes are checked (a
# control, or a CR that is not the last byte so far): a linear test per read, where the grammar
# would be quadratic for a peer that trickles the line. The grammar is applied at its LF.
LINE_BAD_BYTE_RE = re.compile(rb"\r(?=[\s\S])|[^\t\x20-\x7e\x80-\xff\r]")

TCHARS = frozenset(b"-!#$%&'*+.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
MAX_CONTENT_LENGTH = 2**63 - 1

# Field names whose values decide framing, routing or connection handling.
CONTENT_LENGTH = b"content-length"
TRANSFER_ENCODING = b"transfer-encoding"
HOST = b"host"
CONNECTION = b"connection"

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


def refuse(message: str, status: int) -> HttpProtocolError:
    """The error for a message this package will not read (or send), with its status hint."""
    return HttpProtocolError(message, status_hint=status)


def comma_tokens(value: bytes) -> list[bytes]:
    """Lowercased members of a comma-separated list field (RFC 9110 5.6.1), empties dropped."""
    return [t for t in (p.strip(b" \t") for p in value.lower().split(b",")) if t]
