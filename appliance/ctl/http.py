"""The admin socket's transport: blocking HTTP/1.1 over a Unix socket, on `_socket` alone.

Both admin clients stand on it: the typed one (client.py, msgspec bodies) and the `run` fast
path (fast.py), which imports nothing beyond the interpreter's built-in C modules, so this module
does not either (no `socket`: its selectors and enum cost ~17 ms without site; no http.client:
ssl and the email package).

The peer is applianced itself (a root-owned socket) and the exchange is one request per
connection. The server (h11) answers with Content-Length or chunked transfer coding, or with
`101 Switching Protocols` for a `run` session (appliance/daemon/framing.py); the reader below
handles exactly those and refuses anything else, with bounds on heads, lines and bodies.
"""

from _socket import AF_UNIX, SOCK_STREAM
from _socket import socket as _unix_socket

from appliance.daemon.framing import FramingError, LineBuffer

from . import tinyjson

TYPE_CHECKING = False  # typing's, without importing typing (~3 ms); mypy reads the name
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

DEFAULT_ADMIN_SOCKET = "/run/agent-appliance/admin.sock"
MAX_HEAD = 64 * 1024  # status line and headers together
MAX_BODY = 64 * 1024 * 1024  # a whole JSON answer (`crew ls` of many crews is far less)
MAX_CHUNK_LINE = 4096
RECV = 65536


class Endpoint:
    """Where the admin API answers when it is not a Unix socket path: a transport that yields a
    connected socket (blocking, with recv/sendall/close/fileno; an ssl.SSLSocket for a TLS
    context, appliance/ctl/transport.py). A plain `str` is a Unix socket path, the local case,
    so the fast path never builds one of these."""

    label = ""
    # Appended to a failure after the connect: what this transport's likely causes are.
    hint = ""

    def connect(self, timeout: float | None) -> "Any":
        raise NotImplementedError

    def __str__(self) -> str:
        return self.label


def connect(where: "str | Endpoint", timeout: float | None) -> "Any":
    """A connected socket to the admin API: a Unix socket path, or an Endpoint's own transport.
    `Unreachable` (naming where) when nothing answers."""
    if not isinstance(where, str):
        return where.connect(timeout)
    sock = _unix_socket(AF_UNIX, SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(where)
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc) or type(exc).__name__
        raise Unreachable(f"applianced is not answering on {where}: {why}") from None
    return sock


class Unreachable(Exception):
    """Nothing answered on the socket, or what answered did not speak the admin API."""


class AdminError(Exception):
    """applianced answered with an error: its HTTP status and `{error, message}` body."""

    def __init__(self, status: int, error: str, message: str) -> None:
        self.status = status
        self.error = error
        self.message = message
        super().__init__(message)


class ProtocolError(Exception):
    pass


class Response:
    """An answer's status and headers; its body read as a whole, or as lines as they arrive."""

    def __init__(self, sock: "Any") -> None:
        self.sock = sock
        self.buffer = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunked = False
        self.length = 0

    def _fill(self) -> None:
        data = self.sock.recv(RECV)
        if not data:
            raise ProtocolError("connection closed inside the answer")
        self.buffer += data

    def _line(self, limit: int) -> bytes:
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
        raise ProtocolError("truncated or over-long line")

    def _exact(self, size: int) -> bytes:
        while len(self.buffer) < size:
            self._fill()
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def read_head(self) -> None:
        status_line = self._line(MAX_HEAD).decode("latin-1")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line: {status_line[:100]!r}")
        self.status = int(parts[1])
        size = len(status_line)
        while True:
            line = self._line(MAX_HEAD).decode("latin-1")
            size += len(line)
            if size > MAX_HEAD:
                raise ProtocolError("response head too long")
            if line in ("\r\n", "\n"):
                break
            name, sep, value = line.partition(":")
            if not sep:
                raise ProtocolError(f"bad header line: {line[:100]!r}")
            self.headers[name.strip().lower()] = value.strip()
        if self.status == 101:
            return  # the connection is the run session's now (framing.py)
        self.chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        if not self.chunked:
            length = self.headers.get("content-length")
            if length is None or not length.isdigit() or int(length) > MAX_BODY:
                raise ProtocolError(f"bad or missing Content-Length: {length!r}")
            self.length = int(length)

    def _chunks(self) -> "Iterator[bytes]":
        while True:
            size_line = self._line(MAX_CHUNK_LINE).split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise ProtocolError(f"bad chunk size: {size_line[:40]!r}") from None
            if size == 0:
                while self._line(MAX_HEAD) not in (b"\r\n", b"\n"):  # trailers: ignored
                    pass
                return
            data = self._exact(size)
            if self._exact(2) != b"\r\n":
                raise ProtocolError("chunk not followed by CRLF")
            yield data

    def body(self) -> bytes:
        """The whole body (an answer of Content-Length, or chunked up to MAX_BODY)."""
        if not self.chunked:
            return self._exact(self.length)
        parts: list[bytes] = []
        total = 0
        for chunk in self._chunks():
            total += len(chunk)
            if total > MAX_BODY:
                raise ProtocolError("body too large")
            parts.append(chunk)
        return b"".join(parts)

    def lines(self) -> "Iterator[bytes]":
        """The body split at newlines as it arrives (JSON lines: framing.py)."""
        if not self.chunked:
            yield from self._exact(self.length).splitlines(keepends=True)
            return
        lines = LineBuffer()
        try:
            for chunk in self._chunks():
                yield from lines.feed(chunk)
        except FramingError as exc:
            raise ProtocolError(str(exc)) from None
        if rest := lines.flush():
            yield rest

    def take_buffer(self) -> bytes:
        """After a 101: what was read past the head (the session's first bytes)."""
        data, self.buffer = self.buffer, b""
        return data

    def close(self) -> None:
        self.sock.close()


def error_of(raw: bytes) -> tuple[str, str]:
    """(error, message) of an error answer's body (messages.ErrorBody), or of anything else."""
    try:
        body = tinyjson.loads(raw)
        if isinstance(body, dict):
            error, message = body.get("error"), body.get("message")
            if isinstance(error, str) and isinstance(message, str):
                return error, message
    except tinyjson.NotJSON:
        pass
    return "http", raw.decode("utf-8", "replace")[:500]


def request(
    path: "str | Endpoint",
    method: str,
    target: str,
    body: bytes | None = None,
    *,
    headers: "tuple[tuple[str, str], ...]" = (),
    timeout: float | None = None,
) -> Response:
    """Connect, send one request, read the answer's head. `Unreachable` if nothing answers or
    the answer is not HTTP; `AdminError` for an error status (its body read and closed).
    `path`: the Unix socket's path, or an Endpoint (a context's TLS listener)."""
    sock = connect(path, timeout)
    head = f"{method} {target} HTTP/1.1\r\nHost: applianced\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers)
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    response = Response(sock)
    try:
        sock.sendall(head.encode("latin-1") + b"\r\n" + (body or b""))
        response.read_head()
    except (OSError, ProtocolError) as exc:
        sock.close()
        hint = "" if isinstance(path, str) else path.hint
        raise Unreachable(f"applianced on {path}: {exc}{hint}") from None
    if response.status >= 400:
        try:
            raw = response.body()
        except (OSError, ProtocolError) as exc:
            raw = str(exc).encode()
        finally:
            sock.close()
        error, message = error_of(raw)
        raise AdminError(response.status, error, message)
    return response
