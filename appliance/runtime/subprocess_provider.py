"""`SubprocessProvider`: agents as plain host processes. NO ISOLATION.

Theory of operation
-------------------
This provider exists for hosts where no container engine can run (a developer's laptop without
Docker, a CI job inside a container). It is chosen only by explicit configuration, never as a
fallback, and every message and log line it writes says "no isolation":

- There is no pod. `create_infra` creates nothing and returns a `Pod` whose `infra_pid` is 0, so
  its `netns_path` (/proc/0/ns/net) does not exist: `netns.CrewNetworks.attach` on it fails, and
  the control plane must not try (it checks `provider.isolated`). No kernel rule stands between
  the agent and the network; the only thing steering it to the proxy is the proxy environment
  variables of the crew spec, which any program may ignore.
- The agent runs with the appliance's own user, capabilities and filesystem view. No UID
  boundary, no read-only root, no limits beyond the kill on timeout.

What it does do properly: `exec` runs the argv directly (no shell) with a clean environment
(PATH, HOME in a per-crew directory, the crew's env, the call's env; nothing inherited from the
appliance, so none of its secrets), in a new session, streams lines per stream, and on timeout
or cancellation kills the whole process group.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import signal
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from netns.addressing import check_crew_id
from netns.errors import NetConfigError

from .base import ContainerRole, CrewSpec, ExecExited, ExecOutput, OwnedContainer, Pod
from .errors import CrewContainerError, InvalidSpec, check_exec_arguments
from .streams import LineSplitter

log = logging.getLogger(__name__)

NO_ISOLATION = "no isolation"
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
READ_CHUNK = 65536
POLL_INTERVAL = 0.2  # how often a reader thread checks whether it was told to stop
KILL_WAIT = 5.0


class SubprocessProvider:
    """Agents as host processes: NO ISOLATION (no container, no network enforcement)."""

    name = "subprocess"
    isolated = False

    def __init__(self, base_dir: str | os.PathLike[str] | None = None) -> None:
        self.base_dir = Path(base_dir or tempfile.gettempdir()) / "appliance-subprocess-crews"
        self._crews: dict[str, CrewSpec] = {}
        self._lock = threading.Lock()
        log.warning("runtime provider 'subprocess' selected: %s", NO_ISOLATION)

    def runtimes(self) -> tuple[str, ...]:
        return ()

    def create_infra(self, spec: CrewSpec) -> Pod:
        self._check(spec)
        log.warning(
            "crew %s: %s: no pod, no network namespace; only the proxy variables steer traffic",
            spec.name,
            NO_ISOLATION,
        )
        return Pod(crew=spec.name, infra_id="", infra_pid=0, runtime=f"none ({NO_ISOLATION})")

    def start_agent(self, spec: CrewSpec, pod: Pod) -> str:
        self._check(spec)
        if spec.mounts:
            raise InvalidSpec("mounts", f"the subprocess provider ({NO_ISOLATION}) has no mounts")
        self.home(spec.name).mkdir(parents=True, exist_ok=True, mode=0o700)
        with self._lock:
            self._crews[spec.name] = spec
        log.warning("crew %s: agent runs as host processes (%s)", spec.name, NO_ISOLATION)
        return f"subprocess:{spec.name}"

    def home(self, crew: str) -> Path:
        return self.base_dir / crew / "home"

    def remove_crew(self, crew: str, *, volumes: bool = False) -> None:
        with self._lock:
            self._crews.pop(crew, None)
        if volumes:
            import shutil

            shutil.rmtree(self.base_dir / crew, ignore_errors=True)

    def bind_instance(self, instance: str) -> None:
        """Nothing carries it: this provider's crews are this process's children."""

    def adopt(self, container_ids: set[str], legacy_crews: set[str]) -> None:
        """Nothing to adopt: this provider's crews live as long as its process."""

    def owned(self) -> list[OwnedContainer]:
        with self._lock:
            return [
                OwnedContainer(crew, ContainerRole.AGENT, f"subprocess:{crew}", True)
                for crew in self._crews
            ]

    async def exec(
        self,
        crew: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[ExecOutput | ExecExited]:
        check_exec_arguments(argv, timeout)
        with self._lock:
            spec = self._crews.get(crew)
        if spec is None:
            raise CrewContainerError(crew, "exec", "no agent started", rolled_back=False)
        environment = {
            "PATH": DEFAULT_PATH,
            **spec.env,
            "HOME": str(self.home(crew)),
            **(env or {}),
        }
        log.info("crew %s: exec %s (%s)", crew, argv[0], NO_ISOLATION)
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=environment,
                cwd=self.home(crew),
                start_new_session=True,  # its own process group: killed as a whole
            )
        except OSError as exc:
            raise CrewContainerError(crew, "exec", exc, rolled_back=False) from exc
        reader = _PipeReader(process)
        lines = LineSplitter()
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        done = False
        try:
            while True:
                chunk: tuple[str, bytes] | None = None
                timed_out = True
                with trio.move_on_at(deadline):
                    chunk = await trio.to_thread.run_sync(reader.next, abandon_on_cancel=True)
                    timed_out = False
                if timed_out:
                    _kill_group(process)
                    reader.stop()
                    done = True
                    for out in lines.flush():
                        yield out
                    yield ExecExited(exit_code=-1, timed_out=True)
                    return
                if chunk is None:
                    break
                for out in lines.feed(*chunk):
                    yield out
            done = True
            for out in lines.flush():
                yield out
            code = await trio.to_thread.run_sync(process.wait)
            # A process killed by a signal: report it as a shell would (128 + signal number).
            yield ExecExited(exit_code=code if code >= 0 else 128 - code)
        finally:
            reader.stop()
            if not done:
                _kill_group(process)
            with trio.CancelScope(shield=True), trio.move_on_after(KILL_WAIT):
                await trio.to_thread.run_sync(process.wait)

    def _check(self, spec: CrewSpec) -> None:
        try:
            check_crew_id(spec.name)
        except NetConfigError as exc:
            raise InvalidSpec("name", str(exc)) from None


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class _PipeReader:
    """Reads stdout and stderr of a process, one chunk per call, from a worker thread.

    select() with a short timeout, so a thread abandoned on cancellation notices `stop()` even
    if a grandchild that left the process group still holds a pipe open. The pipes are closed
    by whoever is last: the reader thread if one is inside `next()`, else `stop()` itself, so a
    descriptor is never closed under a select() (and then reused by something else).
    """

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None and process.stderr is not None
        self._files = {
            process.stdout.fileno(): process.stdout,
            process.stderr.fileno(): process.stderr,
        }
        self._names = {process.stdout.fileno(): "stdout", process.stderr.fileno(): "stderr"}
        self._lock = threading.Lock()
        self._stopped = False
        self._busy = False

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if not self._busy:
                self._close_all()

    def next(self) -> tuple[str, bytes] | None:
        with self._lock:
            if self._stopped:
                return None
            self._busy = True
        try:
            while self._files:
                with self._lock:
                    if self._stopped:
                        break
                ready, _, _ = select.select(list(self._files), [], [], POLL_INTERVAL)
                for fd in ready:
                    try:
                        data = os.read(fd, READ_CHUNK)
                    except OSError:
                        data = b""
                    if data:
                        return self._names[fd], data
                    self._files.pop(fd).close()
            return None
        finally:
            with self._lock:
                self._busy = False
                if self._stopped:
                    self._close_all()

    def _close_all(self) -> None:
        for file in self._files.values():
            with contextlib.suppress(OSError):
                file.close()
        self._files.clear()
