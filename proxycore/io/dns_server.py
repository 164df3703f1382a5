"""Serving a crew's DNS responder on the sockets applianced hands over: UDP and TCP, on trio.

Theory of operation
-------------------
applianced binds the crew's gateway port 53 as root (UDP, and a listening TCP socket) and gives
the sockets to a `DnsServer` built around the crew's `DnsResponder` (the sans-IO decisions,
proxycore/protocol/dns_responder.py), an async `resolve(name)` (the proxy's resolver:
`proxy_resolve`) and an async `before_answer(crew, addresses, ttl)` hook (the place for a kernel
set of answered addresses; the appliance's workers pass one that does nothing, since an answer
opens nothing there: docs/proxy.md "DNS"). `serve` runs until
cancelled; removing a crew is cancelling its scope and closing its sockets.

UDP: one task reads datagrams as long as the socket has any and answers what the responder
answers at once (a cache hit, a refusal) inline, without a task or a trio wrapper per datagram:
that loop is the server's throughput. A query that needs resolving gets a task of its own,
at most `max_resolving` at once (past that: SERVFAIL), which resolves, awaits the hook, then
answers; the cache remembers the answer only once the hook has taken its addresses.

TCP (RFC 7766 §6.2, §8): each message is preceded by its length in two octets; a length over
the responder's `MAX_QUERY` closes the connection; queries on one connection are answered in
order; a connection idle (or dribbling one message) for `tcp_idle` seconds is closed; at most
`max_tcp` connections at once, a connection past that is closed as soon as it is accepted.

Failures stay with their query: an exception in the responder is a dropped query (it returns a
decision for everything, so only a bug gets there), a failed resolution or hook is SERVFAIL for
that query, a send that fails is that answer lost. The server itself ends only when cancelled.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence

import trio

from proxycore.io.dns import Resolver
from proxycore.protocol.dns_responder import (
    MAX_QUERY,
    DnsRefusal,
    DnsResponder,
    Resolution,
    Verdict,
)

__all__ = ["BeforeAnswer", "DnsServer", "Journal", "Resolve", "proxy_resolve"]

log = logging.getLogger("proxycore.dns")

Resolve = Callable[[str], Awaitable[Sequence[str]]]
BeforeAnswer = Callable[[str, Sequence[str], int], Awaitable[None]]
Journal = Callable[[DnsRefusal], None]

# How much of a datagram we read: one octet more than the longest query we answer, so that a
# longer datagram, truncated by the kernel to this, is still seen as too long and dropped (never
# answered as the shorter query it was cut to). Reading 64 KiB instead costs an allocation of
# that size per datagram.
_DATAGRAM = MAX_QUERY + 1


def proxy_resolve(resolver: Resolver, limiter: trio.CapacityLimiter) -> Resolve:
    """`resolve` through the proxy's resolver (its split-horizon table, nameservers, timeout),
    under the crew's lookup limiter, so that the crew's DNS and its proxy share one budget."""

    async def resolve(name: str) -> Sequence[str]:
        return await resolver.resolve(name, 443, limiter)

    return resolve


class DnsServer:
    def __init__(
        self,
        responder: DnsResponder,
        *,
        resolve: Resolve,
        before_answer: BeforeAnswer,
        journal: Journal,
        resolve_timeout: float = 5.0,
        max_resolving: int = 32,
        max_tcp: int = 16,
        tcp_idle: float = 10.0,
    ) -> None:
        self.responder = responder
        self.crew = responder.crew
        self._resolve = resolve
        self._before_answer = before_answer
        self._journal = journal
        self.resolve_timeout = resolve_timeout
        self.max_resolving = max_resolving
        self.max_tcp = max_tcp
        self.tcp_idle = tcp_idle
        self._resolving = 0
        self._tcp = 0

    async def serve(
        self,
        udp: socket.socket | None,
        tcp: socket.socket | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve the given sockets until cancelled. The sockets stay the caller's to close."""
        async with trio.open_nursery() as nursery:
            if udp is not None:
                udp.setblocking(False)
                nursery.start_soon(self._serve_udp, udp, nursery)
            if tcp is not None:
                nursery.start_soon(self._serve_tcp, trio.socket.from_stdlib_socket(tcp), nursery)
            task_status.started()

    # -- UDP -------------------------------------------------------------------------------

    async def _serve_udp(self, sock: socket.socket, nursery: trio.Nursery) -> None:
        handle = self.responder.handle
        recvfrom = sock.recvfrom
        sendto = sock.sendto
        answer, resolve = Verdict.ANSWER, Verdict.RESOLVE
        while True:
            await trio.lowlevel.wait_readable(sock)
            # Drain what is queued before waiting again: one wakeup, many datagrams. One clock
            # reading per batch: a batch takes about a millisecond, TTLs are seconds.
            now = trio.current_time()
            for _ in range(256):
                try:
                    data, peer = recvfrom(_DATAGRAM)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    # An ICMP error from an earlier send surfaces on the next receive (Linux):
                    # it is about that peer, not this socket.
                    continue
                verdict, wire, resolution, journal = handle(data, now)
                if journal is not None:
                    self._record(journal)
                if verdict is answer:
                    try:
                        sendto(wire, peer)
                    except OSError:
                        # A full buffer, or an ICMP error queued from an earlier send: that
                        # answer is lost (the client retries), the server goes on.
                        pass
                elif verdict is resolve:
                    assert resolution is not None
                    nursery.start_soon(self._resolve_udp, sock, peer, resolution)
            else:
                # 256 datagrams and still more: let resolutions and TCP run before the next.
                await trio.lowlevel.checkpoint()

    async def _resolve_udp(
        self, sock: socket.socket, peer: tuple[str, int], resolution: Resolution
    ) -> None:
        wire = await self._answer(resolution)
        try:
            sock.sendto(wire, peer)
        except BlockingIOError:
            try:
                await trio.lowlevel.wait_writable(sock)
                sock.sendto(wire, peer)
            except OSError:
                pass
        except OSError:
            pass

    # -- TCP -------------------------------------------------------------------------------

    async def _serve_tcp(self, listener: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        while True:
            try:
                conn, _ = await listener.accept()
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: wait rather than spin, the query is the
                    # client's to retry.
                    log.warning("dns %s: accept failed: %s", self.crew, exc)
                    await trio.sleep(0.1)
                continue
            if self._tcp >= self.max_tcp:
                conn.close()
                continue
            self._tcp += 1
            nursery.start_soon(self._tcp_connection, conn)

    async def _tcp_connection(self, conn: trio.socket.SocketType) -> None:
        try:
            with conn:
                buffer = bytearray()
                while True:
                    message: bytes | None = None
                    with trio.move_on_after(self.tcp_idle):
                        message = await self._read_message(conn, buffer)
                    if message is None:
                        return
                    decision = self.responder.handle(message, trio.current_time())
                    if decision.journal is not None:
                        self._record(decision.journal)
                    if decision.verdict is Verdict.DROP:
                        # Over UDP a dropped query costs the client a timeout; over TCP it
                        # would stall every query pipelined behind it. Close instead.
                        return
                    if decision.verdict is Verdict.RESOLVE:
                        assert decision.resolution is not None
                        wire = await self._answer(decision.resolution)
                    else:
                        wire = decision.wire
                    with trio.move_on_after(self.tcp_idle) as scope:
                        await _send_all(conn, struct.pack(">H", len(wire)) + wire)
                    if scope.cancelled_caught:
                        return
        except OSError:
            return
        finally:
            self._tcp -= 1

    @staticmethod
    async def _read_message(conn: trio.socket.SocketType, buffer: bytearray) -> bytes | None:
        """The next length-prefixed message, or None at EOF or on a length over MAX_QUERY."""
        while True:
            if len(buffer) >= 2:
                length = buffer[0] << 8 | buffer[1]
                if length > MAX_QUERY:
                    return None
                if len(buffer) >= 2 + length:
                    message = bytes(buffer[2 : 2 + length])
                    del buffer[: 2 + length]
                    return message
            chunk = await conn.recv(MAX_QUERY + 2)
            if not chunk:
                return None
            buffer += chunk
            # Bounded: a complete message is taken out before more is read, and a message is
            # at most MAX_QUERY + 2 octets, so the buffer never holds more than two reads.

    # -- both ------------------------------------------------------------------------------

    async def _answer(self, resolution: Resolution) -> bytes:
        """Resolve, run the hook, remember; SERVFAIL if any of it fails. Never raises."""
        responder = self.responder
        if self._resolving >= self.max_resolving:
            return self._failed(resolution, "too_many_resolving")
        self._resolving += 1
        try:
            addresses: Sequence[str] | None = None
            with trio.move_on_after(self.resolve_timeout):
                try:
                    addresses = await self._resolve(resolution.name)
                except Exception as exc:
                    log.debug("dns %s: %s: %s", self.crew, resolution.name, exc)
                    return self._failed(resolution, "resolution_failed")
            if addresses is None:
                return self._failed(resolution, "resolution_timeout")
            answer = responder.resolved(resolution, addresses, trio.current_time())
            if answer.journal is not None:
                self._record(answer.journal)
            if answer.addresses:
                try:
                    await self._before_answer(self.crew, answer.addresses, answer.ttl)
                except Exception:
                    log.exception("dns %s: before_answer failed for %s", self.crew, resolution.name)
                    return self._failed(resolution, "before_answer_failed")
            responder.remember(answer, trio.current_time())
            return answer.wire
        finally:
            self._resolving -= 1

    def _failed(self, resolution: Resolution, why: str) -> bytes:
        decision = self.responder.failed(resolution, trio.current_time(), why)
        if decision.journal is not None:
            self._record(decision.journal)
        return decision.wire

    def _record(self, event: DnsRefusal) -> None:
        try:
            self._journal(event)
        except Exception:
            log.exception("dns %s: the journal refused an event", self.crew)


async def _send_all(conn: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    while view:
        sent = await conn.send(view)
        view = view[sent:]
