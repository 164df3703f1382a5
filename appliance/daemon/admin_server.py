"""The admin API's server: the root-only Unix socket, one h11 request per connection, routed
to the handlers of api.py.

The socket is created 0600 under a 0700 directory, and every connection's peer credentials
(SO_PEERCRED) must be root or applianced's own user: file modes are the first gate, the kernel's
word the second. With `[admin_tls] listen`, the same API also answers on TCP over mutual TLS
(admin_tls.py), where the client's certificate is the gate. Each request's log records carry
a request id and the crew it names; a client that goes away mid-answer is one INFO line, never
an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import struct
import urllib.parse
import uuid
from typing import TYPE_CHECKING

import h11
import trio

from proxycore import logs

from . import messages
from .admin_tls import HANDSHAKE_TIMEOUT, peer_subject, server_context
from .api import HEAD_TIMEOUT, MAX_BODY, Handlers, Request, _Reply, route
from .errors import DaemonError, InvalidRequest, Unavailable

if TYPE_CHECKING:
    from .main import Daemon

log = logging.getLogger("applianced.api")

# The client closed its end while we answered: expected, never an error.
_CLIENT_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


def _crew_named(path: str) -> str | None:
    """The crew a request names (/v1/crews/{name}...), for its log records."""
    parts = path.split("/")
    return parts[3] if len(parts) > 3 and parts[1:3] == ["v1", "crews"] and parts[3] else None


class AdminServer:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.handlers = Handlers(daemon)

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

    async def serve_tls(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The same API on host:port over mutual TLS (admin_tls.py); started with the bound
        port. The client's certificate, checked in the handshake, stands in for SO_PEERCRED."""
        context = server_context(self.daemon.config.admin_tls)
        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise Unavailable(
                f"`admin_tls.listen`: cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        bound = listeners[0].socket.getsockname()[1]
        log.info(
            "admin API over mutual TLS on %s",
            f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}",
        )
        task_status.started(bound)

        async def handler(stream: trio.SocketStream) -> None:
            await self._tls_connection(stream, context)

        await trio.serve_listeners(handler, listeners)

    async def _tls_connection(self, stream: trio.SocketStream, context: ssl.SSLContext) -> None:
        # Whatever a network peer does must end its connection, never the listener (an
        # exception here would end serve_listeners and the daemon with it).
        try:
            await self._tls_session(stream, context)
        except Exception as exc:
            log.warning("admin TLS connection ended: %s: %s", type(exc).__name__, exc)
            with contextlib.suppress(Exception):
                await trio.aclose_forcefully(stream)

    async def _tls_session(self, stream: trio.SocketStream, context: ssl.SSLContext) -> None:
        peer = stream.socket.getpeername()
        address = f"{peer[0]}:{peer[1]}"
        # https_compatible: a client that closes without close_notify (Python's ssl does) ends
        # its request like EOF; every answer is delimited by HTTP itself (RFC 9112, 9.8).
        tls = trio.SSLStream(stream, context, server_side=True, https_compatible=True)
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                await tls.do_handshake()
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            why = exc.__cause__ or exc
            log.warning("refused an admin TLS connection from %s: %s", address, why)
            with contextlib.suppress(*_CLIENT_GONE):
                await stream.aclose()
            return
        subject = peer_subject(tls.getpeercert())
        log.info("admin TLS connection from %s as %s", address, subject)
        await self._serve(tls, f"tls {subject}")

    async def _connection(self, stream: trio.SocketStream) -> None:
        creds = stream.socket.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
        )
        _, uid, _ = struct.unpack("3i", creds)
        if uid not in (0, os.geteuid()):
            log.warning("refused an admin connection from uid %d", uid)
            await stream.aclose()
            return
        await self._serve(stream, f"uid {uid}")

    async def _serve(self, stream: trio.abc.Stream, peer: str) -> None:
        """`peer`: who the connection is, as the kernel (SO_PEERCRED) or the TLS handshake
        says; journaled with the answers that name who gave them (approvals.py)."""
        async with stream:
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
            split = urllib.parse.urlsplit(target)
            with logs.bound(
                request_id=uuid.uuid4().hex, crew=_crew_named(split.path), admin_peer=peer
            ):
                await self._answer(method, target, split, request, body, stream, conn)

    async def _answer(
        self,
        method: str,
        target: str,
        split: urllib.parse.SplitResult,
        request: h11.Request,
        body: bytes,
        stream: trio.abc.Stream,
        conn: h11.Connection,
    ) -> None:
        try:
            handler, params = route(method, split.path)
            call = Request(
                method=method,
                path=split.path,
                params=params,
                query=urllib.parse.parse_qs(split.query),
                body=body,
                stream=stream,
                conn=conn,
                headers={
                    name.decode("latin-1"): value.decode("latin-1")
                    for name, value in request.headers
                },
            )
            reply = await handler(self.handlers, call)
        except DaemonError as exc:
            reply = _Reply(exc.status, self._error(exc))
        except _CLIENT_GONE:
            # Expected: the client stopped reading; noticed at our next write to it.
            log.info("admin client went away during %s %s", method, split.path)
            return
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("admin request %s %s", method, target)
            reply = _Reply(500, messages.ErrorBody("internal", f"internal error: {exc}"))
        if reply is not None:
            log.debug("%s %s: %d", method, split.path, reply.status)
            with contextlib.suppress(*_CLIENT_GONE, h11.LocalProtocolError):
                await self._send(stream, conn, reply)

    @staticmethod
    def _error(exc: DaemonError) -> messages.ErrorBody:
        return messages.ErrorBody(error=exc.code, message=str(exc))

    async def _read_request(
        self, stream: trio.abc.Stream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = bytes(await stream.receive_some(65536))
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
            elif event is h11.PAUSED:
                return request, bytes(body)

    async def _send(self, stream: trio.abc.Stream, conn: h11.Connection, reply: _Reply) -> None:
        data = messages.encoder.encode(reply.body)
        headers = [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            ("Connection", "close"),
        ]
        await stream.send_all(conn.send(h11.Response(status_code=reply.status, headers=headers)))
        await stream.send_all(conn.send(h11.Data(data=data)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
