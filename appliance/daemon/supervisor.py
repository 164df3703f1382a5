"""How applianced restarts a proxy worker that exited, and what it records about the exit.

Theory of operation
-------------------
Each worker has its own supervisor loop (`ProxyPool._supervise`): start, serve, exit, wait,
start again. The wait is an exponential backoff per worker (`RestartPolicy`): the first restart
after `first` seconds, each further one twice as long, never longer than `cap`; a worker that
stayed up `stable` seconds has its count of short lives reset, so its next crash waits `first`
again. Each wait is drawn from [(1 - jitter) x nominal, nominal].

Why these numbers (the defaults):

- `first` 0.5 s: one crash costs its share of the crews' new connections half a second (they
  wait in the listeners' backlog, which applianced holds, or go to the other workers); quicker
  than the fixed 1 s it replaces.
- doubling to `cap` 30 s: a worker that dies at once every time (a crew that crashes it on every
  request, a credential it cannot load) is started at most twice a minute once the backoff has
  grown, so its restore (every crew, every key, under the pool's lock, which holds every policy
  change meanwhile), its process start (~0.3 s of a core) and its journal entries stay bounded.
  30 s is also how long the operator waits at worst after removing the cause (`crew rm`, `cred
  revoke`) before the worker is back: shorter than anyone reaching for `appliancectl status`.
- `stable` 60 s: twice the cap, so a worker crashing at the capped rate never looks stable; a
  minute of serving is a worker that works.
- jitter 25 %: workers killed by one cause at once (every worker took the same poisoned
  request) come back at different moments, not all into the same next request at once.

Backoff does not keep other crews served; containment does (a connection's failure ends that
connection only). What backoff keeps bounded is the cost of a worker that cannot stay up.

An exit is recorded as a `WorkerExit`: the exit status or the signal's name, whether applianced
killed the worker itself and why (`_Worker.kill`), and the last lines the worker wrote on its
standard error. applianced reads that through a pipe and logs each line as a record of its own
(appliance/logs.py `WorkerLog`: the worker writes JSON records, applianced writes them in the
operator's format), keeping the last `TAIL_LINES` messages. Every line, logged or kept, passes
through the scrubber applianced's journal uses (every stored credential and the default secret
shapes): a traceback that quoted a key never reaches a log, the journal (`proxy.worker_exited`)
or `appliancectl status` with it.
"""

from __future__ import annotations

import collections
import random
import signal
from collections.abc import Callable
from typing import Protocol, TextIO

import msgspec
import trio

TAIL_LINES = 20
# A line longer than this is cut (logged as its first LINE_BYTES bytes, then "..."): room for a
# JSON record with a traceback.
LINE_BYTES = 64 * 1024
# What the tail keeps of a line (status and the journal show it): its first TAIL_CHARS, "...".
TAIL_CHARS = 1024


class RestartPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The backoff between a worker's exit and its next start (see the module's docstring)."""

    first: float = 0.5
    cap: float = 30.0
    stable: float = 60.0
    jitter: float = 0.25

    def delay(self, failures: int, rng: random.Random) -> float:
        """The wait before the next start after `failures` short lives in a row (>= 1)."""
        # 2**62 is far past any cap; bounding the exponent keeps the float conversion finite.
        nominal = min(self.cap, self.first * 2.0 ** min(max(failures, 1) - 1, 62))
        return nominal * (1.0 - self.jitter * rng.random())


class WorkerExit(msgspec.Struct, frozen=True):
    """One exit of one worker, as applianced saw it. Never holds a credential: `killed_by` is
    applianced's own words, `stderr_tail` went through the scrubber."""

    worker: int
    pid: int
    ts: float  # wall-clock time of the exit as seen by applianced
    uptime: float  # seconds from its start to its exit
    exit_code: int | None  # the status it exited with, or None if a signal ended it
    signal: str | None  # SIGKILL, SIGSEGV...: the signal that ended it
    killed_by: str | None  # applianced killed it itself, for this reason
    stderr_tail: tuple[str, ...]
    restarts: int  # this worker's exits so far, this one included
    restart_in: float  # the backoff before its next start

    @property
    def reason(self) -> str:
        return describe_exit(self.exit_code, self.signal, self.killed_by)


def describe_exit(exit_code: int | None, signal_name: str | None, killed_by: str | None) -> str:
    """Why a worker exited, in the words `status` and the journal use."""
    if killed_by is not None:
        how = signal_name or f"status {exit_code}"
        return f"killed by applianced ({how}): {killed_by}"
    if signal_name is not None:
        return f"killed by {signal_name}"
    return f"exited with status {exit_code}"


def exit_status(returncode: int) -> tuple[int | None, str | None]:
    """(exit_code, signal name) from a Popen-style return code (negative: the signal)."""
    if returncode >= 0:
        return returncode, None
    try:
        return None, signal.Signals(-returncode).name
    except ValueError:
        return None, f"signal {-returncode}"


class LineLogger(Protocol):
    def emit(self, line: str, *, cut: bool = False) -> str:
        """Log one raw line; returns its scrubbed text (appliance/logs.py `WorkerLog`)."""
        ...


class StderrTail:
    """A worker's standard error, fed as it arrives: each complete line is scrubbed, logged
    (`records`) or printed to `relay`, and kept (the last `lines`). Bounded: a partial line
    longer than LINE_BYTES is cut."""

    def __init__(
        self,
        scrub: Callable[[str], str],
        *,
        relay: TextIO | None = None,
        records: LineLogger | None = None,
        lines: int = TAIL_LINES,
    ) -> None:
        self.scrub = scrub
        self.relay = relay
        self.records = records
        self.lines: collections.deque[str] = collections.deque(maxlen=lines)
        self._partial = bytearray()
        self._cut = False  # dropping the rest of a line that was too long

    def feed(self, data: bytes | bytearray) -> None:
        while data:
            end = data.find(b"\n")
            piece, data = (data, b"") if end < 0 else (data[:end], data[end + 1 :])
            if not self._cut:
                room = LINE_BYTES - len(self._partial)
                self._partial += piece[:room]
                if len(piece) > room:
                    self._emit(cut=True)
                    self._cut = True
            if end >= 0:
                if not self._cut:
                    self._emit(cut=False)
                self._cut = False

    def finish(self) -> None:
        """The stream ended: a last line without its newline is a line too."""
        if self._partial and not self._cut:
            self._emit(cut=False)
        self._cut = False

    def _emit(self, *, cut: bool) -> None:
        raw = self._partial.decode("utf-8", "replace").rstrip("\r")
        self._partial.clear()
        if self.records is not None:
            text = self.records.emit(raw, cut=cut)
        else:
            text = self.scrub(raw) + ("..." if cut else "")
        self.lines.append(text if len(text) <= TAIL_CHARS else text[:TAIL_CHARS] + "...")
        if self.relay is not None:
            try:
                print(text, file=self.relay, flush=True)
            except (OSError, ValueError):  # applianced's own stderr is gone: keep the tail
                self.relay = None

    def tail(self) -> tuple[str, ...]:
        return tuple(self.lines)


async def read_stderr(scope: trio.CancelScope, process: trio.Process, tail: StderrTail) -> None:
    """Feed `tail` from the worker's stderr pipe until EOF (it exited) or `scope` ends."""
    stream = process.stderr
    assert stream is not None
    with scope:
        async with stream:
            while True:
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    break
                tail.feed(data)
    tail.finish()


def effective_uid(pid: int) -> int | None:
    """A process's effective UID as the kernel reports it (a worker's is 0 until it drops)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None
