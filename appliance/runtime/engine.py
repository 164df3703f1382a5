"""Finding the container engine, and (for development, CI and tests only) starting one.

Theory of operation
-------------------
`detect_engine` returns a connected `docker.DockerClient` and an `EngineReport` of everything it
tried (shown by `appliancectl doctor`). The order:

1. An address the operator configured (`base_url`), else `DOCKER_HOST` from the environment.
   If one is given, it is the only one tried: an engine the operator named that does not answer
   is an error, never a reason to go looking for another one (which might be a different user's
   rootless engine, or a desktop VM's).
2. Otherwise the well-known sockets, in this order (the source documents' list):
   Docker (/var/run/docker.sock, /run/docker.sock), Podman rootless
   ($XDG_RUNTIME_DIR/podman/podman.sock) and root (/run/podman/podman.sock), Colima
   (~/.colima/default/docker.sock, ~/.colima/docker.sock), OrbStack (~/.orbstack/run/docker.sock),
   Rancher Desktop (~/.rd/docker.sock), Docker Desktop (~/.docker/desktop/docker.sock,
   ~/.docker/run/docker.sock). The first that answers a ping within 1.5 s wins.
   containerd's own socket (/run/containerd/containerd.sock) speaks gRPC, not the Docker API:
   it is reported as found but unsupported, never used.

Every attempt is recorded with its outcome (absent, not a socket, refused, permission denied,
timed out, answered, unsupported), so an operator sees at once why no engine was found.

`ensure_dockerd` is not used by the appliance itself (a dedicated host runs dockerd under its
init system, provisioned by ansible/). It exists for machines without an init system (this
development machine, CI, the tests): it registers gVisor in /etc/docker/daemon.json when runsc is
installed and starts `dockerd` in the background if nothing answers on /var/run/docker.sock.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import docker
import docker.errors
import msgspec

from .errors import EngineUnavailable, RuntimeProviderError

PING_TIMEOUT = 1.5  # seconds per candidate: a local engine answers in milliseconds
# The client's timeout for ordinary API calls once connected (container start under gVisor
# takes well under a second here; a busy engine may take longer).
API_TIMEOUT = 60.0

DEFAULT_SOCKET = "/var/run/docker.sock"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
DAEMON_JSON = Path("/etc/docker/daemon.json")
DOCKERD_LOG = Path("/var/log/dockerd.log")
RUNSC_PATH = "/usr/bin/runsc"
# gVisor joins the pod's (infra container's) namespace only with host networking: with its own
# netstack it refuses "container:<infra>" (docs/runtime.md, runsc).
RUNSC_RUNTIME = {"path": RUNSC_PATH, "runtimeArgs": ["--network=host"]}


class EngineAttempt(msgspec.Struct, frozen=True):
    source: str  # "configured", "DOCKER_HOST", "docker", "podman-rootless", ...
    address: str  # a unix:// or tcp:// URL
    outcome: str  # answered, absent, not-a-socket, refused, denied, timeout, error, unsupported
    detail: str = ""


class EngineReport(msgspec.Struct, frozen=True):
    attempts: tuple[EngineAttempt, ...]
    address: str | None = None  # the engine used
    server_version: str = ""
    api_version: str = ""


def candidate_sockets(env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """(source, socket path) in the order they are tried; containerd last (reported only)."""
    env = os.environ if env is None else env
    home = env.get("HOME") or str(Path.home())
    candidates = [
        ("docker", "/var/run/docker.sock"),
        ("docker", "/run/docker.sock"),
    ]
    runtime_dir = env.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        candidates.append(("podman-rootless", f"{runtime_dir}/podman/podman.sock"))
    candidates += [
        ("podman", "/run/podman/podman.sock"),
        ("colima", f"{home}/.colima/default/docker.sock"),
        ("colima", f"{home}/.colima/docker.sock"),
        ("orbstack", f"{home}/.orbstack/run/docker.sock"),
        ("rancher-desktop", f"{home}/.rd/docker.sock"),
        ("docker-desktop", f"{home}/.docker/desktop/docker.sock"),
        ("docker-desktop", f"{home}/.docker/run/docker.sock"),
        ("containerd", CONTAINERD_SOCKET),
    ]
    return candidates


def engine_socket_paths(env: Mapping[str, str] | None = None) -> list[str]:
    """Every well-known engine socket path (the mount check refuses them and their parents)."""
    return [path for _, path in candidate_sockets(env)]


def detect_engine(
    base_url: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = PING_TIMEOUT,
    candidates: Sequence[tuple[str, str]] | None = None,
) -> tuple[docker.DockerClient, EngineReport]:
    """Connect to the engine (the module's docstring says in which order); EngineUnavailable."""
    env = os.environ if env is None else env
    named = base_url or env.get("DOCKER_HOST")
    if named:
        source = "configured" if base_url else "DOCKER_HOST"
        attempt, client = _try_address(source, named, env, timeout)
        report = EngineReport(attempts=(attempt,))
        if client is None:
            raise EngineUnavailable(
                [(f"{named} ({source})", _why(attempt))],
                no_fallback_reason=f"{source} is set, so no other engine is tried",
            )
        return client, _answered(report, attempt, client)
    attempts: list[EngineAttempt] = []
    # `candidates` replaces the well-known list (tests; a doctor probing one path).
    for source, path in candidate_sockets(env) if candidates is None else candidates:
        if source == "containerd":
            attempts.append(_containerd_attempt(path))
            continue
        attempt, client = _try_address(source, f"unix://{path}", env, timeout)
        attempts.append(attempt)
        if client is not None:
            return client, _answered(EngineReport(attempts=tuple(attempts)), attempt, client)
    raise EngineUnavailable([(f"{a.address} ({a.source})", _why(a)) for a in attempts])


def _why(attempt: EngineAttempt) -> str:
    return attempt.outcome + (f": {attempt.detail}" if attempt.detail else "")


def _answered(
    report: EngineReport, attempt: EngineAttempt, client: docker.DockerClient
) -> EngineReport:
    version = client.version()
    return msgspec.structs.replace(
        report,
        address=attempt.address,
        server_version=str(version.get("Version", "")),
        api_version=str(version.get("ApiVersion", "")),
    )


def _containerd_attempt(path: str) -> EngineAttempt:
    outcome, detail = _probe_unix(path, PING_TIMEOUT)
    if outcome == "connected":
        return EngineAttempt(
            "containerd",
            f"unix://{path}",
            "unsupported",
            "containerd's own API (gRPC) is not the Docker API; use dockerd or podman on top",
        )
    return EngineAttempt("containerd", f"unix://{path}", outcome, detail)


def _probe_unix(path: str, timeout: float) -> tuple[str, str]:
    """Can we connect to this socket? ("connected", "") or (outcome, why)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "absent", ""
    except OSError as exc:
        return "error", exc.strerror or str(exc)
    if not stat.S_ISSOCK(mode):
        return "not-a-socket", ""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except ConnectionRefusedError:
            return "refused", "nothing listens on it (a stale socket file?)"
        except PermissionError:
            return "denied", "permission denied (not in the engine's group?)"
        except TimeoutError:
            return "timeout", f"no connection within {timeout:g} s"
        except OSError as exc:
            return "error", exc.strerror or str(exc)
    return "connected", ""


def _try_address(
    source: str, address: str, env: Mapping[str, str], timeout: float
) -> tuple[EngineAttempt, docker.DockerClient | None]:
    if address.startswith("unix://"):
        outcome, detail = _probe_unix(address.removeprefix("unix://"), timeout)
        if outcome != "connected":
            return EngineAttempt(source, address, outcome, detail), None
    try:
        # The ping: version negotiation asks the engine for /version, bounded by `timeout`.
        probe = _client(address, env, timeout)
    except docker.errors.DockerException as exc:
        text = str(exc)
        outcome = "timeout" if "timed out" in text.lower() else "error"
        return EngineAttempt(source, address, outcome, text), None
    probe.close()
    client = _client(address, env, API_TIMEOUT)
    return EngineAttempt(source, address, "answered"), client


def _client(address: str, env: Mapping[str, str], timeout: float) -> docker.DockerClient:
    if address.startswith(("tcp://", "ssh://", "https://", "http://")):
        # TLS settings (DOCKER_TLS_VERIFY, DOCKER_CERT_PATH) come from the environment as usual.
        environment = dict(env)
        environment["DOCKER_HOST"] = address
        return docker.DockerClient.from_env(
            environment=environment, version="auto", timeout=int(max(1, timeout))
        )
    return docker.DockerClient(base_url=address, version="auto", timeout=timeout)


# --- development, CI and tests only --------------------------------------------------------------


class DockerdStartError(RuntimeProviderError):
    """`ensure_dockerd` could not get an engine answering (dev/CI helper only)."""


def ensure_dockerd(
    *, wait: float = 30.0, socket_path: str = DEFAULT_SOCKET, log_path: Path = DOCKERD_LOG
) -> docker.DockerClient:
    """An engine on /var/run/docker.sock with runsc registered (if installed); started if needed.

    For machines without an init system (development, CI, tests); never called by applianced.
    """
    runsc_installed = os.access(RUNSC_PATH, os.X_OK)
    changed = register_runsc() if runsc_installed else False
    attempt, client = _try_address("docker", f"unix://{socket_path}", os.environ, PING_TIMEOUT)
    if client is None:
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise DockerdStartError(f"no engine on {socket_path} ({_why(attempt)}) and no dockerd")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            # A session of its own: the engine outlives the test run that started it.
            subprocess.Popen(
                [dockerd],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        client = _wait_for_engine(socket_path, wait, log_path)
    elif changed and "runsc" not in client.info().get("Runtimes", {}):
        # dockerd reloads its runtimes on SIGHUP (dockerd(8), "Configuration reload behavior").
        _signal_dockerd(signal.SIGHUP)
    if runsc_installed:
        deadline = time.monotonic() + wait
        while "runsc" not in client.info().get("Runtimes", {}):
            if time.monotonic() > deadline:
                raise DockerdStartError(
                    f"runsc is installed but the engine never registered it ({DAEMON_JSON})"
                )
            time.sleep(0.2)
    return client


def register_runsc(daemon_json: Path = DAEMON_JSON) -> bool:
    """Add runsc to daemon.json, keeping whatever else is there. True if the file changed."""
    config: dict[str, object] = {}
    if daemon_json.exists():
        text = daemon_json.read_text()
        if text.strip():
            loaded = json.loads(text)
            if not isinstance(loaded, dict):
                raise DockerdStartError(f"{daemon_json}: not a JSON object")
            config = loaded
    runtimes = config.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise DockerdStartError(f"{daemon_json}: `runtimes` is not an object")
    if runtimes.get("runsc") == RUNSC_RUNTIME:
        return False
    runtimes["runsc"] = RUNSC_RUNTIME
    daemon_json.parent.mkdir(parents=True, exist_ok=True)
    temporary = daemon_json.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(temporary, daemon_json)
    return True


def _signal_dockerd(signum: int) -> None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(Path("/var/run/docker.pid").read_text().strip())
        os.kill(pid, signum)


def _wait_for_engine(socket_path: str, wait: float, log_path: Path) -> docker.DockerClient:
    deadline = time.monotonic() + wait
    attempt = EngineAttempt("docker", socket_path, "absent")
    while time.monotonic() < deadline:
        attempt, client = _try_address("docker", f"unix://{socket_path}", os.environ, PING_TIMEOUT)
        if client is not None:
            return client
        time.sleep(0.2)
    raise DockerdStartError(
        f"dockerd did not answer on {socket_path} within {wait:g} s ({_why(attempt)}); "
        f"see {log_path}"
    )
