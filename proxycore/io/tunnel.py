"""Opaque CONNECT tunnels: relay bytes both ways with half-close, an idle timeout and counts.

Theory of operation: a tunnel carries TLS the proxy cannot read and must not touch, so each
direction moves bytes kernel-to-kernel with `splice(2)` through a pipe (socket -> pipe -> socket)
and never builds a Python object per chunk. trio tells us when a socket is readable or writable;
the splices themselves are non-blocking. When one side sends EOF we shut down the write half of
the other (TCP half-close, RFC 9293 3.6) and keep relaying the other direction until it ends too.
Any activity in either direction pushes back the idle deadline. Where `os.splice` is missing the
same state machine runs with `recv_into`/`send` on a large buffer.
"""

from __future__ import annotations

import fcntl
import os
import socket
from dataclasses import dataclass

import trio

from proxycore.io.fastio import PlainStream

_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ / F_GETPIPE_SZ, missing from older Python builds
_F_GETPIPE_SZ = 1032
PIPE_SIZE = 1 << 20
CHUNK = 1 << 20
HAVE_SPLICE = hasattr(os, "splice")


@dataclass(slots=True)
class TunnelStats:
    bytes_up: int = 0  # agent -> upstream
    bytes_down: int = 0  # upstream -> agent
    reason: str = "closed"


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
    """Relay until both directions have ended, the idle timeout fires, or a socket breaks."""
    stats = TunnelStats()
    with trio.CancelScope(deadline=trio.current_time() + idle_timeout) as scope:
        activity = _Activity(scope, idle_timeout)
        if client_prefix:
            # Bytes the agent pipelined behind its CONNECT head (e.g. a TLS ClientHello).
            await _send_all(upstream, client_prefix)
            stats.bytes_up += len(client_prefix)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, client, upstream, stats, True, activity)
                nursery.start_soon(_pump, upstream, client, stats, False, activity)
        except OSError as exc:
            stats.reason = f"error: {exc.strerror or exc}"
    if scope.cancelled_caught:
        stats.reason = "idle_timeout"
    return stats


async def _pump(
    src: socket.socket,
    dst: socket.socket,
    stats: TunnelStats,
    upward: bool,
    activity: _Activity,
) -> None:
    moved = _pump_splice if HAVE_SPLICE else _pump_copy
    await moved(src, dst, stats, upward, activity)
    # EOF from src: pass the half-close on.
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _count(stats: TunnelStats, upward: bool, n: int) -> None:
    if upward:
        stats.bytes_up += n
    else:
        stats.bytes_down += n


async def _pump_splice(
    src: socket.socket,
    dst: socket.socket,
    stats: TunnelStats,
    upward: bool,
    activity: _Activity,
) -> None:
    src_fd, dst_fd = src.fileno(), dst.fileno()
    # The pipe starts at the kernel's default size (64 KiB) and grows to PIPE_SIZE only once a
    # splice fills it: a bulk transfer wants large moves, while an idle or chatty tunnel should
    # not pin a 1 MiB buffer ring in the kernel (bench/bench_capacity.py measures this).
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    pipe_size = fcntl.fcntl(write_end, _F_GETPIPE_SZ)
    try:
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        while True:
            await trio.lowlevel.wait_readable(src_fd)
            try:
                n = os.splice(src_fd, write_end, CHUNK, flags=flags)
            except BlockingIOError:
                continue
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
    source, sink = PlainStream(src), PlainStream(dst)
    while True:
        data = await source.receive(CHUNK)
        if not data:
            return
        activity.touch()
        await sink.send_all(data)
        _count(stats, upward, len(data))
        activity.touch()


async def _send_all(sock: socket.socket, data: bytes) -> None:
    await PlainStream(sock).send_all(data)
