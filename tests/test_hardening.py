"""Hostile input on a raw socket: smuggling framings, limits, slowloris, hop-by-hop headers."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from appliance.demo_upstream import FakeServer
from tests.conftest import RunningProxy


def exchange(proxy: RunningProxy, data: bytes, *, timeout: float = 10) -> bytes:
    """Send `data` while reading the answer: the proxy may answer (and close) before a large
    body is all sent, as a server may (RFC 9112 9.6)."""

    def send(sock: socket.socket) -> None:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the proxy closed first; its answer is already on its way

    with socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout) as sock:
        sender = threading.Thread(target=send, args=(sock,), daemon=True)
        sender.start()
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        sender.join(timeout)
    return received


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response[9:12])


def forward(plain_port: int, extra_headers: bytes, body: bytes = b"") -> bytes:
    return (
        b"POST http://plain.test:%d/x HTTP/1.1\r\nHost: plain.test\r\n" % plain_port
        + extra_headers
        + b"\r\n"
        + body
    )


SMUGGLING = [
    ("cl_cl_conflict", b"Content-Length: 5\r\nContent-Length: 6\r\n", b"hello!", 400),
    ("cl_cl_duplicate", b"Content-Length: 5\r\nContent-Length: 5\r\n", b"hello", 400),
    ("cl_list", b"Content-Length: 5, 5\r\n", b"hello", 400),
    ("cl_plus", b"Content-Length: +5\r\n", b"hello", 400),
    ("te_and_cl", b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", b"0\r\n\r\n", 400),
    ("te_not_chunked", b"Transfer-Encoding: gzip, chunked\r\n", b"0\r\n\r\n", None),
    ("te_xchunked", b"Transfer-Encoding: xchunked\r\n", b"0\r\n\r\n", None),
    (
        "te_twice",
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
        b"0\r\n\r\n",
        400,
    ),
    ("obs_fold", b"X-A: a\r\n b\r\n", b"", 400),
    ("space_before_colon", b"Content-Length : 5\r\n", b"hello", 400),
    # Chunk extensions are read by their grammar and dropped (test_proxy_http1_hygiene.py);
    # outside it they are refused like any other framing error.
    (
        "chunk_extension_bare_cr",
        b"Transfer-Encoding: chunked\r\n",
        b"5;x\ry\r\nhello\r\n0\r\n\r\n",
        400,
    ),
    ("chunk_extension_bws", b"Transfer-Encoding: chunked\r\n", b"5 ;x\r\nhello\r\n0\r\n\r\n", 400),
    (
        "trailer_framing",
        b"Transfer-Encoding: chunked\r\n",
        b"0\r\nContent-Length: 5\r\n\r\nhello",
        400,
    ),
    ("chunk_bad_terminator", b"Transfer-Encoding: chunked\r\n", b"5\r\nhelloXX0\r\n\r\n", 400),
    ("chunk_0x", b"Transfer-Encoding: chunked\r\n", b"0x5\r\nhello\r\n0\r\n\r\n", 400),
]


@pytest.mark.parametrize(
    ("name", "headers", "body", "expected"), SMUGGLING, ids=[s[0] for s in SMUGGLING]
)
def test_smuggling_framings_refused_and_closed(
    proxy: RunningProxy,
    plain_host: FakeServer,
    name: str,
    headers: bytes,
    body: bytes,
    expected: int | None,
) -> None:
    plain_host.clear()
    # A second, valid request follows: it must never be read (the connection is closed).
    follow = b"GET http://plain.test:%d/smuggled HTTP/1.1\r\nHost: plain.test\r\n\r\n" % (
        plain_host.port
    )
    response = exchange(proxy, forward(plain_host.port, headers, body) + follow)
    status = status_of(response)
    if expected is None:
        assert status in (400, 501)
    else:
        assert status == expected
    assert response.count(b"HTTP/1.1 ") == 1, "the proxy read past a refused message"
    assert b"connection: close" in response.lower()
    json.loads(response.split(b"\r\n\r\n", 1)[1])  # a readable body
    assert not any(r.path == "/smuggled" for r in plain_host.received)


def test_bare_lf_refused(proxy: RunningProxy, plain_host: FakeServer) -> None:
    response = exchange(
        proxy, b"GET http://plain.test:%d/ HTTP/1.1\nHost: plain.test\n\n" % plain_host.port
    )
    assert status_of(response) == 400


def test_request_line_too_long(proxy: RunningProxy) -> None:
    response = exchange(proxy, b"GET http://plain.test/" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n")
    assert status_of(response) == 414


def test_too_many_headers(proxy: RunningProxy) -> None:
    headers = b"".join(b"X-H%d: v\r\n" % i for i in range(150))
    response = exchange(
        proxy, b"GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n" + headers + b"\r\n"
    )
    assert status_of(response) == 431


def test_head_too_large(proxy: RunningProxy) -> None:
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(40))
    response = exchange(
        proxy, b"GET http://plain.test/ HTTP/1.1\r\nHost: plain.test\r\n" + headers + b"\r\n"
    )
    assert status_of(response) == 431


def test_body_over_cap_gets_413_before_upload(proxy: RunningProxy, plain_host: FakeServer) -> None:
    plain_host.clear()
    response = exchange(
        proxy, forward(plain_host.port, b"Content-Length: %d\r\n" % (10 * 1024 * 1024 + 1))
    )
    assert status_of(response) == 413
    assert not plain_host.received


def test_chunked_body_over_cap_gets_413(proxy: RunningProxy, plain_host: FakeServer) -> None:
    chunk = b"x" * (1024 * 1024)
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(11)) + b"0\r\n\r\n"
    response = exchange(proxy, forward(plain_host.port, b"Transfer-Encoding: chunked\r\n", body))
    assert status_of(response) == 413


def test_chunked_request_is_reframed_with_length(
    proxy: RunningProxy, plain_host: FakeServer
) -> None:
    plain_host.clear()
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    response = exchange(
        proxy,
        forward(plain_host.port, b"Transfer-Encoding: chunked\r\nConnection: close\r\n", body),
    )
    assert status_of(response) == 200
    seen = plain_host.last()
    assert seen.body == b"hello world"
    assert seen.header("content-length") == "11"
    assert seen.header("transfer-encoding") is None


def test_hop_by_hop_headers_stripped(proxy: RunningProxy, plain_host: FakeServer) -> None:
    plain_host.clear()
    response = exchange(
        proxy,
        forward(
            plain_host.port,
            b"Connection: close, X-Secret-Hop\r\nX-Secret-Hop: 1\r\nKeep-Alive: 5\r\n"
            b"Proxy-Authorization: Basic c2VjcmV0\r\nTE: trailers\r\nUpgrade: h2c\r\n"
            b"X-Kept: yes\r\nContent-Length: 0\r\n",
        ),
    )
    assert status_of(response) == 200
    seen = plain_host.last()
    for name in ("x-secret-hop", "keep-alive", "proxy-authorization", "te", "upgrade"):
        assert seen.header(name) is None, name
    assert seen.header("x-kept") == "yes"


def test_slowloris_head_is_cut_off(make_proxy) -> None:
    proxy = make_proxy(extra="[limits]\nhead_timeout = 1.0\n")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"GET http://plain.test/ HTTP/1.1\r\n")
        received = b""
        for _ in range(8):
            try:
                sock.sendall(b"X: y\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.3)
        sock.settimeout(5)
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        elapsed = time.monotonic() - started
    assert status_of(received) == 408
    assert elapsed < 4


def test_idle_keepalive_connection_is_closed(make_proxy) -> None:
    proxy = make_proxy(extra="[limits]\nidle_keepalive_timeout = 0.5\n")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        started = time.monotonic()
        assert sock.recv(10) == b""  # closed by the proxy, without a response
        assert time.monotonic() - started < 3


def test_unknown_gateway_is_refused(make_proxy) -> None:
    # The proxy also listens on 127.0.0.2, which is no crew's gateway: fail closed.
    proxy = make_proxy(listen_addresses=["127.0.0.2"])
    with socket.create_connection(("127.0.0.2", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET /_appliance/health HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    assert status_of(received) == 403
    assert json.loads(received.split(b"\r\n\r\n", 1)[1])["rule"] == "unknown_gateway"
