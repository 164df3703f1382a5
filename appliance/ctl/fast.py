"""appliancectl's entry point: `run` on a start-up budget, every other command line through the
full CLI (appliance/ctl/main.py).

Why: `appliancectl run NAME -- CMD` is what an agent harness calls in a loop, timed against
`docker exec` (a Go binary that starts in a few ms; target: under 30 ms more). Most of a Python
CLI's cost is start-up, so `run` imports nothing but the interpreter's built-in C modules
(`_socket`, `_json`, `_signal`, `select`, `os`) and this package's dependency-free modules
(http.py, session.py, tinyjson.py, exits.py, appliance/daemon/framing.py):

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
$APPLIANCECTL_SOCKET, else the default when no config file is there; with --config or a config
file, the full CLI reads it.

Theory of operation (`run`)
---------------------------
One connection: `POST /v1/crews/NAME/run` upgraded to a session of frames (framing.py). A poll
loop moves the command's output to our stdout and stderr, our stdin to it (-i) until EOF, and
every signal we receive (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) to the command's
process group in the crew; with -t, SIGWINCH becomes a resize of the crew's TTY, and with -i -t
on a terminal ours is in raw mode, so Ctrl-C reaches the crew's TTY as a byte (as with `docker
exec -it`). We exit with the command's exit code (128 + N if signal N ended it; 124 if --timeout
did). If we die, the connection closes and applianced kills the command.

Start without `site`: bin/appliancectl runs `python -S` (no site-packages scan, no `.pth`
processing: ~10 ms instead of ~25-30 ms in a development install). Only the fallback to the full
CLI needs site-packages; `_full_cli` runs `site.main()` for it.
"""

import os
import sys

from appliance.daemon import framing

from . import exits, http, session, tinyjson

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

DEFAULT_CONFIG = "/etc/agent-appliance/appliance.toml"
# Signals passed on to the command in the crew (as `docker run --sig-proxy` does, less the
# ones that stop or kill appliancectl itself or are about its own terminal).
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class RunLine:
    __slots__ = ("argv", "as_json", "interactive", "name", "socket", "timeout", "tty")

    def __init__(self) -> None:
        self.as_json = False
        self.socket: str | None = None
        self.timeout: float | None = None
        self.interactive = False
        self.tty = False
        self.name = ""
        self.argv: list[str] = []


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


def socket_path(line: RunLine) -> str | None:
    if line.socket:
        return line.socket
    env = os.environ.get("APPLIANCECTL_SOCKET")
    if env:
        return env
    if os.path.exists(DEFAULT_CONFIG):
        return None  # the config names the socket: the full CLI reads it
    return http.DEFAULT_ADMIN_SOCKET


def error(as_json: bool, message: str, code: int, kind: str | None = None) -> int:
    """An error on stderr: a line of text, or with --json a JSON object (as output.py's)."""
    if as_json:
        data: dict[str, object] = {"ok": False, "error": message, "exit_code": code}
        if kind is not None:
            data["kind"] = kind
        text = tinyjson.dumps(data)
    else:
        text = f"appliancectl: error: {message}"
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
    return code


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _Printer:
    """Output frames to our stdout/stderr: raw bytes, or with --json one object per line."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.lines = {framing.STDOUT: framing.LineBuffer(), framing.STDERR: framing.LineBuffer()}

    def _json_line(self, kind: int, line: bytes) -> None:
        stream = "stdout" if kind == framing.STDOUT else "stderr"
        text = line.decode("utf-8", "replace")
        _write_all(1, (tinyjson.dumps({"stream": stream, "line": text}) + "\n").encode())

    def output(self, kind: int, data: bytes) -> None:
        if not self.as_json:
            _write_all(1 if kind == framing.STDOUT else 2, data)
            return
        for line in self.lines[kind].feed(data):
            self._json_line(kind, line)

    def end(self, exited: "session.Exited | None") -> None:
        if not self.as_json:
            return
        for kind, lines in self.lines.items():
            if rest := lines.flush():
                self._json_line(kind, rest)
        if exited is not None:
            document = {"exit_code": exited.exit_code, "timed_out": exited.timed_out}
            _write_all(1, (tinyjson.dumps(document) + "\n").encode())


class _Terminal:
    """Our terminal in raw mode for the session (-i -t on a TTY), restored whatever happens."""

    def __init__(self) -> None:
        self.saved: list[Any] | None = None

    def raw(self, fd: int) -> None:
        import termios
        import tty

        self.saved = termios.tcgetattr(fd)
        tty.setraw(fd, termios.TCSANOW)

    def restore(self, fd: int) -> None:
        if self.saved is not None:
            import termios

            termios.tcsetattr(fd, termios.TCSADRAIN, self.saved)
            self.saved = None


def _window(fd: int) -> "tuple[int, int] | None":
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return None
    return size.lines, size.columns


def run(line: RunLine, path: str) -> int:
    """Run the command in the crew (module docstring); its exit code, or one of exits.py's."""
    tty_fd = next((fd for fd in (0, 1) if line.tty and os.isatty(fd)), None)
    size = _window(tty_fd) if tty_fd is not None else None
    body = session.run_request(line.argv, line.timeout, line.interactive, line.tty, size)
    try:
        run_session = session.open_session(path, line.name, body)
    except http.Unreachable as exc:
        return error(line.as_json, str(exc), exits.UNREACHABLE)
    except http.AdminError as exc:
        return error(line.as_json, exc.message, exits.for_status(exc.status), exc.error)
    terminal = _Terminal()
    printer = _Printer(line.as_json)
    restore_signals: Callable[[], None] | None = None
    try:
        raw = line.interactive and line.tty and os.isatty(0)
        if raw:
            terminal.raw(0)
        wakeup, restore_signals = _catch_signals(line.tty)
        exited = _pump(run_session, printer, line.interactive, wakeup, tty_fd)
    except (OSError, session.SessionError) as exc:
        if isinstance(exc, BrokenPipeError):
            raise
        printer.end(None)
        terminal.restore(0)
        return error(line.as_json, f"applianced on {path}: {exc}", exits.UNREACHABLE)
    except http.AdminError as exc:  # an ERROR frame: the exec failed after the upgrade
        printer.end(None)
        terminal.restore(0)
        return error(line.as_json, exc.message, exits.for_status(exc.status), exc.error)
    finally:
        terminal.restore(0)
        if restore_signals is not None:
            restore_signals()
        run_session.close()
    printer.end(exited)
    if exited.timed_out:
        return exits.TIMED_OUT
    return exits.for_process(exited.exit_code)


def _catch_signals(tty: bool) -> "tuple[int, Callable[[], None]]":
    """Our signals, caught: each one's number arrives on the returned fd (the interpreter's
    wakeup fd) for the poll loop to forward. The returned function puts everything back."""
    import _signal

    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    names = [*FORWARDED, *(("SIGWINCH",) if tty else ())]
    numbers = [getattr(_signal, name) for name in names if hasattr(_signal, name)]

    def caught(signum: int, frame: object) -> None:
        pass  # the wakeup fd carries it

    previous = {signum: _signal.signal(signum, caught) for signum in numbers}
    old_wakeup = _signal.set_wakeup_fd(write_end)

    def restore() -> None:
        _signal.set_wakeup_fd(old_wakeup)
        for signum, handler in previous.items():
            _signal.signal(signum, handler)
        os.close(read_end)
        os.close(write_end)

    return read_end, restore


def _pump(
    run_session: session.Session,
    printer: _Printer,
    interactive: bool,
    wakeup: int,
    tty_fd: int | None,
) -> session.Exited:
    import _signal
    import select

    sigwinch = getattr(_signal, "SIGWINCH", None)
    poller = select.poll()
    poller.register(run_session.fileno(), select.POLLIN)
    poller.register(wakeup, select.POLLIN)
    stdin_open = interactive
    if stdin_open:
        poller.register(0, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == wakeup:
                for signum in os.read(wakeup, 64):
                    if signum == sigwinch:
                        size = _window(tty_fd) if tty_fd is not None else None
                        if size is not None:
                            run_session.resize(*size)
                    else:
                        run_session.signal(signum)
            elif fd == 0:
                data = os.read(0, http.RECV) if stdin_open else b""
                if data:
                    run_session.send_stdin(data)
                else:
                    stdin_open = False
                    poller.unregister(0)
                    run_session.close_stdin()
            else:
                batch = run_session.receive()
                if run_session.closed:
                    raise session.SessionError("applianced ended the run without an exit status")
                for kind, payload in batch:
                    if kind in (framing.STDOUT, framing.STDERR):
                        printer.output(kind, payload)
                    elif kind == framing.EXIT:
                        return session.exited_of(payload)
                    elif kind == framing.ERROR:
                        raise session.error_of(payload)


def _full_cli() -> int:
    if sys.flags.no_site:
        # Started without site (module docstring): the full CLI needs site-packages. The tree
        # this package is in comes first, so `appliance.ctl.main` is this checkout's.
        import site

        site.main()
    from appliance.ctl.main import main as full_cli

    return full_cli()


def main() -> int:
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
