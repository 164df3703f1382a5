"""The trio adapter: one task per agent connection owns all I/O, deadlines and cancellation.

Theory of operation: the protocol work (heads, framing, policy, SSRF classification, injection)
is done by sans-IO modules; this module moves bytes between them and the sockets. One listening
port serves every mode, and the request form decides which:

| request form                         | mode                                     |
|--------------------------------------|------------------------------------------|
| `CONNECT host:port`                  | opaque tunnel (`tunnel.relay`)            |
| `GET http://host/...` (absolute)     | forward proxy                             |
| `POST /anthropic/v1/...` (origin)    | reverse proxy to the provider's base URL  |
| `GET /_appliance/health` (origin)    | the sidecar's local API                   |

The crew a connection belongs to is the local address it arrived on (its gateway), which nothing
inside the crew's network namespace can forge. Every request passes, in order: the name policy
(mode + exact allowlist), resolution and the SSRF guard (in every mode), then credential injection
only for an exact provider-host match over verified TLS. Every decision is emitted as an event.

Errors: a refusal is written as a readable JSON response whenever no response byte has been sent
yet; after that the connection can only be closed. Every read runs under a deadline.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import math
import re
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import msgspec
import trio

from native.scrub_patterns import PatternError
from proxycore import control
from proxycore.config import DEFAULT_BASE_URLS, CrewConfig, ProxyConfig, crew_policy, validate
from proxycore.errors import HttpProtocolError, PolicyDenied, ProxyError, UpstreamError
from proxycore.io import tunnel
from proxycore.io.control_server import serve_control_channel, serve_control_socket
from proxycore.io.fastio import ByteStream, PlainStream
from proxycore.io.keeper_client import KeeperUnavailable, forward_to_keeper
from proxycore.io.sinks import BatchingSink, EventSink
from proxycore.io.upstream import Dialer, UpstreamConnection, make_tls_context
from proxycore.protocol import http1
from proxycore.protocol.credentials import (
    Credential,
    Provider,
    ProviderRoute,
    load_credential,
    rewrite_for_provider,
    route_for,
)
from proxycore.protocol.events import (
    AllowlistChanged,
    CredentialInjected,
    KeeperCallRefused,
    PolicyWarning,
    RequestAllowed,
    RequestDenied,
    TunnelClosed,
    TunnelOpened,
)
from proxycore.protocol.keeper import Action, KeeperRefused, check_intent, parse_command
from proxycore.protocol.policy import (
    Allowlist,
    EgressDecision,
    NetworkMode,
    decide_egress,
    normalize_host,
    parse_authority,
    parse_mode,
)
from proxycore.protocol.refusals import Refusal, json_response, local_json, refusal
from proxycore.protocol.scrubbing import (
    IDENTITY,
    ScrubberHolder,
    configured_shapes,
    scrub_field_lines,
    scrub_json_lines,
    unscrubbable_encoding,
)
from proxycore.protocol.ssrf import AddressGuard

log = logging.getLogger("proxycore")

RECV_SIZE = 65536
# Request bodies up to this size are read whole before dialing, so a failed reused upstream
# connection can be retried on a fresh one; larger bodies stream through a fresh connection.
REPLAYABLE_BODY = 64 * 1024
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LINGER_SECONDS = 1.0
MEMO_SIZE = 4096
REAP_INTERVAL = 0.25
LINGER_BYTES = 256 * 1024
LOCAL_PATHS = (b"/_appliance/health", b"/healthz")
# The keeper's routes of the local API (docs/keeper.md), forwarded to applianced.
KEEPER_PATHS = {b"/keeper/request": Action.REQUEST, b"/keeper/execute": Action.EXECUTE}
KEEPER_BODY_BYTES = 16 * 1024
AUDIT_UNAVAILABLE = "audit_unavailable"  # the rule named when the journal is behind
# Response bodies up to this size are read whole before relaying, so they keep a Content-Length
# after scrubbing; larger ones (and chunked, and SSE) stream through the scrubber.
WHOLE_BODY = 64 * 1024
# Store credentials rotated or revoked away that the scrubber keeps redacting (oldest dropped).
RETIRED_SECRETS = 64


@dataclass(slots=True, eq=False)
class CrewState:
    name: str
    gateway: str
    mode: NetworkMode
    allowlist: Allowlist
    connections: int = 0
    # Memo of decide_egress for this crew; a crew's mode is fixed, and the memo is cleared
    # whenever its allowlist changes, so a cached decision is always the current one.
    decisions: dict[tuple[str, int], EgressDecision] = field(default_factory=dict)

    def decide(self, host: str, port: int) -> EgressDecision:
        key = (host, port)
        decision = self.decisions.get(key)
        if decision is None:
            if len(self.decisions) >= MEMO_SIZE:
                self.decisions.clear()
            decision = self.decisions[key] = decide_egress(self.mode, self.allowlist, host, port)
        return decision

    def allow(self, host: str) -> bool:
        added = self.allowlist.add(host)
        self.decisions.clear()
        return added


class ProxyRuntime:
    """Everything a connection task needs, built once from the frozen config."""

    def __init__(self, config: ProxyConfig, sink: EventSink) -> None:
        self.config = config
        self.sink = sink
        # Set by the control plane when its journal is behind (control.AuditPaused).
        self.audit_paused = False
        # Where applianced's keeper listens and the token to present (control.KeeperChannelSet).
        self.keeper_channel: control.KeeperChannelSet | None = None
        limits = config.limits
        self.limits = limits
        self.http_limits = http1.Limits(
            max_request_line=limits.max_request_line,
            max_header_count=limits.max_header_count,
            max_header_bytes=limits.max_header_bytes,
        )
        self.routes_by_name, self.routes_by_host = load_routes(config)
        # crew name -> provider -> credential, from applianced's credential store
        # (`credentials_set`); for that crew it takes precedence over the route's own.
        self.crew_credentials: dict[str, dict[Provider, Credential]] = {}
        self.retired_secrets: dict[tuple[str, bytes], None] = {}  # ordered: oldest first
        # Everything relayed back to a crew passes through this
        # (see proxycore/protocol/scrubbing.py).
        self.scrubbers = ScrubberHolder(
            route_secrets(self.routes_by_name.values()), configured_shapes(config.scrub.shapes)
        )
        self.crews: dict[str, CrewState] = {}
        for crew in config.crew:
            self._add_crew(crew)
        self.dialer = Dialer(
            AddressGuard(config.upstream.ssrf_allow),
            config.upstream.resolve,
            make_tls_context(config.upstream.ca_file, config.upstream.ca_file_only),
            connect_timeout=limits.connect_timeout,
            pool_per_host=limits.upstream_pool_per_host,
        )
        self.connections = 0
        self.tunnel_ids = 0
        self._authorities: dict[bytes, tuple[str, int]] = {}
        self._host_fields: dict[tuple[str, int, bool], bytes] = {}
        self.live: set[ClientConnection] = set()

    async def reap_expired(self) -> None:
        """Cancel connections whose phase deadline has passed, every `REAP_INTERVAL` seconds.

        Each connection keeps its deadline as a plain float (`time.monotonic()`, a C call, where
        `trio.current_time()` is three Python frames) that it sets before a wait; moving a trio
        deadline instead costs a heap operation per wait, several per request. Timeouts are
        seconds long, so enforcing them within `REAP_INTERVAL` is precise enough.
        """
        while True:
            await trio.sleep(REAP_INTERVAL)
            now = time.monotonic()
            for connection in list(self.live):
                if connection.deadline <= now:
                    connection.scope.cancel()

    def parse_authority(self, authority: bytes) -> tuple[str, int]:
        """`policy.parse_authority` for forward requests, memoized (it is pure)."""
        parsed = self._authorities.get(authority)
        if parsed is None:
            parsed = parse_authority(authority, 80)
            if len(self._authorities) >= MEMO_SIZE:
                self._authorities.clear()
            self._authorities[authority] = parsed
        return parsed

    def host_field(self, host: str, port: int, tls: bool) -> bytes:
        """The Host field value for an upstream request (memoized: it is pure)."""
        key = (host, port, tls)
        value = self._host_fields.get(key)
        if value is None:
            authority = f"[{host}]" if ":" in host else host
            if port != (443 if tls else 80):
                authority = f"{authority}:{port}"
            value = authority.encode("ascii")
            if len(self._host_fields) >= MEMO_SIZE:
                self._host_fields.clear()
            self._host_fields[key] = value
        return value

    def _add_crew(self, crew: CrewConfig) -> CrewState:
        mode, allowlist = crew_policy(crew)
        # The configured provider hosts are part of every crew's allowlist: the operator
        # named them, and the reverse routes lead nowhere else.
        for route in self.routes_by_name.values():
            allowlist.add(route.host)
        gateway = normalize_host(crew.gateway) if ":" in crew.gateway else crew.gateway
        state = self.crews[gateway] = CrewState(crew.name, gateway, mode, allowlist)
        _, warning = parse_mode(crew.mode)
        if warning:
            self.sink.emit(PolicyWarning(crew=crew.name, message=warning))
        return state

    def add_crew(self, message: control.CrewAdd) -> control.ControlReply:
        """A crew created at run time (applianced): validated as the config file's crews are."""
        crew = CrewConfig(
            name=message.name, gateway=message.gateway, mode=message.mode, allow=message.allow
        )
        try:
            validate(ProxyConfig(crew=(crew,)), source="crew_add")
        except ProxyError as exc:
            return control.ControlReply(ok=False, error=str(exc))
        if self.crew_named(crew.name) is not None:
            return control.ControlReply(ok=False, error=f"crew {crew.name!r} is already served")
        gateway = normalize_host(crew.gateway) if ":" in crew.gateway else crew.gateway
        if gateway in self.crews:
            return control.ControlReply(
                ok=False, error=f"gateway {gateway} already serves crew {self.crews[gateway].name}"
            )
        self._add_crew(crew)
        return control.ControlReply(ok=True, changed=True)

    def remove_crew(self, name: str) -> control.ControlReply:
        """Forget a crew and end its open connections. Idempotent (changed says if it was
        served)."""
        crew = self.crew_named(name)
        if crew is None:
            return control.ControlReply(ok=True, changed=False)
        del self.crews[crew.gateway]
        for connection in list(self.live):
            if connection.crew is crew:
                connection.scope.cancel()
        return control.ControlReply(ok=True, changed=True)

    def crew_for(self, local_address: str) -> CrewState | None:
        return self.crews.get(local_address)

    def crew_named(self, name: str) -> CrewState | None:
        return next((c for c in self.crews.values() if c.name == name), None)

    def reload_credentials(self) -> bool:
        """Read every provider credential again (a rotation, a new key) and swap the routes and
        the scrubber together; on any error nothing changes. True if a credential changed."""
        routes_by_name, routes_by_host = load_routes(self.config)
        secrets = route_secrets(routes_by_name.values())
        changed = secrets != route_secrets(self.routes_by_name.values())
        self.scrubbers.replace(
            secrets + crew_secrets(self.crew_credentials) + list(self.retired_secrets)
        )
        self.routes_by_name, self.routes_by_host = routes_by_name, routes_by_host
        return changed

    def set_crew_credentials(self, message: control.CredentialsSet) -> control.ControlReply:
        """Replace every crew's store credentials and recompile the scrubber with every value
        the proxy now holds, all or nothing: the new scrubber is compiled before anything is
        swapped, and the swap is two assignments with no await between them, so no request
        sees a key the scrubber does not know. Errors name the crew and provider, never a
        value. A value dropped from the map is no longer injected nor scrubbed: a response
        already streaming finishes on the scrubber it started with."""
        crews: dict[str, dict[Provider, Credential]] = {}
        for crew, by_provider in message.crews.items():
            for name, value in by_provider.items():
                try:
                    provider = Provider(name)
                except ValueError:
                    return control.ControlReply(
                        ok=False, error=f"credentials_set: crew {crew!r}: no provider {name!r}"
                    )
                try:
                    crews.setdefault(crew, {})[provider] = Credential(value)
                except ValueError as exc:
                    return control.ControlReply(
                        ok=False, error=f"credentials_set: crew {crew!r}, {name}: {exc}"
                    )
        new_secrets = crew_secrets(crews)
        old_secrets = crew_secrets(self.crew_credentials)
        changed = new_secrets != old_secrets
        # Values rotated or revoked away stay in the scrubber (not in the routes) for as long
        # as this proxy runs, up to RETIRED_SECRETS: an agent that once saw one reflected in a
        # response it was not scrubbed from is unlikely, but a rotated key may still be live.
        retired = dict(self.retired_secrets)
        for pair in old_secrets:
            if pair not in new_secrets:
                retired.pop(pair, None)
                retired[pair] = None
        while len(retired) > RETIRED_SECRETS:
            del retired[next(iter(retired))]
        try:
            self.scrubbers.replace(
                route_secrets(self.routes_by_name.values()) + new_secrets + list(retired)
            )
        except (ValueError, PatternError):
            # Not the exception's text: a pattern error may quote the secret it was built from.
            return control.ControlReply(
                ok=False, error="credentials_set: the scrubber cannot compile the new values"
            )
        self.crew_credentials = crews
        self.retired_secrets = retired
        return control.ControlReply(ok=True, changed=changed)

    def route_for_crew(self, route: ProviderRoute, crew: str) -> ProviderRoute:
        """The route with the crew's own credential, if the store granted it one."""
        credential = self.crew_credentials.get(crew, {}).get(route.provider)
        if credential is None:
            return route
        return dataclasses.replace(route, credential=credential)

    def handle_control(self, message: control.ControlMessage) -> control.ControlReply:
        if isinstance(message, control.Ping):
            return control.ControlReply(ok=True)
        if isinstance(message, control.ReloadCredentials):
            try:
                changed = self.reload_credentials()
            except (ProxyError, ValueError) as exc:  # ConfigError names the key, never a value
                return control.ControlReply(ok=False, error=str(exc))
            return control.ControlReply(ok=True, changed=changed)
        if isinstance(message, control.CredentialsSet):
            return self.set_crew_credentials(message)
        if isinstance(message, control.CrewAdd):
            return self.add_crew(message)
        if isinstance(message, control.CrewRemove):
            return self.remove_crew(message.name)
        if isinstance(message, control.AuditPaused):
            changed = message.paused != self.audit_paused
            self.audit_paused = message.paused
            return control.ControlReply(ok=True, changed=changed)
        if isinstance(message, control.KeeperChannelSet):
            changed = message != self.keeper_channel
            self.keeper_channel = message
            return control.ControlReply(ok=True, changed=changed)
        crew = self.crew_named(message.crew)
        if crew is None:
            return control.ControlReply(ok=False, error=f"unknown crew {message.crew!r}")
        try:
            host = normalize_host(message.host)
        except PolicyDenied:
            return control.ControlReply(ok=False, error=f"not a valid host: {message.host!r}")
        added = crew.allow(host)
        if added:
            self.sink.emit(AllowlistChanged(crew=crew.name, host=host, added=True))
        return control.ControlReply(ok=True, changed=added)

    async def handle_control_async(self, message: control.ControlMessage) -> control.ControlReply:
        return self.handle_control(message)


def load_routes(config: ProxyConfig) -> tuple[dict[bytes, ProviderRoute], dict[str, ProviderRoute]]:
    by_name: dict[bytes, ProviderRoute] = {}
    by_host: dict[str, ProviderRoute] = {}
    for name, default_url in DEFAULT_BASE_URLS.items():
        provider_config = getattr(config.providers, name)
        credential = load_credential(
            name, provider_config.credential_env, provider_config.credential_file
        )
        route = route_for(provider_config.base_url or default_url, Provider(name), credential)
        by_name[name.encode()] = route
        by_host[route.host] = route
    return by_name, by_host


def route_secrets(routes: Iterable[ProviderRoute]) -> list[tuple[str, bytes]]:
    """The credential values the proxy holds, named after their provider (for the scrubber)."""
    return [
        (route.provider.value, route.credential.reveal().encode())
        for route in routes
        if route.credential is not None
    ]


def crew_secrets(crews: dict[str, dict[Provider, Credential]]) -> list[tuple[str, bytes]]:
    """The store's credentials the proxy holds, named after their provider (for the scrubber)."""
    return sorted(
        {
            (provider.value, credential.reveal().encode())
            for by_provider in crews.values()
            for provider, credential in by_provider.items()
        }
    )


class _Refused(Exception):
    """Internal: a prepared refusal to write (never escapes this module)."""

    def __init__(self, status: int, body: Refusal, *, close: bool = False) -> None:
        self.status = status
        self.body = body
        self.close = close


class Phase(enum.Enum):
    """What a connection is waiting for; decides what a deadline expiring means."""

    IDLE = "idle"  # between requests: a timeout closes silently
    HEAD = "head"  # inside a request head: 408
    BODY = "body"  # reading the agent's request body: 408
    UPSTREAM = "upstream"  # waiting for the upstream's response head: 504
    RELAY = "relay"  # relaying a response: the connection can only be closed


class ClientConnection:
    """One agent connection. Owns its socket and, for the length of an exchange, an upstream.

    One cancel scope covers the whole connection; before each wait its deadline is moved to the
    timeout of the phase about to start, so a timeout costs no extra scope per read.
    """

    def __init__(self, runtime: ProxyRuntime, stream: PlainStream, crew: CrewState) -> None:
        self.runtime = runtime
        self.stream = stream
        self.crew = crew
        self.buffer = bytearray()
        self.response_started = False
        self.limits = runtime.limits
        self.phase = Phase.IDLE
        self.scope = trio.CancelScope()
        # Enforced by the runtime's reaper (see `reap_expired`), not by moving a trio deadline.
        self.deadline = math.inf
        self.upstream: UpstreamConnection | None = None
        self.requests = 0  # request heads read on this connection

    async def _receive(
        self, stream: ByteStream, phase: Phase, deadline: float, *, answer_pending: bool = False
    ) -> bytes:
        """Receive for `phase`; the deadline is armed only if the kernel has nothing yet.

        `answer_pending`: we just sent something the peer must answer first (a request to the
        upstream, a response to the agent), so do not try the kernel before waiting.
        """
        if not answer_pending:
            data = stream.try_receive(RECV_SIZE)
            if data is not None:
                return data
        self.phase = phase
        self.deadline = deadline
        return await stream.receive_after_wait(RECV_SIZE)

    # -- reading ----------------------------------------------------------------------------

    async def read_head(self) -> http1.RequestHead | None:
        """The next request head, or None when the agent closed the connection."""
        limits = self.limits
        buffer = self.buffer
        now = time.monotonic()
        # Idle between requests: the keep-alive timeout. From the first byte of a head, the whole
        # head must arrive within head_timeout (slowloris), however it is dribbled.
        head_deadline = now + limits.head_timeout if buffer else math.inf
        while True:
            if buffer:
                parsed = http1.parse_request_head(buffer, self.runtime.http_limits)
                if parsed is not None:
                    head, consumed = parsed
                    self.requests += 1
                    del buffer[:consumed]
                    return head
            if buffer:
                data = await self._receive(self.stream, Phase.HEAD, head_deadline)
            else:
                # After a response the agent has nothing more to say until it reads it.
                data = await self._receive(
                    self.stream,
                    Phase.IDLE,
                    now + limits.idle_keepalive_timeout,
                    answer_pending=self.requests > 0,
                )
            if not data:
                if buffer:
                    raise HttpProtocolError("connection closed inside a request head")
                return None
            if not buffer:
                head_deadline = time.monotonic() + limits.head_timeout
            buffer += data

    async def _receive_body(self) -> bytes:
        if self.buffer:
            data = bytes(self.buffer)
            self.buffer.clear()
            return data
        deadline = time.monotonic() + self.limits.read_timeout
        return await self._receive(self.stream, Phase.BODY, deadline)

    async def read_body_whole(self, reader: http1.BodyReader, cap: int) -> bytes:
        body = bytearray()
        while not reader.done:
            data = await self._receive_body()
            if not data:
                reader.feed_eof()
            body += reader.feed(data)
            if len(body) > cap:
                raise self._too_large()
        self.buffer[:0] = reader.take_leftover()
        return bytes(body)

    def _too_large(self) -> _Refused:
        return _Refused(
            413,
            Refusal(
                error="body_too_large",
                message=f"request body over {self.limits.max_body_bytes} bytes",
            ),
            close=True,
        )

    # -- the connection loop ----------------------------------------------------------------

    async def run(self) -> None:
        refusal_bytes: bytes | None = None
        live = self.runtime.live
        live.add(self)
        try:
            with self.scope:
                try:
                    refusal_bytes = await self._serve_requests()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        finally:
            live.discard(self)
        if self.upstream is not None:
            # Interrupted mid-exchange (timeout, broken agent socket): never pool it.
            self.upstream.close()
            self.upstream = None
        if self.scope.cancelled_caught and not self.response_started:
            refusal_bytes = self._timeout_refusal()
        if refusal_bytes is not None:
            with trio.move_on_after(LINGER_SECONDS):
                try:
                    await self.stream.send_all(refusal_bytes)
                except trio.BrokenResourceError:
                    pass
            await lingering_close(self.stream)
        else:
            self.stream.close()

    def _timeout_refusal(self) -> bytes | None:
        crew = self.crew
        if self.phase in (Phase.HEAD, Phase.BODY):
            return refusal(
                408,
                Refusal(
                    error="request_timeout",
                    crew=crew.name,
                    message=f"request {self.phase.value} not received in time",
                ),
                close=True,
            )
        if self.phase is Phase.UPSTREAM:
            return refusal(
                504,
                Refusal(
                    error="upstream_timeout",
                    rule="upstream_timeout",
                    crew=crew.name,
                    mode=crew.mode.value,
                    message="the upstream did not answer in time",
                ),
                close=True,
            )
        return None

    async def _serve_requests(self) -> bytes | None:
        """Serve requests until the connection ends; returns a final refusal to send, if any."""
        while True:
            self.response_started = False
            try:
                head = await self.read_head()
                if head is None:
                    return None
                keep_alive = await self.dispatch(head)
            except _Refused as refused:
                if self.response_started:
                    return None
                data = refusal(refused.status, self._scrubbed(refused.body), close=refused.close)
                if refused.close:
                    return data
                await self.stream.send_all(data)
                continue
            except HttpProtocolError as exc:
                if self.response_started:
                    return None
                return refusal(
                    exc.status_hint,
                    self._scrubbed(Refusal(error="bad_request", message=str(exc))),
                    close=True,
                )
            if not keep_alive:
                return None

    def _scrubbed(self, body: Refusal) -> Refusal:
        """A refusal's message can quote an upstream or the agent's input: scrub it too."""
        message = self.runtime.scrubbers.current.scrub_text(body.message)
        return body if message == body.message else msgspec.structs.replace(body, message=message)

    async def dispatch(self, head: http1.RequestHead) -> bool:
        """Serve one request; returns whether the agent connection stays open."""
        target = head.target
        if head.method == b"CONNECT":
            await self.serve_tunnel(head)
            return False
        if target[:7].lower() == b"http://":
            return await self.serve_forward(head)
        if target[:1] == b"/":
            return await self.serve_origin_form(head)
        if target[:8].lower() == b"https://":
            raise _Refused(
                400,
                Refusal(error="bad_request", message="https:// targets must use CONNECT"),
                close=not head.keep_alive,
            )
        raise HttpProtocolError(f"unsupported request target form for {head.method!r}")

    # -- policy -----------------------------------------------------------------------------

    def _deny(
        self,
        route: str,
        method: bytes,
        host: str,
        port: int,
        rule: str,
        status: int,
        message: str,
        close: bool,
    ) -> _Refused:
        crew = self.crew
        self.runtime.sink.emit(
            RequestDenied(
                crew=crew.name,
                mode=crew.mode.value,
                route=route,
                method=method.decode("ascii", "replace"),
                host=host,
                port=port,
                rule=rule,
                status=status,
            )
        )
        return _Refused(
            status,
            Refusal(
                error=(
                    "egress_denied"
                    if status == 403
                    else "audit_unavailable"
                    if rule == AUDIT_UNAVAILABLE
                    else "upstream_failed"
                ),
                message=message,
                host=host,
                rule=rule,
                mode=crew.mode.value,
                crew=crew.name,
            ),
            close=close,
        )

    def _upstream_failed(
        self,
        upstream: UpstreamConnection,
        route: str,
        method: bytes,
        host: str,
        port: int,
        rule: str,
        message: str,
        close: bool,
    ) -> _Refused:
        """Close an upstream that cannot finish this exchange (never pooled) and say why: 502."""
        upstream.close()
        self.upstream = None
        return self._deny(route, method, host, port, rule, 502, message, close)

    def check_name_policy(
        self, route: str, method: bytes, host: str, port: int, close: bool
    ) -> None:
        crew = self.crew
        if self.runtime.audit_paused or self.runtime.sink.backlogged:
            # Every route (forward, reverse, tunnel) passes here before anything is dialled.
            # Paused by applianced (its journal is behind), or this worker's own events are not
            # being taken off its hands fast enough: either way, refuse rather than not record.
            raise self._deny(
                route,
                method,
                host,
                port,
                AUDIT_UNAVAILABLE,
                503,
                "the appliance cannot record requests right now (its journal is behind); "
                "nothing was sent; retry in a few seconds",
                close,
            )
        decision = crew.decide(host, port)
        if not decision.allowed:
            why = {
                "mode_none": f"crew {crew.name} has network mode none: no egress at all",
                "not_in_allowlist": f"{host} is not on the allowlist of crew {crew.name}",
                "ip_shorthand": f"{host} is a numeric shorthand for an address; refused",
            }.get(decision.rule, f"{host} refused by rule {decision.rule}")
            raise self._deny(route, method, host, port, decision.rule, 403, why, close)

    async def open_upstream(
        self,
        route: str,
        method: bytes,
        tls: bool,
        host: str,
        port: int,
        *,
        fresh: bool,
        close: bool,
    ) -> UpstreamConnection:
        dialer = self.runtime.dialer
        try:
            if fresh:
                return await dialer.open(tls, host, port)
            return await dialer.checkout(tls, host, port)
        except PolicyDenied as exc:
            raise self._deny(route, method, host, port, exc.rule, 403, str(exc), close) from None
        except UpstreamError as exc:
            raise self._deny(
                route, method, host, port, "upstream_unreachable", exc.status_hint, str(exc), True
            ) from None

    # -- forward and reverse ----------------------------------------------------------------

    async def serve_forward(self, head: http1.RequestHead) -> bool:
        match = _ABSOLUTE_TARGET_RE.match(head.target, 7)
        assert match is not None  # the pattern matches any bytes
        authority, path = match.groups()
        if path[:1] != b"/":
            path = b"/" + path  # "http://host?q" or "http://host"
        close = not head.keep_alive
        try:
            host, port = self.runtime.parse_authority(authority)
        except PolicyDenied as exc:
            raise self._deny(
                "forward",
                head.method,
                authority.decode("ascii", "replace"),
                0,
                exc.rule,
                403,
                str(exc),
                close,
            ) from None
        self.check_name_policy("forward", head.method, host, port, close)
        provider = self.runtime.routes_by_host.get(host)
        if provider is not None:
            # An exact provider host: always over verified TLS to the configured base URL, so
            # the credential can be injected (never onto a plain-text connection).
            return await self.exchange(
                head, "forward", provider.host, provider.port, True, path, provider
            )
        return await self.exchange(head, "forward", host, port, False, path, None)

    async def serve_origin_form(self, head: http1.RequestHead) -> bool:
        target = head.target
        path = target.split(b"?", 1)[0]
        if path in KEEPER_PATHS:
            return await self.serve_keeper(head, path)
        if path in LOCAL_PATHS:
            if head.body_kind is not http1.BodyKind.NONE:
                reader = http1.BodyReader.for_request(head, self.runtime.http_limits)
                await self.read_body_whole(reader, 0)
            await self.stream.send_all(
                local_json({"ok": True, "crew": self.crew.name, "mode": self.crew.mode.value})
            )
            return head.keep_alive
        second = target.find(b"/", 1)
        query = target.find(b"?", 1)
        ends = [i for i in (second, query) if i != -1]
        end = min(ends) if ends else len(target)
        route = self.runtime.routes_by_name.get(target[1:end])
        if route is None:
            raise _Refused(
                404,
                Refusal(
                    error="not_found",
                    message="no such route; use /anthropic/, /openai/, /google/ or a proxy request",
                    crew=self.crew.name,
                ),
                close=not head.keep_alive,
            )
        rest = target[end:]
        if rest[:1] != b"/":
            rest = b"/" + rest
        upstream_target = route.path_prefix.encode("ascii") + rest
        self.check_name_policy("reverse", head.method, route.host, route.port, not head.keep_alive)
        return await self.exchange(
            head, "reverse", route.host, route.port, True, upstream_target, route
        )

    async def serve_keeper(self, head: http1.RequestHead, path: bytes) -> bool:
        """`POST /keeper/request|execute`: checked here, decided by applianced (docs/keeper.md).

        The crew is this connection's (its gateway), whatever the body says. The answer is not
        scrubbed here: a granted `request` must deliver the value, and applianced has already
        scrubbed an `execute`'s output.
        """
        close = not head.keep_alive
        action = KEEPER_PATHS[path]
        if head.method != b"POST":
            raise _Refused(
                405,
                Refusal(error="method_not_allowed", message="the keeper takes POST only"),
                close=close,
            )
        body = b""
        if head.body_kind is not http1.BodyKind.NONE:
            if head.body_kind is http1.BodyKind.LENGTH and head.content_length > KEEPER_BODY_BYTES:
                raise self._too_large()
            reader = http1.BodyReader.for_request(head, self.runtime.http_limits)
            body = await self.read_body_whole(reader, KEEPER_BODY_BYTES)
        fields: object = None
        try:
            fields = msgspec.json.decode(body)
            if not isinstance(fields, dict):
                raise KeeperRefused("the body must be a JSON object", rule="bad_body")
            check_intent(fields.get("intent"))
            if action is Action.EXECUTE:
                parse_command(fields.get("command"))
        except (KeeperRefused, msgspec.DecodeError) as exc:
            rule = exc.rule if isinstance(exc, KeeperRefused) else "bad_body"
            named = fields.get("credential") if isinstance(fields, dict) else None
            self.runtime.sink.emit(
                KeeperCallRefused(
                    crew=self.crew.name,
                    action=action.value,
                    credential=named[:64] if isinstance(named, str) else "",
                    rule=rule,
                )
            )
            raise _Refused(
                400,
                Refusal(error=rule, message=f"keeper: {exc}", crew=self.crew.name),
                close=close,
            ) from None
        channel = self.runtime.keeper_channel
        if channel is None:
            raise _Refused(
                503,
                Refusal(error="keeper_unavailable", message="the keeper is not connected yet"),
                close=close,
            )
        # The read deadline of the body must not cut the decision short (a model round-trip and
        # an execute's 120 s): forward_to_keeper bounds the wait itself, and answers 503.
        self.phase = Phase.UPSTREAM
        self.deadline = math.inf
        try:
            status, answer = await forward_to_keeper(
                channel.path, channel.token, action.value, self.crew.name, body
            )
        except KeeperUnavailable as exc:
            raise _Refused(
                503, Refusal(error="keeper_unavailable", message=str(exc)), close=close
            ) from None
        await self.stream.send_all(json_response(status, answer, close=close))
        return not close

    async def exchange(
        self,
        head: http1.RequestHead,
        route_kind: str,
        host: str,
        port: int,
        tls: bool,
        target: bytes,
        provider: ProviderRoute | None,
    ) -> bool:
        limits = self.limits
        client_close = not head.keep_alive
        if head.body_kind is http1.BodyKind.LENGTH and head.content_length > limits.max_body_bytes:
            raise self._too_large()
        authority = self.runtime.host_field(host, port, tls)

        # Body: small or chunked bodies are read whole (chunked is re-framed with a length so the
        # upstream never sees the agent's framing); large ones stream on a fresh connection.
        body: bytes | None = None
        reader: http1.BodyReader | None = None
        length: int | None = None
        if head.body_kind is not http1.BodyKind.NONE:
            if head.expect_continue:
                await self.stream.send_all(CONTINUE)
            reader = http1.BodyReader.for_request(head, self.runtime.http_limits)
            if head.body_kind is http1.BodyKind.CHUNKED or head.content_length <= REPLAYABLE_BODY:
                body = await self.read_body_whole(reader, limits.max_body_bytes)
                reader = None
                length = len(body)
            else:
                length = head.content_length
        elif head.method in _METHODS_WITH_BODY:
            body = b""
            length = 0

        injected = False
        fields = None if provider is not None else http1.relay_fields(head, _REQUEST_DROP)
        if fields is not None:
            # The fast path: the agent's field lines as they arrived, minus the dropped ones.
            request_head = (
                b"%s %s HTTP/1.1\r\nhost: %s%s\r\naccept-encoding: identity%s\r\n\r\n"
                % (
                    head.method,
                    target,
                    authority,
                    fields,
                    b"" if length is None else b"\r\ncontent-length: %d" % length,
                )
            )
        else:
            headers = [
                (name, value)
                for name, value in http1.strip_hop_by_hop(head.headers)
                if name not in _REQUEST_FRAMING
            ]
            if provider is not None:
                provider = self.runtime.route_for_crew(provider, self.crew.name)
                target, headers, injected = rewrite_for_provider(provider, target, headers)
            headers.insert(0, (b"host", authority))
            headers.append((b"accept-encoding", IDENTITY))
            if length is not None:
                headers.append((b"content-length", b"%d" % length))
            request_head = http1.serialize_request_head(head.method, target, headers)

        attempt = 0
        while True:
            attempt += 1
            upstream = await self.open_upstream(
                route_kind,
                head.method,
                tls,
                host,
                port,
                fresh=reader is not None or attempt > 1,
                close=client_close,
            )
            self.upstream = upstream
            try:
                if reader is None:
                    await upstream.stream.send_all(request_head + body if body else request_head)
                else:
                    await upstream.stream.send_all(request_head)
                    await self._stream_body_upstream(reader, upstream)
                response = await self._read_response_head(upstream, head.method)
                break
            except (trio.BrokenResourceError, trio.ClosedResourceError, _UpstreamClosedEarly):
                upstream.close()
                self.upstream = None
                if upstream.reused and attempt == 1 and reader is None:
                    continue  # the pooled connection had gone stale: retry once, fresh
                raise self._deny(
                    route_kind,
                    head.method,
                    host,
                    port,
                    "upstream_closed",
                    502,
                    f"{host} closed the connection",
                    True,
                ) from None
            except HttpProtocolError as exc:
                raise self._upstream_failed(
                    upstream,
                    route_kind,
                    head.method,
                    host,
                    port,
                    "upstream_protocol_error",
                    f"{host} sent a malformed response: {exc}",
                    True,
                ) from None

        sink = self.runtime.sink
        crew = self.crew
        sink.emit(
            RequestAllowed(
                crew=crew.name,
                mode=crew.mode.value,
                route=route_kind,
                method=head.method.decode("ascii", "replace"),
                host=host,
                port=port,
                address=upstream.address,
                rule="provider" if provider else "policy",
            )
        )
        if injected and provider is not None:
            sink.emit(
                CredentialInjected(crew=crew.name, provider=provider.provider.value, host=host)
            )
        return await self._relay_response(head, response, upstream, route_kind, host, port)

    async def _stream_body_upstream(
        self, reader: http1.BodyReader, upstream: UpstreamConnection
    ) -> None:
        while not reader.done:
            data = await self._receive_body()
            if not data:
                reader.feed_eof()
            piece = reader.feed(data)
            if piece:
                await upstream.stream.send_all(piece)
        self.buffer[:0] = reader.take_leftover()

    async def _read_response_head(
        self, upstream: UpstreamConnection, method: bytes
    ) -> http1.ResponseHead:
        buffer = upstream.buffer
        deadline = time.monotonic() + self.limits.read_timeout
        http_limits = self.runtime.http_limits
        answer_pending = True  # the request was just sent
        while True:
            if buffer:
                parsed = http1.parse_response_head(buffer, http_limits, request_method=method)
                if parsed is not None:
                    response, consumed = parsed
                    del buffer[:consumed]
                    if 100 <= response.status < 200:
                        if response.status == 101:
                            raise HttpProtocolError("unexpected 101 Switching Protocols")
                        continue  # interim (100 Continue, 103 Early Hints): not relayed
                    return response
            data = await self._receive(
                upstream.stream, Phase.UPSTREAM, deadline, answer_pending=answer_pending
            )
            answer_pending = False
            if not data:
                if buffer:
                    raise HttpProtocolError("upstream closed inside a response head")
                raise _UpstreamClosedEarly
            buffer += data

    async def _relay_response(
        self,
        head: http1.RequestHead,
        response: http1.ResponseHead,
        upstream: UpstreamConnection,
        route_kind: str,
        host: str,
        port: int,
    ) -> bool:
        """Relay the response, field lines and body through the scrubber.

        A body of up to `WHOLE_BODY` bytes is read whole, scrubbed in one call and keeps its
        Content-Length (corrected if a redaction changed it); any other body streams through a
        scrubber stream and is re-framed as chunked (close-delimited for an HTTP/1.0 agent),
        since its scrubbed length is not known in advance.
        """
        scrubber = self.runtime.scrubbers.current
        keep_client = head.keep_alive
        kind = response.body_kind
        buffer = upstream.buffer
        if kind is not http1.BodyKind.NONE and _CONTENT_ENCODING_RE.search(response.raw):
            coding = unscrubbable_encoding(
                [value for name, value in response.headers if name == b"content-encoding"]
            )
            if coding is not None:
                raise self._upstream_failed(
                    upstream,
                    route_kind,
                    head.method,
                    host,
                    port,
                    "unscrubbable_encoding",
                    f"{host} answered with content-encoding {coding.decode('ascii', 'replace')}"
                    " although the proxy asked for identity; the response cannot be checked "
                    "for credentials, so it is not relayed",
                    not keep_client,
                )
        if kind is http1.BodyKind.LENGTH and len(buffer) < response.content_length <= WHOLE_BODY:
            # Small bodies are read whole and scrubbed in one call: they keep a Content-Length.
            deadline = time.monotonic() + self.limits.read_timeout
            while len(buffer) < response.content_length:
                data = await self._receive(upstream.stream, Phase.RELAY, deadline)
                if not data:
                    raise self._upstream_failed(
                        upstream,
                        route_kind,
                        head.method,
                        host,
                        port,
                        "upstream_closed",
                        f"{host} closed the connection inside a response body",
                        True,
                    )
                buffer += data
        whole = kind is http1.BodyKind.LENGTH and len(buffer) == response.content_length
        body = b""
        drop = http1.RESPONSE_DROP
        extra = []
        if whole:
            body = bytes(buffer)
            buffer.clear()
            if body:
                scrubbed = scrubber.scrub(body)
                if scrubbed != body:
                    drop = _RESPONSE_DROP_LENGTH
                    extra.append((b"content-length", b"%d" % len(scrubbed)))
                    body = scrubbed
        streamed = kind is not http1.BodyKind.NONE and not whole
        rechunk = streamed
        if streamed:
            drop = _RESPONSE_DROP_LENGTH
            if head.http_version != b"1.1":
                rechunk = False
                keep_client = False  # an HTTP/1.0 agent learns the end from the close
            else:
                extra.append((b"transfer-encoding", b"chunked"))
        if not keep_client:
            extra.append((b"connection", b"close"))
        fields = http1.relay_fields(response, drop)
        if fields is not None:
            out = bytearray(b"HTTP/1.1 %d %s" % (response.status, response.reason))
            out += scrub_field_lines(scrubber, fields)
            for name, value in extra:
                out += b"\r\n%s: %s" % (name, value)
            out += b"\r\n\r\n"
        else:
            headers = [
                (name, scrubber.scrub(value))
                for name, value in http1.strip_hop_by_hop(response.headers, keep_underscores=True)
                if not (drop is _RESPONSE_DROP_LENGTH and name == b"content-length")
            ]
            headers.extend(extra)
            out = bytearray(
                http1.serialize_response_head(response.status, response.reason, headers)
            )
        send_all = self.stream.send_all
        self.response_started = True
        if not streamed:
            # No body, or the common small response: the whole body came with the head.
            out += body
            await send_all(out)
            self.upstream = None
            self._release_upstream(upstream, response.keep_alive and not buffer)
            return keep_client
        stream = upstream.stream
        scrub = scrubber.stream()
        reader = http1.BodyReader.for_response(response, self.runtime.http_limits)
        piece = b""
        if buffer:
            piece = reader.feed(bytes(buffer))
            buffer.clear()
        read_timeout = self.limits.read_timeout
        while True:
            if piece:
                # An SSE event comes out with the read that completed it, unless its last
                # bytes could begin a secret (native/scrub_reference.py: the hold-back rule).
                piece = scrub.feed(piece)
            if reader.done:
                piece += scrub.flush()
            if piece:
                out += http1.encode_chunk(piece) if rechunk else piece
            if reader.done:
                if rechunk:
                    out += http1.LAST_CHUNK
                await send_all(out)
                break
            if out:
                await send_all(out)
                out = bytearray()
            # Each piece re-arms the deadline: a slow stream is fine, a silent one is not.
            data = await self._receive(stream, Phase.RELAY, time.monotonic() + read_timeout)
            if data:
                piece = reader.feed(data)
            else:
                reader.feed_eof()
                piece = b""
        self.upstream = None
        leftover = reader.take_leftover()
        reusable = response.keep_alive and kind is not http1.BodyKind.UNTIL_CLOSE
        self._release_upstream(upstream, reusable and not leftover)
        return keep_client

    def _release_upstream(self, upstream: UpstreamConnection, reusable: bool) -> None:
        """After a complete exchange: back to the pool if it can carry another, else closed."""
        if not (reusable and self.runtime.dialer.checkin(upstream)):
            upstream.close()

    # -- tunnels ----------------------------------------------------------------------------

    async def serve_tunnel(self, head: http1.RequestHead) -> None:
        try:
            host, port = parse_authority(head.target, -1)
        except PolicyDenied as exc:
            raise self._deny(
                "tunnel",
                b"CONNECT",
                head.target.decode("ascii", "replace"),
                0,
                exc.rule,
                403,
                str(exc),
                True,
            ) from None
        if head.body_kind is not http1.BodyKind.NONE:
            raise HttpProtocolError("CONNECT with a body")
        self.check_name_policy("tunnel", b"CONNECT", host, port, True)
        runtime = self.runtime
        try:
            addresses = await runtime.dialer.resolve(host, port)
            sock = await runtime.dialer.connect_checked(addresses, port, host)
        except PolicyDenied as exc:
            raise self._deny(
                "tunnel", b"CONNECT", host, port, exc.rule, 403, str(exc), True
            ) from None
        except UpstreamError as exc:
            raise self._deny(
                "tunnel",
                b"CONNECT",
                host,
                port,
                "upstream_unreachable",
                exc.status_hint,
                str(exc),
                True,
            ) from None
        runtime.tunnel_ids += 1
        tunnel_id = runtime.tunnel_ids
        crew = self.crew
        address = str(sock.getpeername()[0])
        runtime.sink.emit(
            RequestAllowed(
                crew=crew.name,
                mode=crew.mode.value,
                route="tunnel",
                method="CONNECT",
                host=host,
                port=port,
                address=address,
                rule="policy",
            )
        )
        runtime.sink.emit(
            TunnelOpened(crew=crew.name, tunnel_id=tunnel_id, host=host, port=port, address=address)
        )
        started = trio.current_time()
        stats = tunnel.TunnelStats(reason="error")
        try:
            self.response_started = True
            await self.stream.send_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            prefix = bytes(self.buffer)
            self.buffer.clear()
            # The tunnel has its own idle deadline; lift the connection's.
            self.phase = Phase.RELAY
            self.deadline = math.inf
            stats = await tunnel.relay(
                self.stream.sock,
                sock,
                client_prefix=prefix,
                idle_timeout=self.limits.tunnel_idle_timeout,
            )
        finally:
            trio.lowlevel.notify_closing(sock)
            sock.close()
            runtime.sink.emit(
                TunnelClosed(
                    crew=crew.name,
                    tunnel_id=tunnel_id,
                    host=host,
                    port=port,
                    bytes_up=stats.bytes_up,
                    bytes_down=stats.bytes_down,
                    duration=round(trio.current_time() - started, 6),
                    reason=stats.reason,
                )
            )


class _UpstreamClosedEarly(Exception):
    """The upstream closed before any byte of a response (a stale pooled connection)."""


# Replaced by the proxy's own: the framing, and the codings the agent accepts (the proxy asks for
# identity so that the scrubber reads the response body; see proxycore/protocol/scrubbing.py).
_REQUEST_FRAMING = frozenset({b"host", b"content-length", b"expect", b"accept-encoding"})
# After "http://": the authority runs to the first "/", "?" or "#"; the path and query run to
# the fragment, which is dropped (RFC 9110 4.2.1: never sent to the origin).
_ABSOLUTE_TARGET_RE = re.compile(rb"([^/?#]*)([^#]*)")
_REQUEST_DROP = http1.compile_drop(http1.HOP_BY_HOP | _REQUEST_FRAMING)
_METHODS_WITH_BODY = frozenset({b"POST", b"PUT", b"PATCH"})
# A response whose body is re-framed drops the upstream's length (and never relays its framing).
_RESPONSE_DROP_LENGTH = http1.compile_drop(
    http1.HOP_BY_HOP | {b"content-length"}, keep_underscores=True
)
_CONTENT_ENCODING_RE = re.compile(rb"(?i)\r\ncontent-encoding[ \t]*:")


# -- listening --------------------------------------------------------------------------------


def bind_listeners(config: ProxyConfig, *, reuse_port: bool) -> list[trio.SocketListener]:
    """Bind the proxy port on every crew gateway and extra listen address."""
    addresses = dict.fromkeys([*(c.gateway for c in config.crew), *config.listen.addresses])
    bound: list[socket.socket] = []
    try:
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                # Worker processes share the port; the kernel spreads connections among them.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address, config.listen.port))
            except OSError as exc:
                raise ProxyError(
                    f"cannot listen on {address}:{config.listen.port}: {exc.strerror}"
                ) from None
            sock.listen(config.listen.backlog)
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return [trio.SocketListener(trio.socket.from_stdlib_socket(sock)) for sock in bound]


async def serve(
    config: ProxyConfig,
    sink: EventSink,
    *,
    listeners: list[trio.SocketListener] | None = None,
    control_channel: trio.SocketStream | None = None,
    runtime: ProxyRuntime | None = None,
    task_status: trio.TaskStatus[ProxyRuntime] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy until cancelled.

    `runtime` may be built beforehand (from `config` and `sink`): a worker that drops its
    privileges builds it first, while it can still read its CA bundle and credential files.
    """
    if runtime is None:
        runtime = ProxyRuntime(config, sink)
    if isinstance(sink, BatchingSink):
        scrubbers = runtime.scrubbers
        # Read at each write, so a credential added at run time is scrubbed from then on.
        sink.scrub = lambda batch: scrub_json_lines(scrubbers.current, batch)
    if listeners is None:
        listeners = bind_listeners(config, reuse_port=config.listen.workers > 1)
    limits = config.limits

    async def handle(trio_stream: trio.SocketStream) -> None:
        stream = PlainStream.adopt(trio_stream.socket)
        try:
            stream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            local = str(stream.sock.getsockname()[0]).split("%", 1)[0]
        except OSError:
            stream.close()
            return
        crew = runtime.crew_for(local)
        if crew is None:
            await _refuse_and_close(
                stream,
                403,
                Refusal(
                    error="unknown_gateway",
                    rule="unknown_gateway",
                    message=f"no crew is served on {local}",
                ),
            )
            return
        if runtime.connections >= limits.max_connections:
            await _refuse_and_close(
                stream,
                503,
                Refusal(error="overloaded", message="too many connections", crew=crew.name),
            )
            return
        if crew.connections >= limits.max_connections_per_crew:
            await _refuse_and_close(
                stream,
                503,
                Refusal(
                    error="overloaded",
                    rule="max_connections_per_crew",
                    crew=crew.name,
                    message=f"crew {crew.name} has {crew.connections} open connections",
                ),
            )
            return
        runtime.connections += 1
        crew.connections += 1
        try:
            await ClientConnection(runtime, stream, crew).run()
        finally:
            runtime.connections -= 1
            crew.connections -= 1

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            nursery.start_soon(runtime.reap_expired)
            handler = runtime.handle_control_async
            if control_channel is not None:
                # A child of applianced or of the worker supervisor: control messages (and the
                # listening sockets of crews added at run time) arrive over a socketpair.
                listeners_by_crew: dict[str, trio.CancelScope] = {}

                async def channel_handler(
                    message: control.ControlMessage, listener: socket.socket | None
                ) -> control.ControlReply:
                    if listener is not None and not isinstance(message, control.CrewAdd):
                        listener.close()
                        listener = None
                    reply = runtime.handle_control(message)
                    if isinstance(message, control.CrewRemove):
                        scope = listeners_by_crew.pop(message.name, None)
                        if scope is not None:
                            scope.cancel()
                    elif isinstance(message, control.CrewAdd) and listener is not None:
                        if reply.ok:
                            scope = await nursery.start(_serve_listener, listener, handle, nursery)
                            listeners_by_crew[message.name] = scope
                        else:
                            listener.close()
                    return reply

                async def control_then_stop() -> None:
                    await serve_control_channel(control_channel.socket, channel_handler)
                    # The parent is gone: stop rather than serve a policy nobody can change
                    # (fail closed).
                    log.warning("control channel closed; stopping")
                    nursery.cancel_scope.cancel()

                nursery.start_soon(control_then_stop)
            elif config.control.socket:
                await nursery.start(serve_control_socket, config.control.socket, handler)
            for listener in listeners:
                nursery.start_soon(_accept_loop, listener, handle, nursery)
            task_status.started(runtime)
    finally:
        for connection in runtime.dialer.discard_idle():
            connection.close()


async def _serve_listener(
    sock: socket.socket,
    handler: Callable[[trio.SocketStream], Awaitable[None]],
    nursery: trio.Nursery,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept on a listening socket handed down by the parent until the scope is cancelled."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    with trio.CancelScope() as scope:
        task_status.started(scope)
        try:
            await _accept_loop(listener, handler, nursery)
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()


async def _accept_loop(
    listener: trio.SocketListener,
    handler: Callable[[trio.SocketStream], Awaitable[None]],
    nursery: trio.Nursery,
) -> None:
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # Out of descriptors: back off instead of spinning (trio.serve_listeners does
                # the same).
                log.warning("accept failed: %s; pausing", exc.strerror)
                await trio.sleep(0.1)
                continue
            raise
        nursery.start_soon(handler, stream)


async def _refuse_and_close(stream: PlainStream, status: int, body: Refusal) -> None:
    with trio.move_on_after(LINGER_SECONDS):
        try:
            await stream.send_all(refusal(status, body, close=True))
        except trio.BrokenResourceError:
            pass
    await lingering_close(stream)


async def lingering_close(stream: PlainStream) -> None:
    """Close after a refusal without destroying it.

    Closing a socket that still holds unread input makes the kernel send RST, and an RST can
    discard our response before the agent reads it. So: half-close, drain what the agent is still
    sending (bounded in bytes and time), then close (the "lingering close" of Apache and nginx).
    """
    try:
        stream.shutdown_write()
        with trio.move_on_after(LINGER_SECONDS):
            drained = 0
            while drained < LINGER_BYTES:
                data = await stream.receive(RECV_SIZE)
                if not data:
                    break
                drained += len(data)
    except (OSError, trio.BrokenResourceError):
        pass
    finally:
        stream.close()
