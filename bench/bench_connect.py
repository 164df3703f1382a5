"""CONNECT tunnel throughput: one bulk transfer (2 GiB of zeros by default), end to end.

A source writes N bytes to a sink (both `bench/stream.py`, both pinned to core 1) over four
paths: direct (no relay), through socat (a plain TCP relay, with its default 8 KiB buffer and with
a 1 MiB buffer), through squid's CONNECT, and through our proxy's CONNECT tunnel (which moves the
bytes with os.splice). Every relay is pinned to core 0. The clock starts once the path is open
(after the CONNECT handshake) and stops when the sink has counted the last byte. GB/s is 10^9
bytes per second; the median of --repeat runs is reported, with the ratio of ours to each.

Run `python bench/bench_connect.py --help` for the options.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import Service, Unavailable, Workspace

SINK_HOST = "sink.test"  # resolved by our proxy's split-horizon table


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def start_sink(ws: Workspace) -> Service:
    root = ws.subdir("sink")
    port = common.free_port()
    argv = common.pinned(
        common.LOAD_CORE,
        [
            sys.executable,
            str(common.BENCH_DIR / "stream.py"),
            "sink",
            "--listen",
            f"127.0.0.1:{port}",
        ],
    )
    proc = ws.spawn(argv, log=root / "sink.log", note="the sink")
    service = Service("sink", "127.0.0.1", port, proc, argv, root / "sink.log")
    common.wait_for_port(service.host, service.port, proc)
    return service


def transfer(
    ws: Workspace, sink: Service, size: int, proxy: Service | None, timeout: float
) -> dict[str, Any]:
    if proxy is None:
        path = ["--target", f"127.0.0.1:{sink.port}"]
    elif proxy.name == "socat":
        path = ["--target", f"{proxy.host}:{proxy.port}"]  # a plain relay: no CONNECT
    else:
        host = SINK_HOST if proxy.name.startswith("ours") else "127.0.0.1"
        path = ["--target", f"{host}:{sink.port}", "--proxy", f"{proxy.host}:{proxy.port}"]
    argv = common.pinned(
        common.LOAD_CORE,
        [
            sys.executable,
            str(common.BENCH_DIR / "stream.py"),
            "source",
            *path,
            "--bytes",
            str(size),
            "--timeout",
            str(timeout),
        ],
    )
    output, foreign = common.run_measured(ws, argv, timeout=timeout + 30)
    result: dict[str, Any] = json.loads(output)
    result.update(foreign)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="All traffic stays on 127.0.0.0/8; every transfer is bounded by --duration.",
    )
    common.common_arguments(parser, duration=120.0, what="upper bound in seconds on each transfer")
    parser.add_argument(
        "--size", type=parse_size, default=2 << 30, help="bytes per transfer, e.g. 256M (2G)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--peers", default="socat,squid", help="relays besides ours (socat,squid)")
    args = parser.parse_args(argv)
    # --duration bounds each transfer here (a transfer is sized, not timed).
    timeout = args.duration
    args.peers = [p for p in args.peers.split(",") if p]
    common.raise_fd_limit()
    common.configure(wait_quiet=args.wait_quiet, retry_busy=args.retry_busy)
    started = time.monotonic()
    machine = common.describe_machine(args.source)
    print(f"# bench_connect: {machine['date']}, source {args.source} ({machine['revision']})")
    paths: list[tuple[str, str, Service | None]] = []
    unavailable: dict[str, str] = {}
    with Workspace(prefix="bench-connect-") as ws:
        sink = start_sink(ws)
        paths.append(("direct", "direct (source -> sink, no relay)", None))
        starters: list[tuple[str, str, Any]] = [
            (
                "ours",
                "ours, CONNECT tunnel, 1 worker (core 0), splice",
                lambda: common.start_ours(ws, source=args.source, allow=(SINK_HOST,)),
            ),
        ]
        if "socat" in args.peers:
            starters.append(
                (
                    "socat-8k",
                    "socat, default 8 KiB buffer (core 0)",
                    lambda: common.start_socat_forwarder(ws, sink.port, buffer=8192),
                )
            )
            starters.append(
                (
                    "socat-1m",
                    "socat -b 1048576 (core 0)",
                    lambda: common.start_socat_forwarder(ws, sink.port, buffer=1 << 20),
                )
            )
        if "squid" in args.peers:
            starters.append(
                ("squid", "squid, CONNECT tunnel (core 0)", lambda: common.start_squid(ws))
            )
        for name, label, start in starters:
            try:
                paths.append((name, label, start()))
            except Unavailable as exc:
                print(f"  ! {name}: not available: {exc}", flush=True)
                unavailable[name] = str(exc)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in paths}
        with common.section(f"transfers of {args.size:,} bytes"):
            for round_index in range(args.repeat):
                for name, _, service in paths:
                    result = transfer(ws, sink, args.size, service, timeout)
                    print(
                        f"  round {round_index + 1} {name}: {result['gb_per_s']:.2f} GB/s "
                        f"({result['seconds']:.2f} s)",
                        flush=True,
                    )
                    common.warn_if_loaded(name, result)
                    runs[name].append(result)
    ours_runs = [r["gb_per_s"] for r in runs.get("ours", [])]
    rows: list[dict[str, Any]] = []
    for name, label, _ in paths:
        rates = [r["gb_per_s"] for r in runs[name]]
        rate = common.median(rates)
        rows.append(
            {
                "name": name,
                "label": label,
                "available": True,
                "gb_per_s": rate,
                "gb_per_s_runs": rates,
                # Per round (interleaved), then the median.
                "ours_over_this": common.median(
                    [o / t for o, t in zip(ours_runs, rates, strict=True)]
                )
                if ours_runs
                else None,
                "runs": runs[name],
            }
        )
    for name, reason in unavailable.items():
        rows.append({"name": name, "available": False, "reason": reason})
    summary = {
        "benchmark": "connect",
        "parameters": {"bytes": args.size, "repeat": args.repeat, "timeout_s": timeout},
        "subjects": rows,
        "machine": machine,
        "elapsed_s": round(time.monotonic() - started),
    }
    print_tables(summary)
    common.write_json(args.json_out, summary)
    return 0


def print_tables(summary: dict[str, Any]) -> None:
    params = summary["parameters"]
    common.header(
        f"CONNECT throughput, {params['bytes'] / (1 << 30):g} GiB per transfer "
        f"(median of {params['repeat']}; GB = 10^9 bytes)"
    )
    rows = []
    for row in summary["subjects"]:
        if not row["available"]:
            rows.append([row["name"], None, "", None, None, "not available: " + row["reason"]])
            continue
        runs = row["gb_per_s_runs"]
        others = round(max(r["foreign_cpu_pct"] for r in row["runs"]))
        rows.append(
            [
                row["name"],
                row["gb_per_s"],
                f"{min(runs):.2f}-{max(runs):.2f}",
                row["ours_over_this"],
                others,
                row["label"],
            ]
        )
    print(common.table(["path", "GB/s", "range", "ours / this", "others' CPU %", "notes"], rows))


if __name__ == "__main__":
    sys.exit(main())
