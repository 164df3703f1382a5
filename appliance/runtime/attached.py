"""An exec attached as `docker exec -i -t` attaches one: stdin, a TTY, signals, window size.

Theory of operation
-------------------
The exec is created with AttachStdin (when asked) and Tty (when asked) and started with the
engine's hijacked connection (`POST /exec/ID/start` upgraded to a raw stream, as the docker CLI
does). Output arrives on it raw with a TTY, else multiplexed (8-byte headers: stream, size;
`Demux` below). Input goes the other way; the end of input is a half-close (shutdown SHUT_WR),
which the engine turns into EOF on the command's stdin, as `docker exec -i` does.

Signals: the engine has no "signal an exec" call. The command runs under the provider's wrapper
(docker.py), which records its pid (a process group leader) in /tmp; a second exec sends the
signal to that group (`kill -SIG -PID`). With a TTY, Ctrl-C needs none of this: the client's
terminal is raw, the byte 0x03 reaches the crew's TTY, and its line discipline signals the
foreground group, as in any terminal. Window size: the engine's exec resize call.

The first event is `ExecAttached(handle)` (the input side); then output chunks as they come
(`ExecOutput`, not cut into lines: a TTY's output is a byte stream), then `ExecExited`. A
deadline, a cancellation or a consumer that stops reading kills the command (the wrapper's
group and every process carrying the exec's marker), as for the line-based exec.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal as signals
import socket
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

import docker.errors
import trio

from .base import ExecAttached, ExecExited, ExecOutput
from .errors import CrewContainerError

if TYPE_CHECKING:
    from .docker import DockerProvider

RECV = 65536
KILL_WAIT = 10.0
_STREAMS = {1: "stdout", 2: "stderr"}
# Send a signal to the wrapper's process group (its pid recorded by docker.EXEC_WRAPPER).
EXEC_SIGNALLER = (
    'f=/tmp/.appliance-exec-"$1".pid; [ -r "$f" ] || exit 0; p=$(cat "$f"); '
    'kill -s "$2" -"$p" 2>/dev/null || kill -s "$2" "$p" 2>/dev/null; exit 0'
)


class Demux:
    """The engine's multiplexed stream (no TTY): bytes in, (stream, chunk) out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        buffer = self._buffer
        buffer += data
        out: list[tuple[str, bytes]] = []
        start = 0
        while len(buffer) - start >= 8:
            kind = buffer[start]
            size = int.from_bytes(buffer[start + 4 : start + 8], "big")
            if len(buffer) - start - 8 < size:
                break
            chunk = bytes(buffer[start + 8 : start + 8 + size])
            if chunk:
                out.append((_STREAMS.get(kind, "stdout"), chunk))
            start += 8 + size
        del buffer[:start]
        return out


class _NoStream:
    def close(self) -> None:
        pass


class _Input:
    """The exec's input side (base.AttachedExec)."""

    def __init__(
        self, provider: DockerProvider, sock: trio.socket.SocketType, ids: tuple[str, str, str]
    ) -> None:
        self.provider = provider
        self.sock = sock
        self.container_id, self.exec_id, self.token = ids
        self.stdin_open = True

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view and self.stdin_open:
            view = view[await self.sock.send(view) :]

    async def close_stdin(self) -> None:
        if self.stdin_open:
            self.stdin_open = False
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)

    async def signal(self, signum: int) -> None:
        try:
            name = signals.Signals(signum).name.removeprefix("SIG")
        except ValueError:
            return
        await trio.to_thread.run_sync(self._signal, name)

    def _signal(self, name: str) -> None:
        api = self.provider.api
        command = ["/bin/sh", "-c", EXEC_SIGNALLER, "appliance-signal", self.token, name]
        with contextlib.suppress(docker.errors.DockerException):
            created = api.exec_create(self.container_id, command)
            api.exec_start(created["Id"])

    async def resize(self, rows: int, columns: int) -> None:
        if rows and columns:
            with contextlib.suppress(docker.errors.DockerException):
                await trio.to_thread.run_sync(
                    lambda: self.provider.api.exec_resize(self.exec_id, height=rows, width=columns)
                )


def _open(
    provider: DockerProvider,
    crew: str,
    command: list[str],
    environment: dict[str, str],
    stdin: bool,
    tty: bool,
) -> tuple[str, str, socket.socket]:
    """Create and start the exec on a hijacked connection: (container, exec, our socket)."""
    api = provider.api
    container_id = provider.agent_container(crew)
    options = {"environment": environment, "stdout": True, "stderr": True, "stdin": stdin}
    try:
        created = api.exec_create(container_id, command, tty=tty, **options)
    except docker.errors.APIError as exc:
        # Gone (404) or not running (409): the remembered id is stale; look up once more.
        if exc.status_code not in (404, 409) or provider._agents.pop(crew, None) is None:
            raise CrewContainerError(crew, "exec", exc, rolled_back=False) from exc
        container_id = provider.agent_container(crew)
        try:
            created = api.exec_create(container_id, command, tty=tty, **options)
        except docker.errors.DockerException as exc:
            raise CrewContainerError(crew, "exec", exc, rolled_back=False) from exc
    except docker.errors.DockerException as exc:
        raise CrewContainerError(crew, "exec", exc, rolled_back=False) from exc
    exec_id = str(created["Id"])
    try:
        hijacked = api.exec_start(exec_id, tty=tty, socket=True)
    except docker.errors.DockerException as exc:
        raise CrewContainerError(crew, "exec", exc, rolled_back=False) from exc
    # docker-py hands back its connection's socket (wrapped in a SocketIO); ours is a
    # duplicate of it, owned here, so that trio can wait on it and docker-py's objects can go.
    raw = getattr(hijacked, "_sock", hijacked)
    sock = socket.socket(fileno=os.dup(raw.fileno()))
    with contextlib.suppress(Exception):
        hijacked.close()
    return container_id, exec_id, sock


async def exec_attached(
    provider: DockerProvider,
    crew: str,
    command: list[str],
    environment: dict[str, str],
    token: str,
    *,
    timeout: float | None,
    stdin: bool,
    tty: bool,
    size: tuple[int, int] | None,
) -> AsyncGenerator[ExecAttached | ExecOutput | ExecExited, None]:
    """`command`: the argv under the provider's wrapper, whose pid file is named by `token`
    (docker.py's EXEC_WRAPPER; the arguments are checked there)."""
    container_id, exec_id, plain = await trio.to_thread.run_sync(
        _open, provider, crew, command, environment, stdin, tty
    )
    sock = trio.socket.from_stdlib_socket(plain)
    handle = _Input(provider, sock, (container_id, exec_id, token))
    deadline = math.inf if timeout is None else trio.current_time() + timeout
    demux = None if tty else Demux()
    done = False

    async def kill() -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(KILL_WAIT):
            # The socket is trio's to close (below), not the killer's.
            await trio.to_thread.run_sync(provider._kill_exec, container_id, token, _NoStream())

    try:
        if not stdin:
            handle.stdin_open = False  # nothing attached to write to
        if tty and size is not None:
            await handle.resize(*size)
        yield ExecAttached(handle)
        while True:
            data = None
            with trio.move_on_at(deadline):
                try:
                    data = await sock.recv(RECV)
                except OSError:
                    data = b""
            if data is None:  # the deadline passed
                await kill()
                done = True
                yield ExecExited(exit_code=-1, timed_out=True)
                return
            if not data:
                break
            if demux is None:
                yield ExecOutput("stdout", data)
            else:
                for stream, chunk in demux.feed(data):
                    yield ExecOutput(stream, chunk)
        done = True
        code = await trio.to_thread.run_sync(provider._exec_exit_code, crew, exec_id)
        yield ExecExited(exit_code=code)
    finally:
        if not done:
            # Cancelled, or the consumer stopped reading: the process must not outlive it.
            await kill()
        sock.close()
