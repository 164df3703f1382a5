"""appliancectl's entry point: `run` on a start-up budget, every other command line through the
full CLI (appliance/ctl/main.py).

Why: `appliancectl run NAME -- CMD` is what an agent harness calls in a loop, timed against
`docker exec` (a Go binary that starts in a few ms; target: under 30 ms more). Most of a Python
CLI's cost is start-up, so `run` imports nothing but the interpreter's built-in C modules
(`_socket`, `_json`, `_signal`, `select`, `os`) and this package's dependency-free modules
(attach.py, http.py, session.py, tinyjson.py, exits.py, appliance/daemon/framing.py):

    module                   ms to import here   (python -S -X importtime, 2-core VM)
    socket (selectors, enum)       ~17           `_socket`  ~0.3
    json (re and its compiler)     ~9            `_json`    ~0.5
    signal (enum)                  ~3            `_signal`  built in
    argparse, msgspec              ~35           (the full CLI's)

It reads the plain forms of `run` and hands any other command line, or any form it does not
know, to the full CLI unchanged, so there is one behaviour:

    appliancectl [--json] [--socket PATH] run [--json] [--socket PATH] [--timeout S] [-i] [-t]
                 NAME -- CMD...

The full CLI's `run` calls `run()` below too: one client for both (tests/test_cli.py holds the
two entry points to the same bytes and exit codes). The admin socket: --socket, else
$APPLIANCECTL_SOCKET, else the default when no config file is there and no context is chosen
(--context, $APPLIANCE_CONTEXT, a current context: docs/hosts.md); otherwise the full CLI
resolves it.

The session itself: attach.py.

Start without `site`: bin/appliancectl runs `python -S` (no site-packages scan, no `.pth`
processing: ~10 ms instead of ~25-30 ms in a development install). Only the fallback to the full
CLI needs site-packages; `_full_cli` runs `site.main()` for it.
"""

import os
import sys

from . import exits, http, tinyjson
from .attach import RunLine, error, run

DEFAULT_CONFIG = "/etc/agent-appliance/appliance.toml"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def parse_run(arguments: "list[str]") -> RunLine | None:
    """The plain forms of `run` (module docstring), or None: the full CLI decides."""
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
            if not line.timeout > 0:
                return None
            i += 1
        elif seen_run and word in ("-i", "--interactive", "-it", "-ti"):
            line.interactive = True
            line.tty = line.tty or word in ("-it", "-ti")
        elif seen_run and word in ("-t", "--tty"):
            line.tty = True
        elif seen_run and not line.name and word and set(word) <= _NAME_CHARS and word[0] != "-":
            line.name = word
        else:
            return None
        i += 1
    if not seen_run or not line.name or not command:
        return None
    line.argv = command
    return line


def _no_current_context() -> bool:
    """True when the user's context store (contexts.py) names no current context: absent, or
    `current` empty or "default". Anything else, a store that cannot be read included, is the
    full CLI's to resolve (or to report)."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    if not base.startswith("/"):
        base = os.path.expanduser("~") + "/.config"
    try:
        with open(base + "/agent-appliance/contexts.json", "rb") as file:
            document = tinyjson.loads(file.read())
    except FileNotFoundError:
        return True
    except (OSError, ValueError, tinyjson.NotJSON):
        return False
    return isinstance(document, dict) and document.get("current", "") in ("", "default")


def socket_path(line: RunLine) -> str | None:
    """The local socket, when the command line, the environment and the context store all say
    this host; None: the full CLI decides (a context, a config file)."""
    if line.socket:
        return line.socket
    if os.environ.get("APPLIANCE_CONTEXT"):
        return None
    env = os.environ.get("APPLIANCECTL_SOCKET")
    if env:
        return env
    if not _no_current_context():
        return None
    if os.path.exists(DEFAULT_CONFIG):
        return None  # the config names the socket: the full CLI reads it
    return http.DEFAULT_ADMIN_SOCKET


def _full_cli() -> int:
    if sys.flags.no_site and not getattr(sys, "frozen", False):
        # Started without site (module docstring): the full CLI needs site-packages. The tree
        # this package is in comes first, so `appliance.ctl.main` is this checkout's. The
        # artifact (appliance/entry.py) has no site-packages: everything is in it.
        import site

        site.main()
    from appliance.ctl.main import main as full_cli

    return full_cli()


def main() -> int:
    if sys.argv[1:] == ["--version"]:
        # What a host's tooling asks first (an artifact's smoke check, an upgrade's): the same
        # line as the full CLI's argparse prints, without importing it (about 50 ms here).
        from appliance._version import __version__

        sys.stdout.write(f"appliancectl {__version__}\n")
        return 0
    line = parse_run(sys.argv[1:])
    path = socket_path(line) if line is not None else None
    if line is None or path is None:
        return _full_cli()
    try:
        return run(line, path)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exits.BROKEN_PIPE
    except KeyboardInterrupt:  # before the session's signal handling was in place
        return exits.INTERRUPTED


__all__ = ["RunLine", "error", "main", "parse_run", "run"]
