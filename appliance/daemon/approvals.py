"""Run-time approvals: a host a crew is refused becomes a request the operator answers.

Theory of operation
-------------------
A restricted crew's request to a host outside its allowlist is refused by the proxy (403,
rule `not_in_allowlist`); with approvals on, the refusal tells the agent that an approval
request is pending, for how long, and what the operator runs (proxycore/protocol/exchange.py).
The refusal's `request_denied` event reaches applianced through the journal's ingest
(`JournalRecorder.on_refused`), and `ApprovalBook.note` files a pending request for (crew, host),
or refreshes it: first and last seen, a count, and an end `window` seconds after the last
refusal. A new request is journaled once (`approval.requested`), never per refusal.

The operator answers with `appliancectl approvals` (appliance/ctl/approvals.py):

    allow          the crew's allowlist, as `crew allow` (persisted in the crew's row)
    allow --once   a grant until a wall-clock time: the crew's whole set of grants and denials
                   goes to every worker in one `crew_approvals` message (applied all or
                   nothing); the worker compares the end with its own clock at each decision,
                   so a grant ends on time even if applianced is slow or gone
    deny           the pending request is dropped and the host refused for `window` seconds
                   without a new request being filed (the refusal says "denied")

Nothing is let through without an answer (deny by default), and an answer is never needed for
a host the allowlist already holds. Grants and denials are rows of the state's `approvals`
table, written before the workers are told: a worker that restarts gets its crews' sets with
its crews (`ProxyPool.approvals_source`), and so does every worker of the next applianced
(`Approvals.load` before the crews are reconciled). Pending requests live in memory only:
after a restart the crew's next refusal files its request again, and `approvals allow` does not
need one to be pending.

Bounded: `[approvals] per_crew` pending requests per crew and `total` in all (past either, the
least recently refused one is dropped, and logged); MAX_ENTRIES grants and as many denials per
crew (a grant past it is refused; the denial ending first is dropped, which can only let a new
request be filed). `ApprovalBook` does no I/O: its clock is a parameter, tests drive it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from appliance.journal import entries as E
from proxycore import control, logs
from proxycore.errors import PolicyDenied
from proxycore.protocol import events as pe
from proxycore.protocol.policy import (
    RULE_NOT_IN_ALLOWLIST,
    Allowlist,
    NetworkMode,
    normalize_host,
    parse_mode,
)

from . import messages
from .errors import CrewBusy, CrewNotFound, DaemonError, InvalidRequest, Unavailable

if TYPE_CHECKING:
    from appliance.journal.recorder import JournalRecorder

    from .config import ApprovalsSection
    from .crews import CrewManager
    from .proxy import ProxyPool
    from .state import CrewRow, StateStore

log = logging.getLogger("applianced.approvals")

# Grants (and denials) one crew may hold at once; under control.MAX_APPROVALS.
MAX_ENTRIES = 256
# The longest a long poll of `GET /v1/approvals` may wait.
MAX_WAIT = 60.0
# How often expired grants, denials and requests are swept from memory and the state.
SWEEP_INTERVAL = 5.0
ONCE, DENIED = "once", "denied"


class ApprovalNotInEffect(DaemonError):
    """Stored and journaled, but a proxy worker did not apply it; the workers that refused
    were killed and restart with the stored set (appliancectl exit 7)."""

    status = 502
    code = "not_in_effect"


@dataclass(slots=True)
class Pending:
    seq: int
    crew: str
    host: str
    port: int
    first_seen: float
    last_seen: float
    count: int

    def message(self, window: float) -> messages.ApprovalRequest:
        return messages.ApprovalRequest(
            seq=self.seq,
            crew=self.crew,
            host=self.host,
            port=self.port,
            first_seen=self.first_seen,
            last_seen=self.last_seen,
            count=self.count,
            expires=self.last_seen + window,
        )


def check_host(host: str) -> str:
    """The one spelling the proxy compares (InvalidRequest naming the argument otherwise)."""
    try:
        normalized = normalize_host(host)
        Allowlist([normalized])  # refuses IP shorthand, as every crew's allowlist does
    except (PolicyDenied, ValueError):
        raise InvalidRequest(f"argument host: not a valid host name: {host!r}") from None
    return normalized


class ApprovalBook:
    """Pending requests, grants and denials, without I/O (see the module docstring)."""

    def __init__(
        self,
        window: float,
        *,
        per_crew: int = 32,
        total: int = 1024,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.window = window
        self.per_crew = per_crew
        self.total = total
        self.clock = clock
        # crew -> host -> request; each crew's dict in order of last refusal (oldest first).
        self.pending: dict[str, dict[str, Pending]] = {}
        self.grants: dict[str, dict[str, float]] = {}
        self.denied: dict[str, dict[str, float]] = {}
        self.seq = 0
        self.count = 0  # pending requests in all

    # -- requests ---------------------------------------------------------------------------

    def note(self, crew: str, host: str, port: int) -> tuple[Pending | None, list[Pending]]:
        """A refusal of `host` to `crew`: (the request if one was filed now, else None; the
        requests dropped to make room). Nothing is filed for a host denied or granted now."""
        now = self.clock()
        if self._active(self.denied, crew, host, now) or self._active(self.grants, crew, host, now):
            return None, []
        requests = self.pending.setdefault(crew, {})
        request = requests.pop(host, None)
        if request is not None and request.last_seen + self.window > now:
            request.last_seen, request.port = now, port
            request.count += 1
            requests[host] = request  # to the end: the most recently refused
            return None, []
        if request is not None:
            self.count -= 1  # expired: filed again, as new
        self.seq += 1
        filed = Pending(self.seq, crew, host, port, now, now, 1)
        requests[host] = filed
        self.count += 1
        dropped: list[Pending] = []
        while len(requests) > self.per_crew:
            dropped.append(self._drop(crew, next(iter(requests))))
        while self.count > self.total:
            oldest = min(
                (next(iter(r.values())) for r in self.pending.values() if r),
                key=lambda p: p.last_seen,
            )
            dropped.append(self._drop(oldest.crew, oldest.host))
        return filed, dropped

    def _drop(self, crew: str, host: str) -> Pending:
        requests = self.pending[crew]
        request = requests.pop(host)
        self.count -= 1
        if not requests:
            del self.pending[crew]
        return request

    def take(self, crew: str, host: str) -> bool:
        """Drop the request for (crew, host), answered; whether there was one in force."""
        request = self.pending.get(crew, {}).get(host)
        if request is None:
            return False
        self._drop(crew, host)
        return request.last_seen + self.window > self.clock()

    def requests(self, crew: str | None = None, since: int = 0) -> list[Pending]:
        """The requests in force (filed after `since`), oldest filed first."""
        self.expire()
        found = [
            request
            for name, requests in self.pending.items()
            if crew is None or name == crew
            for request in requests.values()
            if request.seq > since
        ]
        return sorted(found, key=lambda p: p.seq)

    # -- answers ------------------------------------------------------------------------------

    @staticmethod
    def _active(table: dict[str, dict[str, float]], crew: str, host: str, now: float) -> bool:
        until = table.get(crew, {}).get(host)
        return until is not None and until > now

    def grant(self, crew: str, host: str, until: float) -> None:
        """Allow (crew, host) until `until`; CrewBusy past MAX_ENTRIES grants."""
        self.expire()
        grants = self.grants.setdefault(crew, {})
        if host not in grants and len(grants) >= MAX_ENTRIES:
            raise CrewBusy(
                f"crew {crew!r} holds {MAX_ENTRIES} temporary grants already: allow the host "
                "permanently, or wait for one to end"
            )
        grants[host] = until
        self._forget(self.denied, crew, host)

    def deny(self, crew: str, host: str, until: float) -> None:
        self.expire()
        denied = self.denied.setdefault(crew, {})
        denied[host] = until
        while len(denied) > MAX_ENTRIES:
            del denied[min(denied, key=denied.__getitem__)]
        self._forget(self.grants, crew, host)

    def allowed(self, crew: str, host: str) -> None:
        """On the crew's allowlist now: no grant or denial is needed any more."""
        self._forget(self.grants, crew, host)
        self._forget(self.denied, crew, host)

    @staticmethod
    def _forget(table: dict[str, dict[str, float]], crew: str, host: str) -> None:
        entries = table.get(crew)
        if entries is not None:
            entries.pop(host, None)
            if not entries:
                del table[crew]

    def forget_crew(self, crew: str) -> None:
        for host in list(self.pending.get(crew, {})):
            self._drop(crew, host)
        self.grants.pop(crew, None)
        self.denied.pop(crew, None)

    def expire(self) -> set[str]:
        """Drop what has ended; the crews whose grants or denials changed."""
        now = self.clock()
        changed: set[str] = set()
        for table in (self.grants, self.denied):
            for crew, entries in list(table.items()):
                for host, until in list(entries.items()):
                    if until <= now:
                        del entries[host]
                        changed.add(crew)
                if not entries:
                    del table[crew]
        for crew, requests in list(self.pending.items()):
            for host, request in list(requests.items()):
                if request.last_seen + self.window <= now:
                    self._drop(crew, host)
        return changed

    def message(self, crew: str) -> control.CrewApprovals:
        """The crew's whole set for its workers (only what is still in force)."""
        now = self.clock()

        def entries(table: dict[str, dict[str, float]]) -> tuple[control.HostUntil, ...]:
            return tuple(
                control.HostUntil(host=host, until=until)
                for host, until in table.get(crew, {}).items()
                if until > now
            )

        return control.CrewApprovals(
            crew=crew, grants=entries(self.grants), denied=entries(self.denied)
        )

    def in_force(self, table: dict[str, dict[str, float]]) -> tuple[messages.ApprovalEntry, ...]:
        now = self.clock()
        return tuple(
            messages.ApprovalEntry(crew=crew, host=host, until=until)
            for crew, entries in sorted(table.items())
            for host, until in sorted(entries.items())
            if until > now
        )


class Approvals:
    """The book with applianced around it: the journal, the state, the proxy, the admin API."""

    def __init__(
        self,
        section: ApprovalsSection,
        store: StateStore,
        proxy: ProxyPool,
        recorder: JournalRecorder,
        crews: CrewManager,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.section = section
        self.store = store
        self.proxy = proxy
        self.recorder = recorder
        self.crews = crews
        self.book = ApprovalBook(
            section.window, per_crew=section.per_crew, total=section.total, clock=clock
        )
        self.clock = clock
        # Set (and replaced) whenever a request is filed: what a long poll waits on.
        self._filed = trio.Event()

    # -- the state ----------------------------------------------------------------------------

    def load(self) -> None:
        """The grants and denials stored by the previous applianced (before the crews are
        reconciled: every worker gets them with its crews). Ended and orphaned ones go."""
        now = self.clock()
        self.store.approvals_expire(now)
        known = {row.name for row in self.store.crews()}
        for crew, kind, host, until in self.store.approvals():
            if crew not in known:
                self.store.approval_delete(crew)
                continue
            table = self.book.grants if kind == ONCE else self.book.denied
            table.setdefault(crew, {})[host] = until

    def source(self, crew: str) -> control.CrewApprovals | None:
        """For ProxyPool: the crew's set, None when it has none (nothing to send)."""
        message = self.book.message(crew)
        return message if message.grants or message.denied else None

    # -- requests -------------------------------------------------------------------------------

    def on_refused(self, event: pe.RequestDenied) -> E.Entry | None:
        """Told of every `request_denied` event as the journal ingests it (must not block);
        the entry to journal when a request was filed (the ingest submits it as it does the
        proxy's own, waiting for room rather than losing it)."""
        if event.rule != RULE_NOT_IN_ALLOWLIST or event.crew not in self.proxy.crews:
            return None
        filed, dropped = self.book.note(event.crew, event.host, event.port)
        for request in dropped:
            log.warning(
                "approvals: dropped the pending request of crew %s for %s (over the bound of "
                "%d per crew, %d in all)",
                request.crew,
                request.host,
                self.book.per_crew,
                self.book.total,
                extra={"crew": request.crew},
            )
        if filed is None:
            return None
        self._filed.set()
        self._filed = trio.Event()
        return E.ApprovalRequested(
            crew=filed.crew,
            host=filed.host,
            port=filed.port,
            expires=filed.last_seen + self.book.window,
        )

    async def listing(
        self, crew: str | None = None, since: int = 0, wait: float = 0.0
    ) -> messages.ApprovalList:
        """The requests filed after `since`; with `wait`, until one is or `wait` has passed."""
        if wait > 0 and not self.book.requests(crew, since):
            with trio.move_on_after(min(wait, MAX_WAIT)):
                while not self.book.requests(crew, since):
                    await self._filed.wait()
        window = self.book.window
        return messages.ApprovalList(
            requests=tuple(p.message(window) for p in self.book.requests(crew, since)),
            seq=self.book.seq,
            window=window,
            grants=self.book.in_force(self.book.grants),
            denied=self.book.in_force(self.book.denied),
        )

    # -- answers ------------------------------------------------------------------------------

    def _crew(self, name: str) -> CrewRow:
        row = self.store.get(name)
        if row is None:
            raise CrewNotFound(name)
        return row

    async def allow(
        self, crew: str, decision: messages.ApprovalDecision
    ) -> messages.ApprovalResult:
        row = self._crew(crew)
        host = check_host(decision.host)
        peer = logs.context_value("admin_peer")
        if not decision.once:
            if decision.duration is not None:
                raise InvalidRequest("argument duration: only with once (--once --for)")
            changed = await self.crews.allow(crew, host)
            was_pending = self.book.take(crew, host)
            if self._entries(crew, host):
                self.book.allowed(crew, host)
                self.store.approval_delete(crew, host)
                await self._push(crew)
            await self.recorder.record(
                E.ApprovalAllowed(
                    crew=crew, host=host, was_pending=was_pending, by=decision.by, peer=peer
                )
            )
            return messages.ApprovalResult(
                crew=crew, host=host, decision="allowed", changed=changed, was_pending=was_pending
            )
        self._restricted(row, "a grant")
        duration = self.section.once if decision.duration is None else decision.duration
        if not math.isfinite(duration) or not 0 < duration <= self.section.max_once:
            raise InvalidRequest(
                f"argument duration: {decision.duration!r} is not between 0 and "
                f"{self.section.max_once:g} seconds ([approvals] max_once)"
            )
        until = self.clock() + duration
        self.book.grant(crew, host, until)
        # The state first: a worker (re)started from here on is sent the grant with its crew.
        self.store.approval_set(crew, ONCE, host, until)
        was_pending = self.book.take(crew, host)
        await self._push(crew)
        await self.recorder.record(
            E.ApprovalAllowed(
                crew=crew, host=host, once=True, until=until, was_pending=was_pending,
                by=decision.by, peer=peer,
            )
        )  # fmt: skip
        return messages.ApprovalResult(
            crew=crew, host=host, decision="allowed_once", until=until, was_pending=was_pending
        )

    async def deny(self, crew: str, decision: messages.ApprovalDecision) -> messages.ApprovalResult:
        row = self._crew(crew)
        host = check_host(decision.host)
        if decision.once or decision.duration is not None:
            raise InvalidRequest("argument once: a denial lasts the window ([approvals] window)")
        self._restricted(row, "a denial")
        if any(entry.host == host for entry in self.crews.effective_allow(row)):
            # The allowlist decides before any denial: saying "denied" would be untrue.
            raise CrewBusy(
                f"{host} is on the allowlist of crew {crew!r}: a denial would not refuse it"
            )
        until = self.clock() + self.book.window
        # A grant in force ends now: the workers are told before the command returns.
        self.book.deny(crew, host, until)
        self.store.approval_set(crew, DENIED, host, until)
        was_pending = self.book.take(crew, host)
        await self._push(crew)
        await self.recorder.record(
            E.ApprovalDenied(
                crew=crew, host=host, until=until, was_pending=was_pending, by=decision.by,
                peer=logs.context_value("admin_peer"),
            )
        )  # fmt: skip
        return messages.ApprovalResult(
            crew=crew, host=host, decision="denied", until=until, was_pending=was_pending
        )

    @staticmethod
    def _restricted(row: CrewRow, what: str) -> None:
        """Only a restricted crew's refusals consult grants and denials (mode none refuses
        every host whatever they say, mode free none)."""
        mode, _ = parse_mode(row.mode)
        if mode is not NetworkMode.RESTRICTED:
            raise CrewBusy(
                f"crew {row.name!r} is in mode {mode.value}: {what} applies to a restricted crew"
            )

    def _entries(self, crew: str, host: str) -> bool:
        return host in self.book.grants.get(crew, {}) or host in self.book.denied.get(crew, {})

    async def _push(self, crew: str) -> None:
        """The crew's whole set to every worker (not served right now: it goes with the crew
        when it is). A refusal is the caller's error; the state keeps the change."""
        try:
            await self.proxy.push_approvals(crew)
        except Unavailable as exc:
            raise ApprovalNotInEffect(f"stored, but not confirmed by the proxy: {exc}") from None

    def forget_crew(self, crew: str) -> None:
        """The crew is gone: a crew made again under its name starts with nothing."""
        self.book.forget_crew(crew)
        self.store.approval_delete(crew)

    async def keep_swept(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Ended entries leave memory and the state (the workers ignore them already)."""
        task_status.started()
        while True:
            await trio.sleep(SWEEP_INTERVAL)
            self.book.expire()
            self.store.approvals_expire(self.clock())
