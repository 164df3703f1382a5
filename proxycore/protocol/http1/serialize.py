"""Serialization of message heads and chunks, and the general path's hop-by-hop stripping.

The serializers refuse (status hint 500: our own bug) anything the parser would refuse, above
all CR, LF and NUL in a name or value, so that a value that arrived somewhere can never inject a
field line or end a head early.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from proxycore.protocol.http1.grammar import (
    HOP_BY_HOP,
    TARGET,
    TOKEN,
    VALUE_CHARS,
    comma_tokens,
    refuse,
)

__all__ = [
    "LAST_CHUNK",
    "encode_chunk",
    "serialize_request_head",
    "serialize_response_head",
    "strip_hop_by_hop",
]

_TOKEN_RE = re.compile(TOKEN)
_TARGET_RE = re.compile(TARGET)
_FIELD_VALUE_RE = re.compile(VALUE_CHARS)

LAST_CHUNK = b"0\r\n\r\n"


def _serialize_fields(out: list[bytes], headers: Iterable[tuple[bytes, bytes]]) -> None:
    for name, value in headers:
        # Refuse anything our own parser would refuse: above all CR, LF and NUL, so a value
        # that arrived somewhere can never inject a field line or end the head early.
        if _TOKEN_RE.fullmatch(name) is None:
            raise refuse(f"refusing to send invalid field name {name[:40]!r}", 500)
        if _FIELD_VALUE_RE.fullmatch(value) is None:
            raise refuse(f"refusing to send invalid value for field {name[:40]!r}", 500)
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
        raise refuse(f"refusing to send invalid method {method[:40]!r}", 500)
    if _TARGET_RE.fullmatch(target) is None:
        raise refuse("refusing to send invalid request target", 500)
    out = [method, b" ", target, b" HTTP/1.1\r\n"]
    _serialize_fields(out, headers)
    return b"".join(out)


def serialize_response_head(
    status: int, reason: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> bytes:
    """Encode an HTTP/1.1 response head."""
    if not 100 <= status <= 599:
        raise refuse(f"refusing to send status code {status}", 500)
    if _FIELD_VALUE_RE.fullmatch(reason) is None:
        raise refuse("refusing to send invalid reason phrase", 500)
    out = [b"HTTP/1.1 %d " % status, reason, b"\r\n"]
    _serialize_fields(out, headers)
    return b"".join(out)


def encode_chunk(data: bytes) -> bytes:
    """Encode `data` as one chunk; b"" gives b"" (an empty chunk would end the body)."""
    if not data:
        return b""
    return b"%x\r\n%b\r\n" % (len(data), data)


# Fields a peer cannot turn hop-by-hop by naming them in Connection: dropping them would change
# where the message goes or where it ends ("Connection: content-length" would strip the length
# of a body we still forward -- a smuggling primitive). RFC 9110 7.6.1 forbids a sender to name
# such fields; we ignore those tokens rather than refuse, so this never raises, on either side.
# The Connection field itself is always dropped, so the next hop never sees the nomination.
_NEVER_NOMINATED = frozenset({b"content-length", b"host"})


def strip_hop_by_hop(
    headers: Iterable[tuple[bytes, bytes]], *, keep_underscores: bool = False
) -> list[tuple[bytes, bytes]]:
    """Drop hop-by-hop fields and every field named in a Connection field (RFC 9110 7.6.1), and,
    unless `keep_underscores`, every field whose name holds an underscore.

    Names are compared case-insensitively. Connection cannot remove Content-Length or Host.

    Underscores: a name such as "Transfer_Encoding" is a valid token, and a back end that maps
    "_" to "-" (CGI, and the frameworks that read fields from a CGI-style environment) reads it
    as "Transfer-Encoding": a second framing field that this proxy never saw as one. nginx drops
    such request fields by default (underscores_in_headers off), Envoy can drop or refuse them
    (headers_with_underscores_action). We drop them from every request we forward; the caller
    passes `keep_underscores` for responses (see relay.RESPONSE_DROP).
    """
    items = list(headers)
    drop = set(HOP_BY_HOP)
    for name, value in items:
        if name.lower() == b"connection":
            drop.update(comma_tokens(value))
    drop -= _NEVER_NOMINATED
    return [
        (name, value)
        for name, value in items
        if name.lower() not in drop and (keep_underscores or b"_" not in name)
    ]
