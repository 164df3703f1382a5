"""The stateless HPACK encoder of our heads (proxycore/protocol/http2/hpack_out.py): what it
writes decodes (hpack's Decoder, as a client's) to the fields given, and never touches the
client's dynamic table."""

from __future__ import annotations

import random

import hpack
from hpack.table import HeaderTable

from proxycore.protocol.http2.hpack_out import StatelessEncoder, encode_field


def _random_fields(rnd: random.Random) -> list[tuple[bytes, bytes]]:
    fields = []
    for _ in range(rnd.randrange(0, 8)):
        if rnd.random() < 0.4:
            name, value = rnd.choice(HeaderTable.STATIC_TABLE)
            if rnd.random() < 0.5:
                value = bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 300)))
        else:
            name = bytes(rnd.randrange(97, 123) for _ in range(rnd.randrange(1, 200)))
            value = bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 300)))
        fields.append((name, value))
    return fields


def test_round_trip_through_a_client_decoder() -> None:
    rnd = random.Random(16)
    encoder, decoder = StatelessEncoder(), hpack.Decoder()
    for _ in range(2000):
        fields = _random_fields(rnd)
        decoded = decoder.decode(encoder.encode(fields), raw=True)
        assert [(bytes(n), bytes(v)) for n, v in decoded] == fields
    assert len(decoder.header_table.dynamic_entries) == 0  # nothing was ever indexed


def test_representations() -> None:
    assert encode_field(b":status", b"200") == b"\x88"  # static index 8 (RFC 7541 C.2.4)
    # A static name, a literal value without indexing (6.2.2): index 31 content-type.
    assert encode_field(b"content-type", b"a") == b"\x0f\x10\x01a"
    # Never indexed (6.2.3) for a secret-bearing field; a new name as a literal.
    assert encode_field(b"set-cookie", b"s")[0] & 0xF0 == 0x10
    assert encode_field(b"x-y", b"z") == b"\x00\x03x-y\x01z"
    # Lengths over the 7-bit prefix (5.1).
    long = b"v" * 300
    assert hpack.Decoder().decode(encode_field(b"x-long", long), raw=True) == [(b"x-long", long)]


def test_client_table_size_setting_is_accepted() -> None:
    encoder = StatelessEncoder()
    encoder.header_table_size = 0  # as h2 sets it from the client's SETTINGS
    decoder = hpack.Decoder()
    decoder.header_table_size = 0
    assert decoder.decode(encoder.encode([(b"server", b"x")]), raw=True) == [(b"server", b"x")]


def test_credentials_are_never_indexed_nor_cached() -> None:
    """The provider keys the proxy injects upstream (and every other credential field): "never
    indexed" (RFC 7541 7.1.3, so no intermediary re-encoding the head may index it either),
    and never kept in the process-wide cache of encoded fields."""
    from proxycore.protocol.credentials import CREDENTIAL_HEADERS
    from proxycore.protocol.http2 import hpack_out

    encoder = StatelessEncoder()
    for name in sorted(CREDENTIAL_HEADERS):
        secret = b"sk-test-" + name
        block = encoder.encode([(b":method", b"POST"), (name, secret)])
        assert hpack.Decoder().decode(block, raw=True)[1] == (name, secret)
        assert block[1] & 0xF0 == 0x10, name  # after the one-octet :method POST
        assert not any(secret == value for _, value in hpack_out._cache), name
