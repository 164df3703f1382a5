"""applianced's Prometheus metrics: counted as the journal ingests, exposed by prometheus_client.

Theory of operation
-------------------
Nothing is counted twice and nothing new is counted on the proxy's hot path: every figure about
the crews' traffic comes from the events the proxy workers already send for the journal
(proxycore/protocol/events.py), which `JournalRecorder.ingest_proxy_channel` hands to
`Traffic.proxy_events` once per batch as it reads them; every control-plane figure (crew
lifecycle, credential changes, keeper decisions, worker exits) from the journal entries the
recorder submits (`Traffic.entry_submitted`). Both run on applianced's trio thread and add to
plain dicts (no lock, a few dict operations per event: docs/observability.md gives the
measured cost); gauges that are the daemon's state (workers up, the journal's queue, crews by
phase) are read at scrape time.

`DaemonMetrics` is a prometheus_client collector over those dicts: the library writes the text
exposition format (`exposition()`), served on the admin socket (GET /metrics) and, when
`[metrics] listen` is set, on a TCP listener of its own (`serve_tcp`: GET /metrics only).

Labels are bounded. `crew` takes the names of the crews that exist (a worker naming another
crew counts under "_other"; "-" is traffic no crew could be told for), and a crew's series go
away at the first scrape after it is removed; `status` is an HTTP status (100-599) or "0"
(nothing was answered); `route`, `decision`, `direction`, `type` and `reason` come from fixed
sets. No label holds a host, a path or anything else a crew chooses.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import h11
import trio
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from appliance.journal import entries as E
from proxycore.protocol import events as pe

from .errors import Unavailable

if TYPE_CHECKING:
    from .main import Daemon

log = logging.getLogger("applianced.metrics")

# Seconds. A reverse-proxied model call streams for tens of seconds or minutes; a CONNECT is
# established in milliseconds: the buckets cover both.
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
ROUTES = frozenset({"forward", "reverse", "tunnel", "local", "keeper", "connection"})
NO_CREW, OTHER_CREW = "-", "_other"
# The TCP listener: connections served at once, and how long a request head may take.
TCP_CONNECTIONS = 8
TCP_HEAD_TIMEOUT = 5.0
# The text format every Prometheus reads (0.0.4): our names and labels are plain ASCII, so
# generate_latest writes it the same whatever newer version the library would announce.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _status(status: int) -> str:
    return str(status) if 100 <= status <= 599 else "0"


def restart_reason(entry: E.ProxyWorkerExited) -> str:
    """Bounded: "killed_by_applianced", a signal's name (SIGKILL, SIGSEGV...), "exit_<code>"."""
    if entry.killed_by is not None:
        return "killed_by_applianced"
    if entry.signal is not None:
        return entry.signal if entry.signal.startswith("SIG") else "signal"
    return f"exit_{entry.exit_code if entry.exit_code is not None else 'unknown'}"


class Traffic:
    """What applianced counts, in plain dicts: fed by the journal recorder (its observer)."""

    def __init__(self, crews: Callable[[], Collection[str]] | None = None) -> None:
        # The crews that exist (label values); None: every name is taken as it comes (tests).
        self.crews = crews
        self.requests: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self.bytes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.tunnels_open: collections.Counter[tuple[int, str]] = collections.Counter()
        self.tunnels_opened: collections.Counter[str] = collections.Counter()
        # (crew, route) -> per bucket counts (the last one: above every bound), then the sum
        self.durations: dict[tuple[str, str], list[float]] = {}
        self.redactions: collections.Counter[str] = collections.Counter()
        self.injections: collections.Counter[str] = collections.Counter()
        self.events = 0
        self.events_dropped = 0
        self.events_unreadable = 0
        self.ingest_lag = 0.0
        self.restarts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.entries: collections.Counter[str] = collections.Counter()
        self.keeper: collections.Counter[str] = collections.Counter()

    def _crew(self, name: str) -> str:
        if name == NO_CREW or self.crews is None or name in self.crews():
            return name
        return OTHER_CREW

    # -- the recorder's observer -----------------------------------------------------------

    def proxy_events(self, worker: int, events: Sequence[pe.AnyEvent | None]) -> None:
        """One batch of a worker's events, as the journal reads it (oldest first)."""
        if not events:
            return
        self.events += len(events)
        first = events[0]
        if first is not None:
            self.ingest_lag = max(0.0, time.time() - first.ts)
        requests, counted_bytes, crew_of = self.requests, self.bytes, self._crew
        for event in events:
            # The common case first: under load nearly every event is an allowed request.
            if isinstance(event, pe.RequestAllowed):
                crew = crew_of(event.crew)
                requests[(crew, "allowed", _status(event.status))] += 1
                if event.bytes_up:
                    counted_bytes[(crew, "up")] += event.bytes_up
                if event.bytes_down:
                    counted_bytes[(crew, "down")] += event.bytes_down
                if event.redactions:
                    self.redactions[crew] += event.redactions
                route = event.route if event.route in ROUTES else "other"
                histogram = self.durations.get((crew, route))
                if histogram is None:
                    histogram = [0.0] * (len(DURATION_BUCKETS) + 2)
                    self.durations[(crew, route)] = histogram
                histogram[bisect.bisect_left(DURATION_BUCKETS, event.duration)] += 1
                histogram[-1] += event.duration
            elif isinstance(event, pe.RequestDenied):
                requests[(crew_of(event.crew), "denied", _status(event.status))] += 1
            elif isinstance(event, pe.RequestRefused):
                requests[(crew_of(event.crew), "refused", _status(event.status))] += 1
            elif isinstance(event, pe.RequestErrored):
                requests[(crew_of(event.crew), "errored", _status(event.status))] += 1
            elif isinstance(event, pe.TunnelOpened):
                crew = crew_of(event.crew)
                self.tunnels_open[(worker, crew)] += 1
                self.tunnels_opened[crew] += 1
            elif isinstance(event, pe.TunnelClosed):
                crew = crew_of(event.crew)
                key = (worker, crew)
                if self.tunnels_open[key] > 0:
                    self.tunnels_open[key] -= 1
                counted_bytes[(crew, "up")] += event.bytes_up
                counted_bytes[(crew, "down")] += event.bytes_down
            elif isinstance(event, pe.CredentialInjected):
                self.injections[crew_of(event.crew)] += 1
            elif isinstance(event, pe.EventsDropped):
                self.events_dropped += event.count
            elif event is None:
                self.events_unreadable += 1

    def entry_submitted(self, entry: E.Entry) -> None:
        """Every entry the recorder gives the journal (the proxy's grouped ones included)."""
        tag = str(type(entry).__struct_config__.tag)
        self.entries[tag] += 1
        if isinstance(entry, E.ProxyWorkerExited):
            self.restarts[(str(entry.worker), restart_reason(entry))] += 1
            # Its tunnels ended with it; no tunnel_closed will say so.
            for key in [key for key in self.tunnels_open if key[0] == entry.worker]:
                del self.tunnels_open[key]
        elif isinstance(entry, E.KeeperDecision):
            self.keeper["allow" if entry.decision == "allow" else "deny"] += 1

    def forget_crews(self, live: Collection[str]) -> None:
        """Drop the series of crews that no longer exist (called at scrape time)."""

        def gone(crew: str) -> bool:
            return crew not in live and crew not in (NO_CREW, OTHER_CREW)

        tables: list[dict[Any, Any]] = [self.requests, self.bytes, self.durations]
        for keyed in tables:
            for series in [series for series in keyed if gone(series[0])]:
                del keyed[series]
        for tunnel in [tunnel for tunnel in self.tunnels_open if gone(tunnel[1])]:
            del self.tunnels_open[tunnel]
        for counter in (self.tunnels_opened, self.redactions, self.injections):
            for crew in [crew for crew in counter if gone(crew)]:
                del counter[crew]


def _families(traffic: Traffic) -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "appliance_proxy_requests",
        "Requests the proxy ended, by crew, decision (allowed, denied, refused, errored) and "
        "the status the agent got (0: none)",
        labels=("crew", "decision", "status"),
    )
    for (crew, decision, status), count in sorted(traffic.requests.items()):
        requests.add_metric((crew, decision, status), count)
    yield requests
    moved = CounterMetricFamily(
        "appliance_proxy_bytes",
        "Body bytes relayed, by crew and direction (up: agent to upstream, down: to the agent, "
        "after scrubbing); tunnels included",
        labels=("crew", "direction"),
    )
    for (crew, direction), count in sorted(traffic.bytes.items()):
        moved.add_metric((crew, direction), count)
    yield moved
    open_tunnels: collections.Counter[str] = collections.Counter()
    for (_, crew), count in traffic.tunnels_open.items():
        open_tunnels[crew] += count
    tunnels = GaugeMetricFamily(
        "appliance_proxy_tunnels_open", "CONNECT tunnels open now, by crew", labels=("crew",)
    )
    for crew, count in sorted(open_tunnels.items()):
        tunnels.add_metric((crew,), count)
    yield tunnels
    yield _by_crew(
        "appliance_proxy_tunnels_opened", "CONNECT tunnels opened, by crew", traffic.tunnels_opened
    )
    durations = HistogramMetricFamily(
        "appliance_proxy_request_duration_seconds",
        "Allowed requests from their head to the end of the relayed answer (a tunnel: until it "
        "is established), by crew and route",
        labels=("crew", "route"),
    )
    for (crew, route), counts in sorted(traffic.durations.items()):
        cumulative, buckets = 0.0, []
        for bound, observed in zip((*map(str, DURATION_BUCKETS), "+Inf"), counts, strict=False):
            cumulative += observed
            buckets.append((bound, cumulative))
        durations.add_metric((crew, route), buckets, counts[-1])
    yield durations
    yield _by_crew(
        "appliance_scrubber_redactions",
        "Secrets the scrubber redacted from answers relayed to the agents, by crew",
        traffic.redactions,
    )
    yield _by_crew(
        "appliance_proxy_credential_injections",
        "Requests the proxy added a provider credential to, by crew",
        traffic.injections,
    )
    yield _counter("appliance_proxy_events", "Events read from the proxy workers", traffic.events)
    yield _counter(
        "appliance_proxy_events_dropped",
        "Events a worker dropped (its queue was full) and said so",
        traffic.events_dropped,
    )
    yield _counter(
        "appliance_proxy_events_unreadable",
        "Event lines from the workers that did not decode (journaled as a notice)",
        traffic.events_unreadable,
    )
    restarts = CounterMetricFamily(
        "appliance_proxy_worker_restarts",
        "Proxy worker exits (each followed by a restart), by worker and reason: "
        "killed_by_applianced, a signal's name, exit_<status>",
        labels=("worker", "reason"),
    )
    for (worker, reason), count in sorted(traffic.restarts.items()):
        restarts.add_metric((worker, reason), count)
    yield restarts
    entries = CounterMetricFamily(
        "appliance_journal_entries",
        "Entries given to the journal, by type (crew.created, credential.changed, run.completed, "
        "proxy.allow...)",
        labels=("type",),
    )
    for tag, count in sorted(traffic.entries.items()):
        entries.add_metric((tag,), count)
    yield entries
    keeper = CounterMetricFamily(
        "appliance_keeper_decisions", "Keeper calls decided, by decision", labels=("decision",)
    )
    for decision, count in sorted(traffic.keeper.items()):
        keeper.add_metric((decision,), count)
    yield keeper
    yield GaugeMetricFamily(
        "appliance_journal_ingest_lag_seconds",
        "Age of the oldest event of the last batch read from a worker, when it was read",
        value=traffic.ingest_lag,
    )


def _by_crew(name: str, documentation: str, counts: collections.Counter[str]) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=("crew",))
    for crew, count in sorted(counts.items()):
        family.add_metric((crew,), count)
    return family


def _counter(name: str, documentation: str, value: float) -> Metric:
    return CounterMetricFamily(name, documentation, value=value)


class DaemonMetrics:
    """The registry applianced serves: `Traffic`'s counts, its own state read at scrape time,
    and prometheus_client's process and platform collectors (applianced's CPU, memory, fds)."""

    def __init__(self, daemon: Daemon | None = None, traffic: Traffic | None = None) -> None:
        self.daemon = daemon
        self.traffic = traffic if traffic is not None else Traffic()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type): the text exposition format, version 0.0.4."""
        return generate_latest(self.registry), CONTENT_TYPE

    def collect(self) -> Iterator[Metric]:
        daemon = self.daemon
        if self.traffic.crews is not None:
            self.traffic.forget_crews(set(self.traffic.crews()))
        yield from _families(self.traffic)
        if daemon is None:
            return
        yield from self._state(daemon)

    def _state(self, daemon: Daemon) -> Iterator[Metric]:
        workers = GaugeMetricFamily(
            "appliance_proxy_worker_up",
            "1 while a proxy worker serves, 0 while it is down or waits to restart",
            labels=("worker",),
        )
        for status in daemon.proxy.worker_status():
            workers.add_metric((str(status.index),), 1 if status.pid is not None else 0)
        yield workers
        journal, recorder = daemon.journal, daemon.recorder
        yield GaugeMetricFamily(
            "appliance_journal_queue_entries",
            "Entries waiting to be written to the journal",
            value=journal.pending,
        )
        oldest = journal.oldest_pending_ts
        yield GaugeMetricFamily(
            "appliance_journal_oldest_unwritten_seconds",
            "Age of the oldest entry waiting to be written to the journal (0: none waits)",
            value=0.0 if oldest is None else max(0.0, time.time() - oldest),
        )
        yield GaugeMetricFamily(
            "appliance_journal_queue_capacity",
            "The journal queue's capacity; full, crews' traffic is refused",
            value=journal.capacity,
        )
        yield GaugeMetricFamily(
            "appliance_journal_backpressure",
            "1 while the journal is behind and the crews' traffic is refused (503)",
            value=1 if recorder.backpressure else 0,
        )
        yield _counter(
            "appliance_journal_backpressure_episodes",
            "Times the journal fell behind and the crews' traffic was refused",
            recorder.backpressure_episodes,
        )
        phases = GaugeMetricFamily(
            "appliance_crews", "Crews in applianced's state, by phase", labels=("phase",)
        )
        counted = collections.Counter(row.phase.value for row in daemon.crews.store.crews())
        for phase, count in sorted(counted.items()):
            phases.add_metric((phase,), count)
        yield phases


# -- the TCP listener ---------------------------------------------------------------------------


async def serve_tcp(
    metrics: DaemonMetrics,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """GET /metrics on host:port (Prometheus cannot scrape a Unix socket); anything else 404.
    Started with the bound port (0 picks one)."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise Unavailable(
            f"`metrics.listen`: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None
    bound = listeners[0].socket.getsockname()[1]
    log.info("metrics on http://%s:%d/metrics", f"[{host}]" if ":" in host else host, bound)
    limiter = trio.CapacityLimiter(TCP_CONNECTIONS)

    async def handler(stream: trio.SocketStream) -> None:
        async with stream:
            if limiter.available_tokens == 0:
                return  # a scraper retries; a flood gets nothing
            async with limiter:
                with (
                    contextlib.suppress(
                        trio.TooSlowError, trio.BrokenResourceError, h11.ProtocolError
                    ),
                    trio.fail_after(TCP_HEAD_TIMEOUT),
                ):
                    await _answer(metrics, stream)

    task_status.started(bound)
    await trio.serve_listeners(handler, listeners)


async def _answer(metrics: DaemonMetrics, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=16 * 1024)
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(16 * 1024)
            if not data:
                return
            conn.receive_data(data)
            continue
        break
    if not isinstance(event, h11.Request):
        return
    status, body, content_type = 404, b"not found: GET /metrics\n", "text/plain; charset=utf-8"
    path = event.target.split(b"?", 1)[0]
    if path == b"/metrics" and event.method in (b"GET", b"HEAD"):
        status = 200
        body, content_type = metrics.exposition()
    headers: list[tuple[str, Any]] = [
        ("Content-Type", content_type),
        ("Content-Length", str(len(body))),
        ("Connection", "close"),
    ]
    await stream.send_all(conn.send(h11.Response(status_code=status, headers=headers)))
    if event.method != b"HEAD":
        await stream.send_all(conn.send(h11.Data(data=body)))
    await stream.send_all(conn.send(h11.EndOfMessage()))
