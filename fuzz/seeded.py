"""Running a harness under atheris from its seeds (imported by the harnesses' `__main__` blocks,
run as `python fuzz/fuzz_X.py`, so this directory is on sys.path; the tests import the
harnesses as modules and never reach it).

Without a corpus directory on the command line, libFuzzer starts from empty inputs; a harness
whose input is a small program (a step kind, then its bytes) reaches little from there. So the
seeds are written to a fresh directory, which is given as the corpus.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import types
from collections.abc import Callable, Sequence

# What a harness instruments: the project's packages and the protocol libraries our code drives
# (the differential harnesses hold our parsers to them). Not trio, msgspec's Python parts or the
# standard library: instrumenting every function loaded (`atheris.instrument_all`) takes 20-30 s
# per harness before the first input, the better part of a CI smoke run, and their coverage
# guides nothing we test. FUZZ_INSTRUMENT_ALL=1 instruments everything (long campaigns).
INSTRUMENTED = (
    "proxycore",
    "native",
    "appliance",
    "netns",
    "images",
    "h11",
    "h2",
    "hpack",
    "wsproto",
)


def instrument() -> None:
    """Instrument the functions of `INSTRUMENTED` loaded so far (all with FUZZ_INSTRUMENT_ALL=1)."""
    import atheris

    if os.environ.get("FUZZ_INSTRUMENT_ALL") == "1":
        atheris.instrument_all()
        return
    for obj in gc.get_objects():
        if not isinstance(obj, types.FunctionType):
            continue
        module = getattr(obj, "__module__", None)
        if not isinstance(module, str) or module.split(".", 1)[0] not in INSTRUMENTED:
            continue
        if module not in sys.modules:
            continue
        try:
            atheris.instrument_func(obj)
        except Exception:
            continue


def fuzz(
    name: str,
    seeds: Sequence[bytes],
    test_one_input: Callable[[bytes], None],
    *,
    instrument_all: bool = True,
) -> None:
    """`instrument_all=False`: the harness instrumented the modules it is about itself
    (`atheris.instrument_imports`), which starts in a second rather than twenty."""
    import atheris

    args = sys.argv
    if not any(not a.startswith("-") for a in args[1:]):
        corpus = tempfile.mkdtemp(prefix=f"fuzz-{name}-")
        for i, seed in enumerate(seeds):
            with open(os.path.join(corpus, f"seed-{i}"), "wb") as f:
                f.write(seed)
        args = [*args, corpus]
    if instrument_all:
        instrument()
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()
