"""Read the server name out of a TLS ClientHello without terminating anything.

A connection the kernel redirected to the proxy (transparent capture: nftables sent a crew's
TCP to port 443 of some address to the proxy's port instead) carries no CONNECT line saying
where it is going. Its first flight does: the ClientHello's server_name extension (RFC 6066 3).
This module reads that flight, bounded, and hands back the name; the proxy then plans the
connection exactly as a CONNECT to that name and the original port, and relays the very bytes
it read (nothing here is sent, changed or answered).

The reading is strict, because the name decides the policy and a second reading is how a
filter is bypassed:
- The flight is handshake records (content type 22) only; the ClientHello may span records
  (RFC 8446 5.1 lets a handshake message be fragmented), up to `MAX_HELLO` bytes in all.
- Every length is checked against what contains it; trailing bytes in a vector are malformed.
- server_name must appear at most once (RFC 8446 4.2: no extension type twice), with exactly one
  entry, of type host_name, whose bytes are an LDH name (letters, digits, hyphens, dots): no
  NUL, no space, no trailing dot games, no IP literal (RFC 6066 3: "Literal IPv4 and IPv6
  addresses are not permitted in HostName").
- A ClientHello offering Encrypted Client Hello (draft-ietf-tls-esni, extension 0xfe0d) names
  only its public relay in the clear; the real destination is sealed. It is reported as such,
  for the caller to refuse: a policy cannot be applied to a name it cannot read.

Pure: no sockets, no trio, no ssl module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "MAX_FLIGHT",
    "MAX_HELLO",
    "ClientHello",
    "Malformed",
    "NeedMore",
    "NotTls",
    "read_client_hello",
]

# A ClientHello with post-quantum key shares (X25519MLKEM768: 1,216 bytes of share) and a long
# session ticket is 2-3 KiB; 64 KiB is one whole handshake message of the largest length a
# record layer can carry unfragmented four times over, and still a bounded buffer per connection.
MAX_HELLO = 64 * 1024
# The records around it: a client may cut its hello into many small records (some do, to get
# past middleboxes that read only the first), each with a 5-byte header; past this many bytes of
# flight without a whole hello, it is refused.
MAX_FLIGHT = 2 * MAX_HELLO
# Real clients send their hello in one record, two with very large key shares; a hello cut into
# more than this many is refused, which bounds the work of one reading.
MAX_RECORDS = 64

_RECORD_HANDSHAKE = 22
_HANDSHAKE_CLIENT_HELLO = 1
_EXT_SERVER_NAME = 0
_EXT_ALPN = 16
# Encrypted Client Hello (draft-ietf-tls-esni: 0xfe0d, earlier drafts 0xfe08-0xfe0c) and the
# older ESNI (0xffce): the name in the clear is not the destination.
_EXT_ECH = frozenset((*range(0xFE08, 0xFE0E), 0xFFCE))
_NAME_TYPE_HOST = 0
# RFC 1035 2.3.1 / RFC 1123 2.1 labels; the policy's normalizer decides the rest.
_LDH_NAME = re.compile(
    rb"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    rb"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
_ALL_DIGITS_AND_DOTS = re.compile(rb"[0-9.]+")


@dataclass(frozen=True, slots=True)
class NeedMore:
    """The flight so far is a valid prefix of a ClientHello: read on, until it holds at least
    `at_least` bytes (no reading of a shorter flight can say more: a caller that reads again
    only then parses each record once, however the agent dribbles its bytes)."""

    at_least: int


@dataclass(frozen=True, slots=True)
class NotTls:
    """The first byte is not a TLS handshake record: the caller reads it as something else."""


@dataclass(frozen=True, slots=True)
class Malformed:
    """Not a ClientHello this proxy will relay; `reason` says why, for the journal."""

    reason: str


@dataclass(frozen=True, slots=True)
class ClientHello:
    """A whole ClientHello. `server_name` is lowercased ASCII, or None when the client sent
    none; `ech`: it offers Encrypted Client Hello (the name is only the public relay's);
    `alpn`: the protocols it offers, in its order; `length`: the bytes of the records that
    carried it (everything before that offset is the hello, everything after is not read)."""

    server_name: str | None
    ech: bool
    alpn: tuple[str, ...]
    length: int


Reading = NeedMore | NotTls | Malformed | ClientHello


class _Bad(Exception):
    pass


def read_client_hello(flight: bytes | bytearray) -> Reading:
    """What the first bytes of a connection say, so far. Never raises."""
    try:
        reading = _read(bytes(flight[: MAX_FLIGHT + 1]))
    except _Bad as bad:
        return Malformed(str(bad))
    if isinstance(reading, NeedMore) and len(flight) > MAX_FLIGHT:
        return Malformed(f"no whole ClientHello in the first {MAX_FLIGHT} bytes")
    return reading


def _read(data: bytes) -> Reading:
    if not data:
        return NeedMore(1)
    if data[0] != _RECORD_HANDSHAKE:
        return NotTls()
    # Reassemble the handshake message from as many records as it takes.
    message = bytearray()
    offset = 0
    needed: int | None = None
    count = 0
    while needed is None or len(message) < needed:
        if count == MAX_RECORDS:
            raise _Bad(f"a ClientHello cut into more than {MAX_RECORDS} records")
        count += 1
        if len(data) - offset < 5:
            return NeedMore(offset + 5)
        content_type = data[offset]
        major = data[offset + 1]
        length = int.from_bytes(data[offset + 3 : offset + 5], "big")
        if content_type != _RECORD_HANDSHAKE:
            raise _Bad("a record other than handshake inside the ClientHello")
        if major != 3:
            raise _Bad(f"record version {major}.{data[offset + 2]} is not TLS")
        if length == 0 or length > 16384 + 256:
            # RFC 8446 5.1: no zero-length handshake fragments; 2^14 bytes of plaintext.
            raise _Bad(f"record length {length}")
        if len(data) - offset - 5 < length:
            return NeedMore(offset + 5 + length)
        message += data[offset + 5 : offset + 5 + length]
        offset += 5 + length
        if needed is None and len(message) >= 4:
            if message[0] != _HANDSHAKE_CLIENT_HELLO:
                raise _Bad(f"handshake message type {message[0]} where a ClientHello belongs")
            needed = 4 + int.from_bytes(message[1:4], "big")
            if needed > MAX_HELLO:
                raise _Bad(f"a ClientHello of {needed} bytes (over {MAX_HELLO})")
        if len(message) > MAX_HELLO:
            raise _Bad(f"a ClientHello over {MAX_HELLO} bytes")
    if len(message) != needed:
        # The hello's last record carries more than the hello: a second handshake message in
        # the first flight, which no client sends before the server's answer.
        raise _Bad("bytes after the ClientHello in its last record")
    return _hello(bytes(message[4:]), offset)


class _Cursor:
    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes, pos: int = 0, end: int | None = None) -> None:
        self.data = data
        self.pos = pos
        self.end = len(data) if end is None else end

    def take(self, n: int, what: str) -> bytes:
        if n > self.end - self.pos:
            raise _Bad(f"{what} runs past its container")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def number(self, size: int, what: str) -> int:
        return int.from_bytes(self.take(size, what), "big")

    def vector(self, size: int, what: str) -> _Cursor:
        length = self.number(size, what + " length")
        if length > self.end - self.pos:
            raise _Bad(f"{what} runs past its container")
        inner = _Cursor(self.data, self.pos, self.pos + length)
        self.pos += length
        return inner

    def done(self) -> bool:
        return self.pos >= self.end

    def finish(self, what: str) -> None:
        if self.pos != self.end:
            raise _Bad(f"trailing bytes in {what}")


def _hello(body: bytes, length: int) -> ClientHello:
    cursor = _Cursor(body)
    version = cursor.number(2, "legacy_version")
    if version >> 8 != 3:
        raise _Bad(f"ClientHello version {version:#06x}")
    cursor.take(32, "random")
    session = cursor.vector(1, "legacy_session_id")
    if session.end - session.pos > 32:
        raise _Bad("a session id over 32 bytes")
    suites = cursor.vector(2, "cipher_suites")
    if (suites.end - suites.pos) % 2 or suites.done():
        raise _Bad("cipher_suites is not a non-empty list of pairs")
    if cursor.vector(1, "compression_methods").done():
        raise _Bad("no compression method")
    if cursor.done():
        # RFC 5246 7.4.1.2: extensions may be absent (an SSLv3-era hello): no name, no ALPN.
        return ClientHello(None, False, (), length)
    extensions = cursor.vector(2, "extensions")
    cursor.finish("the ClientHello")
    seen: set[int] = set()
    name: str | None = None
    alpn: tuple[str, ...] = ()
    ech = False
    while not extensions.done():
        kind = extensions.number(2, "extension type")
        data = extensions.vector(2, f"extension {kind}")
        if kind in seen:
            raise _Bad(f"extension {kind} twice")
        seen.add(kind)
        if kind == _EXT_SERVER_NAME:
            name = _server_name(data)
        elif kind == _EXT_ALPN:
            alpn = _alpn(data)
        elif kind in _EXT_ECH:
            ech = True
    return ClientHello(name, ech, alpn, length)


def _server_name(data: _Cursor) -> str:
    names = data.vector(2, "server_name_list")
    data.finish("server_name")
    kind = names.number(1, "name_type")
    if kind != _NAME_TYPE_HOST:
        raise _Bad(f"server name of type {kind}")
    raw = names.vector(2, "host_name")
    names.finish("server_name_list (more than one name)")
    host = raw.take(raw.end - raw.pos, "host_name")
    if not host or len(host) > 253 or not _LDH_NAME.fullmatch(host):
        raise _Bad("a server name that is not a host name (letters, digits, '-', '.')")
    if _ALL_DIGITS_AND_DOTS.fullmatch(host):
        raise _Bad("an address literal as server name (RFC 6066 3)")
    return host.decode("ascii").lower()


def _alpn(data: _Cursor) -> tuple[str, ...]:
    protocols = data.vector(2, "protocol_name_list")
    data.finish("application_layer_protocol_negotiation")
    found: list[str] = []
    while not protocols.done():
        name = protocols.vector(1, "protocol name")
        raw = name.take(name.end - name.pos, "protocol name")
        if not raw:
            raise _Bad("an empty ALPN protocol name (RFC 7301 3.1)")
        found.append(raw.decode("ascii", "replace"))
        if len(found) > 64:
            raise _Bad("over 64 ALPN protocols")
    if not found:
        raise _Bad("an empty ALPN list")
    return tuple(found)
