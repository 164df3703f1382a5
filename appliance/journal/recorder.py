"""The journal as applianced uses it: trio-side recording, run lifecycle and proxy-event ingest.

Theory of operation
-------------------
`JournalRecorder` is what the crew manager holds (`CrewManager.journal`); built without a
journal it records nothing, so CrewManager works unchanged in tests that do not journal.

- Control-plane changes (crew created/removed/failed, allowlist changed) wait for their
  acknowledgment: the operator's command returns only once its record is on disk. If the queue
  is full they wait for room (the control plane may wait; only the proxy must not).
- `run()` wraps an exec's event stream: run.started before the first output, then exactly one of
  run.completed / run.timeout / run.failed / run.cancelled, all sharing the run id as trace id.
- `ingest_proxy_channel()` reads one proxy worker's events channel (the worker sends JSON-lines
  batches from its own task, never blocking a request: proxycore/protocol/events.py `ChannelSink`)
  and turns each event into an entry. When the journal's queue is full it stops reading and calls
  `on_backpressure(True)`: applianced tells every worker to refuse crew traffic (503
  audit_unavailable); `watch_backpressure()` serves them again once the queue is under half
  full. Meanwhile events wait in the socket and in the worker's queue; a worker whose queue is
  half full refuses crew traffic on its own (`EventSink.backlogged`), so nothing is served that
  could not be recorded. What an applianced crash loses: the events in flight (the worker's
  queue, at most one flush interval, 50 ms, plus the socket's buffer), since the workers exit
  with it; docs/journal.md.
- An `observer` (applianced's metrics, appliance/daemon/metrics.py) is shown every batch of a
  worker's events as it is decoded and every entry as it is submitted; it must not block.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from proxycore import logs
from proxycore.protocol import events as pe

from . import entries as E
from .store import Journal, JournalFull

if TYPE_CHECKING:
    from appliance.daemon.supervisor import WorkerExit

log = logging.getLogger("applianced.journal")

FULL_RETRY = 0.05
RESUME_QUIET = 0.5
# An event line longer than this (without its newline) is not an event: journaled as unreadable.
MAX_EVENT_LINE = 1 << 20
UNREADABLE_EVENT = "an event line was redacted or unreadable"

Backpressure = Callable[[bool], Awaitable[None]]


class Observer(Protocol):
    """Told what the recorder journals, on the trio thread (applianced's metrics)."""

    def proxy_events(self, worker: int, events: Sequence[pe.AnyEvent | None]) -> None: ...

    def entry_submitted(self, entry: E.Entry) -> None: ...


def from_proxy_event(event: pe.AnyEvent) -> E.Entry:
    """The journal entry for one of the proxy's events (proxycore/protocol/events.py)."""
    crew = None if event.crew == "-" else event.crew
    common: dict[str, Any] = {"ts": event.ts, "crew": crew}
    if isinstance(event, pe.RequestAllowed):
        return E.ProxyAllow(mode=event.mode, requests=(_allowed(event),), **common)
    if isinstance(event, pe.RequestDenied):
        return E.ProxyDeny(mode=event.mode, requests=(_denied(event),), **common)
    if isinstance(event, pe.RequestRefused):
        return E.ProxyRefuse(mode=event.mode, requests=(_refused(event),), **common)
    if isinstance(event, pe.RequestErrored):
        return E.ProxyError(requests=(_errored(event),), **common)
    if isinstance(event, pe.CredentialInjected):
        return E.CredentialInjected(provider=event.provider, host=event.host, **common)
    if isinstance(event, pe.TunnelOpened):
        return E.TunnelOpened(
            tunnel_id=event.tunnel_id, host=event.host, port=event.port, address=event.address,
            **common,
        )  # fmt: skip
    if isinstance(event, pe.TunnelClosed):
        return E.TunnelClosed(
            tunnel_id=event.tunnel_id, host=event.host, port=event.port,
            bytes_up=event.bytes_up, bytes_down=event.bytes_down, duration=event.duration,
            reason=event.reason, **common,
        )  # fmt: skip
    if isinstance(event, pe.AllowlistChanged):
        return E.AllowlistChanged(host=event.host, added=event.added, source="proxy", **common)
    if isinstance(event, pe.PolicyWarning):
        return E.ProxyNotice(message=event.message, **common)
    if isinstance(event, pe.KeeperCallRefused):
        return E.KeeperDecision(
            action=event.action, credential=event.credential, decision="deny",
            reason=f"refused by the proxy: {event.rule}", **common,
        )  # fmt: skip
    if isinstance(event, pe.DnsRefused):
        return E.DnsRefused(queries=(_query(event),), **common)
    assert isinstance(event, pe.EventsDropped)
    return E.ProxyNotice(message="the proxy dropped events", dropped=event.count, **common)


def _allowed(event: pe.RequestAllowed) -> E.AllowedRequest:
    ws = event.websocket
    counts = None if ws is None else E.WebSocketCounts(
        ws.frames_up, ws.frames_down, ws.messages_up, ws.messages_down, ws.closed_by,
        ws.close_code,
    )  # fmt: skip
    return E.AllowedRequest(
        event.ts, event.route, event.method, event.host, event.port, event.address, event.rule,
        event.status, event.bytes_up, event.bytes_down, event.duration, event.ended, counts,
    )  # fmt: skip


def _refused(event: pe.RequestRefused) -> E.RefusedRequest:
    return E.RefusedRequest(
        event.ts, event.route, event.method, event.host, event.port, event.rule, event.status,
        event.message,
    )  # fmt: skip


def _errored(event: pe.RequestErrored) -> E.ErroredRequest:
    return E.ErroredRequest(
        event.ts, event.route, event.method, event.host, event.port, event.cause, event.status
    )


def _denied(event: pe.RequestDenied) -> E.DeniedRequest:
    return E.DeniedRequest(
        event.ts, event.route, event.method, event.host, event.port, event.rule, event.status
    )


def _query(event: pe.DnsRefused) -> E.RefusedQuery:
    return E.RefusedQuery(event.ts, event.name, event.qtype, event.rule, event.rcode, event.count)


_GROUPED = (
    pe.RequestAllowed,
    pe.RequestDenied,
    pe.RequestRefused,
    pe.RequestErrored,
    pe.DnsRefused,
)


def entries_for_batch(events: list[pe.AnyEvent | None]) -> list[E.Entry]:
    """The journal entries for one batch of a worker's events, in order. A request's terminal
    events (allowed, denied, refused, errored) are grouped per kind and (crew, mode) into one
    `proxy.allow` / `proxy.deny` / `proxy.refuse` / `proxy.error` entry each, and a crew's DNS
    refusals into one `dns.refused` entry, which takes the
    place of the group's first request (so a proxy under load writes a few entries per batch,
    not one per request); every other event is an entry of its own. None stands for a line that
    did not decode: a `proxy.notice` saying so."""
    out: list[E.Entry | None] = []
    groups: dict[tuple[type, str, str], tuple[int, list[Any]]] = {}
    for event in events:
        if isinstance(event, _GROUPED):
            mode = "" if isinstance(event, pe.RequestErrored | pe.DnsRefused) else event.mode
            key = (type(event), event.crew, mode)
            group = groups.get(key)
            if group is None:
                groups[key] = (len(out), [event])
                out.append(None)  # the group's place
            else:
                group[1].append(event)
        elif event is None:
            out.append(E.ProxyNotice(message=UNREADABLE_EVENT))
        else:
            out.append(from_proxy_event(event))
    for (kind, crew, mode), (index, members) in groups.items():
        scope: dict[str, Any] = {"ts": members[0].ts, "crew": None if crew == "-" else crew}
        if kind is pe.RequestAllowed:
            out[index] = E.ProxyAllow(
                mode=mode, requests=tuple(_allowed(m) for m in members), **scope
            )
        elif kind is pe.RequestDenied:
            out[index] = E.ProxyDeny(
                mode=mode, requests=tuple(_denied(m) for m in members), **scope
            )
        elif kind is pe.RequestRefused:
            out[index] = E.ProxyRefuse(
                mode=mode, requests=tuple(_refused(m) for m in members), **scope
            )
        elif kind is pe.DnsRefused:
            out[index] = E.DnsRefused(queries=tuple(_query(m) for m in members), **scope)
        else:
            out[index] = E.ProxyError(requests=tuple(_errored(m) for m in members), **scope)
    return [entry for entry in out if entry is not None]


class _CrewLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def allow(self) -> tuple[str, ...]: ...
    @property
    def runtime(self) -> str: ...
    @property
    def net(self) -> tuple[str, ...]: ...


def crew_created(row: _CrewLike) -> E.CrewCreated:
    return E.CrewCreated(
        crew=row.name, mode=row.mode, allow=row.allow, runtime=row.runtime, net=row.net
    )


class JournalRecorder:
    def __init__(
        self,
        journal: Journal | None = None,
        on_backpressure: Backpressure | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.journal = journal
        self.on_backpressure = on_backpressure
        self.observer = observer
        # Told of every `request_denied` event as it is ingested (applianced's approvals:
        # appliance/daemon/approvals.py); must not block.
        self.on_refused: Callable[[pe.RequestDenied], E.Entry | None] | None = None
        self.backpressure = False
        self.backpressure_episodes = 0  # times the journal fell behind (crews refused)
        self._last_full = float("-inf")

    async def _signal(self, paused: bool) -> None:
        if paused == self.backpressure:
            return
        self.backpressure = paused
        self.backpressure_episodes += paused
        log.warning(
            "journal %s: crew traffic %s",
            "behind" if paused else "caught up",
            "refused" if paused else "served again",
        )
        if self.on_backpressure is not None:
            try:
                await self.on_backpressure(paused)
            except Exception as exc:  # the proxy is restarting: it gets the state on restore
                log.error("could not tell the proxy audit_paused=%s: %s", paused, exc)

    async def record(self, entry: E.Entry) -> int | None:
        """Append and wait until it is on disk; waits for room if the queue is full."""
        if self.journal is None:
            return None
        if self.observer is not None:
            self.observer.entry_submitted(entry)
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()
        while True:
            try:
                ticket = self.journal.submit(entry, on_done=lambda: token.run_sync_soon(done.set))
                break
            except JournalFull:
                await trio.sleep(FULL_RETRY)
        await done.wait()
        return ticket.wait(0)

    def record_nowait(self, entry: E.Entry) -> None:
        """For paths that cannot wait (cancellation): queued, acknowledged later."""
        if self.journal is None:
            return
        if self.observer is not None:
            self.observer.entry_submitted(entry)
        try:
            self.journal.submit(entry)
        except JournalFull:
            log.error("journal full: could not record %s", type(entry).__struct_config__.tag)

    # -- crews -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def crew_change(self, crew: str, created: E.Entry) -> AsyncIterator[None]:
        """crew.created when the block succeeds, crew.failed (and the error re-raised) if not."""
        try:
            yield
        except Exception as exc:
            await self.record(E.CrewFailed(crew=crew, error=str(exc)))
            raise
        await self.record(created)

    async def allowlist_changed(self, crew: str, host: str, changed: bool) -> None:
        if changed:
            await self.record(E.AllowlistChanged(crew=crew, host=host, source="admin"))

    async def credential_changed(
        self,
        name: str,
        action: str,
        *,
        provider: str | None = None,
        level: str | None = None,
        version: int | None = None,
        crew: str | None = None,
        agent: str | None = None,
    ) -> None:
        """After the credential store committed a change (`action`: added, granted, revoked,
        rotated); names, provider and level only, never a value."""
        await self.record(
            E.CredentialChanged(
                name=name, action=action, provider=provider, level=level, version=version,
                crew=crew, agent=agent,
            )
        )  # fmt: skip

    async def credential_push_failed(
        self,
        name: str,
        action: str,
        error: str,
        *,
        proxy_killed: tuple[int, ...],
        crew: str | None = None,
        agent: str | None = None,
    ) -> None:
        """The running proxy did not confirm a stored change (appliance/daemon/credentials.py)."""
        await self.record(
            E.CredentialPushFailed(
                name=name, action=action, error=error, proxy_killed=proxy_killed, crew=crew,
                agent=agent,
            )
        )  # fmt: skip

    # -- the proxy's workers ---------------------------------------------------------------

    def proxy_worker_exited(self, gone: WorkerExit) -> None:
        """A worker exited (appliance/daemon/proxy.py): queued, never waited for, so that a
        journal that is behind never delays the restart."""
        self.record_nowait(
            E.ProxyWorkerExited(
                ts=gone.ts, worker=gone.worker, pid=gone.pid, reason=gone.reason,
                exit_code=gone.exit_code, signal=gone.signal, killed_by=gone.killed_by,
                uptime=gone.uptime, restarts=gone.restarts, restart_in=gone.restart_in,
                stderr_tail=gone.stderr_tail,
            )
        )  # fmt: skip

    # -- runs ------------------------------------------------------------------------------

    async def run(
        self,
        crew: str,
        argv: tuple[str, ...],
        timeout: float | None,
        stream: AsyncIterator[Any],
    ) -> AsyncIterator[Any]:
        """The exec's events, passed through, with the run's lifecycle recorded around them."""
        from appliance.runtime.base import ExecExited

        # The admin request's id when there is one (its log records carry it): a run's log
        # lines and its journal entries share one id.
        trace_id = logs.context_value("request_id") or uuid.uuid4().hex
        scope: dict[str, Any] = {"crew": crew, "trace_id": trace_id}
        await self.record(E.RunStarted(argv=argv, timeout=timeout, **scope))
        started = time.monotonic()
        finished = False

        def elapsed() -> float:
            return round(time.monotonic() - started, 6)

        try:
            async for event in stream:
                if isinstance(event, ExecExited):
                    finished = True
                    final: E.Entry = (
                        E.RunTimeout(timeout=timeout, duration=elapsed(), **scope)
                        if event.timed_out
                        else E.RunCompleted(exit_code=event.exit_code, duration=elapsed(), **scope)
                    )
                    await self.record(final)
                yield event
        except (trio.Cancelled, GeneratorExit):
            if not finished:
                self.record_nowait(E.RunCancelled(duration=elapsed(), **scope))
            raise
        except Exception as exc:
            if not finished:
                with trio.CancelScope(shield=True):
                    await self.record(E.RunFailed(error=str(exc), duration=elapsed(), **scope))
            raise
        finally:
            aclose: Callable[[], Any] | None = getattr(stream, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()
        if not finished:
            await self.record(
                E.RunFailed(error="ended without an exit status", duration=elapsed(), **scope)
            )

    # -- the proxy's events ----------------------------------------------------------------

    async def ingest_proxy_channel(self, stream: trio.SocketStream, worker: int = 0) -> None:
        """Journal one proxy worker's events, read from its events channel until EOF."""
        journal = self.journal
        decoder = msgspec.json.Decoder(pe.AnyEvent)
        buffer = bytearray()
        async with stream:
            while True:
                try:
                    # Up to a whole batch of the worker's (1,024 events) at a time.
                    data = await stream.receive_some(1 << 20)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    if buffer.strip():  # a last line cut short: the worker died mid-write
                        await self._submit(journal, E.ProxyNotice(message=UNREADABLE_EVENT))
                    return
                buffer += data
                end = buffer.rfind(b"\n")
                if end < 0:
                    if len(buffer) > MAX_EVENT_LINE:
                        await self._submit(journal, E.ProxyNotice(message=UNREADABLE_EVENT))
                        buffer.clear()
                    continue
                lines = bytes(buffer[: end + 1]).splitlines()
                del buffer[: end + 1]
                events: list[pe.AnyEvent | None] = []
                for line in lines:
                    if not line.strip():
                        continue
                    try:
                        events.append(decoder.decode(line))
                    except msgspec.DecodeError:
                        # The scrubber replaced a line whole, or a line is damaged: say so.
                        events.append(None)
                if self.observer is not None:
                    self.observer.proxy_events(worker, events)
                for entry in entries_for_batch(events):
                    await self._submit(journal, entry)
                if self.on_refused is not None:
                    for entry in self._tell_refused(events):
                        await self._submit(journal, entry)

    def _tell_refused(self, events: list[pe.AnyEvent | None]) -> list[E.Entry]:
        """`on_refused` for each denied request of a batch; the entries it asks to journal."""
        assert self.on_refused is not None
        found: list[E.Entry] = []
        for event in events:
            if isinstance(event, pe.RequestDenied):
                try:
                    entry = self.on_refused(event)
                except Exception:  # its trouble must not stop the journal's ingest
                    log.exception("could not file an approval request for crew %s", event.crew)
                    continue
                if entry is not None:
                    found.append(entry)
        return found

    async def _submit(self, journal: Journal | None, entry: E.Entry) -> None:
        """Queue without waiting for the disk; when the queue is full, refuse crew traffic and
        wait for room (the worker's own queue holds what arrives meanwhile)."""
        if journal is None:
            return
        if self.observer is not None:
            self.observer.entry_submitted(entry)
        while True:
            try:
                journal.submit(entry)
                return
            except JournalFull:
                self._last_full = trio.current_time()
                await self._signal(True)
                await trio.sleep(FULL_RETRY)

    async def watch_backpressure(
        self,
        *,
        interval: float = 0.1,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve crews again once the journal's queue is under half full and has not been full
        for RESUME_QUIET seconds (so that a burst does not flip every worker back and forth)."""
        task_status.started()
        journal = self.journal
        if journal is None:
            await trio.sleep_forever()
            return
        while True:
            await trio.sleep(interval)
            if (
                self.backpressure
                and journal.pending < journal.capacity // 2
                and trio.current_time() - self._last_full >= RESUME_QUIET
            ):
                await self._signal(False)
