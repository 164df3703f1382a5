"""Sinks: carry typed events (`proxycore.protocol.events`) off the request path.

Theory of operation: an event is handed to an `EventSink` with `emit`, which never blocks and
never awaits: the request path only appends to a buffer. A sink's `run` task, owned by the
server's nursery, writes batches on a timer or when a batch is full. The journal of the control
plane plugs in as another sink (`ChannelSink`).

If the writer falls behind by more than `max_pending` events, further events are counted and
reported as one `EventsDropped` event instead of growing memory without bound; the count is never
silently lost.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import IO, Protocol

import msgspec
import trio

from proxycore.protocol.events import Event, EventsDropped


class EventSink(Protocol):
    def emit(self, event: Event) -> None:
        """Queue an event; never blocks."""

    @property
    def backlogged(self) -> bool:
        """True while events are queued faster than they are delivered: the proxy then refuses
        crew traffic (503 audit_unavailable) instead of serving requests it may not record."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver queued events until cancelled, then flush what is left."""


class NullSink:
    backlogged = False

    def emit(self, event: Event) -> None:
        pass

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()


class MemorySink:
    """Keeps events in a list (for tests and for embedding)."""

    backlogged = False

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()


class BatchingSink:
    """Queues events from `emit` and hands them, a JSON-lines batch at a time, to `_deliver`
    from the `run` task: on a timer, or at once when a batch is full."""

    def __init__(
        self,
        *,
        flush_interval: float = 0.2,
        max_batch: int = 1024,
        max_pending: int = 100_000,
    ) -> None:
        self._flush_interval = flush_interval
        self._max_batch = max_batch
        self._max_pending = max_pending
        self._pending: list[Event] = []
        self._dropped = 0
        self._encoder = msgspec.json.Encoder()
        self._wakeup = trio.Event()
        # Applied to each batch before it is written (the proxy sets the scrubber here).
        self.scrub: Callable[[bytes], bytes] | None = None

    @property
    def backlogged(self) -> bool:
        """Half the queue is full: the reader is not keeping up (see EventSink.backlogged)."""
        return len(self._pending) >= self._max_pending // 2

    def emit(self, event: Event) -> None:
        if len(self._pending) >= self._max_pending:
            self._dropped += 1
            return
        self._pending.append(event)
        if len(self._pending) >= self._max_batch:
            self._wakeup.set()

    def _take_batch(self) -> bytes | None:
        batch, self._pending = self._pending, []
        if self._dropped:
            batch.append(EventsDropped(crew="-", count=self._dropped))
            self._dropped = 0
        if not batch:
            return None
        buffer = bytearray()
        for event in batch:
            buffer += self._encoder.encode(event)
            buffer += b"\n"
        return bytes(buffer) if self.scrub is None else self.scrub(bytes(buffer))

    async def _wait_for_batch(self) -> None:
        with trio.move_on_after(self._flush_interval):
            await self._wakeup.wait()
        self._wakeup = trio.Event()


class JsonLinesSink(BatchingSink):
    """Writes one JSON object per line, in batches, to a file (or "-": standard error)."""

    def __init__(
        self,
        path: str,
        *,
        flush_interval: float = 0.2,
        max_batch: int = 1024,
        max_pending: int = 100_000,
    ) -> None:
        super().__init__(
            flush_interval=flush_interval, max_batch=max_batch, max_pending=max_pending
        )
        self._path = path

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Unbuffered: each batch is one write(2) on an O_APPEND file, so batches from several
        # worker processes never interleave inside a line.
        stream: IO[bytes] = (
            sys.stderr.buffer if self._path == "-" else open(self._path, "ab", buffering=0)  # noqa: SIM115
        )
        task_status.started()
        try:
            while True:
                await self._wait_for_batch()
                self._write_batch(stream)
        finally:
            # Cancelled (shutdown): whatever is still queued is written before we go.
            self._write_batch(stream)
            if stream is not sys.stderr.buffer:
                stream.close()

    def _write_batch(self, stream: IO[bytes]) -> None:
        data = self._take_batch()
        if data is not None:
            # A local file append of a batch is short; doing it inline keeps ordering trivial.
            stream.write(data)


class ChannelSink(BatchingSink):
    """Sends the batches over a connected stream socket: a proxy worker's events channel to
    applianced, which journals every line (appliance/journal/recorder.py).

    The worker cannot open a file in applianced's state directory (it runs as its own UID), and
    the channel gives applianced each worker's events as they are written. When applianced reads
    slower than the worker emits, `send_all` waits in this task only, the queue grows, and once
    it is half full `backlogged` tells the server to refuse crew traffic (503 audit_unavailable)
    until it drains: traffic is refused rather than left unaudited. A closed channel means
    applianced is gone: the sink reports itself `backlogged` from then on (crew traffic is
    refused, nothing can record it) and the worker stops when its control channel closes too.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        flush_interval: float = 0.05,
        max_batch: int = 1024,
        max_pending: int = 100_000,
    ) -> None:
        super().__init__(
            flush_interval=flush_interval, max_batch=max_batch, max_pending=max_pending
        )
        self._sock = sock
        self._broken = False

    @property
    def backlogged(self) -> bool:
        return self._broken or super().backlogged

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(self._sock))
        task_status.started()
        try:
            while True:
                await self._wait_for_batch()
                data = self._take_batch()
                if data is not None:
                    try:
                        await stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        # Nobody reads the events any more: refuse what cannot be recorded.
                        self._broken = True
                        await trio.sleep_forever()
        finally:
            # Cancelled (shutdown): the last batch, if the socket takes it within a second
            # (blocking here is fine: nothing else runs any more).
            data = self._take_batch()
            if data is not None:
                try:
                    self._sock.settimeout(1.0)
                    self._sock.sendall(data)
                except OSError:
                    pass
            self._sock.close()
