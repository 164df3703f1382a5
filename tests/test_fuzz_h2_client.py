"""Replays the HTTP/2 client fuzz harness' seeds as ordinary tests, and shows its checks can
fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hyperframe.frame import DataFrame, HeadersFrame, RstStreamFrame

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import fuzz_h2_client as harness

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@pytest.mark.parametrize("seed", harness.SEEDS, ids=range(len(harness.SEEDS)))
def test_h2_client_seed(seed: bytes) -> None:
    harness.TestOneInput(seed)


def test_checker_detects_data_after_our_end_stream() -> None:
    checker = harness._Checker()
    checker.output(
        PREFACE + HeadersFrame(1, b"\x82", flags=["END_HEADERS", "END_STREAM"]).serialize()
    )
    with pytest.raises(AssertionError):
        checker.output(DataFrame(1, b"x").serialize())


def test_checker_detects_a_stream_identifier_going_back() -> None:
    checker = harness._Checker()
    checker.output(PREFACE + HeadersFrame(3, b"\x82", flags=["END_HEADERS"]).serialize())
    with pytest.raises(AssertionError):
        checker.output(HeadersFrame(1, b"\x82", flags=["END_HEADERS"]).serialize())


def test_checker_detects_data_on_a_stream_the_upstream_reset() -> None:
    checker = harness._Checker()
    checker.output(PREFACE + HeadersFrame(1, b"\x82", flags=["END_HEADERS"]).serialize())
    checker.upstream_frame(RstStreamFrame(1, error_code=8))
    with pytest.raises(AssertionError):
        checker.output(DataFrame(1, b"x").serialize())
