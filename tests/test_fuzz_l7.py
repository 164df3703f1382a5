"""Replays the rule matcher's fuzz seeds as ordinary tests, and shows its checks can fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import fuzz_l7 as harness


@pytest.mark.parametrize("seed", harness.SEEDS, ids=range(len(harness.SEEDS)))
def test_l7_seed(seed: bytes) -> None:
    harness.TestOneInput(seed)


def test_the_harness_catches_a_matcher_that_forgets_dot_segments(monkeypatch) -> None:
    """With the dot-segment check taken out, the escape to /admin is found."""
    from proxycore.protocol import l7

    monkeypatch.setattr(l7, "_check_segment", lambda segment: None)
    with pytest.raises(AssertionError):
        harness.TestOneInput(b"/safe/../admin")
