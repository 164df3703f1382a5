"""Per-crew network setup and teardown time: veth plumbing plus nftables rules, on the real kernel.

For each of --crews crews (100 by default), a fresh network namespace is made (untimed, as the
crew's infra container would be) and the clock covers `CrewNetworks.attach` (state record, one
nftables transaction, IPv6 off in the namespace, veth with its peer born in the namespace,
addresses, routes, state commit) and then `CrewNetworks.release` (veth and rules removed,
subnet freed). This is measured twice: with no other crew present, and with --present crews
(200 by default) attached, to show that the cost does not grow with the number of crews. The
time of the nftables step alone is reported too (from the `on_step` callback), as is the time
of one `reconcile` and one `show` with all those crews present.

Needs root. Everything lives in namespaces the benchmark makes, under a table and an interface
prefix of its own (`appliance_bench_<random>`, `b<random>`), all removed at the end; no packet
is sent anywhere.

    python bench/bench_netns.py [--crews 100] [--present 200] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from netns import CrewNetworks, NetConfig


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[rank]


def summary(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
    }


class StepClock:
    """Times each step of attach and release from the `on_step` callbacks."""

    def __init__(self) -> None:
        self.last = 0.0
        self.steps: dict[str, list[float]] = {}

    def start(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, crew: str, step: str) -> None:
        now = time.perf_counter()
        self.steps.setdefault(step, []).append(now - self.last)
        self.last = now


@contextmanager
def namespaces(tag: str, count: int) -> Iterator[list[str]]:
    names: list[str] = []
    try:
        for i in range(count):
            name = f"bench-{tag}-{i}"
            subprocess.run(["ip", "netns", "add", name], check=True)
            names.append(name)
        yield names
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False)


def cycles(net: CrewNetworks, clock: StepClock, names: list[str], prefix: str) -> dict[str, Any]:
    setup: list[float] = []
    teardown: list[float] = []
    both: list[float] = []
    clock.steps.clear()
    for i, name in enumerate(names):
        crew = f"{prefix}-{i}"
        clock.start()
        t0 = time.perf_counter()
        net.attach(crew, f"/run/netns/{name}")
        t1 = time.perf_counter()
        clock.start()
        net.release(crew)
        t2 = time.perf_counter()
        setup.append(t1 - t0)
        teardown.append(t2 - t1)
        both.append(t2 - t0)
    return {
        "setup": summary(setup),
        "teardown": summary(teardown),
        "setup_plus_teardown": summary(both),
        # The nftables transactions alone (one batch each), and the kernel's veth work.
        "nft_install": summary(clock.steps["install rules"]),
        "nft_remove": summary(clock.steps["remove rules"]),
        "veth_create": summary(clock.steps["create veth"]),
        "veth_delete": summary(clock.steps["delete veth"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crews", type=int, default=100, help="timed setup/teardown cycles")
    parser.add_argument("--present", type=int, default=200, help="crews attached in phase 2")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_netns: needs root (network namespaces, nftables)", file=sys.stderr)
        return 2

    tag = uuid.uuid4().hex[:4]
    config = NetConfig(
        pool="100.91.0.0/16",
        table=f"appliance_bench_{tag}",
        ifname_prefix=f"b{tag}",
        proxy_ports=(9119,),
    )
    clock = StepClock()
    results: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.release()} {os.cpu_count()} cores",
        "python": platform.python_version(),
        "crews": args.crews,
        "present": args.present,
    }
    with (
        tempfile.TemporaryDirectory() as state_dir,
        CrewNetworks(config, state_dir, on_step=clock) as net,
        namespaces(tag, args.crews + args.present) as names,
    ):
        try:
            net.reconcile()
            timed, background = names[: args.crews], names[args.crews :]
            results["empty"] = cycles(net, clock, timed, "empty")

            fill: list[float] = []
            for i, name in enumerate(background):
                t0 = time.perf_counter()
                net.attach(f"present-{i}", f"/run/netns/{name}")
                fill.append(time.perf_counter() - t0)
            results["filling"] = {
                "first_20": summary(fill[:20]),
                "last_20": summary(fill[-20:]),
            }
            results["with_present"] = cycles(net, clock, timed, "busy")
            t0 = time.perf_counter()
            report = net.reconcile()
            results["reconcile_ms"] = round((time.perf_counter() - t0) * 1000, 1)
            assert not report.changes, report
            t0 = time.perf_counter()
            shown = net.show()
            results["show_ms"] = round((time.perf_counter() - t0) * 1000, 1)
            assert len(shown.crews) == args.present
            t0 = time.perf_counter()
            for i in range(len(background)):
                net.release(f"present-{i}")
            results["release_all_present_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        finally:
            net.delete_table()
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
