"""appliancectl's entry point: `run` on a start-up budget, everything else through `appliance.cli`.

Why: `appliancectl run NAME -- CMD` is what an agent harness calls in a loop, and issue 5 times
it against `docker exec` (a Go binary that starts in a few ms; target: under 30 ms more). Most
of a Python CLI's cost is start-up, so this module is the whole of `run`'s client side and
imports nothing but the interpreter's built-in C modules (`_socket`, `_json`) and `os`:

    module                   ms to import here   (python -S -X importtime, 2-core VM)
    socket (selectors, enum)       ~17           `_socket`  ~0.3
    json (re and its compiler)     ~9            `_json`    ~0.5
    appliance.daemon.client        ~12           (both of the above, typing, the package)

It reads the one plain form of `run`, and hands any other command line, or any form it does
not know, to the full CLI unchanged, so there is one behaviour:

    appliancectl [--json] [--socket PATH] run [--json] [--socket PATH] [--timeout S] NAME -- CMD...

Output, errors and exit codes are those of `appliance.cli.cmd_run`, which calls `run` below
(tests/test_cli.py holds the two entry points to the same bytes). The admin socket: --socket,
else $APPLIANCECTL_SOCKET, else the default when no config file is there; with --config or a
config file, the full CLI reads it.

Theory of operation
-------------------
One connection, one request (`POST /v1/crews/NAME/run`), one streamed answer: applianced answers
200 with a chunked body of JSON lines (`{"stream", "line"}`..., then `{"exit_code",
"timed_out"}`), or an error status with a `{"error", "message"}` body (appliance/daemon/api.py).
`_Wire` reads exactly that, as strictly as `appliance.daemon.client` does (Content-Length or
chunked, bounded lines and heads; anything else is refused). If appliancectl is killed or its
reader goes away, the connection closes and applianced kills the command (the daemon's side).

Start without `site`: the module also runs as a file, `python -S .../appliance/ctl.py ARGS`
(no site-packages, no `.pth` processing: ~10 ms instead of ~25-30 ms for the bare interpreter
in a development install, where site imports setuptools' editable finder). Only the fallback to
the full CLI then needs site-packages; `_full_cli` runs `site.main()` for it.
"""

import os
import sys

# CPython's own C halves of the json and socket modules (the table above): the public modules
# are thin Python layers over these for what is used here (json.loads' scanner, json.dumps'
# string quoting, a blocking Unix socket). The project runs on CPython only (native/ is cffi).
from _json import encode_basestring_ascii as _quote
from _json import make_scanner as _make_scanner
from _socket import AF_UNIX, SOCK_STREAM
from _socket import socket as _unix_socket

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy reads the name
if TYPE_CHECKING:
    from collections.abc import Iterator

# appliance.cli's and appliance.daemon.client's, repeated here so that this module imports
# nothing of the package (tests check they agree)
DEFAULT_CONFIG = "/etc/agent-appliance/appliance.toml"
DEFAULT_ADMIN_SOCKET = "/run/agent-appliance/admin.sock"
EXIT_FAILURE, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_CONFLICT = 1, 2, 3, 4
EXIT_UNREACHABLE, EXIT_TIMED_OUT = 5, 124

_MAX_HEAD = 64 * 1024  # status line and headers together
_MAX_LINE = 8 * 1024 * 1024  # one chunk-size line, one streamed output line
_MAX_BODY = 64 * 1024 * 1024  # an error answer's body
_RECV = 65536


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


# --- JSON, as the json module writes and reads it ------------------------------------------


def _json_value(value: object) -> str:
    """json.dumps' text for the scalars and string lists appliancectl sends and prints."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return str(_quote(value))
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    if isinstance(value, list):
        return "[" + ", ".join(_json_value(item) for item in value) + "]"
    raise TypeError(f"not sent as JSON here: {type(value).__name__}")


def dumps(data: dict[str, object]) -> str:
    """json.dumps(data) for a flat object of the values above (the same bytes)."""
    return "{" + ", ".join(f"{_quote(k)}: {_json_value(v)}" for k, v in data.items()) + "}"


class _ScanContext:
    """What the C scanner reads of a json.JSONDecoder: json.loads' defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> float:  # NaN, Infinity, -Infinity
        return float(name.lower().replace("infinity", "inf"))


# typeshed types the argument as the scanner class itself; the C code reads these attributes.
_scan = _make_scanner(_ScanContext())  # type: ignore[arg-type]


class _ProtocolError(Exception):
    pass


def loads(data: bytes) -> object:
    """json.loads for one UTF-8 document (one line of the run stream, an error body)."""
    try:
        text = data.decode("utf-8")
        start = len(text) - len(text.lstrip(" \t\r\n"))
        value, end = _scan(text, start)
    except (UnicodeDecodeError, StopIteration, ValueError) as exc:
        raise _ProtocolError(f"not JSON: {data[:200]!r} ({exc})") from None
    if text[end:].strip(" \t\r\n"):
        raise _ProtocolError(f"not one JSON value: {data[:200]!r}")
    return value


# --- the wire ------------------------------------------------------------------------------


class Unreachable(Exception):
    pass


class AdminError(Exception):
    def __init__(self, status: int, error: str, message: str) -> None:
        self.status = status
        self.error = error
        self.message = message
        super().__init__(message)


class _Wire:
    """One HTTP/1.1 exchange on a connected socket: the answer's head, then its body."""

    def __init__(self, sock: _unix_socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.status = 0
        self.chunked = False
        self.length = 0

    def _fill(self) -> None:
        data = self.sock.recv(_RECV)
        if not data:
            raise _ProtocolError("connection closed inside the answer")
        self.buffer += data

    def line(self, limit: int) -> bytes:
        start = 0
        while True:
            end = self.buffer.find(b"\n", start)
            if end >= 0:
                if end + 1 > limit:
                    break
                line, self.buffer = self.buffer[: end + 1], self.buffer[end + 1 :]
                return line
            if len(self.buffer) > limit:
                break
            start = len(self.buffer)
            self._fill()
        raise _ProtocolError("truncated or over-long line")

    def exact(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def head(self) -> None:
        status_line = self.line(_MAX_HEAD).decode("latin-1")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _ProtocolError(f"bad status line: {status_line[:100]!r}")
        self.status = int(parts[1])
        size = len(status_line)
        length: str | None = None
        while True:
            line = self.line(_MAX_HEAD).decode("latin-1")
            size += len(line)
            if size > _MAX_HEAD:
                raise _ProtocolError("response head too long")
            if line in ("\r\n", "\n"):
                break
            name, sep, value = line.partition(":")
            if not sep:
                raise _ProtocolError(f"bad header line: {line[:100]!r}")
            name = name.strip().lower()
            if name == "transfer-encoding":
                self.chunked = value.strip().lower() == "chunked"
            elif name == "content-length":
                length = value.strip()
        if not self.chunked:
            if length is None or not length.isdigit() or int(length) > _MAX_BODY:
                raise _ProtocolError(f"bad or missing Content-Length: {length!r}")
            self.length = int(length)

    def body(self) -> bytes:
        """A whole (small) body: an error answer's."""
        if not self.chunked:
            return self.exact(self.length)
        return b"".join(self.lines())

    def lines(self) -> "Iterator[bytes]":
        """The body split at newlines, as it arrives (the run stream: one JSON object a line)."""
        if not self.chunked:
            yield from self.exact(self.length).splitlines(keepends=True)
            return
        pending = b""
        while True:
            size_line = self.line(_MAX_LINE).split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise _ProtocolError(f"bad chunk size: {size_line[:40]!r}") from None
            if size == 0:
                while self.line(_MAX_HEAD) not in (b"\r\n", b"\n"):  # trailers: ignored
                    pass
                break
            pending += self.exact(size)
            if self.exact(2) != b"\r\n":
                raise _ProtocolError("chunk not followed by CRLF")
            if len(pending) > _MAX_LINE:
                raise _ProtocolError("streamed line too long")
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line + b"\n"
        if pending:
            yield pending


def _request(socket_path: str, name: str, argv: list[str], timeout: float | None) -> _Wire:
    """Connect, send the run request, read the answer's head; errors become exceptions."""
    sock = _unix_socket(AF_UNIX, SOCK_STREAM)
    try:
        sock.connect(socket_path)
    except OSError as exc:
        sock.close()
        raise Unreachable(f"applianced is not answering on {socket_path}: {exc.strerror}") from None
    # json.dumps({"argv": argv, "timeout": timeout}, separators=(",", ":")), as the client sends
    quoted = ",".join(_quote(a) for a in argv)
    body = f'{{"argv":[{quoted}],"timeout":{_json_value(timeout)}}}'.encode()  # all ASCII
    head = (
        f"POST /v1/crews/{name}/run HTTP/1.1\r\nHost: applianced\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    wire = _Wire(sock)
    try:
        sock.sendall(head.encode("latin-1") + body)
        wire.head()
    except (OSError, _ProtocolError) as exc:
        sock.close()
        raise Unreachable(f"applianced on {socket_path}: {exc}") from None
    if wire.status >= 400:
        try:
            raw = wire.body()
        except (OSError, _ProtocolError) as exc:
            raw = str(exc).encode()
        finally:
            sock.close()
        error, message = _error_body(raw)
        raise AdminError(wire.status, error, message)
    return wire


def _error_body(raw: bytes) -> tuple[str, str]:
    try:
        body = loads(raw)
        if isinstance(body, dict):
            error, message = body.get("error"), body.get("message")
            if isinstance(error, str) and isinstance(message, str):
                return error, message
    except _ProtocolError:
        pass
    return "http", raw.decode("utf-8", "replace")[:500]


# --- the command ---------------------------------------------------------------------------


def _socket_path(line: RunLine) -> str | None:
    if line.socket:
        return line.socket
    env = os.environ.get("APPLIANCECTL_SOCKET")
    if env:
        return env
    if os.path.exists(DEFAULT_CONFIG):
        return None  # the config names the socket: the full CLI reads it
    return DEFAULT_ADMIN_SOCKET


def _exit_for_status(status: int) -> int:
    if status == 404:
        return EXIT_NOT_FOUND
    if status == 409:
        return EXIT_CONFLICT
    if 400 <= status < 500:
        return EXIT_USAGE
    return EXIT_FAILURE


def _error(line: RunLine, message: str, code: int, kind: str | None = None) -> int:
    if line.as_json:
        data: dict[str, object] = {"ok": False, "error": message}
        if kind is not None:
            data["kind"] = kind
        print(dumps(data), flush=True)
    else:
        print(f"appliancectl: error: {message}", file=sys.stderr, flush=True)
    return code


def run(line: RunLine, socket_path: str) -> int:
    """Stream the command's output to stdout/stderr as it comes; its exit code (124: timed out)."""
    try:
        wire = _request(socket_path, line.name, line.argv, line.timeout)
    except Unreachable as exc:
        return _error(line, str(exc), EXIT_UNREACHABLE)
    except AdminError as exc:
        return _error(line, exc.message, _exit_for_status(exc.status), exc.error)
    stdout, stderr = sys.stdout, sys.stderr
    try:
        for raw in wire.lines():
            event = loads(raw)
            if not isinstance(event, dict):
                raise _ProtocolError(f"unexpected line in the run stream: {raw[:200]!r}")
            # Untagged objects, checked as strictly as the server's Structs encode them: the
            # exit line is the one with exit_code.
            keys = event.keys()
            if keys <= {"exit_code", "timed_out"} and "exit_code" in keys:
                code, timed_out = event["exit_code"], event.get("timed_out", False)
                if type(code) is not int or type(timed_out) is not bool:
                    raise _ProtocolError(f"unexpected line in the run stream: {raw[:200]!r}")
                if line.as_json:
                    print(dumps({"exit_code": code, "timed_out": timed_out}))
                exit_code = EXIT_TIMED_OUT if timed_out else code
                return exit_code if 0 <= exit_code <= 255 else EXIT_FAILURE
            stream, text = event.get("stream"), event.get("line")
            if keys != {"stream", "line"} or not isinstance(stream, str):
                raise _ProtocolError(f"unexpected line in the run stream: {raw[:200]!r}")
            if not isinstance(text, str):
                raise _ProtocolError(f"unexpected line in the run stream: {raw[:200]!r}")
            if line.as_json:
                print(dumps({"stream": stream, "line": text}), flush=True)
            else:
                target = stdout if stream == "stdout" else stderr
                target.write(text)
                target.flush()
    except (OSError, _ProtocolError) as exc:
        return _error(line, f"applianced on {socket_path}: {exc}", EXIT_UNREACHABLE)
    finally:
        wire.sock.close()
    return EXIT_FAILURE  # the stream ended without an exit line


def _full_cli() -> int:
    if sys.flags.no_site:
        # Started without site (module docstring): the full CLI needs site-packages. The tree
        # this file is in comes first, so `appliance.cli` is this checkout's, like this module.
        import site

        site.main()
    if __name__ == "__main__" and __spec__ is None:  # run as a file, not `-m appliance.ctl`
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [package_root, *(p for p in sys.path if os.path.abspath(p or ".") != here)]
    from appliance.cli import main as full_cli

    return full_cli()


def main() -> int:
    line = parse_run(sys.argv[1:])
    socket_path = _socket_path(line) if line is not None else None
    if line is None or socket_path is None:
        return _full_cli()
    try:
        return run(line, socket_path)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
