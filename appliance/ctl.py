"""appliancectl's entry point: `run` without argparse, everything else through `appliance.cli`.

Why: `appliancectl run NAME -- CMD` is what an agent harness calls in a loop, and issue 5 times
it against `docker exec` (a Go binary that starts in a few ms; target: under 30 ms more). Most
of a Python CLI's cost is start-up: argparse and the CLI module's own import come to about 20
ms here. This dispatcher imports only `sys`, `os`, `json` and the admin client (socket), reads
the one plain form of `run`, and hands any other command line, or any form it does not know, to
the full CLI unchanged, so there is one behaviour:

    appliancectl [--json] [--socket PATH] run [--json] [--socket PATH] [--timeout S] NAME -- CMD...

Output, errors and exit codes are those of `appliance.cli.cmd_run` (tests/test_cli.py holds the
two to the same bytes). The admin socket: --socket, else $APPLIANCECTL_SOCKET, else the default
when no config file is there; with --config or a config file, the full CLI reads it.
"""

from __future__ import annotations

import json
import os
import sys

# appliance.cli's, repeated here so that this module imports nothing heavy (tests check they agree)
DEFAULT_CONFIG = "/etc/agent-appliance/appliance.toml"
EXIT_FAILURE, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_TIMED_OUT = 1, 2, 5, 124


class RunLine:
    __slots__ = ("argv", "as_json", "name", "socket", "timeout")

    def __init__(self) -> None:
        self.as_json = False
        self.socket: str | None = None
        self.timeout: float | None = None
        self.name = ""
        self.argv: list[str] = []


def parse_run(arguments: list[str]) -> RunLine | None:
    """The plain form of `run` (module docstring), or None: the full CLI decides."""
    if "--" not in arguments:
        return None
    split = arguments.index("--")
    head, command = arguments[:split], arguments[split + 1 :]
    line = RunLine()
    seen_run = False
    i = 0
    while i < len(head):
        word = head[i]
        if word == "--json":
            line.as_json = True
        elif word == "--socket" and i + 1 < len(head):
            line.socket = head[i + 1]
            i += 1
        elif word == "run" and not seen_run:
            seen_run = True
        elif seen_run and word == "--timeout" and i + 1 < len(head):
            try:
                line.timeout = float(head[i + 1])
            except ValueError:
                return None
            i += 1
        elif seen_run and not line.name and word and not word.startswith("-"):
            line.name = word
        else:
            return None
        i += 1
    if not seen_run or not line.name or not command:
        return None
    line.argv = command
    return line


def _socket_path(line: RunLine) -> str | None:
    if line.socket:
        return line.socket
    env = os.environ.get("APPLIANCECTL_SOCKET")
    if env:
        return env
    if os.path.exists(DEFAULT_CONFIG):
        return None  # the config names the socket: the full CLI reads it
    from appliance.daemon.client import DEFAULT_ADMIN_SOCKET

    return DEFAULT_ADMIN_SOCKET


def _error(line: RunLine, message: str, code: int, kind: str | None = None) -> int:
    if line.as_json:
        data: dict[str, object] = {"ok": False, "error": message}
        if kind is not None:
            data["kind"] = kind
        print(json.dumps(data), flush=True)
    else:
        print(f"appliancectl: error: {message}", file=sys.stderr, flush=True)
    return code


def run(line: RunLine, socket_path: str) -> int:
    from appliance.daemon.client import AdminClient, AdminError, RunExit, Unreachable

    client = AdminClient(socket_path, timeout=None)
    exit_code = EXIT_FAILURE
    try:
        for event in client.run(line.name, line.argv, line.timeout):
            if isinstance(event, RunExit):
                exit_code = EXIT_TIMED_OUT if event.timed_out else event.exit_code
                if line.as_json:
                    print(json.dumps({"exit_code": event.exit_code, "timed_out": event.timed_out}))
            elif line.as_json:
                print(json.dumps({"stream": event.stream, "line": event.line}), flush=True)
            else:
                target = sys.stdout if event.stream == "stdout" else sys.stderr
                target.write(event.line)
                target.flush()
    except Unreachable as exc:
        return _error(line, str(exc), EXIT_UNREACHABLE)
    except AdminError as exc:
        from appliance.cli import _exit_for_status

        return _error(line, exc.message, _exit_for_status(exc.status), exc.error)
    return exit_code if 0 <= exit_code <= 255 else EXIT_FAILURE


def main() -> int:
    line = parse_run(sys.argv[1:])
    socket_path = _socket_path(line) if line is not None else None
    if line is None or socket_path is None:
        from appliance.cli import main as full_cli

        return full_cli()
    try:
        return run(line, socket_path)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
