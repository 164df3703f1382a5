"""`appliancectl events`: the journal as a stream of events, `-f` to follow it live (as
`docker events` and `kubectl get events -w`), with filters.

Filters: --crew (one crew's entries), --type (a type or a family: `run` is every run.*),
--decision (allow, deny or refuse: the proxy's decisions and the keeper's). crew and type are
applied by applianced; decision here, from each entry's type and payload.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

from appliance.daemon import messages

from . import context, exits, output
from .context import UsageError
from .output import Output

DECISIONS = ("allow", "deny", "refuse")
DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'30s', '5m', '2h', '1d', '90' (seconds) -> seconds."""
    value = text.strip().lower()
    unit = value[-1:] if value[-1:] in DURATION_UNITS else "s"
    number = value[:-1] if value[-1:] in DURATION_UNITS else value
    try:
        seconds = float(number) * DURATION_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 5m, 2h)") from None
    if not math.isfinite(seconds):
        # float() reads "inf", "nan" and "1e400" too; none is a duration (JSON has no such
        # number: it would travel as null, which means "the default" to applianced).
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 5m, 2h)")
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return seconds


def decision_of(entry: messages.JournalEntry) -> str | None:
    if entry.type.startswith("proxy.") and entry.type[6:] in DECISIONS:
        return entry.type[6:]
    if entry.type == "keeper.decision":
        try:
            payload = json.loads(entry.payload)
        except ValueError:
            return None
        decision = payload.get("decision") if isinstance(payload, dict) else None
        return decision if isinstance(decision, str) else None
    return None


def matching(
    entries: Iterable[messages.JournalEntry], decision: str | None
) -> Iterator[messages.JournalEntry]:
    for entry in entries:
        if decision is None or decision_of(entry) == decision:
            yield entry


def line(entry: messages.JournalEntry, wide: bool = False) -> str:
    text = (
        f"{entry.seq:>7} {output.clock(entry.ts)} {entry.type:<20} {entry.crew or '-':<16} "
        f"{entry.summary}"
    )
    if wide:
        text += f"  trace={entry.trace_id or '-'} hash={entry.hash[:16]}"
    return text


def emit(out: Output, entry: messages.JournalEntry) -> None:
    """One entry as it arrives: a line, or one JSON (or YAML) document per entry."""
    if out.format == "yaml":
        print("---\n" + output.to_yaml(output.builtins(entry)).rstrip("\n"), flush=True)
    elif out.format == "json":
        print(json.dumps(output.builtins(entry)), flush=True)
    elif out.format == "name":
        print(entry.seq, flush=True)
    else:
        print(line(entry, out.wide), flush=True)


def stream(args: argparse.Namespace, out: Output, n: int, follow: bool) -> int:
    """The last n matching entries (or those since --since), then with follow every new one
    until Ctrl-C (exit 130, main.py)."""
    client = context.client(args, timeout=None if follow else 600.0)
    since = getattr(args, "since", None)
    decision = getattr(args, "decision", None)
    kind = getattr(args, "type", None)
    if since is not None:
        start: dict[str, Any] = {"since": time.time() - since}
    else:
        start = {"n": n}
    for entry in matching(
        client.events(crew=args.crew, type=kind, follow=follow, **start), decision
    ):
        emit(out, entry)
    return exits.OK


def cmd_events(args: argparse.Namespace, out: Output) -> int:
    if args.n < 0:
        raise UsageError("argument -n: must be >= 0")
    return stream(args, out, args.n, args.follow)


def add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--crew", help="only this crew's entries")
    parser.add_argument(
        "--type", "--kind", dest="type", help="only this type (`run` matches every run.*)"
    )


def add_parsers(commands: Any, leaf: Any) -> None:
    events = leaf(
        commands.add_parser(
            "events", help="journal entries as events; -f follows them live (as docker events)"
        )
    )
    events.add_argument("-f", "--follow", action="store_true", help="keep printing new entries")
    add_filters(events)
    events.add_argument(
        "--decision", choices=DECISIONS, help="only the proxy's and the keeper's decisions of this"
    )
    events.add_argument(
        "--since", type=parse_duration, metavar="DURATION", help="entries of the last 30s, 5m, 2h"
    )
    events.add_argument("-n", type=int, default=20, help="how many past entries (default 20)")
    events.set_defaults(func=cmd_events)
