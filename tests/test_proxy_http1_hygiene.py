"""HTTP/1.1 hygiene through a real proxy process, seen from a strict upstream (h11).

- Request fields whose name holds an underscore never reach the upstream, on the relay fast
  path, on the general path and on a provider route (a back end mapping "_" to "-" would read
  "Transfer_Encoding" as a second framing field). Responses keep them (docs/proxy.md).
- Chunk extensions and trailer fields (RFC 9112 7.1.1, 7.1.2) are read and dropped: neither
  reaches the upstream, nor the agent.
- Empty lines before a request line (RFC 9112 2.2) are skipped.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from appliance.demo_upstream import FakeServer
from tests.conftest import RunningProxy
from tests.recording_upstream import Fields, RecordingUpstream, Seen


def _response_fields(seen: Seen) -> Fields:
    extra = [(b"x_upstream_trace", b"t1"), (b"x-plain", b"p1")]
    if b"general" in seen.target:
        # A nomination sends the response down the general path (strip + serialize).
        extra += [(b"connection", b"x-hop"), (b"x-hop", b"1")]
    return extra


@pytest.fixture
def upstream() -> Iterator[RecordingUpstream]:
    server = RecordingUpstream(response_fields=_response_fields)
    yield server
    server.close()


@pytest.fixture
def hygiene_proxy(make_proxy) -> RunningProxy:
    return make_proxy(allow=["plain.test"])


def exchange(proxy: RunningProxy, data: bytes, *, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received


def responses(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """(status, fields, body) of each Content-Length or chunked response in `data`."""
    import h11

    conn = h11.Connection(h11.CLIENT)
    out = []
    conn.receive_data(data)
    while True:
        conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        event = conn.next_event()
        if not isinstance(event, h11.Response):
            return out
        body = b""
        while not isinstance(part := conn.next_event(), h11.EndOfMessage):
            assert isinstance(part, h11.Data), part
            body += part.data
        out.append((event.status_code, dict(event.headers), body))
        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
            return out
        conn.start_next_cycle()


UNDERSCORED = (
    b"Transfer_Encoding: chunked\r\n"
    b"Content_Length: 3\r\n"
    b"X_Forwarded_For: 203.0.113.9\r\n"
    b"_: 1\r\n"
    b"X-Kept: yes\r\n"
)


@pytest.mark.parametrize("path", ["fast", "general"])
def test_underscored_request_fields_never_reach_the_upstream(
    hygiene_proxy: RunningProxy, upstream: RecordingUpstream, path: str
) -> None:
    nominate = b"Connection: keep-alive, X-Hop\r\nX-Hop: 1\r\n" if path == "general" else b""
    request = (
        b"POST http://plain.test:%d/%s HTTP/1.1\r\nHost: plain.test\r\n"
        % (upstream.port, path.encode())
        + UNDERSCORED
        + nominate
        + b"Content-Length: 5\r\nConnection: close\r\n\r\nhello"
    )
    answers = responses(exchange(hygiene_proxy, request))
    assert [status for status, _, _ in answers] == [200]
    assert len(upstream.requests) == 1 and not upstream.errors
    seen = upstream.requests[0]
    assert seen.body == b"hello"
    assert not [name for name in seen.names() if b"_" in name], seen.headers
    assert (b"x-kept", b"yes") in seen.headers
    assert b"x-hop" not in seen.names()


def test_underscored_fields_never_reach_a_provider(
    hygiene_proxy: RunningProxy, provider: FakeServer
) -> None:
    provider.clear()
    request = (
        b"POST /anthropic/v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + UNDERSCORED
        + b"X_Api_Key: agent-key\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
    )
    answers = responses(exchange(hygiene_proxy, request))
    assert [status for status, _, _ in answers] == [200]
    seen = provider.last()
    assert not [name for name in seen.headers if "_" in name], seen.headers
    assert seen.header("x-kept") == "yes"


@pytest.mark.parametrize("path", ["fast", "general"])
def test_underscored_response_fields_reach_the_agent(
    hygiene_proxy: RunningProxy, upstream: RecordingUpstream, path: str
) -> None:
    # Responses keep them: the "_" to "-" mapping is a server's, not a client's (docs/proxy.md).
    request = b"GET http://plain.test:%d/%s HTTP/1.1\r\nHost: plain.test\r\n\r\n" % (
        upstream.port,
        path.encode(),
    )
    answers = responses(exchange(hygiene_proxy, request))
    assert len(answers) == 1
    status, fields, body = answers[0]
    assert status == 200 and body == b"ok /" + path.encode()
    assert fields[b"x_upstream_trace"] == b"t1" and fields[b"x-plain"] == b"p1"
    assert b"x-hop" not in fields


def test_chunk_extensions_and_trailers_never_reach_the_upstream(
    hygiene_proxy: RunningProxy, upstream: RecordingUpstream
) -> None:
    body = (
        b'5;sig="a;b" ; n=1\r\nhello\r\n6;x\r\n world\r\n0;last\r\n'
        b"X-Checksum: abc\r\nServer-Timing: t;dur=1\r\n\r\n"
    )
    request = (
        b"POST http://plain.test:%d/c HTTP/1.1\r\nHost: plain.test\r\n"
        b"Transfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n" % upstream.port
    ) + body
    follow = b"GET http://plain.test:%d/after HTTP/1.1\r\nHost: plain.test\r\n\r\n" % (
        upstream.port
    )
    answers = responses(exchange(hygiene_proxy, request + follow))
    assert [status for status, _, _ in answers] == [200, 200]
    first, second = upstream.requests
    assert first.body == b"hello world"
    assert not {b"x-checksum", b"server-timing", b"trailer", b"transfer-encoding"} & set(
        first.names()
    )
    assert (b"content-length", b"11") in first.headers
    assert second.target == b"/after"
    assert not upstream.errors


def test_response_extensions_and_trailers_never_reach_the_agent(
    hygiene_proxy: RunningProxy,
) -> None:
    def chunked(seen: Seen) -> bytes:
        return (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Sum\r\n"
            b"Connection: close\r\n\r\n"
            b"4;sig=1\r\nbody\r\n0\r\nX-Sum: 9\r\n\r\n"
        )

    upstream = RecordingUpstream(raw_response=chunked)
    try:
        request = b"GET http://plain.test:%d/r HTTP/1.1\r\nHost: plain.test\r\n\r\n" % (
            upstream.port
        )
        received = exchange(hygiene_proxy, request)
    finally:
        upstream.close()
    answers = responses(received)
    assert len(answers) == 1
    status, fields, body = answers[0]
    assert status == 200 and body == b"body"
    assert b"x-sum" not in fields and b"trailer" not in fields
    assert b"sig=" not in received and b"X-Sum" not in received


def test_leading_empty_lines_are_skipped(
    hygiene_proxy: RunningProxy, upstream: RecordingUpstream
) -> None:
    one = b"GET http://plain.test:%d/one HTTP/1.1\r\nHost: plain.test\r\n\r\n" % upstream.port
    two = b"POST http://plain.test:%d/two HTTP/1.1\r\nHost: plain.test\r\n" % upstream.port
    two += b"Content-Length: 2\r\n\r\nhi\r\n"  # the CRLF some clients add after a body
    three = b"GET http://plain.test:%d/three HTTP/1.1\r\nHost: plain.test\r\n\r\n" % (upstream.port)
    answers = responses(exchange(hygiene_proxy, b"\r\n" + one + b"\r\n\r\n" + two + three))
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert [seen.target for seen in upstream.requests] == [b"/one", b"/two", b"/three"]
    assert upstream.requests[1].body == b"hi"


def test_too_many_empty_lines_are_refused(
    hygiene_proxy: RunningProxy, upstream: RecordingUpstream
) -> None:
    request = b"GET http://plain.test:%d/x HTTP/1.1\r\nHost: plain.test\r\n\r\n" % upstream.port
    received = exchange(hygiene_proxy, b"\r\n" * 5 + request)
    assert received.startswith(b"HTTP/1.1 400 ")
    assert "empty lines" in json.loads(received.split(b"\r\n\r\n", 1)[1])["message"]
    assert not upstream.requests
