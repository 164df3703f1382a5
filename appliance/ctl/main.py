"""appliancectl's full command line: the argparse tree, global options, and the one place where
what a command raises becomes an exit code (exits.py, docs/cli.md).

Every command that shows or lists takes `-o table|wide|json|yaml|name` (`--json` is `-o json`),
`--socket` and `--config`, before or after its name; data goes to stdout, errors to stderr. No
user error ends in a traceback: usage errors exit 2 (argparse), applianced's answers map through
exits.for_status, Ctrl-C exits 130 and a closed stdout 141.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import (
    approvals,
    completion,
    context,
    contexts,
    cred,
    crew,
    doctor,
    events,
    exits,
    journal,
    net,
    output,
    proxy,
    run,
    status,
)
from .output import Output

# The commands that only talk to applianced's admin socket: they configure no logging.
_ADMIN_SOCKET_COMMANDS = frozenset(
    {"status", "crew", "run", "net", "events", "journal", "cred", "approvals"}
)


def version() -> str:
    """The appliance's version (appliance/_version.py: what the package and the artifact carry)."""
    from appliance._version import __version__

    return __version__


def _leaf(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every admin command takes after its name too (SUPPRESS: the global
    option's value stands unless given here)."""
    parser.add_argument(
        "-o",
        "--output",
        choices=output.FORMATS,
        default=argparse.SUPPRESS,
        help="output format (default table)",
    )
    parser.add_argument(
        "--json",
        dest="output",
        action="store_const",
        const="json",
        default=argparse.SUPPRESS,
        help="the same as -o json",
    )
    parser.add_argument(
        "--socket",
        default=argparse.SUPPRESS,
        help="applianced's admin socket (default: $APPLIANCECTL_SOCKET, the config's, or "
        "/run/agent-appliance/admin.sock)",
    )
    parser.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        help=f"appliance config (default {context.DEFAULT_CONFIG})",
    )
    parser.add_argument(
        "--context",
        default=argparse.SUPPRESS,
        help="the applianced to talk to (default: $APPLIANCE_CONTEXT, the current context, this "
        "host's; docs/hosts.md)",
    )
    return parser


def _watchable(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "-w", "--watch", action="store_true", help="show it again every --interval, until Ctrl-C"
    )
    parser.add_argument(
        "--interval", type=float, default=2.0, metavar="S", help="with --watch (default 2 s)"
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="appliancectl",
        description="appliancectl: the operator's command line (docs/cli.md).",
        epilog="Exit codes: " + "; ".join(f"{c} {n}" for c, n, _ in exits.TABLE) + ".",
    )
    parser.add_argument("--version", action="version", version=f"appliancectl {version()}")
    parser.add_argument(
        "-o", "--output", choices=output.FORMATS, default="table", help="output format"
    )
    parser.add_argument(
        "--json", dest="output", action="store_const", const="json", help="the same as -o json"
    )
    parser.add_argument("--socket", default=None, help="applianced's admin socket")
    parser.add_argument("--config", default=None, help="appliance config file")
    parser.add_argument("--context", default=None, help="the applianced to talk to (docs/hosts.md)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status.add_parsers(commands, _leaf, _watchable)
    doctor.add_parsers(commands, _leaf)
    crew.add_parsers(commands, _leaf, _watchable)
    approvals.add_parsers(commands, _leaf)
    run.add_parsers(commands, _leaf)
    cred.add_parsers(commands, _leaf)
    journal.add_parsers(commands, _leaf)
    events.add_parsers(commands, _leaf)
    net.add_parsers(commands, _leaf)
    contexts.add_parsers(commands, _leaf)
    proxy.add_parsers(commands)
    completion.add_parsers(commands)
    parser.set_defaults(root_parser=parser)  # what `completion` walks
    return parser


def split_run(arguments: list[str]) -> tuple[list[str], list[str]]:
    """`run ... -- CMD...`: the command after the first `--` is never read as options."""
    if "run" in arguments and "--" in arguments[arguments.index("run") :]:
        split = arguments.index("--", arguments.index("run"))
        return arguments[:split], arguments[split + 1 :]
    return arguments, []


def main(argv: Sequence[str] | None = None) -> int:
    out = Output()
    args: argparse.Namespace | None = None
    try:
        parser = build_parser()
        arguments, command = split_run(list(sys.argv[1:] if argv is None else argv))
        args = parser.parse_args(arguments)
        if args.command == "run":
            args.argv = [*args.argv, *command]
        if getattr(args, "json", False):  # the hidden --json of the proxy commands
            args.output = "json"
        out.format = args.output
        if args.command not in _ADMIN_SOCKET_COMMANDS:
            import logging

            logging.basicConfig(
                level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s"
            )
        result: int = args.func(args, out)
        return result
    except SystemExit as exc:  # argparse: --help, --version (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else exits.USAGE
    except KeyboardInterrupt:
        # Ctrl-C: no traceback, the shell's code for it. A line break so that the prompt
        # does not follow a half-printed line (^C is already on the terminal).
        if sys.stderr.isatty():
            print(file=sys.stderr, flush=True)
        return exits.INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`appliancectl crew ls | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exits.BROKEN_PIPE
    except context.CtlError as exc:
        return out.error(exc.message, exc.code, kind=exc.kind)
    except Exception as exc:
        return _failed(exc, out, getattr(args, "_context_name", None))


def _failed(exc: Exception, out: Output, context_name: str | None = None) -> int:
    from .http import AdminError, Unreachable

    if isinstance(exc, Unreachable):
        # Which host it was, when a context chose it (docs/hosts.md).
        where = f"context {context_name}: " if context_name else ""
        return out.error(where + str(exc), exits.UNREACHABLE, kind="unreachable")
    if isinstance(exc, AdminError):
        # A journal that does not verify (a prune refused, 409 `tampered`) is exit 6, whatever
        # the status that carried it.
        code = exits.TAMPERED if exc.error == "tampered" else exits.for_status(exc.status)
        return out.error(exc.message, code, kind=exc.error)
    if os.environ.get("APPLIANCECTL_DEBUG"):
        raise exc
    # A bug of ours, not the user's: one line and how to see more.
    message = f"internal error: {type(exc).__name__}: {exc} (APPLIANCECTL_DEBUG=1 shows where)"
    return out.error(message, exits.FAILURE, kind="internal")


if __name__ == "__main__":
    sys.exit(main())
