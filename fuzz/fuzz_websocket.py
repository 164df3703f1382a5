"""Fuzz the WebSocket frame relay (proxycore/protocol/wsrelay.py) with whole sessions.

The input drives a session: messages each side sends (text or binary, with a credential put in
the upstream's, fragmented anywhere), pings, closes, raw garbage, a lost connection, the idle
and close deadlines. The bytes of each step reach the relay in random splits. A wsproto peer on
each side reads what the relay sends it, as the agent's client and the upstream would.

Invariants:
- nothing escapes the relay but `WebSocketProtocolError`, and never for what a peer sends;
- what the relay sends either side reads as valid frames (the peers never fail to parse it);
- no message the agent reassembles, and no Close reason it reads, holds a credential (whole:
  a secret split across fragments is reassembled before the check);
- the session does not depend on the splits: run again with every step in one piece, the
  agent and the upstream receive the same messages and closes (unless a peer broke the
  protocol, where what came before the broken byte may differ by the split);
- what the relay sends is bounded by what it took in (twice, plus a little per step): it makes
  nothing up and, with what it holds back, nothing grows without input.
"""

from __future__ import annotations

import itertools
import os
import struct
import sys

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from native.scrub import Scrubber
from native.scrub_patterns import DEFAULT_SHAPES
from proxycore.protocol.wsrelay import Side, WebSocketLimits, WebSocketRelay

KEY = "sk-ant-api03-FUZZWEBSOCKET-key-0123456789abcdef"
SECRETS = (KEY,)
SCRUBBER = Scrubber([("anthropic", KEY.encode())], DEFAULT_SHAPES)
LIMITS = WebSocketLimits(max_message_bytes=200, control_per_second=8)
# Per step, what the relay sends may exceed twice what it took by this much at most (frame
# headers, Closes, a redaction marker longer than what it replaced), summed over the session:
# the scrubber may hold bytes of one step back until a later one.
SLACK = 1024


# The first byte of a step: its kind (the low nibble, modulo 9), its side and a flag.
TEXT, BINARY, PING, PONG, CLOSE, RAW, GARBAGE, END = 0, 1, 3, 4, 5, 6, 7, 8
UPSTREAM, DEADLINE = 0x80, 0x40


class Source:
    """The fuzzer's bytes, read as numbers and strings; zeros once they run out."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    @property
    def exhausted(self) -> bool:
        return self.pos >= len(self.data)


def _frame(opcode: int, payload: bytes, *, fin: bool = True, masked: bool) -> bytes:
    """One raw frame, any opcode and length (invalid ones included)."""
    head = bytearray([(0x80 if fin else 0) | opcode])
    mask_bit = 0x80 if masked else 0
    n = len(payload)
    if n < 126:
        head.append(mask_bit | n)
    elif n < 65536:
        head += bytes([mask_bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", n)
    if masked:
        key = b"\x01\x02\x03\x04"
        head += key
        payload = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    return bytes(head) + payload


def _steps(source: Source) -> list[tuple[str, Side, bytes, list[int]]]:
    """Decode the input into steps: (kind, side, bytes for the relay, split points)."""
    senders = {
        Side.AGENT: Connection(ConnectionType.CLIENT),  # the agent's client frames (masked)
        Side.UPSTREAM: Connection(ConnectionType.SERVER),
    }
    steps: list[tuple[str, Side, bytes, list[int]]] = []
    while not source.exhausted and len(steps) < 32:
        op = source.byte()
        side = Side.UPSTREAM if op & UPSTREAM else Side.AGENT
        sender = senders[side]
        kind = (op & 0x0F) % 9
        data = b""
        if kind in (0, 1, 2) and sender.state is ConnectionState.OPEN:
            body = source.take(source.byte())
            if side is Side.UPSTREAM and source.byte() & 1:
                at = source.byte() % (len(body) + 1)
                body = body[:at] + KEY.encode() + body[at:]
            parts = 1 + source.byte() % 4
            size = max(1, len(body) // parts)
            pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
            for index, piece in enumerate(pieces):
                last = index == len(pieces) - 1
                if kind == 0:
                    text = piece.decode("latin-1")  # any bytes, as valid text
                    data += sender.send(TextMessage(text, message_finished=last))
                else:
                    data += sender.send(BytesMessage(piece, message_finished=last))
        elif kind == 3 and sender.state is ConnectionState.OPEN:
            data = sender.send(Ping(source.take(source.byte() % 126)))
        elif kind == 4 and sender.state is ConnectionState.OPEN:
            data = sender.send(Pong(source.take(source.byte() % 126)))
        elif kind == 5 and sender.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            code = (1000, 1001, 1005, 3000, 4999)[source.byte() % 5]
            reason = KEY if side is Side.UPSTREAM and source.byte() & 1 else "bye"
            data = sender.send(CloseConnection(code, None if code == 1005 else reason))
        elif kind == 6:
            # Raw frames: any opcode, length, fin bit and mask bit (invalid ones included).
            flags = source.byte()
            data = _frame(flags & 0x0F, source.take(source.byte()), fin=bool(flags & 0x10),
                          masked=bool(flags & 0x20))  # fmt: skip
        elif kind == 7:
            data = source.take(source.byte() % 32)  # garbage
        elif kind == 8:
            steps.append(("deadline" if op & DEADLINE else "lost", side, b"", []))
            continue
        else:
            continue
        splits = sorted({source.byte() % (len(data) + 1) for _ in range(source.byte() % 5)})
        steps.append(("bytes", side, data, splits))
    return steps


class _Peer:
    """What one side reads of the relay's output: messages, closes; never a parse failure."""

    def __init__(self, side: Side) -> None:
        kind = ConnectionType.CLIENT if side is Side.AGENT else ConnectionType.SERVER
        self.side = side
        self.conn = Connection(kind)
        self.messages: list[bytes] = []
        self.closes: list[tuple[int, str]] = []
        self.current = bytearray()

    def read(self, data: bytes) -> None:
        if not data:
            return
        assert self.conn.state is not ConnectionState.CLOSED, (self.side, "bytes after close")
        self.conn.receive_data(data)
        for event in self.conn.events():
            if isinstance(event, TextMessage | BytesMessage):
                chunk = event.data
                self.current += chunk.encode("utf-8") if isinstance(chunk, str) else chunk
                if event.message_finished:
                    self.messages.append(bytes(self.current))
                    self.current.clear()
            elif isinstance(event, CloseConnection):
                state = self.conn.state
                assert state in (ConnectionState.REMOTE_CLOSING, ConnectionState.CLOSED), (
                    f"the relay sent {self.side.value} bytes it cannot parse: {event.reason}"
                )
                self.closes.append((int(event.code), event.reason or ""))
                if state is ConnectionState.REMOTE_CLOSING:
                    self.conn.send(CloseConnection(event.code))  # a peer answers a Close


def run_session(
    steps: list[tuple[str, Side, bytes, list[int]]], *, split: bool
) -> tuple[WebSocketRelay, dict[Side, _Peer]]:
    relay = WebSocketRelay(SCRUBBER, LIMITS)
    peers = {side: _Peer(side) for side in Side}
    now = 0.0
    taken = sent = 0
    for kind, side, data, splits in steps:
        now += 0.01
        if kind == "lost":
            relay.lost(side, f"{side.value}_reset")
        elif kind == "deadline":
            if relay.closing:
                relay.expire_close()
            else:
                relay.expire_idle()
        else:
            cuts = [0, *splits, len(data)] if split else [0, len(data)]
            for start, end in itertools.pairwise(cuts):
                if end > start:
                    relay.receive(side, data[start:end], now)
        taken += len(data) + SLACK
        for target in Side:
            out = relay.take(target)
            sent += len(out)
            peers[target].read(out)
        assert sent <= 2 * taken, ("the relay sent more than it took", sent, taken)
        if relay.done:
            break
    return relay, peers


def TestOneInput(data: bytes) -> None:
    steps = _steps(Source(data))
    relay, peers = run_session(steps, split=True)
    agent = peers[Side.AGENT]
    for message in agent.messages:
        for secret in SECRETS:
            assert secret.encode() not in message, ("a credential reached the agent", message)
    for _, reason in agent.closes:
        assert not any(secret in reason for secret in SECRETS), reason
    whole, whole_peers = run_session(steps, split=False)
    if "protocol_error" not in relay.ended + whole.ended:
        for side in Side:
            assert peers[side].messages == whole_peers[side].messages, side
            assert peers[side].closes == whole_peers[side].closes, side
        assert relay.ended == whole.ended, (relay.ended, whole.ended)


def _splits(*at: int) -> bytes:
    return bytes([len(at), *at])


def message(kind: int, body: bytes, *, upstream: bool = False, key_at: int | None = None,
            parts: int = 1, splits: tuple[int, ...] = ()) -> bytes:  # fmt: skip
    """The input bytes of one message step (the order `_steps` reads them in)."""
    out = bytes([kind | (UPSTREAM if upstream else 0), len(body)]) + body
    if upstream:
        out += bytes([0]) if key_at is None else bytes([1, key_at])
    return out + bytes([parts - 1]) + _splits(*splits)


def control(kind: int, payload: bytes = b"", *, upstream: bool = False) -> bytes:
    return bytes([kind | (UPSTREAM if upstream else 0), len(payload)]) + payload + _splits()


def close(code_index: int = 0, *, upstream: bool = False, key_reason: bool = False) -> bytes:
    out = bytes([CLOSE | (UPSTREAM if upstream else 0), code_index])
    if upstream:
        out += bytes([int(key_reason)])
    return out + _splits()


SEEDS = [
    # The upstream sends text with the key in the middle, in 3 fragments, split twice; then the
    # agent closes and the upstream answers with the key as the reason: a complete close.
    message(TEXT, b"a" * 40, upstream=True, key_at=10, parts=3, splits=(7, 30))
    + close()
    + close(3, upstream=True, key_reason=True),
    # The agent sends binary and a ping; the upstream binary with the key, then a ping flood.
    message(BINARY, b"hello", splits=(2,))
    + control(PING, b"ping")
    + message(BINARY, b"\x00" * 30, upstream=True, key_at=0, parts=2)
    + control(PING, upstream=True) * 12,
    # A raw control frame over 125 bytes from the agent (masked, fin), then garbage upstream.
    bytes([RAW, 0x39, 200])
    + b"x" * 200
    + _splits(1)
    + bytes([GARBAGE | UPSTREAM, 9])
    + b"\xff" * 9,
    # An oversized message from the upstream, in fragments.
    message(BINARY, b"z" * 255, upstream=True, parts=4)
    + message(BINARY, b"z" * 255, upstream=True, parts=4),
    # A close from the agent, the deadline twice (the close's wait, then idle), a lost upstream.
    close() + bytes([END | DEADLINE, END | DEADLINE, END | UPSTREAM]),
    bytes([END | DEADLINE]) + message(TEXT, b"late") + bytes([END | DEADLINE]),
]


if __name__ == "__main__":
    from seeded import fuzz

    fuzz("websocket", SEEDS, TestOneInput)
