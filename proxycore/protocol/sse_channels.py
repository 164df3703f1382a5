"""A text channel of the SSE layer: one scrubber stream over the concatenated texts of its
events, and where each event's text went in what the stream released (sans-IO).

Theory of operation: the events' texts are fed one call each; after each, the stream has
released (as `fed - pending` input bytes) a scrubbed output. Each release maps its input onto
its output (`segment_map`): one to one where they are equal, and where the scrubber redacted,
one to one before the first marker and after the last, the changed middle given to the event
where it starts (that event carries `[REDACTED:<name>]`, events wholly inside it an empty
text). An event's new text is the output between the mapped end of the event before it and the
mapped end of its own text, so the texts of the events, joined, are exactly the stream's
output, whichever way a release is split: the SDK that joins them reads the scrubbed text.
Where the stream releases depends only on the texts fed (one call per event), never on how
the body was cut into reads, so neither does the output.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from native.scrub import ScrubStream
from proxycore.protocol.scrubbing import MARKER

__all__ = ["Channel", "Slot", "segment_map"]


def _common(a: bytes, b: bytes, limit: int, part: Callable[[bytes, int], bytes]) -> int:
    """The longest n <= limit with part(a, n) == part(b, n) (a common prefix or suffix), by
    bisection: comparisons in C, so a long text with a redaction costs no Python loop per byte."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if part(a, mid) == part(b, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def segment_map(seg_in: bytes, seg_out: bytes) -> Callable[[int], int]:
    """Map a position in `seg_in` (one release of a channel's stream) to one in `seg_out` (what
    the scrubber released for it): one to one before the first change and after the last, the
    changed middle to its end (so the event where a redaction starts carries it whole)."""
    if seg_in == seg_out:
        return lambda x: x
    n_in, n_out = len(seg_in), len(seg_out)
    c = _common(seg_in, seg_out, min(n_in, n_out), lambda b, n: b[:n])
    first = seg_out.find(MARKER)
    if 0 <= first < c:
        c = first
    while 0 < c < n_out and seg_out[c] & 0xC0 == 0x80:  # not inside a UTF-8 character
        c -= 1
    last = seg_out.rfind(MARKER)
    tail_floor = c
    if last >= 0:
        close = seg_out.find(b"]", last)
        tail_floor = max(c, n_out if close < 0 else close + 1)
    s_limit = min(n_in - c, n_out - tail_floor)
    s = _common(seg_in, seg_out, s_limit, lambda b, n: b[len(b) - n :])
    while s > 0 and seg_out[n_out - s] & 0xC0 == 0x80:
        s -= 1
    middle_end_in, middle_end_out = n_in - s, n_out - s

    def position(x: int) -> int:
        if x == n_in:  # the end of the release is the end of its output, always
            return n_out
        if x <= c:
            return x
        if x >= middle_end_in:
            return x - n_in + n_out
        return middle_end_out

    return position


class Slot:
    """One text of one event in one channel: where to write it back, and what it became."""

    __slots__ = ("container", "end", "field", "new", "old")

    def __init__(self, container: Any, field: Any, old: bytes) -> None:
        self.container = container
        self.field = field
        self.old = old
        self.end = 0  # the channel's input offset just after this text
        self.new: bytes | None = None  # the scrubbed text, once the channel released it


class Channel:
    """One concatenated text and its scrubber stream; maps what it releases onto its slots."""

    __slots__ = ("batch", "fed", "inp", "out", "released", "stream", "waiting")

    def __init__(self, stream: ScrubStream) -> None:
        self.stream = stream
        self.fed = 0
        self.released = 0
        self.inp = bytearray()  # input from `released` to `fed` (what the stream holds)
        self.out = bytearray()  # output not yet given to a slot
        self.waiting: deque[Slot] = deque()
        self.batch: list[Slot] = []  # slots added since the last `settle`

    def settle(self) -> None:
        """Feed the texts added, one call each: where the stream releases then depends only on
        the events, never on how the body was cut into reads (so neither does the output)."""
        batch = self.batch
        if not batch:
            return
        self.batch = []
        stream = self.stream
        for slot in batch:
            text = slot.old
            out = b""
            if text:
                self.inp += text
                self.fed += len(text)
                out = stream.feed(text)
            slot.end = self.fed
            self.waiting.append(slot)
            self._release(out, self.fed - stream.pending)

    def close(self) -> None:
        self.settle()
        self._release(self.stream.flush(), self.fed)
        if self.out and not self.waiting:  # cannot happen: the last slot ends at `fed`
            raise AssertionError("scrubbed text left without an event")

    def _release(self, out: bytes, released: int) -> None:
        n = released - self.released
        seg_in = bytes(self.inp[:n])
        del self.inp[:n]
        position = segment_map(seg_in, out)
        base = len(self.out)
        self.out += out
        waiting = self.waiting
        while waiting and waiting[0].end <= released:
            slot = waiting.popleft()
            upto = base + position(slot.end - self.released)
            slot.new = bytes(self.out[:upto])
            del self.out[:upto]
            base -= upto
        self.released = released
