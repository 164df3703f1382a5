"""`appliancectl journal tail|search|export|verify`: the tamper-evident journal."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import context, events, exits
from .context import UsageError
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


def cmd_export(args: argparse.Namespace, out: Output) -> int:
    sink = sys.stdout.buffer
    for raw in context.client(args, timeout=None).journal_export():
        sink.write(raw)
    sink.flush()
    return exits.OK


def cmd_verify(args: argparse.Namespace, out: Output) -> int:
    report = context.client(args).journal_verify()
    problem = report.problem
    if problem is None:
        out.emit(
            report,
            f"journal intact: {report.entries} entries, head {report.head_seq} "
            f"{report.head_hash} (anchor at {report.anchor_seq})",
        )
        return exits.OK
    message = f"journal TAMPERED at entry {problem.seq} ({problem.kind}): {problem.detail}"
    if out.as_json:
        out.emit(report, "")
    else:
        print(f"appliancectl: {message}", file=sys.stderr, flush=True)
    return exits.TAMPERED


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
    export = leaf(journals.add_parser("export", help="every entry as JSON lines, to stdout"))
    export.add_argument(
        "--jsonl", action="store_true", required=True, help="JSON lines (the only format)"
    )
    export.set_defaults(func=cmd_export)
    leaf(
        journals.add_parser("verify", help="check the hash chain; exit 6 naming the entry if not")
    ).set_defaults(func=cmd_verify)
