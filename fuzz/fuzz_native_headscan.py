"""Differential fuzzing of the C head scanner (native/src/headscan.c) against the Python parser.

Run:  python fuzz/fuzz_native_headscan.py -runs=2000000 /tmp/corpus-headscan
(atheris is imported only under __main__; tests import `TestOneInput` and `SEEDS` without it.)

Invariant: whenever the scanner accepts a head, the reference parser
(`reference_parse_*_head`) accepts the same bytes and reads the same head: the same bytes used,
start line, method / target / status / reason, version, headers, framing, keep-alive,
100-continue, and the same "Connection nominates a field" verdict; and the C relay writes
exactly what the regex relay writes, for the request and the response drop sets. When the
scanner defers, `parse_*_head` must give what the reference gives (it is the reference).

Inputs reuse the structured generator of fuzz_http1_differential.py (first byte: bit 0 request
or response, bits 1-2 the request method, bit 3 raw or structured), and bits 4-5 pick tight
limits, so that the limit edges are reached too.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fuzz.fuzz_http1_differential import build_input
from native import headscan
from proxycore.errors import HttpProtocolError
from proxycore.protocol import http1

_LIMITS = (
    http1.DEFAULT_LIMITS,
    http1.Limits(max_request_line=40, max_header_count=3, max_header_bytes=120),
    http1.Limits(max_request_line=16, max_header_count=1, max_header_bytes=64),
    http1.Limits(max_request_line=8192, max_header_count=100, max_header_bytes=200),
)
# The request drop set also cuts every underscored name; RESPONSE_DROP keeps them.
_REQUEST_DROP = http1.compile_drop(http1.HOP_BY_HOP | {b"host", b"content-length", b"expect"})
_DROPS = (http1.RESPONSE_DROP, _REQUEST_DROP)


class Mismatch(AssertionError):
    """The C scanner read something the reference parser did not."""


def _reference(
    message: bytes, is_request: bool, method: bytes, limits: http1.Limits
) -> tuple[object, int] | HttpProtocolError | None:
    try:
        if is_request:
            return http1.reference_parse_request_head(message, limits)
        return http1.reference_parse_response_head(message, limits, request_method=method)
    except HttpProtocolError as exc:
        return exc


def _public(head: http1.RequestHead | http1.ResponseHead) -> tuple[object, ...]:
    common = (head.raw, head.start_len, head.nominates, head.headers, head.body_kind)
    if isinstance(head, http1.RequestHead):
        return (
            *common,
            head.method,
            head.target,
            head.http_version,
            head.content_length,
            head.keep_alive,
            head.expect_continue,
        )
    return (
        *common,
        head.status,
        head.reason,
        head.http_version,
        head.content_length,
        head.keep_alive,
    )


def check(message: bytes, is_request: bool, method: bytes, limits: http1.Limits) -> None:
    facts = headscan.scan_head(
        message,
        is_request,
        limits.max_request_line,
        limits.max_header_count,
        limits.max_header_bytes,
    )
    reference = _reference(message, is_request, method, limits)
    try:
        if is_request:
            ours = http1.parse_request_head(message, limits)
        else:
            ours = http1.parse_response_head(message, limits, request_method=method)
    except HttpProtocolError as exc:
        if facts is not None:
            raise Mismatch(f"scanner accepted, parse raised {exc!r}: {message!r}") from None
        if not isinstance(reference, HttpProtocolError) or (
            (str(exc), exc.status_hint) != (str(reference), reference.status_hint)
        ):
            raise Mismatch(f"deferred, yet parse differs from the reference: {message!r}") from None
        return
    if facts is None:
        if ours is None and reference is None:
            return
        if ours is None or not isinstance(reference, tuple):
            raise Mismatch(f"deferred, yet parse differs from the reference: {message!r}")
    if ours is None:
        if reference is not None:
            raise Mismatch(f"parse needs more bytes, the reference does not: {message!r}")
        return
    if not isinstance(reference, tuple):
        raise Mismatch(f"scanner accepted what the reference refuses ({reference!r}): {message!r}")
    head, used = ours
    ref_head, ref_used = reference
    assert isinstance(ref_head, (http1.RequestHead, http1.ResponseHead))
    if used != ref_used or _public(head) != _public(ref_head):
        raise Mismatch(f"scanner and reference read differently: {message!r}")
    for drop in _DROPS:
        if http1.relay_fields(head, drop) != http1.reference_relay_fields(ref_head, drop):
            raise Mismatch(f"C relay differs from the regex relay: {message!r}")


def TestOneInput(data: bytes) -> None:
    is_request, method, message = build_input(data)
    limits = _LIMITS[(data[0] >> 4) & 3] if data else http1.DEFAULT_LIMITS
    check(message, is_request, method, limits)


SEEDS: tuple[bytes, ...] = (
    b"\x00GET / HTTP/1.1\r\nHost: example.com\r\n\r\n",
    b"\x00GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\nConnection: close, TE\r\nTE: x\r\n\r\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"\x00PUT / HTTP/1.1\r\nHost: a\r\nExpect: 100-Continue\r\nContent-Length: 1\r\n\r\nx",
    b"\x00GET / HTTP/1.0\r\n\r\n",
    b"\x01HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    b"\x01HTTP/1.1 200\r\nConnection: X-Custom\r\nX-Custom: 1\r\n\r\n",
    b"\x05HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
    b"\x11HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n\r\n",
    b"\x20GET /0123456789abcdef HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\x00POST / HTTP/1.1\r\nHost: a\r\nTransfer_Encoding: chunked\r\nX_Y: 1\r\n_: 2\r\n"
    b"Content-Length: 0\r\n\r\n",
    b"\x01HTTP/1.1 200 OK\r\nX_Trace: 1\r\nContent_Length: 2\r\n\r\n",
    *(
        bytes([selector]) + bytes(range(i, i + 24))
        for selector in (8, 9, 11, 24, 41, 57)
        for i in range(0, 200, 40)
    ),
)


def main() -> None:
    import atheris

    if not headscan.AVAILABLE:
        sys.exit("native head scanner not built: run `python -m native.build` first")
    from seeded import instrument

    instrument()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
