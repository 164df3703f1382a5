"""Crew B's latency while crew A attacks, as a ratio of crew B's latency in quiet.

Theory of operation
-------------------
The world is the chaos suite's (tests/chaos_support.py): crews A and B and the peers in network
namespaces of their own, a real worker pool as applianced runs it (UID 1002, events collected),
every address on this machine. Crew B sends a fixed-rate, open-loop stream
(tests/chaos_client.py: latency from each request's due time, so a stall is paid by every request
queued behind it) to an ordinary peer through the proxy. Each round has two phases of
`--duration` seconds, measured back to back in the same run so that whatever else the machine
does hits both alike:

    quiet    crew B's stream alone
    attack   crew B's stream while crew A runs the attack mix (each attack of
             tests/chaos_attacks.py and tests/chaos_inputs.py in its own loop, all at once)

and a pause of `--settle` seconds after each attack phase, so that the connections the attacks
left behind have timed out before the next quiet phase starts. The figure is crew B's p99 under
attack divided by its p99 in quiet, per round; the median over rounds is reported. Target: at
most 2x. With `--pin` (the default) the workers run on core 0 and everything else (this
process, crew B's client, the attackers, the peers) on core 1, as in bench/common.py.

A worker that dies during a phase ends the run: the ratio of a pool that lost a worker measures
the restart, not the isolation. The run says so, and which attacks were in the mix.

    python bench/bench_under_attack.py [--rounds 3] [--duration 10] [--rate 100]
        [--attacks tunnel-resets,...] [--json-out bench/results/under_attack.json]

Needs root (network namespaces, the workers' privilege drop). Short timeouts as in the suite
(chaos_support.LIMITS), so each attack cycles within seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import trio

from tests import chaos_attacks as attacks
from tests import chaos_inputs as inputs
from tests.chaos_support import Chaos, chaos_pool
from tests.chaos_world import ChaosWorld, chaos_world

TARGET_RATIO = 2.0
WORKERS_CORE = 0
OTHERS_CORE = 1

AttackRun = Callable[[attacks.Attack, ChaosWorld], Awaitable[object]]
ATTACKS: dict[str, AttackRun] = {
    "tunnel-resets": lambda a, w: attacks.tunnel_resets(a, rounds=2),
    "response-resets": lambda a, w: attacks.response_resets(a, rounds=1),
    "half-open": lambda a, w: attacks.half_open(a, rounds=1),
    "slowloris-heads": lambda a, w: attacks.slowloris_heads(a, dribblers=10, flood=20),
    "slowloris-bodies": lambda a, w: attacks.slowloris_bodies(a, rounds=2),
    "keeper-json": lambda a, w: inputs.keeper_json(a, rounds=1),
    "smuggling": lambda a, w: inputs.refused_with_bodies(a, uuid.uuid4().hex[:8], rounds=2),
    "authorities": lambda a, w: inputs.odd_connects(a, w.peer),
    "bad-framing": lambda a, w: inputs.bad_upstream_framing(a, rounds=1),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = min(len(ordered) - 1, max(0, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def phase_summary(result: dict[str, Any], load: dict[str, Any]) -> dict[str, Any]:
    latencies = result.get("latencies_ms", [])
    return {
        "sent": result.get("sent"),
        "ok": result.get("ok"),
        "failures": result.get("failure_count"),
        "p50_ms": round(percentile(latencies, 50), 3),
        "p99_ms": round(percentile(latencies, 99), 3),
        "max_ms": round(max(latencies), 3) if latencies else float("nan"),
        **load,
    }


async def phase(
    chaos: Chaos, args: argparse.Namespace, mix: list[str] | None
) -> tuple[dict[str, Any], int, list[str]]:
    """One phase: crew B's stream for --duration seconds, with crew A's mix if `mix`."""
    requests = 0
    problems: list[str] = []

    async def loop(name: str) -> None:
        nonlocal requests
        while True:
            attack = attacks.Attack(chaos)
            try:
                await ATTACKS[name](attack, chaos.world)
            finally:
                requests += attack.requests
                problems.extend(f"{name}: {p}" for p in attack.problems[:3])

    with common.ForeignLoad(None) as load:
        async with (
            chaos.legit(
                rate=args.rate,
                lead=0.2,
                trail=0.0,
                keepalive=args.keepalive,
                fresh=args.fresh,
                max_seconds=args.duration + 30,
                # Crew B's client measures the proxy, not its own core: on a two-core machine
                # it shares core 1 with the attackers and the peers (at niceness +10, below).
                prefix=("nice", "-n", "-10") if args.pin else (),
            ) as legit,
            trio.open_nursery() as nursery,
        ):
            for name in mix or ():
                nursery.start_soon(loop, name)
            await trio.sleep(args.duration)
            nursery.cancel_scope.cancel()
    return phase_summary(legit.result, load.report()), requests, problems


async def measure(args: argparse.Namespace, world: ChaosWorld, state: Path) -> dict[str, Any]:
    mix = args.attacks
    rounds: list[dict[str, Any]] = []
    outcome: dict[str, Any] = {"attacks": mix, "rounds": rounds, "survived": True}
    async with chaos_pool(world, state, workers=args.workers) as chaos:
        if args.pin:
            for pid in chaos.pids:
                os.sched_setaffinity(pid, {WORKERS_CORE})
                os.setpriority(os.PRIO_PROCESS, pid, 0)  # not this process's +10
        for index in range(args.rounds):
            # --wait-quiet: up to that long for the machine's other processes to calm down.
            await trio.to_thread.run_sync(common.wait_for_quiet, None)
            quiet, _, _ = await phase(chaos, args, None)
            attacked, requests, problems = await phase(chaos, args, mix)
            ratio = attacked["p99_ms"] / quiet["p99_ms"] if quiet["p99_ms"] else float("nan")
            rounds.append(
                {
                    "quiet": quiet,
                    "attack": attacked,
                    "ratio_p99": round(ratio, 2),
                    "a_requests": requests,
                    "a_problems": problems[:10],
                }
            )
            print(
                f"  round {index + 1}: crew B p99 quiet {quiet['p99_ms']} ms, under attack "
                f"{attacked['p99_ms']} ms ({ratio:.2f}x); B failures {quiet['failures']}/"
                f"{attacked['failures']}; crew A sent {requests} requests; others' CPU "
                f"{quiet['foreign_cpu_pct']}%/{attacked['foreign_cpu_pct']}%",
                flush=True,
            )
            common.warn_if_loaded(f"round {index + 1} quiet", quiet)
            common.warn_if_loaded(f"round {index + 1} attack", attacked)
            if chaos.worker_pids() != chaos.pids or chaos.pool.restarts:
                outcome["survived"] = False
                print(
                    f"  a worker died under attack (pids {chaos.pids} -> "
                    f"{chaos.worker_pids()}): the ratio cannot be measured on this code",
                    flush=True,
                )
                break
            await trio.sleep(args.settle)
    ratios = [r["ratio_p99"] for r in rounds]
    outcome["median_ratio_p99"] = statistics.median(ratios) if outcome["survived"] else None
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.common_arguments(parser, duration=10.0, what="seconds per phase")
    parser.add_argument("--rounds", type=int, default=3, help="quiet+attack pairs (default 3)")
    parser.add_argument("--rate", type=float, default=100.0, help="crew B's requests/s")
    parser.add_argument("--keepalive", type=int, default=2, help="crew B's kept-alive threads")
    parser.add_argument("--fresh", type=int, default=1, help="crew B's connection-per-request")
    parser.add_argument("--workers", type=int, default=1, help="proxy workers (default 1)")
    parser.add_argument("--settle", type=float, default=6.0, help="pause after an attack")
    parser.add_argument(
        "--attacks",
        type=lambda text: text.split(","),
        default=list(ATTACKS),
        help=f"comma-separated mix (default all): {','.join(ATTACKS)}",
    )
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin to cores 0 and 1"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.attacks if name not in ATTACKS]
    if unknown:
        parser.error(f"unknown attacks {unknown}; known: {', '.join(ATTACKS)}")
    if os.geteuid() != 0:
        print("bench_under_attack: needs root (network namespaces)", file=sys.stderr)
        return 2
    if args.source.resolve() != common.REPO:
        parser.error("--source: this bench measures its own checkout only")
    if args.pin:
        os.sched_setaffinity(0, {OTHERS_CORE})  # inherited by the peers and crew B's client
        # The attackers (this process) and the peers yield core 1 to crew B's client, which
        # runs at niceness 0 (phase()): the figure is the proxy's isolation, not core 1's.
        os.nice(10)
    common.configure(wait_quiet=args.wait_quiet, retry_busy=args.retry_busy)
    common.header("crew B's p99 under crew A's attacks, against quiet")
    machine = common.describe_machine(common.REPO)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="bench-attack-") as tmp,
        chaos_world(Path(tmp)) as world,
    ):
        outcome = trio.run(measure, args, world, Path(tmp))
    outcome["seconds"] = round(time.monotonic() - started, 1)
    outcome["machine"] = machine
    outcome["settings"] = {
        k: v for k, v in vars(args).items() if k not in ("json_out", "source", "attacks")
    }
    if outcome["survived"]:
        median = outcome["median_ratio_p99"]
        verdict = "meets" if median <= TARGET_RATIO else "misses"
        print(f"\nmedian p99 ratio {median:.2f}x: {verdict} the target of {TARGET_RATIO:g}x")
    common.write_json(args.json_out, outcome)
    return 0 if outcome["survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
