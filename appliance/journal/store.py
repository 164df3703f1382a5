"""The journal store: an append-only, hash-chained SQLite (WAL) table with FTS5 search.

Theory of operation
-------------------
Producers (the daemon's tasks, the proxy-event ingester) call `submit(entry)`, which never
blocks: it puts the entry on a bounded queue and returns a `Ticket`, or raises `JournalFull` when
the queue is at capacity, so the caller decides what "cannot be audited" means (the proxy path
refuses the crew's traffic rather than let it go unrecorded). One writer thread owns the write
connection and does group commit:

    take the first queued entry (wait for it), then everything queued behind it, up to max_batch
    for each: encode canonically, scrub, chain: hash = sha256(prev_hash | seq | summary | payload)
    INSERT every row, COMMIT with synchronous=FULL (the WAL is fsync'd before COMMIT returns)
    write the head anchor (seq, hash) to journal.head and fdatasync it
    only now: mark every ticket of the batch acknowledged

So an acknowledged entry is on disk in both the database and the anchor; a crash at any point
loses only unacknowledged entries. While one batch is being fsync'd the next one queues up, so
the fsync cost is shared by every entry that arrived meanwhile (docs/journal.md has figures).

Append-only is enforced twice: the API has no update or delete, and SQLite triggers RAISE on
UPDATE of `entries`, and on DELETE of any entry that no `journal.checkpoint` entry names as
removed. Tamper evidence: `verify()` (verify.py) recomputes the chain and reports the first
entry (by sequence number) that was edited, deleted or moved; the anchor, kept outside the
database file, catches a cut-off tail, which the chain alone cannot (docs/journal.md).

Maintenance (retention.py: the signed checkpoint, deleting what it names, giving the space back)
runs on the same writer thread as `run_job` steps: the writer alternates one batch of entries
and one step, each step its own short transaction, so a prune of a million entries delays the
recorder by one step at a time, never by the whole prune (docs/journal.md has the pauses).
"""

from __future__ import annotations

import collections
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import msgspec

from native.scrub import Scrubber
from proxycore.protocol.scrubbing import scrub_json_lines

from . import entries as E
from .rows import (
    CHECKPOINT_TYPE,
    GENESIS,
    JournalError,
    Row,
    anchor_record,
    chain_hash,
    checkpoint_rows,
    connect,
    export,
    read_anchor,
    search,
    tail,
    write_anchor_file,
)

__all__ = [  # what this module offered before rows.py held it
    "CHECKPOINT_TYPE",
    "GENESIS",
    "Journal",
    "JournalClosed",
    "JournalError",
    "JournalFull",
    "Row",
    "Ticket",
    "anchor_record",
    "chain_hash",
    "checkpoint_rows",
    "export",
    "read_anchor",
    "search",
    "tail",
    "write_anchor_file",
]

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq       INTEGER PRIMARY KEY,
    ts        REAL NOT NULL,
    type      TEXT NOT NULL,
    workspace TEXT NOT NULL,
    crew      TEXT,
    agent     TEXT,
    mission   TEXT,
    trace_id  TEXT,
    summary   TEXT NOT NULL,
    payload   TEXT NOT NULL,
    prev_hash TEXT NOT NULL,
    hash      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_crew ON entries (crew, seq);
CREATE INDEX IF NOT EXISTS entries_type ON entries (type, seq);
CREATE INDEX IF NOT EXISTS entries_trace ON entries (trace_id) WHERE trace_id IS NOT NULL;
CREATE TRIGGER IF NOT EXISTS entries_no_update BEFORE UPDATE ON entries
BEGIN SELECT RAISE(ABORT, 'the journal is append-only: UPDATE refused'); END;
CREATE VIRTUAL TABLE IF NOT EXISTS entries_fts USING fts5(
    summary, payload, content='entries', content_rowid='seq'
);
CREATE TRIGGER IF NOT EXISTS entries_fts_insert AFTER INSERT ON entries
BEGIN INSERT INTO entries_fts (rowid, summary, payload) VALUES (new.seq, new.summary, new.payload);
END;
-- An external-content FTS5 table forgets a row only when told its old values.
CREATE TRIGGER IF NOT EXISTS entries_fts_delete AFTER DELETE ON entries
BEGIN INSERT INTO entries_fts (entries_fts, rowid, summary, payload)
      VALUES ('delete', old.seq, old.summary, old.payload);
END;
-- (Journals written before the proxy's events came over channels also hold a `cursors` table,
-- where the proxy's event file was read up to; nothing reads or writes it any more.)
"""

# Only what a checkpoint (signed, retention.py) names as removed may be deleted. Journals from
# before retention had an unconditional trigger; Journal() replaces it (_migrate).
NO_DELETE = """
CREATE TRIGGER entries_no_delete BEFORE DELETE ON entries
WHEN old.seq > (SELECT COALESCE(MAX(json_extract(payload, '$.removed_through_seq')), 0)
                FROM entries WHERE type = 'journal.checkpoint')
BEGIN SELECT RAISE(ABORT, 'the journal is append-only: DELETE refused (no checkpoint names it)');
END
"""

SYNCHRONOUS = ("FULL", "NORMAL", "OFF")
MAX_STEP_DELAY = 1.0  # seconds a maintenance step may be put off while entries are queued


class JournalFull(JournalError):
    """The writer's queue is at capacity: the caller must not proceed unaudited."""


class JournalClosed(JournalError):
    pass


class JobCancelled(JournalError):
    """The journal was closed before a maintenance job finished (it resumes at the next one)."""


class Ticket:
    """An appended entry's acknowledgment: `seq` once its batch is on disk."""

    __slots__ = ("_callback", "_done", "error", "seq")

    def __init__(self, callback: Callable[[], None] | None = None) -> None:
        self._done = threading.Event()
        self._callback = callback
        self.seq: int | None = None
        self.error: BaseException | None = None

    def _finish(self, seq: int | None, error: BaseException | None = None) -> None:
        self.seq, self.error = seq, error
        self._done.set()
        if self._callback is not None:
            self._callback()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise TimeoutError("journal entry not acknowledged in time")
        if self.error is not None:
            raise JournalError(f"journal write failed: {self.error}") from self.error
        assert self.seq is not None
        return self.seq


class Job:
    """A maintenance job on the writer thread: a generator whose every step (up to a `yield`)
    is one short transaction of its own; `wait()` returns what it returns. `pauses` are the
    steps' durations: how long each kept the writer from the recorder's entries."""

    __slots__ = ("_done", "error", "pauses", "result", "steps")

    def __init__(self, steps: Generator[None, None, Any]) -> None:
        self.steps = steps
        self._done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.pauses: list[float] = []

    def _step(self) -> bool:
        started = time.perf_counter()
        try:
            next(self.steps)
        except StopIteration as stop:
            self.result = stop.value
            self._done.set()
            return True
        except BaseException as exc:  # a step's SQL failed: the caller learns it
            self.error = exc
            self._done.set()
            return True
        finally:
            self.pauses.append(time.perf_counter() - started)
        return False

    def _cancel(self) -> None:
        self.steps.close()
        self.error = JobCancelled("the journal was closed before this job finished")
        self._done.set()

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError("journal job not finished in time")
        if self.error is not None:
            if isinstance(self.error, JournalError):
                raise self.error
            raise JournalError(f"journal maintenance failed: {self.error}") from self.error
        return self.result


def _scope(entry: E.Entry) -> tuple[str, str | None, str | None, str | None, str | None]:
    return entry.workspace, entry.crew, entry.agent, entry.mission, entry.trace_id


class Journal:
    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        scrubber: Scrubber | None = None,
        capacity: int = 10_000,
        max_batch: int = 512,
        synchronous: str = "FULL",
        anchor: bool = True,
    ) -> None:
        if synchronous not in SYNCHRONOUS:
            raise ValueError(f"argument synchronous: {synchronous!r} is not one of {SYNCHRONOUS}")
        self.path = Path(path)
        self.anchor_path = self.path.with_suffix(".head") if anchor else None
        self.scrubber = scrubber if scrubber is not None else Scrubber()
        self.capacity = capacity
        self.max_batch = max_batch
        self.synchronous = synchronous
        self._queue: collections.deque[tuple[E.Entry, Ticket]] = collections.deque()
        self._jobs: collections.deque[Job] = collections.deque()
        self.maintenance = threading.Lock()  # one prune or restore-like job at a time
        self._cond = threading.Condition()
        self._closing = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        old = os.umask(0o077)  # the journal names every crew's traffic: owner only
        try:
            self._conn = connect(self.path)
            self._anchor_fd = (
                os.open(self.anchor_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                if self.anchor_path is not None
                else None
            )
        finally:
            os.umask(old)
        # Only a new file takes this (before its first table); an older journal keeps
        # auto_vacuum=NONE until its first prune rebuilds it (retention.py).
        self._conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute(f"PRAGMA synchronous = {synchronous}")
        self._conn.executescript(SCHEMA)
        _migrate(self._conn)
        last = self._conn.execute(
            "SELECT seq, hash FROM entries ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        self._seq: int = int(last[0]) if last else 0
        self._hash: str = str(last[1]) if last else GENESIS
        self._thread = threading.Thread(target=self._writer, name="journal-writer", daemon=True)
        self._thread.start()

    # -- producers -------------------------------------------------------------------------

    def submit(
        self,
        entry: E.Entry,
        *,
        on_done: Callable[[], None] | None = None,
    ) -> Ticket:
        """Queue an entry; never blocks. Raises JournalFull at capacity, JournalClosed after
        close()."""
        if isinstance(entry, E.Checkpoint):
            # Only retention writes checkpoints (signed, at the head it read): retention.py.
            raise ValueError("a checkpoint is written by Journal.run_job, not submitted")
        ticket = Ticket(on_done)
        with self._cond:
            if self._closing:
                raise JournalClosed("the journal is closed")
            if len(self._queue) >= self.capacity:
                raise JournalFull(
                    f"the journal's queue is full ({self.capacity} entries waiting for disk)"
                )
            self._queue.append((entry, ticket))
            self._cond.notify()
        return ticket

    def append(self, entry: E.Entry, timeout: float | None = 30.0) -> int:
        """Blocking convenience: submit and wait for the acknowledgment; returns the seq."""
        return self.submit(entry).wait(timeout)

    @property
    def pending(self) -> int:
        return len(self._queue)

    @property
    def oldest_pending_ts(self) -> float | None:
        """The time of the oldest entry still waiting for disk (its own `ts`), or None: the
        journal's lag, for applianced's metrics."""
        with self._cond:
            return self._queue[0][0].ts if self._queue else None

    def run_job(self, make: Callable[[sqlite3.Connection], Generator[None, None, Any]]) -> Job:
        """Queue a maintenance job: `make(write_connection)` is called on the writer thread and
        its generator stepped between batches of entries (never inside one)."""
        job = Job(self._job_steps(make))
        with self._cond:
            if self._closing:
                raise JournalClosed("the journal is closed")
            self._jobs.append(job)
            self._cond.notify()
        return job

    def _job_steps(
        self, make: Callable[[sqlite3.Connection], Generator[None, None, Any]]
    ) -> Generator[None, None, Any]:
        return (yield from make(self._conn))

    def append_checkpoint(self, make: Callable[[int, str], E.Checkpoint]) -> int:
        """On the writer thread only (a job's step): append the checkpoint `make(head_seq,
        head_hash)` returns (signed) at the current head; its seq. Not scrubbed: it holds only
        numbers, hashes and a key, all made here."""
        entry = make(self._seq, self._hash)
        if (entry.head_seq, entry.head_hash) != (self._seq, self._hash):
            raise JournalError("a checkpoint must name the head it is appended to")
        payload = E.encode(entry).decode("utf-8")
        row = self._row(entry, CHECKPOINT_TYPE, payload, entry.summary(), self._seq + 1, self._hash)
        self._commit([row])
        return self._seq

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        self._conn.close()
        if self._anchor_fd is not None:
            os.close(self._anchor_fd)
            self._anchor_fd = None

    # -- the writer ------------------------------------------------------------------------

    def _writer(self) -> None:
        last_step = 0.0
        while True:
            with self._cond:
                while not self._queue and not self._jobs and not self._closing:
                    self._cond.wait()
                if self._closing and not self._queue:
                    for abandoned in self._jobs:
                        abandoned._cancel()
                    self._jobs.clear()
                    return
                batch = [
                    self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))
                ]
                job = self._jobs[0] if self._jobs else None
            if batch:
                self._write_entries(batch)
            if job is None:
                continue
            # Entries first: a step only once the queue is down to less than a batch, or at
            # least once a second (so maintenance advances under any load); then the recorder
            # waits for one step at a time, never for a whole prune.
            now = time.monotonic()
            if len(self._queue) >= self.max_batch and now - last_step < MAX_STEP_DELAY:
                continue
            last_step = now
            if job._step():
                with self._cond:
                    self._jobs.popleft()

    def _write_entries(self, batch: list[tuple[E.Entry, Ticket]]) -> None:
        try:
            seqs = self._write_batch(batch)
        except BaseException as exc:  # disk full, I/O error: every ticket learns it
            for _, ticket in batch:
                ticket._finish(None, exc)
            return
        for (_, ticket), seq in zip(batch, seqs, strict=True):
            ticket._finish(seq)

    def _prepare(self, entry: E.Entry) -> tuple[E.Entry, str, str]:
        """Scrubbed payload and summary; a payload the scrubber leaves unreadable is replaced
        by a `journal.redacted` entry of the same scope (never written half-redacted)."""
        payload = scrub_json_lines(self.scrubber, E.encode(entry))
        try:
            scrubbed = E.decode(payload)
        except msgspec.DecodeError:
            scrubbed = E.Redacted(
                ts=entry.ts,
                workspace=self.scrubber.scrub_text(entry.workspace),
                original_type=str(type(entry).__struct_config__.tag),
            )
            payload = E.encode(scrubbed)
        summary = self.scrubber.scrub_text(scrubbed.summary())
        return scrubbed, payload.decode("utf-8", "surrogateescape"), summary

    @staticmethod
    def _row(
        entry: E.Entry, tag: str, payload: str, summary: str, seq: int, prev: str
    ) -> tuple[Any, ...]:
        digest = chain_hash(prev, seq, summary, payload)
        return (seq, entry.ts, tag, *_scope(entry), summary, payload, prev, digest)

    def _write_batch(self, batch: list[tuple[E.Entry, Ticket]]) -> list[int]:
        rows = []
        seq, prev = self._seq, self._hash
        for entry, _ in batch:
            scrubbed, payload, summary = self._prepare(entry)
            seq += 1
            tag = str(type(scrubbed).__struct_config__.tag)
            rows.append(self._row(scrubbed, tag, payload, summary, seq, prev))
            prev = rows[-1][-1]
        self._commit(rows)
        return [row[0] for row in rows]

    def _commit(self, rows: list[tuple[Any, ...]]) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("INSERT INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
            conn.execute("COMMIT")  # synchronous=FULL: the WAL is fsync'd before this returns
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._seq, self._hash = rows[-1][0], rows[-1][-1]
        self._write_anchor(self._seq, self._hash)

    def _write_anchor(self, seq: int, digest: str) -> None:
        if self._anchor_fd is None:
            return
        # One pwrite of 48 bytes at offset 0: inside one sector, so never torn in practice;
        # the crc tells a torn one anyway.
        os.pwrite(self._anchor_fd, anchor_record(seq, digest), 0)
        if self.synchronous == "FULL":
            os.fdatasync(self._anchor_fd)

    # -- readers (own connections: WAL readers never wait for the writer) --------------------

    def tail(
        self,
        n: int = 20,
        *,
        crew: str | None = None,
        type: str | None = None,
        after: int = 0,
    ) -> list[Row]:
        return tail(self.path, n, crew=crew, type=type, after=after)

    def search(self, query: str, limit: int = 50) -> list[Row]:
        return search(self.path, query, limit)

    def export(self) -> Iterator[Row]:
        return export(self.path)

    def verify(self, keys: tuple[str, ...] = ()) -> Any:
        """verify.verify() of this journal with its anchor; `keys`: the trusted public keys."""
        from .verify import verify

        return verify(self.path, self.anchor_path, keys=keys)


def _migrate(conn: sqlite3.Connection) -> None:
    """Journals from before retention: the DELETE trigger becomes the conditional one."""
    row = conn.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = 'entries_no_delete'"
    ).fetchone()
    if row is not None and CHECKPOINT_TYPE in row[0]:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("DROP TRIGGER IF EXISTS entries_no_delete")
        conn.execute(NO_DELETE)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
