"""Body decoding: one `BodyReader` per message body, fed bytes as they arrive (sans-IO).

A `BodyReader` decodes one body: Content-Length (count down), chunked (a state machine over the
chunk-size line, the data, the CRLF after data and the end of the message) or until-close; it
returns decoded bytes as soon as they arrive and refuses bad framing at the first byte that
cannot be extended into valid framing, so that a refusal never depends on how the bytes were
segmented (fuzz/fuzz_http1_chunking.py).
"""

from __future__ import annotations

import enum
import re

from proxycore.protocol.http1.grammar import DEFAULT_LIMITS, BodyKind, Limits, refuse
from proxycore.protocol.http1.heads import RequestHead, ResponseHead

__all__ = ["BodyReader"]

# chunk-size = 1*HEXDIG (RFC 9112 section 7.1). We allow at most 16 digits (2**64 - 1) and no
# chunk-ext at all (RFC 9112 7.1.1): extensions are where parsers have disagreed
# (quoted strings, bare LF inside them), and no client we serve sends them.
_CHUNK_SIZE_RE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CHUNK_SIZE_PREFIX_RE = re.compile(rb"(?:[0-9A-Fa-f]{1,16}\r?)?")


class _Chunk(enum.Enum):
    """States of the chunked decoder (RFC 9112 section 7.1)."""

    SIZE = 0  # reading a chunk-size line
    DATA = 1  # inside chunk data
    DATA_CRLF = 2  # expecting the CRLF after chunk data
    LAST_CRLF = 3  # after "0\r\n": expecting the CRLF that ends an empty trailer section
    DONE = 4


class BodyReader:
    """Sans-IO decoder for one message body.

    Feed it bytes as they arrive; `feed` returns the decoded body bytes now available. Once
    `done`, bytes that were fed beyond the end of the message are in `take_leftover()`.
    """

    __slots__ = (
        "_chunk_remaining",
        "_chunk_state",
        "_crlf_seen",
        "_done",
        "_kind",
        "_leftover",
        "_limits",
        "_line",
        "_remaining",
        "_status",
        "bytes_read",
    )

    def __init__(self, kind: BodyKind, content_length: int, limits: Limits, status: int) -> None:
        self._kind = kind
        self._limits = limits
        self._status = status
        self._remaining = content_length
        self._done = kind is BodyKind.NONE or (kind is BodyKind.LENGTH and content_length == 0)
        self._leftover = bytearray()
        self._chunk_state = _Chunk.SIZE
        self._chunk_remaining = 0
        self._line = bytearray()
        self._crlf_seen = 0
        self.bytes_read = 0

    @classmethod
    def for_request(cls, head: RequestHead, limits: Limits = DEFAULT_LIMITS) -> BodyReader:
        """A decoder for the body of `head` (refusals carry status_hint 400)."""
        return cls(head.body_kind, head.content_length, limits, 400)

    @classmethod
    def for_response(cls, head: ResponseHead, limits: Limits = DEFAULT_LIMITS) -> BodyReader:
        """A decoder for the body of `head` (refusals carry status_hint 502)."""
        return cls(head.body_kind, head.content_length, limits, 502)

    @property
    def done(self) -> bool:
        """True once the end of the message body has been read."""
        return self._done

    def take_leftover(self) -> bytes:
        """Bytes fed beyond the end of this message (the start of the next one)."""
        if not self._done:
            raise RuntimeError("take_leftover() before the body is done")
        out = bytes(self._leftover)
        self._leftover.clear()
        return out

    def feed_eof(self) -> None:
        """The peer closed its side: the end of an UNTIL_CLOSE body, a truncation otherwise."""
        if self._done:
            return
        if self._kind is BodyKind.UNTIL_CLOSE:
            self._done = True
            return
        raise refuse(
            "truncated body: connection closed before the end of the message", self._status
        )

    def feed(self, data: bytes) -> bytes:
        """Consume `data`; return the decoded body bytes it completes (possibly b"")."""
        if self._done:
            self._leftover += data
            return b""
        kind = self._kind
        if kind is BodyKind.LENGTH:
            remaining = self._remaining
            if len(data) < remaining:
                self._remaining = remaining - len(data)
                self.bytes_read += len(data)
                return data
            self._remaining = 0
            self._done = True
            self._leftover += data[remaining:]
            self.bytes_read += remaining
            return data[:remaining]
        if kind is BodyKind.UNTIL_CLOSE:
            self.bytes_read += len(data)
            return data
        return self._feed_chunked(data)

    def _feed_chunked(self, data: bytes) -> bytes:
        out: list[bytes] = []
        pos = 0
        n = len(data)
        status = self._status
        while pos < n:
            state = self._chunk_state
            if state is _Chunk.DATA:
                take = min(self._chunk_remaining, n - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._chunk_remaining -= take
                if self._chunk_remaining == 0:
                    self._chunk_state = _Chunk.DATA_CRLF
                    self._crlf_seen = 0
            elif state is _Chunk.SIZE:
                # Accumulate the chunk-size line up to its LF, refusing as soon as it cannot
                # be "1*16HEXDIG CRLF" any more (so a refusal never waits for more input).
                lf = data.find(b"\n", pos)
                stop = n if lf < 0 else lf + 1
                self._line += data[pos:stop]
                pos = stop
                line = self._line
                if len(line) > self._limits.max_chunk_line:
                    raise refuse("chunk-size line too long", status)
                if lf < 0:
                    # Still a prefix of "1*16HEXDIG CR"? Refuse now if it cannot become one.
                    if _CHUNK_SIZE_PREFIX_RE.fullmatch(line) is None:
                        raise refuse(_describe_chunk_line(bytes(line)), status)
                    continue
                if (
                    not line.endswith(b"\r\n")
                    or _CHUNK_SIZE_RE.fullmatch(line, 0, len(line) - 2) is None
                ):
                    raise refuse(_describe_chunk_line(bytes(line)), status)
                size = int(line[:-2], 16)
                self._line = bytearray()
                if size == 0:
                    self._chunk_state = _Chunk.LAST_CRLF
                    self._crlf_seen = 0
                else:
                    self._chunk_state = _Chunk.DATA
                    self._chunk_remaining = size
            else:
                # DATA_CRLF / LAST_CRLF: exactly CRLF, byte by byte. CVE-2025-43859 was h11
                # accepting any two bytes after chunk data; a non-empty trailer section
                # (RFC 9112 7.1.2) is refused rather than parsed, as is a bare LF.
                expected = b"\r\n"[self._crlf_seen]
                if data[pos] != expected:
                    if state is _Chunk.LAST_CRLF and self._crlf_seen == 0:
                        raise refuse("trailer fields are not accepted", status)
                    raise refuse("chunk data not followed by CRLF", status)
                pos += 1
                self._crlf_seen += 1
                if self._crlf_seen == 2:
                    if state is _Chunk.LAST_CRLF:
                        self._chunk_state = _Chunk.DONE
                        self._done = True
                        self._leftover += data[pos:]
                        break
                    self._chunk_state = _Chunk.SIZE
        result = b"".join(out)
        self.bytes_read += len(result)
        return result


def _describe_chunk_line(line: bytes) -> str:
    if b";" in line:
        return "chunk extensions are not accepted (RFC 9112 7.1.1)"
    if line.endswith(b"\n") and not line.endswith(b"\r\n"):
        return "bare LF in chunk-size line"
    digits = len(line) - len(line.lstrip(b"0123456789abcdefABCDEF"))
    if digits > 16:
        return "chunk size too large"
    return f"invalid chunk-size line {line[:40]!r}"
