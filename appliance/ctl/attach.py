"""The client of a `run` session: stdin, a TTY, signals and the exit code, as `docker exec`.

Theory of operation
-------------------
One connection: `POST /v1/crews/NAME/run` upgraded to a session of frames (framing.py). A poll
loop moves the command's output to our stdout and stderr, our stdin to it (-i) until EOF, and
every signal we receive (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) to the command's
process group in the crew; with -t, SIGWINCH becomes a resize of the crew's TTY, and with -i -t
on a terminal ours is in raw mode, so Ctrl-C reaches the crew's TTY as a byte (as with `docker
exec -it`). We exit with the command's exit code (128 + N if signal N ended it; 124 if --timeout
did). If we die, the connection closes and applianced kills the command.

Both faces of `run` call `run()` here: the fast path (fast.py, under `python -S`) and the full
CLI (run.py). Like them it imports only the interpreter's built-in modules and this package's
dependency-free ones.
"""

import os
import sys

from appliance.daemon import framing

from . import exits, http, session, tinyjson

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# Signals passed on to the command in the crew (as `docker run --sig-proxy` does, less the
# ones that stop or kill appliancectl itself or are about its own terminal).
FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


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


def run(line: RunLine, path: "str | http.Endpoint") -> int:
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
