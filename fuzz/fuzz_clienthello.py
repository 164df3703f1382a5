"""Fuzz the ClientHello reader of transparent capture (proxycore/protocol/clienthello.py).

Run:  python fuzz/fuzz_clienthello.py -runs=300000
(atheris is imported only in `main`; tests/test_fuzz_clienthello.py replays `SEEDS` without it.)

The input is a first flight. Invariants, on every input:
- `read_client_hello` never raises, and returns one of its four readings.
- A name it reports is lowercase LDH (letters, digits, '-', '.'), never an address literal:
  the policy sees only names it can compare.
- Split anywhere, the flight reads as `NeedMore` up to the cut (whose `at_least` is past the cut
  and never past the point where the whole reading was made), or as the same reading: the
  answer does not depend on how the agent's bytes arrived, so dribbling cannot change a name.
"""

from __future__ import annotations

import re
import struct
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxycore.protocol.clienthello import (
    ClientHello,
    Malformed,
    NeedMore,
    NotTls,
    read_client_hello,
)

_NAME = re.compile(r"[a-z0-9](?:[a-z0-9.-]*[a-z0-9])?")


def TestOneInput(data: bytes) -> None:
    reading = read_client_hello(data)
    assert isinstance(reading, NeedMore | NotTls | Malformed | ClientHello), reading
    if isinstance(reading, ClientHello):
        name = reading.server_name
        if name is not None:
            assert _NAME.fullmatch(name) and not name.replace(".", "").isdigit(), name
        assert 0 < reading.length <= len(data)
    if isinstance(reading, NeedMore):
        assert reading.at_least > len(data), reading
    # Splits: every prefix is a NeedMore, or reads as the whole does once it holds the hello.
    for cut in {1, len(data) // 3, len(data) // 2, len(data) - 1}:
        if not 0 < cut < len(data):
            continue
        part = read_client_hello(data[:cut])
        if isinstance(reading, ClientHello) and cut < reading.length:
            assert isinstance(part, NeedMore) and cut < part.at_least <= reading.length, (
                cut,
                part,
            )
        elif isinstance(part, ClientHello):
            assert part == reading, (cut, part, reading)


def _hello(extensions: bytes) -> bytes:
    body = b"\x03\x03" + b"\x07" * 32 + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00"
    body += struct.pack(">H", len(extensions)) + extensions
    message = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack(">H", len(message)) + message


def _sni(name: bytes) -> bytes:
    entry = b"\x00" + struct.pack(">H", len(name)) + name
    data = struct.pack(">H", len(entry)) + entry
    return struct.pack(">HH", 0, len(data)) + data


SEEDS = [
    b"",
    b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    _hello(_sni(b"api.example.test")),
    _hello(_sni(b"api.example.test") + struct.pack(">HH", 16, 5) + b"\x00\x03\x02h2"),
    _hello(_sni(b"a.test") + _sni(b"b.test")),
    _hello(_sni(b"10.0.0.1")),
    _hello(_sni(b"relay.test") + struct.pack(">HH", 0xFE0D, 1) + b"x"),
    _hello(b""),
    _hello(_sni(b"a.test"))[:40],
]


def main() -> None:
    from seeded import fuzz

    fuzz("clienthello", SEEDS, TestOneInput)


if __name__ == "__main__":
    main()
