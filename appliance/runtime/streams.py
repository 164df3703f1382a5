"""Cutting a process's output into lines, per stream, with a bound on what is held.

Shared by both providers: chunks arrive as the engine or the pipe delivers them (a line may be
split across chunks, a chunk may hold many lines); `LineSplitter` yields whole lines in order and
keeps the unfinished tail of each stream separately. A "line" longer than `MAX_LINE` is emitted
in pieces of that size rather than held (an agent printing a 1 GB line must not exhaust the
daemon's memory).
"""

from __future__ import annotations

from .base import ExecOutput

MAX_LINE = 64 * 1024


class LineSplitter:
    def __init__(self, max_line: int = MAX_LINE) -> None:
        self.max_line = max_line
        self._pending: dict[str, bytearray] = {}

    def feed(self, stream: str, data: bytes) -> list[ExecOutput]:
        pending = self._pending.setdefault(stream, bytearray())
        pending += data
        out: list[ExecOutput] = []
        start = 0
        while True:
            newline = pending.find(b"\n", start)
            if newline == -1 or newline - start >= self.max_line:
                if len(pending) - start >= self.max_line:
                    out.append(ExecOutput(stream, bytes(pending[start : start + self.max_line])))
                    start += self.max_line
                    continue
                break
            out.append(ExecOutput(stream, bytes(pending[start : newline + 1])))
            start = newline + 1
        del pending[:start]
        return out

    def flush(self) -> list[ExecOutput]:
        """The unfinished last line of each stream (without its newline), stdout first."""
        out = [
            ExecOutput(stream, bytes(self._pending[stream]))
            for stream in sorted(self._pending, key=lambda name: name != "stdout")
            if self._pending[stream]
        ]
        self._pending.clear()
        return out
