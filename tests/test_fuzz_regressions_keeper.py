"""Replay the keeper fuzzer's seeds and every input it has found, without atheris.

Each seed runs under the first four selector bytes (both text decodings). Pin new findings in
PINNED with a comment saying what broke.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_HARNESS = Path(__file__).resolve().parent.parent / "fuzz" / "fuzz_keeper.py"


def _load_harness() -> ModuleType:
    # fuzz/ is not a package; load the harness by path so it runs exactly as the fuzzer runs it.
    spec = importlib.util.spec_from_file_location("fuzz_keeper", _HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_keeper", module)
    spec.loader.exec_module(module)
    return module


harness = _load_harness()

# Inputs found by the fuzzer (200,000 runs so far found none).
PINNED: tuple[bytes, ...] = ()

# Hand-written edges around the quote/escape boundary the two readings must agree on.
EDGES: tuple[bytes, ...] = (
    b"",
    b"\x00",
    b"\x00'",
    b'\x00"',
    b"\x00\\'",
    b'\x00\\"',
    b'\x00"\'"',
    b"\x00'\"'",
    b'\x00"\\\\"',
    b"\x00'\\'",
    b"\x00$'('",
    b"\x00'$'(",
    b"\x00$\\(",
    b"\x00a\x0bb",
    b"\x00a\x7fb",
    b"\x00a\xc2\x85b",  # NEL: not a separator for shlex or for us
    b"\x00" + b"a" * 4096,
    b"\x00" + b"a" * 4097,
)


@pytest.mark.parametrize("seed", harness.SEEDS + PINNED + EDGES)
def test_seed_under_both_decodings(seed: bytes) -> None:
    body = seed[1:]
    for selector in range(4):
        harness.TestOneInput(bytes([selector]) + body)
