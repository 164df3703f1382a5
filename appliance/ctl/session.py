"""The client's end of a `run` session: the upgrade, then frames both ways (framing.py).

One implementation for both admin clients: the typed one (client.py) returns a `Session`, and
the `run` command (run.py, and its fast path under `python -S`) drives one from its poll loop.
Like http.py it imports nothing beyond the interpreter's built-in modules.
"""

from appliance.daemon import framing

from . import http, tinyjson

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator


class SessionError(Exception):
    """The session broke: the connection ended without an exit status, or bad framing."""


class Exited:
    """The command's end: its exit code (as the engine reports it) and whether --timeout
    killed it."""

    __slots__ = ("exit_code", "timed_out")

    def __init__(self, exit_code: int, timed_out: bool) -> None:
        self.exit_code = exit_code
        self.timed_out = timed_out


def exited_of(payload: bytes) -> Exited:
    """An EXIT frame's payload (messages.RunExit), checked as strictly as the server's Struct
    encodes it."""
    try:
        body = tinyjson.loads(payload)
    except tinyjson.NotJSON as exc:
        raise SessionError(str(exc)) from None
    if isinstance(body, dict) and body.keys() <= {"exit_code", "timed_out"}:
        code, timed_out = body.get("exit_code"), body.get("timed_out", False)
        if type(code) is int and type(timed_out) is bool:
            return Exited(code, timed_out)
    raise SessionError(f"bad exit frame: {payload[:200]!r}")


def error_of(payload: bytes) -> http.AdminError:
    """An ERROR frame's payload (messages.RunError: the status, error and message of what
    failed after the upgrade) as the error the request would have raised before it."""
    error, message = http.error_of(payload)
    status = 500
    try:
        body = tinyjson.loads(payload)
    except tinyjson.NotJSON:
        body = None
    if isinstance(body, dict) and type(body.get("status")) is int:
        status = body["status"]
    return http.AdminError(status, error, message)


def run_request(
    argv: "list[str]",
    timeout: float | None,
    stdin: bool,
    tty: bool,
    size: "tuple[int, int] | None",
) -> bytes:
    """messages.RunCommand as JSON (what msgspec would decode), written without msgspec."""
    body: dict[str, object] = {"argv": argv, "timeout": timeout}
    if stdin:
        body["stdin"] = True
    if tty:
        body["tty"] = True
    if size is not None:
        body["rows"], body["columns"] = size
    return tinyjson.dumps(body, compact=True).encode()


class Session:
    def __init__(self, response: http.Response) -> None:
        self.sock = response.sock
        self._reader = framing.FrameReader()
        self._ready = self._reader.feed(response.take_buffer())
        self.closed = False

    def fileno(self) -> int:
        return int(self.sock.fileno())

    def receive(self) -> "list[tuple[int, bytes]]":
        """The frames of one read (blocking until something arrives); [] and `closed` at the
        end of the connection."""
        if self._ready:
            ready, self._ready = self._ready, []
            return ready
        data = self.sock.recv(http.RECV)
        # A TLS socket may hold decrypted bytes past what one recv returned; poll(2) on its
        # descriptor cannot see them, so take them now or the loop would wait on the network
        # for what is already here (ssl.SSLSocket.pending, Python's ssl module docs).
        pending = getattr(self.sock, "pending", None)
        while data and pending is not None and pending() > 0:
            data += self.sock.recv(pending())
        if not data:
            self.closed = True
            if self._reader.pending:
                raise SessionError("the connection ended inside a frame")
            return []
        try:
            return self._reader.feed(data)
        except framing.FramingError as exc:
            raise SessionError(str(exc)) from None

    def frames(self) -> "Iterator[tuple[int, bytes]]":
        """Every frame until EXIT or ERROR (the last one yielded), or the end of the
        connection (SessionError: no exit status)."""
        while True:
            batch = self.receive()
            if self.closed:
                raise SessionError("applianced ended the run without an exit status")
            for kind, payload in batch:
                yield kind, payload
                if kind in (framing.EXIT, framing.ERROR):
                    return

    def send_stdin(self, data: bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), framing.MAX_FRAME):
            self.sock.sendall(
                framing.frame(framing.STDIN, bytes(view[start : start + framing.MAX_FRAME]))
            )

    def close_stdin(self) -> None:
        self.sock.sendall(framing.frame(framing.STDIN_EOF))

    def signal(self, signum: int) -> None:
        self.sock.sendall(framing.signal_frame(signum))

    def resize(self, rows: int, columns: int) -> None:
        self.sock.sendall(framing.resize_frame(rows, columns))

    def close(self) -> None:
        """Ends the session; a command still running is killed by applianced."""
        self.sock.close()


def open_session(
    path: "str | http.Endpoint",
    crew: str,
    body: bytes,
    *,
    timeout: float | None = None,
) -> Session:
    """`POST /v1/crews/CREW/run`, upgraded. `http.Unreachable`, `http.AdminError` (the run was
    refused: no such crew, not ready, bad arguments...) as http.request raises them."""
    response = http.request(
        path,
        "POST",
        f"/v1/crews/{crew}/run",
        body,
        headers=(("Connection", "Upgrade"), ("Upgrade", framing.UPGRADE)),
        timeout=timeout,
    )
    if response.status != 101:
        response.close()
        raise http.Unreachable(f"applianced on {path}: answered {response.status}, not 101")
    return Session(response)
