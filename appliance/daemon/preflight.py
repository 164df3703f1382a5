"""What applianced checks before it starts, beyond the file itself: can this host run this
configuration?

Theory of operation
-------------------
config.py checks the text alone (types, ranges, names, the pool a private range), the same on
every host. These checks read the host as it is now, and report every problem at once (an
operator fixes them in one go), each naming the file, the key and the reason:

    credentials     every provider's credential_file exists, is readable and holds a credential;
                    every credential_env is set in applianced's environment (the workers read
                    them once, before they drop their privileges: a missing one would make each
                    worker exit at start, again and again)
    upstream        ca_file is a readable PEM bundle
    runtime         [crews] default_runtime is available in the engine (not only known)
    images          the configured images exist in the engine (applianced never pulls); unset,
                    the current recipe's images exist or the tools to build them are installed
    proxy port      nothing listens on the wildcard address at [daemon] proxy_port (every crew
                    gateway's listener would fail to bind)
    admin socket    no other applianced answers on it

applianced runs them after it has connected to the engine and before it takes the state lock
(a failure changes nothing), `applianced --check` and `appliancectl config check` run them and
stop. A problem exits 2 (a bad configuration: ansible/'s unit does not restart on it); an engine
that does not answer is not a configuration problem at start (exit 1, the unit retries).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import ssl
import stat
from pathlib import Path
from typing import Any

import msgspec

from appliance.runtime.base import RuntimeProvider
from proxycore.config import DEFAULT_BASE_URLS
from proxycore.errors import ConfigError
from proxycore.protocol.credentials import load_credential

from .config import ApplianceConfig

# Exit codes of `applianced --check`, `appliancectl config check`, and of applianced when a
# check fails at start (appliancectl's table: 2 is a bad configuration).
EXIT_CONFIG_OK = 0
EXIT_CONFIG_INVALID = 2

# What images.build needs to build the images, and the Debian package that brings each.
BUILD_TOOLS = {
    "debootstrap": "debootstrap",
    "unshare": "util-linux",
    "gcc": "gcc libc6-dev",
    "npm": "npm",
    "docker": "docker.io",
}

_KEYED = re.compile(r"`([^`]+)`: (.*)", re.DOTALL)


class Problem(msgspec.Struct, frozen=True):
    file: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: `{self.key}`: {self.reason}"


class Preflight(msgspec.Struct, frozen=True):
    file: str
    ok: bool
    problems: tuple[Problem, ...]
    # What was checked, and facts worth knowing that are not problems (a world-readable
    # credential file, images that will be built at start).
    checked: tuple[str, ...]
    notes: tuple[str, ...]


class _Collect:
    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[Problem] = []
        self.checked: list[str] = []
        self.notes: list[str] = []

    def problem(self, key: str, reason: str) -> None:
        self.problems.append(Problem(self.file, key, reason))


def run_preflight(
    config: ApplianceConfig,
    file: str,
    *,
    provider: RuntimeProvider | None,
    engine_error: str | None = None,
    starting: bool = False,
) -> Preflight:
    """Every check of this module. `provider` None: the engine did not answer (`engine_error`
    says why); the runtime and image checks are then a problem of `daemon.provider`.
    `starting`: applianced itself is about to start, so an applianced already answering on the
    admin socket is a problem even if it runs this very configuration."""
    found = _Collect(file)
    if os.geteuid() != 0:
        found.notes.append(
            f"not root: files were read as uid {os.geteuid()}; applianced reads them as root"
        )
    _credentials(config, found)
    _ca_file(config, found)
    _admin_tls(config, found)
    if provider is None:
        found.problem(
            "daemon.provider",
            f"{config.daemon.provider}: {engine_error or 'not available'}; start the engine "
            "(systemctl start docker, or scripts/install on a machine without an init system)",
        )
    else:
        _runtime(config, provider, found)
        _images(config, provider, found)
    _proxy_port(config, found)
    _admin_socket(config, found, starting=starting)
    return Preflight(
        file=file,
        ok=not found.problems,
        problems=tuple(found.problems),
        checked=tuple(found.checked),
        notes=tuple(found.notes),
    )


def _credentials(config: ApplianceConfig, found: _Collect) -> None:
    providers = config.proxy.providers
    for name in DEFAULT_BASE_URLS:
        provider = getattr(providers, name)
        if not (provider.credential_file or provider.credential_env):
            continue
        found.checked.append(f"the {name} credential")
        try:
            # The worker's own reader: what passes here is what a worker will load.
            load_credential(name, provider.credential_env, provider.credential_file)
        except ConfigError as exc:
            keyed = _KEYED.fullmatch(str(exc))
            key, why = (keyed[1], keyed[2]) if keyed else (f"providers.{name}", str(exc))
            if key.endswith("credential_file"):
                why += f" (write the {name} key to it, mode 0600)"
            elif key.endswith("credential_env"):
                why += " in applianced's environment (the unit's Environment= or EnvironmentFile=)"
            found.problem(f"proxy.{key}", why)
            continue
        if provider.credential_file:
            with contextlib.suppress(OSError):
                mode = os.stat(provider.credential_file).st_mode
                if mode & (stat.S_IRWXG | stat.S_IRWXO):
                    found.notes.append(
                        f"proxy.providers.{name}.credential_file: {provider.credential_file} is "
                        f"mode {stat.S_IMODE(mode):04o}, readable beyond its owner "
                        f"(chmod 600 {provider.credential_file})"
                    )


def _ca_file(config: ApplianceConfig, found: _Collect) -> None:
    path = config.proxy.upstream.ca_file
    if path is None:
        return
    found.checked.append("the upstream CA bundle")
    try:
        ssl.create_default_context(cafile=path)
    except ssl.SSLError as exc:  # an OSError too: first
        found.problem("proxy.upstream.ca_file", f"{path} is not a PEM CA bundle: {exc.reason}")
    except OSError as exc:
        found.problem("proxy.upstream.ca_file", f"cannot read {path}: {exc.strerror or exc}")


def _admin_tls(config: ApplianceConfig, found: _Collect) -> None:
    if not config.admin_tls.listen:
        return
    from .admin_tls import TlsSetupError, server_context

    found.checked.append("the admin TLS listener's certificate, key and client CA")
    try:
        server_context(config.admin_tls)
    except TlsSetupError as exc:
        found.problem(exc.key, exc.reason)


def _runtime(config: ApplianceConfig, provider: RuntimeProvider, found: _Collect) -> None:
    if not provider.isolated:
        return  # the subprocess provider has no runtimes (nothing to choose)
    runtime = config.crews.default_runtime
    found.checked.append(f"runtime {runtime}")
    try:
        status = _runtime_status(provider)
    except Exception as exc:  # the engine's answer; a provider's own error type
        found.problem("crews.default_runtime", f"cannot ask the engine for its runtimes: {exc}")
        return
    if status.get(runtime) == "available":
        return
    available = [name for name, state in status.items() if state == "available"]
    why = status.get(runtime, "not registered in the engine")
    hint = (
        "; install runsc and register it in /etc/docker/daemon.json (scripts/install, or "
        "ansible/ does both)"
        if runtime == "runsc"
        else ""
    )
    found.problem(
        "crews.default_runtime",
        f"{runtime!r} is not available: {why} (available: {', '.join(available) or 'none'})" + hint,
    )


def _runtime_status(provider: RuntimeProvider) -> dict[str, str]:
    status = getattr(provider, "runtime_status", None)
    if callable(status):
        answer: dict[str, str] = status()
        return answer
    return dict.fromkeys(provider.runtimes(), "available")


def image_state(client: Any, kind: str) -> tuple[str, str]:
    """(tag, state) of the current recipe's image of `kind` ("agent", "infra", "base"): "current",
    "missing", or "stale" (the tag exists with another recipe's label)."""
    import docker.errors

    from images.build import LABEL_RECIPE, Recipes, image_tag, recipe_hashes

    recipes = Recipes()
    wanted = recipe_hashes(recipes)[kind]  # type: ignore[index]
    tag = image_tag(kind, wanted, recipes.repository)  # type: ignore[arg-type]
    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return tag, "missing"
    return tag, "current" if (image.labels or {}).get(LABEL_RECIPE) == wanted else "stale"


def missing_build_tools() -> list[str]:
    """The tools images.build needs that are not installed, each with its Debian package."""
    return [
        f"{tool} (apt-get install {package})"
        for tool, package in BUILD_TOOLS.items()
        if shutil.which(tool) is None
    ]


def _images(config: ApplianceConfig, provider: RuntimeProvider, found: _Collect) -> None:
    client = getattr(provider, "client", None)
    if config.daemon.provider != "docker" or client is None:
        return
    import docker.errors

    for kind in ("agent", "infra"):
        named = getattr(config.images, kind)
        found.checked.append(f"the {kind} image")
        try:
            if named:
                try:
                    client.images.get(named)
                except docker.errors.ImageNotFound:
                    found.problem(
                        f"images.{kind}",
                        f"{named} is not in the engine, and applianced never pulls: build it "
                        "(make images) or name an image that exists (docker image ls)",
                    )
                continue
            tag, state = image_state(client, kind)
        except docker.errors.DockerException as exc:
            found.problem(f"images.{kind}", f"cannot ask the engine: {exc}")
            continue
        if state == "current":
            continue
        tools = missing_build_tools()
        if tools:
            found.problem(
                f"images.{kind}",
                f"unset, and {tag} is not built; applianced would build it at start but "
                f"needs {', '.join(tools)} (or: make images on a machine that has them)",
            )
        else:
            found.notes.append(
                f"images.{kind}: {tag} is {state}: applianced builds it at start (minutes; "
                "make images does it ahead)"
            )


def _proxy_port(config: ApplianceConfig, found: _Collect) -> None:
    port = config.daemon.proxy_port
    found.checked.append(f"port {port}")
    for address, inode in _wildcard_listeners(port):
        holder = _socket_holder(inode)
        found.problem(
            "daemon.proxy_port",
            f"{address}:{port} is taken{f' by {holder}' if holder else ''}: every crew "
            "gateway's listener would fail to bind; stop that listener or choose another port",
        )


def _wildcard_listeners(port: int) -> list[tuple[str, int]]:
    """TCP sockets in LISTEN on 0.0.0.0 or [::] at `port` (proc(5), /proc/net/tcp)."""
    found = []
    for table, wildcard, shown in (
        ("/proc/net/tcp", "00000000", "0.0.0.0"),
        ("/proc/net/tcp6", "0" * 32, "[::]"),
    ):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: TCP_LISTEN
                continue
            address, _, hex_port = fields[1].partition(":")
            if address == wildcard and int(hex_port, 16) == port:
                found.append((shown, int(fields[9])))
    return found


def _socket_holder(inode: int) -> str:
    """'pid N (comm)' of a process holding the socket with this inode, or ''."""
    target = f"socket:[{inode}]"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}") == target:
                        comm = Path(f"/proc/{entry}/comm").read_text().strip()
                        return f"pid {entry} ({comm})"
    return ""


def _admin_socket(config: ApplianceConfig, found: _Collect, *, starting: bool) -> None:
    path = config.daemon.admin_socket
    found.checked.append("the admin socket")
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            found.problem("daemon.admin_socket", f"{path} exists and is not a socket")
            return
    except OSError:
        return  # absent (or its directory): applianced creates it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(path)
        except OSError:
            return  # a stale socket file: applianced replaces it
    from .client import AdminClient, AdminError, Unreachable

    try:
        status = AdminClient(path, timeout=5).call("GET", "/v1/status")
    except (Unreachable, AdminError, ValueError) as exc:
        found.problem("daemon.admin_socket", f"something else answers on {path}: {exc}")
        return
    pid, state_dir = status.get("pid"), status.get("state_dir")
    if state_dir == config.daemon.state_dir and not starting:
        found.notes.append(f"applianced (pid {pid}) runs with this configuration's state now")
        return
    found.problem(
        "daemon.admin_socket",
        f"applianced pid {pid} (state {state_dir}) answers on {path}: stop it, or give this "
        "one another admin_socket",
    )
