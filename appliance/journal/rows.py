"""The journal's file: its rows, the chain hash, the head anchor, and the readers.

What every side of the journal shares: the writer (store.py), verification (verify.py),
retention (retention.py) and backups (backup.py). Readers open their own read-only
connections; in WAL they never wait for the writer.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgspec

GENESIS = "0" * 64

CHECKPOINT_TYPE = "journal.checkpoint"

# journal.head: magic, seq (u64), hash (32 bytes), crc32 of the preceding bytes.
_ANCHOR = struct.Struct("<4sQ32sI")
_ANCHOR_MAGIC = b"JHD1"


class JournalError(Exception):
    """Base of the journal's errors; never raised itself."""


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


def chain_hash(prev_hash: str, seq: int, summary: str, payload: str) -> str:
    digest = hashlib.sha256()
    for part in (prev_hash, str(seq), summary, payload):
        data = part.encode("utf-8", "surrogateescape")
        digest.update(len(data).to_bytes(8, "big"))  # length-prefixed: no ambiguity at seams
        digest.update(data)
    return digest.hexdigest()


def connect(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    else:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


def anchor_record(seq: int, digest: str) -> bytes:
    body = _ANCHOR_MAGIC + seq.to_bytes(8, "little") + bytes.fromhex(digest)
    return _ANCHOR.pack(_ANCHOR_MAGIC, seq, bytes.fromhex(digest), zlib.crc32(body))


def write_anchor_file(path: Path, seq: int, digest: str) -> None:
    """A head anchor file written whole and fsync'd (a restore's, backup.py)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, anchor_record(seq, digest))
        os.fsync(fd)
    finally:
        os.close(fd)


class _reader:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> sqlite3.Connection:
        if not self.path.exists():
            raise JournalError(f"no journal at {self.path}")
        self.conn = connect(self.path, readonly=True)
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
    """Every row in seq order, from one snapshot (one read transaction: a prune running
    meanwhile removes nothing from under it, and the WAL cannot be checkpointed past it until
    the export ends)."""
    with _reader(path) as conn:
        conn.execute("BEGIN")
        cursor = conn.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY seq")  # noqa: S608
        while page := cursor.fetchmany(batch):
            yield from (Row(*r) for r in page)
        conn.execute("COMMIT")


def checkpoint_rows(conn: sqlite3.Connection) -> list[Row]:
    """Every `journal.checkpoint` row (few: one per prune), in seq order."""
    return _rows(
        conn.execute(
            f"SELECT {_COLUMNS} FROM entries WHERE type = ? ORDER BY seq",  # noqa: S608
            (CHECKPOINT_TYPE,),
        )
    )


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
