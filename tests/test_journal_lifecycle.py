"""The journal's lifecycle without a daemon: retention with a signed checkpoint against an
attacker holding the file, a prune cut short by a real SIGKILL, signed exports verified offline,
backup and restore."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from appliance.journal import Journal, verify, verify_file
from appliance.journal import entries as E
from appliance.journal.backup import BackupRefused, backup, restore
from appliance.journal.export import ExportFilter, ExportReport, verify_export
from appliance.journal.retention import RetentionPolicy, _delete, prune
from appliance.journal.rows import chain_hash
from appliance.journal.signing import KEY_FILE, Signer, checkpoint_message, load_signer
from appliance.journal.verify import VerifyReport

DAY = 86_400.0
ROOT = Path(__file__).resolve().parents[1]


def fill(journal: Journal, count: int, *, start: float, step: float = 3600.0) -> None:
    tickets = [
        journal.submit(E.AllowlistChanged(ts=start + i * step, crew=f"c{i % 3}", host=f"h{i}"))
        for i in range(count)
    ]
    for ticket in tickets:
        ticket.wait(30)


@pytest.fixture
def signer() -> Signer:
    return Signer(os.urandom(32))


@pytest.fixture
def pruned(tmp_path: Path, signer: Signer) -> tuple[Path, Signer]:
    """A journal of 100 entries an hour apart, the 60 oldest pruned (keep 40 hours)."""
    path = tmp_path / "journal.db"
    journal = Journal(path)
    now = time.time()
    fill(journal, 100, start=now - 99 * 3600)
    report = prune(journal, RetentionPolicy(keep_days=39.5 / 24), signer, now=now)
    assert report.removed == 60 and report.through_seq == 60, report
    assert report.checkpoint_seq == 101
    journal.close()
    return path, signer


def check(path: Path, signer: Signer) -> VerifyReport:
    return verify(path, path.with_suffix(".head"), keys=(signer.public,))


def attacker(path: Path) -> sqlite3.Connection:
    """What root can do with the file: drop the triggers and write."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DROP TRIGGER IF EXISTS entries_no_delete")
    conn.execute("DROP TRIGGER IF EXISTS entries_no_update")
    return conn


def rows_of(conn: sqlite3.Connection) -> list[tuple[object, ...]]:
    return conn.execute("SELECT * FROM entries ORDER BY seq").fetchall()


# -- retention ---------------------------------------------------------------------------------


def test_a_pruned_journal_verifies_from_its_signed_checkpoint(
    pruned: tuple[Path, Signer],
) -> None:
    path, signer = pruned
    report = check(path, signer)
    assert report.ok, report.problem
    assert (report.first_seq, report.head_seq, report.entries) == (61, 101, 41)
    assert report.checkpoint is not None
    assert (report.checkpoint.removed_from_seq, report.checkpoint.removed_through_seq) == (1, 60)
    assert report.checkpoint.removed_entries == 60
    # The journal grows on from there and a second cut chains onto the first.
    journal = Journal(path)
    fill(journal, 5, start=time.time())
    second = prune(journal, RetentionPolicy(keep_bytes=1), signer)
    assert second.removed > 0 and second.checkpoint_seq is not None
    assert journal.verify(keys=(signer.public,)).ok
    journal.close()


def test_without_the_key_a_pruned_journal_does_not_verify(pruned: tuple[Path, Signer]) -> None:
    path, _ = pruned
    report = verify(path, path.with_suffix(".head"))
    assert not report.ok and report.problem is not None
    assert report.problem.kind == "untrusted"
    assert "journal verify" in report.problem.detail  # says where to get the key


def test_nothing_is_pruned_when_the_limits_keep_everything(tmp_path: Path, signer: Signer) -> None:
    journal = Journal(tmp_path / "journal.db")
    fill(journal, 10, start=time.time() - 100)
    report = prune(journal, RetentionPolicy(keep_days=1), signer)
    assert report.removed == 0 and report.checkpoint_seq is None
    dry = prune(journal, RetentionPolicy(keep_bytes=1), signer, dry_run=True)
    assert dry.dry_run and dry.removed > 0
    assert journal.verify(keys=(signer.public,)).entries == 10  # a dry run removes nothing
    journal.close()


def test_the_delete_trigger_still_refuses_what_no_checkpoint_names(
    pruned: tuple[Path, Signer],
) -> None:
    path, _ = pruned
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        conn.execute("DELETE FROM entries WHERE seq = 61")
    conn.close()


def test_attack_removing_entries_after_the_checkpoint_cut(pruned: tuple[Path, Signer]) -> None:
    path, signer = pruned
    conn = attacker(path)
    conn.execute("DELETE FROM entries WHERE seq BETWEEN 61 AND 63")  # beyond what was signed
    conn.close()
    report = check(path, signer)
    assert not report.ok and report.problem is not None
    assert report.problem.kind == "deleted"
    assert "61..63" in report.problem.detail


def test_attack_truncating_in_the_middle(pruned: tuple[Path, Signer]) -> None:
    path, signer = pruned
    conn = attacker(path)
    conn.execute("DELETE FROM entries WHERE seq BETWEEN 70 AND 80")
    conn.close()
    report = check(path, signer)
    assert not report.ok and report.problem is not None
    assert (report.problem.kind, report.problem.seq) == ("deleted", 70)


def test_attack_editing_the_checkpoint(pruned: tuple[Path, Signer]) -> None:
    """Claim more was removed (to hide entries 61..70), with every hash recomputed."""
    path, signer = pruned
    conn = attacker(path)
    rows = rows_of(conn)
    seq, *_, payload, prev, _hash = rows[-1]
    forged = msgspec.structs.replace(E.decode(payload), removed_through_seq=70)
    forged_payload = E.encode(forged).decode()
    summary = forged.summary()
    conn.execute("DELETE FROM entries WHERE seq BETWEEN 61 AND 70")
    conn.execute(
        "UPDATE entries SET payload = ?, summary = ?, hash = ? WHERE seq = ?",
        (forged_payload, summary, chain_hash(prev, seq, summary, forged_payload), seq),
    )
    conn.close()
    report = check(path, signer)
    assert not report.ok and report.problem is not None
    assert report.problem.kind == "forged"
    assert "signature does not verify" in report.problem.detail


def test_attack_swapping_the_checkpoint_key(pruned: tuple[Path, Signer]) -> None:
    """The attacker signs the edited checkpoint with a key of their own: it verifies as a
    signature, and is refused as a key nobody trusts."""
    path, signer = pruned
    mallory = Signer(os.urandom(32))
    conn = attacker(path)
    seq, *_, payload, prev, _hash = rows_of(conn)[-1]
    forged = mallory.sign_checkpoint(
        msgspec.structs.replace(E.decode(payload), removed_through_seq=70)
    )
    forged_payload = E.encode(forged).decode()
    conn.execute("DELETE FROM entries WHERE seq BETWEEN 61 AND 70")
    conn.execute(
        "UPDATE entries SET payload = ?, summary = ?, hash = ? WHERE seq = ?",
        (
            forged_payload,
            forged.summary(),
            chain_hash(prev, seq, forged.summary(), forged_payload),
            seq,
        ),
    )
    conn.close()
    report = check(path, signer)
    assert not report.ok and report.problem is not None
    assert report.problem.kind == "untrusted"
    assert mallory.public[:16] in report.problem.detail


def test_attack_a_cut_without_a_checkpoint(tmp_path: Path, signer: Signer) -> None:
    path = tmp_path / "journal.db"
    journal = Journal(path)
    fill(journal, 20, start=time.time())
    journal.close()
    conn = attacker(path)
    conn.execute("DELETE FROM entries WHERE seq <= 5")
    conn.close()
    report = check(path, signer)
    assert not report.ok and report.problem is not None
    assert report.problem.kind == "deleted"
    assert "no checkpoint accounts for them" in report.problem.detail


def test_a_prune_interrupted_between_its_steps_leaves_a_journal_that_verifies(
    tmp_path: Path, signer: Signer
) -> None:
    """Checkpoint written, one batch deleted, then the process stops: verify passes, and the
    next prune finishes the cut."""
    path = tmp_path / "journal.db"
    journal = Journal(path)
    now = time.time()
    fill(journal, 50, start=now - 49 * 3600)
    from appliance.journal import retention

    plan = retention._plan(path, RetentionPolicy(keep_days=20 / 24), now)
    checkpoint = retention._unsigned_checkpoint(path, plan, now)
    journal.run_job(lambda conn: retention._append(journal, signer, checkpoint)).wait(10)
    assert check(path, signer).ok  # after step 1 alone: the named entries are all still there

    def one_batch(conn: sqlite3.Connection):  # type: ignore[no-untyped-def]
        steps = _delete(conn, plan.first, plan.through, 7)
        next(steps)  # one batch of 7, then "crash"
        yield

    journal.run_job(one_batch).wait(10)
    journal.close()
    report = check(path, signer)
    assert report.ok, report.problem
    assert report.first_seq == 8
    journal = Journal(path)
    finished = prune(journal, RetentionPolicy(), signer)  # no limit: only the cut left undone
    assert finished.removed == plan.through - 7 and finished.checkpoint_seq is None
    report = journal.verify(keys=(signer.public,))
    assert report.ok and report.first_seq == plan.through + 1
    journal.close()


PRUNER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from appliance.journal import Journal, entries as E
    from appliance.journal.retention import RetentionPolicy, prune
    from appliance.journal.signing import load_signer
    path = Path(sys.argv[1])
    signer = load_signer(path.parent / "journal.key")
    journal = Journal(path)
    now = time.time()
    tickets = [journal.submit(E.AllowlistChanged(ts=now - (3000 - i) * 60, host=f"h{i}"))
               for i in range(3000)]
    tickets[-1].wait(60)
    print("filled", flush=True)
    prune(journal, RetentionPolicy(keep_days=0.5), signer, batch=20)
    print("pruned", flush=True)
    """
)


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.15, 0.4])
def test_a_prune_killed_at_any_moment_leaves_a_journal_that_verifies(
    tmp_path: Path, delay: float
) -> None:
    path = tmp_path / "journal.db"
    process = subprocess.Popen(
        [sys.executable, "-c", PRUNER, str(path)],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == b"filled"
    time.sleep(delay)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    signer = load_signer(tmp_path / KEY_FILE, create=False)
    report = check(path, signer)
    assert report.ok, report.problem
    journal = Journal(path)
    prune(journal, RetentionPolicy(keep_days=0.5), signer)
    report = journal.verify(keys=(signer.public,))
    assert report.ok, report.problem
    assert report.entries < 3000 // 2 + 10
    journal.close()


def test_the_key_file_is_0600_and_refused_when_others_can_read_it(tmp_path: Path) -> None:
    from appliance.credstore.keys import KeyUnusable

    key = tmp_path / KEY_FILE
    first = load_signer(key)
    assert (key.stat().st_mode & 0o777) == 0o600
    assert load_signer(key).public == first.public
    key.chmod(0o644)
    with pytest.raises(KeyUnusable, match="0600"):
        load_signer(key)


def test_a_retired_key_still_verifies_its_checkpoints(
    pruned: tuple[Path, Signer],
) -> None:
    """Key rotation: the old public key stays trusted for the checkpoints it signed; the new
    key signs the next ones."""
    path, old = pruned
    new = Signer(os.urandom(32))
    journal = Journal(path)
    fill(journal, 5, start=time.time())
    # Entries 61..100 are 40..1 hours old: this cut keeps the old key's checkpoint (101).
    report = prune(journal, RetentionPolicy(keep_days=20 / 24), new, trusted=(old.public,))
    assert report.checkpoint_seq is not None and report.through_seq < 101
    assert journal.verify(keys=(new.public, old.public)).ok
    assert not journal.verify(keys=(new.public,)).ok  # without the old one: untrusted
    journal.close()


# -- export ---------------------------------------------------------------------------------


def export_to(path: Path, signer: Signer, out: Path, where: ExportFilter) -> Path:
    from appliance.journal.export import export_lines

    out.write_bytes(b"".join(export_lines(path, signer, where, verified=True)))
    return out


def test_an_export_verifies_offline_with_its_key_and_its_checkpoint(
    pruned: tuple[Path, Signer], tmp_path: Path
) -> None:
    path, signer = pruned
    out = export_to(path, signer, tmp_path / "all.jsonl", ExportFilter())
    report = verify_file(out, keys=(signer.public,))
    assert isinstance(report, ExportReport)
    assert report.ok, report.problem
    assert (report.entries, report.first_seq, report.last_seq) == (41, 61, 101)
    assert report.key_trusted and report.checkpoints == 1
    untrusted = verify_file(out)  # no key given: the file's own, and it says so
    assert isinstance(untrusted, ExportReport) and untrusted.ok and not untrusted.key_trusted


def test_export_filters_by_time_and_crew(pruned: tuple[Path, Signer], tmp_path: Path) -> None:
    path, signer = pruned
    rows = [
        r for r in sqlite3.connect(path).execute("SELECT seq, ts, crew FROM entries ORDER BY seq")
    ]
    since, until = rows[5][1], rows[15][1]
    ranged = export_to(path, signer, tmp_path / "r.jsonl", ExportFilter(since=since, until=until))
    report = verify_file(ranged, keys=(signer.public,))
    assert isinstance(report, ExportReport) and report.ok, report.problem
    assert (report.first_seq, report.last_seq, report.entries) == (rows[5][0], rows[14][0], 10)
    crew = export_to(path, signer, tmp_path / "c.jsonl", ExportFilter(crew="c1"))
    report = verify_file(crew, keys=(signer.public,))
    assert isinstance(report, ExportReport) and report.ok, report.problem
    assert report.entries == sum(1 for r in rows if r[2] == "c1")


@pytest.mark.parametrize(
    ("attack", "reason"),
    [
        ("drop_row", "entries"),
        ("edit_row", "content does not match its hash"),
        ("drop_end", "truncated"),
        ("swap_key", "not trusted"),
        ("edit_end", "signature does not verify"),
    ],
)
def test_an_edited_export_fails_offline_verification(
    pruned: tuple[Path, Signer], tmp_path: Path, attack: str, reason: str
) -> None:
    path, signer = pruned
    out = export_to(path, signer, tmp_path / "x.jsonl", ExportFilter())
    lines = out.read_bytes().splitlines(keepends=True)
    if attack == "drop_row":
        del lines[10]
    elif attack == "edit_row":
        lines[10] = lines[10].replace(b"added h", b"added X")
    elif attack == "drop_end":
        del lines[-1]
    elif attack == "swap_key":
        lines[0] = lines[0].replace(signer.public.encode(), Signer(os.urandom(32)).public.encode())
    elif attack == "edit_end":
        # Drop the last row and rewrite the end line to match (digest, counts, last hash):
        # only the signature is left to tell.
        import hashlib
        import json

        del lines[-2]
        end = json.loads(lines[-1])["export_end"]
        last = json.loads(lines[-2])
        end.update(
            entries=40,
            last_seq=last["seq"],
            last_hash=last["hash"],
            digest=hashlib.sha256(b"".join(lines[:-1])).hexdigest(),
        )
        lines[-1] = json.dumps({"export_end": end}).encode() + b"\n"
    report = verify_export(lines, (signer.public,))
    assert not report.ok and report.problem is not None
    assert reason in report.problem, report.problem


# -- backup and restore ---------------------------------------------------------------------


def test_backup_restore_verify(pruned: tuple[Path, Signer], tmp_path: Path) -> None:
    path, signer = pruned
    journal = Journal(path)
    made = backup(path, tmp_path / "journal.bak", signer)
    assert made.head_seq == 101 and made.first_seq == 61
    assert (Path(made.path).stat().st_mode & 0o777) == 0o600
    offline = verify_file(Path(made.path), keys=(signer.public,))
    assert isinstance(offline, VerifyReport) and offline.ok, offline.problem
    assert offline.anchor_from == "signed backup head"
    fill(journal, 3, start=time.time())  # after the backup: the restore goes back before them
    journal.close()
    lock = tmp_path / "applianced.lock"
    with pytest.raises(BackupRefused, match="exists"):
        restore(Path(made.path), path, keys=(signer.public,), lock_path=lock)
    done = restore(Path(made.path), path, keys=(signer.public,), lock_path=lock, force=True)
    assert done.replaced is not None and Path(done.replaced).exists()
    report = check(path, signer)
    assert report.ok, report.problem
    assert (report.first_seq, report.head_seq, report.anchor_seq) == (61, 101, 101)
    kept = verify(Path(done.replaced), Path(done.replaced + ".head"), keys=(signer.public,))
    assert kept.ok and kept.head_seq == 104  # the replaced journal, whole
    reopened = Journal(path)  # and applianced appends on from the restored head
    fill(reopened, 2, start=time.time())
    assert reopened.verify(keys=(signer.public,)).ok
    reopened.close()


def test_restore_refuses_a_tampered_backup_and_a_running_daemon(
    pruned: tuple[Path, Signer], tmp_path: Path
) -> None:
    import fcntl

    path, signer = pruned
    made = Path(backup(path, tmp_path / "journal.bak", signer).path)
    target = tmp_path / "restored" / "journal.db"
    target.parent.mkdir()
    lock = target.parent / "applianced.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as applianced holds it
    with pytest.raises(BackupRefused, match="applianced is running"):
        restore(made, target, keys=(signer.public,), lock_path=lock)
    os.close(fd)
    conn = attacker(made)
    conn.execute("UPDATE backup_head SET head_seq = 90")
    conn.close()
    with pytest.raises(BackupRefused, match="forged"):
        restore(made, target, keys=(signer.public,), lock_path=lock)
    with pytest.raises(BackupRefused, match="no trusted key"):
        restore(made, target, keys=(), lock_path=lock)
    assert not target.exists()


def test_a_backup_of_a_tampered_journal_is_not_signed(
    pruned: tuple[Path, Signer], tmp_path: Path
) -> None:
    path, signer = pruned
    conn = attacker(path)
    conn.execute("DELETE FROM entries WHERE seq = 75")
    conn.close()
    with pytest.raises(BackupRefused, match="entry 75"):
        backup(path, tmp_path / "journal.bak", signer)
    assert not (tmp_path / "journal.bak").exists()
    assert not (tmp_path / "journal.bak.partial").exists()


def test_a_checkpoint_signature_covers_every_field(signer: Signer) -> None:
    checkpoint = signer.sign_checkpoint(
        E.Checkpoint(
            removed_from_seq=1,
            removed_through_seq=9,
            removed_through_hash="a" * 64,
            removed_entries=9,
            removed_oldest_ts=1.0,
            removed_newest_ts=2.0,
            reason="test",
            head_seq=9,
            head_hash="b" * 64,
            key="",
        )
    )
    message = checkpoint_message(checkpoint)
    for field in ("removed_through_seq", "head_seq", "removed_entries"):
        changed = msgspec.structs.replace(checkpoint, **{field: 10})
        assert checkpoint_message(changed) != message
