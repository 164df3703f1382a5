"""appliancectl's side of the admin API: blocking HTTP/1.1 over the Unix socket (http.client).

`AdminError` carries the HTTP status and the `{error, message}` body; `Unreachable` means nothing
answered on the socket (applianced not running, or no permission).
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any

import msgspec

from . import messages


class Unreachable(Exception):
    pass


class AdminError(Exception):
    def __init__(self, status: int, error: str, message: str) -> None:
        self.status = status
        self.error = error
        self.message = message
        super().__init__(message)


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("applianced", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise Unreachable(
                f"applianced is not answering on {self.path}: {exc.strerror}"
            ) from None
        self.sock = sock


class AdminClient:
    def __init__(self, path: str, timeout: float | None = 600.0) -> None:
        self.path = path
        self.timeout = timeout

    def _open(self, method: str, target: str, body: object | None) -> http.client.HTTPResponse:
        connection = _UnixConnection(self.path, self.timeout)
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            connection.request(method, target, body=data, headers=headers)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            if isinstance(exc, Unreachable):
                raise
            raise Unreachable(f"applianced on {self.path}: {exc}") from None
        if response.status >= 400:
            raw = response.read()
            connection.close()
            try:
                error = msgspec.json.decode(raw, type=messages.ErrorBody)
            except msgspec.DecodeError:
                error = messages.ErrorBody("http", raw.decode("utf-8", "replace")[:500])
            raise AdminError(response.status, error.error, error.message)
        return response

    def call(self, method: str, target: str, body: object | None = None) -> Any:
        response = self._open(method, target, body)
        try:
            return json.loads(response.read())
        finally:
            response.close()

    def lines(self, target: str) -> Iterator[bytes]:
        """A streamed JSON-lines answer (journal export), one raw line at a time."""
        response = self._open("GET", target, None)
        try:
            while line := response.readline():
                yield line
        finally:
            response.close()

    def run(
        self, crew: str, argv: list[str], timeout: float | None
    ) -> Iterator[messages.RunOutput | messages.RunExit]:
        request = messages.RunCommand(argv=tuple(argv), timeout=timeout)
        response = self._open("POST", f"/v1/crews/{crew}/run", request)
        try:
            while line := response.readline():
                # Untagged objects: the exit line is the one with exit_code.
                if b'"exit_code"' in line:
                    yield msgspec.json.decode(line, type=messages.RunExit)
                else:
                    yield msgspec.json.decode(line, type=messages.RunOutput)
        finally:
            response.close()


__all__ = ["AdminClient", "AdminError", "Unreachable"]
