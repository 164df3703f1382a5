"""A decided response handed to an HTTP/2 stream as status and fields
(proxycore/protocol/http2/messages.py `decided_fields`) is the response the stream would have
read back from the HTTP/1.1 head the plan renders: the same status, the same fields in the same
order, scrubbed, without what HTTP/2 forbids."""

from __future__ import annotations

import hpack
import pytest
from hyperframe.frame import HeadersFrame, SettingsFrame

from native.scrub import Scrubber
from native.scrub_patterns import DEFAULT_SHAPES
from proxycore.protocol import http1
from proxycore.protocol.exchange import plan_request
from proxycore.protocol.http2 import H2Limits, H2Server, connection
from proxycore.protocol.http2.connection import PREFACE
from proxycore.protocol.http2.messages import decided_fields, response_fields
from proxycore.protocol.plans import Forward
from proxycore.protocol.policy import NetworkMode
from proxycore.protocol.responses import BodyMode, ResponsePlan, plan_response
from tests.test_exchange import KEY, crew, routes

UPSTREAM_HEADS = [
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n",
    # Underscored names are kept on responses; a field named "close" is not (its name is the
    # token a "connection: close" nominates).
    b"HTTP/1.1 200 OK\r\nX_Under: 1\r\nclose: x\r\nContent-Length: 0\r\n\r\n",
    # Hop-by-hop and connection-specific fields, one nominated by Connection (the general
    # path of plan_response).
    b"HTTP/1.1 201 Created\r\nConnection: keep-alive, x-hop\r\nx-hop: 1\r\nKeep-Alive: 5\r\n"
    b"Upgrade: h2c\r\nProxy-Connection: close\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n"
    b"content-length: 7\r\n\r\n",
    # A credential echoed in the reason, a value and a name: scrubbed, the name dropped.
    b"HTTP/1.1 200 " + KEY.encode() + b"\r\nx-echo:  " + KEY.encode() + b" \r\nx-"
    + KEY.encode() + b": v\r\ncontent-length: 4\r\n\r\n",
    b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n",
    b"HTTP/1.1 304 Not Modified\r\netag: \"e\"\r\ncontent-length: 99\r\n\r\n",
]  # fmt: skip


def _response(data: bytes, method: bytes) -> http1.ResponseHead:
    parsed = http1.parse_response_head(data, request_method=method)
    assert parsed is not None
    return parsed[0]


@pytest.mark.parametrize("upstream", UPSTREAM_HEADS)
@pytest.mark.parametrize("method", [b"GET", b"HEAD"])
@pytest.mark.parametrize("keep_alive", [True, False])
def test_decided_fields_are_the_fields_read_back_from_the_rendered_head(
    upstream: bytes, method: bytes, keep_alive: bool
) -> None:
    scrubber = Scrubber([("anthropic", KEY.encode())], DEFAULT_SHAPES)
    framing = b"" if keep_alive else b"Connection: close\r\n"
    request = http1.parse_request_head(
        method + b" http://allowed.test/ HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n"
    )
    assert request is not None
    policy = crew(NetworkMode.RESTRICTED, "allowed.test")
    forward = plan_request(request[0], policy, routes(), audit_blocked=False, max_body=1000)
    assert isinstance(forward, Forward)
    decided = plan_response(forward, request[0], _response(upstream, method), scrubber)
    assert isinstance(decided, ResponsePlan) and decided.mode is not BodyMode.STREAM
    length = None if decided.mode is BodyMode.NONE else 3
    rendered = _response(bytes(decided.head(length)), method)
    fields = decided_fields(decided.start, length, closes=not decided.keep_client)
    assert decided.status == rendered.status
    assert fields == response_fields(rendered)
    assert KEY.encode() not in b"".join(name + value for name, value in fields)


def _two_servers() -> tuple[H2Server, H2Server]:
    """Two servers that read the same request on stream 1 (the client's preface and head)."""
    request = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"x"), (b":path", b"/")]
    block = hpack.Encoder().encode(request)
    frames = (
        SettingsFrame(0).serialize()
        + HeadersFrame(1, block, flags=["END_HEADERS", "END_STREAM"]).serialize()
    )
    servers = (H2Server(H2Limits()), H2Server(H2Limits()))
    for server in servers:
        server.receive_data(PREFACE + frames, 1000.0)
        server.data_to_send()
    return servers


@pytest.mark.parametrize("upstream", UPSTREAM_HEADS)
@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("end", [True, False])
def test_a_decided_head_is_the_same_frames_as_its_fields_sent_cached_or_not(
    upstream: bytes, keep_alive: bool, end: bool
) -> None:
    """`send_decided_head` (its HPACK block cached per head for the process) writes the bytes
    `send_headers` writes for `decided_fields`, the first time and from the cache; a head with
    a cookie or a credential field is never kept."""
    response = _response(upstream, b"GET")
    start = b"HTTP/1.1 %d %s" % (response.status, response.reason)
    start += b"".join(b"\r\n%s: %s" % (name, value) for name, value in response.headers)
    length = None if end else 3
    fields = decided_fields(start, length, closes=not keep_alive)
    for _ in range(2):  # the second time from the cache (when it may be kept)
        plain, decided = _two_servers()
        assert plain.send_headers(1, response.status, fields, end=end)
        assert decided.send_decided_head(
            1, response.status, start, length, closes=not keep_alive, end=end
        )
        assert decided.data_to_send() == plain.data_to_send()
        assert not decided.send_decided_head(
            1, response.status, start, length, closes=not keep_alive, end=end
        )  # a second final head: refused, as send_headers refuses it
    kept = (response.status, start, length, not keep_alive) in connection._decided_blocks
    assert kept == (b"set-cookie" not in upstream.lower())
