"""applianced's configuration: one TOML file parsed into frozen msgspec Structs.

Unknown keys and bad values are errors naming the key (`ConfigInvalid`), as in
`proxycore/config.py`. Sections:

    [daemon]   state directory, admin socket, provider, proxy port, stop_crews_on_exit
    [images]   the agent and infra image tags (built locally, see images/)
    [crews]    bounds on what a crew may ask for (memory, cpus) and the default runtime
    [net]      netns.NetConfig (pool, table, interface prefix...); proxy_ports is set from
               [daemon] proxy_port, so the rules and the proxy can never disagree
    [credentials]  the credential store's file and key source (docs/credentials.md)
    [metrics]  the Prometheus metrics' optional TCP listener (they are always on the admin
               socket)
    [admin_tls]  the admin API's optional TCP listener, mutual TLS (off by default)
    [approvals]  run-time approvals of refused hosts (window, bounds; docs/cli.md)
    [proxy]    what the proxy core takes from its own config file except crews, listeners and
               control (applianced supplies those): limits, providers, upstream, events, scrub,
               policy

No file at all means every default.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from appliance.keeper.gatekeeper import GatekeeperConfig, GatekeeperConfigError
from appliance.runtime.base import AGENT_UID, KNOWN_RUNTIMES
from netns import NetConfig, NetnsError, check_instance_id, validate_config
from proxycore.config import (
    DEFAULT_PORT,
    ApprovalsConfig,
    EventsConfig,
    LimitsConfig,
    PolicyConfig,
    ProvidersConfig,
    ProxyConfig,
    ScrubConfig,
    UpstreamConfig,
    validate,
)
from proxycore.errors import ConfigError

from .errors import ConfigInvalid

# appliancectl has its own copy (appliance/ctl/http.py: the run fast path imports no config);
# tests/test_ctl_layout.py holds the two equal.
DEFAULT_ADMIN_SOCKET = "/run/agent-appliance/admin.sock"
DEFAULT_STATE_DIR = "/var/lib/agent-appliance"
# The file applianced and appliancectl read when no --config is given (ansible/ writes it).
DEFAULT_CONFIG_FILE = "/etc/agent-appliance/appliance.toml"

# A crew name is 1-63 letters, digits or '-' starting with a letter or digit (crews.py); the
# prefix must start every name, so it is such a name's beginning, and leaves room for a name.
NAME_PREFIX_MAX = 40
_NAME_PREFIX = re.compile(rf"[A-Za-z0-9][A-Za-z0-9-]{{0,{NAME_PREFIX_MAX - 1}}}")
# The crews' addresses: never routed on the internet, so that a crew's address can neither be
# mistaken for nor shadow a public host the proxy dials. RFC 1918 private space and RFC 6598
# shared address space (the default pool is in the latter).
PRIVATE_POOLS = tuple(
    ipaddress.IPv4Network(net)
    for net in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
)
_NETNS_KEY = re.compile(r"network config: `([a-z_]+)`: (.*)", re.DOTALL)

MIB = 1024 * 1024

Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class DaemonSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    state_dir: str = DEFAULT_STATE_DIR
    admin_socket: str = DEFAULT_ADMIN_SOCKET
    # "docker", or "package.module:factory" (a callable taking the ApplianceConfig and returning
    # a RuntimeProvider): development and the tests' own providers.
    provider: str = "docker"
    proxy_port: Port = DEFAULT_PORT
    # On SIGTERM: False leaves the crews running (the next start adopts them), True stops them
    # (containers removed, networks detached, rows kept as "stopped"; the next start re-creates
    # them).
    stop_crews_on_exit: bool = False
    # Runtime files that the proxy workers must reach (the keeper's socket), each applianced in
    # a directory of its own below this one; appliance/daemon/main.py keeper_dir.
    run_dir: str = "/run/agent-appliance-keeper"
    # Standard error, one line per record (docs/observability.md): "text" for people, "json"
    # (one object per line) for a log shipper; records from `log_level` up. The proxy workers'
    # records come out the same way. `appliancectl up --log-format/--log-level` override both.
    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # This appliance's instance id (1-16 of a-z, 0-9, inner '-'): everything it makes on the host
    # carries it, and it touches nothing that does not (appliance/daemon/instance.py). None: the
    # id recorded in the state, or at the first start one derived from the state directory.
    instance: str | None = None


class ImagesSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # None: ask images.build.ensure_images() at start (the Docker provider only).
    agent: str | None = None
    infra: str | None = None


class CrewsSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Every crew name must start with this. Containers of crews whose names do not are not this
    # applianced's (it never adopts or removes them): two instances on one host (a test
    # instance beside a real one) partition the names, as netns's table and interface prefix
    # partition the kernel objects.
    name_prefix: str = ""
    default_runtime: str = "runc"
    default_memory_bytes: int = 512 * MIB
    min_memory_bytes: int = 64 * MIB
    max_memory_bytes: int = 16 * 1024 * MIB
    default_cpus: float = 1.0
    min_cpus: float = 0.1
    # 0: the number of CPUs of the host.
    max_cpus: float = 0.0
    # Pre-plumbed infra namespaces kept ready (infra container running, network attached and
    # its rules in place, no agent ever): `crew create` takes one instead of creating both.
    # 0 disables the pool. docs/daemon.md, "The infra pool".
    infra_pool: Annotated[int, msgspec.Meta(ge=0, le=64)] = 2


class CredentialsSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # None: <state_dir>/credentials.db and <state_dir>/credentials.key (created at first start).
    db: str | None = None
    key_file: str | None = None
    # The environment variable that holds the key (32 bytes, hex or base64); when it is set it
    # is used instead of the key file (and removed from the environment once read). "": never.
    key_env: str = "ENCRYPTION_KEY"


class ProxySection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Worker processes sharing the crews' traffic; 0: one per CPU of the host.
    workers: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    # The workers drop to this UID and GID (no capabilities, no_new_privs) once started; they
    # need no account, and must not share their ids with anything else on the host.
    uid: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 2)] = 1002
    gid: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 2)] = 1002
    limits: LimitsConfig = LimitsConfig()
    providers: ProvidersConfig = ProvidersConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    # Under applianced a worker's events go to the journal over its events channel every 50 ms
    # (what an applianced crash can lose, docs/journal.md); `path` must stay unset.
    events: EventsConfig = EventsConfig(flush_interval=0.05)
    scrub: ScrubConfig = ScrubConfig()
    # `default_allow`: hosts every restricted crew may reach besides its own (docs/proxy.md,
    # "The default allowlist"; `appliancectl crew show` lists each crew's effective allowlist).
    policy: PolicyConfig = PolicyConfig()


class MetricsSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Prometheus metrics are always served on the admin socket (GET /metrics); Prometheus
    # cannot scrape a Unix socket, so "ADDRESS:PORT" (e.g. "127.0.0.1:9464", "[::1]:9464") also
    # serves them over TCP, GET /metrics only. "" (the default): no TCP listener. The metrics
    # name crews and counts their traffic, no credential: keep the address on loopback or a
    # monitoring network (docs/observability.md).
    listen: str = ""


class AdminTlsSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # The admin API over TCP with mutual TLS, for `appliancectl --context` from another machine
    # (docs/hosts.md). "" (the default): no such listener, the admin socket alone. Otherwise
    # "ADDRESS:PORT" (an IP address: nothing is resolved at start), TLS 1.3 only (RFC 8446),
    # and every client must present a certificate that `client_ca_file` signed: whoever holds
    # one is an administrator of this appliance, as root on the admin socket is.
    listen: str = ""
    cert_file: str = ""  # the daemon's certificate chain (PEM), leaf first
    key_file: str = ""  # its private key (PEM); keep it 0600 root
    client_ca_file: str = ""  # the CA(s) whose client certificates are admitted (PEM)


class JournalSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Retention (docs/journal.md, "Retention"): entries older than keep_days, and the oldest
    # entries while journal.db is over keep_bytes, are removed behind a signed checkpoint every
    # prune_interval seconds; 0: no limit of that kind (the default: nothing is ever removed).
    keep_days: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    keep_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    prune_interval: Annotated[float, msgspec.Meta(ge=1)] = 3600.0
    # The Ed25519 key that signs checkpoints, exports and backups. None:
    # <state_dir>/journal.key (created 0600 at first start).
    key_file: str | None = None
    # Public keys (64 hex digits) of retired journal keys, still trusted for what they signed
    # (docs/operations.md, "Rotating the journal key").
    trusted_keys: tuple[str, ...] = ()


class ApprovalsSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Run-time approvals (docs/cli.md "approvals"): a host a restricted crew is refused as not
    # on its allowlist becomes a pending request the operator answers with `appliancectl
    # approvals allow|deny`; nothing is let through until then. false: plain refusals only.
    enabled: bool = True
    # Seconds a pending request lives after its last refusal; also how long a denial lasts.
    window: Annotated[float, msgspec.Meta(ge=1, le=7 * 86400)] = 900.0
    # `approvals allow --once`: how long without --for, and the longest --for.
    once: Annotated[float, msgspec.Meta(ge=1, le=7 * 86400)] = 600.0
    max_once: Annotated[float, msgspec.Meta(ge=1, le=30 * 86400)] = 86400.0
    # Pending requests kept per crew and in all (past either, the least recently refused one is
    # dropped, and logged): a crew that tries a thousand hosts cannot grow applianced.
    per_crew: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 32
    total: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 1024


class ApplianceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    daemon: DaemonSection = DaemonSection()
    images: ImagesSection = ImagesSection()
    crews: CrewsSection = CrewsSection()
    net: NetConfig = NetConfig()
    proxy: ProxySection = ProxySection()
    credentials: CredentialsSection = CredentialsSection()
    # The keeper's gatekeeper model (docs/keeper.md): model, url, timeout_seconds.
    keeper: GatekeeperConfig = GatekeeperConfig()
    metrics: MetricsSection = MetricsSection()
    journal: JournalSection = JournalSection()
    admin_tls: AdminTlsSection = AdminTlsSection()
    approvals: ApprovalsSection = ApprovalsSection()

    @property
    def max_cpus(self) -> float:
        return self.crews.max_cpus or float(os.cpu_count() or 1)

    @property
    def proxy_workers(self) -> int:
        return self.proxy.workers or os.cpu_count() or 1

    def net_config(self) -> NetConfig:
        return msgspec.structs.replace(self.net, proxy_ports=(self.daemon.proxy_port,))

    def proxy_config(self) -> ProxyConfig:
        """The proxy child's configuration: no crews and no listeners of its own (crews and
        their listening sockets arrive over the control channel)."""
        section = self.proxy
        # The crews' address pool is the appliance's own: no crew dials another crew or a
        # gateway, whatever `ssrf_allow` says (proxycore/io/upstream.py).
        upstream = msgspec.structs.replace(
            section.upstream,
            appliance_ranges=tuple(
                dict.fromkeys((*section.upstream.appliance_ranges, self.net.pool))
            ),
        )
        return ProxyConfig(
            limits=section.limits,
            providers=section.providers,
            upstream=upstream,
            events=section.events,
            scrub=section.scrub,
            policy=section.policy,
            approvals=ApprovalsConfig(enabled=self.approvals.enabled, window=self.approvals.window),
        )


def parse_config(text: str | bytes, *, source: str = "<config>") -> ApplianceConfig:
    try:
        config = msgspec.toml.decode(text, type=ApplianceConfig)
    except msgspec.ValidationError as exc:
        raise ConfigInvalid(f"{source}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigInvalid(f"{source}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec decodes bytes itself (fuzz/fuzz_daemon_inputs)
        raise ConfigInvalid(f"{source}: not UTF-8 (byte {exc.start}): TOML is UTF-8") from None
    return check_config(config, source=source)


def config_file(path: str | os.PathLike[str] | None) -> str | None:
    """The file to read: the one named, else DEFAULT_CONFIG_FILE if it exists, else None (every
    default)."""
    if path is not None:
        return os.fspath(path)
    return DEFAULT_CONFIG_FILE if os.path.exists(DEFAULT_CONFIG_FILE) else None


def load_config(path: str | os.PathLike[str] | None) -> ApplianceConfig:
    if path is None:
        return check_config(ApplianceConfig(), source="<defaults>")
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigInvalid(f"cannot read config {path}: {exc.strerror}") from None
    return parse_config(text, source=str(path))


def check_config(config: ApplianceConfig, *, source: str) -> ApplianceConfig:
    def fail(key: str, why: str) -> ConfigInvalid:
        return ConfigInvalid(f"{source}: `{key}`: {why}")

    daemon = config.daemon
    for key in ("state_dir", "admin_socket", "run_dir"):
        if not os.path.isabs(getattr(daemon, key)):
            raise fail(f"daemon.{key}", "must be an absolute path")
    for key in ("db", "key_file"):
        value = getattr(config.credentials, key)
        if value is not None and not os.path.isabs(value):
            raise fail(f"credentials.{key}", "must be an absolute path")
    if config.journal.key_file is not None and not os.path.isabs(config.journal.key_file):
        raise fail("journal.key_file", "must be an absolute path")
    for key in config.journal.trusted_keys:
        # (the form appliance.journal.signing.parse_public_key takes; checked here without
        # importing the crypto library into every appliancectl command)
        digits = key.strip().lower().removeprefix("ed25519:")
        if len(digits) != 64 or digits.strip("0123456789abcdef"):
            raise fail("journal.trusted_keys", f"{key!r} is not a public key (64 hex digits)")
    if config.approvals.once > config.approvals.max_once:
        raise fail("approvals.once", "must not exceed approvals.max_once")
    if AGENT_UID in (config.proxy.uid, config.proxy.gid):
        raise fail(
            "proxy.uid",
            f"the proxy workers' uid and gid must differ from the agents' ({AGENT_UID}): a crew "
            "process would otherwise share the workers' identity",
        )
    if config.proxy.events.path is not None:
        raise fail(
            "proxy.events.path",
            "applianced journals the proxy's events itself (each worker sends them over its "
            "events channel); remove the key",
        )
    if config.metrics.listen:
        try:
            metrics_address(config.metrics.listen)
        except ValueError as exc:
            raise fail("metrics.listen", str(exc)) from None
    tls = config.admin_tls
    if tls.listen:
        try:
            metrics_address(tls.listen)
        except ValueError as exc:
            raise fail("admin_tls.listen", str(exc)) from None
        for key in ("cert_file", "key_file", "client_ca_file"):
            if not getattr(tls, key):
                raise fail(f"admin_tls.{key}", "required with admin_tls.listen")
            if not os.path.isabs(getattr(tls, key)):
                raise fail(f"admin_tls.{key}", "must be an absolute path")
    if daemon.instance is not None:
        try:
            check_instance_id(daemon.instance)
        except NetnsError as exc:
            raise fail("daemon.instance", str(exc)) from None
    if not daemon.provider:
        raise fail("daemon.provider", "must be 'docker' or 'module:factory'")
    crews = config.crews
    if crews.name_prefix and not _NAME_PREFIX.fullmatch(crews.name_prefix):
        raise fail(
            "crews.name_prefix",
            f"{crews.name_prefix!r} must be empty or 1-{NAME_PREFIX_MAX} letters, digits or '-', "
            "starting with a letter or digit (every crew name starts with it)",
        )
    if crews.default_runtime not in KNOWN_RUNTIMES:
        raise fail(
            "crews.default_runtime",
            f"{crews.default_runtime!r} is not a runtime the appliance knows "
            f"({', '.join(KNOWN_RUNTIMES)})",
        )
    if not 0 < crews.min_memory_bytes <= crews.default_memory_bytes <= crews.max_memory_bytes:
        raise fail(
            "crews", "needs 0 < min_memory_bytes <= default_memory_bytes <= max_memory_bytes"
        )
    if not 0 < crews.min_cpus <= crews.default_cpus <= config.max_cpus:
        raise fail("crews", "needs 0 < min_cpus <= default_cpus <= max_cpus")
    try:
        validate_config(config.net_config())
    except NetnsError as exc:
        named = _NETNS_KEY.fullmatch(str(exc))
        raise (fail(f"net.{named[1]}", named[2]) if named else fail("net", str(exc))) from None
    pool = ipaddress.IPv4Network(config.net.pool)  # validate_config: an IPv4 network
    if not any(pool.subnet_of(private) for private in PRIVATE_POOLS):
        raise fail(
            "net.pool",
            f"{pool} is not a private range: the crews' pool must lie in "
            + ", ".join(map(str, PRIVATE_POOLS[:3]))
            + f" (RFC 1918) or {PRIVATE_POOLS[3]} (RFC 6598)",
        )
    try:
        config.keeper.validate()
    except GatekeeperConfigError as exc:
        raise ConfigInvalid(f"{source}: {exc}") from None
    try:
        validate(config.proxy_config(), source=f"{source} [proxy]")
    except ConfigError as exc:
        raise ConfigInvalid(str(exc)) from None
    return config


def metrics_address(text: str) -> tuple[str, int]:
    """("127.0.0.1", 9464) from "127.0.0.1:9464", ("::1", 9464) from "[::1]:9464"; an IP
    address, not a name (nothing is resolved at start). ValueError says what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not ADDRESS:PORT (a port from 1 to 65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{text!r}: {host!r} is not an IP address") from None
    return host, int(port)
