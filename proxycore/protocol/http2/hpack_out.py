"""The HPACK encoder of our heads (responses to agents, requests to upstreams): stateless (no
dynamic table), each field cached.

Theory of operation
-------------------
`H2Server` and `H2Client` encode every head they send with a `StatelessEncoder`
(`endpoint.H2Endpoint._send_head`). It writes
every field as an index into HPACK's static table when the whole field is in it (RFC 7541 6.1),
else as a literal that is never added to the peer's dynamic table (6.2.2 "without indexing",
or 6.2.3 "never indexed" for the fields that carry secrets), the name as a static index when the
table has it, strings without Huffman coding (5.2). Nothing it writes changes the decoder's
state, so:

- encoding a field is a pure function of the field, and its bytes are cached (one bounded dict
  for the process: the same bytes for every connection, so nothing is held per connection;
  fields that carry secrets are never cached);
  hpack's own encoder searched its tables and re-encoded every field of every response: the
  largest single cost of a small response (bench/bench_h2.py, docs/benchmarks.md);
- a head refused after encoding cannot leave the peer's decoder out of step;
- no field can serve as a compression oracle on another (the dynamic table is shared by
  every stream of the connection: CRIME-like probing, RFC 7541 7.1).

The price is bytes on the wire: a repeated field costs its literal each time instead of one
octet. A peer's SETTINGS_HEADER_TABLE_SIZE is accepted and needs no answer: an encoder that
never inserts never has to signal a table size update (RFC 7541 4.2, 6.3).

Incoming heads keep hpack's Decoder, which enforces the header list size.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpack.table import HeaderTable

from proxycore.protocol.credentials import CREDENTIAL_HEADERS

__all__ = ["SENSITIVE", "StatelessEncoder", "encode_field"]

# RFC 7541 Appendix A: index 1..61.
_STATIC_FIELD: dict[tuple[bytes, bytes], int] = {}
_STATIC_NAME: dict[bytes, int] = {}
for _index, (_name, _value) in enumerate(HeaderTable.STATIC_TABLE, start=1):
    _STATIC_FIELD.setdefault((_name, _value), _index)
    _STATIC_NAME.setdefault(_name, _index)

# Fields whose values are secrets: never indexed (RFC 7541 7.1.3) and never cached (here, nor in
# connection.py's cache of whole response heads). Every field a credential travels in (the
# provider keys the proxy injects upstream among them), and cookies.
SENSITIVE = CREDENTIAL_HEADERS | {b"set-cookie"}

_CACHE_LIMIT = 1024
_cache: dict[tuple[bytes, bytes], bytes] = {}


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """RFC 7541 5.1: `value` with an N-bit prefix, `first` holding the octet's other bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    """RFC 7541 5.2: a string literal, without Huffman coding."""
    return _integer(len(data), 7, 0) + data


def encode_field(name: bytes, value: bytes) -> bytes:
    """One field's representation (RFC 7541 6.1, 6.2.2, 6.2.3); never a dynamic-table one."""
    index = _STATIC_FIELD.get((name, value))
    if index is not None:
        return _integer(index, 7, 0x80)
    first = 0x10 if name in SENSITIVE else 0x00
    name_index = _STATIC_NAME.get(name)
    if name_index is not None:
        return _integer(name_index, 4, first) + _string(value)
    return bytes((first,)) + _string(name) + _string(value)


class StatelessEncoder:
    """An HPACK encoder's interface (`encode`, a settable `header_table_size`)."""

    __slots__ = ("header_table_size",)

    def __init__(self) -> None:
        self.header_table_size = 4096  # the peer's setting: nothing to do with it

    def encode(self, headers: Iterable[tuple[bytes, bytes]], huffman: bool = True) -> bytes:
        cache = _cache
        out = []
        for field in headers:
            # Any pair (tuple subclasses among them): the key is the pair itself.
            name, value = field[0], field[1]
            key = (name, value)
            encoded = cache.get(key)
            if encoded is None:
                encoded = encode_field(name, value)
                if name in SENSITIVE:
                    out.append(encoded)
                    continue
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[key] = encoded
            out.append(encoded)
        return b"".join(out)
