"""Serving control messages: JSON lines over a Unix socket (0600) or a socketpair.

One message per line in, one `ControlReply` per line out, in order. A line that does not decode
gets an error reply naming the problem; the connection stays usable. Lines are capped at 1 MiB
and an idle connection is closed after a while, so a stuck client cannot pin memory.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Awaitable, Callable

import msgspec
import trio

from . import control

Handler = Callable[[control.ControlMessage], Awaitable[control.ControlReply]]
MAX_LINE = 1 << 20
IDLE_SECONDS = 300.0


async def serve_control_stream(stream: trio.abc.Stream, handler: Handler) -> None:
    buffer = bytearray()
    async with stream:
        while True:
            data: bytes | bytearray = b""
            with trio.move_on_after(IDLE_SECONDS):
                data = await stream.receive_some(65536)
            if not data:
                return
            buffer += data
            if len(buffer) > MAX_LINE and b"\n" not in buffer:
                return
            while (end := buffer.find(b"\n")) != -1:
                line = bytes(buffer[:end])
                del buffer[: end + 1]
                try:
                    message = control.message_decoder.decode(line)
                except msgspec.DecodeError as exc:
                    reply = control.ControlReply(ok=False, error=f"bad message: {exc}")
                else:
                    reply = await handler(message)
                await stream.send_all(control.encoder.encode(reply) + b"\n")


async def serve_control_socket(
    path: str,
    handler: Handler,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve control messages on a Unix socket only its owner can open (0600)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # created 0600: no window in which others could connect
    try:
        await sock.bind(path)
    finally:
        os.umask(old_umask)
    sock.listen(16)
    listener = trio.SocketListener(sock)

    async def one(stream: trio.SocketStream) -> None:
        await serve_control_stream(stream, handler)

    try:
        task_status.started()
        await trio.serve_listeners(one, [listener])
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


class ControlClient:
    """The supervisor's end of one worker's socketpair: one request at a time."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.lock = trio.Lock()
        self.buffer = bytearray()

    async def request(self, message: control.ControlMessage) -> control.ControlReply:
        async with self.lock:
            await self.stream.send_all(control.encoder.encode(message) + b"\n")
            while (end := self.buffer.find(b"\n")) == -1:
                data = await self.stream.receive_some(65536)
                if not data:
                    raise trio.BrokenResourceError("worker closed its control channel")
                self.buffer += data
            line = bytes(self.buffer[:end])
            del self.buffer[: end + 1]
            return control.reply_decoder.decode(line)
