"""appliancectl's side of the admin API: blocking HTTP/1.1 over the Unix socket.

`AdminError` carries the HTTP status and the `{error, message}` body; `Unreachable` means nothing
answered on the socket (applianced not running, or no permission).

Why not http.client: this module is what every admin command imports (`appliancectl run` is
timed against `docker exec`, docs/benchmarks.md), and http.client pulls in ssl and the email
package (~15 ms of a ~30 ms budget); msgspec another ~14 ms. The peer is applianced itself (a
root-owned socket), the exchange is one request per connection, and the server (h11) answers
with either Content-Length or chunked transfer coding, so the reader below handles exactly
those two and refuses anything else. Only the standard library's socket and json are used.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

DEFAULT_ADMIN_SOCKET = "/run/agent-appliance/admin.sock"

_MAX_HEAD = 64 * 1024  # status line and headers together
_MAX_LINE = 8 * 1024 * 1024  # one chunk-size line, one streamed output line
_MAX_BODY = 64 * 1024 * 1024  # a whole JSON answer (`crew ls` of many crews is far less)


class Unreachable(Exception):
    pass


class AdminError(Exception):
    def __init__(self, status: int, error: str, message: str) -> None:
        self.status = status
        self.error = error
        self.message = message
        super().__init__(message)


class RunOutput:
    """One line a command wrote (`stream` is "stdout" or "stderr")."""

    __slots__ = ("line", "stream")

    def __init__(self, stream: str, line: str) -> None:
        self.stream = stream
        self.line = line


class RunExit:
    """The last event of a run: the command's exit code and whether the timeout killed it."""

    __slots__ = ("exit_code", "timed_out")

    def __init__(self, exit_code: int, timed_out: bool = False) -> None:
        self.exit_code = exit_code
        self.timed_out = timed_out


class _ProtocolError(Exception):
    pass


class _Response:
    """A response's status and a reader of its body (Content-Length or chunked)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.file = sock.makefile("rb")
        self.status, headers = self._head()
        self._chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self._left = 0  # bytes left in the current chunk (chunked) or the body
        self._done = False
        if not self._chunked:
            length = headers.get("content-length")
            if length is None or not length.isdigit() or int(length) > _MAX_BODY:
                raise _ProtocolError(f"bad or missing Content-Length: {length!r}")
            self._left = int(length)

    def _line(self, limit: int) -> bytes:
        line = self.file.readline(limit + 1)
        if not line.endswith(b"\n") or len(line) > limit:
            raise _ProtocolError("truncated or over-long line")
        return line

    def _head(self) -> tuple[int, dict[str, str]]:
        status_line = self._line(_MAX_HEAD).decode("latin-1")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise _ProtocolError(f"bad status line: {status_line[:100]!r}")
        headers: dict[str, str] = {}
        size = len(status_line)
        while True:
            line = self._line(_MAX_HEAD).decode("latin-1")
            size += len(line)
            if size > _MAX_HEAD:
                raise _ProtocolError("response head too long")
            if line in ("\r\n", "\n"):
                return int(parts[1]), headers
            name, sep, value = line.partition(":")
            if not sep:
                raise _ProtocolError(f"bad header line: {line[:100]!r}")
            headers[name.strip().lower()] = value.strip()

    def _exact(self, size: int) -> bytes:
        data = self.file.read(size)
        if len(data) != size:
            raise _ProtocolError("connection closed inside the body")
        return data

    def _next_chunk(self) -> None:
        size_line = self._line(_MAX_LINE).split(b";", 1)[0].strip()
        try:
            self._left = int(size_line, 16)
        except ValueError:
            raise _ProtocolError(f"bad chunk size: {size_line[:40]!r}") from None
        if self._left == 0:
            while self._line(_MAX_HEAD) not in (b"\r\n", b"\n"):  # trailers: ignored
                pass
            self._done = True

    def read(self) -> bytes:
        if not self._chunked:
            data, self._left = self._exact(self._left), 0
            return data
        parts: list[bytes] = []
        total = 0
        while not self._done:
            self._next_chunk()
            if self._left:
                total += self._left
                if total > _MAX_BODY:
                    raise _ProtocolError("body too large")
                parts.append(self._exact(self._left))
                self._exact(2)  # the chunk's CRLF
        return b"".join(parts)

    def lines(self) -> Iterator[bytes]:
        """The body split at newlines, as it arrives (the run stream: one JSON object a line)."""
        if not self._chunked:
            yield from self.read().splitlines(keepends=True)
            return
        pending = b""
        while not self._done:
            self._next_chunk()
            if not self._left:
                break
            pending += self._exact(self._left)
            self._exact(2)
            if len(pending) > _MAX_LINE:
                raise _ProtocolError("streamed line too long")
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line + b"\n"
        if pending:
            yield pending

    def close(self) -> None:
        self.file.close()
        self.sock.close()


class AdminClient:
    def __init__(self, path: str, timeout: float | None = 600.0) -> None:
        self.path = path
        self.timeout = timeout

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise Unreachable(
                f"applianced is not answering on {self.path}: {exc.strerror}"
            ) from None
        return sock

    def _open(self, method: str, target: str, body: object | None) -> _Response:
        sock = self._connect()
        head = f"{method} {target} HTTP/1.1\r\nHost: applianced\r\n"
        if body is None:
            data = b""
        else:
            if hasattr(body, "__struct_fields__"):
                # A msgspec Struct (the `cred` commands build typed requests): only then is
                # msgspec imported, which the other admin commands leave out for start-up time.
                import msgspec

                body = msgspec.to_builtins(body)
            data = json.dumps(body, separators=(",", ":")).encode()
            head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        try:
            sock.sendall(head.encode("latin-1") + b"\r\n" + data)
            response = _Response(sock)
        except (OSError, _ProtocolError) as exc:
            sock.close()
            raise Unreachable(f"applianced on {self.path}: {exc}") from None
        if response.status >= 400:
            try:
                raw = response.read()
            except (OSError, _ProtocolError) as exc:
                raw = str(exc).encode()
            finally:
                response.close()
            error = _error_body(raw)
            raise AdminError(response.status, error[0], error[1])
        return response

    def call(self, method: str, target: str, body: object | None = None) -> Any:
        response = self._open(method, target, body)
        try:
            return json.loads(response.read())
        except (OSError, _ProtocolError) as exc:
            raise Unreachable(f"applianced on {self.path}: {exc}") from None
        finally:
            response.close()

    def lines(self, target: str) -> Iterator[bytes]:
        """A streamed JSON-lines answer (journal export), one raw line at a time."""
        response = self._open("GET", target, None)
        try:
            yield from response.lines()
        except (OSError, _ProtocolError) as exc:
            raise Unreachable(f"applianced on {self.path}: {exc}") from None
        finally:
            response.close()

    def run(
        self, crew: str, argv: list[str], timeout: float | None
    ) -> Iterator[RunOutput | RunExit]:
        request = {"argv": list(argv), "timeout": timeout}
        response = self._open("POST", f"/v1/crews/{crew}/run", request)
        try:
            for line in response.lines():
                yield _run_event(line)
        except (OSError, _ProtocolError) as exc:
            raise Unreachable(f"applianced on {self.path}: {exc}") from None
        finally:
            response.close()


def _error_body(raw: bytes) -> tuple[str, str]:
    try:
        body = json.loads(raw)
        if isinstance(body, dict):
            error, message = body.get("error"), body.get("message")
            if isinstance(error, str) and isinstance(message, str):
                return error, message
    except ValueError:
        pass
    return "http", raw.decode("utf-8", "replace")[:500]


def _run_event(line: bytes) -> RunOutput | RunExit:
    """One line of the run stream, checked as strictly as the server's Structs encode it."""
    try:
        event = json.loads(line)
    except ValueError:
        event = None
    if isinstance(event, dict):
        # Untagged objects: the exit line is the one with exit_code.
        if set(event) <= {"exit_code", "timed_out"} and "exit_code" in event:
            code, timed_out = event["exit_code"], event.get("timed_out", False)
            if type(code) is int and type(timed_out) is bool:
                return RunExit(code, timed_out)
        elif set(event) == {"stream", "line"}:
            stream, text = event["stream"], event["line"]
            if isinstance(stream, str) and isinstance(text, str):
                return RunOutput(stream, text)
    raise _ProtocolError(f"unexpected line in the run stream: {line[:200]!r}")


__all__ = ["AdminClient", "AdminError", "RunExit", "RunOutput", "Unreachable"]
