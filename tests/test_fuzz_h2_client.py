"""Replays the HTTP/2 client fuzz harness' seeds as ordinary tests, and shows its checks can
fail."""

from __future__ import annotations

import base64
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


# Found by the harness: frames after an error GOAWAY stayed in the input buffer (nothing reads
# them any more: they are dropped).
REGRESSIONS = [
    base64.b64decode(
        "AAoBh4eHh4eHh4cjIyOHh4eHh0oAh4eHh4eHh4eHh4eHh4eHh4eH09PT09PT09PT09PT09PT09PT0yXT09PT09PT09PT"
        "09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT09PT"
        "09PT09PT09PT09PT09PT09PT09PT09OHh4eHh4eHh4eHh4eHh4eHh6Skh4eHh6SkpKSHh4eHh4eHh4cAQEMFBQVA"
    ),
]


@pytest.mark.parametrize("data", REGRESSIONS, ids=range(len(REGRESSIONS)))
def test_h2_client_regression(data: bytes) -> None:
    harness.TestOneInput(data)


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
