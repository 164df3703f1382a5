"""Backup and restore of the journal.

Theory of operation
-------------------
backup (applianced, while it runs; `appliancectl journal backup FILE`):

    copy journal.db with SQLite's online backup API from a read connection, in one step: the
        copy is one snapshot (WAL: the writer keeps committing meanwhile, the copy sees none of
        it), into FILE.partial (0600), then switched to rollback-journal mode: one file
    verify the copy (chain, checkpoints) with applianced's keys; a journal that fails is not
        backed up with a signature (copy the files by hand to keep the evidence)
    add a table `backup_head` with one row: the head (seq, hash) of the copy, when it was
        taken, and an Ed25519 signature over them (signing.backup_head_message): the backup's
        anchor, as journal.head is the live journal's, except that it cannot be rewritten
        without the key
    fsync, rename FILE.partial to FILE, fsync the directory

restore (offline; `appliancectl journal restore FILE`):

    refuse while applianced holds the state directory (its lock): a journal is never replaced
        under its writer, --force or not
    refuse if a journal is there, unless --force: then it is kept, renamed with its WAL and
        anchor to journal.db.replaced-<time> (nothing is lost)
    verify the backup (signed head included) with the trusted keys, copy it to
        journal.db.restoring, drop its backup_head, switch it to WAL, verify the copy again
    move the old journal aside, write the anchor (journal.head) for the restored head, rename
        journal.db.restoring to journal.db, fsync the directory

A crash before the last rename leaves the old journal (or its renamed copy) and a
journal.db.restoring that the next restore overwrites; after it, the restored journal.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sqlite3
import time
from pathlib import Path

import msgspec

from . import signing
from .rows import JournalError, connect, write_anchor_file
from .verify import BACKUP_HEAD_TABLE, VerifyReport, verify, verify_file


class BackupReport(msgspec.Struct, frozen=True):
    path: str
    entries: int
    first_seq: int
    head_seq: int
    head_hash: str
    taken: float
    bytes: int
    seconds: float
    key: str


class RestoreReport(msgspec.Struct, frozen=True):
    path: str
    source: str
    entries: int
    first_seq: int
    head_seq: int
    head_hash: str
    replaced: str | None  # where the journal it replaced was kept
    verified_with: str | None  # "signed backup head" or None (a plain copy of journal.db)


class BackupRefused(JournalError):
    """A backup or restore that would lose or bless something; the message says what."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _problem_text(report: VerifyReport) -> str:
    problem = report.problem
    assert problem is not None
    return f"entry {problem.seq} ({problem.kind}): {problem.detail}"


def backup(
    source: Path,
    dest: Path,
    signer: signing.Signer,
    *,
    keys: tuple[str, ...] = (),
) -> BackupReport:
    """A consistent, signed copy of the journal at `source` in `dest` (blocking)."""
    started = time.monotonic()
    dest = Path(dest)
    if dest.exists():
        raise BackupRefused(f"{dest} exists: give a new file name")
    if not dest.parent.is_dir():
        raise BackupRefused(f"{dest.parent} is not a directory")
    partial = dest.with_name(dest.name + ".partial")
    with contextlib.suppress(FileNotFoundError):
        partial.unlink()
    old = os.umask(0o077)  # the journal names every crew's traffic: owner only
    try:
        src = connect(source, readonly=True)
        out = sqlite3.connect(partial, isolation_level=None)
    finally:
        os.umask(old)
    try:
        try:
            src.backup(out)  # pages=-1: one step, so one snapshot of the source
        finally:
            src.close()
        out.execute("PRAGMA journal_mode = DELETE")  # one self-contained file
        out.close()
        report = verify(partial, keys=(signer.public, *keys))
        if not report.ok:
            raise BackupRefused(
                f"the journal fails verification at {_problem_text(report)}; no signed backup "
                "made (stop applianced and copy journal.db, journal.db-wal and journal.head to "
                "keep the evidence)"
            )
        taken = time.time()
        signature = signer.sign(
            signing.backup_head_message(report.head_seq, report.head_hash, taken)
        )
        out = sqlite3.connect(partial, isolation_level=None)
        out.execute(
            f"CREATE TABLE {BACKUP_HEAD_TABLE} (head_seq INTEGER NOT NULL, head_hash TEXT NOT "
            "NULL, taken REAL NOT NULL, key TEXT NOT NULL, signature TEXT NOT NULL)"
        )
        out.execute(
            f"INSERT INTO {BACKUP_HEAD_TABLE} VALUES (?, ?, ?, ?, ?)",  # noqa: S608
            (report.head_seq, report.head_hash, taken, signer.public, signature),
        )
        out.close()
        _fsync_file(partial)
        os.rename(partial, dest)
        _fsync_dir(dest.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        raise
    return BackupReport(
        path=str(dest),
        entries=report.entries,
        first_seq=report.first_seq,
        head_seq=report.head_seq,
        head_hash=report.head_hash,
        taken=taken,
        bytes=dest.stat().st_size,
        seconds=time.monotonic() - started,
        key=signer.public,
    )


def _state_unlocked(lock_path: Path) -> int:
    """An fd holding the state directory's lock (applianced's), or BackupRefused."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BackupRefused(
            f"applianced is running (it holds {lock_path}): stop it first; a journal is never "
            "replaced under its writer"
        ) from None
    return fd


def restore(
    source: Path,
    journal_path: Path,
    *,
    keys: tuple[str, ...],
    lock_path: Path,
    force: bool = False,
) -> RestoreReport:
    """Replace the journal at `journal_path` by the backup `source` (blocking; applianced must
    be stopped). BackupRefused, naming why, if it cannot be done safely."""
    source, journal_path = Path(source), Path(journal_path)
    lock_fd = _state_unlocked(lock_path)
    try:
        return _restore(source, journal_path, keys, force)
    finally:
        os.close(lock_fd)


def _restore(source: Path, journal_path: Path, keys: tuple[str, ...], force: bool) -> RestoreReport:
    if not keys:
        raise BackupRefused("no trusted key to verify the backup with")
    exists = journal_path.exists()
    if exists and not force:
        raise BackupRefused(
            f"{journal_path} exists: restoring replaces it (give --force; it is kept as "
            f"{journal_path.name}.replaced-<time>)"
        )
    checked = verify_file(source, keys=keys)
    if not isinstance(checked, VerifyReport):
        raise BackupRefused(f"{source} is an export, not a backup: it cannot be restored")
    if not checked.ok:
        raise BackupRefused(f"{source} fails verification at {_problem_text(checked)}")
    staged = journal_path.with_name(journal_path.name + ".restoring")
    old = os.umask(0o077)
    try:
        shutil.copyfile(source, staged)
    finally:
        os.umask(old)
    conn = sqlite3.connect(staged, isolation_level=None)
    try:
        conn.execute(f"DROP TABLE IF EXISTS {BACKUP_HEAD_TABLE}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    again = verify(staged, keys=keys)
    if not again.ok or (again.head_seq, again.head_hash) != (checked.head_seq, checked.head_hash):
        staged.unlink()
        raise BackupRefused(f"the restored copy does not verify: {again.problem}")
    _fsync_file(staged)
    replaced = None
    anchor = journal_path.with_suffix(".head")
    if exists:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        replaced = str(journal_path.with_name(f"{journal_path.name}.replaced-{stamp}"))
        for suffix in ("-wal", "-shm"):
            # The old WAL goes with the old file (renamed the same way), so it stays readable.
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{journal_path}{suffix}", f"{replaced}{suffix}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(anchor, f"{replaced}.head")
        os.rename(journal_path, replaced)
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{journal_path}{suffix}")
    write_anchor_file(anchor, checked.head_seq, checked.head_hash)
    os.rename(staged, journal_path)
    _fsync_dir(journal_path.parent)
    return RestoreReport(
        path=str(journal_path),
        source=str(source),
        entries=checked.entries,
        first_seq=checked.first_seq,
        head_seq=checked.head_seq,
        head_hash=checked.head_hash,
        replaced=replaced,
        verified_with=checked.anchor_from,
    )
