"""Replay the DNS fuzzer's seeds and every input it has found, without atheris.

Each seed is run with every selector byte, so every crew (mode, real or synthetic addresses,
resolution or failure) and both ways of reading the input are covered. Pin new findings in
PINNED with a comment saying what broke.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_HARNESS = Path(__file__).resolve().parent.parent / "fuzz" / "fuzz_dns.py"


def _load_harness() -> ModuleType:
    # fuzz/ is not a package; load the harness by path so it runs exactly as the fuzzer runs it.
    spec = importlib.util.spec_from_file_location("fuzz_dns", _HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_dns", module)
    spec.loader.exec_module(module)
    return module


harness = _load_harness()

# Inputs found by the fuzzer (or written while reading its output), first byte = selector.
PINNED: tuple[bytes, ...] = ()

# Hand-written edge cases: a header only, a question cut short, a label over 63, an OPT whose
# length runs past the end, two OPTs, a name of 255 octets.
_QUERY = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00"
EDGES: tuple[bytes, ...] = (
    _QUERY + b"\x00\x00",
    _QUERY + b"\x00\x00\x03api",
    _QUERY + b"\x00\x00\x40" + b"a" * 64 + b"\x00\x00\x01\x00\x01",
    _QUERY + b"\x00\x01\x03api\x00\x00\x01\x00\x01\x00\x00\x29\x04\xd0\x00\x00\x00\x00\x00\x09",
    _QUERY + b"\x00\x02\x03api\x00\x00\x01\x00\x01" + b"\x00\x00\x29\x04\xd0" + b"\x00" * 6 * 2,
    _QUERY + b"\x00\x00" + (b"\x3f" + b"a" * 63) * 4 + b"\x00\x00\x01\x00\x01",
)


@pytest.mark.parametrize("seed", harness.SEEDS + PINNED)
@pytest.mark.parametrize("selector", range(0, 256, 3))
def test_seed(seed: bytes, selector: int) -> None:
    harness.TestOneInput(bytes([selector]) + seed[1:])


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("selector", [0x80, 0x81, 0x82, 0x86, 0x8A])
def test_edge(edge: bytes, selector: int) -> None:
    harness.TestOneInput(bytes([selector]) + edge)
