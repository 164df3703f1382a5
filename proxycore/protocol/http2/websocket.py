"""RFC 8441 extended CONNECT: a WebSocket handshake on an HTTP/2 stream, as the exchange reads one.

Theory of operation
-------------------
A stream whose request is `:method CONNECT` with `:protocol websocket` (RFC 8441 4, with
`:scheme`, `:path` and `:authority`) asks for a WebSocket over that stream. The proxy serves it
exactly as it serves the HTTP/1.1 Upgrade (proxycore/protocol/websocket.py): `websocket_head`
writes the stream's request as the HTTP/1.1 handshake the exchange already plans
(`GET <target>`, `connection: Upgrade`, `upgrade: websocket`, the agent's
`sec-websocket-version`, `-protocol`, `origin` and other fields), through the same checks as
every stream's request (messages.py `request_head`: the target, field names and values), so the
name policy, the SSRF guard, credential injection and refusals apply on the handshake unchanged.

RFC 8441 5: the handshake over HTTP/2 has no Sec-WebSocket-Key and no Sec-WebSocket-Accept.
The upstream is reached with the HTTP/1.1 Upgrade (an RFC 8441 proxy translates; RFC 8441 does
not require the next hop to speak HTTP/2), which needs a key: the caller makes one (16 random
bytes) and the exchange checks the upstream's Accept against it (RFC 6455 4.1), as it checks
the agent's key on HTTP/1.1. A key or Accept the agent sent anyway is dropped.

`connection: Upgrade, close`: the handshake is the stream's only exchange; a refusal (or an
upstream's ordinary answer) ends the stream after its response.

Any other `:protocol` is refused 501 on its stream (RFC 8441 4: a server that does not support
the protocol); `:protocol` on a method other than CONNECT, or without the setting advertised,
is a malformed request (connection.py), answered 400.
"""

from __future__ import annotations

import msgspec

from proxycore.protocol.http2.events import RequestReceived
from proxycore.protocol.http2.messages import MessageRefused, request_head

__all__ = ["WEBSOCKET_PROTOCOL", "is_extended_connect", "websocket_head"]

WEBSOCKET_PROTOCOL = b"websocket"
# RFC 8441 5: not used over HTTP/2; the proxy writes its own key for the HTTP/1.1 upstream.
_AGENT_DROP = frozenset({b"sec-websocket-key", b"sec-websocket-accept"})
_CLOSE = b"connection: close\r\n\r\n"
_UPGRADE = b"connection: Upgrade, close\r\nupgrade: websocket\r\n\r\n"


def is_extended_connect(request: RequestReceived) -> bool:
    """The stream asks for a tunnelled protocol (RFC 8441 4): CONNECT with `:protocol`."""
    return request.method == b"CONNECT" and bool(request.protocol)


def websocket_head(
    request: RequestReceived, gateway: str, key: bytes, *, origin_form: bool = False
) -> bytes:
    """The stream's extended CONNECT as the HTTP/1.1 WebSocket handshake (see the module
    docstring); `key` is the Sec-WebSocket-Key to send upstream (base64 of 16 bytes).
    Raises MessageRefused (400, 501) with the status the stream is answered. `origin_form`: as
    `request_head`'s (inside a terminated tunnel)."""
    if request.malformed:
        raise MessageRefused(400, "bad_request", f"malformed HTTP/2 request: {request.malformed}")
    if request.protocol.lower() != WEBSOCKET_PROTOCOL:
        shown = request.protocol[:40].decode("ascii", "replace")
        raise MessageRefused(
            501,
            "not_implemented",
            f"extended CONNECT (RFC 8441) for protocol {shown!r} is not served by this proxy; "
            "only websocket is",
        )
    headers = tuple((n, v) for n, v in request.headers if n not in _AGENT_DROP)
    as_get = msgspec.structs.replace(
        request,
        method=b"GET",
        protocol=b"",
        ended=True,  # a handshake has no body; a content-length the agent sent stays (400)
        headers=(*headers, (b"sec-websocket-key", key)),
    )
    head = request_head(as_get, gateway, origin_form=origin_form)
    if not head.endswith(_CLOSE):  # request_head ends every head so: never, but never guessed
        raise MessageRefused(500, "internal_error", "the handshake could not be written")
    return head[: -len(_CLOSE)] + _UPGRADE
