"""Serving control messages: JSON lines over a Unix socket (0600) or a socketpair.

One message per line in, one `ControlReply` per line out, in order. A line that does not decode
gets an error reply naming the problem; the connection stays usable. Lines are capped at 1 MiB
and an idle connection is closed after a while, so a stuck client cannot pin memory.
"""

from __future__ import annotations

import array
import os
import socket
import stat
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence

import msgspec
import trio

from proxycore import control

Handler = Callable[[control.ControlMessage], Awaitable[control.ControlReply]]
# A handler for the parent's channel: the second argument is the sockets that came with the
# message (`CrewAdd.listener`, then `CrewAdd.dns`'s UDP and TCP sockets), or (); the handler owns
# them from then on.
ChannelHandler = Callable[
    [control.ControlMessage, tuple[socket.socket, ...]], Awaitable[control.ControlReply]
]
MAX_LINE = 1 << 20
IDLE_SECONDS = 300.0
# Descriptors accepted per read; the sender passes at most three per message (`CrewAdd`).
MAX_FDS_PER_READ = 8


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
            for message in _complete_messages(buffer):
                if not isinstance(message, control.ControlReply):
                    message = await handler(message)
                await stream.send_all(control.encoder.encode(message) + b"\n")


async def serve_control_channel(sock: trio.socket.SocketType, handler: ChannelHandler) -> None:
    """Serve the parent's end of a socketpair (applianced, or the worker supervisor); returns
    when the parent closes it.

    Like `serve_control_stream`, plus descriptors passed with SCM_RIGHTS: they are queued in the
    order they arrive, and a message that announces some (`CrewAdd.listener`, `CrewAdd.dns`)
    takes the oldest, as many as it announces.
    The kernel delivers a descriptor with the first byte of the `sendmsg` that carried it, and
    the sender puts a message and its descriptor in one `sendmsg`, so the descriptor is queued
    before its line is complete. If descriptors were truncated (MSG_CTRUNC) the pairing can no
    longer be trusted and the channel is closed (fail closed: the caller stops the proxy).
    Unclaimed descriptors are closed. No idle timeout: the parent may be quiet for days.
    """
    buffer = bytearray()
    fds: deque[socket.socket] = deque()
    space = socket.CMSG_SPACE(MAX_FDS_PER_READ * array.array("i").itemsize)
    try:
        while True:
            data, ancdata, flags, _ = await sock.recvmsg(65536, space, socket.MSG_CMSG_CLOEXEC)
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    numbers = array.array("i")
                    usable = len(payload) - len(payload) % numbers.itemsize
                    numbers.frombytes(payload[:usable])
                    fds.extend(socket.socket(fileno=fd) for fd in numbers)
            if flags & socket.MSG_CTRUNC or not data:
                return
            buffer += data
            if len(buffer) > MAX_LINE and b"\n" not in buffer:
                return
            for message in _complete_messages(buffer):
                if isinstance(message, control.ControlReply):
                    reply = message
                else:
                    passed: tuple[socket.socket, ...] = ()
                    if isinstance(message, control.CrewAdd) and message.descriptors:
                        wanted = message.descriptors
                        if len(fds) < wanted:
                            # Fewer than announced: the pairing is off; none of them is used.
                            while fds:
                                fds.popleft().close()
                            reply = control.ControlReply(
                                ok=False, error="crew_add: no listening socket came with it"
                            )
                            await _send_all(sock, control.encoder.encode(reply) + b"\n")
                            continue
                        passed = tuple(fds.popleft() for _ in range(wanted))
                    reply = await handler(message, passed)
                await _send_all(sock, control.encoder.encode(reply) + b"\n")
    finally:
        for fd in fds:
            fd.close()


def _complete_messages(
    buffer: bytearray,
) -> Iterator[control.ControlMessage | control.ControlReply]:
    """Each complete line taken off `buffer`, decoded; a line that does not decode is the
    refusal to send back instead."""
    while (end := buffer.find(b"\n")) != -1:
        line = bytes(buffer[:end])
        del buffer[: end + 1]
        try:
            yield control.message_decoder.decode(line)
        except msgspec.DecodeError as exc:
            yield control.ControlReply(ok=False, error=f"bad message: {exc}")


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


class ChannelClient:
    """The parent's end of a proxy's control socketpair: one request at a time, optionally with
    sockets passed along (SCM_RIGHTS): `listener`, then `fds`, in that order."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.lock = trio.Lock()
        self.buffer = bytearray()

    async def request(
        self,
        message: control.ControlMessage,
        *,
        listener: socket.socket | None = None,
        fds: Sequence[socket.socket] = (),
    ) -> control.ControlReply:
        data = control.encoder.encode(message) + b"\n"
        passed = [*([] if listener is None else [listener]), *fds]
        async with self.lock:
            if passed:
                numbers = array.array("i", [s.fileno() for s in passed])
                sent = await self.sock.sendmsg(
                    [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, numbers.tobytes())]
                )
                data = data[sent:]
            await _send_all(self.sock, data)
            while (end := self.buffer.find(b"\n")) == -1:
                chunk = await self.sock.recv(65536)
                if not chunk:
                    raise trio.BrokenResourceError("the proxy closed its control channel")
                self.buffer += chunk
            line = bytes(self.buffer[:end])
            del self.buffer[: end + 1]
            return control.reply_decoder.decode(line)


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
