"""A decided response handed to an HTTP/2 stream as status and fields
(proxycore/protocol/http2/messages.py `decided_fields`) is the response the stream would have
read back from the HTTP/1.1 head the plan renders: the same status, the same fields in the same
order, scrubbed, without what HTTP/2 forbids."""

from __future__ import annotations

import pytest

from native.scrub import Scrubber
from native.scrub_patterns import DEFAULT_SHAPES
from proxycore.protocol import http1
from proxycore.protocol.exchange import plan_request
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
