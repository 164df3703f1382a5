"""bench_h2.py's summary (JSON) and its markdown tables, ready for docs/benchmarks.md.

Ratios are computed per round (the subjects are interleaved, so a pair was measured minutes
apart at most) and the median ratio is reported, as in bench_forward.py.
"""

from __future__ import annotations

import argparse
from typing import Any

import common


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return common.median(present) if present else None


def _ratio(ours: list[dict[str, Any]], this: list[dict[str, Any]], key: str) -> float | None:
    pairs = [o[key] / t[key] for o, t in zip(ours, this, strict=False) if o.get(key) and t.get(key)]
    return common.median(pairs) if pairs else None


def summarize(
    args: argparse.Namespace,
    subjects: list[Any],
    unavailable: dict[str, str],
    ours_h1_runs: list[dict[str, Any]],
    memory: list[dict[str, Any]],
) -> dict[str, Any]:
    by_key = {(s.name, s.leg): s for s in subjects}
    h1_rps = _median([r["requests_per_s"] for r in ours_h1_runs])
    h1_core = _median([r["req_per_core_s"] for r in ours_h1_runs])
    rows: list[dict[str, Any]] = []
    for subject in subjects:
        ours = by_key.get(("ours", subject.leg))
        for level, runs in subject.runs.items():
            rates = [r["streams_per_s"] for r in runs]
            ours_runs = ours.runs.get(level, []) if ours else []
            row = {
                "name": subject.name,
                "leg": subject.leg,
                "level": level,
                "available": True,
                "streams_per_s": common.median(rates),
                "streams_per_s_runs": rates,
                "proxy_cpu_pct": _median([r["proxy_cpu_pct"] for r in runs]),
                "streams_per_core_s": _median([r["streams_per_core_s"] for r in runs]),
                "p50_ms": _median([r.get("p50_ms") for r in runs]),
                "p99_ms": _median([r.get("p99_ms") for r in runs]),
                "not_2xx_or_failed": sum(
                    r["failed"] + r["errored"] + r["timeout"] + r.get("non_2xx", 0) for r in runs
                ),
                "streams": sum(r["total"] for r in runs),
                "others_cpu_pct_max": max(r["foreign"]["foreign_cpu_pct"] for r in runs),
                "ours_over_this": _ratio(ours_runs, runs, "streams_per_s"),
                "ours_over_this_per_core": _ratio(ours_runs, runs, "streams_per_core_s"),
                "runs": runs,
            }
            if subject.name == "ours" and h1_rps:
                row["over_ours_http1"] = row["streams_per_s"] / h1_rps
                if h1_core and row["streams_per_core_s"]:
                    row["over_ours_http1_per_core"] = row["streams_per_core_s"] / h1_core
            rows.append(row)
    for key, reason in unavailable.items():
        name, leg = key.split("/")
        rows.append({"name": name, "leg": leg, "available": False, "reason": reason})
    return {
        "benchmark": "h2",
        "parameters": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "repeat": args.repeat,
            "levels": args.levels,
            "memory_connections": args.connections if args.memory else None,
            "body_bytes": common.BODY_SIZE,
        },
        "ours_http1": {
            "req_per_s": h1_rps,
            "req_per_s_runs": [r["requests_per_s"] for r in ours_h1_runs],
            "proxy_cpu_pct": _median([r["proxy_cpu_pct"] for r in ours_h1_runs]),
            "req_per_core_s": h1_core,
            "others_cpu_pct_max": max(
                (r["foreign"]["foreign_cpu_pct"] for r in ours_h1_runs), default=None
            ),
            "runs": ours_h1_runs,
        },
        "subjects": rows,
        "memory": memory,
    }


def print_tables(summary: dict[str, Any]) -> None:
    params = summary["parameters"]
    h1 = summary["ours_http1"]
    for leg, what in (("h1", "an HTTP/1.1 upstream"), ("h2c", "an h2c upstream")):
        common.header(
            f"h2c agent side to {what}: h2load -t1 -cC -mM, {params['duration_s']:g} s "
            f"x {params['repeat']} (median); proxy on core 0"
        )
        rows = []
        for row in summary["subjects"]:
            if row["leg"] != leg:
                continue
            if not row["available"]:
                reason = row["reason"].splitlines()[0]
                name = "ours: no h2c yet" if reason.startswith("no h2c yet") else row["name"]
                rows.append([name, None, None, None, None, None, None, None, None, reason])
                continue
            runs = row["streams_per_s_runs"]
            notes = [f"{row['others_cpu_pct_max']:.0f}"]
            if row["name"] == "direct":
                notes.append("no proxy: the load side's ceiling")
            # A stream or two in flight when -D ends is counted as failed; more is a finding.
            if row["not_2xx_or_failed"] > 0.001 * row["streams"]:
                notes.append(f"{row['not_2xx_or_failed']:,} failed or not 2xx")
            if "over_ours_http1_per_core" in row:
                notes.append(f"{row['over_ours_http1_per_core']:.2f}x our HTTP/1.1 per core")
            rows.append(
                [
                    row["name"],
                    row["level"],
                    row["streams_per_s"],
                    f"{min(runs):,.0f}-{max(runs):,.0f}",
                    row["proxy_cpu_pct"],
                    row["streams_per_core_s"],
                    row["p50_ms"],
                    row["p99_ms"],
                    row["ours_over_this_per_core"],
                    "; ".join(notes),
                ]
            )
        headers = [
            "subject",
            "CxM",
            "streams/s",
            "range",
            "proxy CPU %",
            "streams/core-s",
            "p50 ms",
            "p99 ms",
            "ours / this per core",
            "others' CPU %; notes",
        ]
        print(common.table(headers, rows))
    common.header("Ours over HTTP/1.1 in the same run (bench_forward's method: wrk -t1 -c50)")
    if h1["req_per_s"] is None:
        print("not measured")
    else:
        runs = h1["req_per_s_runs"]
        print(
            common.table(
                ["subject", "req/s", "range", "proxy CPU %", "req/core-s", "others' CPU %"],
                [
                    [
                        "ours HTTP/1.1",
                        h1["req_per_s"],
                        f"{min(runs):,.0f}-{max(runs):,.0f}",
                        h1["proxy_cpu_pct"],
                        h1["req_per_core_s"],
                        h1["others_cpu_pct_max"],
                    ]
                ],
            )
        )
    if summary["memory"]:
        common.header(
            f"Memory per idle h2 connection ({params['memory_connections']:,} h2c connections, "
            "each carried one request; RSS of the process group)"
        )
        rows = []
        for row in summary["memory"]:
            if "error" in row:
                rows.append([row["subject"], None, None, None, None, None, row["error"]])
                continue
            rows.append(
                [
                    row["subject"],
                    row["rss_idle_kib"],
                    row["rss_with_kib"],
                    row["kib_per_connection"],
                    row["fds_per_connection"],
                    row["kernel_slab_kib_per_connection"],
                    "",
                ]
            )
        headers = [
            "subject",
            "RSS idle KiB",
            "RSS with KiB",
            "RSS KiB/conn",
            "fds/conn",
            "slab KiB/conn (all ends)",
            "notes",
        ]
        print(common.table(headers, rows))
