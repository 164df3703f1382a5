"""Proxy requests/s with journaling on against off (issue 6: "under 10 % cost").

One real proxy worker, as applianced runs it (`python -m proxycore.worker --control-fd C
[--events-fd E]`, its crew and listening socket sent over the control channel), pinned to core
0; wrk and nginx on core 1, as in bench_forward.py. The worker is driven by a host process
(this script with `--host`) that plays applianced's part:

- on: the worker gets `--events-fd`; its events (one `request_allowed` per request: the worst
  case, every request is a journaled decision) come over the socketpair and the host journals
  them with the real `JournalRecorder.ingest_proxy_channel` into a real `Journal` (SQLite WAL,
  synchronous=FULL, hash chain, FTS5) on a temporary file, with the real backpressure (the
  journal's queue full -> `audit_paused` to the worker -> 503 audit_unavailable);
- off: no `--events-fd`; the worker's events go nowhere (NullSink).

The host runs unpinned (like applianced): its journaling competes for both cores. Rounds
alternate on/off (`--repeat`), each with a fresh worker, host and journal. After an "on" round
the host stops, the journal is verified (`Journal.verify`) and its entries counted against the
responses wrk counted. Loopback only; every run is bounded (`wrk -d`).

    python bench/bench_journal_proxy.py --duration 10 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import Workspace

CREW = "bench0"
GATEWAY = "127.0.0.1"


# --------------------------------------------------------------------------- the host


def worker_config(path: Path) -> None:
    path.write_text(
        "\n".join(
            [
                "[listen]",
                f"port = {common.free_port()}",  # unused: the crew's socket is handed down
                "",
                "[upstream]",
                'ssrf_allow = ["127.0.0.1/32"]',
                f'resolve = {{ "{common.UPSTREAM_HOST}" = "127.0.0.1" }}',
                "",
            ]
        )
    )


def run_host(args: argparse.Namespace) -> int:
    """Play applianced for one worker until SIGTERM; then report (one JSON line on stdout)."""
    import trio

    from appliance.journal import Journal
    from appliance.journal.recorder import JournalRecorder
    from proxycore import control
    from proxycore.io.control_server import ChannelClient

    workdir = Path(args.workdir)
    config = workdir / "proxy.toml"
    worker_config(config)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((GATEWAY, args.port))
    listener.listen(1024)
    journal = Journal(workdir / "journal.db") if args.host == "on" else None
    counts = {"paused": 0}
    cpu: dict[str, tuple[float, float]] = {}

    async def main() -> None:
        control_ours, control_theirs = socket.socketpair()
        events_ours, events_theirs = socket.socketpair()
        argv = [sys.executable, "-m", "proxycore.worker", "--config", str(config)]
        argv += ["--control-fd", str(control_theirs.fileno())]
        pass_fds = [control_theirs.fileno()]
        if args.host == "on":
            argv += ["--events-fd", str(events_theirs.fileno())]
            pass_fds.append(events_theirs.fileno())
        process = await trio.lowlevel.open_process(
            common.pinned(args.worker_core, argv), pass_fds=pass_fds
        )
        control_theirs.close()
        events_theirs.close()
        client = ChannelClient(trio.socket.from_stdlib_socket(control_ours))

        async def paused(flag: bool) -> None:
            counts["paused"] += flag
            await client.request(control.AuditPaused(paused=flag))

        recorder = JournalRecorder(journal, on_backpressure=paused)
        async with trio.open_nursery() as nursery:
            if journal is not None:
                events = trio.SocketStream(trio.socket.from_stdlib_socket(events_ours))
                nursery.start_soon(recorder.ingest_proxy_channel, events, 0)
                await nursery.start(recorder.watch_backpressure)
            with trio.fail_after(30):
                assert (await client.request(control.Ping())).ok
            reply = await client.request(
                control.CrewAdd(
                    name=CREW,
                    gateway=GATEWAY,
                    mode="restricted",
                    allow=(common.UPSTREAM_HOST,),
                    listener=True,
                    # The upstream is on this host's loopback: the crew names it.
                    ssrf_allow=("127.0.0.1/32",),
                ),
                listener=listener,
            )
            assert reply.ok, reply
            cpu["start"] = (own_cpu(), process_cpu(process.pid))
            print("ready", flush=True)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            # CPU used while serving: the worker's, and this host's (the journaling).
            cpu["end"] = (own_cpu(), process_cpu(process.pid))
            # Stop the worker (its channel closes), then read its events to the end.
            control_ours.close()
            with trio.move_on_after(10):
                await process.wait()
            if process.returncode is None:
                process.kill()
            with trio.move_on_after(10):
                while journal is not None and journal.pending:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    trio.run(main)
    report: dict[str, Any] = {
        "mode": args.host,
        "paused_signals": counts["paused"],
        "host_cpu_s": round(cpu["end"][0] - cpu["start"][0], 3),
        "worker_cpu_s": round(cpu["end"][1] - cpu["start"][1], 3),
    }
    if journal is not None:
        journal.close()
        verify = Journal(workdir / "journal.db").verify()
        rows = journal_counts(workdir / "journal.db")
        report.update(verified=verify.ok, entries=verify.entries, by_type=rows)
    print(json.dumps(report), flush=True)
    return 0


def own_cpu() -> float:
    """This process's CPU seconds, all threads (the journal's writer thread included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu(pid: int) -> float:
    """Another process's CPU seconds (utime + stime from /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def journal_counts(path: Path) -> dict[str, int]:
    import sqlite3

    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        counts = dict(db.execute("SELECT type, count(*) FROM entries GROUP BY type").fetchall())
        # The requests inside the batched entries (one proxy.allow holds a batch of them).
        for kind in ("proxy.allow", "proxy.deny"):
            (inside,) = db.execute(
                "SELECT coalesce(sum(json_array_length(payload, '$.requests')), 0) FROM entries "
                "WHERE type = ?",
                (kind,),
            ).fetchone()
            counts[f"{kind} requests"] = int(inside)
        return counts
    finally:
        db.close()


# --------------------------------------------------------------------------- the rounds


def one_round(
    ws: Workspace, mode: str, nginx: common.Service, args: argparse.Namespace, index: int
) -> dict[str, Any]:
    workdir = ws.subdir(f"{mode}-{index}")
    port = common.free_port()
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--host",
        mode,
        "--workdir",
        str(workdir),
        "--port",
        str(port),
    ]
    out = workdir / "host.out"
    env = {**os.environ, "PYTHONPATH": str(args.source)}
    proc = ws.spawn(argv, log=out, note=f"journaling {mode}", cwd=args.source, env=env)
    deadline = time.monotonic() + 60
    while b"ready" not in out.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"host ({mode}) did not start: {out.read_text()[-2000:]}")
        time.sleep(0.05)
    uri = f"http://{common.UPSTREAM_HOST}:{nginx.port}/1k"
    script = common.wrk_script(ws, uri, f"{common.UPSTREAM_HOST}:{nginx.port}")
    result = common.run_wrk(
        ws,
        f"http://{GATEWAY}:{port}",
        duration=args.duration,
        connections=args.connections,
        script=script,
    )
    # SIGTERM to the host alone (not its group: the worker must stop through its channel).
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(60)
    ws.procs.remove(proc)
    report = json.loads(out.read_text().strip().splitlines()[-1])
    data = result.as_dict()
    # Served requests only: a 503 audit_unavailable (journal behind) is fast and not a success.
    served = result.requests - result.non_2xx
    report.update(rps=result.requests_per_s * served / max(1, result.requests), wrk=data)
    return report


def print_tables(summary: dict[str, Any]) -> None:
    on, off, ratios = summary["on_rps"], summary["off_rps"], summary["on_over_off"]
    print("\n## Journaling on vs off (one worker, every request journaled)\n")
    rows = []
    for mode, values in (("journaling off", off), ("journaling on", on)):
        rows.append([mode, f"{common.median(values):.0f}", f"{min(values):.0f}-{max(values):.0f}"])
    print(common.table(["worker", "req/s served (median)", "range"], rows))
    print(
        f"\non / off per round: {', '.join(f'{r:.3f}' for r in ratios)}; median cost "
        f"{summary['median_cost_pct']} % (target < 10 %)"
    )
    cpu = summary["cpu_ms_per_1k"]
    off_total = cpu["off"]["worker"] + cpu["off"]["host"]
    on_total = cpu["on"]["worker"] + cpu["on"]["host"]
    print(
        f"CPU ms per 1,000 served requests (median): off: worker {cpu['off']['worker']}, "
        f"host {cpu['off']['host']}; on: worker {cpu['on']['worker']}, host (journaling) "
        f"{cpu['on']['host']}; total on/off {on_total / off_total:.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run")
    parser.add_argument("--repeat", type=int, default=3, help="on/off round pairs")
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument(
        "--warmup", type=int, default=0, help="unrecorded on/off round pairs first (0)"
    )
    parser.add_argument("--wait-quiet", type=float, default=0.0)
    parser.add_argument("--retry-busy", type=int, default=0)
    parser.add_argument("--source", type=Path, default=common.REPO, help="tree whose code runs")
    parser.add_argument("--json-out", type=Path, default=common.RESULTS_DIR / "journal-proxy.json")
    parser.add_argument("--host", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-core", default=common.PROXY_CORE, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.host:
        return run_host(args)
    common.configure(wait_quiet=args.wait_quiet, retry_busy=args.retry_busy)
    common.raise_fd_limit()
    rounds: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with Workspace("bench-journal-proxy-") as ws:
        nginx = common.start_nginx(ws)
        for index in range(args.warmup):
            for mode in ("off", "on"):
                one_round(ws, mode, nginx, args, -1 - index)
        for index in range(args.repeat):
            order = ("off", "on") if index % 2 == 0 else ("on", "off")
            for mode in order:
                report = one_round(ws, mode, nginx, args, index)
                rounds[mode].append(report)
                print(f"  round {index + 1} {mode}: {report['rps']:.0f} req/s", flush=True)
    for report in rounds["on"]:
        completed = report["wrk"]["requests"] - report["wrk"]["non_2xx"]
        journaled = report["by_type"].get("proxy.allow requests", 0)
        # wrk counts the responses it read within its window; the proxy also served the
        # requests in flight when wrk stopped (at most one per connection).
        report["journal_matches_wrk"] = completed <= journaled <= completed + args.connections
        print(
            f"on round: {report['rps']:.0f} req/s served, wrk read {completed} 2xx, journaled "
            f"{journaled} allowed requests in {report['by_type'].get('proxy.allow', 0)} "
            f"entries ({report['by_type']}), chain verified {report.get('verified')}, "
            f"audit pauses {report['paused_signals']}"
        )
    on = [r["rps"] for r in rounds["on"]]
    off = [r["rps"] for r in rounds["off"]]
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    for report in (*rounds["on"], *rounds["off"]):
        served = max(1, report["wrk"]["requests"] - report["wrk"]["non_2xx"])
        report["worker_cpu_ms_per_1k"] = round(report["worker_cpu_s"] * 1e6 / served, 2)
        report["host_cpu_ms_per_1k"] = round(report["host_cpu_s"] * 1e6 / served, 2)
    summary = {
        "revision": common.source_revision(args.source),
        "duration": args.duration,
        "connections": args.connections,
        "on_rps": on,
        "off_rps": off,
        "on_over_off": ratios,
        "median_cost_pct": round((1 - common.median(ratios)) * 100, 1),
        "cpu_ms_per_1k": {
            mode: {
                "worker": common.median([r["worker_cpu_ms_per_1k"] for r in rounds[mode]]),
                "host": common.median([r["host_cpu_ms_per_1k"] for r in rounds[mode]]),
            }
            for mode in ("off", "on")
        },
        "rounds": rounds,
        "machine": common.versions(),
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.json_out}")
    print_tables(summary)
    if not all(r["verified"] and r["journal_matches_wrk"] for r in rounds["on"]):
        print("a journal did not verify or did not hold every served request", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
