"""Reading what the proxy says, as a hostile client does: responses off a trio stream,
whatever their framing, with EOF and reset both read as the end (tests/chaos_attacks.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import trio


@dataclass
class Response:
    status: int
    headers: dict[bytes, bytes]
    body: bytes
    complete: bool  # the body arrived whole, as its framing said

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    @property
    def refusal(self) -> bool:
        """A readable refusal: a JSON object naming the error."""
        body = self.json()
        return isinstance(body, dict) and "error" in body


class Reader:
    """Responses from a trio stream; EOF and reset both read as the end."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        self.eof = False
        self.reset = False

    async def fill(self) -> bool:
        if self.eof:
            return False
        try:
            data = await self.stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            data = b""
            self.reset = True
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    async def response(self, timeout: float = 10.0) -> Response | None:
        """The next response, or None if the connection ended (or `timeout`) before a head."""
        with trio.move_on_after(timeout):
            while (end := self.buffer.find(b"\r\n\r\n")) < 0:
                if not await self.fill():
                    return None
            lines = bytes(self.buffer[:end]).split(b"\r\n")
            del self.buffer[: end + 4]
            try:
                status = int(lines[0].split(b" ", 2)[1])
            except (IndexError, ValueError):
                return Response(0, {}, bytes(lines[0]), False)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            body = bytearray()
            if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                while True:
                    while (end := self.buffer.find(b"\r\n")) < 0:
                        if not await self.fill():
                            return Response(status, headers, bytes(body), False)
                    try:
                        size = int(bytes(self.buffer[:end]).split(b";")[0], 16)
                    except ValueError:  # relayed garbage: not a complete response
                        return Response(status, headers, bytes(body), False)
                    if size == 0:
                        del self.buffer[: end + 2]
                        return Response(status, headers, bytes(body), True)
                    while len(self.buffer) < end + 2 + size + 2:
                        if not await self.fill():
                            return Response(status, headers, bytes(body), False)
                    body += self.buffer[end + 2 : end + 2 + size]
                    del self.buffer[: end + 2 + size + 2]
            length = int(headers.get(b"content-length", b"0"))
            while len(self.buffer) < length:
                if not await self.fill():
                    break
            body += self.buffer[:length]
            del self.buffer[:length]
            return Response(status, headers, bytes(body), len(body) == length)
        return None

    async def closed(self, timeout: float, max_bytes: int = 1 << 30) -> bool:
        """True if the proxy closes the connection within `timeout` and `max_bytes` (bytes read
        meanwhile are dropped)."""
        read = 0
        with trio.move_on_after(timeout):
            while await self.fill():
                read += len(self.buffer)
                self.buffer.clear()
                if read > max_bytes:
                    return False
            return True
        return False


def describe(response: Response | None) -> str:
    if response is None:
        return "closed without a response"
    return f"{response.status} {response.body[:200]!r}"
