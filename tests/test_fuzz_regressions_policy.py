"""Replay the policy fuzzer's seeds and every input it has found, without atheris.

Each seed is run with every selector byte, so both text decodings and every port of the harness
are covered. Pin new findings in PINNED with a comment saying what broke.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_HARNESS = Path(__file__).resolve().parent.parent / "fuzz" / "fuzz_policy.py"


def _load_harness() -> ModuleType:
    # fuzz/ is not a package; load the harness by path so it runs exactly as the fuzzer runs it.
    spec = importlib.util.spec_from_file_location("fuzz_policy", _HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_policy", module)
    spec.loader.exec_module(module)
    return module


harness = _load_harness()

# Inputs found by the fuzzer (or written while reading its output), first byte = selector.
PINNED: tuple[bytes, ...] = ()

# Hand-written edge cases around the invariants: resolver-read IPv4 forms, ports, brackets.
EDGES: tuple[bytes, ...] = (
    b"",
    b"\x00",
    b"\x000x7f.0x0.0x0.0x1",
    b"\x000x.0x.0x.0x",
    b"\x00127.0.0.1.",
    b"\x00127.000.000.001",
    b"\x000.0.0.0",
    b"\x004294967295",
    b"\x004294967296",
    b"\x00a.b.c.1",
    b"\x00[::]:1",
    b"\x00[::ffff:0.0.0.0]:65535",
    b"\x00[1:2:3:4:5:6:7:8]:443",
    b"\x00[1:2:3:4:5:6:1.2.3.4]",
    b"\x00::1:443",
    b"\x00::1,10.1.2.3,github.com",
    b"\x00127.0.0.0/8,fd00::/8",
    b"\x00::ffff:0:0/96",
    b"\x00fe80::1%\xff",
    b"\x01fe80::1%\xff",
    b"\x00\xed\xa0\x80.com",  # a lone surrogate after surrogateescape
    b"\x00api.anthropic.com:443\x00",
    b"\x00" + b"a." * 126 + b"a",
    b"\x00" + b"1" * 300,
)


@pytest.mark.parametrize("seed", harness.SEEDS + PINNED + EDGES)
def test_seed_under_every_selector(seed: bytes) -> None:
    body = seed[1:]
    for selector in range(256):
        harness.TestOneInput(bytes([selector]) + body)
