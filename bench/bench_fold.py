"""Stage 2 (the fold matcher, C) alone: GB/s per core on bench_scrub's corpora.

A quick companion of `bench_scrub.py --fold` for work on native/src/fold.c: only `fold-c`
(no stage 1, no reference, no false-positive pass), on the same corpora and secrets
(`make_secrets(256)`, `json_corpus`, `code_corpus`, `random_corpus`), the same timing
(`fold_throughput`: CPU time, best of three passes), with the native/ of `--source` (default:
this file's checkout, not the venv's editable install). Benchmark runs go through the machine's
lock:

    flock /tmp/bench.lock taskset -c 1 .venv/bin/python bench/bench_fold.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_scrub as bs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus-size", default="8m", help="bytes per corpus (8m)")
    parser.add_argument("--corpora", default="json,code,random", help="json,code,random")
    parser.add_argument("--chunks", default="1k,16k", help="chunk sizes (1k,16k)")
    parser.add_argument("--secrets", type=int, default=256, help="secret count (256)")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per timed pass")
    parser.add_argument("--source", type=Path, default=ROOT, help="tree whose native/ runs")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(args.source.resolve()))

    import native
    from native import scrub_fold_native

    if not scrub_fold_native.AVAILABLE:
        print("the C fold engine is not built", file=sys.stderr)
        return 1
    print(f"native: {Path(native.__file__).parent}")
    secrets = bs.make_secrets(args.secrets)
    size = bs.parse_size(args.corpus_size)
    code = bs.code_corpus(max(size, 4 * bs.MIB))
    every = {
        "json": lambda: bs.json_corpus(size, code),
        "code": lambda: code[:size],
        "random": lambda: bs.random_corpus(size),
    }
    factory = scrub_fold_native.NativeFoldTables(secrets).stream
    chunks = [bs.parse_size(c) for c in args.chunks.split(",")]
    print(f"fold-c, {args.secrets} secrets, corpora of {bs.size_label(size)}: GB/s")
    print(f"{'corpus':8} " + " ".join(f"{bs.size_label(c):>8}" for c in chunks))
    for name in args.corpora.split(","):
        data = every[name]()
        figures = [bs.fold_throughput(data, factory, c, args.budget) for c in chunks]
        print(f"{name:8} " + " ".join(f"{g:>8.3f}" for g in figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
