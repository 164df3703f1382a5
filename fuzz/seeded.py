"""Running a harness under atheris from its seeds (imported by the harnesses' `__main__` blocks,
run as `python fuzz/fuzz_X.py`, so this directory is on sys.path; the tests import the
harnesses as modules and never reach it).

Without a corpus directory on the command line, libFuzzer starts from empty inputs; a harness
whose input is a small program (a step kind, then its bytes) reaches little from there. So the
seeds are written to a fresh directory, which is given as the corpus.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Sequence


def fuzz(name: str, seeds: Sequence[bytes], test_one_input: Callable[[bytes], None]) -> None:
    import atheris

    args = sys.argv
    if not any(not a.startswith("-") for a in args[1:]):
        corpus = tempfile.mkdtemp(prefix=f"fuzz-{name}-")
        for i, seed in enumerate(seeds):
            with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
                f.write(seed)
        args = [*args, corpus]
    atheris.instrument_all()
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()
