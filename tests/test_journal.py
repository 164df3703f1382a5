"""The journal store: types, append-only triggers, the hash chain against an attacker with
sqlite3, FTS search, scrubbing, the bounded queue and durability across a real SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from appliance.journal import Journal, JournalFull, verify
from appliance.journal import entries as E
from appliance.journal.store import chain_hash
from native.scrub import Scrubber

# A key of Anthropic's shape, random-looking (a periodic body reads as a placeholder to the
# shape filter, which would not redact it).
SECRET = (
    "sk-ant-api03-"
    "yX711an73tOEc28WqctKBgL2hKRU1mG9Y8Nu06lJwGEHg41ORgMLwAwmRkNDeezKeGOiU49cIle0LoXB3JCBZFNGPE"
)


def sample_entries() -> list[E.Entry]:
    scope = {"crew": "c1", "agent": "a1", "mission": "m1", "trace_id": "run-1"}
    return [
        E.RunStarted(argv=("echo", "hi there"), timeout=5.0, **scope),
        E.RunCompleted(exit_code=0, duration=0.5, **scope),
        E.RunFailed(error="no such container", duration=0.1, **scope),
        E.RunCancelled(duration=1.0, **scope),
        E.RunTimeout(timeout=5.0, duration=5.0, **scope),
        E.ProxyAllow(
            mode="restricted",
            requests=(
                E.AllowedRequest(
                    1.0, "forward", "GET", "example.org", 443, "10.0.0.1", "allowlist"
                ),
                E.AllowedRequest(
                    2.0, "forward", "POST", "example.org", 443, "10.0.0.1", "allowlist"
                ),
            ),
            crew="c1",
        ),
        E.ProxyDeny(
            mode="restricted",
            requests=(
                E.DeniedRequest(
                    3.0, "tunnel", "CONNECT", "evil.example", 443, "not allowlisted", 403
                ),
            ),
            crew="c1",
        ),
        E.CredentialInjected(provider="anthropic", host="api.anthropic.com", crew="c1"),
        E.TunnelOpened(tunnel_id=1, host="h", port=443, address="10.0.0.2", crew="c1"),
        E.TunnelClosed(
            tunnel_id=1,
            host="h",
            port=443,
            bytes_up=1,
            bytes_down=2,
            duration=0.1,
            reason="eof",
            crew="c1",
        ),
        E.CommandExecuted(argv=("git", "push"), exit_code=0, credential="gh", crew="c1"),
        E.KeeperDecision(
            action="request", credential="gh", decision="deny", reason="no", crew="c1"
        ),
        E.AllowlistChanged(host="pypi.org", crew="c1"),
        E.CredentialChanged(name="gh", action="rotated"),
        E.CrewCreated(mode="restricted", allow=("pypi.org",), runtime="runc", crew="c1"),
        E.CrewRemoved(crew="c1"),
        E.CrewFailed(error="create infra: boom", crew="c1"),
        E.ProxyNotice(message="events dropped", dropped=3),
    ]


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    j = Journal(tmp_path / "journal.db")
    yield j  # type: ignore[misc]
    j.close()


def fill(journal: Journal, n: int = 10) -> None:
    for i in range(n):
        journal.append(E.AllowlistChanged(host=f"host{i}.example", crew="c1"))


def attack(path: Path, *statements: str) -> None:
    """What an attacker with the file does: drop the triggers, then edit."""
    conn = sqlite3.connect(path)
    conn.execute("DROP TRIGGER entries_no_update")
    conn.execute("DROP TRIGGER entries_no_delete")
    for statement in statements:
        conn.execute(statement)
    conn.commit()
    conn.close()


def test_every_type_round_trips_through_the_file(journal: Journal) -> None:
    written = sample_entries()
    assert {str(type(e).__struct_config__.tag) for e in written} >= {
        "run.started",
        "run.completed",
        "run.failed",
        "run.cancelled",
        "run.timeout",
        "proxy.allow",
        "proxy.deny",
        "credential.injected",
        "tunnel.opened",
        "tunnel.closed",
        "command.executed",
        "allowlist.changed",
        "credential.changed",
        "crew.created",
        "crew.removed",
        "crew.failed",
    }
    for entry in written:
        journal.append(entry)
    rows = journal.tail(100)
    assert [E.decode(r.payload) for r in rows] == written
    assert [r.type for r in rows] == [str(type(e).__struct_config__.tag) for e in written]
    assert rows[0].crew == "c1" and rows[0].trace_id == "run-1" and rows[0].mission == "m1"
    assert journal.tail(100, type="run")[-1].type == "run.timeout"
    assert len(journal.tail(100, type="run")) == 5
    assert all(r.crew == "c1" for r in journal.tail(100, crew="c1"))
    assert journal.verify().ok


def test_update_and_delete_are_refused_by_sqlite(journal: Journal) -> None:
    fill(journal, 3)
    conn = sqlite3.connect(journal.path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only: UPDATE refused"):
        conn.execute("UPDATE entries SET summary = 'x' WHERE seq = 2")
    with pytest.raises(sqlite3.DatabaseError, match="append-only: DELETE refused"):
        conn.execute("DELETE FROM entries WHERE seq = 3")
    conn.close()
    assert journal.verify().ok


def test_verify_names_an_edited_entry(journal: Journal) -> None:
    fill(journal)
    journal.close()
    attack(
        journal.path,
        "UPDATE entries SET payload = replace(payload, 'host4', 'hostX') WHERE seq = 5",
    )
    report = verify(journal.path, journal.anchor_path)
    assert not report.ok and report.problem is not None
    assert (report.problem.seq, report.problem.kind) == (5, "edited")


def test_verify_names_an_edited_column(journal: Journal) -> None:
    fill(journal)
    journal.close()
    attack(journal.path, "UPDATE entries SET crew = 'other' WHERE seq = 7")
    problem = verify(journal.path).problem
    assert problem is not None and (problem.seq, problem.kind) == (7, "edited")


def test_verify_names_an_entry_rewritten_with_its_hash(journal: Journal) -> None:
    fill(journal)
    journal.close()
    conn = sqlite3.connect(journal.path)
    seq, prev, summary, payload = conn.execute(
        "SELECT seq, prev_hash, summary, payload FROM entries WHERE seq = 3"
    ).fetchone()
    conn.close()
    payload = payload.replace("host2", "hostZ")
    forged = chain_hash(prev, seq, summary, payload)
    attack(
        journal.path,
        f"UPDATE entries SET payload = '{payload}', hash = '{forged}' WHERE seq = 3",
    )
    problem = verify(journal.path).problem
    assert problem is not None and (problem.seq, problem.kind) == (3, "edited")


def test_verify_names_a_deleted_entry(journal: Journal) -> None:
    fill(journal)
    journal.close()
    attack(journal.path, "DELETE FROM entries WHERE seq = 4")
    problem = verify(journal.path, journal.anchor_path).problem
    assert problem is not None and (problem.seq, problem.kind) == (4, "deleted")


def test_verify_names_reordered_entries(journal: Journal) -> None:
    fill(journal)
    journal.close()
    attack(
        journal.path,
        "UPDATE entries SET seq = -1 WHERE seq = 6",
        "UPDATE entries SET seq = 6 WHERE seq = 7",
        "UPDATE entries SET seq = 7 WHERE seq = -1",
    )
    problem = verify(journal.path).problem
    assert problem is not None and (problem.seq, problem.kind) == (6, "reordered")
    assert "now at 7" in problem.detail


def test_tail_truncation_is_caught_by_the_anchor_only(journal: Journal) -> None:
    fill(journal)
    journal.close()
    attack(journal.path, "DELETE FROM entries WHERE seq >= 9")
    # The chain alone cannot tell a cut-off tail from a journal that ended there.
    assert verify(journal.path).ok
    problem = verify(journal.path, journal.anchor_path).problem
    assert problem is not None and (problem.seq, problem.kind) == (9, "truncated")


def test_search_matches_summary_and_payload(journal: Journal) -> None:
    for entry in sample_entries():
        journal.append(entry)
    assert [r.type for r in journal.search("evil")] == ["proxy.deny"]
    assert [r.type for r in journal.search('"api.anthropic.com"')] == ["credential.injected"]
    assert {r.type for r in journal.search("tunnel")} == {
        "tunnel.opened",
        "tunnel.closed",
        "proxy.deny",
    }
    from appliance.journal import JournalError

    with pytest.raises(JournalError, match="argument query"):
        journal.search('"unterminated')


def test_a_planted_secret_never_reaches_the_files(tmp_path: Path) -> None:
    journal = Journal(
        tmp_path / "journal.db", scrubber=Scrubber([("planted", "hunter2-planted-value")])
    )
    journal.append(
        E.ProxyDeny(
            mode="restricted",
            requests=(
                E.DeniedRequest(1.0, "forward", "GET", f"x.example/?k={SECRET}", 443, "r", 403),
            ),
            crew="c1",
        )
    )
    journal.append(E.RunStarted(argv=("echo", "hunter2-planted-value", SECRET), crew="c1"))
    journal.append(E.RunFailed(error='quote " hunter2-planted-value', duration=1.0, crew="c1"))
    rows = journal.tail(10)
    assert "[REDACTED" in rows[0].payload and "[REDACTED" in rows[1].summary
    # Bytes on disk while the WAL still holds them, then after the checkpoint at close.
    for name in ("journal.db", "journal.db-wal"):
        data = (tmp_path / name).read_bytes()
        assert SECRET.encode() not in data and b"hunter2-planted-value" not in data
    assert journal.verify().ok
    journal.close()
    data = (tmp_path / "journal.db").read_bytes()
    assert SECRET.encode() not in data and b"hunter2-planted-value" not in data
    assert verify(tmp_path / "journal.db", tmp_path / "journal.head").ok


def test_a_full_queue_is_reported_not_swallowed(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.db", capacity=8)
    # Hold the writer inside its commit: a reader's lock on the file is not enough in WAL,
    # so take the write lock ourselves.
    blocker = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    tickets = []
    with pytest.raises(JournalFull, match="queue is full"):
        for i in range(100):
            tickets.append(journal.submit(E.AllowlistChanged(host=f"h{i}", crew="c1")))
    # The writer holds at most one batch; the rest waited in the bounded queue.
    assert 8 <= len(tickets) <= 8 + journal.max_batch
    assert not any(t.done for t in tickets)
    blocker.execute("COMMIT")
    blocker.close()
    assert [t.wait(10) for t in tickets] == list(range(1, len(tickets) + 1))
    journal.submit(E.AllowlistChanged(host="after", crew="c1")).wait(10)
    journal.close()


WRITER = textwrap.dedent(
    """
    import sys
    from appliance.journal import Journal, entries as E
    journal = Journal(sys.argv[1])
    i = 0
    while True:
        tickets = [
            journal.submit(E.AllowlistChanged(host=f"h{i + k}", crew="c1")) for k in range(20)
        ]
        for t in tickets:
            seq = t.wait()
            # Acknowledged: only now may anyone be told.
            sys.stdout.write(f"{seq}\\n")
        sys.stdout.flush()
        i += 20
    """
)


def test_nothing_acknowledged_is_lost_to_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    root = Path(__file__).resolve().parents[1]
    process = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdout=subprocess.PIPE,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert process.stdout is not None
    acknowledged = 0
    deadline = time.monotonic() + 30
    while acknowledged < 2000 and time.monotonic() < deadline:
        acknowledged = int(process.stdout.readline())
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    for line in process.stdout.read().split():  # acknowledged before the kill landed
        acknowledged = max(acknowledged, int(line))
    assert acknowledged >= 2000
    reopened = Journal(path)
    report = reopened.verify()
    assert report.ok, report.problem
    assert report.head_seq >= acknowledged
    rows = reopened.tail(1, after=acknowledged - 1)
    assert rows and rows[0].seq == acknowledged
    assert msgspec.json.decode(rows[0].payload)["host"] == f"h{acknowledged - 1}"
    # Appending after the crash continues the chain.
    reopened.append(E.CrewRemoved(crew="c1"))
    assert reopened.verify().ok
    reopened.close()


# -- refusing, not skipping, when the journal is behind -------------------------------------


def test_the_proxy_refuses_crew_traffic_while_audit_is_paused(
    tmp_path: Path, provider: object, ca_file: str
) -> None:
    """A real proxy child: AuditPaused(True) turns every route into a readable 503."""
    from proxycore import control
    from tests.conftest import free_port, proxy_env, write_proxy_config
    from tests.test_daemon_proxy_channel import curl, listening, request

    port = free_port()
    config, _, _ = write_proxy_config(
        tmp_path,
        port=port,
        provider_port=provider.port,  # type: ignore[attr-defined]
        ca_file=ca_file,
        gateway="127.0.0.9",
    )
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "proxycore.worker", "--config", str(config)),
            *("--control-fd", str(theirs.fileno())),
        ],
        env=proxy_env(),
        pass_fds=[theirs.fileno()],
        stderr=subprocess.DEVNULL,
    )
    theirs.close()
    try:
        ours.settimeout(10)
        gateway = "127.0.0.27"
        listener = listening(gateway, port)
        reply = request(
            ours,
            control.CrewAdd(
                name="alpha",
                gateway=gateway,
                mode="restricted",
                listener=True,
                ssrf_allow=("127.0.0.0/8",),
            ),
            listener,
        )
        listener.close()
        assert reply["ok"]
        url = f"http://{gateway}:{port}/anthropic/v1/models"
        assert curl("-f", url).returncode == 0
        assert request(ours, control.AuditPaused(paused=True)) == {"ok": True, "changed": True}
        refused = curl("-w", "\\n%{http_code}", url)
        body, status = refused.stdout.rsplit("\n", 1)
        assert status == "503"
        assert json.loads(body)["error"] == "audit_unavailable"
        assert "journal is behind" in json.loads(body)["message"]
        tunnel = curl(
            "-w", "%{http_code}", "-p", "-x", f"http://{gateway}:{port}", "https://x.test/"
        )
        assert "503" in tunnel.stdout + tunnel.stderr
        assert request(ours, control.AuditPaused(paused=False)) == {"ok": True, "changed": True}
        assert curl("-f", url).returncode == 0
    finally:
        ours.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_ingest_waits_when_full_signals_and_loses_nothing(tmp_path: Path) -> None:
    """A worker's events channel into the journal: a full queue pauses the crews (the signal),
    the channel buffers, every event lands exactly once and in order; a line cut short by a
    dying worker is journaled as unreadable, never dropped silently."""
    import socket

    import trio

    from appliance.journal.recorder import UNREADABLE_EVENT, JournalRecorder
    from proxycore.protocol import events as pe

    encoder = msgspec.json.Encoder()

    def event_lines(start: int, count: int) -> bytes:
        return b"".join(
            encoder.encode(
                # One crew per event: each is an entry of its own (a crew's requests in one
                # batch would share one), so 100 of them fill the 8-entry queue.
                pe.RequestDenied(
                    crew=f"c{i}", mode="restricted", route="forward", method="GET",
                    host=f"h{i}.example", port=80, rule="not_in_allowlist", status=403,
                )
            )
            + b"\n"
            for i in range(start, start + count)
        )  # fmt: skip

    journal = Journal(tmp_path / "journal.db", capacity=8, max_batch=4)
    signals: list[bool] = []

    async def backpressure(paused: bool) -> None:
        signals.append(paused)

    async def main() -> None:
        recorder = JournalRecorder(journal, on_backpressure=backpressure)
        ours, worker = socket.socketpair()
        blocker = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # the disk "stalls": the writer cannot commit
        worker.sendall(event_lines(0, 100))
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(recorder.ingest_proxy_channel, stream, 0)
            await nursery.start(recorder.watch_backpressure)
            with trio.fail_after(10):
                while not signals:
                    await trio.sleep(0.01)
            assert signals == [True]  # refused, not skipped
            blocker.execute("COMMIT")
            blocker.close()
            # The worker goes on, then dies in the middle of a line.
            worker.sendall(event_lines(100, 5) + b'{"event":"request_den')
            worker.close()
            with trio.fail_after(20):
                while journal.pending or len(journal.tail(1000)) < 106 or signals[-1]:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert signals == [True, False]

    trio.run(main)
    rows = journal.tail(1000)
    assert len(rows) == 106
    requests = [msgspec.json.decode(r.payload)["requests"] for r in rows[:105]]
    assert [one[3] for (one,) in requests] == [f"h{i}.example" for i in range(105)]
    assert [r.crew for r in rows[:105]] == [f"c{i}" for i in range(105)]
    assert {r.type for r in rows[:105]} == {"proxy.deny"}
    assert rows[105].type == "proxy.notice" and UNREADABLE_EVENT in rows[105].summary
    assert journal.verify().ok
    journal.close()


def test_a_batch_of_requests_is_one_entry_per_crew_in_order() -> None:
    """entries_for_batch: a crew's allowed (and denied) requests in one batch are one entry,
    in the place of the first, each request kept with its own time; other events keep theirs."""
    from appliance.journal.recorder import UNREADABLE_EVENT, entries_for_batch
    from proxycore.protocol import events as pe

    def allowed(crew: str, host: str, ts: float) -> pe.RequestAllowed:
        return pe.RequestAllowed(
            ts=ts, crew=crew, mode="restricted", route="forward", method="GET", host=host,
            port=443, address="10.0.0.1", rule="allowlist",
        )  # fmt: skip

    denied = pe.RequestDenied(
        ts=4.0, crew="a", mode="restricted", route="tunnel", method="CONNECT", host="evil.test",
        port=443, rule="not_in_allowlist", status=403,
    )  # fmt: skip
    opened = pe.TunnelOpened(ts=2.5, crew="a", tunnel_id=1, host="x.test", port=443, address="a")
    batch: list[pe.AnyEvent | None] = [
        allowed("a", "one.test", 1.0),
        allowed("b", "two.test", 2.0),
        opened,
        allowed("a", "three.test", 3.0),
        denied,
        None,
        allowed("a", "four.test", 5.0),
    ]
    entries = entries_for_batch(batch)
    assert [type(e).__name__ for e in entries] == [
        "ProxyAllow", "ProxyAllow", "TunnelOpened", "ProxyDeny", "ProxyNotice",
    ]  # fmt: skip
    first, second, _, deny, notice = entries
    assert isinstance(first, E.ProxyAllow) and first.crew == "a" and first.ts == 1.0
    assert [(r.host, r.ts) for r in first.requests] == [
        ("one.test", 1.0), ("three.test", 3.0), ("four.test", 5.0),
    ]  # fmt: skip
    assert first.summary() == (
        "allow 3 requests: GET one.test:443 (allowlist) x1, GET three.test:443 (allowlist) x1, "
        "GET four.test:443 (allowlist) x1"
    )
    assert isinstance(second, E.ProxyAllow) and second.crew == "b"
    assert second.summary() == "allow GET two.test:443 (forward, rule allowlist)"
    assert isinstance(deny, E.ProxyDeny) and deny.requests[0].status == 403
    assert isinstance(notice, E.ProxyNotice) and notice.message == UNREADABLE_EVENT


def test_channel_sink_backlog_refuses_rather_than_loses(tmp_path: Path) -> None:
    """The worker's side: while nobody reads its events channel its queue grows; at half full
    `backlogged` is true (the server refuses crew traffic then); past full, events are counted
    and reported as one EventsDropped, never lost without a word; once read, all arrive."""
    import socket

    import trio

    from proxycore.io.sinks import ChannelSink
    from proxycore.protocol import events as pe

    ours, theirs = socket.socketpair()
    sink = ChannelSink(theirs, flush_interval=0.01, max_batch=64, max_pending=1000)
    received = bytearray()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            filler = pe.PolicyWarning(crew="c", message="x" * 2000)
            # Fill the socket's buffer first (nobody reads), then the queue behind it.
            sent = 0
            with trio.fail_after(20):
                while not sink.backlogged:
                    sink.emit(filler)
                    sent += 1
                    if sent % 64 == 0:
                        await trio.sleep(0.02)
            assert sink.backlogged
            for _ in range(2000):  # past max_pending: counted, not queued
                sink.emit(filler)
            reader = trio.socket.from_stdlib_socket(ours)
            with trio.fail_after(20):
                # Until the drop count has arrived (it is sent with the batch after the drops)
                # and the last line is whole.
                while b'"events_dropped"' not in received or not received.endswith(b"\n"):
                    received.extend(await reader.recv(1 << 20))
            assert not sink.backlogged
            nursery.cancel_scope.cancel()

    trio.run(main)
    events = pe.decode_events(bytes(received))
    dropped = [e for e in events if isinstance(e, pe.EventsDropped)]
    assert len(dropped) == 1 and dropped[0].count > 0
    assert len(events) - 1 + dropped[0].count >= 2000
