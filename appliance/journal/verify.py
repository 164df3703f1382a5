"""Verification: the hash chain, the retention checkpoints and the head anchor.

Theory of operation
-------------------
One walk over the rows in seq order (`_walk`), whatever they come from: the live journal.db
(one read snapshot, so a prune running meanwhile removes nothing from under the walk), a backup
(a SQLite file: its signed head is the anchor), or an export (JSON lines: no anchor). It
reports the first problem by sequence number:

- the start: a journal that starts at seq 1 links to the genesis hash. One that starts later
  is accepted only if a checkpoint in it (a `journal.checkpoint` entry, retention.py) names
  the missing seq as removed and is signed by a trusted key; if its cut is complete, the first
  entry must link to the hash it recorded for the last entry removed (a cut interrupted by a
  crash leaves entries it names still there: the walk then meets the recorded hash on the way).
  Missing entries no checkpoint accounts for are `deleted`; a checkpoint whose signature fails
  is `forged`, one signed by a key not trusted is `untrusted`;
- every entry: its seq follows, it links to its predecessor, its hash is sha256 of its parts,
  its payload decodes and its columns agree with it (`edited`, `deleted`, `reordered`);
- every checkpoint in the chain: trusted signature, and the head it names is really the entry
  before it (so the signature covers the chain up to there: a rewrite of those entries is
  caught even with every hash recomputed);
- the anchor (journal.head, or a backup's signed head): the entry it names exists and has its
  hash; otherwise `truncated` / `edited`.

Trusted keys: the public keys the caller gives (applianced: its own journal key; offline: the
operator's `--public-key`). Without a key only a journal with no checkpoint can verify.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec

from . import entries as E
from . import signing
from .export import ExportReport, is_export, read_lines, verify_export
from .rows import (
    CHECKPOINT_TYPE,
    GENESIS,
    JournalError,
    Row,
    chain_hash,
    checkpoint_rows,
    connect,
    read_anchor,
)

SQLITE_MAGIC = b"SQLite format 3\x00"
BACKUP_HEAD_TABLE = "backup_head"


class Problem(msgspec.Struct, frozen=True):
    seq: int
    kind: str  # edited | deleted | reordered | truncated | forged | untrusted
    detail: str


class CheckpointInfo(msgspec.Struct, frozen=True):
    """The checkpoint that accounts for the entries before the journal's first one."""

    seq: int
    ts: float
    removed_from_seq: int
    removed_through_seq: int
    removed_entries: int
    removed_oldest_ts: float
    removed_newest_ts: float
    reason: str
    key: str


class VerifyReport(msgspec.Struct, frozen=True):
    ok: bool
    entries: int
    head_seq: int
    head_hash: str
    anchor_seq: int | None
    problem: Problem | None = None
    first_seq: int = 1
    checkpoint: CheckpointInfo | None = None
    checkpoints: int = 0  # checkpoints in the chain, each one's signature checked
    keys: tuple[str, ...] = ()  # the trusted public keys
    anchor_from: str | None = None  # "journal.head" | "signed backup head" | None
    keys_from_file: bool = False  # offline, no key given: checked with the file's own key


class _Anchor(msgspec.Struct, frozen=True):
    seq: int
    hash: str
    source: str


def verify(
    path: Path,
    anchor_path: Path | None = None,
    *,
    keys: Iterable[str] = (),
    until: int | None = None,
) -> VerifyReport:
    """The live journal (or any journal.db) with its anchor file. `until`: stop after that seq
    (retention verifies what it is about to remove; no anchor check then)."""
    anchor = None
    if anchor_path is not None and until is None:
        found = read_anchor(anchor_path)
        anchor = _Anchor(found[0], found[1], "journal.head") if found else None
    return _verify_db(path, anchor, tuple(keys), until=until)


def verify_file(path: Path, *, keys: Iterable[str] = ()) -> VerifyReport | ExportReport:
    """A backup (SQLite, its signed head as the anchor) or an export (JSON lines: a signed
    export, export.py, or the rows alone), offline: no applianced, no state directory needed.
    Without `keys` the file's own key is used (`keys_from_file` says so): that shows the file
    is intact, not who made it."""
    trusted = tuple(keys)
    try:
        with open(path, "rb") as file:
            first = file.readline()
    except OSError as exc:
        raise JournalError(f"cannot read {path}: {exc.strerror}") from None
    if first.startswith(SQLITE_MAGIC):
        from_file = not trusted
        if from_file:
            trusted = _backup_key(path)
        head, problem = backup_head(path, trusted)
        if problem is not None:
            return _failed(problem, trusted)
        report = _verify_db(path, head, trusted)
        return msgspec.structs.replace(report, keys_from_file=from_file)
    if is_export(first):
        return verify_export(read_lines(path), trusted)
    return _verify_export(path, trusted)


def _backup_key(path: Path) -> tuple[str, ...]:
    conn = connect(path, readonly=True)
    try:
        rows = conn.execute(f"SELECT key FROM {BACKUP_HEAD_TABLE}").fetchall()  # noqa: S608
    except sqlite3.DatabaseError:
        return ()
    finally:
        conn.close()
    return tuple(str(row[0]) for row in rows[:1])


def backup_head(path: Path, keys: tuple[str, ...]) -> tuple[_Anchor | None, Problem | None]:
    """A backup's signed head (backup.py), if it has one: (anchor, None), or (None, problem)
    if it is there and does not verify; (None, None) for a plain copy of a journal.db."""
    conn = connect(path, readonly=True)
    try:
        if not conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (BACKUP_HEAD_TABLE,)
        ).fetchone():
            return None, None
        row = conn.execute(
            f"SELECT head_seq, head_hash, taken, key, signature FROM {BACKUP_HEAD_TABLE}"  # noqa: S608
        ).fetchall()
    except sqlite3.DatabaseError as exc:
        raise JournalError(f"{path}: not a journal: {exc}") from None
    finally:
        conn.close()
    if len(row) != 1:
        return None, Problem(0, "edited", f"the backup's head table holds {len(row)} rows")
    seq, digest, taken, key, signature = row[0]
    if key not in keys:
        return None, Problem(
            seq, "untrusted", f"the backup's head is signed by key {key[:16]}..., not trusted"
        )
    if not signing.signature_valid(key, signing.backup_head_message(seq, digest, taken), signature):
        return None, Problem(seq, "forged", "the backup's signed head does not verify")
    return _Anchor(seq, digest, "signed backup head"), None


def _failed(problem: Problem, keys: tuple[str, ...]) -> VerifyReport:
    return VerifyReport(
        ok=False, entries=0, head_seq=0, head_hash=GENESIS, anchor_seq=None, problem=problem,
        keys=keys,
    )  # fmt: skip


def _verify_db(
    path: Path, anchor: _Anchor | None, keys: tuple[str, ...], *, until: int | None = None
) -> VerifyReport:
    if not path.exists():
        raise JournalError(f"no journal at {path}")
    conn = connect(path, readonly=True)
    try:
        conn.execute("BEGIN")  # one snapshot for the whole walk
        checkpoints = checkpoint_rows(conn)
        sql = "SELECT seq, ts, type, workspace, crew, agent, mission, trace_id, summary, "
        sql += "payload, prev_hash, hash FROM entries"
        args: tuple[int, ...] = ()
        if until is not None:
            sql, args = sql + " WHERE seq <= ?", (until,)
        cursor = conn.execute(sql + " ORDER BY seq", args)

        def rows() -> Iterator[Row]:
            while page := cursor.fetchmany(1000):
                yield from (Row(*r) for r in page)

        def seq_of_hash(digest: str) -> int | None:
            found = conn.execute("SELECT seq FROM entries WHERE hash = ?", (digest,)).fetchone()
            return int(found[0]) if found else None

        return _walk(rows(), checkpoints, seq_of_hash, anchor, keys)
    except sqlite3.DatabaseError as exc:
        raise JournalError(f"{path}: not a journal: {exc}") from None
    finally:
        conn.close()


_row_decoder = msgspec.json.Decoder(Row)


def _export_rows(path: Path) -> Iterator[Row]:
    with open(path, "rb") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                yield _row_decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise _BadLine(f"line {number} is not a journal row: {exc}") from None


class _BadLine(Exception):
    pass


def _verify_export(path: Path, keys: tuple[str, ...]) -> VerifyReport:
    try:
        checkpoints = [row for row in _export_rows(path) if row.type == CHECKPOINT_TYPE]

        def seq_of_hash(digest: str) -> int | None:
            return next((row.seq for row in _export_rows(path) if row.hash == digest), None)

        return _walk(_export_rows(path), checkpoints, seq_of_hash, None, keys)
    except _BadLine as exc:
        return _failed(Problem(0, "edited", f"{path}: {exc}"), keys)


def _decode_checkpoint(row: Row) -> E.Checkpoint | None:
    try:
        entry = E.decode(row.payload)
    except msgspec.DecodeError:
        return None  # the walk reports it when it gets there
    return entry if isinstance(entry, E.Checkpoint) else None


def _start(
    row: Row, checkpoints: dict[int, E.Checkpoint], keys: tuple[str, ...]
) -> tuple[CheckpointInfo | None, Problem | None]:
    """The checkpoint that accounts for a journal starting at row.seq > 1, or the problem."""
    missing = row.seq - 1
    covering = [
        (seq, c)
        for seq, c in checkpoints.items()
        if c.removed_from_seq <= missing <= c.removed_through_seq
    ]
    if not covering:
        earlier = [c.removed_through_seq for c in checkpoints.values()]
        accounted = max((seq for seq in earlier if seq < row.seq), default=0)
        return None, Problem(
            accounted + 1,
            "deleted",
            f"entries {accounted + 1}..{missing} are missing and no checkpoint accounts for them",
        )
    why, seq, checkpoint = "", 0, covering[0][1]
    for seq, checkpoint in sorted(covering, reverse=True):  # noqa: B007 (used after the loop)
        why = signing.check_checkpoint(checkpoint, keys) or ""
        if not why:
            break
    if why:
        kind = "untrusted" if "not trusted" in why else "forged"
        return None, Problem(seq, kind, f"checkpoint {seq} (removing up to {missing}): {why}")
    if row.seq == checkpoint.removed_through_seq + 1 and (
        row.prev_hash != checkpoint.removed_through_hash
    ):
        return None, Problem(
            row.seq,
            "edited",
            f"entry {row.seq} does not link to the last entry checkpoint {seq} removed",
        )
    info = CheckpointInfo(
        seq=seq,
        ts=checkpoint.ts,
        removed_from_seq=checkpoint.removed_from_seq,
        removed_through_seq=checkpoint.removed_through_seq,
        removed_entries=checkpoint.removed_entries,
        removed_oldest_ts=checkpoint.removed_oldest_ts,
        removed_newest_ts=checkpoint.removed_newest_ts,
        reason=checkpoint.reason,
        key=checkpoint.key,
    )
    return info, None


def _check_row(row: Row, prev: str, seq_of_hash: Callable[[str], int | None]) -> Problem | None:
    if row.prev_hash != prev:
        moved = seq_of_hash(row.prev_hash)
        if moved is not None:
            return Problem(
                row.seq,
                "reordered",
                f"entry {row.seq} links to the entry now at {moved}, not to {row.seq - 1}",
            )
        # The predecessor's hash checked out on its own, so it was rewritten together with its
        # hash; or this entry's link itself was edited.
        return Problem(
            row.seq - 1,
            "edited",
            f"entry {row.seq - 1} was rewritten: entry {row.seq} links to another hash",
        )
    if chain_hash(row.prev_hash, row.seq, row.summary, row.payload) != row.hash:
        return Problem(row.seq, "edited", f"entry {row.seq}: content does not match its hash")
    try:
        entry = E.decode(row.payload)
    except msgspec.DecodeError as exc:
        return Problem(row.seq, "edited", f"entry {row.seq}: payload unreadable: {exc}")
    columns = (row.ts, row.type, row.workspace, row.crew, row.agent, row.mission, row.trace_id)
    tag = str(type(entry).__struct_config__.tag)
    scope = (entry.workspace, entry.crew, entry.agent, entry.mission, entry.trace_id)
    if columns != (entry.ts, tag, *scope):
        return Problem(row.seq, "edited", f"entry {row.seq}: columns differ from its payload")
    return None


def _walk(
    rows: Iterator[Row],
    checkpoint_list: list[Row],
    seq_of_hash: Callable[[str], int | None],
    anchor: _Anchor | None,
    keys: tuple[str, ...],
) -> VerifyReport:
    checkpoints = {
        row.seq: c for row in checkpoint_list if (c := _decode_checkpoint(row)) is not None
    }
    # seq -> (the checkpoint that recorded it as its last removed entry, that entry's hash)
    recorded = {
        c.removed_through_seq: (seq, c.removed_through_hash) for seq, c in checkpoints.items()
    }
    first_seq, expected_seq, prev = 1, 1, GENESIS
    count, head_hash, walked_checkpoints = 0, GENESIS, 0
    problem: Problem | None = None
    start: CheckpointInfo | None = None
    anchor_row_hash: str | None = None
    for row in rows:
        if count == 0 and row.seq != 1:
            first_seq = expected_seq = row.seq
            start, problem = _start(row, checkpoints, keys)
            if problem is not None:
                break
            prev = row.prev_hash  # its link was checked against the checkpoint, if it can be
        count += 1
        if row.seq != expected_seq:
            problem = Problem(
                expected_seq, "deleted", f"entry {expected_seq} is missing (next is {row.seq})"
            )
            break
        problem = _check_row(row, prev, seq_of_hash)
        if problem is None and row.type == CHECKPOINT_TYPE:
            problem = _check_checkpoint_row(row, checkpoints.get(row.seq), keys)
            walked_checkpoints += 1
        if problem is None and row.seq in recorded and recorded[row.seq][1] != row.hash:
            problem = Problem(
                row.seq,
                "edited",
                f"entry {row.seq} does not have the hash checkpoint {recorded[row.seq][0]} "
                "recorded for it",
            )
        if problem is not None:
            break
        if anchor is not None and row.seq == anchor.seq:
            anchor_row_hash = row.hash
        prev, head_hash = row.hash, row.hash
        expected_seq += 1
    head_seq = expected_seq - 1 if count else 0
    if problem is None and anchor is not None:
        if anchor.seq > head_seq:
            problem = Problem(
                head_seq + 1,
                "truncated",
                f"the anchor ({anchor.source}) names entry {anchor.seq}; the journal ends at "
                f"{head_seq}",
            )
        elif anchor_row_hash != anchor.hash:
            problem = Problem(
                anchor.seq,
                "edited",
                f"entry {anchor.seq} does not have the hash the anchor ({anchor.source}) names",
            )
    return VerifyReport(
        ok=problem is None,
        entries=count,
        head_seq=head_seq,
        head_hash=head_hash,
        anchor_seq=anchor.seq if anchor else None,
        problem=problem,
        first_seq=first_seq,
        checkpoint=start,
        checkpoints=walked_checkpoints,
        keys=keys,
        anchor_from=anchor.source if anchor else None,
    )


def _check_checkpoint_row(
    row: Row, checkpoint: E.Checkpoint | None, keys: tuple[str, ...]
) -> Problem | None:
    if checkpoint is None:  # decoded fine in _check_row, so it is another type's payload
        return Problem(row.seq, "edited", f"entry {row.seq}: not a checkpoint's payload")
    why = signing.check_checkpoint(checkpoint, keys)
    if why:
        kind = "untrusted" if "not trusted" in why else "forged"
        return Problem(row.seq, kind, f"checkpoint {row.seq}: {why}")
    if (checkpoint.head_seq, checkpoint.head_hash) != (row.seq - 1, row.prev_hash):
        return Problem(
            row.seq, "edited", f"checkpoint {row.seq} names another head than the entry before it"
        )
    return None
