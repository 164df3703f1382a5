"""What the agent-side session and an upstream HTTP/2 connection share: writing queued frames.

Both hold one connection on which many streams queue frames in a sans-IO endpoint
(proxycore/protocol/http2); `OrderedWriter.flush` writes them out in the order they were queued.
The lock is held only while a write waits for the peer; while none does (the lock is free) the
kernel takes the bytes at once and no lock is taken at all (nothing awaits in between, so the
order holds). It is taken without a checkpoint: trio's `async with lock` yields while holding
it, which made every other stream wait a scheduling round, and took a round itself.
"""

from __future__ import annotations

import trio

__all__ = ["OrderedWriter"]


class OrderedWriter:
    """Base of `H2Session` (proxycore/io/http2.py) and `H2Upstream` (upstream_h2.py)."""

    lock: trio.Lock

    def _send_now(self) -> bytes:
        """Hand what the endpoint queued to the kernel without waiting; returns what it did not
        take (the caller holds the lock, or no write is waiting)."""
        raise NotImplementedError

    async def _send_rest(self, data: bytes) -> None:
        """Write `data` to the end, waiting for the peer (the caller holds the lock)."""
        raise NotImplementedError

    async def flush(self) -> None:
        """Write what the endpoint queued (see the module docstring)."""
        lock = self.lock
        if lock.locked():
            await lock.acquire()  # after the write that waits (the order of frames holds)
            try:
                rest = self._send_now()
                if rest:
                    await self._send_rest(rest)
            finally:
                lock.release()
            return
        rest = self._send_now()
        if rest:
            lock.acquire_nowait()  # free: nothing awaited since it was checked
            try:
                await self._send_rest(rest)
            finally:
                lock.release()
