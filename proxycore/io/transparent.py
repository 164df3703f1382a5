"""Transparent capture: a crew's connection the kernel redirected to the proxy.

A tool that ignores HTTP_PROXY (git over some transports, a package manager, `openssl s_client`,
a compiled binary) connects straight to some address on port 80 or 443. The crew's nftables
rules redirect that connection to the proxy's port on the crew's gateway (a DNAT, so the proxy
still knows the crew by the gateway the connection arrives on), and the kernel keeps where it
was going: `SO_ORIGINAL_DST` (netfilter's conntrack, linux/netfilter_ipv4.h) on the accepted
socket. `original_destination` reads it at accept; a connection whose original destination is
the proxy itself was not redirected and is served as always.

What the connection is for is read from its first bytes, never from the address alone:
- **TLS** (a handshake record first): its ClientHello's server name
  (proxycore/protocol/clienthello.py) stands for the CONNECT the tool did not send. The
  connection is planned exactly as `CONNECT name:port` (the original port): the name policy,
  the method and path rules, placeholders; an opaque tunnel that relays the very bytes read, or,
  where the crew holds a leaf for the name, termination. No "200 Connection Established" is
  written: the tool never asked for a tunnel. A refusal cannot be an HTTP response to a TLS
  client; it is a TLS alert (access_denied, RFC 8446 6.2) and the journal entry says why.
- **Anything else** is read as HTTP/1.1: its first request's Host names the connection's host,
  every request on it must name the same (as inside a terminated tunnel: a second authority is
  domain fronting), and they are forwarded over plain HTTP to that host and the original port.
  Refusals are ordinary HTTP responses. HTTP/2 with prior knowledge is refused (cleartext
  HTTP/2 is for the explicit proxy only).

The host and the destination must agree: the original address has to be one the proxy itself
resolves the name to (in its crew's policy and the SSRF guard). A connection to one address
that names another host (an allowed name in the SNI or Host, toward an address the crew looked
up elsewhere or made up) is refused with `destination_mismatch`. The name is checked against the
policy first, so a refused name is never resolved (no lookup leaks it). The boundary itself is
that the proxy dials the *name* (resolved again, checked again), never the captured address:
nothing reaches an address the name does not stand for, whatever the crew aimed at. A name whose
answers rotate between lookups (some CDNs) can fail the agreement check for a tool that got
another of its addresses; the crew's own DNS (docs/proxy.md "DNS") asks the same resolver.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxycore.errors import PolicyDenied, UpstreamError
from proxycore.io.http2 import PrefaceReceived
from proxycore.io.progress import Phase, Refused, upstream_refusal
from proxycore.protocol import http1
from proxycore.protocol.clienthello import ClientHello, Malformed, NeedMore, read_client_hello
from proxycore.protocol.plans import Refuse, Request
from proxycore.protocol.policy import parse_authority

if TYPE_CHECKING:
    from proxycore.io.connection import ClientConnection

__all__ = [
    "RULE_DESTINATION_MISMATCH",
    "RULE_NOT_READABLE",
    "Transparent",
    "first_head",
    "original_destination",
    "refusal_for_tls",
    "tls_alert",
]

# linux/netfilter_ipv4.h; the socket module does not name it.
SO_ORIGINAL_DST = 80

RULE_DESTINATION_MISMATCH = "destination_mismatch"
# A captured connection whose first bytes name no host the proxy can judge (a TLS hello without
# a server name, with Encrypted Client Hello, malformed; HTTP without Host; cleartext HTTP/2).
RULE_NOT_READABLE = "captured_unreadable"

# RFC 8446 6 (and 5246 7.2): a fatal alert, in a plaintext record, before any ServerHello.
_ALERT_ACCESS_DENIED = 49
_ALERT_DECODE_ERROR = 50


@dataclass(slots=True)
class Transparent:
    """A captured connection: where it was going, and whether it speaks TLS (decided by its
    first bytes; until then and for HTTP, False)."""

    address: str
    port: int
    tls: bool = False


def original_destination(sock: socket.socket, local: str, local_port: int) -> Transparent | None:
    """Where a redirected connection was going; None for one that was not redirected (its
    original destination is the proxy's own address, or conntrack knows nothing of it)."""
    if sock.family != socket.AF_INET:
        return None  # crews are IPv4 (netns/addressing.py); IPv6 capture is not configured
    try:
        raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    except OSError:
        return None  # no conntrack entry, or no NAT in this network namespace
    port = struct.unpack_from(">H", raw, 2)[0]
    address = socket.inet_ntoa(raw[4:8])
    if address == local and port == local_port:
        return None
    return Transparent(address, port)


def tls_alert(description: int = _ALERT_ACCESS_DENIED) -> bytes:
    return bytes((21, 3, 3, 0, 2, 2, description))


async def first_head(conn: ClientConnection) -> http1.RequestHead | None:
    """The first request of a captured connection: the CONNECT its ClientHello stands for, or
    its first HTTP/1.1 request (with `conn.tunnel` set to its Host and the original port).
    Raises Refused; None if the agent closed before saying anything."""
    captured = conn.transparent
    assert captured is not None
    limits = conn.limits
    buffer = conn.buffer
    started = time.monotonic()
    deadline = started + limits.head_timeout
    at_least = 1
    while True:
        if len(buffer) >= at_least:
            reading = read_client_hello(buffer)
            if not isinstance(reading, NeedMore):
                break
            at_least = reading.at_least
        data = await conn._receive(conn.stream, Phase.HEAD, deadline)
        if not data:
            return None
        buffer += data
    conn.head_started = started
    if isinstance(reading, ClientHello | Malformed):
        captured.tls = True
        return await _tls_head(conn, captured, reading)
    return await _http_head(conn, captured)


async def _tls_head(
    conn: ClientConnection, captured: Transparent, hello: ClientHello | Malformed
) -> http1.RequestHead:
    crew = conn.crew
    request = Request(crew.name, crew.mode, "tunnel", "CONNECT", "", captured.port)
    unreadable: str | None = None
    if isinstance(hello, Malformed):
        unreadable = f"its TLS ClientHello is not one the proxy relays: {hello.reason}"
    elif hello.ech:
        unreadable = (
            "it offers Encrypted Client Hello, which hides the host it is for: no policy can "
            "be applied to it"
        )
    elif hello.server_name is None:
        unreadable = "its TLS ClientHello names no server (no SNI): no policy can be applied"
    if unreadable is not None:
        raise Refused(
            request.denied(
                RULE_NOT_READABLE,
                f"a connection to {captured.address}:{captured.port} captured from crew "
                f"{crew.name} is refused: {unreadable}",
                close=True,
            )
        )
    assert isinstance(hello, ClientHello) and hello.server_name is not None
    authority = f"{hello.server_name}:{captured.port}"
    raw = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode("ascii")
    # Read by the same parser as a CONNECT an agent sends: the same checks, the same refusals.
    parsed = http1.parse_request_head(raw, conn.runtime.http_limits)
    assert parsed is not None
    head, _ = parsed
    conn.requests += 1
    await _check_agreement(conn, captured, hello.server_name, request)
    return head


async def _http_head(conn: ClientConnection, captured: Transparent) -> http1.RequestHead | None:
    crew = conn.crew
    request = Request(crew.name, crew.mode, "forward", "", "", captured.port)
    try:
        head = await conn.read_head()
    except PrefaceReceived:
        raise Refused(
            request.denied(
                RULE_NOT_READABLE,
                "HTTP/2 with prior knowledge is not served on a captured connection; use TLS "
                "(h2 is offered by ALPN) or the proxy (HTTP_PROXY)",
                close=True,
            )
        ) from None
    if head is None:
        return None
    request = Request(
        crew.name, crew.mode, "forward", head.method.decode("ascii", "replace"), "", captured.port
    )
    named = head.get(b"host")
    if named is None:
        raise Refused(
            request.refused(
                400,
                "bad_request",
                "a request captured on its way to "
                f"{captured.address}:{captured.port} names no Host: the proxy cannot tell which "
                "host it is for",
                rule=RULE_NOT_READABLE,
                close=True,
            )
        )
    try:
        host, _ = parse_authority(named, captured.port)
    except PolicyDenied as exc:
        raise Refused(
            request.refused(400, "bad_request", f"bad Host field: {exc}", close=True)
        ) from None
    await _check_agreement(conn, captured, host, request)
    # Every request on this connection is planned against this host and the original port, as
    # inside a terminated tunnel, but forwarded in the clear.
    conn.tunnel = (host, captured.port)
    return head


async def _check_agreement(
    conn: ClientConnection, captured: Transparent, host: str, request: Request
) -> None:
    """Refuse a host the original address is not one of (see the module docstring). A host the
    name policy refuses is not resolved here: its plan refuses it, readably."""
    crew = conn.crew
    if not crew.policy.decide(host, captured.port).allowed:
        return
    request = request.with_target(request.route, host, captured.port)
    try:
        addresses = await conn.runtime.dialer.resolve(host, captured.port, crew.lookups, crew.guard)
    except PolicyDenied as exc:
        raise Refused(request.denied(exc.rule, str(exc), close=True)) from None
    except UpstreamError as exc:
        raise Refused(upstream_refusal(request, exc, close=True)) from None
    if captured.address not in addresses:
        raise Refused(
            request.denied(
                RULE_DESTINATION_MISMATCH,
                f"this connection was on its way to {captured.address}, which is not an "
                f"address of {host} (it resolves to {', '.join(addresses[:4])}): a host "
                "named to one address and sent to another is refused",
                close=True,
            )
        )


def refusal_for_tls(plan: Refuse) -> bytes:
    """What a TLS client reads of a refusal: an alert (the journal has the reason)."""
    rule = plan.event.rule
    return tls_alert(_ALERT_DECODE_ERROR if rule == "bad_request" else _ALERT_ACCESS_DENIED)
