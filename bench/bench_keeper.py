"""Keeper L1 decision latency (issue 6 target: p99 under 5 ms).

Measures `KeeperService.handle` for an L1 `request` with a substantive intent (the fast path: no
model) in-process, with the real credential store (AES-GCM decrypt of the value) and the real
journal (the `keeper.decision` entry acknowledged on disk before the answer, synchronous=FULL:
one fsync per batch, docs/journal.md). Also the sans-IO rules alone (check_intent +
fast_path_allows, parse_command) to show where the time goes. Sequential calls, so each one pays
its own fsync (the worst case: concurrent calls share a batch).

    python bench/bench_keeper.py [--calls 2000] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio

from appliance.credstore import CredentialStore, SecretValue
from appliance.journal.recorder import JournalRecorder
from appliance.journal.store import Journal
from appliance.keeper.gatekeeper import GatekeeperConfig
from appliance.keeper.service import KeeperService
from proxycore.protocol.keeper import Action, Level, check_intent, fast_path_allows, parse_command

BODY = json.dumps(
    {"credential": "gh", "intent": "list the open pull requests of org/repo"}
).encode()


def percentiles(samples: list[float]) -> str:
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))] * 1000  # noqa: E731
    return (
        f"p50 {pick(0.50):.3f} ms, p99 {pick(0.99):.3f} ms, max {samples[-1] * 1000:.3f} ms, "
        f"mean {statistics.fmean(samples) * 1000:.3f} ms"
    )


async def service_latency(directory: Path, calls: int) -> list[float]:
    store = CredentialStore(directory / "credentials.db", bytes(range(32)))
    with SecretValue(b"ghp_benchValue0123456789abcdefXYZ") as value:
        store.add("gh", "github", value, level="L1", kind="secret")
    store.grant("gh", "alpha")
    journal = Journal(directory / "journal.db")
    service = KeeperService(store, GatekeeperConfig(), JournalRecorder(journal), None)
    samples = []
    try:
        for _ in range(calls):
            started = time.perf_counter()
            status, answer = await service.handle(Action.REQUEST, "alpha", BODY)
            samples.append(time.perf_counter() - started)
            assert status == 200 and answer.value is not None
    finally:
        journal.close()
        store.close()
    return samples


def rules_latency(calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        intent = check_intent("list the open pull requests of org/repo")
        fast_path_allows(Action.REQUEST, Level.L1, intent)
        parse_command("gh pr list --repo 'org/repo' --state open --limit 50")
        samples.append(time.perf_counter() - started)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--dir", default=None, help="where the store and journal live")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        samples = trio.run(service_latency, Path(tmp), args.calls)
    print(f"keeper L1 request, whole decision ({args.calls} calls): {percentiles(samples)}")
    print(f"rules alone (intent + fast path + command split): {percentiles(rules_latency(20000))}")


if __name__ == "__main__":
    main()
