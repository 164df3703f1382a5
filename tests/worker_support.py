"""Real proxy workers as applianced runs them, without applianced and without Docker.

- `unreadable_interpreter`: a copy of the running Python's base interpreter (the executable,
  libpython if shared, the standard library without site-packages and test/) in a root-owned
  0700 directory, with the environment that runs the workers from it (PYTHONPATH: this checkout
  and the virtualenv's site-packages). Before their privilege drop the workers (root) read it;
  after it (UID 1002) they cannot, as with a Python built under /root (pyenv). On a machine
  whose Python is a world-readable Debian python3 this reproduces the same condition.
- `PoolThread`: `appliance.daemon.proxy.ProxyPool` (real worker processes, the real drop to
  UID 1002, crews' listeners bound by the parent) and, optionally, applianced's real keeper
  channel, in a trio loop on a thread of its own, so that a test drives them with ordinary
  blocking sockets; the workers' events are collected as they arrive.
- `http_exchange` / `Answer`: one request on a raw socket, the answer read to EOF; `readable`
  holds a refusal to a status and a JSON body that says why.
- `RawUpstream` (an upstream that answers garbage, or nothing), `StubKeeperService` (the
  keeper's decisions without the store and the model), `pool_config`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from appliance.daemon.proxy import ProxyPool
from appliance.keeper.channel import KeeperChannel
from appliance.keeper.service import Answer as KeeperAnswer
from proxycore.config import ProxyConfig, parse_config
from proxycore.protocol.keeper import Action

ROOT = Path(__file__).resolve().parent.parent
WORKER_IDS = (1002, 1002)
T = TypeVar("T")

# Not needed by a worker, and half the standard library's size.
_SKIPPED = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo"}
_SKIPPED |= {"ensurepip", "lib2to3"}


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)  # same file system: instant, and the same bytes
    except OSError:
        shutil.copy2(source, destination)


def unreadable_interpreter(directory: Path) -> tuple[str, dict[str, str]]:
    """Copy the base interpreter under `directory` (made root-owned 0700); returns its
    executable and the environment that runs `-m proxycore.worker` from it."""
    os.chown(directory, 0, 0)
    os.chmod(directory, 0o700)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    lib = directory / "lib"
    stdlib = lib / version
    shutil.copytree(
        sysconfig.get_paths()["stdlib"],
        stdlib,
        ignore=lambda _, names: [name for name in names if name in _SKIPPED],
        copy_function=_link_or_copy,
        symlinks=True,
    )
    dynload = sysconfig.get_config_var("DESTSHARED")
    if dynload and not (stdlib / "lib-dynload").exists():
        shutil.copytree(dynload, stdlib / "lib-dynload", copy_function=_link_or_copy)
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        name = sysconfig.get_config_var("INSTSONAME")
        _link_or_copy(os.path.join(sysconfig.get_config_var("LIBDIR"), name), str(lib / name))
    (directory / "bin").mkdir()
    python = directory / "bin" / version
    _link_or_copy(os.path.realpath(sys.executable), str(python))
    site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *sorted(site)]),
        "PYTHONNOUSERSITE": "1",
        # A RUNPATH (pyenv's points at the original) yields to LD_LIBRARY_PATH.
        "LD_LIBRARY_PATH": str(lib),
    }
    return str(python), env


def as_worker_uid(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run argv as UID/GID 1002, no supplementary group: what a worker can read."""

    def become() -> None:
        os.setgroups([])
        os.setresgid(WORKER_IDS[1], WORKER_IDS[1], WORKER_IDS[1])
        os.setresuid(WORKER_IDS[0], WORKER_IDS[0], WORKER_IDS[0])

    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, preexec_fn=become)


class PoolThread:
    """A ProxyPool (and a keeper channel) run by a trio loop on a thread of their own."""

    def __init__(self, pool: ProxyPool, keeper: KeeperChannel | None = None) -> None:
        self.pool = pool
        self.keeper = keeper
        self.events: dict[int, bytearray] = {}
        pool.events_reader = self._read_events
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._keeper_scope: trio.CancelScope | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    async def _read_events(self, stream: trio.SocketStream, index: int) -> None:
        async with stream:
            async for chunk in stream:
                self.events.setdefault(index, bytearray()).extend(chunk)

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:  # re-raised in the test's thread by stop()
            self._error = exc
        finally:
            self._started.set()

    async def _run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            if self.keeper is not None:
                self._keeper_scope = await nursery.start(self._serve_keeper, self.keeper)
            await nursery.start(self.pool.run)
            self._started.set()

    async def _serve_keeper(
        self, keeper: KeeperChannel, *, task_status: trio.TaskStatus[trio.CancelScope]
    ) -> None:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(keeper.serve, self.pool.drop_to)
                task_status.started(scope)

    def start(self) -> PoolThread:
        self._thread.start()
        if not self._started.wait(60) or self._error is not None:
            self.stop()
            raise AssertionError("the pool did not start") from self._error
        return self

    def call(self, function: Callable[..., Awaitable[T]], *args: Any) -> T:
        return trio.from_thread.run(function, *args, trio_token=self._token)

    def stop_keeper(self) -> None:
        scope = self._keeper_scope
        if scope is not None:
            trio.from_thread.run_sync(scope.cancel, trio_token=self._token)

    def stop(self) -> None:
        """Cancel everything: the pool closes the workers' channels, they stop (5 s each)."""
        if self._scope is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(30)
        if self._error is not None and not isinstance(self._error, trio.Cancelled):
            raise self._error

    def decoded_events(self) -> list[dict[str, Any]]:
        return [
            json.loads(line)
            for data in self.events.values()
            for line in bytes(data).splitlines()
            if line.strip()
        ]


@dataclass
class Answer:
    status: int
    head: bytes
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: bytes) -> bytes | None:
        for line in self.head.split(b"\r\n")[1:]:
            field, _, value = line.partition(b":")
            if field.strip().lower() == name:
                return value.strip()
        return None


def http_exchange(
    address: tuple[str, int], data: bytes | Iterable[bytes], *, timeout: float = 15
) -> Answer:
    """Send `data` (or each piece of it), read to EOF; the first response only."""
    with socket.create_connection(address, timeout=timeout) as sock:
        for piece in [data] if isinstance(data, bytes) else data:
            sock.sendall(piece)
        received = bytearray()
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return parse_answer(bytes(received))


def parse_answer(received: bytes) -> Answer:
    assert received.startswith(b"HTTP/1."), received[:300]
    head, _, body = received.partition(b"\r\n\r\n")
    answer = Answer(int(head[9:12]), head, body)
    if answer.header(b"transfer-encoding") == b"chunked":
        answer.body = _dechunk(body)
    elif (length := answer.header(b"content-length")) is not None:
        answer.body = body[: int(length)]
    return answer


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        data = rest[size + 2 :]


class RawUpstream:
    """A loopback TCP server that answers every connection with `answer` (None: never)."""

    def __init__(self, answer: bytes | None) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.answer is None:
                self.held.append(conn)  # silent: read nothing, answer nothing
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                    conn.sendall(self.answer)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


class StubKeeperService:
    """applianced's keeper decisions (KeeperService.handle), minus the store and the model."""

    def __init__(self) -> None:
        self.calls: list[tuple[Action, str, object]] = []

    async def handle(self, action: Action, crew: str, body: bytes) -> tuple[int, KeeperAnswer]:
        self.calls.append((action, crew, json.loads(body)))
        if action is Action.REQUEST:
            return 200, KeeperAnswer("allow", "granted by the test", value="kept-value")
        return 200, KeeperAnswer("allow", "ran", exit_code=0, stdout="h\u00e9llo\n")


def readable(answer: Answer, statuses: Collection[int], what: object) -> dict[str, object]:
    assert answer.status in statuses, (what, answer.status, answer.body[:300])
    assert answer.header(b"content-type") == b"application/json", (what, answer.head)
    body = answer.json()
    assert isinstance(body, dict) and body.get("error"), (what, body)
    return body


def get(target: bytes, host: bytes = b"x", extra: bytes = b"") -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n%s\r\n" % (target, host, extra)


def post(target: bytes, body: bytes = b"{}", extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n%s\r\n%s" % (target, len(body), extra, body)
    )


def read_to_eof(sock: socket.socket) -> bytes:
    data = bytearray()
    sock.settimeout(5)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return bytes(data)


def pool_config(
    port: int, provider_port: int, ca_file: str, ports: dict[str, int], *, per_crew: int
) -> ProxyConfig:
    """The fake providers (no key of their own), the test upstreams' names in the static
    table, short timeouts."""
    resolve = {
        name: "127.0.0.1"
        for name in (
            "api.anthropic.test",
            "api.openai.test",
            "generativelanguage.googleapis.test",
            "plain.test",
            "bad.test",
            "silent.test",
            "closed.test",
        )
    }
    resolve |= {"metadata.test": "169.254.169.254", "private.test": "10.1.2.3"}
    return parse_config(
        f"""
[listen]
port = {port}

[limits]
head_timeout = 1.0
read_timeout = 2.0
max_connections_per_crew = {per_crew}

# No key of its own, as under applianced: the keys come from the store (credentials_set), so
# the first grant compiles the scrubber after the drop.
[providers.anthropic]
base_url = "https://api.anthropic.test:{provider_port}"

[providers.openai]
base_url = "https://api.openai.test:{provider_port}/v1"

[providers.google]
base_url = "https://generativelanguage.googleapis.test:{provider_port}"

[upstream]
ca_file = "{ca_file}"
ssrf_allow = ["127.0.0.0/8"]
resolve = {json.dumps(resolve).replace('":', '" =')}
""",
        source=f"ports {ports}",
    )
