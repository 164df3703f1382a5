"""The WebSocket opening handshake (RFC 6455 4) through the proxy, decided without I/O.

Theory of operation
-------------------
An agent's `GET` carrying `Connection: Upgrade` and `Upgrade: websocket` (RFC 6455 4.1) goes
through the same exchange as any request (proxycore/protocol/exchange.py: route, journal, name
policy, credential injection on a provider host); `plan_websocket` then checks the agent's
offer and turns the `Forward` the exchange built into an `OpenWebSocket` plan whose upstream
head carries the upgrade. The adapter (proxycore/io/websocket.py) dials, sends it, and reads the
answer:

    101        `check_switch` holds it to RFC 6455 4.1 (the client's checks 1 to 6: Upgrade,
               Connection, Sec-WebSocket-Accept for the agent's key, no extension, a subprotocol
               among those offered); a failure is a 502 to the agent, nothing switched. Then
               `switching_head` is the 101 the agent sees (scrubbed, no extension) and the frame
               relay (proxycore/protocol/wsrelay.py) takes over both connections.
    otherwise  an ordinary response, relayed as any other (a 401 or 404 tells the agent's
               client why its upgrade was refused).

The agent's `Sec-WebSocket-Extensions` is never forwarded: no extension (permessage-deflate,
RFC 7692, in practice) is negotiated, for the same reason the proxy asks every upstream for
`accept-encoding: identity`: a compressed message cannot be scrubbed. The agent's key travels
unchanged, so the agent's client checks the same Accept the proxy checked.

`wss://` never reaches this module: the agent's client opens a CONNECT tunnel for it, whose
bytes the proxy does not read (docs/proxy.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

import msgspec

from native.scrub import Scrubber
from proxycore.protocol import http1
from proxycore.protocol.http1.grammar import TCHARS, comma_tokens
from proxycore.protocol.plans import Forward, OpenWebSocket, Refuse
from proxycore.protocol.scrubbing import scrub_field_lines

__all__ = [
    "UPGRADE_FIELD_RE",
    "WEBSOCKET_DROP",
    "accept_for",
    "check_switch",
    "plan_websocket",
    "switching_head",
    "wants_websocket",
]

# RFC 6455 1.3: the GUID the server appends to the client's key before hashing.
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
# A head holds an Upgrade field: the cheap test the exchange runs on every GET (most have none).
UPGRADE_FIELD_RE = re.compile(rb"(?i)\r\nupgrade[ \t]*:")
# Never forwarded upstream on a handshake: no extension is negotiated (see the module docstring).
_OFFER_DROP = frozenset({b"sec-websocket-extensions"})
# Field names the upstream request of a handshake drops beyond the exchange's own set.
WEBSOCKET_DROP = _OFFER_DROP
# Not relayed from the upstream's 101 to the agent: the proxy writes the upgrade fields itself;
# a 101 has no body, so no framing field either.
_SWITCH_DROP = frozenset({b"content-length", b"sec-websocket-extensions"})


def wants_websocket(head: http1.RequestHead) -> bool:
    """The request asks to switch to WebSocket (RFC 6455 4.1 items 2, 5, 6): a GET over
    HTTP/1.1 whose Upgrade names `websocket` and whose Connection names `upgrade`. Anything
    else with an Upgrade field is an ordinary request (Upgrade is hop-by-hop: dropped)."""
    if head.method != b"GET" or head.http_version != b"1.1":
        return False
    if UPGRADE_FIELD_RE.search(head.raw) is None:
        return False
    upgrade = _tokens(head, b"upgrade")
    return b"websocket" in upgrade and b"upgrade" in _tokens(head, b"connection")


def plan_websocket(head: http1.RequestHead, forward: Forward) -> OpenWebSocket | Refuse:
    """The handshake to send for an agent's offer, or a 400 that says what is wrong with it."""
    request = forward.request

    def bad(why: str) -> Refuse:
        # The agent's client waits for a 101; anything else ends its attempt: close after.
        return request.refused(400, "bad_request", f"websocket handshake: {why}", close=True)

    if head.body_kind is not http1.BodyKind.NONE:
        return bad("a GET that asks to upgrade carries no body (RFC 6455 4.1)")
    keys = _values(head, b"sec-websocket-key")
    if len(keys) != 1:
        return bad("exactly one Sec-WebSocket-Key is required (RFC 6455 4.1 item 7)")
    key = keys[0]
    try:
        nonce = base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        nonce = b""
    if len(nonce) != 16:
        return bad("Sec-WebSocket-Key must be 16 bytes in base64 (RFC 6455 4.1 item 7)")
    versions = _values(head, b"sec-websocket-version")
    if versions != [b"13"]:
        return bad("Sec-WebSocket-Version must be 13 (RFC 6455 4.1 item 9)")
    protocols = tuple(_tokens(head, b"sec-websocket-protocol", lower=False))
    if any(not p or not set(p) <= TCHARS for p in protocols):
        return bad("Sec-WebSocket-Protocol must be a list of tokens (RFC 6455 4.1 item 10)")
    upgraded = msgspec.structs.replace(
        forward,
        head=forward.head + b"\r\nconnection: Upgrade\r\nupgrade: websocket",
        keep_alive=False,
        expect_continue=False,
        empty_body_length=False,
    )
    return OpenWebSocket(upgraded, key, protocols)


def accept_for(key: bytes) -> bytes:
    """Sec-WebSocket-Accept for a Sec-WebSocket-Key (RFC 6455 4.2.2 item 5.4)."""
    return base64.b64encode(hashlib.sha1(key + GUID, usedforsecurity=False).digest())


def check_switch(plan: OpenWebSocket, response: http1.ResponseHead) -> str | None:
    """Why a 101 from the upstream fails the client's checks of RFC 6455 4.1, or None."""
    if _tokens(response, b"upgrade") != [b"websocket"]:
        return "its 101 does not upgrade to websocket (RFC 6455 4.1 item 2)"
    if b"upgrade" not in _tokens(response, b"connection"):
        return "its 101 has no Connection: Upgrade (RFC 6455 4.1 item 3)"
    accepts = _values(response, b"sec-websocket-accept")
    if accepts != [accept_for(plan.key)]:
        return "its Sec-WebSocket-Accept does not match the key (RFC 6455 4.1 item 4)"
    if _values(response, b"sec-websocket-extensions"):
        return "it chose an extension that was not offered (RFC 6455 4.1 item 5)"
    chosen = _values(response, b"sec-websocket-protocol")
    if chosen and (len(chosen) != 1 or chosen[0] not in plan.protocols):
        return "it chose a subprotocol that was not offered (RFC 6455 4.1 item 6)"
    return None


def switching_head(response: http1.ResponseHead, scrubber: Scrubber) -> bytes:
    """The 101 the agent sees: the upstream's fields (scrubbed; Accept and the chosen
    subprotocol among them) minus hop-by-hop ones, with the proxy's own upgrade fields."""
    lines = bytearray()
    for name, value in http1.strip_hop_by_hop(response.headers, keep_underscores=True):
        if name not in _SWITCH_DROP:
            lines += b"\r\n%s: %s" % (name, value)
    fields = scrub_field_lines(scrubber, bytes(lines))
    return (
        b"HTTP/1.1 101 Switching Protocols"
        + fields
        + b"\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\r\n"
    )


def _values(head: http1.RequestHead | http1.ResponseHead, name: bytes) -> list[bytes]:
    return [value for key, value in head.headers if key == name]


def _tokens(
    head: http1.RequestHead | http1.ResponseHead, name: bytes, *, lower: bool = True
) -> list[bytes]:
    """The members of every `name` field (RFC 9110 5.6.1 lists), in order."""
    if lower:
        return [token for value in _values(head, name) for token in comma_tokens(value)]
    return [
        token
        for value in _values(head, name)
        for token in (part.strip(b" \t") for part in value.split(b","))
        if token
    ]
