"""Byte streams for the hot path: plain sockets that yield to trio only when the kernel would block.

Theory of operation: trio's socket methods make every call a checkpoint (a trip through the
scheduler) even when the kernel has the data ready. On a relay that does four socket operations
per request this is most of the cost: a bare trio relay measured 17.4k req/s on one core with
`SocketStream`, and noticeably more with the kernel tried first (see docs/benchmarks.md). So
`PlainStream` calls the non-blocking socket directly and waits with
`trio.lowlevel.wait_readable`/`wait_writable` only on `EAGAIN`. To stay fair to other tasks it
still checkpoints every `_FAIRNESS` operations that completed without waiting.

`TlsStream` adapts `trio.SSLStream` (upstream TLS) to the same three methods, so the proxy code is
written once against `ByteStream`.
"""

from __future__ import annotations

import socket
from typing import Protocol

import trio
from trio.lowlevel import checkpoint, wait_readable, wait_writable

_FAIRNESS = 16


class ByteStream(Protocol):
    def try_receive(self, max_bytes: int) -> bytes | None:
        """What the kernel has now (b"" at EOF), or None if a receive would block."""
        ...

    async def receive(self, max_bytes: int) -> bytes: ...

    async def receive_after_wait(self, max_bytes: int) -> bytes:
        """Wait for readability first: for when the peer cannot have answered yet."""
        ...

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...

    def close(self) -> None: ...


class PlainStream:
    """A connected non-blocking stdlib socket."""

    __slots__ = ("_unyielded", "sock")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._unyielded = 0

    @classmethod
    def adopt(cls, trio_sock: trio.socket.SocketType) -> PlainStream:
        """Take over the descriptor of a trio socket (the trio object is left detached)."""
        family, kind, proto = trio_sock.family, trio_sock.type, trio_sock.proto
        return cls(socket.socket(family, kind, proto, fileno=trio_sock.detach()))

    async def _fair(self) -> None:
        self._unyielded += 1
        if self._unyielded >= _FAIRNESS:
            self._unyielded = 0
            await checkpoint()

    def try_receive(self, max_bytes: int) -> bytes | None:
        try:
            return self.sock.recv(max_bytes)
        except BlockingIOError:
            return None
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise trio.BrokenResourceError(str(exc)) from None

    async def receive_after_wait(self, max_bytes: int) -> bytes:
        # Skips the recv that would fail with EAGAIN: right after we sent a request (or a
        # response) the peer has not answered yet, and a failed syscall costs as much as a
        # successful one.
        sock = self.sock
        self._unyielded = 0
        while True:
            await wait_readable(sock)
            try:
                return sock.recv(max_bytes)
            except BlockingIOError:
                continue  # spurious wake-up
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise trio.BrokenResourceError(str(exc)) from None

    async def receive(self, max_bytes: int) -> bytes:
        sock = self.sock
        try:
            data = sock.recv(max_bytes)
        except BlockingIOError:
            return await self.receive_after_wait(max_bytes)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise trio.BrokenResourceError(str(exc)) from None
        await self._fair()
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        sock = self.sock
        try:
            sent = sock.send(data)
            if sent == len(data):
                await self._fair()
                return
            view = memoryview(data)[sent:]
            while view:
                self._unyielded = 0
                await wait_writable(sock)
                try:
                    sent = sock.send(view)
                except BlockingIOError:
                    continue
                view = view[sent:]
        except BlockingIOError:
            self._unyielded = 0
            await wait_writable(sock)
            await self.send_all(data)
        except (ConnectionResetError, BrokenPipeError, OSError) as exc:
            raise trio.BrokenResourceError(str(exc)) from None

    def shutdown_write(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        # Wake any task still waiting on this descriptor before the number can be reused.
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()


class TlsStream:
    """`trio.SSLStream` behind the `ByteStream` methods."""

    __slots__ = ("raw", "ssl_stream")

    def __init__(self, ssl_stream: trio.SSLStream[trio.SocketStream], raw: socket.socket) -> None:
        self.ssl_stream = ssl_stream
        self.raw = raw

    def try_receive(self, max_bytes: int) -> bytes | None:
        return None  # TLS records need the SSL object: always go through receive()

    async def receive_after_wait(self, max_bytes: int) -> bytes:
        return await self.receive(max_bytes)

    async def receive(self, max_bytes: int) -> bytes:
        return bytes(await self.ssl_stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.ssl_stream.send_all(data)

    def close(self) -> None:
        # The TLS session is simply dropped (no close_notify): this is only called on error or
        # when an idle pooled connection is discarded.
        transport = self.ssl_stream.transport_stream
        trio.lowlevel.notify_closing(transport.socket)
        transport.socket.close()


# After a refusal that closes the connection: how long, and how much, to drain first.
LINGER_SECONDS = 1.0
LINGER_BYTES = 256 * 1024


async def lingering_close(stream: PlainStream) -> None:
    """Close after a refusal without destroying it.

    Closing a socket that still holds unread input makes the kernel send RST, and an RST can
    discard our response before the agent reads it. So: half-close, drain what the agent is still
    sending (bounded in bytes and time), then close (the "lingering close" of Apache and nginx).
    """
    try:
        stream.shutdown_write()
        with trio.move_on_after(LINGER_SECONDS):
            drained = 0
            while drained < LINGER_BYTES:
                data = await stream.receive(65536)
                if not data:
                    break
                drained += len(data)
    except (OSError, trio.BrokenResourceError):
        pass
    finally:
        stream.close()
