"""applianced's supervision of its proxy workers (appliance/daemon/proxy.py, supervisor.py): a
real ProxyPool with real worker processes, real signals and a real journal, without Docker.

The backoff constants are shrunk (RestartPolicy) so that a run of kills takes seconds."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from appliance.daemon.messages import WorkerStatus
from appliance.daemon.proxy import CrewEntry, ProxyPool, _Worker
from appliance.daemon.supervisor import RestartPolicy, StderrTail, WorkerExit, exit_status
from appliance.journal import Journal
from appliance.journal.recorder import JournalRecorder
from native.scrub import Scrubber
from proxycore.config import ProxyConfig
from tests.conftest import free_port

POLICY = RestartPolicy(first=0.2, cap=0.8, stable=3.0, jitter=0.25)
WORKER_UID = 1002


def _drop_to() -> tuple[int, int] | None:
    # As under applianced: root starts the workers and they drop to 1002 (their uid in status
    # is then the kernel's word that they did).
    return (WORKER_UID, WORKER_UID) if os.geteuid() == 0 else None


async def _wait(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.01)
        return
    raise AssertionError(f"timed out waiting for {what}")


async def _health(port: int) -> bool:
    """The crew's local health route, answered by whichever worker accepts."""
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(
                b"GET /_appliance/health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
            )
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
    return data.startswith(b"HTTP/1.1 200")


def _running(worker: _Worker) -> bool:
    return worker.client is not None and worker.restart_at is None


async def _with_pool(
    tmp_path: Path,
    body: Callable[[ProxyPool, int], Awaitable[None]],
    on_exit: Callable[[WorkerExit], None],
) -> None:
    port = free_port()
    pool = ProxyPool(
        ProxyConfig(),
        tmp_path,
        port,
        workers=2,
        drop_to=_drop_to(),
        restart_policy=POLICY,
        on_exit=on_exit,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        await pool.add_crew(CrewEntry("sup", "127.0.0.1", "restricted", ()))
        await body(pool, port)
        nursery.cancel_scope.cancel()


def test_killed_again_and_again_backs_off_capped_then_resets(tmp_path: Path) -> None:
    exits: list[WorkerExit] = []
    journal = Journal(tmp_path / "journal.db", synchronous="OFF")
    recorder = JournalRecorder(journal)

    def on_exit(gone: WorkerExit) -> None:
        exits.append(gone)
        recorder.proxy_worker_exited(gone)

    observed: list[float] = []  # seconds from each exit to the next start
    statuses: list[WorkerStatus] = []

    async def body(pool: ProxyPool, port: int) -> None:
        victim, other = pool.workers
        assert other.process is not None
        other_pid = other.process.pid
        for round_ in range(5):
            await _wait(lambda: _running(victim), "the victim up")
            assert victim.process is not None
            pid = victim.process.pid
            os.kill(pid, signal.SIGKILL)
            count = round_ + 1
            await _wait(lambda: len(exits) == count, "the exit recorded")  # noqa: B023 (awaited in this iteration)
            gone_at = trio.current_time()
            statuses.append(pool.worker_status()[0])
            # While the victim is down, the other worker serves the crew.
            for _ in range(3):
                assert await _health(port)
            await _wait(
                lambda: victim.process is not None and victim.process.pid != pid,  # noqa: B023 (awaited in this iteration)
                "the restart",
            )
            observed.append(trio.current_time() - gone_at)
        # Up for longer than `stable`: its next crash is a first one again.
        await _wait(lambda: _running(victim), "the victim up")
        await trio.sleep(POLICY.stable + 0.2)
        assert victim.process is not None
        os.kill(victim.process.pid, signal.SIGKILL)
        await _wait(lambda: len(exits) == 6, "the exit after a stable life")
        await _wait(lambda: _running(victim), "the victim up again")
        # The other worker never stopped.
        assert other.process is not None and other.process.pid == other_pid
        assert other.restarts == 0 and other.last_exit is None
        assert pool.restarts == 6
        status = pool.worker_status()
        assert status[0].pid == victim.process.pid and status[0].restarts == 6
        assert status[0].restart_at is None and status[0].backoff is None
        assert status[0].last_exit == "killed by SIGKILL"
        assert status[1].pid == other_pid and status[1].restarts == 0
        assert status[1].last_exit is None
        if _drop_to() is not None:
            assert status[0].uid == WORKER_UID and status[1].uid == WORKER_UID

    try:
        trio.run(_with_pool, tmp_path, body, on_exit)
        rows = journal.tail(20, type="proxy.worker_exited")
    finally:
        journal.close()

    delays = [gone.restart_in for gone in exits]
    # Doubling from `first`, each drawn from [(1 - jitter) x nominal, nominal]...
    nominal = [0.2, 0.4, 0.8, 0.8, 0.8, 0.2]
    for delay, expected in zip(delays, nominal, strict=True):
        assert expected * (1 - POLICY.jitter) - 1e-3 <= delay <= expected + 1e-3, delays
    # ... so they grow until the cap, and never pass it.
    assert delays[0] < delays[1] < delays[2], delays
    assert max(delays) <= POLICY.cap
    # The supervisor waited (at least) what it said it would.
    for delay, seen in zip(delays, observed, strict=False):
        assert seen >= delay - 0.05, (delays, observed)
    for index, gone in enumerate(exits):
        assert gone.worker == 0 and gone.restarts == index + 1
        assert gone.signal == "SIGKILL" and gone.exit_code is None and gone.killed_by is None
        assert gone.reason == "killed by SIGKILL"
    # The last one lived for seconds: what it said at start is in its tail.
    assert any(line.startswith("proxy worker 0: listening") for line in exits[-1].stderr_tail)
    assert exits[-1].uptime >= POLICY.stable
    # While it waited, status said so.
    for status, gone in zip(statuses, exits, strict=False):
        assert status.pid is None and status.backoff == gone.restart_in
        assert status.restart_at is not None and status.last_exit == "killed by SIGKILL"
    # One journal entry per exit, oldest first.
    assert [row.type for row in rows] == ["proxy.worker_exited"] * 6
    assert [row.summary.split(" (pid ")[0] for row in rows] == ["proxy worker 0"] * 6
    assert "killed by SIGKILL" in rows[0].summary and "restart 1 in" in rows[0].summary


def test_exit_reasons_applianced_kill_and_clean_exit(tmp_path: Path) -> None:
    exits: list[WorkerExit] = []

    async def body(pool: ProxyPool, port: int) -> None:
        first, second = pool.workers
        await _wait(lambda: _running(first) and _running(second), "both up")
        killed = pool.kill_all("did not apply credentials_set: (a test)")
        assert len(killed) == 2
        await _wait(lambda: len(exits) == 2, "both exits")
        await _wait(lambda: _running(first) and _running(second), "both up again")
        assert second.process is not None
        # SIGTERM: the worker stops on its own and exits 0; not applianced's doing.
        second.process.send_signal(signal.SIGTERM)
        await _wait(lambda: len(exits) == 3, "the clean exit")
        await _wait(lambda: _running(second), "the second up again")
        assert await _health(port)

    trio.run(_with_pool, tmp_path, body, exits.append)
    by_applianced = sorted(exits[:2], key=lambda gone: gone.worker)
    for index, gone in enumerate(by_applianced):
        assert gone.worker == index and gone.signal == "SIGKILL"
        assert gone.killed_by == "did not apply credentials_set: (a test)"
        assert gone.reason == (
            "killed by applianced (SIGKILL): did not apply credentials_set: (a test)"
        )
        assert gone.restarts == 1
        assert POLICY.first * (1 - POLICY.jitter) - 1e-3 <= gone.restart_in <= POLICY.first
    clean = exits[2]
    assert clean.worker == 1 and clean.exit_code == 0 and clean.signal is None
    assert clean.killed_by is None and clean.reason == "exited with status 0"
    assert clean.restarts == 2  # its second short life in a row: the backoff doubled
    assert 2 * POLICY.first * (1 - POLICY.jitter) - 1e-3 <= clean.restart_in <= 2 * POLICY.first


def test_stderr_tail_is_scrubbed_bounded_and_relayed(tmp_path: Path) -> None:
    secret = "sk-ant-api03-SUPERVISOR-secret-0123456789abcdef"
    scrubber = Scrubber([("anthropic", secret.encode())])
    relay_path = tmp_path / "relay.txt"
    with relay_path.open("w") as relay:
        tail = StderrTail(scrubber.scrub_text, relay=relay, lines=3)
        tail.feed(f"Traceback: header value {secret}\n".encode())
        for piece in (b"split ", b"across ", b"reads\n"):
            tail.feed(piece)
        tail.feed(b"x" * 5000 + b"\nafter a long line\n")
        tail.feed(b"last words without a newline")
        tail.finish()
    kept = tail.tail()
    assert len(kept) == 3  # the last three
    assert kept[0] == "x" * 1024 + "..."
    assert kept[1:] == ("after a long line", "last words without a newline")
    relayed = relay_path.read_text()
    assert secret not in relayed and "split across reads" in relayed
    assert "Traceback: header value" in relayed


def test_restart_policy_and_exit_status() -> None:
    policy = RestartPolicy()  # the documented defaults (docs/daemon.md)
    assert (policy.first, policy.cap, policy.stable, policy.jitter) == (0.5, 30.0, 60.0, 0.25)
    rng = random.Random(7)
    nominal = [min(30.0, 0.5 * 2**n) for n in range(12)]
    for failures, expected in enumerate(nominal, start=1):
        delay = policy.delay(failures, rng)
        assert 0.75 * expected <= delay <= expected
    assert policy.delay(10_000, rng) <= 30.0  # no overflow far past the cap
    assert exit_status(-signal.SIGSEGV) == (None, "SIGSEGV")
    assert exit_status(-signal.SIGKILL) == (None, "SIGKILL")
    assert exit_status(3) == (3, None)
    assert exit_status(-200) == (None, "signal 200")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-v"]))
