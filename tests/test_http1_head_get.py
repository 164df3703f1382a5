"""`RequestHead.get` / `ResponseHead.get` (proxycore/protocol/http1/heads.py) read one field
without splitting them all: the first value of the name, exactly as a search of `headers` (the
split fields) finds it, on every head the parser accepts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxycore.errors import HttpProtocolError
from proxycore.protocol import http1
from proxycore.protocol.http1.heads import split_fields
from tests.http1_corpus import conformance_cases, smuggling_cases

TCHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
NAMES = [
    b"content-type",
    b"transfer-encoding",
    b"content-length",
    b"host",
    b"connection",
    b"x-a",
    b"content",
    b"type",
    b"te",
]


def _oracle(head: http1.RequestHead | http1.ResponseHead, name: bytes) -> bytes | None:
    for key, value in split_fields(head.raw[:-4]):
        if key == name:
            return value
    return None


def _check(head: http1.RequestHead | http1.ResponseHead) -> None:
    names = {name for name, _ in split_fields(head.raw[:-4])} | set(NAMES)
    for name in sorted(names):
        assert head.get(name) == _oracle(head, name), name
    # Once the fields are split, `get` reads them.
    assert head.headers is not None
    for name in sorted(names):
        assert head.get(name) == _oracle(head, name), name


def _requests() -> list[bytes]:
    return [case.tagged(i) for i, case in enumerate(smuggling_cases(80) + conformance_cases(80))]


@pytest.mark.parametrize("wire", _requests())
def test_get_is_the_first_split_field_of_the_name_on_the_corpus(wire: bytes) -> None:
    try:
        parsed = http1.parse_request_head(wire)
    except HttpProtocolError:
        return
    if parsed is not None:
        _check(parsed[0])


_name = st.text(alphabet=TCHARS, min_size=1, max_size=12).map(str.encode) | st.sampled_from(
    [name.decode() for name in NAMES] + ["Content-Type", "TRANSFER-ENCODING", "X-A"]
).map(str.encode)
_value = st.text(alphabet=" \t:abcXYZ,;=-/\x80", max_size=16).map(lambda t: t.encode("latin-1"))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_name, _value), max_size=8), st.booleans())
def test_get_is_the_first_split_field_of_the_name(
    fields: list[tuple[bytes, bytes]], response: bool
) -> None:
    start = b"HTTP/1.1 200 OK" if response else b"GET http://x.test/ HTTP/1.1"
    raw = start + b"".join(b"\r\n" + name + b":" + value for name, value in fields) + b"\r\n\r\n"
    try:
        parsed = (
            http1.parse_response_head(raw, request_method=b"GET")
            if response
            else http1.parse_request_head(raw)
        )
    except HttpProtocolError:
        return
    if parsed is not None:
        _check(parsed[0])
