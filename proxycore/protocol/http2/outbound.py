"""HTTP/2 messages to and from an upstream, in the exchange's HTTP/1.1 form (RFC 9113 8.3).

Theory of operation: the forward path (proxycore/io/forward.py) writes every upstream request
as HTTP/1.1 and reads every response as HTTP/1.1, whatever the upstream speaks; an HTTP/2
upstream stream (proxycore/io/upstream_h2.py) translates at that seam, as the agent side's
`StreamPipe` does in the other direction. So the request the upstream receives is exactly the
head the exchange built (policy, credentials, header scrubbing all done), and the response the
exchange reads goes through the strict HTTP/1.1 parser and the response plan like any other.

`request_fields`: the exchange's head (parsed back by the strict parser) as HTTP/2 fields:
Host becomes :authority, the target :path (origin-form, or "*"), the scheme that of the
connection; connection-specific fields are dropped (RFC 9113 8.2.2) and `te: trailers` is sent
(the proxy reads trailers and relays them where the agent can take them).

`response_head`: an upstream's final response head as an HTTP/1.1 head with its framing: the
upstream's Content-Length when it sent one, none when the head ended the stream (or the response
has no body by its status or the request's method), else chunked, so that trailers can follow as
a chunked trailer section. A field HTTP/1.1 could not carry (client.py checks the pseudo-headers
and connection-specific fields; the grammar is checked here) makes the response malformed
(`None`): the stream is reset and the exchange answers 502.
"""

from __future__ import annotations

from http import HTTPStatus

from proxycore.protocol import http1
from proxycore.protocol.http2.events import ResponseReceived
from proxycore.protocol.http2.fields import well_formed

__all__ = ["request_fields", "response_head"]

_REQUEST_DROP = http1.HOP_BY_HOP | {b"host", b"http2-settings", b"expect"}
_RESPONSE_DROP = http1.HOP_BY_HOP | {b"content-length"}
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


def request_fields(head: http1.RequestHead, *, tls: bool) -> list[tuple[bytes, bytes]]:
    """The request head as HTTP/2 fields, pseudo-headers first (see the module docstring)."""
    authority: bytes | None = None
    rest: list[tuple[bytes, bytes]] = []
    for name, value in head.headers:  # one pass: the first Host is the :authority
        if name not in _REQUEST_DROP:
            rest.append((name, value))
        elif name == b"host" and authority is None:
            authority = value
    fields = [
        (b":method", head.method),
        (b":scheme", b"https" if tls else b"http"),
        (b":authority", authority or b""),
        (b":path", head.target),
    ]
    fields += rest
    fields.append((b"te", b"trailers"))
    return fields


def response_head(event: ResponseReceived, method: bytes) -> tuple[bytes, bool] | None:
    """The HTTP/1.1 head for `event`, and whether its body is written chunked; None when a
    field cannot be written as HTTP/1.1 (the response is malformed)."""
    status = event.status
    if not 200 <= status <= 999:
        return None
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
    length: bytes | None = None
    for name, value in event.headers:
        if not well_formed(name, value):
            return None
        if name == b"content-length":
            if length is not None and value != length:
                return None
            length = value
            continue
        if name in _RESPONSE_DROP:
            continue
        lines.append(b"%s: %s\r\n" % (name, value))
    bodiless = method == b"HEAD" or status in (204, 304)
    chunked = False
    if length is not None:
        if not length.isdigit():
            return None
        lines.append(b"content-length: %s\r\n" % length)
    elif event.ended:
        if not bodiless:
            lines.append(b"content-length: 0\r\n")
    elif not bodiless:
        chunked = True
        lines.append(b"transfer-encoding: chunked\r\n")
    lines.append(b"\r\n")
    return b"".join(lines), chunked
