"""The admin API: HTTP/1.1 (h11) with JSON bodies on a root-only Unix socket.

Theory of operation
-------------------
The control plane, not the hot path, so h11 (strict, well tested) parses it. The socket is
created 0600 under a 0700 directory, and every connection's peer credentials (SO_PEERCRED) must
be root or applianced's own user: file modes are the first gate, the kernel's word the second.
One request per connection (`Connection: close`): appliancectl opens a connection per command.

    GET    /v1/status                  Status
    GET    /v1/crews                   CrewList
    POST   /v1/crews                   CreateCrew -> 201 CrewInfo
    GET    /v1/crews/{name}            CrewInfo
    DELETE /v1/crews/{name}            Removed
    POST   /v1/crews/{name}/allow      AllowHost -> AllowResult
    POST   /v1/crews/{name}/run        RunCommand -> 200, chunked JSON lines: RunOutput..., RunExit
    GET    /v1/net                     netns.NetworkReport (crews by name, then free pool slots)
    GET    /v1/credentials             CredentialList; POST adds; .../{name}/grant|revoke|rotate
                                       (appliance/daemon/credentials.py; values only in bodies)
    GET    /v1/journal?n=&crew=&type=&after=   {"entries": [journal Row...]}, oldest first
    GET    /v1/journal/search?q=&n=    {"entries": [...]} (FTS5 MATCH over summary and payload)
    GET    /v1/journal/export?since=&until=&crew=   200, chunked JSON lines: a signed export
                                       (appliance/journal/export.py: header, Rows, signed end)
    GET    /v1/journal/verify          journal VerifyReport (200 whether or not it is ok)
    GET    /metrics                    Prometheus text exposition (appliance/daemon/metrics.py)
    POST   /v1/journal/prune           PruneRequest -> PruneReport (409 tampered: nothing removed)
    POST   /v1/journal/backup          {"path": absolute} -> BackupReport (a signed copy)

Errors are `{"error": code, "message": text}` with the status the error class carries
(errors.py): 400 invalid (names the argument), 404 not_found, 409 exists/conflict, 503
unavailable, 500 failed/internal. A request head must arrive within HEAD_TIMEOUT and a body is
capped at MAX_BODY.

Each request's log records carry a request id (a run's is its journal trace id) and the crew it
names. A client that goes away mid-answer (Ctrl-C, a killed `appliancectl`, a closed pipe, or
`run` closing as soon as it has read the exit) is not an error: one INFO line, no traceback.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import socket
import struct
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import h11
import msgspec
import trio

from proxycore import logs

from . import messages
from .errors import DaemonError, InvalidRequest

if TYPE_CHECKING:
    from .main import Daemon

log = logging.getLogger("applianced.api")

MAX_BODY = 1 << 20
HEAD_TIMEOUT = 10.0
PREFIX = "/v1/"
METRICS_PATH = "/metrics"
# The client closed its end while we answered: expected, never an error.
_CLIENT_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


def _crew_named(target: str) -> str | None:
    """The crew a request names (/v1/crews/{name}...), for its log records."""
    parts = target.split("?", 1)[0].split("/")
    return parts[3] if len(parts) > 3 and parts[1:3] == ["v1", "crews"] and parts[3] else None


class _Reply(msgspec.Struct, frozen=True):
    status: int
    body: Any


class _NotFound(DaemonError):
    status = 404
    code = "not_found"


class _MethodNotAllowed(DaemonError):
    status = 405
    code = "method_not_allowed"


def _decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"bad request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not JSON: {exc}") from None


class AdminServer:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    async def serve(
        self, path: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # born 0600: no window in which another user could connect
        try:
            await sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(64)
        listener = trio.SocketListener(sock)
        try:
            task_status.started()
            await trio.serve_listeners(self._connection, [listener])
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            creds = stream.socket.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
            )
            _, uid, _ = struct.unpack("3i", creds)
            if uid not in (0, os.geteuid()):
                log.warning("refused an admin connection from uid %d", uid)
                return
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
            try:
                with trio.fail_after(HEAD_TIMEOUT):
                    request, body = await self._read_request(stream, conn)
            except (trio.TooSlowError, h11.RemoteProtocolError, trio.BrokenResourceError):
                return
            except InvalidRequest as exc:
                await self._send(stream, conn, _Reply(413, self._error(exc)))
                return
            if request is None:
                return
            target = request.target.decode("ascii", "replace")
            method = request.method.decode("ascii", "replace")
            with logs.bound(request_id=uuid.uuid4().hex, crew=_crew_named(target)):
                await self._answer(method, target, body, stream, conn)

    async def _answer(
        self, method: str, target: str, body: bytes, stream: trio.SocketStream, conn: h11.Connection
    ) -> None:
        path = target.split("?", 1)[0]
        try:
            reply = await self._dispatch(method, target, body, stream, conn)
        except DaemonError as exc:
            reply = _Reply(exc.status, self._error(exc))
        except _CLIENT_GONE:
            # Expected: the client stopped reading; noticed at our next write to it.
            log.info("admin client went away during %s %s", method, path)
            return
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("admin request %s %s", method, path)
            reply = _Reply(500, messages.ErrorBody("internal", f"internal error: {exc}"))
        if reply is not None:
            log.debug("%s %s: %d", method, path, reply.status)
            with contextlib.suppress(*_CLIENT_GONE, h11.LocalProtocolError):
                await self._send(stream, conn, reply)

    @staticmethod
    def _error(exc: DaemonError) -> messages.ErrorBody:
        return messages.ErrorBody(error=exc.code, message=str(exc))

    async def _read_request(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(data)
                if not data and request is None:
                    return None, b""
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    raise InvalidRequest(f"request body over {MAX_BODY} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    async def _send(self, stream: trio.SocketStream, conn: h11.Connection, reply: _Reply) -> None:
        data = messages.encoder.encode(reply.body)
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            ("Connection", "close"),
        ]
        await stream.send_all(conn.send(h11.Response(status_code=reply.status, headers=headers)))
        await stream.send_all(conn.send(h11.Data(data=data)))
        await stream.send_all(conn.send(h11.EndOfMessage()))

    async def _dispatch(
        self,
        method: str,
        target: str,
        body: bytes,
        stream: trio.SocketStream,
        conn: h11.Connection,
    ) -> _Reply | None:
        path = target.split("?", 1)[0]
        if path == METRICS_PATH:
            if method != "GET":
                raise _MethodNotAllowed(f"{method} not allowed on {path}")
            await self._stream_metrics(stream, conn)
            return None
        if not path.startswith(PREFIX):
            raise _NotFound(f"no such endpoint: {path}")
        parts = path[len(PREFIX) :].strip("/").split("/")
        crews = self.daemon.crews

        def only(*allowed: str) -> None:
            if method not in allowed:
                raise _MethodNotAllowed(f"{method} not allowed on {path}")

        if parts == ["status"]:
            only("GET")
            return _Reply(200, await self.daemon.status())
        if parts[0] == "journal" and parts[1:] in (["prune"], ["backup"]):
            only("POST")
            return await self._journal_maintenance(parts[1], body)
        if parts[0] == "journal":
            only("GET")
            return await self._journal(parts[1:], target, stream, conn)
        if parts[0] == "credentials":
            # The endpoints journal their changes themselves: a change stored whose push to
            # the proxy then fails is journaled too (appliance/daemon/credentials.py).
            api = self.daemon.credentials_api
            status, reply = await api.handle(method, parts, body, self.daemon.recorder)
            return _Reply(status, reply)
        if parts == ["net"]:
            only("GET")
            return _Reply(200, await self.daemon.crews.net_report())
        if parts == ["crews"]:
            only("GET", "POST")
            if method == "GET":
                return _Reply(200, messages.CrewList(tuple(await crews.list_crews())))
            request = _decode(body, messages.CreateCrew)
            row = await crews.create(request)
            return _Reply(201, await crews.info(row))
        if len(parts) >= 2 and parts[0] == "crews":
            name = parts[1]
            if len(parts) == 2:
                only("GET", "DELETE")
                if method == "GET":
                    return _Reply(200, await crews.show(name))
                await crews.remove(name)
                return _Reply(200, messages.Removed(crew=name))
            if parts[2:] == ["allow"]:
                only("POST")
                allow = _decode(body, messages.AllowHost)
                changed = await crews.allow(name, allow.host)
                return _Reply(
                    200, messages.AllowResult(crew=name, host=allow.host, changed=changed)
                )
            if parts[2:] == ["run"]:
                only("POST")
                run = _decode(body, messages.RunCommand)
                events = await crews.run(name, run.argv, run.timeout)
                await self._stream_run(stream, conn, events)
                return None
        raise _NotFound(f"no such endpoint: {path}")

    async def _journal(
        self, parts: list[str], target: str, stream: trio.SocketStream, conn: h11.Connection
    ) -> _Reply | None:
        from appliance.journal import JournalError

        journal = self.daemon.journal
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query)

        def arg(name: str) -> str | None:
            values = query.get(name)
            return values[-1] if values else None

        def number(name: str, default: int) -> int:
            text = arg(name)
            if text is None:
                return default
            if not text.isdigit():
                raise InvalidRequest(f"argument {name}: {text!r} is not a non-negative integer")
            return int(text)

        try:
            if parts == []:
                rows = await trio.to_thread.run_sync(
                    functools.partial(
                        journal.tail,
                        min(number("n", 20), 10_000),
                        crew=arg("crew"),
                        type=arg("type"),
                        after=number("after", 0),
                    )
                )
                return _Reply(200, {"entries": rows})
            if parts == ["search"]:
                q = arg("q")
                if not q:
                    raise InvalidRequest("argument query: needs a search expression")
                rows = await trio.to_thread.run_sync(
                    journal.search, q, min(number("n", 50), 10_000)
                )
                return _Reply(200, {"entries": rows})
            if parts == ["verify"]:
                lifecycle = self.daemon.journal_lifecycle
                return _Reply(200, await trio.to_thread.run_sync(lifecycle.verify))
        except JournalError as exc:
            raise InvalidRequest(str(exc)) from None
        if parts == ["export"]:
            from appliance.journal.export import ExportFilter

            def seconds(name: str) -> float | None:
                text = arg(name)
                try:
                    return None if text is None else float(text)
                except ValueError:
                    raise InvalidRequest(f"argument {name}: {text!r} is not a time") from None

            where = ExportFilter(since=seconds("since"), until=seconds("until"), crew=arg("crew"))
            lines = await trio.to_thread.run_sync(self.daemon.journal_lifecycle.export, where)
            await self._stream_export(stream, conn, lines)
            return None
        raise _NotFound(f"no such endpoint: /v1/journal/{'/'.join(parts)}")

    async def _journal_maintenance(self, action: str, body: bytes) -> _Reply:
        """POST /v1/journal/prune (PruneRequest -> PruneReport; 409 `tampered` if what it would
        remove does not verify) and /v1/journal/backup ({"path": absolute} -> BackupReport)."""
        from appliance.journal import JournalError
        from appliance.journal.retention import JournalTampered, PruneRequest

        lifecycle = self.daemon.journal_lifecycle
        try:
            if action == "prune":
                request = _decode(body, PruneRequest)
                return _Reply(200, await trio.to_thread.run_sync(lifecycle.prune, request))
            path = _decode(body, dict[str, str]).get("path")
            if not path:
                raise InvalidRequest("argument path: give the backup file")
            return _Reply(200, await trio.to_thread.run_sync(lifecycle.backup, path))
        except JournalTampered as exc:
            return _Reply(409, {"error": "tampered", "message": str(exc)})
        except (JournalError, ValueError) as exc:
            raise InvalidRequest(str(exc)) from None

    async def _stream_export(
        self, stream: trio.SocketStream, conn: h11.Connection, rows: Iterator[Any]
    ) -> None:
        headers = [
            ("Content-Type", "application/x-ndjson"),
            ("Transfer-Encoding", "chunked"),
            ("Connection", "close"),
        ]
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
        while True:
            # Pages of rows read off the trio thread; the sqlite reads never block the loop.
            page = await trio.to_thread.run_sync(lambda: list(itertools.islice(rows, 1000)))
            if not page:
                break
            data = b"".join(
                row if isinstance(row, bytes) else messages.encoder.encode(row) + b"\n"
                for row in page
            )
            await stream.send_all(conn.send(h11.Data(data=data)))
        await stream.send_all(conn.send(h11.EndOfMessage()))

    async def _stream_run(
        self, stream: trio.SocketStream, conn: h11.Connection, events: Any
    ) -> None:
        """Chunked JSON lines; if the client goes away the command is cancelled (killed)."""
        from appliance.runtime.base import ExecExited

        headers = [
            ("Content-Type", "application/x-ndjson"),
            ("Transfer-Encoding", "chunked"),
            ("Connection", "close"),
        ]
        send: Callable[[bytes], Awaitable[None]] = stream.send_all
        await send(conn.send(h11.Response(status_code=200, headers=headers)))
        async with contextlib.aclosing(events) as iterator:
            async for event in iterator:
                if isinstance(event, ExecExited):
                    item: messages.RunEvent = messages.RunExit(event.exit_code, event.timed_out)
                else:
                    item = messages.RunOutput(
                        stream=event.stream, line=event.line.decode("utf-8", "replace")
                    )
                await send(conn.send(h11.Data(data=messages.encoder.encode(item) + b"\n")))
        # The client may close as soon as it has read the exit (appliance/ctl.py does): the
        # run is complete either way.
        with contextlib.suppress(*_CLIENT_GONE):
            await send(conn.send(h11.EndOfMessage()))

    async def _stream_metrics(self, stream: trio.SocketStream, conn: h11.Connection) -> None:
        data, content_type = self.daemon.metrics.exposition()
        headers = [
            ("Content-Type", content_type),
            ("Content-Length", str(len(data))),
            ("Connection", "close"),
        ]
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
        await stream.send_all(conn.send(h11.Data(data=data)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
