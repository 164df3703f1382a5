"""gRPC response messages through the scrubber (proxycore/protocol/grpc.py, sans-IO): each
message scrubbed whole and re-framed with its new length, however the body is split, and what an
incomplete message holds charged to the crew's buffer budget."""

from __future__ import annotations

import pytest

from native.scrub import Scrubber
from proxycore.errors import HttpProtocolError
from proxycore.protocol.grpc import MessageScrubber
from proxycore.runtime import BufferBudget

SECRET = b"sk-ant-api03-GRPCMESSAGE-0123456789abcdef"


def frame(message: bytes, compressed: bool = False) -> bytes:
    return bytes((int(compressed),)) + len(message).to_bytes(4, "big") + message


def messages_of(body: bytes) -> list[bytes]:
    out = []
    while body:
        length = int.from_bytes(body[1:5], "big")
        out.append(body[5 : 5 + length])
        body = body[5 + length :]
    return out


@pytest.mark.parametrize("split", [1, 3, 7, 64, 10_000])
def test_messages_are_scrubbed_whole_whatever_the_split(split: int) -> None:
    budget = BufferBudget(1 << 20)
    scrubber = MessageScrubber(Scrubber([("anthropic", SECRET)]), 1 << 20, budget)
    body = frame(b"hello") + frame(b"key " + SECRET + b" end") + frame(b"")
    out = b"".join(scrubber.feed(body[i : i + split]) for i in range(0, len(body), split))
    out += scrubber.flush()
    got = messages_of(out)
    assert got[0] == b"hello" and got[2] == b""
    assert SECRET not in out and got[1].startswith(b"key ") and got[1].endswith(b" end")
    assert budget.used == 0


def test_an_incomplete_message_is_charged_and_given_back() -> None:
    budget = BufferBudget(1000)
    scrubber = MessageScrubber(Scrubber([]), 1 << 20, budget)
    whole = frame(b"x" * 600)
    assert scrubber.feed(whole[:400]) == b""
    assert budget.used == 400
    assert scrubber.feed(whole[400:]) == whole
    assert budget.used == 0
    assert scrubber.feed(whole[:100]) == b""
    scrubber.release()  # the body was abandoned
    assert budget.used == 0


def test_a_message_over_the_crews_budget_ends_the_stream() -> None:
    """Another stream of the crew holds most of the budget: this one's message finds no room."""
    budget = BufferBudget(1000)
    assert budget.take(900)
    scrubber = MessageScrubber(Scrubber([]), 1 << 20, budget)
    with pytest.raises(HttpProtocolError, match="buffer budget"):
        scrubber.feed(frame(b"y" * 500)[:300])
    scrubber.release()
    assert budget.used == 900  # only what the other stream holds


def test_compressed_and_oversized_messages_are_refused() -> None:
    scrubber = MessageScrubber(Scrubber([]), 100, BufferBudget(1 << 20))
    with pytest.raises(HttpProtocolError, match="compressed"):
        scrubber.feed(frame(b"z", compressed=True))
    scrubber = MessageScrubber(Scrubber([]), 100, BufferBudget(1 << 20))
    with pytest.raises(HttpProtocolError, match="over 100 bytes"):
        scrubber.feed(frame(b"z" * 101)[:5])
