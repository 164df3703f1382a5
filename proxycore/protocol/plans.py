"""What the exchange decides: a request's identity, the plans, and each request's terminal event.

These are the commands of the data plane (proxycore/protocol/exchange.py returns them, the
connection adapter in proxycore/io/ carries them out). `Request` is a request's identity in its
terminal event: it builds the denied, refused and errored ones; the allowed one, which carries
what the exchange measured (status, bytes, duration), is built by the connection at its end
(proxycore/io/connection.py `emit_allowed`).
"""

from __future__ import annotations

import msgspec

from proxycore.protocol.credentials import Provider
from proxycore.protocol.events import RequestDenied, RequestErrored, RequestRefused
from proxycore.protocol.keeper import Action
from proxycore.protocol.refusals import Refusal, refusal

__all__ = [
    "Forward",
    "OpenTunnel",
    "OpenWebSocket",
    "Plan",
    "Refuse",
    "Request",
    "ServeKeeper",
    "ServeLocal",
    "TerminateTunnel",
]


class Request(msgspec.Struct, frozen=True):
    """Who asked for what: enough to write the request's one terminal event.

    `route` is "forward", "reverse", "tunnel", "local", "keeper", or "" while the request is not
    read far enough to know ("connection" for a connection refused before any byte is read).
    """

    crew: str
    mode: str
    route: str = ""
    method: str = ""
    host: str = ""
    port: int = 0

    def denied(
        self,
        rule: str,
        message: str,
        *,
        close: bool,
        approval: tuple[str, int, str | None] | None = None,
    ) -> Refuse:
        """The name policy or the SSRF guard said no: 403. `approval`: (state, seconds left,
        the operator's command) of a run-time approval (exchange.py)."""
        state, expires_in, command = approval if approval is not None else (None, None, None)
        body = Refusal(
            error="egress_denied",
            message=message,
            host=self.host,
            rule=rule,
            mode=self.mode,
            crew=self.crew,
            approval=state,
            approval_expires_in=expires_in,
            approval_command=command,
        )
        event = RequestDenied(
            crew=self.crew,
            mode=self.mode,
            route=self.route,
            method=self.method,
            host=self.host,
            port=self.port,
            rule=rule,
            status=403,
        )
        return Refuse(403, body, close, event)

    def refused(
        self, status: int, error: str, message: str, *, rule: str | None = None, close: bool
    ) -> Refuse:
        """The proxy answers with its own error (bad input, limits, a failed upstream)."""
        body = Refusal(
            error=error,
            message=message,
            host=self.host or None,
            rule=rule,
            mode=self.mode if rule is not None else None,
            crew=self.crew,
        )
        event = RequestRefused(
            crew=self.crew,
            mode=self.mode,
            route=self.route,
            method=self.method,
            host=self.host,
            port=self.port,
            rule=rule or error,
            status=status,
            message=message[:300],
        )
        return Refuse(status, body, close, event)

    def errored(self, cause: str, status: int) -> RequestErrored:
        return RequestErrored(
            crew=self.crew,
            route=self.route,
            method=self.method,
            host=self.host,
            port=self.port,
            cause=cause[:300],
            status=status,
        )

    def with_target(self, route: str, host: str, port: int) -> Request:
        return Request(self.crew, self.mode, route, self.method, host, port)


# -- plans ------------------------------------------------------------------------------------


class Refuse(msgspec.Struct, frozen=True):
    """Answer `status` with `body` (JSON), record `event`; `close` ends the connection after."""

    status: int
    body: Refusal
    close: bool
    event: RequestDenied | RequestRefused

    def response(self) -> bytes:
        return refusal(self.status, self.body, close=self.close)


class ServeLocal(msgspec.Struct, frozen=True):
    request: Request
    response: bytes
    keep_alive: bool


class ServeKeeper(msgspec.Struct, frozen=True):
    request: Request
    action: Action
    keep_alive: bool


class OpenTunnel(msgspec.Struct, frozen=True):
    request: Request
    host: str
    port: int


class TerminateTunnel(msgspec.Struct, frozen=True):
    """CONNECT to a host the crew holds a leaf for: answer 200, be `host` to the agent with that
    leaf (TLS server side), and plan every request read inside as a forward request to
    (host, port) over verified TLS (`plan_request(..., tunnel=(host, port))`)."""

    request: Request
    host: str
    port: int


class Forward(msgspec.Struct, frozen=True):
    """Send the request to (host, port); `head` is the upstream request head up to and
    excluding the framing field and the blank line (see `upstream_head`)."""

    request: Request
    host: str
    port: int
    tls: bool
    head: bytes
    # The provider whose credential was injected into `head`, if any.
    provider: Provider | None
    keep_alive: bool
    expect_continue: bool
    # POST, PUT and PATCH without a body are sent with "content-length: 0".
    empty_body_length: bool

    @property
    def rule(self) -> str:
        return "provider" if self.provider is not None else "policy"

    def upstream_head(self, length: int | None, *, chunked: bool = False) -> bytes:
        """The head with its framing: a length, chunked, or none (no body)."""
        if chunked:
            return self.head + b"\r\ntransfer-encoding: chunked\r\n\r\n"
        if length is None:
            if self.empty_body_length:
                return self.head + b"\r\ncontent-length: 0\r\n\r\n"
            return self.head + b"\r\n\r\n"
        return self.head + b"\r\ncontent-length: %d\r\n\r\n" % length


class OpenWebSocket(msgspec.Struct, frozen=True):
    """Send the WebSocket handshake in `forward.head` (RFC 6455 4.1) and, on a 101 that passes
    the client's checks for `key`, relay frames both ways (proxycore/protocol/websocket.py)."""

    forward: Forward
    # Sec-WebSocket-Key as the agent sent it, and the subprotocols it offered.
    key: bytes
    protocols: tuple[bytes, ...]

    @property
    def request(self) -> Request:
        return self.forward.request


Plan = Refuse | ServeLocal | ServeKeeper | OpenTunnel | TerminateTunnel | Forward | OpenWebSocket
