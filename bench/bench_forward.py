"""Forward-proxy throughput and added latency: 1 KiB responses over keep-alive.

Subjects: nginx direct (no proxy), our proxy (one worker; restricted policy, SSRF check and
events on, as in production), squid, proxy.py, tinyproxy, mitmdump, and our proxy with two
SO_REUSEPORT workers. Each proxy runs pinned to core 0; wrk, the fixed-rate client and nginx are
pinned to core 1 (the two-worker run may use both cores, shared with wrk and nginx).

1. Throughput: `wrk -t1 -c50 --latency` with absolute-form requests, `--repeat` rounds with the
   subjects interleaved (so drift hits all of them alike); the median is reported with the range.
2. Added latency: `fixed_rate.py` at a fixed moderate rate (2,000 req/s over 4 keep-alive
   connections by default), latency from each request's due time; reported as proxy minus direct.

Run `python bench/bench_forward.py --help` for the options.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import Service, Unavailable, Workspace


@dataclass
class Subject:
    name: str
    label: str
    host: str
    port: int
    uri: str
    authority: str
    service: Service | None = None
    rps: list[float] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    latency: dict[str, Any] | None = None


def start_subjects(
    ws: Workspace, args: argparse.Namespace, nginx: Service
) -> tuple[list[Subject], dict[str, str]]:
    direct_authority = f"127.0.0.1:{nginx.port}"
    subjects = [
        Subject(
            "direct",
            "nginx direct (wrk -> nginx, no proxy)",
            nginx.host,
            nginx.port,
            "/1k",
            direct_authority,
        ),
    ]
    unavailable: dict[str, str] = {}
    starters: list[tuple[str, str, Any]] = [
        (
            "ours",
            "ours, 1 worker (core 0)",
            lambda: common.start_ours(ws, source=args.source, tag="ours"),
        ),
    ]
    for peer in args.peers:
        starters.append((peer, f"{peer} (core 0)", lambda peer=peer: common.PEERS[peer](ws)))
    if args.workers2:
        starters.append(
            (
                "ours-2w",
                "ours, 2 workers (not pinned: cores 0-1, shared with wrk and nginx)",
                lambda: common.start_ours(
                    ws, source=args.source, workers=2, core=common.BOTH_CORES, tag="ours-2w"
                ),
            )
        )
    for name, label, start in starters:
        try:
            service = start()
            common.check_forward(service, nginx.port)
        except Unavailable as exc:
            print(f"  ! {name}: not available: {exc}", flush=True)
            unavailable[name] = str(exc)
            continue
        uri, authority = common.forward_target(service.name, nginx.port)
        subjects.append(Subject(name, label, service.host, service.port, uri, authority, service))
    return subjects, unavailable


def measure_throughput(ws: Workspace, args: argparse.Namespace, subjects: list[Subject]) -> None:
    for round_index in range(args.repeat):
        for subject in subjects:
            url = f"http://{subject.host}:{subject.port}"
            script = None
            if subject.name == "direct":
                url += subject.uri
            else:
                script = common.wrk_script(ws, subject.uri, subject.authority)
            if round_index == 0 and args.warmup > 0:
                common.run_wrk(
                    ws,
                    url,
                    duration=args.warmup,
                    warmup=True,
                    connections=args.connections,
                    script=script,
                )
            result = common.run_wrk(
                ws, url, duration=args.duration, connections=args.connections, script=script
            )
            errors = sum(result.socket_errors.values())
            print(
                f"  round {round_index + 1} {subject.name}: {result.requests_per_s:,.0f} req/s"
                f" (non-2xx {result.non_2xx}, socket errors {errors})",
                flush=True,
            )
            common.warn_if_loaded(subject.name, result.foreign)
            if result.non_2xx > 0.01 * result.requests:
                print(
                    f"  ! {subject.name}: {result.non_2xx} non-2xx responses: figure invalid",
                    flush=True,
                )
            subject.rps.append(result.requests_per_s)
            subject.runs.append(result.as_dict())


def measure_latency(ws: Workspace, args: argparse.Namespace, subjects: list[Subject]) -> None:
    for subject in subjects:
        result = common.run_fixed_rate(
            ws,
            host=subject.host,
            port=subject.port,
            uri=subject.uri,
            authority=subject.authority,
            rate=args.rate,
            duration=args.latency_duration or args.duration,
            connections=args.latency_connections,
        )
        subject.latency = result
        lat = result["latency_ms"]
        print(
            f"  {subject.name}: achieved {result['achieved_rate']:,.0f}/s, p50 {lat['p50']} ms,"
            f" p99 {lat['p99']} ms, errors {result['errors']}, not sent {result['not_sent']}",
            flush=True,
        )
        common.warn_if_loaded(subject.name, result)


def count_events(subject: Subject) -> int | None:
    if subject.service is None or "events" not in subject.service.extra:
        return None
    path: Path = subject.service.extra["events"]
    try:
        with path.open("rb") as events:
            return sum(1 for _ in events)
    except OSError:
        return 0


def sustained(latency: dict[str, Any]) -> bool:
    return bool(
        latency["achieved_rate"] >= 0.97 * latency["target_rate"]
        and not latency["errors"]
        and not latency["not_sent"]
        and not latency["non_200"]
    )


def summarize(
    args: argparse.Namespace, subjects: list[Subject], unavailable: dict[str, str]
) -> dict[str, Any]:
    by_name = {s.name: s for s in subjects}
    ours = by_name.get("ours")
    direct = by_name["direct"]
    direct_lat = direct.latency["latency_ms"] if direct.latency else None
    rows: list[dict[str, Any]] = []
    for subject in subjects:
        rps = common.median(subject.rps) if subject.rps else None
        row: dict[str, Any] = {
            "name": subject.name,
            "label": subject.label,
            "available": True,
            "req_per_s": rps,
            "req_per_s_runs": subject.rps,
            # Per round (the subjects are interleaved), then the median: drift between rounds
            # moves both figures of a pair alike.
            "ours_over_this": (
                common.median([o / t for o, t in zip(ours.rps, subject.rps, strict=True)])
                if ours and ours.rps and subject.rps
                else None
            ),
            "wrk_runs": subject.runs,
            "latency": subject.latency,
            "events_written": count_events(subject),
        }
        if subject.latency and direct_lat:
            lat = subject.latency["latency_ms"]
            row["added_p50_ms"] = lat["p50"] - direct_lat["p50"]
            row["added_p99_ms"] = lat["p99"] - direct_lat["p99"]
            row["sustained_rate"] = sustained(subject.latency)
        rows.append(row)
    for name, reason in unavailable.items():
        rows.append({"name": name, "available": False, "reason": reason})
    return {
        "benchmark": "forward",
        "parameters": {
            "duration_s": args.duration,
            "connections": args.connections,
            "repeat": args.repeat,
            "warmup_s": args.warmup,
            "latency_rate": args.rate,
            "latency_duration_s": args.latency_duration or args.duration,
            "latency_connections": args.latency_connections,
            "body_bytes": common.BODY_SIZE,
        },
        "subjects": rows,
    }


def print_tables(summary: dict[str, Any]) -> None:
    params = summary["parameters"]
    common.header(
        f"Forward proxy, 1 KiB over keep-alive (wrk -t1 -c{params['connections']}, "
        f"{params['duration_s']:g} s x {params['repeat']}, median)"
    )
    rows = []
    for row in summary["subjects"]:
        if not row["available"]:
            reason = row["reason"].splitlines()[0]
            rows.append([row["name"], None, None, None, None, f"not available: {reason}"])
            continue
        runs = row["req_per_s_runs"]
        spread = f"{min(runs):,.0f}-{max(runs):,.0f}" if runs else ""
        note = row["label"]
        errors = sum(sum(r["socket_errors"].values()) for r in row["wrk_runs"])
        if errors:
            note += f"; {errors:,} socket errors (the proxy closed connections, wrk reconnected)"
        if row.get("events_written"):
            note += f"; {row['events_written']:,} events written"
        others = round(max(r["foreign"]["foreign_cpu_pct"] for r in row["wrk_runs"]))
        rows.append([row["name"], row["req_per_s"], spread, row["ours_over_this"], others, note])
    print(
        common.table(["subject", "req/s", "range", "ours / this", "others' CPU %", "notes"], rows)
    )
    common.header(
        f"Added latency at {params['latency_rate']:,} req/s fixed rate "
        f"({params['latency_connections']} keep-alive connections, "
        f"{params['latency_duration_s']:g} s; latency from the due time)"
    )
    rows = []
    for row in summary["subjects"]:
        if not row["available"] or not row.get("latency"):
            continue
        latency = row["latency"]
        note = ""
        if row["name"] == "direct":
            note = "baseline"
        elif not row.get("sustained_rate", True):
            note = (
                f"did not sustain the rate: {latency['achieved_rate']:,.0f}/s, "
                f"{latency['not_sent']:,} not sent, {latency['errors']:,} errors"
            )
        if latency["connects"] > params["latency_connections"] and row["name"] != "direct":
            note += f"{'; ' if note else ''}{latency['connects']:,} connections opened"
        rows.append(
            [
                row["name"],
                latency["latency_ms"]["p50"],
                latency["latency_ms"]["p99"],
                row.get("added_p50_ms"),
                row.get("added_p99_ms"),
                round(latency["foreign_cpu_pct"]),
                note,
            ]
        )
    print(
        common.table(
            [
                "subject",
                "p50 ms",
                "p99 ms",
                "added p50 ms",
                "added p99 ms",
                "others' CPU %",
                "notes",
            ],
            rows,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="All traffic stays on 127.0.0.0/8; every run is bounded by --duration.",
    )
    common.common_arguments(parser, duration=10.0)
    parser.add_argument("--connections", type=int, default=50, help="wrk connections (50)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unrecorded wrk seconds (2)")
    parser.add_argument("--rate", type=int, default=2000, help="fixed-rate req/s (2000)")
    parser.add_argument(
        "--latency-duration",
        type=float,
        default=None,
        help="seconds of the fixed-rate run (default: --duration)",
    )
    parser.add_argument(
        "--latency-connections", type=int, default=4, help="fixed-rate keep-alive connections (4)"
    )
    parser.add_argument(
        "--peers",
        default=",".join(common.PEERS),
        help=f"comma-separated peers (default {','.join(common.PEERS)})",
    )
    parser.add_argument(
        "--no-workers2", dest="workers2", action="store_false", help="skip our proxy with 2 workers"
    )
    args = parser.parse_args(argv)
    args.peers = [p for p in args.peers.split(",") if p]
    for peer in args.peers:
        if peer not in common.PEERS:
            parser.error(f"unknown peer {peer!r}; known: {', '.join(common.PEERS)}")
    common.raise_fd_limit()
    common.configure(wait_quiet=args.wait_quiet, retry_busy=args.retry_busy)
    started = time.monotonic()
    machine = common.describe_machine(args.source)
    print(f"# bench_forward: {machine['date']}, source {args.source} ({machine['revision']})")
    with Workspace(prefix="bench-forward-") as ws:
        nginx = common.start_nginx(ws)
        subjects, unavailable = start_subjects(ws, args, nginx)
        with common.section("throughput (wrk)"):
            measure_throughput(ws, args, subjects)
        with common.section("added latency (fixed rate)"):
            measure_latency(ws, args, subjects)
        time.sleep(0.5)  # let the event sinks flush
        summary = summarize(args, subjects, unavailable)
    summary["machine"] = machine
    summary["elapsed_s"] = round(time.monotonic() - started)
    print_tables(summary)
    common.write_json(args.json_out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
