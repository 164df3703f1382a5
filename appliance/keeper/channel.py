"""applianced's end of the keeper channel: a Unix socket only the proxy worker may use.

Theory of operation
-------------------
The proxy worker forwards the keeper routes of a crew's local API here
(proxycore/io/keeper_client.py). Two independent checks admit a connection, both before a byte
of the request is read:

1. SO_PEERCRED: the kernel's record of the connecting process (pid, uid, gid), which the peer
   cannot forge; `peer_allowed` decides (applianced: the pid is one of its running proxy
   workers', and uid and gid are the workers' own). Anything else is closed at once.
2. `X-Internal-Token`: a 256-bit token generated at every start of applianced, known only to
   it and to the worker (sent over their socketpair), compared with `hmac.compare_digest` so the
   comparison's time says nothing about how much of a guess was right.

The socket file is 0660 root:<workers' gid> in a directory 0750 root:<workers' gid> of its own
under `[daemon] run_dir` (the workers cannot enter applianced's 0700 state directory; nobody
else can enter this one). Then one HTTP/1.1 exchange per connection: `POST
/internal/keeper/request` or `/internal/keeper/execute` with the crew in `X-Crew` (the worker took
it from the gateway), the agent's JSON body passed on to `KeeperService.handle`, and its answer
as JSON.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import h11
import msgspec
import trio

from appliance.keeper.service import MAX_BODY_BYTES, Answer, KeeperService
from proxycore.protocol.keeper import Action

log = logging.getLogger("applianced.keeper")

READ_DEADLINE_SECONDS = 10.0
_PEERCRED = struct.Struct("3i")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }
_encoder = msgspec.json.Encoder()
PeerCheck = Callable[[int, int, int], bool]


def new_token() -> str:
    return secrets.token_urlsafe(32)


def peer_credentials(sock: socket.socket | trio.socket.SocketType) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def token_matches(presented: bytes | None, token: str) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(presented, token.encode("ascii"))


class KeeperChannel:
    def __init__(
        self, service: KeeperService, path: Path, token: str, peer_allowed: PeerCheck
    ) -> None:
        self.service = service
        self.path = path
        self.token = token
        self.peer_allowed = peer_allowed
        self.refused_peers = 0

    async def serve(
        self,
        worker_ids: tuple[int, int] | None = None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen at `self.path`; with `worker_ids` (the proxy workers' uid, gid) its directory
        is made 0750 root:gid and the socket 0660 root:gid, so that only root and the workers'
        group can even connect (and then SO_PEERCRED and the token decide)."""
        directory = self.path.parent
        directory.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # closed while it is prepared
        self.path.unlink(missing_ok=True)
        listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: never a moment with wider rights
        try:
            await listener.bind(str(self.path))
        finally:
            os.umask(old)
        if worker_ids is not None:
            gid = worker_ids[1]
            os.chown(self.path, 0, gid)
            os.chmod(self.path, 0o660)
            os.chown(directory, 0, gid)
            os.chmod(directory, 0o750)  # noqa: S103 (group: the workers' own gid)
        listener.listen(64)
        try:
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    conn, _ = await listener.accept()
                    nursery.start_soon(self._serve_one, conn)
        finally:
            listener.close()
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                directory.rmdir()

    async def _serve_one(self, conn: trio.socket.SocketType) -> None:
        stream = trio.SocketStream(conn)
        async with stream:
            pid, uid, gid = peer_credentials(conn)
            if not self.peer_allowed(pid, uid, gid):
                self.refused_peers += 1
                log.warning("keeper channel: refused peer pid %d uid %d", pid, uid)
                return
            try:
                status, answer = await self._exchange(stream)
            except (trio.BrokenResourceError, trio.TooSlowError, h11.ProtocolError, OSError):
                return
            except Exception:
                # One bad call must not take the channel (and applianced's nursery) down.
                log.exception("keeper channel: call failed")
                status, answer = 500, Answer("deny", "the keeper failed", error="internal")
            with trio.move_on_after(READ_DEADLINE_SECONDS):
                await stream.send_all(answer_bytes(status, answer))

    async def _exchange(self, stream: trio.SocketStream) -> tuple[int, Answer]:
        server = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
        head: h11.Request | None = None
        body = bytearray()
        with trio.fail_after(READ_DEADLINE_SECONDS):
            while True:
                event = server.next_event()
                if event is h11.NEED_DATA:
                    server.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Request):
                    head = event
                    headers = dict(event.headers)
                    if not token_matches(headers.get(b"x-internal-token"), self.token):
                        return 401, Answer("deny", "bad internal token", error="unauthorized")
                elif isinstance(event, h11.Data):
                    body += event.data
                    if len(body) > MAX_BODY_BYTES:
                        return 413, Answer("deny", "body too large", error="too_long")
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
        if head is None:  # closed before a whole request head
            return 400, Answer("deny", "no request", error="bad_request")
        target = head.target.decode("ascii", "replace")
        action = {
            "/internal/keeper/request": Action.REQUEST,
            "/internal/keeper/execute": Action.EXECUTE,
        }.get(target)
        crew = dict(head.headers).get(b"x-crew", b"").decode("ascii", "replace")
        if head.method != b"POST" or action is None or not crew:
            return 404, Answer("deny", "no such keeper endpoint", error="not_found")
        return await self.service.handle(action, crew, bytes(body))


def answer_bytes(status: int, answer: Answer) -> bytes:
    body = _encoder.encode(answer)
    server = h11.Connection(h11.SERVER)
    # h11 needs to have seen a request before it writes a response.
    server.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    server.next_event()
    server.next_event()
    response = h11.Response(
        status_code=status,
        headers=[
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ],
    )
    return b"".join(
        server.send(event) or b"" for event in (response, h11.Data(data=body), h11.EndOfMessage())
    )
