"""applianced's configuration: one TOML file parsed into frozen msgspec Structs.

Unknown keys and bad values are errors naming the key (`ConfigInvalid`), as in
`proxycore/config.py`. Sections:

    [daemon]   state directory, admin socket, provider, proxy port, stop_crews_on_exit
    [images]   the agent and infra image tags (built locally, see images/)
    [crews]    bounds on what a crew may ask for (memory, cpus) and the default runtime
    [net]      netns.NetConfig (pool, table, interface prefix...); proxy_ports is set from
               [daemon] proxy_port, so the rules and the proxy can never disagree
    [credentials]  the credential store's file and key source (docs/credentials.md)
    [proxy]    what the proxy core takes from its own config file except crews, listeners and
               control (applianced supplies those): limits, providers, upstream, events, scrub,
               policy

No file at all means every default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import msgspec

from appliance.keeper.gatekeeper import GatekeeperConfig, GatekeeperConfigError
from appliance.runtime.base import AGENT_UID
from netns import NetConfig, NetnsError, check_instance_id, validate_config
from proxycore.config import (
    DEFAULT_PORT,
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

from .client import DEFAULT_ADMIN_SOCKET  # defined there: appliancectl imports only the client
from .errors import ConfigInvalid

DEFAULT_STATE_DIR = "/var/lib/agent-appliance"

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


class ApplianceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    daemon: DaemonSection = DaemonSection()
    images: ImagesSection = ImagesSection()
    crews: CrewsSection = CrewsSection()
    net: NetConfig = NetConfig()
    proxy: ProxySection = ProxySection()
    credentials: CredentialsSection = CredentialsSection()
    # The keeper's gatekeeper model (docs/keeper.md): model, url, timeout_seconds.
    keeper: GatekeeperConfig = GatekeeperConfig()

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
    if daemon.instance is not None:
        try:
            check_instance_id(daemon.instance)
        except NetnsError as exc:
            raise fail("daemon.instance", str(exc)) from None
    if not daemon.provider:
        raise fail("daemon.provider", "must be 'docker' or 'module:factory'")
    crews = config.crews
    if not 0 < crews.min_memory_bytes <= crews.default_memory_bytes <= crews.max_memory_bytes:
        raise fail(
            "crews", "needs 0 < min_memory_bytes <= default_memory_bytes <= max_memory_bytes"
        )
    if not 0 < crews.min_cpus <= crews.default_cpus <= config.max_cpus:
        raise fail("crews", "needs 0 < min_cpus <= default_cpus <= max_cpus")
    try:
        validate_config(config.net_config())
    except NetnsError as exc:
        raise fail("net", str(exc)) from None
    try:
        config.keeper.validate()
    except GatekeeperConfigError as exc:
        raise ConfigInvalid(f"{source}: {exc}") from None
    try:
        validate(config.proxy_config(), source=f"{source} [proxy]")
    except ConfigError as exc:
        raise ConfigInvalid(str(exc)) from None
    return config
