"""Replays the request-path fuzz harness' seeds (and pinned findings) as ordinary tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import fuzz_request_path as harness


@pytest.mark.parametrize("seed", harness.SEEDS, ids=range(len(harness.SEEDS)))
def test_request_path_seed(seed: bytes) -> None:
    harness.TestOneInput(seed)


def test_harness_detects_a_malformed_response() -> None:
    with pytest.raises(AssertionError):
        harness._check_responses(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokgarbage\r\n\r\n")
