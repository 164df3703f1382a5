"""Run the whole benchmark suite and write bench/results/latest.json plus markdown tables.

Runs bench_forward.py, bench_capacity.py, bench_connect.py, bench_scrub.py, bench_crews.py,
bench_journal_proxy.py and bench_h2.py one after another (each as its own process, each
command printed), gathers their JSON into bench/results/latest.json (a copy with the date in its
name stays beside it) and prints every table as markdown, ready for docs/benchmarks.md.
`--quick` shortens every run for a smoke test; its figures are not for the document.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_capacity
import bench_connect
import bench_crews
import bench_forward
import bench_h2
import bench_journal_proxy
import bench_scrub
import common

SUITES = {
    "forward": (bench_forward, "bench_forward.py"),
    "capacity": (bench_capacity, "bench_capacity.py"),
    "connect": (bench_connect, "bench_connect.py"),
    "scrub": (bench_scrub, "bench_scrub.py"),
    "crews": (bench_crews, "bench_crews.py"),
    "journal-proxy": (bench_journal_proxy, "bench_journal_proxy.py"),
    "h2": (bench_h2, "bench_h2.py"),
}


def suite_arguments(name: str, args: argparse.Namespace) -> list[str]:
    extra = ["--source", str(args.source), "--wait-quiet", f"{args.wait_quiet:g}"]
    extra += ["--retry-busy", str(args.retry_busy)]
    if name == "connect":
        extra += ["--size", args.size, "--repeat", str(args.repeat)]
        return extra
    if name == "crews":  # root, the engine and the images; 50 crews (5 with --quick)
        return [*extra, *(["--crews", "5"] if args.quick else [])]
    if name == "scrub":  # in-process, no load generator: no --duration
        return [*extra, "--repeat", str(args.repeat), *(["--quick"] if args.quick else [])]
    extra += ["--duration", f"{args.duration:g}", "--repeat", str(args.repeat)]
    if args.quick:
        extra += ["--warmup", "1"]
        if name in ("capacity", "h2"):
            extra += ["--connections", "200"]
    return extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load run (10)")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds per suite (3)")
    parser.add_argument("--size", default="2G", help="bytes per CONNECT transfer (2G)")
    parser.add_argument(
        "--only", default=",".join(SUITES), help=f"comma-separated suites ({','.join(SUITES)})"
    )
    parser.add_argument("--source", type=Path, default=common.REPO, help="tree under test")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="passed to each suite: wait up to this many seconds for a quiet machine (0)",
    )
    parser.add_argument(
        "--retry-busy",
        type=int,
        default=0,
        help="passed to each suite: re-run a disturbed measurement up to this many times (0)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 2 s runs, 1 round, 256 MiB transfers"
    )
    parser.add_argument(
        "--out", type=Path, default=common.RESULTS_DIR / "latest.json", help="combined JSON"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.repeat, args.size = 2.0, 1, "256M"
    selected = [name for name in args.only.split(",") if name]
    for name in selected:
        if name not in SUITES:
            parser.error(f"unknown suite {name!r}")
    started = time.monotonic()
    combined: dict[str, Any] = {
        "machine": common.describe_machine(args.source),
        "quick": args.quick,
        "suites": {},
        "failed": {},
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in selected:
        _, script = SUITES[name]
        out = common.RESULTS_DIR / f"{name}-{stamp}.json"
        argv_suite = [
            sys.executable,
            str(common.BENCH_DIR / script),
            *suite_arguments(name, args),
            "--json-out",
            str(out),
        ]
        common.show(argv_suite)
        code = subprocess.run(argv_suite, check=False).returncode
        if code != 0 or not out.exists():
            combined["failed"][name] = f"exit status {code}"
            print(f"! {name} failed with exit status {code}", flush=True)
            continue
        combined["suites"][name] = json.loads(out.read_text())
    combined["elapsed_s"] = round(time.monotonic() - started)
    common.write_json(args.out, combined)
    common.write_json(args.out.with_name(f"all-{stamp}.json"), combined)
    print("\n# Results (markdown)")
    for name, data in combined["suites"].items():
        SUITES[name][0].print_tables(data)
    for name, reason in combined["failed"].items():
        print(f"\n{name}: not measured ({reason})")
    return 1 if combined["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
