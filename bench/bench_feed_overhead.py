"""Where the time of one scrubber feed goes: the per-call cost, apart from the scanning.

For stage 1 (`scrub_native.NativeStream`), stage 2 (`scrub_fold_native.NativeFoldStream`) and the
whole scrubber (`Scrubber(secrets).stream()`, 256 secrets + the default shapes, and its
two-stage `ComposedStream` built by hand for comparison), each fed an empty chunk, 8 bytes and
1 KiB over and over (one stream per case, so its pending tail is in its steady state), plus the
pieces a feed is made of: a Python method call, a one-argument cffi call, the thread-local work
lookup, the raw C call with its arguments prepared, `ffi.unpack` of 1 KiB.

Figures are nanoseconds of this thread's CPU time (`time.thread_time`) per call: the minimum over
--repeat batches of --number calls (the minimum is the least disturbed batch; on a loaded machine
compare two runs back to back, or pin a core: `taskset -c 1`). The text fed is real Python source
(the standard library's json/encoder.py), which holds none of the secrets.

    .venv/bin/python bench/bench_feed_overhead.py [--number N] [--repeat R] [--only SUBSTR]
        [--source TREE]

--source runs another checkout's native/ (an older revision, for a before/after comparison):
the pieces that revision does not have are left out.
"""

from __future__ import annotations

import argparse
import importlib
import json as json_module
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
SOURCE = Path(json_module.__file__).parent / "encoder.py"
scrub: Any = None
scrub_fold_native: Any = None
scrub_native: Any = None
compile_patterns: Any = None


def load(tree: Path) -> None:
    """Import native/ from `tree` (this checkout by default)."""
    global scrub, scrub_fold_native, scrub_native, compile_patterns
    sys.path.insert(0, str(tree.resolve()))
    scrub = importlib.import_module("native.scrub")
    scrub_fold_native = importlib.import_module("native.scrub_fold_native")
    scrub_native = importlib.import_module("native.scrub_native")
    compile_patterns = importlib.import_module("native.scrub_patterns").compile_patterns


def call(fn: Callable[..., object], *args: object) -> Callable[[], object]:
    """fn(*args) as a zero-argument callable (the arguments bound now)."""
    return lambda: fn(*args)


def cases(secrets: list[tuple[str, bytes]]) -> dict[str, Callable[[], object]]:
    text = SOURCE.read_bytes()
    inputs = {"empty": b"", "8B": text[4096:4104], "1KiB": text[4096:5120]}
    out: dict[str, Callable[[], object]] = {}

    class Noop:
        def feed(self, chunk: bytes) -> bytes:
            return chunk

    out["python method call (floor)"] = call(Noop().feed, b"")
    s1 = scrub_native.NativeTables(compile_patterns(secrets))
    bare = scrub_native.NativeTables(compile_patterns([], ()))
    ffi, lib = scrub_native.ffi, scrub_native.lib
    out["cffi 1-arg call (scrub_tables_simd)"] = call(lib.scrub_tables_simd, s1._tables)
    out["ffi.unpack 1KiB"] = call(ffi.unpack, ffi.new("char[]", inputs["1KiB"]), 1024)
    work = getattr(scrub_native, "_local_work", None)  # the per-thread work of two-call wrappers
    if work is not None:
        out["thread-local work lookup"] = call(getattr, work, "slots")
    scrubber = scrub.Scrubber(secrets)
    s2 = scrub_fold_native.NativeFoldTables(secrets) if scrub_fold_native.AVAILABLE else None
    for label, data in inputs.items():
        if work is not None:
            raw = s1.stream()._st
            out[f"stage1 raw scrub_feed {label}"] = call(
                lib.scrub_feed, raw, work.slots[0], data, len(data), 0, *work.slots[1:]
            )
        if hasattr(lib, "composed_feed"):
            cs = s1.stream()._cs
            out[f"stage1 raw composed_feed {label}"] = call(
                lib.composed_feed, cs, data, len(data), 0
            )
        out[f"stage1 feed {label}"] = call(s1.stream().feed, data)
        out[f"stage1 no patterns feed {label}"] = call(bare.stream().feed, data)
        if s2 is not None:
            out[f"stage2 feed {label}"] = call(s2.stream().feed, data)
        if scrubber._native is not None and scrubber._fold is not None:
            composed = scrub.ComposedStream(scrubber._native.stream(), scrubber._fold.stream())
            out[f"ComposedStream (two calls) feed {label}"] = call(composed.feed, data)
        out[f"Scrubber.stream() feed {label}"] = call(scrubber.stream().feed, data)
        if hasattr(lib, "composed_feed") and scrubber._fold is not None:
            cs = scrubber.stream()._cs
            out[f"Scrubber raw composed_feed {label}"] = call(
                lib.composed_feed, cs, data, len(data), 0
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=20000, help="calls per batch (20000)")
    parser.add_argument("--repeat", type=int, default=7, help="batches; the minimum is kept (7)")
    parser.add_argument("--only", default="", help="only the cases whose name holds this")
    parser.add_argument("--secrets", type=int, default=256, help="known secrets (256)")
    parser.add_argument("--source", type=Path, default=BENCH.parent, help="tree whose native/ runs")
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH))
    from bench_scrub import make_secrets

    load(args.source)
    secrets = make_secrets(args.secrets)
    print(
        f"engine {scrub.ENGINE}, fold {'native' if scrub.FOLD_NATIVE_AVAILABLE else 'reference'}, "
        f"{args.secrets} secrets + default shapes; ns of thread CPU time per call, min of "
        f"{args.repeat} x {args.number}"
    )
    for name, fn in cases(secrets).items():
        if args.only and args.only not in name:
            continue
        fn()  # warm: the work area's buffers, the stream's pending tail
        timer = timeit.Timer(fn, timer=time.thread_time)
        best = min(timer.repeat(repeat=args.repeat, number=args.number)) / args.number
        print(f"{best * 1e9:9.0f} ns  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
