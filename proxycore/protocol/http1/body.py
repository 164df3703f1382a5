"""Body decoding: one `BodyReader` per message body, fed bytes as they arrive (sans-IO).

A `BodyReader` decodes one body: Content-Length (count down), chunked (a state machine over the
chunk line, the data, the CRLF after data and the trailer section) or until-close. It returns
decoded bytes as soon as they arrive, and refuses bad framing at a point that does not depend on
how the bytes were segmented (fuzz/fuzz_http1_chunking.py): a chunk line or trailer line is
refused at its first byte that no valid line can have, except that the grammar of a chunk
extension or a trailer field line is checked when its LF arrives (while it arrives, only its
bytes are: controls, a bare CR), so that a peer trickling a line cannot make it quadratic.

What RFC 9112 asks a recipient to accept, and this decoder reads and then drops:
- chunk extensions (7.1.1), by their strict grammar (`grammar.CHUNK_LINE_RE`), within the
  chunk-line limit; nothing of them is kept;
- trailer fields (7.1.2), by the field-line grammar, within the header count and size limits;
  "a recipient that removes the chunked coding from a message MAY selectively retain or discard
  the received trailer fields": they are kept in `trailers` (lowercase names, values without
  surrounding whitespace) for the caller to relay or drop (proxycore/protocol/trailers.py).
  Framing fields (Content-Length, Transfer-Encoding) in a trailer section are refused: RFC 9110
  6.5.1 forbids them there, and a peer sending them is probing for a reader that would act on
  them.
The proxy re-frames every body it relays, so extensions never reach the next hop, and trailers
only as the caller writes them again.
"""

from __future__ import annotations

import enum
import re

from proxycore.protocol.http1.diagnose import describe_bad_line
from proxycore.protocol.http1.grammar import (
    CHUNK_LINE_RE,
    CONTENT_LENGTH,
    DEFAULT_LIMITS,
    FIELD_LINE_RE,
    LINE_BAD_BYTE_RE,
    TRANSFER_ENCODING,
    BodyKind,
    Limits,
    refuse,
)
from proxycore.protocol.http1.heads import RequestHead, ResponseHead

__all__ = ["BodyReader"]

# The common chunk line, "1*16HEXDIG CRLF" (no extension), and every prefix of it.
_CHUNK_SIZE_RE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CHUNK_SIZE_PREFIX_RE = re.compile(rb"(?:[0-9A-Fa-f]{1,16}\r?)?")
# Fields that decide framing: never in a trailer section (RFC 9110 6.5.1).
_TRAILER_FORBIDDEN = frozenset({CONTENT_LENGTH, TRANSFER_ENCODING})


class _Chunk(enum.Enum):
    """States of the chunked decoder (RFC 9112 section 7.1)."""

    SIZE = 0  # reading a chunk line (size, extensions, CRLF)
    DATA = 1  # inside chunk data
    DATA_CRLF = 2  # expecting the CRLF after chunk data
    TRAILER = 3  # after the last chunk: trailer field lines up to an empty line (7.1.2)
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
        "_trailer_bytes",
        "_trailer_count",
        "bytes_read",
        "trailers",
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
        self._trailer_bytes = 0
        self._trailer_count = 0
        self.bytes_read = 0
        # The trailer section's fields, once read (RFC 9112 7.1.2).
        self.trailers: list[tuple[bytes, bytes]] = []

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
            elif state is _Chunk.DATA_CRLF:
                # Exactly CRLF, byte by byte. CVE-2025-43859 was h11 accepting any two bytes
                # after chunk data; a bare LF is refused too.
                if data[pos] != b"\r\n"[self._crlf_seen]:
                    raise refuse("chunk data not followed by CRLF", self._status)
                pos += 1
                self._crlf_seen += 1
                if self._crlf_seen == 2:
                    self._chunk_state = _Chunk.SIZE
            else:
                # A line (chunk line or trailer line): accumulate it up to its LF.
                lf = data.find(b"\n", pos)
                stop = n if lf < 0 else lf + 1
                before = len(self._line)
                self._line += data[pos:stop]
                pos = stop
                if state is _Chunk.SIZE:
                    self._chunk_line(before, lf >= 0)
                elif self._trailer_line(before, lf >= 0):
                    self._chunk_state = _Chunk.DONE
                    self._done = True
                    self._leftover += data[pos:]
                    break
        result = b"".join(out)
        self.bytes_read += len(result)
        return result

    def _chunk_line(self, before: int, complete: bool) -> None:
        """Check the chunk line accumulated so far (`before` bytes of it checked already); once
        `complete`, read its size and move on. Refuses as described in the module docstring."""
        line = self._line
        status = self._status
        if len(line) > self._limits.max_chunk_line:
            raise refuse("chunk line too long", status)
        if not complete:
            semi = line.find(b";", 0, 18)
            if semi < 0:
                # Still a prefix of "1*16HEXDIG CR"? Refuse now if it cannot become one.
                if _CHUNK_SIZE_PREFIX_RE.fullmatch(line) is None:
                    raise refuse(_describe_chunk_line(bytes(line)), status)
            elif (
                _CHUNK_SIZE_RE.fullmatch(line, 0, semi) is None
                or LINE_BAD_BYTE_RE.search(line, max(semi, before - 1)) is not None
            ):
                raise refuse(_describe_chunk_line(bytes(line)), status)
            return
        if not line.endswith(b"\r\n"):
            raise refuse(_describe_chunk_line(bytes(line)), status)
        digits = len(line) - 2
        if _CHUNK_SIZE_RE.fullmatch(line, 0, digits) is None:
            # RFC 9112 7.1.1: extensions are parsed, then ignored.
            match = CHUNK_LINE_RE.fullmatch(line, 0, digits)
            if match is None:
                raise refuse(_describe_chunk_line(bytes(line)), status)
            digits = match.end(1)
        size = int(line[:digits], 16)
        self._line = bytearray()
        if size == 0:
            self._chunk_state = _Chunk.TRAILER
        else:
            self._chunk_state = _Chunk.DATA
            self._chunk_remaining = size

    def _trailer_line(self, before: int, complete: bool) -> bool:
        """Check the trailer line accumulated so far; True once the empty line ends the section.

        RFC 9112 7.1.2: trailer-section = *( field-line CRLF ), read by the field-line grammar
        and held to the header limits (count and bytes), then kept in `trailers`.
        """
        line = self._line
        status = self._status
        limits = self._limits
        if self._trailer_bytes + len(line) > limits.max_header_bytes:
            raise refuse(f"trailer section larger than {limits.max_header_bytes} bytes", status)
        if not complete:
            if LINE_BAD_BYTE_RE.search(line, max(0, before - 1)) is not None:
                raise refuse(_describe_trailer_line(bytes(line)), status)
            return False
        self._trailer_bytes += len(line)
        self._line = bytearray()
        if line == b"\r\n":
            return True
        end = len(line) - 2
        if not line.endswith(b"\r\n") or FIELD_LINE_RE.fullmatch(line, 0, end) is None:
            raise refuse(_describe_trailer_line(bytes(line)), status)
        self._trailer_count += 1
        if self._trailer_count > limits.max_header_count:
            raise refuse(f"more than {limits.max_header_count} trailer fields", status)
        colon = line.index(b":")
        name = bytes(line[:colon]).lower()
        if name in _TRAILER_FORBIDDEN:
            raise refuse(f"{name.decode()} in a trailer section (RFC 9110 6.5.1)", status)
        self.trailers.append((name, bytes(line[colon + 1 : end]).strip(b" \t")))
        return False


def _describe_chunk_line(line: bytes) -> str:
    if line.endswith(b"\n") and not line.endswith(b"\r\n"):
        return "bare LF in chunk line"
    digits = len(line) - len(line.lstrip(b"0123456789abcdefABCDEF"))
    if digits > 16:
        return "chunk size too large"
    if digits and line[digits : digits + 1] == b";":
        return "invalid chunk extension (RFC 9112 7.1.1)"
    return f"invalid chunk line {line[:40]!r}"


def _describe_trailer_line(line: bytes) -> str:
    return f"invalid trailer field line: {describe_bad_line(line, field=True)}"
