"""Framing on the admin socket, written once: JSON lines, and the frames of a `run` session.

Both ends import this module: applianced (api.py) and appliancectl, including its start-up-bound
`run` client (appliance/ctl/fast.py), so it imports nothing at all.

JSON lines (`application/x-ndjson`): one JSON document per line, in a chunked HTTP body. Used
by the streamed answers (`/v1/journal/export`, `/v1/events`). `LineBuffer` cuts a byte stream
into lines with a bound on what it holds.

Run frames: `POST /v1/crews/NAME/run` with `Upgrade: appliance-run/1` is answered `101 Switching
Protocols` (RFC 9110 section 7.8, the way Docker upgrades `exec start` to a raw stream), and from
then on the connection carries frames in both directions, each an 8-byte header and a payload:

    [kind: 1 byte][0, 0, 0][payload length: 4 bytes, big endian][payload]

(the header of Docker's multiplexed attach stream, with kinds of our own). applianced sends
STDOUT and STDERR (output bytes as they come, raw: with a TTY everything is STDOUT), then one
EXIT (a JSON `RunExit`) or one ERROR (a JSON `ErrorBody`: the exec failed after the upgrade).
appliancectl sends STDIN (bytes), STDIN_EOF (no more input: the process's stdin is closed),
SIGNAL (one byte: the signal number, delivered to the command's process group) and RESIZE
(rows, columns: 2 bytes each, big endian; the TTY's window size). When the client's side of the
connection ends, applianced kills the command: a run never outlives the appliancectl that
started it.
"""

UPGRADE = "appliance-run/1"

# applianced -> appliancectl
STDOUT = 1
STDERR = 2
EXIT = 3
ERROR = 4
# appliancectl -> applianced
STDIN = 0
STDIN_EOF = 5
SIGNAL = 6
RESIZE = 7

KINDS = frozenset({STDIN, STDOUT, STDERR, EXIT, ERROR, STDIN_EOF, SIGNAL, RESIZE})
HEADER = 8
MAX_FRAME = 1 << 20  # a frame's payload; output and input are sent in pieces far smaller
MAX_LINE = 8 * 1024 * 1024  # one JSON line of a streamed answer


class FramingError(Exception):
    """The peer broke the framing: an unknown kind, an over-long frame or line."""


def frame(kind: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME:
        raise FramingError(f"frame of {len(payload)} bytes (at most {MAX_FRAME})")
    return bytes((kind, 0, 0, 0)) + len(payload).to_bytes(4, "big") + payload


def signal_frame(signum: int) -> bytes:
    return frame(SIGNAL, bytes((signum,)))


def resize_frame(rows: int, columns: int) -> bytes:
    rows, columns = max(0, min(rows, 0xFFFF)), max(0, min(columns, 0xFFFF))
    return frame(RESIZE, rows.to_bytes(2, "big") + columns.to_bytes(2, "big"))


def parse_resize(payload: bytes) -> tuple[int, int]:
    if len(payload) != 4:
        raise FramingError(f"resize frame of {len(payload)} bytes (4 expected)")
    return int.from_bytes(payload[:2], "big"), int.from_bytes(payload[2:], "big")


def parse_signal(payload: bytes) -> int:
    if len(payload) != 1 or not 0 < payload[0] < 65:
        raise FramingError(f"bad signal frame {payload[:8]!r}")
    return payload[0]


class FrameReader:
    """Bytes in (as the socket delivers them), whole frames out: (kind, payload)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buffer = self._buffer
        buffer += data
        frames: list[tuple[int, bytes]] = []
        start = 0
        while len(buffer) - start >= HEADER:
            kind = buffer[start]
            if kind not in KINDS or buffer[start + 1 : start + 4] != b"\0\0\0":
                raise FramingError(f"bad frame header {bytes(buffer[start : start + 8])!r}")
            size = int.from_bytes(buffer[start + 4 : start + 8], "big")
            if size > MAX_FRAME:
                raise FramingError(f"frame of {size} bytes (at most {MAX_FRAME})")
            if len(buffer) - start - HEADER < size:
                break
            frames.append((kind, bytes(buffer[start + HEADER : start + HEADER + size])))
            start += HEADER + size
        del buffer[:start]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an unfinished frame (at the end of the stream: a truncated frame)."""
        return len(self._buffer)


class LineBuffer:
    """Bytes in, whole lines out (each with its newline); at most `max_line` held."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._pending = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        pending = self._pending
        searched = len(pending)
        pending += data
        lines: list[bytes] = []
        start = 0
        while (end := pending.find(b"\n", max(start, searched))) != -1:
            lines.append(bytes(pending[start : end + 1]))
            start = end + 1
        del pending[:start]
        if len(pending) > self.max_line:
            raise FramingError(f"a line of over {self.max_line} bytes")
        return lines

    def flush(self) -> bytes:
        """The unfinished last line (no newline), if any."""
        rest = bytes(self._pending)
        self._pending.clear()
        return rest


def json_lines(documents: "list[bytes]") -> bytes:
    """Encoded JSON documents (without newlines) as one piece of a JSON-lines body."""
    return b"".join(document + b"\n" for document in documents)
