"""`appliancectl journal tail|search|export|verify|prune|backup|restore`: the tamper-evident
journal and its lifecycle (docs/journal.md)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from appliance.daemon import messages

from . import context, events, exits
from .context import CtlError, UsageError
from .crew import parse_size
from .output import Output


def cmd_tail(args: argparse.Namespace, out: Output) -> int:
    if args.n < 0:
        raise UsageError("argument -n: must be >= 0")
    return events.stream(args, out, args.n, args.follow)


def cmd_search(args: argparse.Namespace, out: Output) -> int:
    if not args.text.strip():
        raise UsageError("argument TEXT: give something to search for")
    reply = context.client(args).journal_search(args.text, args.n, fts=args.fts)
    if out.format in ("json", "yaml"):
        out.emit({"ok": True, "entries": reply.entries}, "")
    else:
        for entry in reply.entries:
            events.emit(out, entry)
    return exits.OK


def _time(name: str, text: str | None) -> float | None:
    from appliance.journal.export import parse_time

    try:
        return None if text is None else parse_time(text)
    except ValueError as exc:
        raise UsageError(f"argument {name}: {exc}") from None


def cmd_export(args: argparse.Namespace, out: Output) -> int:
    since, until = _time("--since", args.since), _time("--until", args.until)
    sink = sys.stdout.buffer
    lines = context.client(args, timeout=None).journal_export(
        since=since, until=until, crew=args.crew
    )
    for raw in lines:
        sink.write(raw)
    sink.flush()
    return exits.OK


def _public_keys(given: list[str]) -> tuple[str, ...]:
    from appliance.journal.signing import parse_public_key

    try:
        return tuple(parse_public_key(key) for key in given)
    except ValueError as exc:
        raise UsageError(f"argument --public-key: {exc}") from None


def _tampered(out: Output, report: Any, message: str) -> int:
    if out.as_json:
        out.emit(report, "")
    else:
        print(f"appliancectl: {message}", file=sys.stderr, flush=True)
    return exits.TAMPERED


def cmd_verify(args: argparse.Namespace, out: Output) -> int:
    if args.file:
        return _verify_file(args, out)
    report = context.client(args).journal_verify()
    problem = report.problem
    if problem is None:
        cut = ""
        if report.checkpoint is not None:
            checkpoint = report.checkpoint
            cut = (
                f"; starts at {report.first_seq} (entries {checkpoint.removed_from_seq}.."
                f"{checkpoint.removed_through_seq} removed by retention, signed checkpoint "
                f"{checkpoint.seq})"
            )
        key = report.keys[0] if report.keys else "-"
        out.emit(
            report,
            f"journal intact: {report.entries} entries, head {report.head_seq} "
            f"{report.head_hash} (anchor at {report.anchor_seq}){cut}; journal key {key}",
        )
        return exits.OK
    message = f"journal TAMPERED at entry {problem.seq} ({problem.kind}): {problem.detail}"
    return _tampered(out, report, message)


def _verify_file(args: argparse.Namespace, out: Output) -> int:
    """Offline: a backup or an export, no applianced needed."""
    from appliance.journal import JournalError, verify_file
    from appliance.journal.export import ExportReport

    keys = _public_keys(args.public_key)
    try:
        report = verify_file(Path(args.file), keys=keys)
    except JournalError as exc:
        raise UsageError(str(exc)) from None
    own_key = " (checked with the file's own key: pass --public-key)"
    if isinstance(report, ExportReport):
        if report.ok:
            trust = "" if report.key_trusted else own_key
            out.emit(
                report,
                f"export intact: {report.entries} entries ({report.first_seq}.."
                f"{report.last_seq}), signed by {report.key}{trust}",
            )
            return exits.OK
        return _tampered(out, report, f"export TAMPERED: {report.problem}")
    if report.ok:
        trust = own_key if report.keys_from_file else ""
        out.emit(
            report,
            f"backup intact: {report.entries} entries ({report.first_seq}..{report.head_seq}), "
            f"head {report.head_hash}, key {', '.join(report.keys)}{trust}",
        )
        return exits.OK
    assert report.problem is not None
    problem = report.problem
    message = f"backup TAMPERED at entry {problem.seq} ({problem.kind}): {problem.detail}"
    return _tampered(out, report, message)


def cmd_prune(args: argparse.Namespace, out: Output) -> int:
    request = messages.JournalPrune(
        keep_days=args.keep_days, keep_bytes=args.keep_bytes, dry_run=args.dry_run
    )
    report = context.client(args, timeout=None).journal_prune(request)
    verb = "would remove" if report.dry_run else "removed"
    out.emit(
        report,
        f"{verb} {report.removed} entries (through {report.through_seq}; {report.reason}); "
        f"the journal starts at {report.first_seq}; {report.bytes_before} -> "
        f"{report.bytes_after} bytes in {report.seconds:.1f} s",
    )
    return exits.OK


def cmd_backup(args: argparse.Namespace, out: Output) -> int:
    report = context.client(args, timeout=None).journal_backup(os.path.abspath(args.file))
    out.emit(
        report,
        f"{report.path}: {report.entries} entries ({report.first_seq}..{report.head_seq}), "
        f"head {report.head_hash}, signed by {report.key}",
        [report.path],
    )
    return exits.OK


def cmd_restore(args: argparse.Namespace, out: Output) -> int:
    """Offline: applianced must be stopped (the state directory's lock says whether it runs)."""
    from appliance.credstore.errors import CredStoreError
    from appliance.journal import JournalError
    from appliance.journal.backup import restore
    from appliance.journal.signing import KEY_FILE, load_signer

    keys = _public_keys(args.public_key)
    config = context.daemon_config(args)
    state = Path(config.daemon.state_dir)
    key_file = Path(config.journal.key_file or state / KEY_FILE)
    try:
        own = (load_signer(key_file, create=False).public,) if key_file.exists() else ()
        retired = (key.lower().removeprefix("ed25519:") for key in config.journal.trusted_keys)
        report = restore(
            Path(args.file),
            state / "journal.db",
            keys=(*keys, *own, *retired),
            lock_path=state / "applianced.lock",
            force=args.force,
        )
    except (JournalError, CredStoreError, OSError) as exc:
        raise CtlError(str(exc)) from None
    kept = f"; the journal it replaced is {report.replaced}" if report.replaced else ""
    out.emit(
        report,
        f"{report.path}: restored {report.entries} entries ({report.first_seq}.."
        f"{report.head_seq}) from {report.source}, verified{kept}",
        [report.path],
    )
    return exits.OK


def add_parsers(commands: Any, leaf: Any) -> None:
    journal = commands.add_parser("journal", help="the tamper-evident journal")
    journals = journal.add_subparsers(dest="journal_command", required=True, metavar="COMMAND")
    tail = leaf(journals.add_parser("tail", help="the latest entries, oldest first"))
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing new entries")
    events.add_filters(tail)
    tail.add_argument("-n", type=int, default=20, help="how many (default 20)")
    tail.set_defaults(func=cmd_tail)
    search = leaf(
        journals.add_parser(
            "search", help="entries holding every word of TEXT (plain text; --fts for FTS5)"
        )
    )
    search.add_argument("text", metavar="TEXT")
    search.add_argument(
        "--fts", action="store_true", help="TEXT is an FTS5 query (AND, OR, NEAR, prefix*)"
    )
    search.add_argument("-n", type=int, default=50, help="at most this many (default 50)")
    search.set_defaults(func=cmd_search)
    export = leaf(journals.add_parser("export", help="a signed export as JSON lines, to stdout"))
    export.add_argument(
        "--jsonl", action="store_true", required=True, help="JSON lines (the only format)"
    )
    export.add_argument("--since", help="entries from then on: epoch seconds, ISO 8601, or 7d")
    export.add_argument("--until", help="entries before then (same forms)")
    export.add_argument("--crew", help="only this crew's entries")
    export.set_defaults(func=cmd_export)
    verify = leaf(
        journals.add_parser("verify", help="check the hash chain; exit 6 naming the entry if not")
    )
    verify.add_argument("--file", help="offline: a backup or an export instead of the live journal")
    verify.add_argument(
        "--public-key",
        action="append",
        default=[],
        help="the appliance's journal key (64 hex digits) to trust (repeatable)",
    )
    verify.set_defaults(func=cmd_verify)
    prune = leaf(journals.add_parser("prune", help="apply retention now (signed checkpoint)"))
    prune.add_argument("--keep-days", type=float, help="remove entries older than this")
    prune.add_argument(
        "--keep-bytes", type=parse_size, help="remove the oldest entries beyond this size (1g)"
    )
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed")
    prune.set_defaults(func=cmd_prune)
    backup = leaf(journals.add_parser("backup", help="a consistent, signed copy while it runs"))
    backup.add_argument("file", metavar="FILE")
    backup.set_defaults(func=cmd_backup)
    restore = leaf(journals.add_parser("restore", help="replace the journal (applianced stopped)"))
    restore.add_argument("file", metavar="FILE")
    restore.add_argument("--force", action="store_true", help="replace an existing journal")
    restore.add_argument(
        "--public-key", action="append", default=[], help="also trust this key (repeatable)"
    )
    restore.set_defaults(func=cmd_restore)
