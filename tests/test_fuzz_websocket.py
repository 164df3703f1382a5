"""Replays the WebSocket relay fuzz harness' seeds (and a few hundred generated inputs) as
ordinary tests, and shows its checks can fail."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import fuzz_websocket as harness

from proxycore.protocol import wsrelay


@pytest.mark.parametrize("seed", harness.SEEDS, ids=range(len(harness.SEEDS)))
def test_websocket_seed(seed: bytes) -> None:
    harness.TestOneInput(seed)


@pytest.mark.parametrize("batch", range(4))
def test_websocket_generated_inputs(batch: int) -> None:
    rng = random.Random(batch)
    for _ in range(100):
        harness.TestOneInput(rng.randbytes(rng.randrange(1, 400)))


def test_the_seeds_reach_every_kind_of_end() -> None:
    ended = set()
    for seed in harness.SEEDS:
        relay, _ = harness.run_session(harness._steps(harness.Source(seed)), split=True)
        ended.add(relay.ended.split(":")[0])
    assert {"complete", "control_flood", "agent_protocol_error", "message_too_big"} <= ended


def test_harness_detects_an_unscrubbed_message(monkeypatch) -> None:
    """A relay whose scrubber lets everything through fails the harness on its first seed."""
    monkeypatch.setattr(harness, "SCRUBBER", wsrelay.Scrubber([], ()))
    with pytest.raises(AssertionError, match="credential"):
        harness.TestOneInput(harness.SEEDS[0])
