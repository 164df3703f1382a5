"""Terminated CONNECT tunnels: be the host to the agent, and serve the requests inside.

`serve_terminated` runs a `TerminateTunnel` plan (proxycore/protocol/exchange.py): answer 200,
do the TLS handshake as the tunnel's host with the crew's leaf for it (proxycore/io/leaves.py),
then hand the connection back to its request loop with the decrypted stream in place of the
socket and `tunnel=(host, port)` set, so every request read inside is planned as a forward
request to https://host:port (name policy, rules, placeholders, credential injection on a
provider host, the scrubber) and sent upstream over verified TLS like any other.

Theory of operation: TLS runs over `ssl.MemoryBIO` on the connection's `PlainStream`, not
`trio.SSLStream`. The connection's adapters are written against `PlainStream`'s methods, with a
synchronous `try_receive` and `shutdown_write`; the bytes the agent pipelined behind its CONNECT
head (often its ClientHello) are already in the connection's buffer and are fed to the BIO as
they are; and the socket stays owned by one object (a trio `SocketStream` over it would be a
second owner of the descriptor). `TerminatedStream` subclasses `PlainStream` as
proxycore/io/h2_stream.py's `StreamPipe` does, so every adapter takes it unchanged; it never sets
`sock`, so a path that writes to the socket directly fails loudly on it rather than write plain
text past the TLS layer (the opaque tunnel cannot be planned inside a tunnel anyway).

ALPN h2 (the leaf contexts offer h2 and http/1.1, proxycore/io/leaves.py): the connection hands
the tunnel to the HTTP/2 session (proxycore/io/http2.py), whose fast write path is the one
place that needs the socket: it uses `send_nowait` (encrypt, then a non-blocking send of the
records) and `send_records` (the rest, under its write lock) instead.

Failures of the handshake end the tunnel with `tunnel_closed` naming the host and a cause:
`agent_rejected_certificate` (the agent's TLS refused our leaf with an alert: a pinned client,
or a crew that does not trust its CA), `agent_closed_during_handshake` (the agent hung up; some
clients reject a certificate that way), `agent_tls_failed: REASON` (anything else, e.g. plain
HTTP sent into the tunnel). A slow handshake is bounded by the head timeout, as a slow head is.
"""

from __future__ import annotations

import math
import ssl
import time
from typing import TYPE_CHECKING

import trio

from proxycore.io.fastio import PlainStream
from proxycore.io.progress import RECV_SIZE, Phase
from proxycore.protocol.events import TunnelClosed, TunnelOpened
from proxycore.protocol.plans import TerminateTunnel

if TYPE_CHECKING:
    from proxycore.io.connection import ClientConnection

__all__ = ["TerminatedStream", "TerminatedTunnel", "serve_terminated"]

# Plain text encrypted per TLS write: bounds the ciphertext held before it is sent.
WRITE_CHUNK = 64 * 1024
# Alerts (RFC 8446 6.2) by which a client says it does not accept the certificate it was shown.
_REJECTING_ALERTS = (
    "UNKNOWN_CA",
    "BAD_CERTIFICATE",
    "CERTIFICATE_UNKNOWN",
    "CERTIFICATE_EXPIRED",
    "CERTIFICATE_REVOKED",
    "UNSUPPORTED_CERTIFICATE",
)


class HandshakeFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TerminatedStream(PlainStream):
    """The agent's side of a terminated tunnel: TLS, server side, over the agent's socket.

    Reads give plain text (b"" once the agent has closed, with or without close_notify: request
    framing, not the TLS close, says whether a request is whole); writes encrypt. A TLS error
    after the handshake is the peer's doing: trio.BrokenResourceError, as a reset socket is.
    """

    __slots__ = ("_closing", "_ended", "_incoming", "_outgoing", "_unsent", "bytes_down",
                 "bytes_up", "plain", "tls", "writer_flushes")  # fmt: skip

    def __init__(self, plain: PlainStream, context: ssl.SSLContext, prefix: bytes) -> None:
        # No socket of its own (PlainStream's __init__ is not called): every method is
        # overridden, and `sock` stays unset (see the module docstring).
        self.plain = plain
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        # TLS records produced by a read (a TLS 1.3 KeyUpdate answer) in `try_receive`, which
        # cannot await: sent before the next operation that can.
        self._unsent = b""
        self._closing = False
        # The agent's end of stream (TCP EOF fed to the BIO, or close_notify read): from then on
        # reads go to the TLS object, which answers it again, not to the socket.
        self._ended = False
        # Set when an HTTP/2 session serves the tunnel: its reads and writes run in different
        # tasks, and a read that sent the records it produced could put them in the middle of a
        # record a write has half sent. Those records then wait for the session's next write
        # (`send_nowait`), which follows every read that gave anything.
        self.writer_flushes = False
        # Bytes on the wire, agent -> proxy and proxy -> agent (as an opaque tunnel counts).
        self.bytes_up = len(prefix)
        self.bytes_down = 0
        if prefix:
            self._incoming.write(prefix)

    async def handshake(self) -> None:
        """Raises HandshakeFailed with the tunnel's closing reason."""
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                data = await self.plain.receive(RECV_SIZE)
                if not data:
                    raise HandshakeFailed("agent_closed_during_handshake") from None
                self.bytes_up += len(data)
                self._incoming.write(data)
            except ssl.SSLError as exc:
                try:
                    await self._flush()  # our alert, so the agent knows why
                except trio.BrokenResourceError:
                    pass
                raise HandshakeFailed(_handshake_reason(exc)) from None
        await self._flush()  # the server's last flight (TLS 1.3: with its session tickets)

    async def _flush(self) -> None:
        data = self._unsent + self._outgoing.read()
        self._unsent = b""
        if data:
            self.bytes_down += len(data)
            await self.plain.send_all(data)

    def _starved(self) -> bool:
        """Nothing received that is not decrypted, and nothing decrypted that is not read: a read
        of the TLS object could only raise SSLWantReadError. Asked first because that exception
        costs more than the check, and a keep-alive tunnel meets it at every request. (OpenSSL
        takes one record at a time from the BIO: a part of a record it holds cannot complete
        without new bytes.)"""
        return not self._incoming.pending and not self._ended and not self.tls.pending()

    def _decrypted(self, max_bytes: int) -> bytes | None:
        """Plain text from what has arrived; None: a whole record is not there yet."""
        if self._starved():
            return None
        try:
            data = self.tls.read(max_bytes)
        except ssl.SSLWantReadError:
            data = None
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            self._ended = True
            data = b""
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"agent TLS: {exc.reason or exc}") from None
        if self._outgoing.pending:
            self._unsent += self._outgoing.read()
        return data

    def _feed(self, raw: bytes) -> None:
        if raw:
            self.bytes_up += len(raw)
            self._incoming.write(raw)
        else:
            self._ended = True
            self._incoming.write_eof()

    def try_receive(self, max_bytes: int) -> bytes | None:
        if self._closing:
            return self.plain.try_receive(max_bytes)
        data = self._decrypted(max_bytes)
        if data is not None:
            return data
        raw = self.plain.try_receive(RECV_SIZE)
        if raw is None:
            return None
        self._feed(raw)
        return self._decrypted(max_bytes)

    async def receive(self, max_bytes: int) -> bytes:
        if self._closing:
            return await self.plain.receive(max_bytes)
        flush = not self.writer_flushes
        if self._unsent and flush:
            await self._flush()
        while True:
            # Records already received come first: waiting on the socket for them would hang.
            data = self._decrypted(max_bytes)
            if data is not None:
                if self._unsent and flush:
                    await self._flush()
                return data
            self._feed(await self.plain.receive(RECV_SIZE))

    async def receive_after_wait(self, max_bytes: int) -> bytes:
        # The peer cannot have answered yet: with nothing buffered and nothing to flush, skip
        # the receive that `receive` would try first and wait for the socket.
        if not self._closing and not self._unsent and self._starved():
            self._feed(await self.plain.receive_after_wait(RECV_SIZE))
        return await self.receive(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        try:
            for start in range(0, len(view), WRITE_CHUNK):
                self.tls.write(view[start : start + WRITE_CHUNK])
                await self._flush()
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"agent TLS: {exc.reason or exc}") from None
        if self._unsent:
            await self._flush()

    @property
    def records_waiting(self) -> bool:
        """Records a read produced are waiting for `send_nowait` (see `writer_flushes`)."""
        return bool(self._unsent)

    def send_nowait(self, data: bytes) -> bytes:
        """Encrypt `data` and hand the records, after any a read produced, to the kernel without
        waiting; returns the records it did not take, for `send_records`. For a writer that
        never calls this while records it returned are still unsent (H2Session's lock), so the
        records go out in the order they were made."""
        view = memoryview(data)
        try:
            for start in range(0, len(view), WRITE_CHUNK):
                self.tls.write(view[start : start + WRITE_CHUNK])
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"agent TLS: {exc.reason or exc}") from None
        records = self._unsent + self._outgoing.read()
        self._unsent = b""
        if not records:
            return b""
        try:
            sent = self.plain.sock.send(records)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise trio.BrokenResourceError(str(exc)) from None
        self.bytes_down += sent
        return records[sent:]

    async def send_records(self, records: bytes) -> None:
        """Write records `send_nowait` returned, waiting for the agent."""
        await self.plain.send_all(records)
        self.bytes_down += len(records)

    def shutdown_write(self) -> None:
        """close_notify (best effort: one non-blocking send of a short record), then the TCP
        half-close; what the agent still sends is read raw (the lingering close drains it)."""
        if self._closing:
            return
        self._closing = True
        try:
            self.tls.unwrap()
        except ssl.SSLError:
            pass  # SSLWantReadError: the close_notify is written, the agent's is not awaited
        data = self._unsent + self._outgoing.read()
        self._unsent = b""
        if data:
            try:
                self.bytes_down += self.plain.sock.send(data)
            except OSError:
                pass
        self.plain.shutdown_write()

    def close(self) -> None:
        self.plain.close()


def _handshake_reason(exc: ssl.SSLError) -> str:
    reason = str(exc.reason or type(exc).__name__)
    if isinstance(exc, ssl.SSLEOFError):
        return "agent_closed_during_handshake"
    if "ALERT" in reason and reason.endswith(_REJECTING_ALERTS):
        return "agent_rejected_certificate"
    return f"agent_tls_failed: {reason}"


class TerminatedTunnel:
    """A terminated tunnel, held by its connection until it ends (`closed_event`)."""

    __slots__ = ("host", "port", "reason", "started", "stream", "tunnel_id")

    def __init__(self, tunnel_id: int, host: str, port: int, stream: TerminatedStream) -> None:
        self.tunnel_id = tunnel_id
        self.host = host
        self.port = port
        self.stream = stream
        self.started = time.monotonic()
        # Set when the handshake fails; None: it succeeded or is under way.
        self.reason: str | None = None

    def closed_event(self, crew: str, reason: str) -> TunnelClosed:
        return TunnelClosed(
            crew=crew,
            tunnel_id=self.tunnel_id,
            host=self.host,
            port=self.port,
            bytes_up=self.stream.bytes_up,
            bytes_down=self.stream.bytes_down,
            duration=round(time.monotonic() - self.started, 6),
            reason=self.reason or reason,
        )


async def serve_terminated(conn: ClientConnection, plan: TerminateTunnel) -> bool:
    """Answer the CONNECT and do the handshake; True: the connection goes on reading requests,
    now from the tunnel (`conn.stream` and `conn.tunnel` are set). False: it ends (the
    handshake failed; the tunnel's reason says why)."""
    runtime, crew = conn.runtime, conn.crew
    # Read in the same step as the plan (no await between): the leaf the plan was made for.
    context = crew.leaves[plan.host]
    runtime.tunnel_ids += 1
    assert conn.progress is not None
    conn.progress.body_consumed = True
    conn.emit_allowed(status=200)
    # No upstream is dialled for the tunnel itself (each request inside dials its own, checked
    # as any): its address is "".
    conn.emit(
        TunnelOpened(
            crew=crew.name, tunnel_id=runtime.tunnel_ids, host=plan.host, port=plan.port, address=""
        )
    )
    plain = conn.stream
    prefix = bytes(conn.buffer)
    conn.buffer.clear()
    stream = TerminatedStream(plain, context, prefix)
    tunnel = conn.terminated = TerminatedTunnel(runtime.tunnel_ids, plan.host, plan.port, stream)
    conn.response_started = True
    if conn.transparent is None:  # a captured connection asked for no tunnel
        await plain.send_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
    # The handshake is held to the head timeout, as a request head is: a client that stalls
    # in it is cut (the reaper cancels the connection; `tunnel_closed` says "head timeout").
    conn.phase = Phase.HEAD
    conn.deadline = time.monotonic() + conn.limits.head_timeout
    try:
        await stream.handshake()
    except HandshakeFailed as failed:
        tunnel.reason = failed.reason
        return False
    except trio.BrokenResourceError as exc:
        tunnel.reason = f"agent_reset: {exc}"
        return False
    conn.deadline = math.inf
    conn.stream = stream
    conn.tunnel = (plan.host, plan.port)
    return True
