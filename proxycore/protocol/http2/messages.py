"""HTTP/2 messages to and from the exchange's HTTP/1.1 form (RFC 9113 8.3, 8.2.2, 8.2.3).

Theory of operation: a stream's request goes through the same exchange as an HTTP/1.1 request
(`plan_request`: policy, SSRF checks, credential injection, scrubbing, refusals). The seam is
the HTTP/1.1 head: `request_head` writes the stream's request as one, which the strict HTTP/1.1
parser then reads like any other, so no second reading of a request exists. Writing it is safe
only for what cannot change its meaning in HTTP/1.1, so every field name must be a token and
every value free of CR, LF, NUL and other controls (h2 checks some of this; we check all of it
here, once): anything else refuses the stream (`MessageRefused`, 400).

The request target: a request to the proxy itself (its :authority is the gateway address the
connection arrived on) is origin-form (the reverse routes, the local API); any other authority
is a proxy request in absolute-form (`http://authority/path`), as an HTTP/1.1 client writes it
to a proxy. Inside a terminated CONNECT tunnel (HTTP/2 over the agent's TLS, ALPN h2) every
target is origin-form, as an HTTP/1.1 request inside one must be. CONNECT (RFC 9113 8.5) is
refused here: tunnels over a stream are not served yet; extended CONNECT for WebSocket (RFC
8441) is written by websocket.py, through this function.

A request with a body and no content-length is written chunked (the exchange re-frames it
anyway); "connection: close" makes each stream one exchange.

`response_fields` goes the other way: an HTTP/1.1 response head (already scrubbed by the
exchange) becomes the :status and the fields of an HTTP/2 response, minus the
connection-specific fields HTTP/2 forbids (RFC 9113 8.2.2). `decided_fields` gives the same
fields from the head the exchange decided (proxycore/protocol/responses.py) before it is
rendered as HTTP/1.1, so that a whole response need not be written out and read back.
"""

from __future__ import annotations

import functools
import re

from proxycore.errors import PolicyDenied
from proxycore.protocol import http1
from proxycore.protocol.http1.grammar import TOKEN
from proxycore.protocol.http1.heads import split_fields
from proxycore.protocol.http2.events import RequestReceived
from proxycore.protocol.http2.fields import CONNECTION_SPECIFIC, well_formed
from proxycore.protocol.policy import normalize_host

__all__ = ["MessageRefused", "decided_fields", "request_head", "response_fields"]

_TOKEN_RE = re.compile(TOKEN)
_TARGET_RE = re.compile(rb"[\x21-\x7e]+")
# Replaced by the head's own (host from :authority, framing, connection).
_REPLACED = frozenset({b"host", b"te"})
_RESPONSE_DROP = http1.HOP_BY_HOP | CONNECTION_SPECIFIC
_CLOSE_DROP = _RESPONSE_DROP | {b"close"}


class MessageRefused(Exception):
    """Internal: the stream's request cannot be written as HTTP/1.1; answer `status`."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error = error
        self.message = message


def _authority_host(authority: bytes) -> str:
    text = authority.decode("ascii", "replace")
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


# Whether an :authority names the proxy itself (the gateway the connection arrived on), for the
# authorities that come again and again: reading one costs more than the rest of the head.
# Bounded; an authority carries no secret (userinfo is refused before).
@functools.lru_cache(maxsize=1024)
def _is_own(authority: bytes, gateway: str) -> bool:
    try:
        return normalize_host(_authority_host(authority)) == gateway
    except PolicyDenied:
        return False


def request_head(request: RequestReceived, gateway: str, *, origin_form: bool = False) -> bytes:
    """The stream's request as an HTTP/1.1 head (see the module docstring). `origin_form`: the
    stream is inside a terminated tunnel, whose authority is the tunnel's whatever the stream
    names: the target is the path, and :authority is only the head's Host (which the exchange
    holds to the tunnel's host)."""
    if request.malformed:
        raise MessageRefused(400, "bad_request", f"malformed HTTP/2 request: {request.malformed}")
    method = request.method
    if method == b"CONNECT":
        what = "extended CONNECT (RFC 8441)" if request.protocol else "CONNECT"
        raise MessageRefused(
            501,
            "not_implemented",
            f"{what} over HTTP/2 is not served by this proxy; use CONNECT over HTTP/1.1",
        )
    if not _TOKEN_RE.fullmatch(method):
        raise MessageRefused(400, "bad_request", "bad :method")
    path, authority = request.path, request.authority
    if not _TARGET_RE.fullmatch(path) or not (path[:1] == b"/" or path == b"*"):
        raise MessageRefused(400, "bad_request", "bad :path")
    if not authority or not _TARGET_RE.fullmatch(authority) or b"@" in authority:
        raise MessageRefused(400, "bad_request", "bad or missing :authority")
    if origin_form or _is_own(authority, gateway):
        target = path
    else:
        scheme = request.scheme.lower() or b"http"
        if scheme not in (b"http", b"https"):
            raise MessageRefused(400, "bad_request", "bad :scheme")
        target = scheme + b"://" + authority + path
    lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method, target, authority)]
    cookies: list[bytes] = []
    length: bytes | None = None
    for name, value in request.headers:
        if not well_formed(name, value):
            # RFC 9113 8.2.1: uppercase names, CR, LF, NUL, surrounding whitespace: malformed.
            raise MessageRefused(400, "bad_request", "a header field HTTP/2 forbids")
        if name in CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            # RFC 9113 8.2.2: connection-specific fields make the request malformed.
            raise MessageRefused(400, "bad_request", "a connection-specific header field")
        if name in _REPLACED:
            continue
        if name == b"cookie":
            cookies.append(value)  # RFC 9113 8.2.3: one field again, "; "-joined
            continue
        if name == b"content-length":
            if length is not None and value != length:
                raise MessageRefused(400, "bad_request", "conflicting content-length")
            if length is not None:
                continue
            length = value
        lines.append(b"%s: %s\r\n" % (name, value))
    if cookies:
        lines.append(b"cookie: %s\r\n" % b"; ".join(cookies))
    if length is None and not request.ended:
        lines.append(b"transfer-encoding: chunked\r\n")
    # An HTTP/2 client always takes trailers (RFC 9113 8.1): the exchange relays them.
    lines.append(b"te: trailers\r\n")
    lines.append(b"connection: close\r\n\r\n")
    return b"".join(lines)


def response_fields(head: http1.ResponseHead) -> list[tuple[bytes, bytes]]:
    """An HTTP/1.1 response head's fields for an HTTP/2 response: lowercase names, no
    connection-specific fields (nor any field a Connection value names)."""
    fields = head.headers
    connection = [value for name, value in fields if name == b"connection"]
    if all(value.lower() == b"close" for value in connection):
        # The common case (our exchange ends each stream's exchange with "connection: close"):
        # the only field a Connection value nominates is "close" (RFC 9110 7.6.1).
        drop = _CLOSE_DROP if connection else _RESPONSE_DROP
        return [(name, value) for name, value in fields if name not in drop]
    return [
        (name, value)
        for name, value in http1.strip_hop_by_hop(fields, keep_underscores=True)
        if name not in _RESPONSE_DROP
    ]


def decided_fields(
    start: bytes, content_length: int | None, *, closes: bool
) -> list[tuple[bytes, bytes]]:
    """The HTTP/2 fields of a response the exchange decided: `start` is its status line and
    field lines (`ResponsePlan.start`: scrubbed, without framing or connection fields), which
    `ResponsePlan.head` would render followed by the length and, when `closes`, "connection:
    close". The same fields, in the same order, as `response_fields` reads from that head."""
    drop = _CLOSE_DROP if closes else _RESPONSE_DROP
    fields = [(name, value) for name, value in split_fields(start) if name not in drop]
    if content_length is not None:
        fields.append((b"content-length", b"%d" % content_length))
    return fields
