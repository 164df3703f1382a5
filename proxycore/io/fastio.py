"""Byte streams for the hot path: plain sockets that yield to trio only when the kernel would block.

Theory of operation: trio's socket methods make every call a checkpoint (a trip through the
scheduler) even when the kernel has the data ready. On a relay that does four socket operations
per request this is most of the cost: a bare trio relay measured 17.4k req/s on one core with
`SocketStream`, and noticeably more with the kernel tried first (see docs/benchmarks.md). So
`PlainStream` calls the non-blocking socket directly and waits with
`trio.lowlevel.wait_readable`/`wait_writable` only on `EAGAIN`. To stay fair to other tasks it
still checkpoints every `_FAIRNESS` operations that completed without waiting.

`TlsStream` does the same for TLS (upstream TLS) over an `ssl.SSLSocket`, so the proxy code is
written once against `ByteStream`.
"""

from __future__ import annotations

import socket
import ssl
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
    """TLS over a connected non-blocking socket: `ssl.SSLSocket`, driven like `PlainStream`.

    The kernel read and the decryption are one C call (`SSLSocket.recv`), and trio is entered
    only when OpenSSL says it would block (`SSLWantReadError`/`SSLWantWriteError`), then to wait
    for the descriptor. `trio.SSLStream` over a `SocketStream` costs several awaits, a lock and
    a MemoryBIO copy each way per operation: on a terminated tunnel, where every request crosses
    two TLS legs, that was a quarter of the proxy's CPU.

    Two rules of OpenSSL shape the methods: plain text OpenSSL has already decrypted
    (`pending()`) makes no descriptor readable, so a read checks it before waiting; and a write
    that would block must be retried with the same bytes, so a write interrupted while it waits
    (a cancellation) leaves the stream broken for writes rather than let another write follow.
    Reads and writes may run in different tasks (HTTP/2, WebSocket relays): OpenSSL allows one of
    each at a time on one SSL object within a thread.
    """

    __slots__ = ("_broken", "_unyielded", "sock")

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self.sock = sock
        self._unyielded = 0
        self._broken = False

    async def handshake(self) -> None:
        """Raises ssl.SSLError (a refused certificate among them) or OSError."""
        sock = self.sock
        while True:
            try:
                sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await wait_readable(sock)
            except ssl.SSLWantWriteError:
                await wait_writable(sock)

    def try_receive(self, max_bytes: int) -> bytes | None:
        try:
            return self.sock.recv(max_bytes)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except OSError as exc:
            raise trio.BrokenResourceError(_tls_failure(exc)) from None

    async def receive_after_wait(self, max_bytes: int) -> bytes:
        sock = self.sock
        self._unyielded = 0
        if not sock.pending():
            await wait_readable(sock)
        return await self._receive(max_bytes)

    async def receive(self, max_bytes: int) -> bytes:
        data = self.try_receive(max_bytes)
        if data is None:
            self._unyielded = 0
            return await self._receive(max_bytes)
        await self._fair()
        return data

    async def _receive(self, max_bytes: int) -> bytes:
        sock = self.sock
        while True:
            try:
                return sock.recv(max_bytes)
            except ssl.SSLWantReadError:
                await wait_readable(sock)
            except ssl.SSLWantWriteError:
                await wait_writable(sock)
            except OSError as exc:
                raise trio.BrokenResourceError(_tls_failure(exc)) from None

    async def _fair(self) -> None:
        self._unyielded += 1
        if self._unyielded >= _FAIRNESS:
            self._unyielded = 0
            await checkpoint()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._broken:
            raise trio.BrokenResourceError("TLS stream broken by an interrupted write")
        sock = self.sock
        try:
            sent = sock.send(data)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            sent = 0
        except OSError as exc:
            raise trio.BrokenResourceError(_tls_failure(exc)) from None
        if sent == len(data):
            await self._fair()
            return
        # The slow path: the peer is not reading as fast. Each write after a refused one
        # repeats it with the same bytes (see the class docstring).
        view = memoryview(data)[sent:]
        self._unyielded = 0
        try:
            while view:
                try:
                    sent = sock.send(view)
                except ssl.SSLWantWriteError:
                    await wait_writable(sock)
                    continue
                except ssl.SSLWantReadError:
                    await wait_readable(sock)
                    continue
                except OSError as exc:
                    raise trio.BrokenResourceError(_tls_failure(exc)) from None
                view = view[sent:]
        except BaseException:
            self._broken = True  # a record may be half written: no other write may follow
            raise

    def close(self) -> None:
        # The TLS session is simply dropped (no close_notify): this is only called on error or
        # when an idle pooled connection is discarded.
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()


def _tls_failure(exc: OSError) -> str:
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    return str(exc)


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
