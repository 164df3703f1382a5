"""`appliancectl run [-i] [-t] [--timeout S] NAME -- CMD...`: a command in a crew's agent
container, as `docker exec` runs one (attach.py holds the client; this is its argparse face)."""

from __future__ import annotations

import argparse
from typing import Any

from . import context
from .context import UsageError
from .output import Output


def cmd_run(args: argparse.Namespace, out: Output) -> int:
    from .attach import RunLine, run

    if not args.argv:
        raise UsageError("argument CMD: give the command after --")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError("argument --timeout: must be > 0")
    line = RunLine()
    line.as_json, line.timeout, line.name = out.as_json, args.timeout, args.name
    line.interactive, line.tty, line.argv = args.interactive, args.tty, list(args.argv)
    return run(line, context.endpoint(args))


def add_parsers(commands: Any, leaf: Any) -> None:
    run = leaf(
        commands.add_parser(
            "run",
            help="run a command in a crew's agent container (as docker exec)",
            description="Exit code: the command's own (128+N if signal N ended it), 124 if "
            "--timeout killed it, else one of appliancectl's (docs/cli.md).",
        )
    )
    run.add_argument("-i", "--interactive", action="store_true", help="attach standard input")
    run.add_argument(
        "-t", "--tty", action="store_true", help="allocate a TTY (raw mode, window size)"
    )
    run.add_argument("--timeout", type=float, help="seconds, then the command is killed (exit 124)")
    run.add_argument("name")
    # Everything after the first "--" is the command (split off in main(), so that options
    # may come before or after NAME).
    run.add_argument("argv", nargs="*", metavar="-- CMD")
    run.set_defaults(func=cmd_run)
