"""The worker's state: the config snapshot, the crews, the routes and credentials, the dialer.

Theory of operation: one `ProxyRuntime` per worker process, built from the frozen config before
the worker drops its privileges (it reads the CA bundle and credential files then). Control
messages (proxycore/control.py) change it at run time, each applied all or nothing with no await
in between, so a connection task never sees half a change: routes and the store's credentials are
one immutable `Routes` value swapped whole, the scrubber is compiled before it is swapped in.

Every resource a crew can consume is bounded per crew here or in the dialer (docs/proxy.md
"Limits"): connections (`CrewState.connections`), lookups in flight (`CrewState.lookups`), bytes
held in memory for bodies (`CrewState.buffered`), upstream connections open and idle
(`Dialer.crews`). A crew that uses up its share is refused (503) or made to stream; the other
crews never wait for it.
"""

from __future__ import annotations

import dataclasses
import math
import ssl
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from native.scrub_patterns import PatternError
from proxycore import control
from proxycore.config import (
    DEFAULT_BASE_URLS,
    CrewConfig,
    ProxyConfig,
    crew_policy,
    crew_rules,
    validate,
)
from proxycore.errors import PolicyDenied, ProxyError
from proxycore.io.dns import Resolver
from proxycore.io.http2 import h2_limits
from proxycore.io.leaves import LeafError, load_leaves, read_leaf_files
from proxycore.io.sinks import EventSink
from proxycore.io.upstream import CrewReach, Dialer, make_tls_context
from proxycore.io.upstream_h2 import H2Pool
from proxycore.protocol import http1
from proxycore.protocol.credentials import (
    Credential,
    Provider,
    ProviderRoute,
    Routes,
    load_credential,
    route_for,
)
from proxycore.protocol.events import AllowlistChanged, PolicyWarning
from proxycore.protocol.fairness import Activity, Pacer
from proxycore.protocol.netrules import NetRules, parse_net_rules
from proxycore.protocol.policy import Allowlist, CrewPolicy, normalize_host, parse_mode
from proxycore.protocol.scrubbing import ScrubberHolder, configured_shapes
from proxycore.protocol.ssrf import AddressGuard

if TYPE_CHECKING:
    from proxycore.io.connection import ClientConnection

# How often the reaper enforces the connections' phase deadlines and closes idle upstreams.
REAP_INTERVAL = 0.25
IDLE_REAP_INTERVAL = 1.0
# Store credentials rotated or revoked away that the scrubber keeps redacting (oldest dropped).
RETIRED_SECRETS = 64


class BufferBudget:
    """Bytes a crew may hold in memory for bodies; a taker that gets no room streams instead."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give_back(self, n: int) -> None:
        self.used -= n


@dataclass(slots=True, eq=False)
class CrewState:
    """One crew as a worker serves it: its policy and its share of every resource."""

    gateway: str
    policy: CrewPolicy
    # The policy's name and mode, kept here too: read on every request.
    name: str
    mode: str
    # The ranges this crew alone may reach past the SSRF guard (`CrewConfig.ssrf_allow`) and
    # its address rules (`CrewConfig.net`).
    guard: CrewReach | None
    lookups: trio.CapacityLimiter
    buffered: BufferBudget
    # Its pace of new requests and connections while another crew is active (fairness.py).
    requests: Pacer
    accepts: Pacer
    connections: int = 0
    live: set[ClientConnection] = field(default_factory=set)
    # Host -> the server context of its leaf: CONNECT tunnels to these hosts are terminated
    # (proxycore/io/terminate.py). Swapped whole (control.CrewLeaves), never mutated.
    leaves: dict[str, ssl.SSLContext] = field(default_factory=dict)


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
        routes_by_name, routes_by_host = load_routes(config)
        self.routes = Routes(routes_by_name, routes_by_host, {})
        self.retired_secrets: dict[tuple[str, bytes], None] = {}  # ordered: oldest first
        # Everything relayed back to a crew passes through this
        # (see proxycore/protocol/scrubbing.py).
        self.scrubbers = ScrubberHolder(
            route_secrets(routes_by_name.values()), configured_shapes(config.scrub.shapes)
        )
        self.crews: dict[str, CrewState] = {}  # by gateway address
        for crew in config.crew:
            self._add_crew(crew)
        upstream = config.upstream
        self.dialer = Dialer(
            AddressGuard(upstream.ssrf_allow),
            Resolver(upstream.resolve, upstream.nameservers, timeout=upstream.dns_timeout),
            make_tls_context(upstream.ca_file, upstream.ca_file_only),
            appliance_ranges=upstream.appliance_ranges,
            connect_timeout=limits.connect_timeout,
            max_open_per_crew=limits.upstream_connections_per_crew,
            max_idle_per_crew=limits.upstream_idle_per_crew,
            idle_timeout=limits.upstream_idle_timeout,
            tls_h2=(
                make_tls_context(upstream.ca_file, upstream.ca_file_only, ("h2", "http/1.1"))
                if upstream.h2
                else None
            ),
        )
        # Upstream HTTP/2 connections, per crew and host (proxycore/io/upstream_h2.py); the
        # listener runs the pool (its tasks' nursery).
        self.h2 = H2Pool(
            h2_limits(limits),
            self.http_limits,
            write_timeout=limits.read_timeout,
            idle_timeout=limits.upstream_idle_timeout,
        )
        # Cleartext upstreams reached with HTTP/2 prior knowledge: "host" or "host:port".
        self.h2c_hosts = frozenset(entry.lower() for entry in upstream.h2c)
        self.connections = 0
        self.tunnel_ids = 0
        # Which crews started requests lately: pacing applies only when crews compete.
        self.activity = Activity()
        self.live: set[ClientConnection] = set()

    @property
    def audit_blocked(self) -> bool:
        """Crew traffic must be refused: the journal is behind, or this worker's own events
        are not being taken off its hands (EventSink.backlogged)."""
        return self.audit_paused or self.sink.backlogged

    # -- background work ----------------------------------------------------------------------

    async def reap_expired(self) -> None:
        """Cancel connections whose phase deadline has passed, every `REAP_INTERVAL` seconds,
        and close idle upstream connections past their idle timeout.

        Each connection keeps its deadline as a plain float (`time.monotonic()`, a C call, where
        `trio.current_time()` is three Python frames) that it sets before a wait; moving a trio
        deadline instead costs a heap operation per wait, several per request. Timeouts are
        seconds long, so enforcing them within `REAP_INTERVAL` is precise enough.
        """
        next_idle_reap = 0.0
        while True:
            await trio.sleep(REAP_INTERVAL)
            now = time.monotonic()
            for connection in list(self.live):
                if connection.deadline <= now:
                    connection.scope.cancel()
            if now >= next_idle_reap:
                self.dialer.reap_idle()
                self.h2.reap_idle()
                next_idle_reap = now + IDLE_REAP_INTERVAL

    # -- crews --------------------------------------------------------------------------------

    def _add_crew(self, crew: CrewConfig) -> CrewState:
        mode, allowlist = crew_policy(crew, self.config.policy)
        # The configured provider hosts are part of every crew's allowlist: the operator
        # named them, and the reverse routes lead nowhere else.
        for route in self.routes.by_name.values():
            allowlist.add(route.host)
        gateway = normalize_host(crew.gateway) if ":" in crew.gateway else crew.gateway
        limits = self.limits
        state = self.crews[gateway] = CrewState(
            gateway=gateway,
            policy=CrewPolicy(
                crew.name,
                mode,
                allowlist,
                crew_rules(crew),
                NetRules(parse_net_rules(crew.net)),
                approval_window=(
                    self.config.approvals.window if self.config.approvals.enabled else None
                ),
            ),
            name=crew.name,
            mode=mode.value,
            guard=CrewReach(
                AddressGuard(crew.ssrf_allow) if crew.ssrf_allow else None,
                NetRules(parse_net_rules(crew.net)),
            )
            if crew.ssrf_allow or crew.net
            else None,
            lookups=trio.CapacityLimiter(limits.dns_lookups_per_crew),
            buffered=BufferBudget(limits.max_buffered_bytes_per_crew),
            requests=Pacer(
                limits.fair_requests_per_second, limits.fair_request_burst, limits.fair_max_wait
            ),
            accepts=Pacer(
                limits.fair_connections_per_second, limits.fair_connection_burst, math.inf
            ),
        )
        if crew.leaves:
            # Read now: the worker has not dropped its privileges yet (the files may be
            # readable by root only).
            state.leaves = read_leaf_files(crew.leaves, source=f"crew {crew.name}")
        _, warning = parse_mode(crew.mode)
        if warning:
            self.sink.emit(PolicyWarning(crew=crew.name, message=warning))
        return state

    def add_crew(self, message: control.CrewAdd) -> control.ControlReply:
        """A crew created at run time (applianced): validated as the config file's crews are."""
        crew = CrewConfig(
            name=message.name,
            gateway=message.gateway,
            mode=message.mode,
            allow=message.allow,
            ssrf_allow=message.ssrf_allow,
            rules=message.rules,
            net=message.net,
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
        for connection in list(crew.live):
            connection.end("crew_removed")
        self.dialer.forget_crew(name)
        self.h2.forget_crew(name)
        return control.ControlReply(ok=True, changed=True)

    def set_crew_leaves(self, message: control.CrewLeaves) -> control.ControlReply:
        """Replace a crew's leaves, all or nothing: every context is built before the swap."""
        crew = self.crew_named(message.crew)
        if crew is None:
            return control.ControlReply(ok=False, error=f"unknown crew {message.crew!r}")
        try:
            contexts = load_leaves(
                (
                    (leaf.host, leaf.cert_pem.encode("ascii"), leaf.key_pem.encode("ascii"))
                    for leaf in message.leaves
                ),
                source=f"crew_leaves for {crew.name}",
            )
        except UnicodeEncodeError:
            return control.ControlReply(
                ok=False, error=f"crew_leaves for {crew.name}: PEM must be ASCII"
            )
        except LeafError as exc:
            return control.ControlReply(ok=False, error=str(exc))
        # Hosts only: a context has no equality, and a re-sent set re-minted for the same hosts
        # is a change worth reporting anyway (new leaves).
        changed = bool(contexts) or bool(crew.leaves)
        crew.leaves = contexts
        return control.ControlReply(ok=True, changed=changed)

    def set_crew_approvals(self, message: control.CrewApprovals) -> control.ControlReply:
        """Replace a crew's run-time grants and denials, all or nothing: every host is checked
        before the swap (one bad host changes nothing)."""
        crew = self.crew_named(message.crew)
        if crew is None:
            return control.ControlReply(ok=False, error=f"unknown crew {message.crew!r}")
        sets: list[dict[str, float]] = []
        for kind, entries in (("grants", message.grants), ("denied", message.denied)):
            if len(entries) > control.MAX_APPROVALS:
                return control.ControlReply(
                    ok=False,
                    error=f"crew_approvals for {crew.name}: over {control.MAX_APPROVALS} {kind}",
                )
            hosts: dict[str, float] = {}
            for entry in entries:
                try:
                    host = normalize_host(entry.host)
                    Allowlist([host])  # no IP shorthand: the policy refuses those in every mode
                except (PolicyDenied, ValueError):
                    return control.ControlReply(
                        ok=False,
                        error=f"crew_approvals for {crew.name}: {kind}: not a valid host: "
                        f"{entry.host!r}",
                    )
                if not math.isfinite(entry.until):
                    return control.ControlReply(
                        ok=False,
                        error=f"crew_approvals for {crew.name}: {kind}: {host}: bad time",
                    )
                hosts[host] = max(entry.until, hosts.get(host, entry.until))
            sets.append(hosts)
        grants, denied = sets
        policy = crew.policy
        changed = grants != policy.grants or denied != policy.denied
        policy.grants, policy.denied = grants, denied
        policy.changed()
        return control.ControlReply(ok=True, changed=changed)

    def crew_for(self, local_address: str) -> CrewState | None:
        return self.crews.get(local_address)

    def set_crew_net(self, message: control.CrewNet) -> control.ControlReply:
        """A crew's address rules replaced: its dialer check and its name policy together (the
        policy's memo cleared, its idle upstream connections closed), or nothing if a rule is
        refused. Open tunnels and exchanges keep going (the kernel's rules, which applianced
        changes in the same step, do not concern them: they leave from the proxy)."""
        crew = self.crew_named(message.crew)
        if crew is None:
            return control.ControlReply(ok=False, error=f"no crew {message.crew!r}")
        try:
            rules = NetRules(parse_net_rules(message.net))
        except ValueError as exc:
            return control.ControlReply(ok=False, error=f"crew_net: net{exc}")
        ranges = crew.guard.ranges if crew.guard is not None else None
        before = crew.policy.net
        crew.guard = CrewReach(ranges, rules) if ranges is not None or rules else None
        crew.policy.net = rules
        crew.policy.changed()
        changed = (before.allow, before.deny) != (rules.allow, rules.deny)
        if changed:
            # A pooled upstream connection was checked under the former rules and is reused
            # without a new check: the crew's idle ones go (those in use end with their
            # exchange), so that a new deny rule holds for the crew's next request.
            self.dialer.close_idle(crew.name)
            self.h2.forget_crew(crew.name)
        return control.ControlReply(ok=True, changed=changed)

    def crew_named(self, name: str) -> CrewState | None:
        return next((c for c in self.crews.values() if c.name == name), None)

    # -- credentials --------------------------------------------------------------------------

    def reload_credentials(self) -> bool:
        """Read every provider credential again (a rotation, a new key) and swap the routes and
        the scrubber together; on any error nothing changes. True if a credential changed."""
        routes_by_name, routes_by_host = load_routes(self.config)
        secrets = route_secrets(routes_by_name.values())
        changed = secrets != route_secrets(self.routes.by_name.values())
        self.scrubbers.replace(
            secrets + crew_secrets(self.routes.crew_credentials) + list(self.retired_secrets)
        )
        self.routes = Routes(routes_by_name, routes_by_host, self.routes.crew_credentials)
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
        old_secrets = crew_secrets(self.routes.crew_credentials)
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
                route_secrets(self.routes.by_name.values()) + new_secrets + list(retired)
            )
        except (ValueError, PatternError):
            # Not the exception's text: a pattern error may quote the secret it was built from.
            return control.ControlReply(
                ok=False, error="credentials_set: the scrubber cannot compile the new values"
            )
        self.routes = dataclasses.replace(self.routes, crew_credentials=crews)
        self.retired_secrets = retired
        return control.ControlReply(ok=True, changed=changed)

    # -- control messages ---------------------------------------------------------------------

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
        if isinstance(message, control.CrewNet):
            return self.set_crew_net(message)
        if isinstance(message, control.AuditPaused):
            changed = message.paused != self.audit_paused
            self.audit_paused = message.paused
            return control.ControlReply(ok=True, changed=changed)
        if isinstance(message, control.CrewLeaves):
            return self.set_crew_leaves(message)
        if isinstance(message, control.CrewApprovals):
            return self.set_crew_approvals(message)
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
        added = crew.policy.allow(host)
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


def crew_secrets(crews: Mapping[str, Mapping[Provider, Credential]]) -> list[tuple[str, bytes]]:
    """The store's credentials the proxy holds, named after their provider (for the scrubber)."""
    return sorted(
        {
            (provider.value, credential.reveal().encode())
            for by_provider in crews.values()
            for provider, credential in by_provider.items()
        }
    )
