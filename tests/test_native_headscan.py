"""The C head scanner (native/src/headscan.c) reads exactly what the Python reference reads.

It is a front for proxycore.protocol.http1: it accepts the common case or defers, never refuses.
These tests hold it to the reference on generated heads (Hypothesis), on each refusal class (it must
defer), and replay the seeds of fuzz/fuzz_native_headscan.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from native import headscan
from proxycore.protocol import http1

_FUZZ = Path(__file__).resolve().parent.parent / "fuzz"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _FUZZ / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness = _load("fuzz_native_headscan")
L = http1.DEFAULT_LIMITS


def scan(message: bytes, is_request: bool, limits: http1.Limits = L) -> list[int] | None:
    return headscan.scan_head(
        message,
        is_request,
        limits.max_request_line,
        limits.max_header_count,
        limits.max_header_bytes,
    )


def test_the_extension_is_built() -> None:
    # `make install` (and so `make test`, CI) builds it; a silent fallback would hide a
    # broken build behind the reference parser.
    assert headscan.AVAILABLE


def test_accepts_the_common_heads() -> None:
    request = b"GET http://a.test/x HTTP/1.1\r\nHost: a.test\r\nAccept: */*\r\n\r\n"
    facts = scan(request, True)
    assert facts is not None
    assert facts[headscan.HEAD_LEN] == len(request) - 4
    assert request[: facts[headscan.TOKEN_END]] == b"GET"
    response = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close\r\n\r\n"
    facts = scan(response, False)
    assert facts is not None
    assert facts[headscan.STATUS] == 200 and facts[headscan.CONTENT_LENGTH] == 12
    assert facts[headscan.FLAGS] == headscan.FLAG_CLOSE


@pytest.mark.parametrize(
    "message",
    [
        b"GET / HTTP/1.1\r\nHost: a\r\n",  # incomplete
        b"GET / HTTP/1.1\nHost: a\r\n\r\n",  # bare LF
        b"GET / HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",  # obs-fold
        b"GET / HTTP/1.1\r\nHost : a\r\n\r\n",  # space before colon
        b"GET / HTTP/1.1\r\nHost: a\x00\r\n\r\n",  # NUL
        b"GET / HTTP/1.1\r\nHost: a\x7f\r\n\r\n",  # DEL
        b"GET / HTTP/1.2\r\nHost: a\r\n\r\n",  # version
        b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n",  # double space
        b"GET / HTTP/1.1\r\n\r\n",  # no Host in 1.1
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",  # two Host
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +1\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1 2\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 9223372036854775808\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
    ],
)
def test_defers_whatever_the_reference_refuses_or_waits_for(message: bytes) -> None:
    assert scan(message, True) is None


@pytest.mark.parametrize(
    "message",
    [
        b"HTTP/1.1 600 Nope\r\n\r\n",
        b"HTTP/1.1 099 Nope\r\n\r\n",
        b"HTTP/1.1 20 OK\r\n\r\n",
        b"HTTP/1.1 200 O\x00K\r\n\r\n",
        b"HTTP/2.0 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1, 1\r\n\r\n",
    ],
)
def test_defers_bad_responses(message: bytes) -> None:
    assert scan(message, False) is None


def test_limits_are_the_references() -> None:
    tight = http1.Limits(max_request_line=14, max_header_count=1, max_header_bytes=40)
    assert scan(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", True, tight) is not None
    assert scan(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n", True, tight) is None  # line of 15
    assert scan(b"GET / HTTP/1.1\r\nHost: a\r\nA: b\r\n\r\n", True, tight) is None  # 2 fields
    assert scan(b"GET / HTTP/1.1\r\nHost: aaaaaaaaaaaaaaaaaa\r\n\r\n", True, tight) is None


_NAMES = st.sampled_from(
    [
        b"Host",
        b"host",
        b"HOST",
        b"Content-Length",
        b"content-length",
        b"Transfer-Encoding",
        b"Connection",
        b"connection",
        b"Expect",
        b"TE",
        b"Te",
        b"Trailer",
        b"Upgrade",
        b"Keep-Alive",
        b"Proxy-Connection",
        b"X-A",
        b"Accept",
        b"Content-Lengths",
        b"Hos",
    ]
)
_VALUES = st.one_of(
    st.sampled_from(
        [
            b"close",
            b"Keep-Alive",
            b"close, X-A",
            b" , close ,",
            b"te, upgrade",
            b"x-a",
            b"chunked",
            b"Chunked",
            b"gzip",
            b"0",
            b"12",
            b"007",
            b"",
            b" 5 ",
            b"\t3",
            b"100-continue",
            b"100-Continue, x",
            b"a.test",
            b"9223372036854775807",
        ]
    ),
    st.binary(max_size=12),
)


@st.composite
def heads(draw: st.DrawFn) -> tuple[bool, bytes]:
    is_request = draw(st.booleans())
    version = draw(st.sampled_from([b"1.1", b"1.0"]))
    if is_request:
        method = draw(st.sampled_from([b"GET", b"POST", b"CONNECT", b"M!"]))
        target = draw(st.sampled_from([b"/", b"http://a.test/x?y", b"a.test:443", b"*"]))
        start = b"%s %s HTTP/%s" % (method, target, version)
    else:
        status = draw(st.sampled_from([b"200", b"204", b"304", b"101", b"599", b"600"]))
        reason = draw(st.sampled_from([b" OK", b"", b" ", b" \xffok\t"]))
        start = b"HTTP/%s %s%s" % (version, status, reason)
    fields = draw(st.lists(st.tuples(_NAMES, _VALUES), max_size=6))
    ows = draw(st.sampled_from([b"", b" ", b"\t", b"  "]))
    lines = [start] + [name + b":" + ows + value for name, value in fields]
    message = b"\r\n".join(lines) + b"\r\n\r\n"
    # An occasional raw mutation, so that the grammar edges are crossed too.
    if draw(st.integers(0, 3)) == 0:
        where = draw(st.integers(0, len(message)))
        message = message[:where] + draw(st.binary(min_size=1, max_size=3)) + message[where:]
    return is_request, message


@settings(max_examples=1500, deadline=None)
@given(heads(), st.sampled_from([b"GET", b"HEAD", b"CONNECT"]), st.integers(0, 3))
def test_scanner_equals_reference(
    case: tuple[bool, bytes], method: bytes, limits_index: int
) -> None:
    is_request, message = case
    harness.check(message, is_request, method, harness._LIMITS[limits_index])


@pytest.mark.parametrize("seed", harness.SEEDS)
def test_fuzz_seeds(seed: bytes) -> None:
    harness.TestOneInput(seed)


def test_harness_catches_a_disagreement(monkeypatch: pytest.MonkeyPatch) -> None:
    # The harness is not vacuous: a scanner that misread Content-Length is caught.
    real = headscan.scan_head

    def lying(*args: object) -> list[int] | None:
        facts = real(*args)  # type: ignore[arg-type]
        if facts is not None:
            facts[headscan.CONTENT_LENGTH] += 1
        return facts

    monkeypatch.setattr(headscan, "scan_head", lying)
    with pytest.raises(harness.Mismatch):
        harness.check(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", False, b"GET", http1.DEFAULT_LIMITS
        )


def test_without_the_extension_the_reference_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(headscan, "scan_head", lambda *args: None)
    message = b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
    parsed = http1.parse_request_head(message)
    assert parsed is not None
    assert parsed[0].target == b"http://a.test/" and not parsed[0].keep_alive


def test_the_c_name_table_matches_the_python_sets() -> None:
    # headscan.c's first ten names are its HOP_BY_HOP_MASK; native/ cannot import proxycore, so
    # the two lists are kept in step here.
    assert set(headscan.MASK_NAMES[:10]) == http1.HOP_BY_HOP
    server_drop = http1.HOP_BY_HOP | {b"host", b"content-length", b"expect"}
    assert headscan.drop_mask(frozenset(server_drop)) == (1 << 13) - 1
    assert headscan.drop_mask(frozenset({b"x-other"})) is None
    assert headscan.drop_mask(frozenset({b"te"}), underscores=True) == (1 << 5) | (1 << 31)


@pytest.mark.parametrize(
    "names",
    [b"Transfer_Encoding", b"_", b"a_", b"_a", b"X-A_B-C", b"Host_", b"TE_"],
)
def test_relay_cuts_underscored_names_like_the_regex(names: bytes) -> None:
    raw = b"GET / HTTP/1.1\r\nHost: a\r\n%s: 1\r\nX-Kept: 2\r\nTE: x\r\n\r\n" % names
    parsed = http1.parse_request_head(raw)
    assert parsed is not None
    head = parsed[0]
    cut = http1.compile_drop({b"te"})
    kept = http1.compile_drop({b"te"}, keep_underscores=True)
    assert cut.mask is not None and kept.mask is not None
    assert headscan.relay_fields(head.raw, head.start_len, cut.mask) == (
        b"\r\nHost: a\r\nX-Kept: 2"
    )
    assert http1.reference_relay_fields(head, cut) == b"\r\nHost: a\r\nX-Kept: 2"
    assert headscan.relay_fields(head.raw, head.start_len, kept.mask) == (
        b"\r\nHost: a\r\n%s: 1\r\nX-Kept: 2" % names
    )
    assert http1.reference_relay_fields(head, kept) == b"\r\nHost: a\r\n%s: 1\r\nX-Kept: 2" % names
