"""Leaf certificate mint time for the crew CA (appliance/crew_ca.py): cold and cached.

Cold: `CrewCA.mint` for a new host each time (an ECDSA P-256 key generated, a certificate built
and signed). Cached: `LeafCache.get` for a host it holds. Wall time per call, p50 and p99, on one
core; `--count` calls each. A benchmark, not a test: it asserts nothing about the figures.

    taskset -c 1 python bench/bench_crew_ca.py --count 2000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appliance.crew_ca import LeafCache, new_ca


def _quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": ordered[len(ordered) // 2] * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="calls per figure")
    args = parser.parse_args()
    ca = new_ca("bench")
    cold = []
    for i in range(args.count):
        start = time.perf_counter()
        ca.mint(f"host{i}.bench.test")
        cold.append(time.perf_counter() - start)
    cache = LeafCache(ca)
    cache.get("cached.bench.test")
    cached = []
    for _ in range(args.count):
        start = time.perf_counter()
        cache.get("cached.bench.test")
        cached.append(time.perf_counter() - start)
    print(json.dumps({"count": args.count, "cold": _quantiles(cold), "cached": _quantiles(cached)}))


if __name__ == "__main__":
    main()
