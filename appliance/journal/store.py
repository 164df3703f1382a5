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
UPDATE and DELETE of `entries`. Tamper evidence: `verify()` recomputes the chain and reports the
first entry (by sequence number) that was edited, deleted or moved; the anchor, kept outside the
database file, catches a cut-off tail, which the chain alone cannot (docs/journal.md).
"""

from __future__ import annotations

import collections
import hashlib
import os
import sqlite3
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from native.scrub import Scrubber
from proxycore.protocol.scrubbing import scrub_json_lines

from . import entries as E

GENESIS = "0" * 64

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
CREATE TRIGGER IF NOT EXISTS entries_no_delete BEFORE DELETE ON entries
BEGIN SELECT RAISE(ABORT, 'the journal is append-only: DELETE refused'); END;
CREATE VIRTUAL TABLE IF NOT EXISTS entries_fts USING fts5(
    summary, payload, content='entries', content_rowid='seq'
);
CREATE TRIGGER IF NOT EXISTS entries_fts_insert AFTER INSERT ON entries
BEGIN INSERT INTO entries_fts (rowid, summary, payload) VALUES (new.seq, new.summary, new.payload);
END;
-- (Journals written before the proxy's events came over channels also hold a `cursors` table,
-- where the proxy's event file was read up to; nothing reads or writes it any more.)
"""

SYNCHRONOUS = ("FULL", "NORMAL", "OFF")
# journal.head: magic, seq (u64), hash (32 bytes), crc32 of the preceding bytes.
_ANCHOR = struct.Struct("<4sQ32sI")
_ANCHOR_MAGIC = b"JHD1"


class JournalError(Exception):
    """Base of the journal's errors; never raised itself."""


class JournalFull(JournalError):
    """The writer's queue is at capacity: the caller must not proceed unaudited."""


class JournalClosed(JournalError):
    pass


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


class Row(msgspec.Struct, frozen=True):
    seq: int
    ts: float
    type: str
    workspace: str
    crew: str | None
    agent: str | None
    mission: str | None
    trace_id: str | None
    summary: str
    payload: str
    prev_hash: str
    hash: str


class Problem(msgspec.Struct, frozen=True):
    seq: int
    kind: str  # edited | deleted | reordered | truncated | inserted
    detail: str


class VerifyReport(msgspec.Struct, frozen=True):
    ok: bool
    entries: int
    head_seq: int
    head_hash: str
    anchor_seq: int | None
    problem: Problem | None = None


def chain_hash(prev_hash: str, seq: int, summary: str, payload: str) -> str:
    digest = hashlib.sha256()
    for part in (prev_hash, str(seq), summary, payload):
        data = part.encode("utf-8", "surrogateescape")
        digest.update(len(data).to_bytes(8, "big"))  # length-prefixed: no ambiguity at seams
        digest.update(data)
    return digest.hexdigest()


def _connect(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    else:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


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
        self._cond = threading.Condition()
        self._closing = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        old = os.umask(0o077)  # the journal names every crew's traffic: owner only
        try:
            self._conn = _connect(self.path)
            self._anchor_fd = (
                os.open(self.anchor_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                if self.anchor_path is not None
                else None
            )
        finally:
            os.umask(old)
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.execute(f"PRAGMA synchronous = {synchronous}")
        self._conn.executescript(SCHEMA)
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
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = [
                    self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))
                ]
            try:
                seqs = self._write_batch(batch)
            except BaseException as exc:  # disk full, I/O error: every ticket learns it
                for _, ticket in batch:
                    ticket._finish(None, exc)
                continue
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

    def _write_batch(self, batch: list[tuple[E.Entry, Ticket]]) -> list[int]:
        rows = []
        seq, prev = self._seq, self._hash
        for entry, _ in batch:
            scrubbed, payload, summary = self._prepare(entry)
            seq += 1
            digest = chain_hash(prev, seq, summary, payload)
            tag = str(type(scrubbed).__struct_config__.tag)
            rows.append((seq, scrubbed.ts, tag, *_scope(scrubbed), summary, payload, prev, digest))
            prev = digest
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany("INSERT INTO entries VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
            conn.execute("COMMIT")  # synchronous=FULL: the WAL is fsync'd before this returns
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        self._seq, self._hash = seq, prev
        self._write_anchor(seq, prev)
        return [row[0] for row in rows]

    def _write_anchor(self, seq: int, digest: str) -> None:
        if self._anchor_fd is None:
            return
        body = _ANCHOR_MAGIC + seq.to_bytes(8, "little") + bytes.fromhex(digest)
        record = _ANCHOR.pack(_ANCHOR_MAGIC, seq, bytes.fromhex(digest), zlib.crc32(body))
        # One pwrite of 48 bytes at offset 0: inside one sector, so never torn in practice;
        # the crc tells a torn one anyway.
        os.pwrite(self._anchor_fd, record, 0)
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

    def verify(self) -> VerifyReport:
        return verify(self.path, self.anchor_path)


class _reader:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> sqlite3.Connection:
        if not self.path.exists():
            raise JournalError(f"no journal at {self.path}")
        self.conn = _connect(self.path, readonly=True)
        return self.conn

    def __exit__(self, *exc: object) -> None:
        self.conn.close()


_COLUMNS = (
    "seq, ts, type, workspace, crew, agent, mission, trace_id, summary, payload, prev_hash, hash"
)


def _rows(cursor: sqlite3.Cursor) -> list[Row]:
    return [Row(*r) for r in cursor]


def tail(
    path: Path, n: int = 20, *, crew: str | None = None, type: str | None = None, after: int = 0
) -> list[Row]:
    """Matching entries oldest first: the last `n`, or with `after` the first `n` after that seq
    (what `tail -f` pages with, so a burst is never skipped)."""
    where, args = ["seq > ?"], [after]
    if crew is not None:
        where.append("crew = ?")
        args.append(crew)  # type: ignore[arg-type]
    if type is not None:
        # "run" matches every run.* type; "run.failed" only itself.
        where.append("(type = ? OR type LIKE ?)")
        args += [type, type + ".%"]  # type: ignore[list-item]
    order = "ASC" if after else "DESC"
    sql = f"SELECT {_COLUMNS} FROM entries WHERE {' AND '.join(where)} ORDER BY seq {order} LIMIT ?"  # noqa: S608 (fixed clauses; values are bound)
    with _reader(path) as conn:
        rows = _rows(conn.execute(sql, (*args, n)))
    return rows if after else rows[::-1]


def search(path: Path, query: str, limit: int = 50) -> list[Row]:
    """FTS5 MATCH over summary and payload, oldest first. A query FTS5 cannot parse is an error
    naming it."""
    with _reader(path) as conn:
        try:
            seqs = [
                r[0]
                for r in conn.execute(
                    "SELECT rowid FROM entries_fts WHERE entries_fts MATCH ? ORDER BY rowid DESC "
                    "LIMIT ?",
                    (query, limit),
                )
            ]
        except sqlite3.OperationalError as exc:
            raise JournalError(f"argument query: {query!r}: {exc}") from None
        if not seqs:
            return []
        marks = ",".join("?" * len(seqs))
        return _rows(
            conn.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE seq IN ({marks}) ORDER BY seq",  # noqa: S608
                seqs,
            )
        )


def export(path: Path, batch: int = 1000) -> Iterator[Row]:
    after = 0
    while True:
        with _reader(path) as conn:
            rows = _rows(
                conn.execute(
                    f"SELECT {_COLUMNS} FROM entries WHERE seq > ? ORDER BY seq LIMIT ?",  # noqa: S608
                    (after, batch),
                )
            )
        if not rows:
            return
        yield from rows
        after = rows[-1].seq


def read_anchor(path: Path) -> tuple[int, str] | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < _ANCHOR.size:
        return None
    magic, seq, digest, crc = _ANCHOR.unpack(data[: _ANCHOR.size])
    if magic != _ANCHOR_MAGIC or zlib.crc32(data[: _ANCHOR.size - 4]) != crc:
        raise JournalError(f"{path}: the head anchor is damaged")
    return seq, digest.hex()


def _seq_of_hash(path: Path, digest: str) -> int | None:
    with _reader(path) as conn:
        row = conn.execute("SELECT seq FROM entries WHERE hash = ?", (digest,)).fetchone()
    return int(row[0]) if row else None


def verify(path: Path, anchor_path: Path | None = None) -> VerifyReport:
    """Walk the chain in seq order; report the first problem by sequence number.

    - edited: the row's hash is not sha256(prev, seq, summary, payload), or its columns do not
      match its payload (someone rewrote a column the hash does not cover directly);
    - deleted: a seq is missing (or prev_hash links to a hash that is not the previous row's);
    - reordered: a row's prev_hash is the hash of another row than its predecessor;
    - truncated: the anchor names a seq beyond the last row, or a hash that row does not have.
    """
    anchor = read_anchor(anchor_path) if anchor_path is not None else None
    expected_seq, prev = 1, GENESIS
    count = 0
    head_hash = GENESIS
    problem: Problem | None = None
    anchor_row_hash: str | None = None
    for row in export(path):
        count += 1
        if row.seq != expected_seq:
            problem = Problem(
                expected_seq, "deleted", f"entry {expected_seq} is missing (next is {row.seq})"
            )
            break
        if row.prev_hash != prev:
            moved = _seq_of_hash(path, row.prev_hash)
            if moved is not None:
                problem = Problem(
                    row.seq,
                    "reordered",
                    f"entry {row.seq} links to the entry now at {moved}, not to {row.seq - 1}",
                )
            else:
                # The predecessor's hash checked out on its own, so it was rewritten together
                # with its hash; or this entry's link itself was edited.
                problem = Problem(
                    row.seq - 1,
                    "edited",
                    f"entry {row.seq - 1} was rewritten: entry {row.seq} links to another hash",
                )
            break
        if chain_hash(row.prev_hash, row.seq, row.summary, row.payload) != row.hash:
            problem = Problem(
                row.seq, "edited", f"entry {row.seq}: content does not match its hash"
            )
            break
        try:
            entry = E.decode(row.payload)
        except msgspec.DecodeError as exc:
            problem = Problem(row.seq, "edited", f"entry {row.seq}: payload unreadable: {exc}")
            break
        columns = (row.ts, row.type, row.workspace, row.crew, row.agent, row.mission, row.trace_id)
        tag = str(type(entry).__struct_config__.tag)
        if columns != (entry.ts, tag, *_scope(entry)):
            problem = Problem(
                row.seq, "edited", f"entry {row.seq}: columns differ from its payload"
            )
            break
        if anchor is not None and row.seq == anchor[0]:
            anchor_row_hash = row.hash
        prev, head_hash = row.hash, row.hash
        expected_seq += 1
    head_seq = expected_seq - 1
    if problem is None and anchor is not None:
        anchor_seq, anchor_hash = anchor
        if anchor_seq > head_seq:
            problem = Problem(
                head_seq + 1,
                "truncated",
                f"the anchor names entry {anchor_seq}; the journal ends at {head_seq}",
            )
        elif anchor_row_hash != anchor_hash:
            problem = Problem(
                anchor_seq, "edited", f"entry {anchor_seq} does not have the anchored hash"
            )
    return VerifyReport(
        ok=problem is None,
        entries=count,
        head_seq=head_seq,
        head_hash=head_hash,
        anchor_seq=anchor[0] if anchor else None,
        problem=problem,
    )
