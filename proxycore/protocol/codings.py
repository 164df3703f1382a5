"""Compressed response bodies: decoded, scrubbed and encoded again with the same coding (sans-IO).

Theory of operation: the proxy asks every upstream for `accept-encoding: identity`; some
compress anyway, and the scrubber cannot read compressed bytes. A `Recoder` sits between the
upstream's body and the scrubber (a `ScrubStream` or an `SseScrubber`): it inflates what arrives
(RFC 9110 8.4.1: `gzip` / `x-gzip` is RFC 1952, `deflate` is RFC 1950 zlib, and raw RFC 1951
deflate as sent by servers that get it wrong; `br` is RFC 7932 brotli), feeds the scrubber,
and encodes what the scrubber releases with the same coding, flushed after each read
(`Z_SYNC_FLUSH`, brotli's flush) so a stream keeps streaming: the client's decoder can decode
all it has. The coding field is kept; the length is the new one (a body read whole) or the body
is re-framed (streamed). Stacked and unknown codings are refused (`declared_coding`).

A body *labelled* identity (or with no coding) that begins with a gzip member (1f 8b 08) or a
zlib header with a standard level (78 01, 78 5e, 78 9c, 78 da) is scrubbed the same way and
relayed re-encoded, unless its content-type says the compressed bytes are the payload (an
archive: `application/gzip`, `application/x-tar`, `application/octet-stream`, ...: a download
whose checksum must hold; the byte scrubber still reads it as it is). A body that begins like
zlib is taken for zlib only if its first 64 bytes inflate without an error, and one that does
not inflate before anything came out of it is still read as the plain text it is (text that
happens to begin with "x^").

Bounds: inflating proceeds `PIECE` bytes at a time, each scrubbed and encoded before the next
(zlib's `max_length`, brotli's `output_buffer_limit`), so a decompression bomb never sits in
memory; past `RATIO_FLOOR` bytes out, more than `MAX_RATIO` bytes out per byte in, or more than
`MAX_DECODED` bytes out in all, is a `CodingError` (the proxy refuses the response if nothing
went out yet, else cuts it).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Protocol

import brotli

from proxycore.errors import HttpProtocolError

__all__ = ["CodingError", "Filter", "Recoder", "declared_coding", "sniffable"]

PIECE = 64 * 1024
MAX_RATIO = 200
RATIO_FLOOR = 8 * 1024 * 1024
MAX_DECODED = 1024 * 1024 * 1024
LEVEL = 1  # re-encoding is a courtesy to the client: fast over small
BROTLI_QUALITY = 1
_SNIFF = 3
# A body labelled identity that begins like zlib is taken for zlib only if its first bytes (this
# many, or all of a shorter body) inflate without an error: text can begin with "x^".
_ZLIB_TRIAL = 64
_GZIP_MAGIC = b"\x1f\x8b\x08"
_ZLIB_HEADERS = (b"\x78\x01", b"\x78\x5e", b"\x78\x9c", b"\x78\xda")
# Content-types whose compressed bytes are the payload (archives, downloads): not sniffed.
_ARCHIVE_TYPES = frozenset(
    {
        b"application/gzip",
        b"application/x-gzip",
        b"application/x-tgz",
        b"application/x-tar",
        b"application/x-compressed-tar",
        b"application/zlib",
        b"application/octet-stream",
        b"application/x-gtar",
    }
)
_WBITS = {b"gzip": 31, b"zlib": 15, b"raw": -15}


class CodingError(HttpProtocolError):
    """A compressed body that cannot be read, or that inflates past a bound."""

    status_hint = 502


class Filter(Protocol):
    def feed(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


def declared_coding(values: Iterable[bytes]) -> tuple[bytes | None, str | None]:
    """The Content-Encoding fields (RFC 9110 8.4) as (coding to decode, None), (None, None) for
    identity, or (None, the coding that cannot be decoded)."""
    codings = []
    for value in values:
        for coding in value.split(b","):
            coding = coding.strip().lower()
            if coding not in (b"", b"identity"):
                codings.append(coding)
    if not codings:
        return None, None
    if len(codings) > 1:
        return None, b", ".join(codings).decode("ascii", "replace")
    coding = codings[0]
    if coding in (b"gzip", b"x-gzip"):
        return b"gzip", None
    if coding == b"deflate":
        return b"deflate", None
    if coding == b"br":
        return b"br", None
    return None, coding.decode("ascii", "replace")


def sniffable(content_type: bytes | None) -> bool:
    """Whether a body labelled identity is checked for compressed bytes."""
    if content_type is None:
        return True
    return content_type.split(b";", 1)[0].strip().lower() not in _ARCHIVE_TYPES


def _zlib_header(data: bytes) -> bool:
    """RFC 1950 2.2: CM 8, CINFO <= 7, (CMF*256 + FLG) a multiple of 31."""
    return (
        len(data) >= 2
        and data[0] & 0x0F == 8
        and data[0] >> 4 <= 7
        and (data[0] << 8 | data[1]) % 31 == 0
    )


def _inflates(head: bytes) -> bool:
    try:
        zlib.decompressobj().decompress(head[:_ZLIB_TRIAL], PIECE)
    except zlib.error:
        return False
    return True


class Recoder:
    """Feed the body as it came; get it back decoded, scrubbed by `inner`, encoded again.
    `coding`: b"gzip", b"deflate" or b"br" as declared, or None to sniff a body labelled
    identity."""

    __slots__ = (
        "_br",
        "_declared",
        "_decoded",
        "_decoder",
        "_done",
        "_encoded",
        "_encoder",
        "_format",
        "_head",
        "_inner",
        "_max_decoded",
        "_max_ratio",
        "_member_start",
        "_out_any",
        "_raw",
        "_sniffed",
    )

    def __init__(
        self,
        coding: bytes | None,
        inner: Filter,
        *,
        max_decoded: int = MAX_DECODED,
        max_ratio: int = MAX_RATIO,
    ) -> None:
        self._declared = coding
        self._inner = inner
        self._max_decoded = max_decoded
        self._max_ratio = max_ratio
        self._head = bytearray()  # the first bytes, until the format is decided
        self._format: bytes | None = None  # gzip | zlib | raw | plain
        self._sniffed = False
        self._raw: bytearray | None = None  # a sniffed zlib body's bytes, until it inflates
        self._decoder: zlib._Decompress | None = None
        self._encoder: zlib._Compress | None = None
        self._br: tuple[brotli.Decompressor, brotli.Compressor] | None = None
        self._decoded = 0
        self._encoded = 0
        self._out_any = False
        self._member_start = False  # a gzip member after the first has begun, nothing out yet
        self._done = False

    @staticmethod
    def sniffs(body: bytes) -> bool:
        """Whether a body labelled identity begins like a gzip member or a zlib stream."""
        return body[:3] == _GZIP_MAGIC or body[:2] in _ZLIB_HEADERS

    @property
    def coding(self) -> bytes | None:
        """The format decided (gzip, zlib, raw, plain), None before the first bytes."""
        return self._format

    def feed(self, data: bytes) -> bytes:
        if self._format is None:
            head = self._head
            head += data
            if len(head) < _SNIFF or (
                self._declared is None and head[:2] in _ZLIB_HEADERS and len(head) < _ZLIB_TRIAL
            ):
                return b""
            data = self._decide()
        if self._format == b"plain":
            return self._inner.feed(data)
        if self._br is not None:
            return self._unbrotli(data)
        return self._inflate(data)

    def flush(self) -> bytes:
        out = b""
        if self._format is None:
            data = self._decide()
            if self._format == b"plain":
                out = self._inner.feed(data)
            else:
                out = self._unbrotli(data) if self._br is not None else self._inflate(data)
        if self._format == b"plain":
            return out + self._inner.flush()
        if self._br is not None:
            # A stream cut before its end is relayed as far as it decoded (as for gzip).
            encoder = self._br[1]
            tail: bytes = encoder.process(self._inner.flush()) + encoder.finish()
            return out + tail
        if self._raw is not None and not self._out_any:
            # Taken for zlib, never inflated to anything: it was text after all.
            return out + self._plain_after_all() + self._inner.flush()
        assert self._encoder is not None
        scrubbed = self._inner.flush()
        return out + self._encoder.compress(scrubbed) + self._encoder.flush(zlib.Z_FINISH)

    def _decide(self) -> bytes:
        head = bytes(self._head)
        self._head.clear()
        declared = self._declared
        if declared == b"br":
            self._format = b"br"
            self._br = (brotli.Decompressor(), brotli.Compressor(quality=BROTLI_QUALITY))
            return head
        if declared == b"gzip":
            fmt = b"gzip"
        elif declared == b"deflate":
            fmt = b"zlib" if _zlib_header(head) else b"raw"
        elif head[:3] == _GZIP_MAGIC:
            fmt, self._sniffed = b"gzip", True
        elif head[:2] in _ZLIB_HEADERS and _inflates(head):
            fmt, self._sniffed = b"zlib", True
            self._raw = bytearray()
        else:
            fmt = b"plain"
        self._format = fmt
        if fmt != b"plain":
            self._decoder = zlib.decompressobj(_WBITS[fmt])
            self._encoder = zlib.compressobj(LEVEL, zlib.DEFLATED, _WBITS[fmt])
        return head

    def _plain_after_all(self) -> bytes:
        assert self._raw is not None
        raw = bytes(self._raw)
        self._raw = None
        self._format = b"plain"
        return self._inner.feed(raw)

    def _inflate(self, data: bytes) -> bytes:
        assert self._encoder is not None
        if self._raw is not None:
            self._raw += data  # kept until it inflates to something (bounded below)
        self._encoded += len(data)
        out = bytearray()
        scrubbed_any = False
        while data and not self._done:
            decoder = self._decoder
            assert decoder is not None
            try:
                piece = decoder.decompress(data, PIECE)
            except zlib.error as exc:
                if self._raw is not None and not self._out_any:
                    return self._plain_after_all()
                if self._member_start:  # not another gzip member: trailing bytes, dropped
                    self._done = True
                    break
                raise CodingError(f"the {self._name()} body does not decode ({exc})") from None
            data = decoder.unconsumed_tail
            if piece:
                self._member_start = False
            if decoder.eof:
                # RFC 1952 2.2: a gzip body may be several members; after the last (or after a
                # zlib/deflate stream's end) whatever follows is not relayed. The next member
                # may begin in the next read: a new decoder waits for its first bytes.
                rest = decoder.unused_data
                if self._format == b"gzip" and _GZIP_MAGIC.startswith(rest[:3]):
                    self._decoder = zlib.decompressobj(_WBITS[b"gzip"])
                    self._member_start = True
                    data = rest
                else:
                    self._done = True
            if piece:
                self._decoded += len(piece)
                self._check_bounds()
                if self._raw is not None:
                    self._raw = None  # it inflates: compressed it is
                self._out_any = True
                scrubbed = self._inner.feed(piece)
                if scrubbed:
                    out += self._encoder.compress(scrubbed)
                    scrubbed_any = True
        if self._raw is not None and len(self._raw) > 4 * PIECE:
            raise CodingError(f"the {self._name()} body inflates to nothing")
        if scrubbed_any:
            out += self._encoder.flush(zlib.Z_SYNC_FLUSH)
        return bytes(out)

    def _unbrotli(self, data: bytes) -> bytes:
        """`_inflate` for brotli: the decoder takes the input whole and is then drained at most
        `PIECE` bytes per call (its `output_buffer_limit`), each piece scrubbed before the next,
        until a call gives nothing (all this input decoded) or the stream ends."""
        assert self._br is not None
        decoder, encoder = self._br
        self._encoded += len(data)
        if self._done:
            return b""  # after the end of the brotli stream: not relayed
        out = bytearray()
        scrubbed_any = False
        while True:
            try:
                piece = decoder.process(data, output_buffer_limit=PIECE)
            except brotli.error as exc:
                raise CodingError(f"the br body does not decode ({exc})") from None
            data = b""
            if piece:
                self._decoded += len(piece)
                self._check_bounds()
                self._out_any = True
                scrubbed = self._inner.feed(piece)
                if scrubbed:
                    out += encoder.process(scrubbed)
                    scrubbed_any = True
            if decoder.is_finished():
                self._done = True
                break
            if not piece:
                if decoder.can_accept_more_data():
                    break  # all it had is out: the next read goes on
                # Neither output nor room for input: a decoder that would spin.
                raise CodingError("the br body does not decode (the decoder is stuck)")
        if scrubbed_any:
            out += encoder.flush()
        return bytes(out)

    def _check_bounds(self) -> None:
        decoded = self._decoded
        if decoded > self._max_decoded:
            raise CodingError(
                f"the {self._name()} body inflates to more than {self._max_decoded} bytes"
            )
        if decoded > RATIO_FLOOR and decoded > self._max_ratio * max(1, self._encoded):
            raise CodingError(
                f"the {self._name()} body inflates more than {self._max_ratio} times "
                "(a decompression bomb?)"
            )

    def _name(self) -> str:
        name = (self._format or b"?").decode()
        return f"{name} (labelled identity)" if self._sniffed else name
