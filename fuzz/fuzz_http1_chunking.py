"""Fuzz proxycore.protocol.http1 for segmentation independence and for its error contract.

Run:  python fuzz/fuzz_http1_chunking.py -runs=200000 /tmp/corpus_http1_chunking
(atheris is imported only under __main__; tests import `TestOneInput` and `SEEDS` without it.)

The bytes are driven through the head parser and the body reader the way the connection
adapter drives them (a growing head buffer, then the body reader, then the leftover as the next
pipelined message), three ways: as one chunk, byte by byte, and in random splits. Invariants:
- nothing but HttpProtocolError escapes (any other exception is a crash);
- the transcript is identical whatever the segmentation: the same heads, the same body bytes
  per message, the same leftover, the same final state, and a refusal at the same message with
  the same status_hint;
- bookkeeping holds: `bytes_read` equals the body bytes returned, a LENGTH body is exactly
  Content-Length bytes, the head's `consumed` never exceeds the buffer.

Input layout: byte 0 selects request/response (bit 0), the request method a response answers
(bits 1-2), whether the peer closes after the bytes (bit 3), and bits 4-6 optionally prepend a
valid head template so the fuzz bytes become a (chunked or fixed-length) body.
"""

from __future__ import annotations

import random
import sys
import zlib
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxycore.errors import HttpProtocolError
from proxycore.protocol.http1 import (
    BodyKind,
    BodyReader,
    Limits,
    RequestHead,
    ResponseHead,
    parse_request_head,
    parse_response_head,
)

_METHODS = (b"GET", b"HEAD", b"POST", b"CONNECT")
# Small limits so that the limit paths (414, 431, long chunk lines) are reachable by short inputs.
_LIMITS = Limits(
    max_request_line=64,
    max_header_count=6,
    max_header_bytes=256,
    max_chunk_line=12,
    max_empty_lines=2,
)
_MAX_MESSAGES = 8

_REQUEST_TEMPLATES = (
    b"",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 7\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"PUT /x HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\ntransfer-encoding: CHUNKED\r\n\r\n",
    b"GET / HTTP/1.1\r\n",
    b"GET / HTTP/1.0\r\nContent-Length: 3\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
)
_RESPONSE_TEMPLATES = (
    b"",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"HTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n",
)

Transcript = list[tuple[object, ...]]


class Divergence(AssertionError):
    """Two segmentations of the same bytes were read differently (the invariant broke)."""


def _pieces(message: bytes, sizes: list[int]) -> list[bytes]:
    out = []
    pos = 0
    for size in sizes:
        if pos >= len(message):
            break
        out.append(message[pos : pos + size])
        pos += size
    if pos < len(message):
        out.append(message[pos:])
    return out


class _Driver:
    """Drives head parser and body reader over a sequence of pieces, like the trio adapter."""

    def __init__(self, *, is_request: bool, method: bytes) -> None:
        self.is_request = is_request
        self.method = method
        self.transcript: Transcript = []
        self.buf = bytearray()
        self.reader: BodyReader | None = None
        self.head: RequestHead | ResponseHead | None = None
        self.body = bytearray()
        self.stopped = False  # the bytes after this point are not HTTP (or not read)
        self.messages = 0

    def _parse(self) -> None:
        while not self.stopped:
            reader = self.reader
            if reader is None:
                if not self._parse_head():
                    return
            elif reader.done:
                self._end_message(reader)
            else:
                return

    def _parse_head(self) -> bool:
        buf = self.buf
        before = len(buf)
        parsed: tuple[RequestHead | ResponseHead, int] | None
        if self.is_request:
            parsed = parse_request_head(buf, _LIMITS)
        else:
            parsed = parse_response_head(buf, _LIMITS, request_method=self.method)
        if parsed is None:
            return False
        head, used = parsed
        if not 0 < used <= before:
            raise AssertionError(f"consumed {used} of {before} bytes")
        del buf[:used]
        self.transcript.append(("head", head))
        self.head = head
        if isinstance(head, ResponseHead):
            if head.status < 200:
                if head.body_kind is not BodyKind.NONE:
                    raise AssertionError("1xx with a body")
                if head.status == 101:
                    self._stop("switched")
                return True  # interim response: the final one follows
            if self.method == b"CONNECT" and head.status < 300:
                self._stop("tunnel")
                return True
            self.reader = BodyReader.for_response(head, _LIMITS)
        else:
            self.reader = BodyReader.for_request(head, _LIMITS)
        rest = bytes(buf)
        buf.clear()
        self._feed_body(rest)
        return True

    def _feed_body(self, data: bytes) -> None:
        assert self.reader is not None
        out = self.reader.feed(data)
        if not isinstance(out, bytes):
            raise AssertionError("feed() returned a non-bytes value")
        self.body += out

    def _end_message(self, reader: BodyReader) -> None:
        head = self.head
        assert head is not None
        body = bytes(self.body)
        if reader.bytes_read != len(body):
            raise AssertionError(f"bytes_read {reader.bytes_read} != {len(body)}")
        if head.body_kind is BodyKind.LENGTH and len(body) != head.content_length:
            raise AssertionError("LENGTH body of the wrong size")
        self.transcript.append(("body", body))
        self.body.clear()
        self.reader = None
        self.buf = bytearray(reader.take_leftover())
        self.messages += 1
        if not head.keep_alive or self.messages >= _MAX_MESSAGES:
            self._stop("closed")

    def _stop(self, why: str) -> None:
        self.transcript.append(("stop", why, bytes(self.buf)))
        self.stopped = True

    def run(self, pieces: list[bytes], eof: bool) -> Transcript:
        try:
            for piece in pieces:
                if self.stopped:
                    self.buf += piece
                elif self.reader is None:
                    self.buf += piece
                    self._parse()
                else:
                    self._feed_body(piece)
                    self._parse()
            if self.stopped:
                self.transcript[-1] = (*self.transcript[-1][:2], bytes(self.buf))
                return self.transcript
            if eof and self.reader is not None:
                self.reader.feed_eof()
                self._parse()
            state = "head" if self.reader is None else "body"
            self.transcript.append(("end", state, bytes(self.buf), bytes(self.body)))
        except HttpProtocolError as exc:
            self.transcript.append(("refused", exc.status_hint))
        return self.transcript


def drive(
    message: bytes, sizes: list[int], *, is_request: bool, method: bytes, eof: bool
) -> Transcript:
    """The transcript of reading `message` split into pieces of `sizes` (rest in one piece)."""
    driver = _Driver(is_request=is_request, method=method)
    return driver.run(_pieces(message, sizes), eof)


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    selector = data[0]
    is_request = not selector & 1
    method = _METHODS[(selector >> 1) & 3]
    eof = bool(selector & 8)
    templates = _REQUEST_TEMPLATES if is_request else _RESPONSE_TEMPLATES
    message = templates[(selector >> 4) & 7] + data[1:]

    def run(sizes: list[int]) -> Transcript:
        return drive(message, sizes, is_request=is_request, method=method, eof=eof)

    whole = run([len(message)])
    bytewise = run([1] * len(message))
    if bytewise != whole:
        raise Divergence(f"byte by byte differs:\n{whole!r}\n{bytewise!r}\n{message!r}")
    rng = random.Random(zlib.crc32(data))
    for _ in range(3):
        sizes = [rng.choice((1, 2, 3, 5, 8, 13, 64)) for _ in range(len(message))]
        split = run(sizes)
        if split != whole:
            raise Divergence(f"split {sizes[:20]} differs:\n{whole!r}\n{split!r}\n{message!r}")


SEEDS: tuple[bytes, ...] = (
    b"\x00GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x00GET /a HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x10" + b"5\r\nhello\r\n0\r\n\r\n",
    b"\x10" + b"5\r\nhello\r\n0\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x10" + b"5;x\r\nhello\r\n0\r\n\r\n",
    b"\x10" + b"5\r\nhelloXX0\r\n\r\n",
    b"\x10" + b"0\r\nTrailer: x\r\n\r\n",
    b"\x20" + b"1234567GET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x28" + b"123",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
    b"\x00GET / HTTP/1.1\nHost: a\n\n",
    b"\x00GET /" + b"a" * 80 + b" HTTP/1.1\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\n" + b"X: y\r\n" * 8 + b"\r\n",
    b"\x00GET / HTTP/1.1\r\nX: " + b"y" * 300,
    b"\x01HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"\x09HTTP/1.0 200 OK\r\n\r\nuntil close",
    b"\x11" + b"a\r\n0123456789\r\n0\r\n\r\n",
    b"\x41" + b"3\r\nabc\r\n0\r\n\r\n",
    b"\x07HTTP/1.1 200 Connection established\r\n\r\ntunnel bytes",
    b"\x01HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\nframes",
    b"\x19" + b"ffffffffffffffff\r\n",
    b"\x19" + b"10000000000000000\r\n",
    # RFC 9112 2.2, 7.1.1, 7.1.2: leading empty lines, chunk extensions, trailer fields.
    b"\x00\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x00\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x00\r\r\n",
    b"\x10" + b'5;a="b"\r\nhello\r\n0;c\r\n\r\n',
    b"\x10" + b"5;a\x01\r\nhello\r\n0\r\n\r\n",
    b"\x10" + b"5;a\rb\r\nhello\r\n0\r\n\r\n",
    b"\x10" + b"0\r\nX: 1\r\nY: 2\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x10" + b"0\r\nX: 1\r\n" + b"Y: 2\r\n" * 8 + b"\r\n",
    b"\x10" + b"0\r\nX: " + b"v" * 300 + b"\r\n\r\n",
    b"\x10" + b"0\r\nContent-Length: 1\r\n\r\n",
    b"\x11" + b"0\r\nX: 1\rY\r\n\r\n",
)


def main() -> None:
    import atheris
    from seeded import instrument

    instrument()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
