"""False positives of the whole scrubber on real text: redactions per 100 MB.

Theory of operation
-------------------
The scrubber as the proxy builds it (stage 1: known values, their exact encodings and the
shapes; stage 2: the fold matcher) with `--secrets` random credentials of bench_scrub's mix
configured is run over every regular file under the given roots (by default CPython's standard
library without site-packages, and Debian's /usr/share/doc), one file at a time. Markers already
in a file are not counted; each new `[REDACTED:<name>]` is, by name, with up to three example
files per name, so that a real key (a test certificate's private key) can be told from a false
positive by reading the file.

    python bench/scrub_false_positives.py [--secrets 256] [ROOT ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_scrub

from native.scrub import Scrubber

MARKER = re.compile(rb"\[REDACTED:([^\]]{1,64})\]")
MAX_FILE = 8 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="*", help="directories (default: stdlib, /usr/share/doc)")
    parser.add_argument("--secrets", type=int, default=256, help="random credentials configured")
    args = parser.parse_args(argv)
    roots = args.roots or [sysconfig.get_paths()["stdlib"], "/usr/share/doc"]
    scrubber = Scrubber(bench_scrub.make_secrets(args.secrets))
    print(f"engines: stage 1 {scrubber.engine}, stage 2 {scrubber.fold_engine}")
    names: collections.Counter[str] = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    total = files = 0
    started = time.monotonic()
    for root in roots:
        for folder, _, entries in os.walk(root):
            for entry in entries:
                path = os.path.join(folder, entry)
                if "site-packages" in path or os.path.islink(path) or not os.path.isfile(path):
                    continue
                try:
                    data = Path(path).read_bytes()
                except OSError:
                    continue
                if len(data) > MAX_FILE:
                    continue
                total += len(data)
                files += 1
                found = collections.Counter(
                    m.group(1) for m in MARKER.finditer(scrubber.scrub(data))
                )
                found.subtract(m.group(1) for m in MARKER.finditer(data))
                for name, count in found.items():
                    if count > 0:
                        label = name.decode("ascii", "replace")
                        names[label] += count
                        if len(examples[label]) < 3:
                            examples[label].append(path)
    seconds = time.monotonic() - started
    redactions = sum(names.values())
    print(
        f"{files} files, {total / 1e6:.1f} MB in {seconds:.0f} s: {redactions} redactions, "
        f"{redactions / (total / 1e8):.2f} per 100 MB"
    )
    for name, count in names.most_common():
        print(f"  {name}: {count}  e.g. {', '.join(examples[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
