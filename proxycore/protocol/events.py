"""Typed decision events: what the data plane tells the journal (types only, no I/O).

Every decision the data plane takes (allowed, denied, refused, credential injected, tunnel opened
and closed, allowlist changed) is a frozen msgspec Struct, tagged with its kind. The sinks that
carry them off the request path are in `proxycore.io.sinks`. No event carries a credential
value: `CredentialInjected` names the provider only, and every batch passes through the scrubber
before it is written, for what an event quotes from elsewhere (an upstream's words, say).
"""

from __future__ import annotations

import time

import msgspec


class Event(msgspec.Struct, frozen=True, tag_field="event", kw_only=True, omit_defaults=True):
    ts: float = msgspec.field(default_factory=time.time)
    crew: str


class WebSocketSession(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a WebSocket session relayed (proxycore/protocol/wsrelay.py), in its request's
    terminal event; the payload bytes are the event's `bytes_up` and `bytes_down`."""

    frames_up: int = 0  # agent -> upstream, control frames included
    frames_down: int = 0
    messages_up: int = 0
    messages_down: int = 0
    # Whose Close (or failure) began the end: "agent", "upstream" or "proxy"; and its code.
    closed_by: str = ""
    close_code: int = 0


class RequestAllowed(Event, frozen=True, tag="request_allowed"):
    """The policy allowed the request and an answer was relayed: the request's terminal event,
    emitted when the exchange ends (for a tunnel: once it is established)."""

    mode: str
    route: str  # "forward" | "reverse" | "tunnel" | "local" | "keeper"
    method: str
    host: str
    port: int
    address: str
    rule: str
    status: int = 0  # the upstream's status (200 for an established tunnel)
    bytes_up: int = 0  # request body bytes sent upstream
    bytes_down: int = 0  # response body bytes relayed to the agent (after scrubbing)
    duration: float = 0.0
    complete: bool = True  # False: the response was cut short (see `ended`)
    # "complete", or why it was cut: "agent_closed", "upstream_closed", "upstream_timeout",
    # "upstream_protocol_error: ...", "crew_removed", "shutdown", ...
    ended: str = "complete"
    # Secrets the scrubber redacted from the answer (head and body); left off the wire when 0.
    redactions: int = 0
    # A request that switched to WebSocket (status 101): the session, emitted when it ends;
    # `ended` "complete" is a clean close handshake.
    websocket: WebSocketSession | None = None


class RequestDenied(Event, frozen=True, tag="request_denied"):
    """The name policy or the SSRF guard refused the destination (403): terminal."""

    mode: str
    route: str
    method: str
    host: str
    port: int
    rule: str
    status: int


class RequestRefused(Event, frozen=True, tag="request_refused"):
    """The proxy answered with its own error: bad input (400, 408, 413, 414, 431, 501), a
    failed upstream (502, 504), or no capacity (503): terminal. `rule` names the cause."""

    mode: str
    route: str  # "" when the request was not read far enough to know; "connection" at accept
    method: str
    host: str
    port: int
    rule: str
    status: int
    message: str = ""


class RequestErrored(Event, frozen=True, tag="request_errored"):
    """A failure the proxy did not plan for (a bug, an I/O error it could not answer) ended the
    request: terminal. `status` is what the agent was told (0: nothing could be sent)."""

    route: str
    method: str
    host: str
    port: int
    cause: str
    status: int


class CredentialInjected(Event, frozen=True, tag="credential_injected"):
    provider: str
    host: str


class TunnelOpened(Event, frozen=True, tag="tunnel_opened"):
    tunnel_id: int
    host: str
    port: int
    address: str


class TunnelClosed(Event, frozen=True, tag="tunnel_closed"):
    tunnel_id: int
    host: str
    port: int
    bytes_up: int  # agent -> upstream
    bytes_down: int  # upstream -> agent
    duration: float
    reason: str


class AllowlistChanged(Event, frozen=True, tag="allowlist_changed"):
    host: str
    added: bool


class PolicyWarning(Event, frozen=True, tag="policy_warning"):
    message: str


class EventsDropped(Event, frozen=True, tag="events_dropped"):
    count: int


class KeeperCallRefused(Event, frozen=True, tag="keeper_call_refused"):
    """A keeper call the worker refused before forwarding it (proxycore/protocol/keeper.py's
    rules), so that applianced journals it as a keeper decision too."""

    action: str
    credential: str  # as the body named it (truncated), "" if none
    rule: str


class DnsRefused(Event, frozen=True, tag="dns_refused"):
    """The crew's DNS responder refused a query, or failed it (proxycore/protocol/dns_responder.py
    `DnsRefusal`): `name` and `qtype` as the crew asked (printable, truncated), `rule` why,
    `rcode` what it answered ("DROP": nothing), `count` how many queries this stands for (more
    than one for queries dropped over the crew's rate, reported once a second)."""

    name: str
    qtype: str
    rule: str
    rcode: str
    count: int = 1


AnyEvent = (
    RequestAllowed
    | RequestDenied
    | RequestRefused
    | RequestErrored
    | CredentialInjected
    | TunnelOpened
    | TunnelClosed
    | AllowlistChanged
    | PolicyWarning
    | EventsDropped
    | KeeperCallRefused
    | DnsRefused
)


def decode_events(data: bytes) -> list[AnyEvent]:
    """Parse a JSON-lines event log back into typed events (tests, tools)."""
    decoder = msgspec.json.Decoder(AnyEvent)
    return [decoder.decode(line) for line in data.splitlines() if line.strip()]
