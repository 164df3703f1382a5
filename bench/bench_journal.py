"""Journal appends per second and acknowledgment latency, per fsync policy.

For each `synchronous` setting (FULL: the documented policy, an fsync of the WAL per group
commit plus an fdatasync of the head anchor; NORMAL and OFF for comparison, anchor not synced):

- flood: one producer submits N entries as fast as the bounded queue takes them (it retries
  when JournalFull says the queue is at capacity), timed until the last one is acknowledged:
  sustained appends/s with group commit at its best;
- closed loop with C concurrent producers (threads), each submitting one entry and waiting for
  its acknowledgment before the next, for --seconds: appends/s and p50/p99 of submit -> ack.

Entries are realistic `proxy.allow` records (scrubbed like every payload). The files live in
--dir (default /var/tmp: a real disk, not tmpfs), fresh for each run.

    /work/main/.venv/bin/python bench/bench_journal.py [--entries 20000] [--seconds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appliance.journal import Journal, JournalFull
from appliance.journal import entries as E


def entry(i: int) -> E.Entry:
    """One allowed request as its own entry (the proxy batches a crew's requests into one
    entry per batch; this measures the journal per entry)."""
    request = E.AllowedRequest(
        time.time(), "forward", "GET", f"pypi{i % 7}.example.org", 443, "10.20.30.40",
        "allowlist: pypi.example.org",
    )  # fmt: skip
    return E.ProxyAllow(crew="crew-bench", mode="restricted", requests=(request,))


def flood(directory: Path, synchronous: str, count: int) -> dict[str, Any]:
    journal = Journal(directory / "journal.db", synchronous=synchronous)
    try:
        start = time.perf_counter()
        last = None
        full = 0
        for i in range(count):
            while True:
                try:
                    last = journal.submit(entry(i))
                    break
                except JournalFull:
                    full += 1
                    time.sleep(0.0005)
        assert last is not None
        last.wait(120)
        elapsed = time.perf_counter() - start
        assert journal.verify().ok
    finally:
        journal.close()
    return {"entries": count, "seconds": elapsed, "per_second": count / elapsed, "full": full}


def closed_loop(
    directory: Path, synchronous: str, producers: int, seconds: float
) -> dict[str, Any]:
    journal = Journal(directory / "journal.db", synchronous=synchronous)
    latencies: list[list[float]] = [[] for _ in range(producers)]
    stop = time.perf_counter() + seconds

    def produce(index: int) -> None:
        mine = latencies[index]
        i = 0
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            journal.submit(entry(i)).wait(60)
            mine.append(time.perf_counter() - t0)
            i += 1

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    journal.close()
    every = sorted(x for part in latencies for x in part)
    q = statistics.quantiles(every, n=100)
    return {
        "producers": producers,
        "entries": len(every),
        "per_second": len(every) / elapsed,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=20_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--producers", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    for synchronous in ("FULL", "NORMAL", "OFF"):
        runs = [("flood", None)] + [("closed", p) for p in args.producers]
        for kind, producers in runs:
            directory = Path(tempfile.mkdtemp(prefix="bench-journal-", dir=args.dir))
            try:
                if kind == "flood":
                    result = flood(directory, synchronous, args.entries)
                else:
                    assert producers is not None
                    result = closed_loop(directory, synchronous, producers, args.seconds)
            finally:
                shutil.rmtree(directory)
            result.update(synchronous=synchronous, kind=kind)
            results.append(result)
            if not args.json:
                line = f"{synchronous:<7} {kind:<6}"
                if kind == "flood":
                    line += f"            {result['per_second']:>9.0f}/s"
                else:
                    line += (
                        f" x{result['producers']:<3}       {result['per_second']:>9.0f}/s  "
                        f"p50 {result['p50_ms']:.2f} ms  p99 {result['p99_ms']:.2f} ms"
                    )
                print(line, flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
