"""Stage 1 of the scrubber alone (the C engine, `native/src/scrub.c`): GB/s per core.

`bench_scrub.py`'s `ours-stream` measures the composed scrubber (stage 1, then the fold matcher
when a secret qualifies), so a change to stage 1's scan is hard to see there. This times
`scrub_native.NativeTables(compile_patterns(secrets)).stream()` alone, `feed` per chunk then
`flush`, on bench_scrub's corpora with its planted secrets and shapes, and checks that the output
does not depend on the chunk size. Rows:

- `stage1`: the default shapes (DEFAULT_SHAPES) and the secrets' literals;
- `literals`: the same literals, no shapes (what the shapes cost is the difference);
- `shapes`: the shapes alone, no secrets.

Figures are bytes per second of this process's CPU time (`time.process_time`), the median of
`--repeat` passes over the whole corpus (each chunk list is built before timing). Benchmark runs
go through the machine's lock and a pinned core:

    flock /tmp/bench.lock taskset -c 1 .venv/bin/python bench/bench_stage1.py
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# bench_scrub beside this file, and this tree's native/ (not an installed one)
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_scrub

ROWS = ("stage1", "literals", "shapes")


def factories(secrets: Sequence[tuple[str, bytes]], rows: Sequence[str]) -> dict[str, Any]:
    from native import scrub_native
    from native.scrub_patterns import compile_patterns

    if not scrub_native.AVAILABLE:
        raise SystemExit("the C engine is not built (python -m native.build)")
    made = {
        "stage1": lambda: compile_patterns(secrets),
        "literals": lambda: compile_patterns(secrets, shapes=()),
        "shapes": lambda: compile_patterns(()),
    }
    return {row: scrub_native.NativeTables(made[row]()) for row in rows}


def run(tables: Any, chunks: Sequence[bytes]) -> list[bytes]:
    stream = tables.stream()
    feed = stream.feed
    out = [feed(c) for c in chunks]
    out.append(stream.flush())
    return out


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median CPU seconds of `repeat` calls, and the last result."""
    cpu: list[float] = []
    result = None
    gc.collect()
    gc.disable()
    try:
        fn()  # warm-up: caches, the work area's buffers
        for _ in range(repeat):
            result = None
            c0 = time.process_time()
            result = fn()
            cpu.append(time.process_time() - c0)
    finally:
        gc.enable()
    return statistics.median(cpu), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--secrets", type=int, default=256, help="secret count (256)")
    parser.add_argument("--chunks", default="1k,16k,1m", help="chunk sizes (1k,16k,1m)")
    parser.add_argument("--corpora", default="json,code", help="json,code,random")
    parser.add_argument("--corpus-size", default="8m", help="bytes per corpus (8m)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which ({','.join(ROWS)})")
    parser.add_argument("--repeat", type=int, default=5, help="timed passes per figure (5)")
    args = parser.parse_args(argv)
    chunk_sizes = [bench_scrub.parse_size(x) for x in args.chunks.split(",") if x]
    corpora = [c for c in args.corpora.split(",") if c]
    rows = [r for r in args.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            parser.error(f"unknown row {r!r}")
    size = bench_scrub.parse_size(args.corpus_size)

    code = bench_scrub.code_corpus(max(size, 4 * bench_scrub.MIB))
    base = {
        "json": lambda: bench_scrub.json_corpus(size, code),
        "code": lambda: code[:size],
        "random": lambda: bench_scrub.random_corpus(size),
    }
    secrets = bench_scrub.make_secrets(args.secrets)
    tables = factories(secrets, rows)
    print(f"stage 1 alone, {args.secrets} secrets, CPU time, median of {args.repeat} passes")
    labels = "".join(f"{bench_scrub.size_label(c):>10}" for c in chunk_sizes)
    print(f"{'corpus':<8}{'row':<10}{labels}")
    for name in corpora:
        data, _ = bench_scrub.plant(base[name](), secrets)
        for row in rows:
            cells = []
            digests = set()
            for chunk in chunk_sizes:
                chunks = bench_scrub.chunked(data, chunk)
                seconds, out = timed(lambda t=tables[row], c=chunks: run(t, c), args.repeat)
                digests.add(hashlib.sha256(b"".join(out)).hexdigest())
                cells.append(f"{len(data) / seconds / 1e9:>10.3f}")
            flag = "" if len(digests) == 1 else "  ! output differs between chunk sizes"
            print(f"{name:<8}{row:<10}" + "".join(cells) + flag, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
