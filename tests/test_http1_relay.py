"""The relay fast path (`relay_fields`) must forward exactly what the general path would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxycore.protocol import http1

NAMES = [
    b"Host",
    b"Connection",
    b"connection",
    b"Keep-Alive",
    b"TE",
    b"Te",
    b"Trailer",
    b"Trailers",
    b"Transfer-Encoding",
    b"Upgrade",
    b"Proxy-Authorization",
    b"Proxy-Connection",
    b"Proxy-Authenticate",
    b"X-Te",
    b"Content-Type",
    b"X-A",
    b"Server",
    b"Accept",
    b"x-upgrade",
    b"Tee",
    b"Transfer_Encoding",
    b"Content_Length",
    b"X_A",
    b"_",
    b"x-a_",
]
CONNECTION_VALUES = [
    b"keep-alive",
    b"close",
    b"Keep-Alive, Upgrade",
    b"x-a",
    b"close, X-A",
    b"te",
    b"",
    b"content-length",
]


@st.composite
def response_heads(draw):
    fields = draw(
        st.lists(
            st.tuples(st.sampled_from(NAMES), st.sampled_from([b"v", b"1", b"a b", b"keep-alive"])),
            max_size=8,
        )
    )
    fields = [
        (n, draw(st.sampled_from(CONNECTION_VALUES)) if n.lower() == b"connection" else v)
        for n, v in fields
    ]
    fields = [(n, v) for n, v in fields if n.lower() != b"transfer-encoding"]
    lines = b"".join(b"%s: %s\r\n" % (n, v) for n, v in fields)
    return b"HTTP/1.1 200 OK\r\n" + lines + b"Content-Length: 0\r\n\r\n"


@settings(max_examples=400, deadline=None)
@given(response_heads())
def test_fast_path_equals_general_path(raw: bytes) -> None:
    parsed = http1.parse_response_head(raw, request_method=b"GET")
    assert parsed is not None
    head, consumed = parsed
    assert consumed == len(raw)
    fast = http1.relay_fields(head, http1.RESPONSE_DROP)
    if fast is None:
        return  # Connection nominated other fields: the caller takes the general path
    rebuilt = b"HTTP/1.1 200 OK" + fast + b"\r\n\r\n"
    reparsed = http1.parse_response_head(rebuilt, request_method=b"GET")
    assert reparsed is not None
    general = [
        (n.lower(), v) for n, v in http1.strip_hop_by_hop(head.headers, keep_underscores=True)
    ]
    assert [(n.lower(), v) for n, v in reparsed[0].headers] == general
    assert fast == http1.reference_relay_fields(head, http1.RESPONSE_DROP)


_REQUEST_DROP = http1.compile_drop(http1.HOP_BY_HOP | {b"host", b"content-length", b"expect"})


@settings(max_examples=400, deadline=None)
@given(response_heads())
def test_request_fast_path_equals_general_path_and_drops_underscores(raw: bytes) -> None:
    fields = raw[len(b"HTTP/1.1 200 OK") :].replace(b"\r\nHost:", b"\r\nX-Host:")
    raw = b"GET / HTTP/1.1\r\nHost: h" + fields
    parsed = http1.parse_request_head(raw)
    assert parsed is not None
    head = parsed[0]
    fast = http1.relay_fields(head, _REQUEST_DROP)
    general = [
        (n, v)
        for n, v in http1.strip_hop_by_hop(head.headers)
        if n not in {b"host", b"content-length", b"expect"}
    ]
    assert all(b"_" not in n for n, _ in general)
    if fast is None:
        return
    assert fast == http1.reference_relay_fields(head, _REQUEST_DROP)
    reparsed = http1.parse_request_head(b"GET / HTTP/1.1\r\nHost: h" + fast + b"\r\n\r\n")
    assert reparsed is not None
    assert list(reparsed[0].headers[1:]) == general


def test_underscored_names_are_cut_from_requests_on_both_paths() -> None:
    raw = (
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer_Encoding: chunked\r\nX-Kept: 1\r\n"
        b"content_length: 9\r\n_: x\r\nX-A_: 2\r\nContent-Length: 0\r\n\r\n"
    )
    parsed = http1.parse_request_head(raw)
    assert parsed is not None
    head = parsed[0]
    # The parser reads them as ordinary fields: they frame nothing here.
    assert head.get(b"transfer_encoding") == b"chunked" and head.content_length == 0
    assert http1.relay_fields(head, _REQUEST_DROP) == b"\r\nX-Kept: 1"
    assert http1.reference_relay_fields(head, _REQUEST_DROP) == b"\r\nX-Kept: 1"
    assert [n for n, _ in http1.strip_hop_by_hop(head.headers)] == [
        b"host",
        b"x-kept",
        b"content-length",
    ]
    keep = http1.compile_drop(http1.HOP_BY_HOP, keep_underscores=True)
    assert b"Transfer_Encoding" in (http1.relay_fields(head, keep) or b"")


def test_nomination_falls_back() -> None:
    raw = b"HTTP/1.1 200 OK\r\nConnection: close, X-A\r\nX-A: 1\r\nContent-Length: 0\r\n\r\n"
    parsed = http1.parse_response_head(raw, request_method=b"GET")
    assert parsed is not None
    assert http1.relay_fields(parsed[0], http1.RESPONSE_DROP) is None


def test_drops_whole_lines_only() -> None:
    raw = (
        b"GET / HTTP/1.1\r\nHost: h\r\nX-Te: a\r\nTE: trailers\r\nTee: b\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    drop = http1.compile_drop(http1.HOP_BY_HOP | {b"host", b"content-length"})
    parsed = http1.parse_request_head(raw)
    assert parsed is not None
    assert http1.relay_fields(parsed[0], drop) == b"\r\nX-Te: a\r\nTee: b"
