"""The proxy core's configuration: one TOML file parsed into frozen msgspec Structs.

Theory of operation: the TOML text is decoded by `msgspec.toml` straight into the Struct tree
below with `forbid_unknown_fields`, so a typo is an error that names the key (msgspec reports the
path, e.g. ``$.crew[0].mdoe``). Values that a type cannot express (a CIDR, a URL, a host name) are
checked afterwards by `validate`, which names the key the same way. Nothing here opens a socket or
reads a credential: credentials are loaded by `load_credentials`, and their values never appear in
an error message or a repr.

Everything is frozen: the running proxy swaps whole objects, it never mutates shared config.
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec

from native.scrub_patterns import token_shape
from proxycore.errors import ConfigError, PolicyDenied
from proxycore.protocol.l7 import MAX_RULES, HostRule, L7Rules, RuleError
from proxycore.protocol.netrules import MAX_NET_RULES, parse_net_rule
from proxycore.protocol.policy import (
    DEFAULT_ALLOWED_HOSTS,
    Allowlist,
    NetworkMode,
    normalize_host,
    parse_mode,
)
from proxycore.protocol.ssrf import AddressGuard

# Documented defaults, compared with other servers in docs/limits.md.
DEFAULT_PORT = 9119
MAX_BODY_BYTES = 10 * 1024 * 1024

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]


class ListenConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    port: Port = DEFAULT_PORT
    # Extra addresses to listen on besides every crew's gateway address.
    addresses: tuple[str, ...] = ()
    workers: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    backlog: PositiveInt = 1024


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_body_bytes: PositiveInt = MAX_BODY_BYTES
    max_request_line: PositiveInt = 8192
    max_header_count: PositiveInt = 100
    max_header_bytes: PositiveInt = 32768
    # Slowloris: a request head (or the next one on a kept-alive connection) must arrive whole
    # within this many seconds.
    head_timeout: PositiveFloat = 15.0
    # Any single read of a request body or an upstream response.
    read_timeout: PositiveFloat = 120.0
    idle_keepalive_timeout: PositiveFloat = 60.0
    connect_timeout: PositiveFloat = 10.0
    tunnel_idle_timeout: PositiveFloat = 300.0
    # WebSocket sessions (proxycore/protocol/wsrelay.py): a message over the size fails its
    # sender (1009); control frames (ping, pong) and empty fragments past the rate fail theirs
    # (1008); a session silent both ways for the idle timeout is closed (1001); a Close is
    # answered within the close timeout or the connection is dropped.
    ws_max_message_bytes: PositiveInt = 16 * 1024 * 1024
    ws_control_frames_per_second: PositiveInt = 100
    ws_idle_timeout: PositiveFloat = 300.0
    ws_close_timeout: PositiveFloat = 5.0
    max_connections: PositiveInt = 4096
    max_connections_per_crew: PositiveInt = 512
    # Upstream connections one crew may hold open at once: in use, pooled and tunnels (each
    # is a descriptor of the worker's). Over it: 503 once no idle one can be closed instead.
    upstream_connections_per_crew: PositiveInt = 512
    # Idle kept-alive upstream connections kept per crew (its pool, all hosts together), and
    # how long one may stay idle before it is closed (servers drop idle ones anyway: nginx
    # keepalive_timeout 75 s, many APIs less). Above one agent connection's HTTP/2 streams
    # (`h2_max_concurrent_streams`): each stream to an HTTP/1.1 upstream holds a connection, and
    # a pool smaller than a crew's requests in flight opens and closes one per request.
    upstream_idle_per_crew: PositiveInt = 128
    upstream_idle_timeout: PositiveFloat = 30.0
    # Name lookups one crew may have in flight: a crew whose lookups hang waits for its own
    # share, never for another crew's.
    dns_lookups_per_crew: PositiveInt = 8
    # Bytes the proxy may hold in memory for one crew's request and response bodies (bodies
    # read whole to be replayed or scrubbed in one call); past it, bodies stream instead.
    max_buffered_bytes_per_crew: PositiveInt = 32 * 1024 * 1024
    # While another crew is active on a worker, a crew's new requests and connections are paced
    # to these (per worker), so that no crew fills the worker's core (proxycore/protocol/
    # fairness.py). A crew alone on a worker is never paced. A request that would wait longer
    # than fair_max_wait for its turn is refused with 429.
    fair_requests_per_second: PositiveFloat = 1000.0
    fair_request_burst: PositiveInt = 100
    fair_connections_per_second: PositiveFloat = 50.0
    fair_connection_burst: PositiveInt = 50
    fair_max_wait: PositiveFloat = 2.0
    # HTTP/2 from the agent (docs/proxy.md "HTTP/2"): streams one connection may have open
    # (Envoy edge: 100), and how long a response may wait for the agent to open its flow-control
    # window before the stream is reset (a zero-window stall).
    h2_max_concurrent_streams: PositiveInt = 100
    h2_stall_timeout: PositiveFloat = 30.0
    # The worker's descriptor limit (RLIMIT_NOFILE); 0 raises the soft limit to the hard one.
    # Near it the worker answers new connections 503 rather than failing (see docs/proxy.md).
    open_files: Annotated[int, msgspec.Meta(ge=0)] = 0


class RuleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Methods and paths one crew may use on one host (proxycore/protocol/l7.py)."""

    host: str
    # HTTP methods, exact (case-sensitive); with `preset` they add up. Neither: any method.
    methods: tuple[str, ...] = ()
    preset: str | None = None  # "read-only": GET, HEAD, OPTIONS
    # Path patterns: "/exact", "*" within a segment, "**" as a whole segment. None: any path.
    paths: tuple[str, ...] = ()


class LeafConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A certificate and key (PEM files) the proxy presents to the crew as `host`, to terminate
    the crew's CONNECT tunnels to it (docs/proxy.md "TLS termination"): a leaf signed by the
    crew's own CA (appliance/crew_ca.py), never the CA itself."""

    host: str
    cert_file: str
    key_file: str


# Leaves one crew may hold (each is an SSL context in every worker): the hosts with a credential
# binding or method and path rules, far fewer in practice. appliance/crew_ca.py caches as many.
MAX_LEAVES = 1024


class CrewConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    # The gateway address the crew's traffic arrives on: the crew identity (it cannot be forged
    # from inside the crew's network namespace).
    gateway: str
    mode: str | None = None
    allow: tuple[str, ...] = ()
    # Destination ranges this crew alone may reach although the SSRF guard refuses them,
    # including the appliance's own addresses (the host's, loopback, the crews' pool), which
    # `[upstream] ssrf_allow` never opens. For a service on the host meant for this crew.
    ssrf_allow: tuple[str, ...] = ()
    # Method and path rules for some of its hosts: requests to such a host are allowed only
    # when a rule allows them, and a CONNECT tunnel to it is refused (docs/proxy.md) unless
    # the crew holds a leaf for it (then the tunnel is terminated and its requests held to them).
    rules: tuple[RuleConfig, ...] = ()
    # Address rules, "allow:tcp:10.9.0.0/24:5432" (proxycore/protocol/netrules.py): a resolved
    # address in a deny rule is refused whatever else allows it; one in a TCP allow rule passes
    # the SSRF guard for this crew (and, as an IP literal, the allowlist).
    net: tuple[str, ...] = ()
    # Hosts whose CONNECT tunnels are terminated (docs/proxy.md "TLS termination"); more may
    # arrive at run time (control.CrewLeaves), which replaces these.
    leaves: tuple[LeafConfig, ...] = ()


class ProviderConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    base_url: str | None = None
    # Exactly one credential source, or none (then nothing is injected for that provider).
    credential_env: str | None = None
    credential_file: str | None = None


class ProvidersConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    anthropic: ProviderConfig = ProviderConfig()
    openai: ProviderConfig = ProviderConfig()
    google: ProviderConfig = ProviderConfig()


class UpstreamConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Extra CA bundle trusted for upstream TLS, on top of the system store (tests use a test CA).
    ca_file: str | None = None
    # Replace the system store entirely with ca_file.
    ca_file_only: bool = False
    # Operator-approved destination ranges that the SSRF guard would otherwise refuse.
    ssrf_allow: tuple[str, ...] = ()
    # Split-horizon DNS: host name -> address, consulted before the nameservers.
    resolve: dict[str, str] = {}
    # The proxy's resolvers ("ADDRESS" or "ADDRESS:PORT"); empty: those of /etc/resolv.conf,
    # read when a worker starts. The hosts file is not read (use `resolve`).
    nameservers: tuple[str, ...] = ()
    dns_timeout: PositiveFloat = 5.0
    # The appliance's own address ranges (applianced puts its crews' pool here): refused as
    # destinations even when `ssrf_allow` covers them, so no crew reaches another crew.
    appliance_ranges: tuple[str, ...] = ()
    # HTTP/2 upstream (docs/proxy.md "HTTP/2 to upstreams"): TLS upstreams are offered ALPN
    # ["h2", "http/1.1"] (false: "http/1.1" only). Cleartext upstreams speak HTTP/1.1 unless
    # listed in `h2c` ("host" or "host:port"), which are reached with HTTP/2 prior knowledge;
    # a gRPC request (content-type application/grpc...) to a cleartext upstream always is.
    h2: bool = True
    h2c: tuple[str, ...] = ()


class EventsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # JSON-lines file; "-" is standard error; None disables the sink.
    path: str | None = None
    flush_interval: PositiveFloat = 0.2
    max_batch: PositiveInt = 1024
    max_pending: PositiveInt = 100_000


class ControlConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # A Unix socket (mode 0600) on which the control plane sends typed messages, e.g. to add an
    # allowlist entry at run time. Never reachable from a crew.
    socket: str | None = None


class ScrubShapeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A secret shape of the operator's: `prefix` then `min..max` bytes of the class `chars`
    (`A-Za-z0-9_-` style), not glued to a preceding token character."""

    name: str
    prefix: str
    chars: str = "A-Za-z0-9_-"
    min: int = 16
    max: int = 256


class ScrubConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Added to the built-in shapes (native/scrub_patterns.py). The credentials the proxy holds
    # are always scrubbed; there is no switch to turn scrubbing off.
    shapes: tuple[ScrubShapeConfig, ...] = ()


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Hosts every crew in restricted mode may reach besides its own `allow` (exact names, as
    # `allow`). The shipped default is the source design's list, each host's reason beside it in
    # proxycore/protocol/policy.py DEFAULT_ALLOWED_HOSTS; [] for none. The configured providers'
    # hosts are added to every crew whatever this says (docs/proxy.md, "The default allowlist").
    default_allow: tuple[str, ...] = DEFAULT_ALLOWED_HOSTS


class ApprovalsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Run-time approvals (docs/proxy.md "Approvals"): applianced files a pending approval
    request for every host a restricted crew is refused as not on its allowlist, and writes
    this section for its workers. The proxy only says so in its refusal (how long the request
    stays pending, and what the operator runs); it never lets anything through for it. Off for
    a proxy on its own: nobody would answer the request."""

    enabled: bool = False
    # Seconds a pending request lives after the last refusal that filed or refreshed it.
    window: PositiveFloat = 900.0


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    crew: tuple[CrewConfig, ...] = ()
    listen: ListenConfig = ListenConfig()
    limits: LimitsConfig = LimitsConfig()
    providers: ProvidersConfig = ProvidersConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    events: EventsConfig = EventsConfig()
    control: ControlConfig = ControlConfig()
    scrub: ScrubConfig = ScrubConfig()
    policy: PolicyConfig = PolicyConfig()
    approvals: ApprovalsConfig = ApprovalsConfig()


DEFAULT_BASE_URLS = {
    "anthropic": "https://api.anthropic.com",
    "openai": "https://api.openai.com",
    "google": "https://generativelanguage.googleapis.com",
}


def parse_config(text: str | bytes, *, source: str = "<config>") -> ProxyConfig:
    """Decode and validate TOML text; every error is a ConfigError naming the key."""
    try:
        config = msgspec.toml.decode(text, type=ProxyConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec.toml decodes bytes itself; TOML is UTF-8
        raise ConfigError(f"{source}: not UTF-8 (byte {exc.start}): TOML is UTF-8") from None
    validate(config, source=source)
    return config


def load_config(path: str | os.PathLike[str]) -> ProxyConfig:
    """A TOML file, or the JSON that applianced writes for its workers (`.json`: the same Struct
    tree, the same checks)."""
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    if not str(path).endswith(".json"):
        return parse_config(text, source=str(path))
    try:
        config = msgspec.json.decode(text, type=ProxyConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    validate(config, source=str(path))
    return config


def validate(config: ProxyConfig, *, source: str) -> list[str]:
    """Check what types cannot; returns warnings (e.g. unknown network mode -> restricted)."""
    warnings: list[str] = []

    def fail(key: str, why: str) -> ConfigError:
        return ConfigError(f"{source}: `{key}`: {why}")

    seen_names: set[str] = set()
    seen_gateways: set[str] = set()
    for index, crew in enumerate(config.crew):
        key = f"crew[{index}]"
        if not crew.name or len(crew.name) > 63 or not crew.name.replace("-", "").isalnum():
            raise fail(f"{key}.name", "must be 1-63 letters, digits or '-'")
        if crew.name in seen_names:
            raise fail(f"{key}.name", f"duplicate crew name {crew.name!r}")
        seen_names.add(crew.name)
        try:
            gateway = str(ipaddress.ip_address(crew.gateway))
        except ValueError:
            raise fail(f"{key}.gateway", f"not an IP address: {crew.gateway!r}") from None
        if gateway in seen_gateways:
            raise fail(f"{key}.gateway", f"gateway {gateway} is used by two crews")
        seen_gateways.add(gateway)
        _, warning = parse_mode(crew.mode)
        if warning:
            warnings.append(f"{source}: `{key}.mode`: {warning}")
        for j, host in enumerate(crew.allow):
            try:
                Allowlist([host])
            except Exception:
                raise fail(f"{key}.allow[{j}]", f"not a valid host name: {host!r}") from None
        try:
            AddressGuard(crew.ssrf_allow)
        except ValueError as exc:
            raise fail(f"{key}.ssrf_allow", str(exc)) from None
        for j, text in enumerate(crew.net):
            try:
                parse_net_rule(text)
            except ValueError as exc:
                raise fail(f"{key}.net[{j}]", str(exc)) from None
        if len(crew.net) > MAX_NET_RULES:
            raise fail(f"{key}.net", f"over {MAX_NET_RULES} rules")
        for j, rule in enumerate(crew.rules):
            try:
                host_rule(rule)
            except RuleError as exc:
                raise fail(f"{key}.rules[{j}]", str(exc)) from None
        if len(crew.rules) > MAX_RULES:
            raise fail(f"{key}.rules", f"over {MAX_RULES} rules")
        if len(crew.leaves) > MAX_LEAVES:
            raise fail(f"{key}.leaves", f"over {MAX_LEAVES} leaves")
        leaf_hosts: set[str] = set()
        for j, leaf in enumerate(crew.leaves):
            try:
                host = normalize_host(leaf.host)
            except PolicyDenied:
                raise fail(f"{key}.leaves[{j}].host", f"not a valid host: {leaf.host!r}") from None
            if host in leaf_hosts:
                raise fail(f"{key}.leaves[{j}].host", f"a second leaf for {host}")
            leaf_hosts.add(host)
    for j, host in enumerate(config.policy.default_allow):
        try:
            Allowlist([host])
        except Exception:
            raise fail(f"policy.default_allow[{j}]", f"not a valid host name: {host!r}") from None
    for index, address in enumerate(config.listen.addresses):
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise fail(f"listen.addresses[{index}]", f"not an IP address: {address!r}") from None
    for name in DEFAULT_BASE_URLS:
        provider: ProviderConfig = getattr(config.providers, name)
        if provider.base_url is not None:
            _check_base_url(provider.base_url, f"providers.{name}.base_url", fail)
        if provider.credential_env and provider.credential_file:
            raise fail(f"providers.{name}", "set credential_env or credential_file, not both")
    try:
        AddressGuard(config.upstream.ssrf_allow)
    except ValueError as exc:
        raise fail("upstream.ssrf_allow", str(exc)) from None
    for host, address in config.upstream.resolve.items():
        try:
            normalize_host(host)
            ipaddress.ip_address(address)
        except Exception:
            raise fail(
                f"upstream.resolve.{host}", f"needs a host name and an IP address, got {address!r}"
            ) from None
    for index, server in enumerate(config.upstream.nameservers):
        try:
            parse_nameserver(server)
        except ValueError as exc:
            raise fail(f"upstream.nameservers[{index}]", str(exc)) from None
    for index, text in enumerate(config.upstream.appliance_ranges):
        try:
            ipaddress.ip_network(text, strict=True)
        except ValueError as exc:
            raise fail(f"upstream.appliance_ranges[{index}]", str(exc)) from None
    if config.upstream.ca_file_only and not config.upstream.ca_file:
        raise fail("upstream.ca_file_only", "needs upstream.ca_file")
    for index, shape in enumerate(config.scrub.shapes):
        try:
            token_shape(shape.name, shape.prefix.encode("utf-8"), shape.chars, shape.min, shape.max)
        except ValueError as exc:  # PatternError, naming what is wrong with the shape
            raise fail(f"scrub.shapes[{index}]", str(exc)) from None
        if len(shape.prefix.encode("utf-8")) < 3 or not 1 <= shape.min <= shape.max <= 4096:
            raise fail(
                f"scrub.shapes[{index}]", "needs a prefix of >= 3 bytes and 1 <= min <= max <= 4096"
            )
    return warnings


def _check_base_url(url: str, key: str, fail: Callable[[str, str], ConfigError]) -> None:
    parsed = urllib.parse.urlsplit(url)
    # Credentials only ever travel over verified TLS, so a provider base URL must be https.
    if parsed.scheme != "https":
        raise fail(key, f"must be an https:// URL, got {url!r}")
    if not parsed.hostname or parsed.query or parsed.fragment or parsed.username:
        raise fail(key, f"must be https://host[:port][/path], got {url!r}")
    try:
        normalize_host(parsed.hostname)
        _ = parsed.port
    except Exception:
        raise fail(key, f"bad host or port in {url!r}") from None


def parse_nameserver(text: str) -> tuple[str, int]:
    """ "ADDRESS", "ADDRESS:PORT" or "[V6]:PORT"; ValueError naming what is wrong."""
    address, port_text = text, "53"
    if text.startswith("["):
        address, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"not ADDRESS[:PORT]: {text!r}")
            port_text = rest[1:]
    elif text.count(":") == 1:
        address, _, port_text = text.partition(":")
    ipaddress.ip_address(address)  # ValueError names the text
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"bad port in {text!r}")
    return address, int(port_text)


def crew_policy(crew: CrewConfig, policy: PolicyConfig) -> tuple[NetworkMode, Allowlist]:
    """The crew's mode and its allowlist: `[policy] default_allow`, then the crew's own. The
    proxy adds the configured provider hosts (`provider_hosts`) on top."""
    mode, _ = parse_mode(crew.mode)
    return mode, Allowlist([*policy.default_allow, *crew.allow])


def host_rule(rule: RuleConfig) -> HostRule:
    """One configured rule, checked (`RuleError` names what is wrong), its host normalized as
    the name policy normalizes the hosts it compares."""
    try:
        host = normalize_host(rule.host)
    except PolicyDenied:
        raise RuleError(f"host {rule.host!r}: not a valid host name") from None
    return HostRule.make(host, methods=rule.methods, preset=rule.preset, paths=rule.paths)


def crew_rules(crew: CrewConfig) -> L7Rules:
    """The crew's method and path rules (validated already: `validate`)."""
    return L7Rules(host_rule(rule) for rule in crew.rules)


def provider_hosts(config: ProxyConfig) -> tuple[str, ...]:
    """The host of every provider's base URL (configured, or the default): the reverse routes
    lead there, and the name policy checks them like any other host, so every crew's allowlist
    holds them (the proxy's routes are built from the same URLs: protocol/credentials.py)."""
    hosts: list[str] = []
    for name, default_url in DEFAULT_BASE_URLS.items():
        provider: ProviderConfig = getattr(config.providers, name)
        hostname = urllib.parse.urlsplit(provider.base_url or default_url).hostname
        assert hostname is not None  # checked by validate
        hosts.append(hostname.lower())
    return tuple(hosts)


# Where an entry of a crew's effective allowlist comes from (`allowlist_sources`).
SOURCE_CREW, SOURCE_DEFAULT, SOURCE_PROVIDER = "crew", "default", "provider"


def allowlist_sources(
    config: ProxyConfig, crew_allow: tuple[str, ...]
) -> list[tuple[str, tuple[str, ...]]]:
    """A restricted crew's effective allowlist as the proxy holds it, each normalized host with
    where it comes from (crew, default, provider; a host may come from several): the crew's own
    hosts first, then `[policy] default_allow`, then the provider hosts, each in its order."""
    sources: dict[str, list[str]] = {}
    for source, hosts in (
        (SOURCE_CREW, crew_allow),
        (SOURCE_DEFAULT, config.policy.default_allow),
        (SOURCE_PROVIDER, provider_hosts(config)),
    ):
        for host in hosts:
            entry = sources.setdefault(normalize_host(host), [])
            if source not in entry:
                entry.append(source)
    return [(host, tuple(where)) for host, where in sources.items()]
