"""Retention: cutting off the journal's oldest entries behind a signed checkpoint.

Theory of operation
-------------------
    plan, on a read snapshot: the cut `through` is the last entry before the first one younger
        than keep_days, or as many of the oldest entries as bring the file under keep_bytes
        (in proportion: entries differ in size, so it lands near keep_bytes), whichever removes
        more
    verify what is about to go (entries up to through + 1, read-only, beside the writer): a
        cut must not destroy the evidence of a tampering, so a journal that fails is not pruned
    job 1, one step: append the checkpoint (journal.checkpoint: the range removed, the hash of
        its last entry, count, time span, the head it was cut at) signed with applianced's key;
        from its commit on, the DELETE trigger lets those entries go
    job 2, steps of `batch` entries, each its own transaction: delete them, oldest first (the
        FTS index forgets each through its delete trigger)
    job 3, steps: merge the FTS index (the deleted rows' tombstones go only when its segments
        are merged), give the free pages back to the file system (incremental_vacuum; a journal
        created before auto_vacuum is rebuilt once with VACUUM) and truncate the WAL

Every job step runs on the journal's writer thread between two batches of entries
(store.Journal.run_job), so the recorder waits for one step at a time: the pauses are measured
in the report (`longest_pause`) and in docs/journal.md. A crash between the jobs leaves entries
the checkpoint names in place; verify accepts that, and the next prune deletes them first.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sqlite3
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import msgspec
import trio

from . import entries as E
from .rows import JournalError, checkpoint_rows, connect
from .signing import Signer
from .store import Journal
from .verify import Problem, verify

log = logging.getLogger("applianced.journal")

DELETE_BATCH = 1_000  # entries per delete step (docs/journal.md, "Retention": the pauses)
MERGE_PAGES = 200  # FTS5 pages written per merge step
VACUUM_PAGES = 500  # pages given back per incremental_vacuum step
DAY = 86_400.0


class RetentionPolicy(msgspec.Struct, frozen=True):
    """0 means no limit of that kind."""

    keep_days: float = 0.0
    keep_bytes: int = 0

    @property
    def limited(self) -> bool:
        return self.keep_days > 0 or self.keep_bytes > 0

    def describe(self) -> str:
        parts = []
        if self.keep_days > 0:
            parts.append(f"keep_days {self.keep_days:g}")
        if self.keep_bytes > 0:
            parts.append(f"keep_bytes {self.keep_bytes}")
        return ", ".join(parts) or "no limit"


class PruneRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """POST /v1/journal/prune: a limit given here replaces the configured one."""

    keep_days: float | None = None
    keep_bytes: int | None = None
    dry_run: bool = False


class Phase(msgspec.Struct, frozen=True):
    """One part of a prune: its wall time, its writer steps and the longest of them."""

    seconds: float
    steps: int = 0
    longest_pause: float = 0.0


class PruneReport(msgspec.Struct, frozen=True):
    removed: int  # entries this prune deleted
    through_seq: int  # every entry up to here is gone (0: none ever was)
    first_seq: int  # the journal's first entry now
    checkpoint_seq: int | None  # the checkpoint this prune wrote
    reason: str
    bytes_before: int  # journal.db and its WAL
    bytes_after: int
    seconds: float
    steps: int
    longest_pause: float  # the longest step: the most the recorder waited for the writer
    rebuilt: bool = False  # a journal from before auto_vacuum, rebuilt by VACUUM
    dry_run: bool = False
    # verify, checkpoint, delete, fts_merge, vacuum, wal: where the time went
    phases: dict[str, Phase] = msgspec.field(default_factory=dict)


class JournalTampered(JournalError):
    """The entries a prune would remove fail verification: nothing is removed."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        super().__init__(
            f"the journal fails verification at entry {problem.seq} ({problem.kind}): "
            f"{problem.detail}; nothing was pruned"
        )


class _Plan(msgspec.Struct, frozen=True):
    first: int  # the first entry present (0: empty journal)
    head: int
    through: int  # delete every entry up to here (0: nothing)
    checkpointed: int  # the furthest any checkpoint already allows (a cut not finished)
    reason: str


def file_bytes(path: Path) -> int:
    total = 0
    for suffix in ("", "-wal"):
        with contextlib.suppress(FileNotFoundError):
            total += Path(f"{path}{suffix}").stat().st_size
    return total


def _plan(path: Path, policy: RetentionPolicy, now: float) -> _Plan:
    conn = connect(path, readonly=True)
    try:
        conn.execute("BEGIN")
        first, head = conn.execute("SELECT MIN(seq), MAX(seq) FROM entries").fetchone()
        if first is None:
            return _Plan(0, 0, 0, 0, "the journal is empty")
        checkpointed = 0
        for row in checkpoint_rows(conn):
            with contextlib.suppress(msgspec.DecodeError):
                entry = E.decode(row.payload)
                if isinstance(entry, E.Checkpoint):
                    checkpointed = max(checkpointed, entry.removed_through_seq)
        through, reasons = 0, []
        if policy.keep_days > 0:
            # In seq order from the oldest: the scan stops at the first young entry.
            young = conn.execute(
                "SELECT seq FROM entries WHERE ts >= ? ORDER BY seq LIMIT 1",
                (now - policy.keep_days * DAY,),
            ).fetchone()
            cut = young[0] - 1 if young else head
            if cut >= first:
                through = cut
                reasons.append(f"older than keep_days {policy.keep_days:g}")
        if policy.keep_bytes > 0:
            page_size = conn.execute("PRAGMA page_size").fetchone()[0]
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            free = conn.execute("PRAGMA freelist_count").fetchone()[0]
            used = (pages - free) * page_size
            if used > policy.keep_bytes:
                count = head - first + 1
                cut = first - 1 + math.ceil(count * (used - policy.keep_bytes) / used)
                if cut > through:
                    through = cut
                reasons.append(f"{used} bytes over keep_bytes {policy.keep_bytes}")
        return _Plan(first, head, min(through, head), checkpointed, "; ".join(reasons))
    finally:
        conn.close()


def prune(
    journal: Journal,
    policy: RetentionPolicy,
    signer: Signer,
    *,
    now: float | None = None,
    dry_run: bool = False,
    batch: int = DELETE_BATCH,
    trusted: tuple[str, ...] = (),
) -> PruneReport:
    """Apply `policy` (blocking; call it off the trio thread). JournalTampered if what would be
    removed does not verify; nothing is removed then. `trusted`: the public keys earlier
    checkpoints may be signed with (the signer's own is always trusted)."""
    keys = (signer.public, *(k for k in trusted if k != signer.public))
    with journal.maintenance:
        return _prune(journal, policy, signer, now or time.time(), dry_run, batch, keys)


def _prune(
    journal: Journal,
    policy: RetentionPolicy,
    signer: Signer,
    now: float,
    dry_run: bool,
    batch: int,
    keys: tuple[str, ...],
) -> PruneReport:
    started = time.monotonic()
    before = file_bytes(journal.path)
    plan = _plan(journal.path, policy, now)
    through = max(plan.through, plan.checkpointed)
    if dry_run or plan.first == 0 or through < plan.first:
        cut = plan.first != 0 and through >= plan.first
        return PruneReport(
            removed=through - plan.first + 1 if cut else 0,  # dry run: what it would remove
            through_seq=through if cut else max(plan.first - 1, 0),
            first_seq=through + 1 if cut else plan.first,
            checkpoint_seq=None,
            reason=plan.reason or f"nothing to remove ({policy.describe()})",
            bytes_before=before,
            bytes_after=before,
            seconds=time.monotonic() - started,
            steps=0,
            longest_pause=0.0,
            dry_run=dry_run,
        )
    phases: dict[str, Phase] = {}

    def run(name: str, make: Callable[[sqlite3.Connection], Generator[None, None, Any]]) -> Any:
        began = time.monotonic()
        job = journal.run_job(make)
        result = job.wait()
        phases[name] = Phase(time.monotonic() - began, len(job.pauses), max(job.pauses))
        return result

    checkpoint_seq = None
    if plan.through > plan.checkpointed:
        began = time.monotonic()
        report = verify(journal.path, keys=keys, until=plan.through + 1)
        phases["verify"] = Phase(time.monotonic() - began)
        if report.problem is not None:
            raise JournalTampered(report.problem)
        checkpoint = _unsigned_checkpoint(journal.path, plan, now)
        checkpoint_seq = run("checkpoint", lambda conn: _append(journal, signer, checkpoint))
    removed = run("delete", lambda conn: _delete(conn, plan.first, through, batch))
    run("fts_merge", _merge_fts)
    rebuilt = run("vacuum", _vacuum)
    run("wal", _truncate_wal)
    return PruneReport(
        removed=removed,
        through_seq=through,
        first_seq=through + 1,
        checkpoint_seq=checkpoint_seq,
        reason=plan.reason or "finishing an earlier cut",
        bytes_before=before,
        bytes_after=file_bytes(journal.path),
        seconds=time.monotonic() - started,
        steps=sum(phase.steps for phase in phases.values()),
        longest_pause=max(phase.longest_pause for phase in phases.values()),
        rebuilt=rebuilt,
        phases=phases,
    )


def _unsigned_checkpoint(path: Path, plan: _Plan, now: float) -> E.Checkpoint:
    conn = connect(path, readonly=True)
    try:
        count, oldest, newest = conn.execute(
            "SELECT COUNT(*), MIN(ts), MAX(ts) FROM entries WHERE seq BETWEEN ? AND ?",
            (plan.first, plan.through),
        ).fetchone()
        (last_hash,) = conn.execute(
            "SELECT hash FROM entries WHERE seq = ?", (plan.through,)
        ).fetchone()
    finally:
        conn.close()
    return E.Checkpoint(
        ts=now,
        removed_from_seq=plan.first,
        removed_through_seq=plan.through,
        removed_through_hash=last_hash,
        removed_entries=count,
        removed_oldest_ts=oldest,
        removed_newest_ts=newest,
        reason=plan.reason,
        head_seq=0,
        head_hash="",
        key="",
    )


def _append(
    journal: Journal, signer: Signer, checkpoint: E.Checkpoint
) -> Generator[None, None, int]:
    def at_head(head_seq: int, head_hash: str) -> E.Checkpoint:
        placed = msgspec.structs.replace(checkpoint, head_seq=head_seq, head_hash=head_hash)
        return signer.sign_checkpoint(placed)

    return journal.append_checkpoint(at_head)
    yield  # a generator of one step


def _delete(
    conn: sqlite3.Connection, first: int, through: int, batch: int
) -> Generator[None, None, int]:
    removed, low = 0, first
    while low <= through:
        high = min(low + batch - 1, through)
        conn.execute("BEGIN IMMEDIATE")
        try:
            removed += conn.execute(
                "DELETE FROM entries WHERE seq BETWEEN ? AND ?", (low, high)
            ).rowcount
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        low = high + 1
        yield
    return removed


def _merge_fts(conn: sqlite3.Connection) -> Generator[None, None, None]:
    # FTS5 drops a deleted row's postings only when the segments holding them are merged. A
    # negative first 'merge' puts every segment on one level (an incremental 'optimize'); the
    # positive ones after it continue that merge even if entries arrive meanwhile, until
    # total_changes moves by less than 2: no work was left (sqlite.org/fts5.html, "merge").
    size = -MERGE_PAGES
    while True:
        changes = conn.total_changes
        conn.execute("INSERT INTO entries_fts (entries_fts, rank) VALUES ('merge', ?)", (size,))
        yield
        if conn.total_changes - changes < 2:
            return
        size = MERGE_PAGES


def _vacuum(conn: sqlite3.Connection) -> Generator[None, None, bool]:
    """Give the free pages back to the file system; True if the file had to be rebuilt."""
    rebuilt = False
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
        # A journal created before auto_vacuum: only VACUUM can switch it (one long step; it
        # copies what is left, after the deletions).
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        conn.execute("VACUUM")
        rebuilt = True
        yield
    while conn.execute("PRAGMA freelist_count").fetchone()[0] > 0:
        # Each sqlite3_step of this pragma frees one page and Python's execute() steps once:
        # executescript steps it to its end.
        conn.executescript(f"PRAGMA incremental_vacuum({VACUUM_PAGES})")
        yield
    return rebuilt


def _truncate_wal(conn: sqlite3.Connection) -> Generator[None, None, None]:
    # Every commit above left its pages in the WAL (the automatic checkpoints copy them back
    # but never shrink the file): copy what is left and truncate it to zero bytes.
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return
    yield  # a generator of one step


async def keep_pruned(
    journal: Journal,
    signer: Signer,
    policy: RetentionPolicy,
    interval: float,
    *,
    trusted: tuple[str, ...] = (),
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """applianced's retention: prune every `interval` seconds (the first one a minute after
    start, or sooner if the interval is shorter). A prune refused because the journal does not
    verify is logged as an error every time; nothing is removed until it is resolved."""
    task_status.started()
    if not policy.limited:
        return
    await trio.sleep(min(interval, 60.0))
    while True:
        try:
            report = await trio.to_thread.run_sync(
                functools.partial(prune, journal, policy, signer, trusted=trusted)
            )
        except JournalTampered as exc:
            log.error("retention: %s", exc)
        except JournalError as exc:
            log.error("retention failed: %s", exc)
        else:
            if report.removed:
                log.info(
                    "retention: removed %d entries (through %d, %s), %d -> %d bytes, "
                    "longest pause %.3f s",
                    report.removed,
                    report.through_seq,
                    report.reason,
                    report.bytes_before,
                    report.bytes_after,
                    report.longest_pause,
                )
        await trio.sleep(interval)


def policy_for(request: PruneRequest, configured: RetentionPolicy) -> RetentionPolicy:
    """The request's limits where given, the configured ones otherwise."""
    return RetentionPolicy(
        keep_days=configured.keep_days if request.keep_days is None else request.keep_days,
        keep_bytes=configured.keep_bytes if request.keep_bytes is None else request.keep_bytes,
    )
