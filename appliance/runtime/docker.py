"""`DockerProvider`: crews as pods of hardened containers, on the docker SDK.

Theory of operation
-------------------
A crew is a pod (see base.py): an *infra* container that only holds the network namespace, and
an *agent* container that joins it with `network_mode="container:<infra id>"`. The infra starts
with network "none", so the engine gives it loopback only; netns/ then moves one veth end into it
through `/proc/<infra pid>/ns/net`. Nothing the engine would add (a bridge, published ports, DNS)
is ever there.

Each public call either completes or removes what it created before raising
`CrewContainerError(crew, step, ...)`: `create_infra` removes its infra container, `start_agent`
its agent container and any volume it created. Across calls (infra created, then the network
attach fails), the caller owns the rollback: `launch_crew` in this package does the three steps
and calls `remove_crew` on failure. Everything carries the labels of base.py, so `owned()` and
`remove_crew()` find it after a crash as well.

Instances. A provider belongs to one appliance instance (`instance=`): its containers and
volumes carry `io.agent-appliance.instance=<id>` and end their names in `.<id>`
(`appliance-<crew>-<role>.<id>`, `appliance-<crew>-home.<id>`: names are unique on the engine,
and two instances may have crews of one name), and everything it lists, adopts or removes is
selected by that label, so it never touches another instance's crews, nor containers with no
instance label. The exception is what the daemon hands to `adopt()`: containers made before
instance ids (labels cannot be changed), recognised by the container ids in the daemon's own
state; and their crews' volumes, which keep their former names (`appliance-<crew>-home`) as
long as the crew lives. Whatever such a crew gets anew (a container re-created at reconcile)
carries the label. A provider made without an instance (`doctor`) answers about runtimes and
images but creates, lists and removes nothing.

Before anything is created, every check that can fail is run: the crew name, the limits, the
runtime (present in the engine and not known broken: never a silent fallback to another), both
images (present locally: never pulled), and the mounts (an engine socket, or a directory holding
one, is refused outright; see mounts.py).

Hardening of the agent container (docs/runtime.md says why for each): UID 1001, cap-drop ALL
(NET_RAW back only if the crew spec asks), no-new-privileges, read-only root, tmpfs /tmp (500m,
1777), pids 200, memory (swap not above it) and CPU limits, the engine's default seccomp
profile (never unconfined), an init (docker-init) as PID 1 to reap orphans, named volumes for
HOME and tools, host paths only when the spec lists them.

gVisor: the agent runs under `runsc`, which the engine must have registered with
`runtimeArgs ["--network=host"]`; inside the sandbox, "host" networking is the namespace the
sandbox was started in, i.e. the pod's. The infra container always runs on runc: it only holds
the namespace, and a namespace made by runc is one the host's nftables rules see.

Exec: `docker exec` has no kill. The command runs under a tiny shell wrapper that records its
process id in /tmp and carries a per-exec marker in its environment; the wrapper is a session
and process group leader (runc and runsc both start exec processes that way). To kill, a second
exec kills the process group and every process that still carries the marker (children that
left the group). Output is read from the engine's multiplexed stream, one frame per call in a
worker thread (abandoned on cancellation, unblocked by closing the stream), and cut into lines.

An exec costs the engine three calls (create, start with the attached stream, inspect for the exit
code), as `docker exec` does. The crew's agent container is not looked up per exec: its id is
remembered from `start_agent` (or the first lookup) until `remove_crew`; a remembered id that the
engine no longer runs (404, or 409 "not running") is forgotten and looked up once more, so a
container replaced or stopped behind the provider's back is found, or reported, as before. The
wrapper's extra fork costs nothing measurable next to the engine's exec (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import docker
import docker.errors
import msgspec
import trio
from docker.types import Mount

from netns.addressing import check_crew_id, check_instance_id
from netns.errors import NetConfigError

from .base import (
    AGENT_UID,
    KNOWN_RUNTIMES,
    LABEL_APPLIANCE,
    LABEL_CREW,
    LABEL_INSTANCE,
    LABEL_ROLE,
    LABELS_OWNER_VALUE,
    PIDS_LIMIT,
    TMP_SIZE,
    ContainerRole,
    CrewSpec,
    ExecAttached,
    ExecExited,
    ExecOutput,
    OwnedContainer,
    Pod,
)
from .engine import detect_engine
from .errors import (
    CrewContainerError,
    EngineCallError,
    ImageMissing,
    InvalidSpec,
    RuntimeUnavailable,
    check_exec_arguments,
)
from .mounts import check_mounts
from .streams import LineSplitter

HOME = "/home/agent"
TOOLS = "/opt/tools"
NOBODY = 65534
INFRA_RUNTIME = "runc"
INFRA_MEMORY_BYTES = 16 * 1024 * 1024
INFRA_PIDS_LIMIT = 8
INFRA_NANO_CPUS = 100_000_000  # a tenth of a CPU: it only sleeps
LONG_SLEEP = ("sleep", "infinity")
MIN_MEMORY_BYTES = 32 * 1024 * 1024  # below this runc itself cannot start the container
EXEC_MARKER = "APPLIANCE_EXEC_ID"
# The exec wrapper: record the pid (sh stays the group leader, so killing the group kills the
# command and its children), run the command, remove the record, keep the command's status.
# The signals a client forwards (attached.py) go to the whole group; the wrapper catches them
# (a handler, not an ignore: the command gets them with their default action) and so outlives
# the command, whose status, e.g. a trap's `exit 42`, is then the exec's.
EXEC_WRAPPER = (
    "trap : HUP INT QUIT TERM USR1 USR2; "
    'f=/tmp/.appliance-exec-"$APPLIANCE_EXEC_ID".pid; echo $$ > "$f" 2>/dev/null; '
    '"$@"; s=$?; rm -f "$f"; exit $s'
)
# The killer: the group of the recorded pid, then anything still carrying the marker.
EXEC_KILLER = (
    'f=/tmp/.appliance-exec-"$1".pid; '
    'if [ -r "$f" ]; then p=$(cat "$f"); kill -9 -"$p" 2>/dev/null; kill -9 "$p" 2>/dev/null; fi; '
    "for d in /proc/[0-9]*; do "
    'if tr "\\000" "\\n" < "$d/environ" 2>/dev/null | grep -qx "APPLIANCE_EXEC_ID=$1"; '
    'then kill -9 "${d#/proc/}" 2>/dev/null; fi; done; rm -f "$f"; exit 0'
)
KILL_WAIT = 10.0  # seconds for the kill exec and the stream to end after it


def crew_labels(instance: str, crew: str, role: ContainerRole) -> dict[str, str]:
    return {**volume_labels(instance, crew), LABEL_ROLE: role.value}


def volume_labels(instance: str, crew: str) -> dict[str, str]:
    return {LABEL_APPLIANCE: LABELS_OWNER_VALUE, LABEL_INSTANCE: instance, LABEL_CREW: crew}


def container_name(instance: str, crew: str, role: ContainerRole) -> str:
    # The instance last, after a '.': "appliance-<crew>-" still starts every name of a crew,
    # and neither crew names nor instance ids have a '.', so no two (crew, instance) pairs
    # give one name (with a '-' they could: crew "a" of "b-agent-c" and "a-agent-b" of "c").
    return f"appliance-{crew}-{role.value}.{instance}"


def volume_names(instance: str, crew: str) -> dict[str, str]:
    """Container path -> the crew's named volume for it."""
    return {HOME: f"appliance-{crew}-home.{instance}", TOOLS: f"appliance-{crew}-tools.{instance}"}


def legacy_volume_names(crew: str) -> dict[str, str]:
    """The names a crew's volumes had before instance ids (kept while that crew lives)."""
    return {HOME: f"appliance-{crew}-home", TOOLS: f"appliance-{crew}-tools"}


class StrayProcess(msgspec.Struct, frozen=True):
    pid: int
    kind: str  # "runsc-sandbox", "runsc-gofer", "runsc", "shim"
    container_id: str
    cmdline: str


class DockerProvider:
    """Crews as pods of hardened containers on a Docker-API engine (docker, podman)."""

    name = "docker"
    isolated = True

    def __init__(
        self,
        client: docker.DockerClient,
        *,
        instance: str | None = None,
        infra_command: tuple[str, ...] = LONG_SLEEP,
        agent_command: tuple[str, ...] = LONG_SLEEP,
    ) -> None:
        # The agent container's PID 1 only keeps it alive; agent processes arrive by `exec`.
        if instance is not None:
            try:
                check_instance_id(instance)
            except NetConfigError as exc:
                raise InvalidSpec("instance", str(exc)) from None
        self.instance = instance
        # Made before instance ids, recorded in the daemon's state (adopt()).
        self._adopted: frozenset[str] = frozenset()
        self._legacy_crews: frozenset[str] = frozenset()
        self.client = client
        self.api = client.api
        self.infra_command = infra_command
        self.agent_command = agent_command
        # crew -> its running agent container's id, for exec (module docstring); a listing of
        # the engine's containers costs ~10 ms, most of what an exec of `true` adds over the
        # engine's own three calls. Written from worker threads: single dict operations only.
        self._agents: dict[str, str] = {}

    @classmethod
    def connect(cls, base_url: str | None = None, *, instance: str | None = None) -> DockerProvider:
        client, _report = detect_engine(base_url)
        return cls(client, instance=instance)

    def bind_instance(self, instance: str) -> None:
        """Give a provider made without an instance (applianced makes its provider before it
        reads the id from its state) its id, once: it never changes under a provider."""
        try:
            check_instance_id(instance)
        except NetConfigError as exc:
            raise InvalidSpec("instance", str(exc)) from None
        if self.instance not in (None, instance):
            raise InvalidSpec("instance", f"this provider is instance {self.instance!r}'s")
        self.instance = instance

    def _instance(self) -> str:
        if self.instance is None:
            raise InvalidSpec(
                "instance",
                "this provider has no instance id: it creates, lists and removes nothing",
            )
        return self.instance

    # --- runtimes ------------------------------------------------------------------------------

    def runtime_status(self) -> dict[str, str]:
        """Every known runtime -> "available" or why not (shown by `appliancectl doctor`)."""
        info = self._call("engine info", self.client.info)
        registered = set((info.get("Runtimes") or {}).keys())
        status: dict[str, str] = {}
        for runtime in KNOWN_RUNTIMES:
            if runtime not in registered:
                status[runtime] = "not registered in the engine"
            elif runtime == "crun" and _cgroups_hybrid(info):
                # crun 1.8.1 refuses to start anything here (docs/runtime.md).
                status[runtime] = "crun does not support cgroups in hybrid mode (v1 + v2)"
            else:
                status[runtime] = "available"
        return status

    def runtimes(self) -> tuple[str, ...]:
        return tuple(r for r, state in self.runtime_status().items() if state == "available")

    def _require_runtime(self, runtime: str) -> None:
        status = self.runtime_status()
        if status.get(runtime) != "available":
            why = status.get(runtime, f"not one of the known runtimes {', '.join(KNOWN_RUNTIMES)}")
            available = [r for r, state in status.items() if state == "available"]
            raise RuntimeUnavailable(runtime, available, why)

    # --- checks before anything is created -----------------------------------------------------

    def check_spec(self, spec: CrewSpec) -> list[tuple[str, str, bool]]:
        """Everything that can be checked before creating anything; the resolved mounts."""
        try:
            check_crew_id(spec.name)
        except NetConfigError as exc:
            raise InvalidSpec("name", str(exc)) from None
        if spec.memory_bytes < MIN_MEMORY_BYTES:
            raise InvalidSpec("memory_bytes", f"must be at least {MIN_MEMORY_BYTES} bytes")
        if not (math.isfinite(spec.cpus) and 0.01 <= spec.cpus <= (os.cpu_count() or 1) * 64):
            raise InvalidSpec("cpus", "must be a number of CPUs, at least 0.01")
        for key in spec.env:
            if not key or "=" in key or "\0" in key or key == EXEC_MARKER:
                raise InvalidSpec("env", f"bad variable name {key!r}")
        mounts = check_mounts(spec.mounts, extra_sockets=self._engine_socket())
        reserved = {HOME, TOOLS, "/tmp"}
        for _, target, _ in mounts:
            if os.path.normpath(target) in reserved:
                raise InvalidSpec("mounts", f"container path {target} is the crew's own")
        self._require_runtime(spec.runtime)
        self._require_runtime(INFRA_RUNTIME)
        self._require_image(spec.image, "agent")
        self._require_image(spec.infra_image, "infra")
        return mounts

    def _engine_socket(self) -> list[str]:
        url = str(self.api.base_url)
        # The SDK rewrites unix://PATH to http+docker://localhost; the adapter keeps the path.
        adapter = self.api.adapters.get("http+docker://")
        path = getattr(adapter, "socket_path", None)
        return [path] if isinstance(path, str) else ([url] if url.startswith("/") else [])

    def _require_image(self, image: str, role: str) -> None:
        try:
            self.client.images.get(image)
        except docker.errors.ImageNotFound:
            raise ImageMissing(image, role) from None
        except docker.errors.APIError as exc:
            if exc.status_code == 404:
                raise ImageMissing(image, role) from None
            raise EngineCallError(f"look up {role} image {image!r}", exc) from exc

    # --- the pod -------------------------------------------------------------------------------

    def create_infra(self, spec: CrewSpec) -> Pod:
        instance = self._instance()
        self.check_spec(spec)
        crew = spec.name
        existing = [c for c in self.owned() if c.crew == crew]
        if existing:
            raise CrewContainerError(
                crew,
                "create infra container",
                "the crew already has containers "
                f"({', '.join(c.container_id[:12] for c in existing)}); remove_crew first",
                rolled_back=False,
            )
        with _Rollback(crew) as rollback:
            container = rollback.step(
                "create infra container",
                lambda: self.client.containers.create(
                    spec.infra_image,
                    list(self.infra_command),
                    name=container_name(instance, crew, ContainerRole.INFRA),
                    labels=crew_labels(instance, crew, ContainerRole.INFRA),
                    user=f"{NOBODY}:{NOBODY}",
                    network_mode="none",
                    runtime=INFRA_RUNTIME,
                    cap_drop=["ALL"],
                    security_opt=["no-new-privileges"],
                    read_only=True,
                    pids_limit=INFRA_PIDS_LIMIT,
                    mem_limit=INFRA_MEMORY_BYTES,
                    memswap_limit=INFRA_MEMORY_BYTES,
                    nano_cpus=INFRA_NANO_CPUS,
                    # No init: nothing runs in it but the sleep (no orphans to reap), and without
                    # one a missing program fails the start itself, not a moment later.
                    init=False,
                    restart_policy={"Name": "no"},
                    log_config={"Type": "none", "Config": {}},
                ),
            )
            rollback.undo(lambda: self._remove_container(container.id))
            rollback.step("start infra container", container.start)
            pid = rollback.step("read infra pid", lambda: self._running_pid(container.id))
            return Pod(crew=crew, infra_id=container.id, infra_pid=pid, runtime=spec.runtime)

    def start_agent(self, spec: CrewSpec, pod: Pod) -> str:
        instance = self._instance()
        mounts = self.check_spec(spec)
        crew = spec.name
        if pod.crew != crew:
            raise InvalidSpec("name", f"the pod belongs to crew {pod.crew!r}, not {crew!r}")
        with _Rollback(crew) as rollback:
            # The infra must be alive: an agent joined to a dead namespace would fail anyway,
            # and one joined to a *new* container of the same id is impossible (ids are unique).
            rollback.step("check infra container", lambda: self._running_pid(pod.infra_id))
            volume_mounts = []
            for target, volume in self._volume_names(crew).items():
                created = rollback.step(
                    f"create volume {volume}", partial(self._volume, crew, volume)
                )
                if created:
                    rollback.undo(partial(self._remove_volume, volume))
                volume_mounts.append(Mount(target, volume, type="volume"))
            binds = [
                Mount(target, source, type="bind", read_only=ro) for source, target, ro in mounts
            ]
            environment = {**spec.env, "HOME": HOME}
            container = rollback.step(
                "create agent container",
                lambda: self.client.containers.create(
                    spec.image,
                    list(self.agent_command),
                    name=container_name(instance, crew, ContainerRole.AGENT),
                    labels=crew_labels(instance, crew, ContainerRole.AGENT),
                    user=f"{AGENT_UID}:{AGENT_UID}",
                    environment=environment,
                    working_dir=HOME,
                    network_mode=f"container:{pod.infra_id}",
                    runtime=spec.runtime,
                    cap_drop=["ALL"],
                    cap_add=["NET_RAW"] if spec.net_raw else None,
                    # The engine's default seccomp profile stays: no seccomp option is given.
                    security_opt=["no-new-privileges"],
                    read_only=True,
                    tmpfs={"/tmp": f"rw,nosuid,nodev,size={TMP_SIZE},mode=1777"},
                    pids_limit=PIDS_LIMIT,
                    mem_limit=spec.memory_bytes,
                    memswap_limit=spec.memory_bytes,
                    nano_cpus=int(spec.cpus * 1e9),
                    mounts=[*volume_mounts, *binds],
                    init=True,
                    restart_policy={"Name": "no"},
                ),
            )
            rollback.undo(lambda: self._remove_container(container.id))
            rollback.step("start agent container", container.start)
            rollback.step("check agent container", lambda: self._running_pid(container.id))
            self._agents[crew] = str(container.id)
            return str(container.id)

    def remove_crew(self, crew: str, *, volumes: bool = False) -> None:
        self._agents.pop(crew, None)
        containers = [c for c in self.owned() if c.crew == crew]
        # Agents first: the infra holds their namespace.
        ordered = sorted(containers, key=lambda c: c.role != ContainerRole.AGENT)
        errors: list[str] = []
        for owned in ordered:
            try:
                self._remove_container(owned.container_id)
            except docker.errors.DockerException as exc:
                errors.append(f"{owned.role} {owned.container_id[:12]}: {exc}")
        if volumes:
            for volume in self._crew_volumes(crew):
                try:
                    self._remove_volume(volume)
                except docker.errors.DockerException as exc:
                    errors.append(f"volume {volume}: {exc}")
        if errors:
            raise CrewContainerError(crew, "remove crew", "; ".join(errors), rolled_back=False)

    def adopt(self, container_ids: set[str], legacy_crews: set[str]) -> None:
        """Containers of this instance that carry no instance label (made before instance ids):
        the daemon knows them by the ids in its state. `owned()` lists them (only if they carry
        the appliance's owner label and no instance label) and `remove_crew()` removes them;
        `legacy_crews` keep their volumes' former names. Each call replaces the previous."""
        self._adopted = frozenset(container_ids)
        self._legacy_crews = frozenset(legacy_crews)

    def _listed(self) -> list[dict[str, Any]]:
        """This instance's containers as the engine lists them: by label, plus the adopted."""
        instance = self._instance()
        found: list[dict[str, Any]] = self._call(
            "list containers",
            lambda: self.api.containers(
                all=True,
                filters={
                    "label": [
                        f"{LABEL_APPLIANCE}={LABELS_OWNER_VALUE}",
                        f"{LABEL_INSTANCE}={instance}",
                    ]
                },
            ),
        )
        if self._adopted:
            adopted = self._call(
                "list adopted containers",
                lambda: self.api.containers(all=True, filters={"id": sorted(self._adopted)}),
            )
            found += [
                item
                for item in adopted
                if item["Id"] in self._adopted
                and (item.get("Labels") or {}).get(LABEL_APPLIANCE) == LABELS_OWNER_VALUE
                and LABEL_INSTANCE not in (item.get("Labels") or {})
            ]
        return found

    def unowned(self) -> list[tuple[str, str, str | None]]:
        """(container id, crew label, instance label or None) of the appliance-labelled
        containers that are not this instance's: what reconcile leaves alone (and logs)."""
        mine = {item["Id"] for item in self._listed()}
        found = self._call(
            "list containers",
            lambda: self.api.containers(
                all=True, filters={"label": f"{LABEL_APPLIANCE}={LABELS_OWNER_VALUE}"}
            ),
        )
        return [
            (
                item["Id"],
                (item.get("Labels") or {}).get(LABEL_CREW, ""),
                (item.get("Labels") or {}).get(LABEL_INSTANCE),
            )
            for item in found
            if item["Id"] not in mine
        ]

    def owned(self) -> list[OwnedContainer]:
        out = []
        for item in self._listed():
            labels = item.get("Labels") or {}
            try:
                role = ContainerRole(labels.get(LABEL_ROLE, ""))
            except ValueError:
                role = ContainerRole.AGENT  # unknown role: treat as the more dangerous kind
            out.append(
                OwnedContainer(
                    crew=labels.get(LABEL_CREW, ""),
                    role=role,
                    container_id=item["Id"],
                    running=item.get("State") == "running",
                )
            )
        return out

    def owned_volumes(self) -> list[str]:
        instance = self._instance()
        found = self._call(
            "list volumes",
            lambda: self.api.volumes(
                filters={
                    "label": [
                        f"{LABEL_APPLIANCE}={LABELS_OWNER_VALUE}",
                        f"{LABEL_INSTANCE}={instance}",
                    ]
                }
            ),
        )
        return [v["Name"] for v in (found.get("Volumes") or [])]

    # --- exec ----------------------------------------------------------------------------------

    attached_exec = True  # exec(..., attach=True): stdin, TTY, signals (attached.py)

    async def exec(
        self,
        crew: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        attach: bool = False,
        stdin: bool = False,
        tty: bool = False,
        size: tuple[int, int] | None = None,
    ) -> AsyncIterator[ExecAttached | ExecOutput | ExecExited]:
        check_exec_arguments(argv, timeout)
        for key in env or {}:
            if not key or "=" in key or key == EXEC_MARKER:
                raise InvalidSpec("env", f"bad variable name {key!r}")
        token = secrets.token_hex(8)
        environment = {**(env or {}), EXEC_MARKER: token}
        wrapper = EXEC_WRAPPER
        if tty and size is not None and all(isinstance(n, int) and 0 < n < 65536 for n in size):
            # The engine sizes an exec's TTY only after it started (exec resize), so a command
            # that looks at once (`stty size`, a full-screen program) could see no size; the
            # wrapper sets it first, as the terminal had it.
            wrapper = f"stty rows {size[0]} cols {size[1]} 2>/dev/null; {EXEC_WRAPPER}"
        command = ["/bin/sh", "-c", wrapper, "appliance-exec", *argv]
        if attach:
            from .attached import exec_attached

            attached = exec_attached(
                self, crew, command, environment, token,
                timeout=timeout, stdin=stdin, tty=tty, size=size,
            )  # fmt: skip
            async with contextlib.aclosing(attached) as events:
                async for event in events:
                    yield event
            return
        container_id, exec_id, stream = await trio.to_thread.run_sync(
            self._exec_open, crew, command, environment
        )
        frames: Iterator[tuple[bytes | None, bytes | None]] = iter(stream)
        lines = LineSplitter()
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        done = False
        try:
            while True:
                frame: tuple[bytes | None, bytes | None] | None = None
                with trio.move_on_at(deadline):
                    frame = await trio.to_thread.run_sync(
                        _next_frame, frames, abandon_on_cancel=True
                    )
                    if frame is None:  # end of stream: the process is gone
                        break
                if frame is None:  # the deadline passed
                    await trio.to_thread.run_sync(self._kill_exec, container_id, token, stream)
                    done = True
                    for out in lines.flush():
                        yield out
                    yield ExecExited(exit_code=-1, timed_out=True)
                    return
                stdout, stderr = frame
                for out in [
                    *(lines.feed("stdout", stdout) if stdout else ()),
                    *(lines.feed("stderr", stderr) if stderr else ()),
                ]:
                    yield out
            done = True
            for out in lines.flush():
                yield out
            code = await trio.to_thread.run_sync(self._exec_exit_code, crew, exec_id)
            yield ExecExited(exit_code=code)
        finally:
            if not done:
                # Cancelled, or the consumer stopped reading: the process must not outlive it.
                with trio.CancelScope(shield=True), trio.move_on_after(KILL_WAIT):
                    await trio.to_thread.run_sync(self._kill_exec, container_id, token, stream)
            with contextlib.suppress(Exception):
                stream.close()

    def agent_container(self, crew: str) -> str:
        """The crew's running agent container: the remembered id, else the engine's list."""
        remembered = self._agents.get(crew)
        if remembered is not None:
            return remembered
        running = [
            c
            for c in self.owned()
            if c.crew == crew and c.role == ContainerRole.AGENT and c.running
        ]
        if not running:
            raise CrewContainerError(
                crew, "exec", "the crew has no running agent container", rolled_back=False
            )
        self._agents[crew] = running[0].container_id
        return running[0].container_id

    def _exec_open(
        self, crew: str, command: list[str], environment: dict[str, str]
    ) -> tuple[str, str, Any]:
        """Create and start the exec in the crew's agent container: (container, exec, stream)."""
        container_id = self.agent_container(crew)
        try:
            created = self.api.exec_create(
                container_id, command, environment=environment, stdout=True, stderr=True
            )
        except docker.errors.APIError as exc:
            # Gone (404) or not running (409): the remembered id is stale; look up once more.
            if exc.status_code not in (404, 409) or self._agents.pop(crew, None) is None:
                raise CrewContainerError(crew, "exec", exc, rolled_back=False) from exc
            container_id = self.agent_container(crew)
            try:
                created = self.api.exec_create(
                    container_id, command, environment=environment, stdout=True, stderr=True
                )
            except docker.errors.DockerException as exc:
                self._agents.pop(crew, None)
                raise CrewContainerError(crew, "exec", exc, rolled_back=False) from exc
        except docker.errors.DockerException as exc:
            raise CrewContainerError(crew, "exec", exc, rolled_back=False) from exc
        exec_id = str(created["Id"])
        try:
            stream = self.api.exec_start(exec_id, stream=True, demux=True)
        except docker.errors.DockerException as exc:
            raise CrewContainerError(crew, "exec", exc, rolled_back=False) from exc
        return container_id, exec_id, stream

    def _exec_exit_code(self, crew: str, exec_id: str) -> int:
        # The stream can end a moment before the engine records the exit.
        deadline = time.monotonic() + KILL_WAIT
        while True:
            try:
                state = self.api.exec_inspect(exec_id)
            except docker.errors.DockerException as exc:
                raise CrewContainerError(crew, "exec exit code", exc, rolled_back=False) from exc
            if not state.get("Running") and state.get("ExitCode") is not None:
                return int(state["ExitCode"])
            if time.monotonic() > deadline:
                raise CrewContainerError(
                    crew, "exec exit code", "the engine never reported it", rolled_back=False
                )
            time.sleep(0.02)

    def _kill_exec(self, container_id: str, token: str, stream: Any) -> None:
        """Kill an exec's processes (see the module's docstring), then end its stream."""
        try:
            created = self.api.exec_create(
                container_id, ["/bin/sh", "-c", EXEC_KILLER, "appliance-kill", token]
            )
            self.api.exec_start(created["Id"])
        except docker.errors.DockerException:
            # The container is gone (then so are its processes) or the engine is: nothing more
            # can be done from here; reconciliation removes the container.
            pass
        finally:
            with contextlib.suppress(Exception):
                stream.close()  # unblocks the reader thread at once

    # --- leftovers -----------------------------------------------------------------------------

    def stray_runsc_processes(self) -> list[StrayProcess]:
        """runsc sandboxes/gofers and containerd shims whose container the engine no longer has.

        A failed runsc start can leave them running (docs/runtime.md). Host-local: reads /proc.
        """
        # Processes first, then the engine's list: a container is created before its runtime
        # starts, so any process seen here whose container is alive is in the later list (the
        # other order would take a sandbox started in between for a stray, and kill it).
        processes = runtime_processes()
        known = {
            c["Id"] for c in self._call("list containers", lambda: self.api.containers(all=True))
        }
        return [p for p in processes if p.container_id not in known]

    def kill_stray_runsc_processes(self) -> list[StrayProcess]:
        """Kill what `stray_runsc_processes` finds (reconciliation); returns what was killed."""
        killed = []
        for stray in self.stray_runsc_processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(stray.pid, signal.SIGKILL)
                killed.append(stray)
        return killed

    # --- helpers -------------------------------------------------------------------------------

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except docker.errors.DockerException as exc:
            raise EngineCallError(what, exc) from exc

    def _running_pid(self, container_id: str) -> int:
        attrs = self.api.inspect_container(container_id)
        state = attrs.get("State") or {}
        pid = int(state.get("Pid") or 0)
        if not state.get("Running") or pid <= 0:
            raise RuntimeError(
                f"container {container_id[:12]} is not running (status {state.get('Status')!r}, "
                f"error {state.get('Error')!r}, exit code {state.get('ExitCode')})"
            )
        return pid

    def _remove_container(self, container_id: str) -> None:
        try:
            self.api.remove_container(container_id, force=True, v=False)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            # "removal already in progress" is success for an idempotent remove.
            if exc.status_code != 409 or "in progress" not in str(exc):
                raise

    def _volume_names(self, crew: str) -> dict[str, str]:
        """The crew's volumes: a crew from before instance ids keeps each former one that is
        still there; anything else is named and labelled with the instance."""
        names = volume_names(self._instance(), crew)
        if crew in self._legacy_crews:
            for target, volume in legacy_volume_names(crew).items():
                if self._legacy_volume(crew, volume):
                    names[target] = volume
        return names

    def _legacy_volume(self, crew: str, name: str) -> bool:
        try:
            labels = self.api.inspect_volume(name).get("Labels") or {}
        except docker.errors.NotFound:
            return False
        return (
            labels.get(LABEL_APPLIANCE) == LABELS_OWNER_VALUE
            and labels.get(LABEL_CREW) == crew
            and LABEL_INSTANCE not in labels
        )

    def _volume(self, crew: str, name: str) -> bool:
        """Make sure the crew's volume exists; True if this call created it."""
        instance = self._instance()
        try:
            volume = self.api.inspect_volume(name)
        except docker.errors.NotFound:
            self.api.create_volume(name, labels=volume_labels(instance, crew))
            return True
        labels = volume.get("Labels") or {}
        if labels != volume_labels(instance, crew) and not (
            crew in self._legacy_crews and self._legacy_volume(crew, name)
        ):
            raise RuntimeError(f"volume {name} exists but is not this crew's (labels {labels})")
        return False

    def _remove_volume(self, name: str) -> None:
        try:
            self.api.remove_volume(name, force=True)
        except docker.errors.NotFound:
            pass

    def _crew_volumes(self, crew: str) -> list[str]:
        instance = self._instance()
        found = self._call(
            "list volumes",
            lambda: self.api.volumes(
                filters={
                    "label": [
                        f"{LABEL_APPLIANCE}={LABELS_OWNER_VALUE}",
                        f"{LABEL_INSTANCE}={instance}",
                        f"{LABEL_CREW}={crew}",
                    ]
                }
            ),
        )
        names = [v["Name"] for v in (found.get("Volumes") or [])]
        if crew in self._legacy_crews:
            names += [
                volume
                for volume in legacy_volume_names(crew).values()
                if self._legacy_volume(crew, volume)
            ]
        return names


class _Rollback:
    """Runs named steps; on failure undoes the recorded ones in reverse order, then raises
    CrewContainerError naming the step."""

    def __init__(self, crew: str) -> None:
        self.crew = crew
        self.undos: list[Callable[[], object]] = []

    def __enter__(self) -> _Rollback:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, CrewContainerError):
            # KeyboardInterrupt or a bug between steps: undo, then let it propagate as is.
            self._undo()

    def step(self, name: str, work: Callable[[], Any]) -> Any:
        try:
            return work()
        except BaseException as exc:
            errors = self._undo()
            if not isinstance(exc, Exception):
                raise
            raise CrewContainerError(self.crew, name, exc, rollback_errors=errors) from exc

    def undo(self, action: Callable[[], object]) -> None:
        self.undos.append(action)

    def _undo(self) -> list[str]:
        errors = []
        while self.undos:
            action = self.undos.pop()
            try:
                action()
            except Exception as exc:
                errors.append(str(exc))
        return errors


def _next_frame(
    frames: Iterator[tuple[bytes | None, bytes | None]],
) -> tuple[bytes | None, bytes | None] | None:
    try:
        return next(frames)
    except StopIteration:
        return None
    except (OSError, ValueError):
        return None  # the stream was closed under us (kill or cancellation)


def _cgroups_hybrid(info: dict[str, Any]) -> bool:
    """cgroup v1 controllers with a v2 hierarchy mounted beside them (as on this machine)."""
    if str(info.get("CgroupVersion", "1")) != "1":
        return False
    try:
        mounts = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return False
    return any(" - cgroup2 " in line for line in mounts.splitlines())


_CONTAINER_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")


def _pid_namespace(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _parent(pid: int | str) -> str | None:
    try:
        # /proc/PID/stat: "pid (comm) state ppid ...", comm may hold spaces and parentheses.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None


def _of_this_pid_namespace(pid: str, ours: str | None) -> bool:
    """Whether a process belongs to the engine of this PID namespace: it lives in it, or its
    parent does (a gVisor sandbox is pid 1 of a namespace of its own, its parent is ours).

    /proc shows every process of the host, including those of another Docker engine running in a
    container (a nested dockerd, a CI runner's, a test machine's): their shims and sandboxes
    name container ids our engine does not know, yet they are not ours to kill. They live, with
    their parents, in that container's PID namespace.
    """
    if ours is None:
        return True
    if _pid_namespace(pid) == ours:
        return True
    parent = _parent(pid)
    return parent is not None and _pid_namespace(parent) == ours


def runtime_processes() -> list[StrayProcess]:
    """runsc sandbox/gofer processes and containerd shims of this PID namespace's engines, with
    their container id.

    runsc's processes name their container in the bundle and log paths
    (.../io.containerd.runtime.v2.task/moby/<id>); a shim has `-id <id>`.
    """
    found = []
    ours = _pid_namespace("self")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if not args:
            continue
        program = os.path.basename(args[0])
        if program in ("runsc-sandbox", "runsc-gofer"):
            kind = program
        elif program == "runsc" and ("boot" in args or "gofer" in args):
            kind = "runsc"
        elif program.startswith("containerd-shim") and "moby" in args:
            kind = "shim"  # only the Docker engine's namespace ("moby"), not another client's
        else:
            continue
        match = _CONTAINER_ID.search(" ".join(args))
        if match and _of_this_pid_namespace(entry.name, ours):
            found.append(StrayProcess(int(entry.name), kind, match.group(0), " ".join(args)[:300]))
    return found
