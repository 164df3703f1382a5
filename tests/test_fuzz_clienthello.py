"""Replays the ClientHello reader's fuzz seeds as ordinary tests, and shows its checks can fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import fuzz_clienthello as harness


@pytest.mark.parametrize("seed", harness.SEEDS, ids=range(len(harness.SEEDS)))
def test_clienthello_seed(seed: bytes) -> None:
    harness.TestOneInput(seed)


def test_the_harness_catches_a_reader_that_lets_an_address_through(monkeypatch) -> None:
    """With the address-literal check taken out, the hello naming 10.0.0.1 fails the harness."""
    from proxycore.protocol import clienthello

    monkeypatch.setattr(clienthello, "_ALL_DIGITS_AND_DOTS", clienthello.re.compile(rb"(?!)"))
    with pytest.raises(AssertionError):
        harness.TestOneInput(harness.SEEDS[5])
