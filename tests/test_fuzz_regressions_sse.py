"""Replay the SSE layer's fuzzer (fuzz/fuzz_sse_scrub.py) on its seeds and its findings, without
atheris. Pin new findings in PINNED with a comment saying what broke."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

_HARNESS = Path(__file__).resolve().parent.parent / "fuzz" / "fuzz_sse_scrub.py"


def _load_harness() -> ModuleType:
    # fuzz/ is not a package; load the harness by path so it runs exactly as the fuzzer runs it.
    spec = importlib.util.spec_from_file_location("fuzz_sse_scrub", _HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("fuzz_sse_scrub", module)
    spec.loader.exec_module(module)
    return module


harness = _load_harness()


def _delta(text: str) -> bytes:
    data = {"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}}  # fmt: skip
    return b"event: content_block_delta\r\ndata: " + json.dumps(data).encode() + b"\r\n\r\n"


PINNED: tuple[bytes, ...] = (
    # A chat `[DONE]` inside an Anthropic stream flushed the Anthropic channel (which the SDK
    # does not end there): two pieces of the key under 8 bytes each passed apart, and the SDK
    # joined them into 10 bytes of it. Now: text after a channel's end cuts the stream.
    b"\x00" + _delta("k 5Cd7E") + b"data: [DONE]\n\n" + _delta("f1Gh."),
    # Invalid UTF-8 in the middle delta: the layer read it with a replacement character and
    # joined it, a client that skips the undecodable event joined the other two into 8 bytes
    # of the key. Now: invalid UTF-8 in a text cuts the stream.
    b"\x00" + _delta("w3Yb") + _delta("w3Y").replace(b'w3Y"', b'w3Y\xc7"') + _delta("5Cd7E"),
)


@pytest.mark.parametrize("data", harness.SEEDS + list(PINNED))
def test_replay(data: bytes) -> None:
    for mode in range(3):
        harness.TestOneInput(bytes([mode]) + data[1:])
