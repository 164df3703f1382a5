"""Differential fuzzing of proxycore.protocol.http1 against h11 (the oracle).

Run:  python fuzz/fuzz_http1_differential.py -runs=200000 /tmp/corpus_http1_diff
(atheris is imported only under __main__; tests import `TestOneInput` and `SEEDS` without it.)

Invariant: for every input, the fast parser either refuses (HttpProtocolError), or needs more
bytes, or reads exactly what h11 reads: the same method / target / version (status / reason for
responses), the same headers (lowercased names, stripped values, in order), the same framing
(Content-Length n, chunked, read-until-close), the same keep-alive and 100-continue decision, the
same body bytes, the same end of message and the same leftover (the next pipelined message).
It may refuse what h11 accepts; it may never accept what h11 rejects, nor end a message where
h11 does not (or the reverse): two readings of one byte stream is how smuggling happens.
One normalization, defined by the RFC rather than by either parser: the empty lines before a
request line that RFC 9112 2.2 asks a server to ignore (we skip a bounded number; h11 refuses
them) are removed before h11 reads a request (`leading_empty_lines`). Chunk extensions and
trailer fields are read by both and dropped by us; body, end of message and leftover must agree.

Input layout: the first byte selects the mode.
- bit 0: request (server side) or response (client side, request method from bits 1-2);
- bit 3: raw (the rest is the message bytes) or structured: the rest drives a generator that
  assembles a message from a valid template with targeted mutations (duplicate and conflicting
  framing headers, TE+CL, obs-fold, bare LF/CR, odd whitespace, chunk-size and chunk-extension
  variants, trailers, leading empty lines, pipelining) so that disagreements are found in
  seconds, not hours.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import h11
from h11._connection import _keep_alive

from proxycore.errors import HttpProtocolError
from proxycore.protocol.http1 import (
    DEFAULT_LIMITS,
    BodyKind,
    BodyReader,
    RequestHead,
    ResponseHead,
    parse_request_head,
    parse_response_head,
    serialize_request_head,
    serialize_response_head,
)

_METHODS_FOR_RESPONSE = (b"GET", b"HEAD", b"POST", b"CONNECT")
# Requests sent as h11 CLIENT propose an upgrade so that a 101 is a legal answer for h11 too.
_UPGRADE_PROPOSAL = [(b"host", b"example.com"), (b"connection", b"upgrade"), (b"upgrade", b"x")]
_BIG = 10**9


class Mismatch(AssertionError):
    """The fast parser read something h11 did not (the invariant broke)."""


# ---------------------------------------------------------------------------------------------
# Structured input generation (deterministic, no atheris needed)
# ---------------------------------------------------------------------------------------------


class _Choices:
    """Draw choices from fuzz bytes; past the end every draw is 0 (the plain template)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        b = self.data[self.pos]
        self.pos += 1
        return b

    def pick(self, options: tuple[bytes, ...]) -> bytes:
        """options[0] (the valid template) most of the time, any option otherwise."""
        b = self.byte()
        return options[0] if b < 176 else options[b % len(options)]

    def chance(self, one_in: int) -> bool:
        return self.byte() % one_in == 1

    def blob(self) -> bytes:
        n = self.byte() % 8
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


_METHOD_OPTIONS = (b"GET", b"POST", b"PUT", b"HEAD", b"CONNECT", b"OPTIONS", b"get", b"G@T", b"")
_TARGET_OPTIONS = (
    b"/",
    b"/v1/messages?beta=true",
    b"http://example.com/x",
    b"example.com:443",
    b"*",
    b"/a\x7fb",
    b"/a b",
    b"/\xc3\xa9",
    b"",
)
_VERSION_OPTIONS = (b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.2", b"HTTP/2.0", b"http/1.1", b"HTTP/1.1 ")
_SP_OPTIONS = (b" ", b" ", b" ", b"  ", b"\t", b"")
_EOL_OPTIONS = (b"\r\n",) * 6 + (b"\n", b"\r", b"\r\r\n", b"\n\r")
_CL_VALUES = (
    b"5",
    b"0",
    b"05",
    b"+5",
    b" 5",
    b"5 ",
    b"5,5",
    b"5, 5",
    b"5,6",
    b"-1",
    b"0x5",
    b"5 5",
    b"",
    b"18446744073709551616",
    b"9223372036854775807",
    b"9223372036854775808",
    b"00000000000000000005",
    b"\xd9\xa5",
)
_TE_VALUES = (
    b"chunked",
    b"Chunked",
    b"CHUNKED",
    b"chunked ",
    b"\tchunked",
    b"chunked, chunked",
    b"gzip, chunked",
    b"identity",
    b"xchunked",
    b"chunked;q=1",
    b"chunked\x0b",
    b"",
)
_NAME_FORMS = (
    b"%s",
    b"%s",
    b"%s",
    b"%s ",
    b" %s",
    b"%s\t",
    b"X-%s",
    b"%s\x00",
)
_OTHER_FIELDS = (
    (b"Host", b"example.com"),
    (b"Host", b""),
    (b"Connection", b"close"),
    (b"Connection", b"keep-alive"),
    (b"Connection", b"Keep-Alive, CLOSE"),
    (b"Connection", b"closed"),
    (b"Expect", b"100-continue"),
    (b"Expect", b"100-Continue, foo"),
    (b"User-Agent", b"claude-cli/2.1 (external)"),
    (b"X-Obs", b"caf\xc3\xa9"),
    (b"X-Ctl", b"a\x01b"),
    (b"X-Del", b"a\x7fb"),
    (b"X-Nul", b"a\x00b"),
    (b"X-Vt", b"a\x0bb"),
    (b"X-Ws", b"  spaced  out \t"),
    (b"X-Empty", b""),
    (b"Upgrade", b"websocket"),
    (b"Transfer_Encoding", b"chunked"),
    (b"Content_Length", b"5"),
    (b"X_Y", b"1"),
)
_CHUNK_SIZE_FORMS = (
    b"%x",
    b"%x",
    b"%X",
    b"0%x",
    b"0x%x",
    b"%x;ext=1",
    b'%x;a="b;c" ; d',
    b"%x; a = b",
    b'%x;a="x\\"y"',
    b"%x ;a",
    b"%x;a\rb",
    b'%x;a="b',
    b"%x;",
    b"%x;a=\x01",
    b"%x ",
    b" %x",
    b"%x\t",
    b"00000000000000000%x",
)
_CHUNK_ENDS = (b"\r\n",) * 5 + (b"\n", b"\r", b"XX", b"", b"\r\r")
_LAST_CHUNKS = (
    b"0\r\n\r\n",
    b"0\r\n\r\n",
    b"0\r\n\r\n",
    b"0\r\n\n",
    b"0\r\nX-Trailer: 1\r\n\r\n",
    b"000\r\n\r\n",
    b"0;x\r\n\r\n",
    b"0;a=b;c\r\n\r\n",
    b"0\r\nX-T: 1\r\nY: 2 \r\n\r\n",
    b"0\r\nContent-Length: 5\r\n\r\n",
    b"0\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"0\r\nX: a\x01\r\n\r\n",
    b"0\r\nX : 1\r\n\r\n",
    b"0\r\nX: 1\r\n 2\r\n\r\n",
    b"0\r\nX:1\n\r\n",
    b"0\r\nX:1\r\n\n",
    b"0\r\n",
    b"0\r\n\r",
)


def _gen_fields(c: _Choices, request: bool) -> tuple[list[bytes], int, str]:
    """Header lines (without EOL), declared body length and framing for the template."""
    lines: list[bytes] = []
    framing = "none"
    length = c.byte() % 12
    if request and not c.chance(8):
        lines.append(b"Host: example.com")
    mode = c.byte() % 6
    if mode in (1, 2):
        framing = "length"
        lines.append(b"Content-Length: %d" % length)
    elif mode in (3, 4):
        framing = "chunked"
        lines.append(b"Transfer-Encoding: chunked")
    for _ in range(c.byte() % 5):
        kind = c.byte() % 6
        name_form = c.pick(_NAME_FORMS)
        if kind == 0:
            name, value = b"Content-Length", c.pick(_CL_VALUES)
        elif kind == 1:
            name, value = b"Transfer-Encoding", c.pick(_TE_VALUES)
        elif kind == 2:
            name, value = b"Content-Length", b"%d" % length
        else:
            name, value = _OTHER_FIELDS[c.byte() % len(_OTHER_FIELDS)]
        if c.chance(4):
            name = name.lower() if c.chance(2) else name.upper()
        ows = c.pick((b" ", b"", b"  ", b"\t", b" \t"))
        trail = c.pick((b"", b"", b" ", b"\t"))
        lines.insert(c.byte() % (len(lines) + 1), (name_form % name) + b":" + ows + value + trail)
    if lines and c.chance(10):
        # obs-fold: a continuation line
        lines.insert(c.byte() % (len(lines) + 1), c.pick((b" folded", b"\tfolded")))
    return lines, length, framing


def _gen_body(c: _Choices, length: int, framing: str) -> bytes:
    if framing == "length":
        return b"abcdefghijklmnop"[: length + (c.byte() % 3) - 1 if c.chance(6) else length]
    if framing != "chunked":
        return b""
    out = bytearray()
    for i in range(c.byte() % 4):
        size = (c.byte() % 7) + 1
        out += c.pick(_CHUNK_SIZE_FORMS) % size + c.pick(_EOL_OPTIONS)
        data = bytes(range(0x61 + i, 0x61 + i + size))
        if c.chance(10):
            data = data[:-1] if c.chance(2) else data + b"Z"
        out += data + c.pick(_CHUNK_ENDS)
    out += c.pick(_LAST_CHUNKS)
    return bytes(out)


def _gen_request(c: _Choices) -> bytes:
    sp1, sp2 = c.pick(_SP_OPTIONS), c.pick(_SP_OPTIONS)
    line = c.pick(_METHOD_OPTIONS) + sp1 + c.pick(_TARGET_OPTIONS) + sp2 + c.pick(_VERSION_OPTIONS)
    lines, length, framing = _gen_fields(c, request=True)
    out = bytearray(
        c.pick((b"", b"", b"", b"", b"\r\n", b"\n", b" ", b"\r\n\r\n", b"\r\n" * 5, b"\r\r\n"))
    )
    out += line + c.pick(_EOL_OPTIONS)
    for field in lines:
        out += field + c.pick(_EOL_OPTIONS)
    out += c.pick(_EOL_OPTIONS)
    out += _gen_body(c, length, framing)
    return bytes(out)


_STATUS_OPTIONS = (b"200", b"200", b"204", b"304", b"100", b"101", b"404", b"099", b"600", b"20")
_REASON_OPTIONS = (b" OK", b" OK", b"", b" ", b" Not Found", b" caf\xc3\xa9", b" a\x01b", b"\tOK")


def _gen_response(c: _Choices) -> bytes:
    out = bytearray()
    for _ in range(1 if c.chance(5) else 0):
        out += b"HTTP/1.1 100 Continue\r\n\r\n"
    version = c.pick((b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.2", b"HTTP/2"))
    line = version + c.pick(_SP_OPTIONS) + c.pick(_STATUS_OPTIONS) + c.pick(_REASON_OPTIONS)
    lines, length, framing = _gen_fields(c, request=False)
    out += line + c.pick(_EOL_OPTIONS)
    for field in lines:
        out += field + c.pick(_EOL_OPTIONS)
    out += c.pick(_EOL_OPTIONS)
    out += _gen_body(c, length, framing)
    if framing == "none" and not c.chance(3):
        out += b"until-close body"
    return bytes(out)


def build_input(data: bytes) -> tuple[bool, bytes, bytes]:
    """Decode a fuzz input into (is_request, request_method, message bytes)."""
    if not data:
        return True, b"GET", b""
    selector = data[0]
    is_request = not selector & 1
    method = _METHODS_FOR_RESPONSE[(selector >> 1) & 3]
    rest = data[1:]
    if not selector & 8:
        return is_request, method, rest
    c = _Choices(rest)
    if is_request:
        message = _gen_request(c)
        if c.chance(4):  # pipelining: a second request right behind the first
            message += _gen_request(c)
    else:
        message = _gen_response(c)
    if c.chance(6):  # a raw mutation: overwrite or insert a few fuzz bytes somewhere
        where = (c.byte() * 7 + c.byte()) % (len(message) + 1)
        blob = c.blob()
        message = message[:where] + blob + message[where + (len(blob) if c.chance(2) else 0) :]
    return is_request, method, message


# ---------------------------------------------------------------------------------------------
# The oracle: what h11 reads
# ---------------------------------------------------------------------------------------------


def _h11_framing(reader: Any) -> tuple[str, int]:
    name = type(reader).__name__
    if name == "ContentLengthReader":
        return "length", int(reader._length)
    if name == "ChunkedReader":
        return "chunked", 0
    if name == "Http10Reader":
        return "until_close", 0
    return name, 0


def _ours_framing(kind: BodyKind, length: int) -> tuple[str, int]:
    if kind is BodyKind.NONE:
        return "length", 0  # h11 reads "no body" as Content-Length 0
    if kind is BodyKind.LENGTH:
        return "length", length
    if kind is BodyKind.CHUNKED:
        return "chunked", 0
    return "until_close", 0


class _Oracle:
    """Steps an h11 connection one event at a time and records what it read."""

    def __init__(self, conn: h11.Connection) -> None:
        self.conn = conn
        self.error: str | None = None

    def next(self) -> Any:
        """The next event, or NEED_DATA / PAUSED, or None after an h11 RemoteProtocolError."""
        if self.error is not None:
            return None
        try:
            return self.conn.next_event()
        except h11.RemoteProtocolError as exc:
            self.error = str(exc)
            return None

    def read_body(self) -> tuple[bytes, str]:
        """Data events until the end: (body, "eom" | "need" | "error" | other state)."""
        body = bytearray()
        while True:
            event = self.next()
            if event is None:
                return bytes(body), "error"
            if isinstance(event, h11.Data):
                body += event.data
                continue
            if isinstance(event, h11.EndOfMessage):
                return bytes(body), "eom"
            if event is h11.NEED_DATA:
                return bytes(body), "need"
            return bytes(body), type(event).__name__


def _check(condition: bool, message: str, *context: object) -> None:
    if not condition:
        raise Mismatch(message + ": " + " | ".join(repr(x) for x in context))


def check_reserialized_request(head: RequestHead) -> None:
    """What we send on is what we read: h11 reads our re-serialized head back unchanged."""
    if head.get(b"host") is None:
        return  # an HTTP/1.0 head re-sent as HTTP/1.1 needs a Host the caller adds
    wire = serialize_request_head(head.method, head.target, head.headers)
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_BIG)
    conn.receive_data(wire)
    event = _Oracle(conn).next()
    _check(isinstance(event, h11.Request), "h11 refused our serialization", wire)
    assert isinstance(event, h11.Request)
    _check(
        (event.method, event.target, event.http_version, list(event.headers))
        == (head.method, head.target, b"1.1", list(head.headers)),
        "serialized request read back differently",
        head,
        event,
    )


def check_reserialized_response(head: ResponseHead) -> None:
    wire = serialize_response_head(head.status, head.reason, head.headers)
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_BIG)
    conn.send(h11.Request(method=b"GET", target=b"/", headers=_UPGRADE_PROPOSAL))
    conn.send(h11.EndOfMessage())
    conn.receive_data(wire)
    event = _Oracle(conn).next()
    _check(
        isinstance(event, (h11.InformationalResponse, h11.Response)),
        "h11 refused our serialization",
        wire,
    )
    assert isinstance(event, (h11.InformationalResponse, h11.Response))
    _check(
        (event.status_code, event.reason, list(event.headers))
        == (head.status, head.reason, list(head.headers)),
        "serialized response read back differently",
        head,
        event,
    )


# ---------------------------------------------------------------------------------------------
# Requests (h11 as SERVER)
# ---------------------------------------------------------------------------------------------


def leading_empty_lines(buf: bytes) -> int:
    """How many bytes of empty lines (CRLF) lead `buf`, counting at most as many as we skip.

    RFC 9112 2.2 asks a server to ignore at least one empty line before a request line; h11
    refuses it ("no request line received"). The oracle is therefore h11 reading the bytes after
    the empty lines that we skip: the only place where we accept what h11 refuses, and where the
    reading is defined by the RFC, not by either parser.
    """
    skip = 0
    while skip < 2 * DEFAULT_LIMITS.max_empty_lines and buf[skip : skip + 2] == b"\r\n":
        skip += 2
    return skip


def check_requests(message: bytes) -> None:
    buf = message
    for _ in range(4):  # up to 4 pipelined requests
        # One h11 connection per request (the cycle h11 would start after our response), fed
        # the bytes after the empty lines RFC 9112 2.2 tells us to skip.
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_BIG)
        conn.receive_data(buf[leading_empty_lines(buf) :])
        oracle = _Oracle(conn)
        try:
            parsed = parse_request_head(buf)
        except HttpProtocolError:
            return  # refusing is always allowed
        event = oracle.next()
        if parsed is None:
            return  # we need more bytes: nothing read, nothing to compare
        head, used = parsed
        _check(
            isinstance(event, h11.Request),
            "we read a request head, h11 did not",
            event,
            oracle.error,
            buf,
        )
        assert isinstance(event, h11.Request)
        _check(
            (head.method, head.target, head.http_version)
            == (event.method, event.target, event.http_version),
            "request line differs",
            head,
            event,
        )
        _check(list(head.headers) == list(event.headers), "headers differ", head, event)
        _check(
            head.expect_continue == conn.they_are_waiting_for_100_continue,
            "100-continue differs",
            head,
        )
        h11_keep_alive = _keep_alive(event)
        _check(head.keep_alive == h11_keep_alive, "keep-alive differs", head, event)
        check_reserialized_request(head)
        _check(
            _ours_framing(head.body_kind, head.content_length) == _h11_framing(conn._reader),
            "framing differs",
            head,
            conn._reader,
        )
        reader = BodyReader.for_request(head)
        try:
            body = reader.feed(buf[used:])
        except HttpProtocolError:
            return
        h11_body, h11_end = oracle.read_body()
        if not reader.done:
            _check(h11_end != "eom", "h11 ended the body, we did not", head, body, h11_body, buf)
            if h11_end == "need":
                _check(body == h11_body, "partial body differs", body, h11_body)
            return
        _check(
            h11_end == "eom",
            "we ended the body, h11 did not",
            head,
            body,
            h11_end,
            oracle.error,
            buf,
        )
        _check(body == h11_body, "body differs", body, h11_body)
        leftover = reader.take_leftover()
        _check(leftover == conn.trailing_data[0], "leftover differs", leftover, conn.trailing_data)
        # Next cycle. Stop where h11 would switch protocols or close (CONNECT, Upgrade, no
        # keep-alive).
        if conn.their_state is not h11.DONE or not head.keep_alive:
            return
        buf = leftover
        if not buf:
            return


# ---------------------------------------------------------------------------------------------
# Responses (h11 as CLIENT)
# ---------------------------------------------------------------------------------------------


def check_response(method: bytes, message: bytes) -> None:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_BIG)
    target = b"example.com:443" if method == b"CONNECT" else b"/"
    conn.send(h11.Request(method=method, target=target, headers=_UPGRADE_PROPOSAL))
    conn.send(h11.EndOfMessage())
    conn.receive_data(message)
    conn.receive_data(b"")  # the server closed after these bytes (ends an until-close body)
    oracle = _Oracle(conn)
    buf = message
    while True:
        try:
            parsed = parse_response_head(buf, request_method=method)
        except HttpProtocolError:
            return
        event = oracle.next()
        if parsed is None:
            return
        head, used = parsed
        expected_type = h11.InformationalResponse if head.status < 200 else h11.Response
        _check(
            isinstance(event, expected_type),
            "we read a response head, h11 did not",
            head,
            event,
            oracle.error,
            buf,
        )
        assert isinstance(event, (h11.InformationalResponse, h11.Response))
        _check(
            (head.status, head.reason, head.http_version)
            == (event.status_code, event.reason, event.http_version),
            "status line differs",
            head,
            event,
        )
        _check(list(head.headers) == list(event.headers), "headers differ", head, event)
        check_reserialized_response(head)
        buf = buf[used:]
        if head.status < 200:
            _check(head.body_kind is BodyKind.NONE, "1xx with a body", head)
            if head.status == 101:
                return  # protocol switched: the bytes after it are not HTTP
            continue
        break
    if head.body_kind is BodyKind.NONE and method == b"CONNECT" and head.status < 300:
        _check(conn.their_state is h11.SWITCHED_PROTOCOL, "CONNECT tunnel differs", head)
        return
    _check(
        _ours_framing(head.body_kind, head.content_length) == _h11_framing(conn._reader),
        "framing differs",
        head,
        conn._reader,
    )
    expected_keep_alive = _keep_alive(event) and head.body_kind is not BodyKind.UNTIL_CLOSE
    _check(head.keep_alive == expected_keep_alive, "keep-alive differs", head, event)
    reader = BodyReader.for_response(head)
    try:
        body = reader.feed(buf)
        reader.feed_eof()
    except HttpProtocolError:
        return
    h11_body, h11_end = oracle.read_body()
    _check(h11_end == "eom", "we ended the body, h11 did not", head, body, h11_end, oracle.error)
    _check(body == h11_body, "body differs", body, h11_body)
    if head.body_kind is not BodyKind.UNTIL_CLOSE:
        leftover = reader.take_leftover()
        _check(leftover == conn.trailing_data[0], "leftover differs", leftover, conn.trailing_data)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def TestOneInput(data: bytes) -> None:
    is_request, method, message = build_input(data)
    if is_request:
        check_requests(message)
    else:
        check_response(method, message)


SEEDS: tuple[bytes, ...] = (
    b"\x00GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
    b"\x00POST /v1/messages HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"\x00GET /a HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x00GET / HTTP/1.0\r\n\r\n",
    b"\x00CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    b"\x00PUT / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx",
    b"\x00GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n",
    b"\x01HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"\x03HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n",
    b"\x05HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    b"\x01HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
    b"\x01HTTP/1.0 200 OK\r\n\r\nuntil close",
    b"\x07HTTP/1.1 200 Connection established\r\n\r\n",
    b"\x01HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n",
    b"\x00\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'5;a="b;c" ; d\r\nhello\r\n0;e=f\r\nX-T: 1\r\nY: \r\n\r\n',
    b"\x05HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;x\r\nok\r\n0\r\nT: 1\r\n\r\n",
    *(
        bytes([selector]) + bytes(range(i, i + 24))
        for selector in (8, 9, 11, 13, 15)
        for i in range(0, 200, 40)
    ),
)


def main() -> None:
    import atheris
    from seeded import instrument

    instrument()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
