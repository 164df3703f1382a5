"""The chaos suite's world: namespaces, peers, a real worker pool, and the invariants.

Theory of operation
-------------------
Everything is real and on this machine: `ChaosWorld` (tests/chaos_world.py, one per test module)
makes the namespaces of crews A and B and of the peers.

Each test then starts a real `ProxyPool` (appliance/daemon/proxy.py) as applianced does: two
workers, dropped to UID/GID 1002, whose event lines are collected per worker, and hands it the
two crews (`add_crew` binds each gateway and sends the listener down). Crew B runs a steady
legitimate stream (tests/chaos_client.py, in crew B's namespace) while the test attacks from
crew A with sockets created inside crew A's namespace (`crew_sockets`), driven by trio here.
`check` then asserts the suite's invariants and reports every violation at once:

1. the workers' pids are those the pool started with, and the pool restarted none;
2. crew B's requests all succeeded, within LEGIT_MAX_LATENCY each;
3. per crew, requests that reached the proxy == terminal events (request_allowed, _denied,
   _refused, _errored), and tunnel_opened == tunnel_closed;
4. every worker's peak resident memory (VmHWM) stays under MEMORY_BUDGET.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from tests import chaos_peers as peers
from tests.chaos_http import Reader, Response
from tests.chaos_world import ChaosWorld, crew_sockets

HERE = Path(__file__).resolve().parent
PORT = 9119  # the gateways' port (the addresses are the test's own)
WORKERS = 2
WORKER_IDS = (1002, 1002)
# Peak resident memory of one worker (VmHWM). Measured on this machine (Python 3.11): a worker
# peaks at 32-34 MiB through every attack here that today's code survives; 256 MiB leaves room
# for buffers that are bounded per connection and per crew, and none for bodies held whole.
MEMORY_BUDGET = 256 * 1024 * 1024
LEGIT_MAX_LATENCY = 1.0  # seconds, from a request's due time to its response's last byte
LEGIT_RATE = 20.0
TERMINAL = ("request_allowed", "request_denied", "request_refused", "request_errored")
# The short timeouts every chaos pool runs with (seconds), so each attack ends in bounded time.
LIMITS: dict[str, Any] = {
    "head_timeout": 2.0,
    "read_timeout": 2.0,
    "idle_keepalive_timeout": 4.0,
    "connect_timeout": 2.0,
    "tunnel_idle_timeout": 3.0,
}
PEER_NAME = "peer.chaos.test"


# --- configuration -----------------------------------------------------------------------------


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def config_text(world: ChaosWorld, limits: dict[str, Any], upstream: dict[str, Any]) -> str:
    sections = {
        "limits": {**LIMITS, **limits},
        "upstream": {
            "ssrf_allow": [f"{world.peer}/32"],
            "resolve": {PEER_NAME: world.peer},
            **upstream,
        },
        "events": {"flush_interval": 0.05},
    }
    return "\n".join(
        f"[{name}]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in table.items())
        for name, table in sections.items()
    )


# --- the pool ---------------------------------------------------------------------------------


class EventLog:
    """Every event line of every worker, decoded (as plain dicts: new kinds need no type)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.undecodable: list[bytes] = []

    async def read(self, stream: trio.SocketStream, index: int) -> None:
        pending = b""
        while data := await stream.receive_some(65536):
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                try:
                    event = msgspec.json.decode(line)
                except msgspec.DecodeError:
                    self.undecodable.append(line)
                    continue
                if isinstance(event, dict):
                    event["_worker"] = index
                    self.events.append(event)
        await stream.aclose()

    def of(self, crew: str, *kinds: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("crew") == crew and e.get("event") in kinds]

    def terminal(self, crew: str) -> list[dict[str, Any]]:
        return self.of(crew, *TERMINAL)

    def summary(self, crew: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for event in self.events:
            if event.get("crew") == crew:
                counts[event["event"]] = counts.get(event["event"], 0) + 1
        return counts


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class LegitRun:
    """Crew B's stream, as its client reported it when stopped."""

    result: dict[str, Any] = field(default_factory=dict)


@dataclass
class Chaos:
    world: ChaosWorld
    pool: Any  # appliance.daemon.proxy.ProxyPool
    events: EventLog
    pids: tuple[int, ...]
    crew_a: str = "chaos-a"
    crew_b: str = "chaos-b"

    def a_sockets(self, count: int = 1) -> list[socket.socket]:
        return crew_sockets(self.world.ns_a, count)

    async def connect_a(self) -> trio.SocketStream:
        """A connection from inside crew A to crew A's gateway."""
        sock = trio.socket.from_stdlib_socket(self.a_sockets()[0])
        try:
            await sock.connect((self.world.gateway_a, PORT))
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)

    @contextlib.asynccontextmanager
    async def legit(
        self,
        url: str | None = None,
        *,
        rate: float = LEGIT_RATE,
        lead: float = 0.5,
        trail: float = 0.5,
        max_seconds: float = 60.0,
        keepalive: int = 1,
        fresh: int = 1,
        prefix: tuple[str, ...] = (),
    ) -> AsyncIterator[LegitRun]:
        """Crew B's legitimate stream for the length of the `async with` body (plus `lead`
        seconds before it and `trail` after); `prefix` goes before the command (`nice`)."""
        url = url or f"http://{PEER_NAME}:{peers.OK}/ok"
        argv = [
            *prefix, "ip", "netns", "exec", self.world.ns_b, sys.executable,
            str(HERE / "chaos_client.py"), "--proxy", f"{self.world.gateway_b}:{PORT}",
            "--url", url, "--rate", str(rate), "--max-seconds", str(max_seconds),
            "--keepalive", str(keepalive), "--fresh", str(fresh),
        ]  # fmt: skip
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        run = LegitRun()
        output = bytearray()
        assert process.stdout is not None and process.stdin is not None
        try:
            with trio.fail_after(20):
                while b"\n" not in output:
                    data = await process.stdout.receive_some(65536)
                    if not data:
                        raise RuntimeError("the legit client exited before it was ready")
                    output += data
            assert output.startswith(b"ready"), output
            await trio.sleep(lead)
            yield run
            await trio.sleep(trail)
        finally:
            with trio.CancelScope(shield=True):
                await process.stdin.aclose()
                with trio.move_on_after(30):
                    while data := await process.stdout.receive_some(65536):
                        output += data
                if process.returncode is None:
                    process.kill()
                await process.wait()
        run.result = json.loads(output.splitlines()[-1])

    def worker_pids(self) -> tuple[int, ...]:
        return tuple(self.pool.pids)

    async def settle(self, expected: dict[str, int], timeout: float = 15.0) -> None:
        """Wait until each crew's terminal events reach their expected counts and every tunnel
        has closed (or `timeout`), then a little longer, for any event in excess to show."""
        with trio.move_on_after(timeout):
            while not all(
                len(self.events.terminal(crew)) >= count for crew, count in expected.items()
            ) or any(
                len(self.events.of(crew, "tunnel_opened"))
                > len(self.events.of(crew, "tunnel_closed"))
                for crew in expected
            ):
                await trio.sleep(0.05)
        await trio.sleep(0.4)

    async def check(
        self,
        *,
        a_requests: int,
        legit: LegitRun | None,
        problems: list[str] | None = None,
        min_legit: int = 10,
        max_latency: float = LEGIT_MAX_LATENCY,
        settle_timeout: float = 15.0,
    ) -> None:
        """Assert the invariants (module docstring), with the attack's own `problems`."""
        problems = list(problems or [])
        expected = {self.crew_a: a_requests}
        if legit is not None:
            expected[self.crew_b] = int(legit.result.get("sent", 0))
        await self.settle(expected, settle_timeout)
        now = self.worker_pids()
        if now != self.pids or self.pool.restarts:
            problems.append(
                f"invariant 1: worker pids {self.pids} -> {now}, "
                f"{self.pool.restarts} restart(s): a worker died"
            )
        if legit is not None:
            result = legit.result
            latency = result.get("latency_ms", {})
            if result.get("failure_count") or result.get("ok") != result.get("sent"):
                problems.append(
                    f"invariant 2: crew B: {result.get('ok')} of {result.get('sent')} requests "
                    f"succeeded; failures: {result.get('failures')}"
                )
            if result.get("sent", 0) < min_legit:
                problems.append(f"invariant 2: crew B sent only {result.get('sent')} requests")
            if not latency.get("max", 1e9) <= max_latency * 1e3:
                problems.append(
                    f"invariant 2: crew B latency p50 {latency.get('p50')} ms, p99 "
                    f"{latency.get('p99')} ms, max {latency.get('max')} ms "
                    f"(limit {max_latency * 1e3:.0f} ms)"
                )
        for crew, count in expected.items():
            terminal = len(self.events.terminal(crew))
            if terminal != count:
                problems.append(
                    f"invariant 3: crew {crew}: {count} requests reached the proxy, "
                    f"{terminal} terminal events; events seen: {self.events.summary(crew)}"
                )
            opened = len(self.events.of(crew, "tunnel_opened"))
            closed = len(self.events.of(crew, "tunnel_closed"))
            if opened != closed:
                problems.append(
                    f"invariant 3: crew {crew}: {opened} tunnel_opened, {closed} tunnel_closed"
                )
        for pid in now:
            with contextlib.suppress(OSError):
                peak = memory(pid)["VmHWM"]
                if peak > MEMORY_BUDGET:
                    problems.append(
                        f"invariant 4: worker {pid} peaked at {peak >> 20} MiB "
                        f"(budget {MEMORY_BUDGET >> 20} MiB)"
                    )
        peaks = {pid: memory(pid)["VmHWM"] >> 20 for pid in now if Path(f"/proc/{pid}").exists()}
        # Shown with -s or -rA (the figures the report and docs quote).
        print(
            f"chaos: crew A {a_requests} requests {self.events.summary(self.crew_a)}; crew B "
            f"{legit.result.get('latency_ms') if legit else None}; worker peaks MiB {peaks}"
        )
        if self.events.undecodable:
            problems.append(f"undecodable event lines: {self.events.undecodable[:3]}")
        assert not problems, "\n".join(problems)


@contextlib.asynccontextmanager
async def chaos_pool(
    world: ChaosWorld,
    state_dir: Path,
    *,
    limits: dict[str, Any] | None = None,
    upstream: dict[str, Any] | None = None,
    allow_a: tuple[str, ...] = (),
    allow_b: tuple[str, ...] = (),
    modes: tuple[str, str] = ("restricted", "restricted"),
    workers: int = WORKERS,
) -> AsyncIterator[Chaos]:
    """Two workers as applianced runs them, crews A and B (in `modes`; PEER_NAME allowed)."""
    from appliance.daemon.proxy import CrewEntry, ProxyPool
    from proxycore import control
    from proxycore.config import parse_config

    config = parse_config(config_text(world, limits or {}, upstream or {}), source="chaos")
    events = EventLog()
    failure: Exception | None = None
    pool = ProxyPool(
        config, state_dir, PORT, workers=workers, drop_to=WORKER_IDS, events_reader=events.read
    )
    # As applianced does: the workers know where the keeper listens. Nothing listens there, so
    # a keeper call the worker forwards is answered 503; one it refuses itself, 400 or 413.
    pool.keeper_channel = control.KeeperChannelSet(
        path=str(state_dir / "keeper.sock"), token=uuid.uuid4().hex
    )
    async with trio.open_nursery() as nursery:
        with trio.fail_after(30):
            await nursery.start(pool.run)
        pids = tuple(pool.pids)
        chaos = Chaos(world, pool, events, pids)
        for name, gateway, mode, allow in (
            (chaos.crew_a, world.gateway_a, modes[0], allow_a),
            (chaos.crew_b, world.gateway_b, modes[1], allow_b),
        ):
            await pool.add_crew(CrewEntry(name, gateway, mode, (PEER_NAME, *allow)))
        try:
            yield chaos
        except Exception as exc:
            # Raised again outside the nursery: a failed assertion reads as itself, not as a
            # member of an exception group.
            failure = exc
        finally:
            nursery.cancel_scope.cancel()
            for listener in pool.listeners.values():
                listener.close()
    if failure is not None:
        raise failure


async def ask(
    chaos: Chaos, request: bytes, *, timeout: float = 10.0
) -> tuple[Response | None, Reader]:
    """Send one request from crew A on a new connection; its response (None: closed first)."""
    stream = await chaos.connect_a()
    reader = Reader(stream)
    try:
        await stream.send_all(request)
    except trio.BrokenResourceError:
        pass
    response = await reader.response(timeout)
    return response, reader


def fd_limit_of(pid: int) -> int:
    """The soft RLIMIT_NOFILE of a process, from /proc/PID/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise LookupError(pid)
