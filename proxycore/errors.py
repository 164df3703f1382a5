"""The proxy core's exceptions.

`ProxyError` is the base of every exception the data plane raises on purpose and is never raised
directly. Wire errors carry the HTTP status they map to (`status_hint`, after h11's
`error_status_hint`) so the connection adapter can answer the agent with a readable refusal
instead of a silent close.
"""

from __future__ import annotations

from collections.abc import Sequence


class ProxyError(Exception):
    """Base of the proxy core's exceptions; never raised directly."""

    status_hint: int = 500

    def __init__(self, message: str, *, status_hint: int | None = None) -> None:
        super().__init__(message)
        if status_hint is not None:
            self.status_hint = status_hint


class HttpProtocolError(ProxyError):
    """The peer sent bytes that are not a message we are willing to read.

    Raised by the sans-IO parser; anything ambiguous (duplicate framing headers, obs-fold,
    bare LF) lands here too, because a second reading of the same bytes is how smuggling works.
    """

    status_hint = 400


class ConfigError(ProxyError):
    """The configuration is invalid; the message names the offending key."""


class PolicyDenied(ProxyError):
    """The network policy or the SSRF guard refused a destination.

    `rule` is a stable, machine-readable name of the rule that refused (shown to the agent).
    """

    status_hint = 403

    def __init__(self, message: str, *, host: str, rule: str) -> None:
        super().__init__(message)
        self.host = host
        self.rule = rule


class UpstreamError(ProxyError):
    """The upstream could not be reached or broke the protocol."""

    status_hint = 502


class Http2ConnectionError(ProxyError):
    """The HTTP/2 connection must end: the peer broke the protocol or a limit of the connection
    (proxycore/protocol/http2). A GOAWAY carrying `error_code` (RFC 9113 7) is queued for the
    peer already; `rule` names the cause for the journal."""

    status_hint = 400

    def __init__(self, message: str, *, error_code: int, rule: str) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.rule = rule
        # The events of the same input before the failure (their requests need an ending).
        self.events: Sequence[object] = ()
