"""gRPC response messages through the scrubber, one whole message at a time (sans-IO).

Theory of operation: a response body passes through the streaming scrubber, which holds back
the last bytes of a read that could begin a secret until the next read shows whether they do.
That is right for a body read as a whole, and wrong for gRPC: a bidirectional or server stream
sends one message and waits for the client, so a held-back byte would stall the call. gRPC
frames its body itself (gRPC over HTTP/2, "Length-Prefixed-Message": a compressed flag, a
4-byte big-endian length, the message), so the proxy scrubs each message whole as soon as it
is complete, and writes it with the length of what remains after scrubbing (a message that
held a secret is redacted, and its protobuf no longer decodes: the client sees an error rather
than the secret). A secret cannot hide across a message boundary any more than across two
fields of one JSON body.

A compressed message (flag 1) cannot be read by the scrubber: the stream ends there (the proxy
asks for identity; a server that compresses anyway is not relayed, as for Content-Encoding in
proxycore/protocol/responses.py). A message longer than `max_message` ends the stream too: the
proxy holds a message whole before it goes on. What it holds of an incomplete message is
charged to the crew's buffer budget (`max_buffered_bytes_per_crew`, shared with bodies and
WebSocket sessions), so a crew's many streams together hold at most that: a message that finds
no room ends its stream, never another crew's memory.
"""

from __future__ import annotations

from typing import Protocol

from native.scrub import Scrubber
from proxycore.errors import HttpProtocolError

__all__ = ["Budget", "MessageScrubber", "is_grpc"]


class Budget(Protocol):
    """The crew's buffer budget (proxycore/runtime.py `BufferBudget`)."""

    def take(self, n: int) -> bool: ...

    def give_back(self, n: int) -> None: ...


def is_grpc(content_type: bytes | None) -> bool:
    """A gRPC message's content-type: application/grpc, application/grpc+proto, ..."""
    return content_type is not None and content_type[:16].lower() == b"application/grpc"


class MessageScrubber:
    """Feed the decoded response body; get back whole messages, scrubbed and re-framed. Call
    `release` when the body is over (or abandoned): it gives back what is still charged."""

    __slots__ = ("_budget", "_buffer", "_held", "_max", "_scrubber")

    def __init__(self, scrubber: Scrubber, max_message: int, budget: Budget) -> None:
        self._scrubber = scrubber
        self._max = max_message
        self._budget = budget
        self._buffer = bytearray()
        self._held = 0  # bytes of `_buffer` charged to the budget

    def feed(self, data: bytes) -> bytes:
        buffer = self._buffer
        buffer += data
        out = bytearray()
        while len(buffer) >= 5:
            if buffer[0] & 0x01:
                raise HttpProtocolError(
                    "a compressed gRPC message, which the scrubber cannot read", status_hint=502
                )
            length = int.from_bytes(buffer[1:5], "big")
            if length > self._max:
                raise HttpProtocolError(f"a gRPC message over {self._max} bytes", status_hint=502)
            if len(buffer) < 5 + length:
                break
            message = bytes(buffer[5 : 5 + length])
            del buffer[: 5 + length]
            scrubbed = self._scrubber.scrub(message) if message else message
            out += b"\x00" + len(scrubbed).to_bytes(4, "big") + scrubbed
        self._charge(len(buffer))
        return bytes(out)

    def _charge(self, pending: int) -> None:
        """Keep the budget charged with exactly the bytes held."""
        if pending > self._held:
            if not self._budget.take(pending - self._held):
                raise HttpProtocolError(
                    "gRPC messages held over the crew's buffer budget "
                    "(max_buffered_bytes_per_crew)",
                    status_hint=502,
                )
        elif pending < self._held:
            self._budget.give_back(self._held - pending)
        self._held = pending

    def release(self) -> None:
        self._budget.give_back(self._held)
        self._held = 0

    def flush(self) -> bytes:
        """The end of the body: a partial message left is malformed gRPC; it goes on
        scrubbed (the client reports the truncation)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        self.release()
        return self._scrubber.scrub(rest) if rest else rest
