"""Replays the HTTP/2 fuzz harness' seeds as ordinary tests, pins what it found, and shows its
checks can fail."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import hpack
import pytest
from hyperframe.frame import DataFrame, HeadersFrame

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import fuzz_h2 as harness

from proxycore.protocol.http2 import H2Limits, H2Server
from tests.h2_client import parse_frames


@pytest.mark.parametrize("seed", harness.SEEDS, ids=range(len(harness.SEEDS)))
def test_h2_seed(seed: bytes) -> None:
    harness.TestOneInput(seed)


# Found by the harness: a second response head (h2 takes it for trailers without END_STREAM)
# changed h2's HPACK encoder before h2 refused it, so the client's decoder fell out of step.
REGRESSIONS = [
    base64.b64decode(
        "IBAAAAAAAAAAAAAgAAAQAAALEAInWyPd3NzcAPAA97QLAP8B3Nzc2yMjIyMjIyMjIyMjIyMAAAAAAAAAAAAAAAAAAAAA"
        "AAAAAAAAAAAAAAAAIyMjOqenp6enp6cAAAAAIyMjIyMjI93c3NwA8AD3tAsA/wEjI/8YAg=="
    ),
    # The client allowed a larger HPACK table (the harness' own decoder must follow it).
    base64.b64decode("AAAABNDQ0NDQ0NDQ0NDQ0NDQ1NDQ////+/8AAAADAAAACWU="),
]


@pytest.mark.parametrize("data", REGRESSIONS, ids=range(len(REGRESSIONS)))
def test_h2_regression(data: bytes) -> None:
    harness.TestOneInput(data)


def test_a_second_response_head_is_refused_before_h2() -> None:
    """The client's HPACK decoder stays in step after a head the server refused."""
    server = H2Server(H2Limits())
    server.receive_data(harness.PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00", 1.0)
    encoder = hpack.Encoder()
    request = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a"), (b":path", b"/")]
    for stream_id in (1, 3):
        block = encoder.encode(request)
        frame = HeadersFrame(stream_id, block, flags=["END_HEADERS", "END_STREAM"])
        server.receive_data(frame.serialize(), 1.0)
    server.data_to_send()
    checker = harness._Checker()
    checker.opened |= {1, 3}
    assert server.send_headers(1, 200, [(b"Bad-Name", b"x"), (b"x-ok", b" pad")], end=False)
    assert not server.send_headers(1, 200, [(b"x-second", b"head")], end=False)
    assert server.send_headers(3, 200, [(b"x-second", b"head")], end=True)
    out = server.data_to_send()
    checker.output(out)
    assert checker.answered == {1, 3}
    decoder = hpack.Decoder()
    heads = {f.stream_id: decoder.decode(f.data, raw=True) for f in parse_frames(out)}
    assert heads[1] == [(b":status", b"200")]  # the fields HTTP/2 forbids are dropped
    assert heads[3] == [(b":status", b"200"), (b"x-second", b"head")]


def test_checker_detects_data_before_headers() -> None:
    checker = harness._Checker()
    checker.opened.add(1)
    with pytest.raises(AssertionError):
        checker.output(DataFrame(1, b"x").serialize())


def test_checker_detects_a_frame_on_a_stream_never_opened() -> None:
    checker = harness._Checker()
    with pytest.raises(AssertionError):
        checker.output(HeadersFrame(3, b"\x88", flags=["END_HEADERS"]).serialize())
