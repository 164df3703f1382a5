"""CONNECT tunnels: open one for an agent, and relay its opaque bytes both ways.

`serve_tunnel` runs an `OpenTunnel` plan on an agent connection: resolve, check every address,
dial within the crew's share of upstream connections, answer 200, relay, and record the tunnel
(`tunnel_opened` and, whatever ends it, `tunnel_closed` with its counts and cause).

Theory of operation: a tunnel carries TLS the proxy cannot read and must not touch, so each
direction moves bytes kernel-to-kernel with `splice(2)` through a pipe (socket -> pipe -> socket)
and never builds a Python object per chunk. trio tells us when a socket is readable or writable;
the splices themselves are non-blocking. When one side sends EOF we shut down the write half of
the other (TCP half-close, RFC 9293 3.6) and keep relaying the other direction until it ends too.
Any activity in either direction pushes back the idle deadline. Where `os.splice` is missing the
same state machine runs with `recv_into`/`send` on a large buffer.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from proxycore.errors import PolicyDenied, UpstreamError
from proxycore.io.progress import Phase, Refused, upstream_refusal
from proxycore.protocol.events import TunnelClosed, TunnelOpened
from proxycore.protocol.plans import OpenTunnel

if TYPE_CHECKING:
    from proxycore.io.connection import ClientConnection

_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ / F_GETPIPE_SZ, missing from older Python builds
_F_GETPIPE_SZ = 1032
PIPE_SIZE = 1 << 20
CHUNK = 1 << 20
# The copy fallback's buffer (one per direction, only while a tunnel copies).
COPY_CHUNK = 256 * 1024
HAVE_SPLICE = hasattr(os, "splice")


@dataclass(slots=True)
class TunnelStats:
    bytes_up: int = 0  # agent -> upstream
    bytes_down: int = 0  # upstream -> agent
    # "closed" (both sides ended), "idle_timeout", "agent_reset", "upstream_reset",
    # "agent_error: ...", "upstream_error: ..."; set by the first failure.
    reason: str = "closed"


class _SideFailed(Exception):
    """A socket operation on one side of the tunnel failed (never escapes this module)."""

    def __init__(self, side: str, exc: OSError) -> None:
        super().__init__(side)
        self.side = side
        self.exc = exc

    def reason(self) -> str:
        if self.exc.errno in (errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED):
            return f"{self.side}_reset"
        return f"{self.side}_error: {self.exc.strerror or self.exc}"


class _Activity:
    __slots__ = ("deadline_scope", "idle")

    def __init__(self, scope: trio.CancelScope, idle: float) -> None:
        self.deadline_scope = scope
        self.idle = idle

    def touch(self) -> None:
        self.deadline_scope.deadline = trio.current_time() + self.idle


async def relay(
    client: socket.socket,
    upstream: socket.socket,
    *,
    client_prefix: bytes,
    idle_timeout: float,
) -> TunnelStats:
    """Relay until both directions have ended, the idle timeout fires, or a socket breaks.

    Never raises for what a peer does (a reset, a broken pipe, a half-open peer): the first
    failure ends both directions and is the tunnel's `reason`. Only cancellation from outside
    propagates.
    """
    stats = TunnelStats()
    with trio.CancelScope(deadline=trio.current_time() + idle_timeout) as scope:
        activity = _Activity(scope, idle_timeout)
        try:
            if client_prefix:
                # Bytes the agent pipelined behind its CONNECT head (e.g. a TLS ClientHello).
                await _send_all(upstream, client_prefix, "upstream")
                stats.bytes_up += len(client_prefix)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, client, upstream, stats, True, activity, nursery)
                nursery.start_soon(_pump, upstream, client, stats, False, activity, nursery)
        except _SideFailed as failed:
            stats.reason = failed.reason()
    if scope.cancelled_caught:
        stats.reason = "idle_timeout"
    return stats


async def _pump(
    src: socket.socket,
    dst: socket.socket,
    stats: TunnelStats,
    upward: bool,
    activity: _Activity,
    nursery: trio.Nursery,
) -> None:
    try:
        if HAVE_SPLICE:
            await _pump_splice(src, dst, stats, upward, activity)
        else:
            await _pump_copy(src, dst, stats, upward, activity)
    except _SideFailed as failed:
        # The first failure names the tunnel's end; the other direction cannot go on.
        if stats.reason == "closed":
            stats.reason = failed.reason()
        nursery.cancel_scope.cancel()
        return
    # EOF from src: pass the half-close on (RFC 9293 3.6).
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _count(stats: TunnelStats, upward: bool, n: int) -> None:
    if upward:
        stats.bytes_up += n
    else:
        stats.bytes_down += n


def _sides(upward: bool) -> tuple[str, str]:
    """(the side read from, the side written to)."""
    return ("agent", "upstream") if upward else ("upstream", "agent")


async def _pump_splice(
    src: socket.socket,
    dst: socket.socket,
    stats: TunnelStats,
    upward: bool,
    activity: _Activity,
) -> None:
    src_fd, dst_fd = src.fileno(), dst.fileno()
    reader, writer = _sides(upward)
    # The pipe starts at the kernel's default size (64 KiB) and grows to PIPE_SIZE only once a
    # splice fills it: a bulk transfer wants large moves, while an idle or chatty tunnel should
    # not pin a 1 MiB buffer ring in the kernel (bench/bench_capacity.py measures this).
    try:
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        # Out of descriptors (two per direction): copying needs none.
        await _pump_copy(src, dst, stats, upward, activity)
        return
    pipe_size = fcntl.fcntl(write_end, _F_GETPIPE_SZ)
    try:
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        while True:
            await trio.lowlevel.wait_readable(src_fd)
            try:
                n = os.splice(src_fd, write_end, CHUNK, flags=flags)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise _SideFailed(reader, exc) from None
            if n == 0:
                return
            activity.touch()
            if n >= pipe_size and pipe_size < PIPE_SIZE:
                try:
                    pipe_size = fcntl.fcntl(write_end, _F_SETPIPE_SZ, PIPE_SIZE)
                except OSError:
                    pipe_size = PIPE_SIZE  # capped by /proc/sys/fs/pipe-max-size: keep going
            pending = n
            while pending:
                try:
                    pending -= os.splice(read_end, dst_fd, pending, flags=flags)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(dst_fd)
                except OSError as exc:
                    raise _SideFailed(writer, exc) from None
            _count(stats, upward, n)
            activity.touch()
    finally:
        os.close(read_end)
        os.close(write_end)


async def _pump_copy(
    src: socket.socket,
    dst: socket.socket,
    stats: TunnelStats,
    upward: bool,
    activity: _Activity,
) -> None:
    reader, writer = _sides(upward)
    buffer = bytearray(COPY_CHUNK)
    view = memoryview(buffer)
    while True:
        await trio.lowlevel.wait_readable(src)
        try:
            n = src.recv_into(buffer)
        except BlockingIOError:
            continue
        except OSError as exc:
            raise _SideFailed(reader, exc) from None
        if n == 0:
            return
        activity.touch()
        await _send_all(dst, view[:n], writer)
        _count(stats, upward, n)
        activity.touch()


async def _send_all(sock: socket.socket, data: bytes | memoryview, side: str) -> None:
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        except OSError as exc:
            raise _SideFailed(side, exc) from None
        view = view[sent:]


# -- the CONNECT exchange -----------------------------------------------------------------------


async def serve_tunnel(conn: ClientConnection, plan: OpenTunnel) -> None:
    runtime, crew = conn.runtime, conn.crew
    request = plan.request
    dialer = runtime.dialer
    host, port = plan.host, plan.port
    try:
        addresses = await dialer.resolve(host, port, crew.lookups, crew.guard)
        upstreams = dialer.reserve(crew.name)
    except PolicyDenied as exc:
        raise Refused(request.denied(exc.rule, str(exc), close=True)) from None
    except UpstreamError as exc:
        raise Refused(upstream_refusal(request, exc, close=True)) from None
    try:
        try:
            sock = await dialer.connect_checked(addresses, port, host)
        except UpstreamError as exc:
            raise Refused(upstream_refusal(request, exc, close=True)) from None
        try:
            await _relay_tunnel(conn, plan, sock)
        finally:
            trio.lowlevel.notify_closing(sock)
            sock.close()
    finally:
        upstreams.open -= 1


async def _relay_tunnel(conn: ClientConnection, plan: OpenTunnel, sock: socket.socket) -> None:
    runtime, crew = conn.runtime, conn.crew
    runtime.tunnel_ids += 1
    tunnel_id = runtime.tunnel_ids
    address = str(sock.getpeername()[0])
    assert conn.progress is not None
    conn.progress.address = address
    conn.progress.body_consumed = True
    conn.emit_allowed(status=200)
    conn.emit(
        TunnelOpened(
            crew=crew.name,
            tunnel_id=tunnel_id,
            host=plan.host,
            port=plan.port,
            address=address,
        )
    )
    started = time.monotonic()
    stats = TunnelStats(reason="error")
    try:
        conn.response_started = True
        if conn.transparent is None:  # a captured connection asked for no tunnel
            await conn.stream.send_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        prefix = bytes(conn.buffer)
        conn.buffer.clear()
        # The tunnel has its own idle deadline; lift the connection's.
        conn.phase = Phase.RELAY
        conn.deadline = math.inf
        stats = await relay(
            conn.stream.sock,
            sock,
            client_prefix=prefix,
            idle_timeout=conn.limits.tunnel_idle_timeout,
        )
    except trio.BrokenResourceError as exc:
        stats.reason = f"agent_reset: {exc}"
    finally:
        if conn.ended_by is not None:
            stats.reason = conn.ended_by
        conn.emit(
            TunnelClosed(
                crew=crew.name,
                tunnel_id=tunnel_id,
                host=plan.host,
                port=plan.port,
                bytes_up=stats.bytes_up,
                bytes_down=stats.bytes_down,
                duration=round(time.monotonic() - started, 6),
                reason=stats.reason,
            )
        )
