"""Replays the differential HTTP/2 harness (our server core against the h2 package's) on its
seeds and on a fixed set of random inputs, and shows its comparison can fail."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import fuzz_h2_differential as harness

from proxycore.protocol.http2 import H2Server, RequestReceived


@pytest.mark.parametrize("seed", harness.SEEDS, ids=range(len(harness.SEEDS)))
def test_h2_differential_seed(seed: bytes) -> None:
    harness.TestOneInput(seed)


def test_h2_differential_random_inputs() -> None:
    """A brief run: the same 600 inputs every time (the fuzzer explores further)."""
    rng = random.Random(1609)
    for _ in range(600):
        harness.TestOneInput(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))))


def test_a_request_read_differently_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    class Misreading(H2Server):
        def _request(self, *args: object, **kwargs: object) -> RequestReceived | None:
            request = super()._request(*args, **kwargs)  # type: ignore[arg-type]
            return request and msgspec.structs.replace(request, path=b"/elsewhere")

    monkeypatch.setattr(harness, "H2Server", Misreading)
    with pytest.raises(AssertionError):
        harness.TestOneInput(harness.SEEDS[1])


def test_a_refusal_of_one_side_only_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    class Lenient(H2Server):
        def _protocol_error(self, why: str) -> None:  # type: ignore[override]
            pass

    monkeypatch.setattr(harness, "H2Server", Lenient)
    # A PRIORITY frame on stream 0: both refuse it, unless ours is made lenient.
    with pytest.raises(AssertionError):
        harness.TestOneInput(b"\x0f\x00\x40\x01\x05" + bytes(5))
