"""Replay the HTTP/1.1 fuzzers' seeds and every input they have found, without atheris.

Both harnesses (fuzz/fuzz_http1_differential.py: fast parser vs h11; fuzz/fuzz_http1_chunking.py:
segmentation independence and "only HttpProtocolError escapes") are loaded by path and their
`TestOneInput` run over their seeds, the pinned findings and hand-written edge cases, under
several selector bytes so every mode of each harness sees every input. Pin new findings in the
PINNED tuples below, as raw-mode inputs, with a comment saying what broke.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from proxycore.errors import HttpProtocolError
from proxycore.protocol.http1 import BodyReader, parse_request_head, parse_response_head

_FUZZ = Path(__file__).resolve().parent.parent / "fuzz"


def _load(name: str) -> ModuleType:
    # fuzz/ is not a package; load each harness by path so it runs exactly as the fuzzer runs it.
    spec = importlib.util.spec_from_file_location(name, _FUZZ / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


_atheris_was_loaded = "atheris" in sys.modules
differential = _load("fuzz_http1_differential")
chunking = _load("fuzz_http1_chunking")


def test_harnesses_import_without_atheris() -> None:
    assert _atheris_was_loaded or "atheris" not in sys.modules


# ---------------------------------------------------------------------------------------------
# Findings (first byte = selector; 0x00 = raw request, 0x01/0x03/0x05/0x07 = raw response to
# GET/HEAD/POST/CONNECT)
# ---------------------------------------------------------------------------------------------

DIFFERENTIAL_PINNED: tuple[bytes, ...] = (
    # Found by the structured differential run: h11 reads a Transfer-Encoding value lowercased
    # ("Chunked" -> "chunked"), we passed it on raw, so the header lists differed. Fixed by
    # lowercasing the (only accepted) value, as h11 does.
    b"\x05HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked \r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: CHUNKED\r\n\r\n0\r\n\r\n",
)

CHUNKING_PINNED: tuple[bytes, ...] = ()

# Hand-written: the places where h11 and a strict parser part ways. For each, we must refuse or
# read exactly what h11 reads.
DIFFERENTIAL_EDGES: tuple[bytes, ...] = (
    b"\x00GET / HTTP/1.1\nHost: a\n\n",  # h11 accepts bare LF; we refuse
    b"\x00GET / HTTP/1.1\r\nHost: a\r\n\n",  # h11 ends the head at "\n\r?\n"
    b"\x00GET / HTTP/1.1\r\nHost: a\n\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nX: 1\r\n 2\r\n\r\n",  # obs-fold: h11 joins, we refuse
    b"\x00\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",  # RFC 9112 2.2: we skip it, h11 refuses
    b"\x00\r\n\r\n\r\n\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",  # over our bound
    b"\x00\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",  # h11 skips a bare LF too; we refuse
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 3\r\n\r\nabc",  # h11 dedups
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
    b"0\r\n\r\n",  # h11: TE wins; we refuse
    b"\x00POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3;x=y\r\nabc\r\n0\r\n\r\n",  # chunk extension: both skip it (RFC 9112 7.1.1)
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3 \r\nabc\r\n0\r\n\r\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX: y\r\n\r\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\nContent-Length: 3\r\n\r\n",  # h11 reads a trailer CL; we refuse (RFC 9110 6.5.1)
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\nX: y\n\r\n",  # h11 ends trailers at "\n\r\n"; we refuse bare LF
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3;a\rb\r\nabc\r\n0\r\n\r\n",  # h11's ";.*" takes a bare CR; we refuse
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"3 ;a\r\nabc\r\n0\r\n\r\n",  # BWS before ";": both refuse
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b'3;a="\\"x;\r\nabc\r\n0\r\n\r\n',  # open quoted-string: h11 yes, we no
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXX0\r\n\r\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"00000000000000000003\r\nabc\r\n0\r\n\r\n",  # 20 hex digits: h11 yes, we no
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0000000000000003\r\nabc\r\n0000000000000000\r\n\r\n",  # 16: both
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 00000000000000000003\r\n\r\nabc",
    b"\x00GET / HTTP/1.2\r\nHost: a\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nX: a\x01b\r\n\r\n",  # h11 lets controls through
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nX: a\x7fb\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nX: caf\xc3\xa9 \r\n\r\n",  # obs-text: both, same value
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nX:\r\nY: \t\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\nGET / HTTP/1.1\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
    b"\x00GET / HTTP/1.0\r\nExpect: 100-continue\r\n\r\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nyzGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\njunk",
    b"\x01HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n",  # no SP, no reason: h11 reads "" too
    b"\x01HTTP/1.1 200 \r\nContent-Length: 0\r\n\r\n",
    b"\x01HTTP/1.1 200 OK \t\r\nContent-Length: 0\r\n\r\n",  # reason is not stripped
    b"\x01HTTP/1.1 000 Zero\r\n\r\n",
    b"\x01HTTP/1.1 099 Low\r\n\r\n",
    b"\x01HTTP/1.1 999 High\r\n\r\n",
    b"\x01HTTP/1.1 200 O\x01K\r\n\r\n",
    b"\x01HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
    b"\x01HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"\x03HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",  # HEAD: no body
    b"\x07HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\ntunnel",  # CONNECT 2xx: tunnel
    b"\x07HTTP/1.1 407 Auth\r\nContent-Length: 2\r\n\r\nno",
    b"\x01HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\nframes",
    b"\x01HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Hints\r\n\r\nHTTP/1.1 200 OK\r\n\r\nbody",
    b"\x01HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"\x01HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\nextra",
    b"\x01HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
    b"\x01HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
    b"\x01HTTP/1.1 200 OK\r\n\r\nuntil close",
)

CHUNKING_EDGES: tuple[bytes, ...] = (
    b"\x00",
    b"\x00\x16\x03\x01",
    b"\x00GET / HTTP/1.1\r",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\n\r",
    b"\x00GET / HTTP/1.1\r\nHost: a\rX",
    b"\x00GET / HTTP/2.0\r\nHost: a\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\n" + b"X: y\r\n" * 10 + b"Bad Name: x\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\nHost: a\r\nBad Name: x\r\n" + b"X: y\r\n" * 10,
    b"\x00GET /" + b"a" * 70 + b"\n",
    b"\x00GET /" + b"a" * 61 + b"\r\n",  # request line exactly at the test limit (64)
    b"\x00GET /" + b"a" * 62 + b"\r\n",
    b"\x00GET / HTTP/1.1\r\nX: " + b"v" * 240 + b"\r\n\r\n",
    b"\x00GET / HTTP/1.1\r\nX: " + b"v" * 240 + b"\n",
    b"\x10" + b"ff\r\n",
    b"\x10" + b"fff\r\n",
    b"\x10" + b"00000000000f\r\n",  # 14 bytes with CRLF: over the test limit
    b"\x10" + b"3\r\nabc\r\n0\r\n\r\n\r\n",
    b"\x10" + b"3\r\nabc\r\r",
    b"\x18" + b"3\r\nab",
    b"\x21" + b"1234567",
    b"\x29" + b"1234",
    b"\x39" + b"until the end",
    b"\x31" + b"HTTP/1.1 200 OK\r\n\r\n",
    b"\x35" + b"body",
    b"\x49" + b"HTTP/1.1 200 OK\r\n\r\n",
    b"\x50" + b"0\r\n\r\n",
    b"\x60GET / HTTP/1.0\r\n\r\nabc",
    b"\x70Host: a\r\n\r\n",
    b"\x71Content-Length: 0\r\n\r\nHTTP/1.1 204 No\r\n\r\n",
)


@pytest.mark.parametrize(
    "seed", differential.SEEDS + DIFFERENTIAL_PINNED + DIFFERENTIAL_EDGES, ids=repr
)
def test_differential_under_every_mode(seed: bytes) -> None:
    differential.TestOneInput(seed)
    body = seed[1:]
    # Bits 0-3 choose request/response, the method a response answers, raw or structured.
    for selector in range(16):
        differential.TestOneInput(bytes([selector]) + body)


@pytest.mark.parametrize("seed", chunking.SEEDS + CHUNKING_PINNED + CHUNKING_EDGES, ids=repr)
def test_chunking_under_every_mode(seed: bytes) -> None:
    chunking.TestOneInput(seed)
    body = seed[1:]
    # Bits 0-6: request/response, method, EOF, head template.
    for selector in range(128):
        chunking.TestOneInput(bytes([selector]) + body)


def test_differential_catches_a_disagreement() -> None:
    # The harness is not vacuous: a parser that read a field value differently is caught.
    original = differential.parse_request_head

    def lying(buf: bytes | bytearray):  # type: ignore[no-untyped-def]
        parsed = original(buf)
        if parsed is None:
            return None
        head, used = parsed
        # Plant a wrong field list in the head's lazily-split cache.
        head._headers = tuple((n, v + b"!") for n, v in head.headers)
        return head, used

    differential.parse_request_head = lying
    try:
        with pytest.raises(differential.Mismatch):
            differential.TestOneInput(b"\x00GET / HTTP/1.1\r\nHost: a\r\n\r\n")
    finally:
        differential.parse_request_head = original


def test_transfer_encoding_finding_spelled_out() -> None:
    # The first finding, asserted directly, beyond what the harness checks.
    data = DIFFERENTIAL_PINNED[1][1:]
    parsed = parse_request_head(data)
    assert parsed is not None
    head, used = parsed
    assert head.get(b"transfer-encoding") == b"chunked"
    reader = BodyReader.for_request(head)
    assert reader.feed(data[used:]) == b"" and reader.done
    with pytest.raises(HttpProtocolError):
        parse_response_head(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", request_method=b"GET"
        )
