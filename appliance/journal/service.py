"""The journal's lifecycle as applianced runs it: its key, retention, export and backup.

One object that the daemon opens at start (`open_lifecycle`) and its admin routes call: the
routes stay one line each, and everything that touches the journal's files is in this package.
Every method blocks (SQLite, fsync): call it with trio.to_thread.run_sync.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import trio

from . import signing
from .backup import BackupReport, backup
from .export import ExportFilter, export_lines
from .retention import (
    PruneReport,
    PruneRequest,
    RetentionPolicy,
    keep_pruned,
    policy_for,
    prune,
)
from .store import Journal
from .verify import VerifyReport, verify


class JournalLifecycle:
    def __init__(
        self,
        journal: Journal,
        signer: signing.Signer,
        *,
        retired_keys: tuple[str, ...] = (),
        policy: RetentionPolicy | None = None,
        interval: float = 3600.0,
    ) -> None:
        self.journal = journal
        self.signer = signer
        self.retired_keys = tuple(k for k in retired_keys if k != signer.public)
        self.policy = policy or RetentionPolicy()
        self.interval = interval

    @property
    def keys(self) -> tuple[str, ...]:
        """The trusted public keys: the current one first, then the retired ones."""
        return (self.signer.public, *self.retired_keys)

    def verify(self) -> VerifyReport:
        return verify(self.journal.path, self.journal.anchor_path, keys=self.keys)

    def prune(self, request: PruneRequest) -> PruneReport:
        return prune(
            self.journal,
            policy_for(request, self.policy),
            self.signer,
            dry_run=request.dry_run,
            trusted=self.keys,
        )

    def export(self, where: ExportFilter) -> Iterator[bytes]:
        """The signed export's lines; the live journal is verified first and the header says
        how that went (a journal that fails is still exported: it is the evidence)."""
        report = self.verify()
        problem = report.problem
        return export_lines(
            self.journal.path,
            self.signer,
            where,
            retired_keys=self.retired_keys,
            verified=report.ok,
            verify_problem=f"entry {problem.seq} ({problem.kind}): {problem.detail}"
            if problem
            else None,
        )

    def backup(self, dest: str) -> BackupReport:
        if not os.path.isabs(dest):
            raise ValueError(f"argument path: {dest!r} must be absolute")
        return backup(self.journal.path, Path(dest), self.signer, keys=self.retired_keys)

    async def keep_pruned(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await keep_pruned(
            self.journal, self.signer, self.policy, self.interval, task_status=task_status,
            trusted=self.keys,
        )  # fmt: skip


def open_lifecycle(
    journal: Journal,
    state_dir: Path,
    *,
    key_file: str | None = None,
    trusted_keys: tuple[str, ...] = (),
    keep_days: float = 0.0,
    keep_bytes: int = 0,
    prune_interval: float = 3600.0,
) -> JournalLifecycle:
    """applianced's: the key in `key_file` (default <state_dir>/journal.key, created 0600 at
    first start); credstore's KeyUnusable if it cannot be used."""
    signer = signing.load_signer(Path(key_file) if key_file else state_dir / signing.KEY_FILE)
    return JournalLifecycle(
        journal,
        signer,
        retired_keys=tuple(signing.parse_public_key(k) for k in trusted_keys),
        policy=RetentionPolicy(keep_days=keep_days, keep_bytes=keep_bytes),
        interval=prune_interval,
    )
