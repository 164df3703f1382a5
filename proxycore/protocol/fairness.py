"""Fair shares of a worker between crews: paced requests and connections under contention.

Theory of operation
-------------------
One worker serves every crew on one core. A crew that floods it (thousands of refused requests
a second, tunnels opened and reset in a loop) would otherwise fill every pass of the scheduler
with its own tasks, and another crew's request would wait behind all of them: the proxy would
stay up, but not for the others. So while more than one crew is active, each crew's new
requests and new connections are paced by a generic cell rate algorithm (`Pacer`, GCRA as in
ATM's traffic policing and Envoy's and nginx's rate limits): a crew may start `rate` a second,
with bursts of `burst`. A request over its crew's pace waits (asleep, costing nothing) until its
turn, up to `max_wait`; beyond that it is refused with 429. A connection over its crew's pace
stays in the kernel's backlog of that crew's own listening socket until its turn.

Work-conserving: a crew alone on a worker is never paced (`Activity.contended` is false), so one
busy crew still gets the whole core. "Active" means a request started within the last
`CONTENTION_WINDOW` seconds; tracking the two crews seen last is enough to tell whether another
crew than this one is active, in constant time per request.

Pure: time is a parameter (`now`, monotonic seconds); nothing here sleeps.
"""

from __future__ import annotations

__all__ = ["CONTENTION_WINDOW", "Activity", "Pacer"]

CONTENTION_WINDOW = 0.5


class Pacer:
    """GCRA: admits one event every 1/rate seconds on average, `burst` ahead of that at most.

    `delay(now)` says how long the next event must wait for its turn and books that turn (the
    caller waits that long, then proceeds); a wait longer than `max_wait` books nothing and
    returns it, for the caller to refuse instead.
    """

    __slots__ = ("_interval", "_tat", "_tolerance", "max_wait")

    def __init__(self, rate: float, burst: int, max_wait: float) -> None:
        self._interval = 1.0 / rate
        # The theoretical arrival time of the next event; up to `burst` intervals early is fine.
        self._tolerance = burst * self._interval
        self._tat = 0.0
        self.max_wait = max_wait

    def delay(self, now: float) -> float:
        tat = self._tat if self._tat > now else now
        wait = tat - self._tolerance - now
        if wait <= 0.0:
            self._tat = tat + self._interval
            return 0.0
        if wait > self.max_wait:
            return wait  # not booked: refused
        self._tat = tat + self._interval
        return wait


class Activity:
    """Which crews started requests lately: enough to tell whether a crew has company."""

    __slots__ = ("_first", "_first_at", "_second", "_second_at")

    def __init__(self) -> None:
        self._first = ""
        self._first_at = -1e9
        self._second = ""
        self._second_at = -1e9

    def note(self, crew: str, now: float) -> None:
        """`crew` started a request at `now`."""
        if crew == self._first:
            self._first_at = now
        else:
            self._second, self._second_at = self._first, self._first_at
            self._first, self._first_at = crew, now

    def contended(self, crew: str, now: float) -> bool:
        """True if a crew other than `crew` started a request in the last window."""
        other_at = self._second_at if crew == self._first else self._first_at
        return other_at > now - CONTENTION_WINDOW
