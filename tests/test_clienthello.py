"""The ClientHello reader of transparent capture (proxycore/protocol/clienthello.py): real
hellos from Python's ssl, every split of them, re-fragmented records, and hostile ones."""

from __future__ import annotations

import ssl
import struct

import pytest

from proxycore.protocol.clienthello import (
    MAX_FLIGHT,
    ClientHello,
    Malformed,
    NeedMore,
    NotTls,
    read_client_hello,
)


def real_hello(server_name: str | None, alpn: list[str] | None = None) -> bytes:
    """The first flight Python's ssl (OpenSSL) sends as a client."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if alpn:
        context.set_alpn_protocols(alpn)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def records(message: bytes, size: int) -> bytes:
    """A handshake message cut into handshake records of `size` bytes (RFC 8446 5.1)."""
    return b"".join(
        bytes([22, 3, 1]) + struct.pack(">H", len(piece)) + piece
        for piece in (message[start : start + size] for start in range(0, len(message), size))
    )


def message_of(flight: bytes) -> bytes:
    """The handshake message of a one-record flight."""
    assert flight[0] == 22
    length = struct.unpack(">H", flight[3:5])[0]
    return flight[5 : 5 + length]


def hello_message(extensions: list[tuple[int, bytes]], *, version: int = 0x0303) -> bytes:
    body = struct.pack(">H", version) + b"\x07" * 32 + b"\x00"  # random, no session id
    body += struct.pack(">H", 2) + b"\x13\x01" + b"\x01\x00"  # one suite, null compression
    ext = b"".join(struct.pack(">HH", kind, len(data)) + data for kind, data in extensions)
    body += struct.pack(">H", len(ext)) + ext
    return b"\x01" + len(body).to_bytes(3, "big") + body


def sni(name: bytes, kind: int = 0) -> tuple[int, bytes]:
    entry = bytes([kind]) + struct.pack(">H", len(name)) + name
    return (0, struct.pack(">H", len(entry)) + entry)


def test_a_real_hello_gives_its_name_and_protocols() -> None:
    flight = real_hello("API.Example.test", ["h2", "http/1.1"])
    reading = read_client_hello(flight)
    assert reading == ClientHello("api.example.test", False, ("h2", "http/1.1"), len(flight))


def test_a_hello_without_a_name() -> None:
    reading = read_client_hello(real_hello(None))
    assert isinstance(reading, ClientHello) and reading.server_name is None


def test_every_split_reads_the_same() -> None:
    flight = real_hello("split.example.test", ["http/1.1"])
    whole = read_client_hello(flight)
    for cut in range(len(flight)):
        reading = read_client_hello(flight[:cut])
        assert isinstance(reading, NeedMore) and cut < reading.at_least <= len(flight), cut
    assert read_client_hello(flight + b"\x17\x03\x03\x00\x05early") == whole


@pytest.mark.parametrize("size", [64, 100, 1000, 16384])
def test_a_hello_in_many_records_reads_the_same(size: int) -> None:
    flight = real_hello("frag.example.test")
    refragmented = records(message_of(flight), size)
    reading = read_client_hello(refragmented)
    assert isinstance(reading, ClientHello)
    assert reading.server_name == "frag.example.test" and reading.length == len(refragmented)


def test_what_is_not_tls() -> None:
    assert read_client_hello(b"GET / HTTP/1.1\r\n") == NotTls()
    assert read_client_hello(b"") == NeedMore(1)


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (hello_message([sni(b"a.test"), sni(b"b.test")]), "twice"),
        (hello_message([sni(b"10.0.0.1")]), "address literal"),
        (hello_message([sni(b"a.test\x00.evil.test")]), "not a host name"),
        (hello_message([sni(b"a.test.")]), "not a host name"),
        (hello_message([sni(b"a test")]), "not a host name"),
        (hello_message([sni(b"")]), "not a host name"),
        (hello_message([sni(b"a.test", kind=1)]), "type 1"),
        (hello_message([sni(b"a.test")], version=0x0200), "version"),
        (hello_message([(16, b"\x00\x01\x00")]), "empty ALPN protocol"),
        (b"\x02" + hello_message([sni(b"a.test")])[1:], "type 2"),
    ],
)
def test_hostile_hellos_are_malformed(message: bytes, reason: str) -> None:
    reading = read_client_hello(records(message, 16384))
    assert isinstance(reading, Malformed) and reason in reading.reason, reading


def test_two_names_in_one_extension_are_malformed() -> None:
    one = b"\x00" + struct.pack(">H", 6) + b"a.test"
    two = one + b"\x00" + struct.pack(">H", 6) + b"b.test"
    message = hello_message([(0, struct.pack(">H", len(two)) + two)])
    reading = read_client_hello(records(message, 16384))
    assert isinstance(reading, Malformed) and "more than one name" in reading.reason


def test_lengths_that_lie_are_malformed_not_a_wait() -> None:
    message = bytearray(hello_message([sni(b"a.test")]))
    # The extensions' length says one byte more than the hello holds.
    ext_at = 4 + 2 + 32 + 1 + 2 + 2 + 2
    message[ext_at : ext_at + 2] = struct.pack(">H", len(message) - ext_at - 2 + 1)
    reading = read_client_hello(records(bytes(message), 16384))
    assert isinstance(reading, Malformed), reading
    # A record of another type in the middle of the hello.
    flight = records(hello_message([sni(b"a.test")]), 10)
    mixed = flight[:15] + b"\x17\x03\x03\x00\x01x" + flight[15:]
    assert isinstance(read_client_hello(mixed), Malformed)


@pytest.mark.parametrize("kind", [0xFE0D, 0xFE0A, 0xFE08, 0xFFCE])
def test_encrypted_client_hello_is_reported(kind: int) -> None:
    """The final codepoint, earlier drafts' and the older ESNI's: the name in the clear is a
    relay's, never the destination."""
    reading = read_client_hello(records(hello_message([sni(b"relay.test"), (kind, b"x")]), 512))
    assert isinstance(reading, ClientHello) and reading.ech and reading.server_name == "relay.test"


def test_the_flight_and_the_work_are_bounded() -> None:
    # A hello that claims to be huge: refused from its header, not buffered without end.
    header = b"\x01" + (MAX_FLIGHT).to_bytes(3, "big")
    assert isinstance(read_client_hello(records(header, 4)), Malformed)
    # Cut into one-byte records (a way past middleboxes that read one record): refused after
    # MAX_RECORDS, so one reading never walks thousands of records.
    tiny = records(message_of(real_hello("tiny.example.test")), 1)
    reading = read_client_hello(tiny)
    assert isinstance(reading, Malformed) and "records" in reading.reason, reading
    # Whatever it says, a flight past MAX_FLIGHT without a whole hello is refused.
    assert isinstance(read_client_hello(b"\x16\x03\x01\x40\x00" + b"\x01" * MAX_FLIGHT), Malformed)
