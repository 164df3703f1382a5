"""Retention on a big journal: how long a prune takes, how long it holds up the recorder, and
whether the files shrink.

- fill: N entries (default 1,000,000; a mix like applianced's: `proxy.allow` batches of three
  requests, runs, allowlist changes, injected credentials) with timestamps spread evenly over
  60 days, written through `Journal` (synchronous=OFF for the fill only: it is setup);
- reopen with synchronous=FULL (applianced's policy) and start a producer thread that submits
  entries at --rate per second, recording each one's submit -> acknowledgment latency and the
  queue's depth (the proxy refuses crew traffic only when the queue, 10,000, is full);
- measure a baseline for --baseline seconds, then prune with keep_days 6 (90 % of the entries)
  while the producer runs; then verify the rest with the key.

`--old` creates the file as journals were before retention (auto_vacuum NONE): the first prune
then rebuilds it with VACUUM, one long step.

    .venv/bin/python bench/bench_journal_prune.py [--entries 1000000] [--rate 1000] [--old]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
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
from appliance.journal.retention import RetentionPolicy, file_bytes, prune
from appliance.journal.signing import Signer
from appliance.journal.store import SCHEMA

DAYS = 60


def entry(i: int, ts: float) -> E.Entry:
    kind = i % 10
    crew = f"crew-{i % 5}"
    if kind < 7:
        requests = tuple(
            E.AllowedRequest(
                ts,
                "forward",
                "POST",
                f"api{k}.example.org",
                443,
                "10.20.30.40",
                "allowlist: api.example.org",
                200,
                812,
                20_417,
                0.183,
            )
            for k in range(3)
        )
        return E.ProxyAllow(ts=ts, crew=crew, mode="restricted", requests=requests)
    if kind == 7:
        return E.RunStarted(
            ts=ts, crew=crew, argv=("python", "-m", "pytest", "-q"), trace_id=f"r{i}"
        )
    if kind == 8:
        return E.CredentialInjected(ts=ts, crew=crew, provider="anthropic", host="api.example")
    return E.AllowlistChanged(ts=ts, crew=crew, host=f"host{i}.example.org")


def fill(path: Path, count: int, start: float) -> float:
    journal = Journal(path, synchronous="OFF")
    began = time.perf_counter()
    step = DAYS * 86_400 / count
    try:
        last = None
        for i in range(count):
            while True:
                try:
                    last = journal.submit(entry(i, start + i * step))
                    break
                except JournalFull:
                    time.sleep(0.001)
        assert last is not None
        last.wait(600)
    finally:
        journal.close()
    return time.perf_counter() - began


class Producer(threading.Thread):
    def __init__(self, journal: Journal, rate: float) -> None:
        super().__init__(daemon=True)
        self.journal = journal
        self.rate = rate
        self.samples: list[tuple[float, float]] = []  # (submitted, latency)
        self.depth: list[tuple[float, int]] = []
        self.full = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        interval = 1 / self.rate
        next_at = time.perf_counter()
        i = 0
        while not self.stopping.is_set():
            now = time.perf_counter()
            if now < next_at:
                time.sleep(next_at - now)
                continue
            next_at += interval
            i += 1
            submitted = time.perf_counter()

            def done(submitted: float = submitted) -> None:
                self.samples.append((submitted, time.perf_counter() - submitted))

            try:
                self.journal.submit(entry(i, time.time()), on_done=done)
            except JournalFull:
                self.full += 1
            self.depth.append((submitted, self.journal.pending))

    def window(self, start: float, end: float) -> dict[str, Any]:
        lat = sorted(lat for at, lat in self.samples if start <= at < end)
        depth = [d for at, d in self.depth if start <= at < end]
        if not lat:
            return {}
        return {
            "entries": len(lat),
            "p50_ms": round(statistics.median(lat) * 1000, 2),
            "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 2),
            "max_ms": round(lat[-1] * 1000, 2),
            "max_queue": max(depth, default=0),
        }


def old_style(path: Path) -> None:
    """A journal file as created before retention: auto_vacuum NONE."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.executescript(SCHEMA)
    conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=1000.0, help="producer entries/s")
    parser.add_argument("--baseline", type=float, default=5.0, help="seconds before the prune")
    parser.add_argument("--keep-days", type=float, default=6.0)
    parser.add_argument("--old", action="store_true", help="a file from before auto_vacuum")
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="bench-prune-", dir=args.dir))
    path = directory / "journal.db"
    result: dict[str, Any] = {"entries": args.entries, "rate": args.rate, "old": args.old}
    try:
        if args.old:
            old_style(path)
        now = time.time()
        result["fill_seconds"] = round(fill(path, args.entries, now - DAYS * 86_400), 1)
        result["bytes_before"] = file_bytes(path)
        signer = Signer(os.urandom(32))
        journal = Journal(path)
        producer = Producer(journal, args.rate)
        producer.start()
        time.sleep(args.baseline)
        t0 = time.perf_counter()
        report = prune(journal, RetentionPolicy(keep_days=args.keep_days), signer)
        t1 = time.perf_counter()
        time.sleep(2.0)
        producer.stopping.set()
        producer.join()
        began = time.perf_counter()
        verified = journal.verify(keys=(signer.public,))
        result["verify_seconds"] = round(time.perf_counter() - began, 1)
        journal.close()
        result["baseline"] = producer.window(t0 - args.baseline, t0)
        result["during_prune"] = producer.window(t0, t1)
        result["journal_full"] = producer.full
        result["prune"] = {
            "removed": report.removed,
            "seconds": round(report.seconds, 1),
            "steps": report.steps,
            "longest_pause_ms": round(report.longest_pause * 1000, 1),
            "rebuilt": report.rebuilt,
            "bytes_before": report.bytes_before,
            "bytes_after": report.bytes_after,
            "phases": {
                name: {
                    "seconds": round(phase.seconds, 2),
                    "steps": phase.steps,
                    "longest_ms": round(phase.longest_pause * 1000, 1),
                }
                for name, phase in report.phases.items()
            },
        }
        result["files_after_close"] = {
            name.name: name.stat().st_size for name in sorted(directory.iterdir())
        }
        result["verify_ok"] = verified.ok
        result["entries_left"] = verified.entries
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
