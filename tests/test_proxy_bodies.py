"""Request bodies stream with flow control; the cap counts bytes as they pass; a refused
request's body is never read as the next request. A real proxy process, a raw upstream that
records what it receives and when."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.conftest import RunningProxy


@dataclass
class RawUpstream:
    """Accepts connections, records every byte received, answers 200 once a request's body
    has ended (the chunked last-chunk or the declared length)."""

    sock: socket.socket
    received: bytearray = field(default_factory=bytearray)
    heads: list[bytes] = field(default_factory=list)
    progress: threading.Condition = field(default_factory=threading.Condition)
    closed_early: int = 0

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        data = bytearray()
        with conn:
            conn.settimeout(20)
            while True:
                try:
                    chunk = conn.recv(65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    with self.progress:
                        self.closed_early += 1
                        self.progress.notify_all()
                    return
                data += chunk
                with self.progress:
                    self.received += chunk
                    self.progress.notify_all()
                if b"\r\n\r\n" in data:
                    head, _, body = bytes(data).partition(b"\r\n\r\n")
                    lowered = head.lower()
                    if b"transfer-encoding: chunked" in lowered:
                        done = body.endswith(b"0\r\n\r\n")
                    elif b"content-length: " in lowered:
                        length = int(lowered.split(b"content-length: ")[1].split()[0])
                        done = len(body) >= length
                    else:
                        done = True  # no body
                    if done:
                        self.heads.append(head)
                        if b"transfer-encoding: chunked" in head.lower():
                            body = _dechunk(body)
                        answer = b"got %d" % len(body)
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                            % (len(answer), answer)
                        )
                        data.clear()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self.progress:
            return self.progress.wait_for(lambda: len(self.received) >= count, timeout)


def _dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, rest = out + rest[:size], rest[size + 2 :]


@pytest.fixture
def upstream() -> Iterator[RawUpstream]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    raw = RawUpstream(sock)
    threading.Thread(target=raw.serve, daemon=True).start()
    yield raw
    sock.close()


def _read_response(sock: socket.socket) -> bytes:
    sock.settimeout(20)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_chunked_body_streams_upstream_as_it_arrives(make_proxy, upstream: RawUpstream):
    """The agent sends 256 KiB in four chunks, waiting before the last until the upstream has
    received most of the rest: a proxy that read the body whole first never lets it."""
    proxy: RunningProxy = make_proxy(allow=["plain.test"])
    piece = b"a" * (64 * 1024)
    with socket.create_connection(("127.0.0.1", proxy.port)) as agent:
        agent.sendall(
            b"POST http://plain.test:%d/upload HTTP/1.1\r\nHost: plain.test\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % upstream.port
        )
        for _ in range(3):
            agent.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        assert upstream.wait_for(3 * len(piece), timeout=10), (
            f"the upstream had {len(upstream.received)} bytes while the agent held its last chunk"
        )
        agent.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(piece), piece))
        answer = _read_response(agent)
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"got %d" % (4 * len(piece)))
    (head,) = upstream.heads
    # Re-framed by the proxy: its own chunking, never a length it could not know.
    assert b"transfer-encoding: chunked" in head.lower() and b"content-length" not in head.lower()


def test_a_small_chunked_body_is_sent_with_a_length(make_proxy, upstream: RawUpstream):
    proxy: RunningProxy = make_proxy(allow=["plain.test"])
    with socket.create_connection(("127.0.0.1", proxy.port)) as agent:
        agent.sendall(
            b"POST http://plain.test:%d/small HTTP/1.1\r\nHost: plain.test\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
            % upstream.port
        )
        answer = _read_response(agent)
    assert answer.endswith(b"got 11")
    (head,) = upstream.heads
    assert b"content-length: 11" in head and b"chunked" not in head.lower()


def test_the_cap_counts_a_streamed_body_as_it_passes(make_proxy, upstream: RawUpstream):
    proxy: RunningProxy = make_proxy(
        allow=["plain.test"], extra="[limits]\nmax_body_bytes = 200000\n"
    )
    piece = b"b" * (64 * 1024)
    with socket.create_connection(("127.0.0.1", proxy.port)) as agent:
        agent.sendall(
            b"POST http://plain.test:%d/big HTTP/1.1\r\nHost: plain.test\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" % upstream.port
        )
        answer = b""
        try:
            for _ in range(5):
                agent.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                time.sleep(0.05)
        except OSError:
            pass  # the proxy may close before the agent is done sending
        answer = _read_response(agent)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"body_too_large"' in answer
    # The upstream saw the start of a body and then its connection closed: never a complete
    # request, never more than the cap.
    with upstream.progress:
        assert upstream.progress.wait_for(lambda: upstream.closed_early >= 1, 10)
    assert upstream.heads == []
    assert len(upstream.received) < 200000 + 8 * 1024


def test_a_refused_requests_body_is_never_read_as_a_request(make_proxy, upstream: RawUpstream):
    """A denied POST whose body is itself a request, pipelined: the body is drained (small) and
    the next real request is served; the smuggled one never reaches any upstream."""
    proxy: RunningProxy = make_proxy(allow=["plain.test"])
    smuggled = (
        b"GET http://plain.test:%d/smuggled HTTP/1.1\r\nHost: plain.test\r\n\r\n" % upstream.port
    )
    honest = b"GET http://plain.test:%d/honest HTTP/1.1\r\nHost: plain.test\r\n\r\n" % (
        upstream.port
    )
    with socket.create_connection(("127.0.0.1", proxy.port)) as agent:
        agent.sendall(
            b"POST http://other.test/ HTTP/1.1\r\nHost: other.test\r\nContent-Length: %d\r\n\r\n"
            % len(smuggled)
            + smuggled
            + honest
        )
        first = _read_response(agent)
        second = _read_response(agent)
    assert first.startswith(b"HTTP/1.1 403") and b"connection: close" not in first.lower()
    assert second.startswith(b"HTTP/1.1 200")
    assert [h.split(b"\r\n")[0] for h in upstream.heads] == [b"GET /honest HTTP/1.1"]
    # A body too large to drain: the refusal closes the connection instead.
    with socket.create_connection(("127.0.0.1", proxy.port)) as agent:
        agent.sendall(
            b"POST http://other.test/ HTTP/1.1\r\nHost: other.test\r\nContent-Length: 900000\r\n"
            b"\r\n" + smuggled
        )
        refused = _read_response(agent)
        assert refused.startswith(b"HTTP/1.1 403") and b"connection: close" in refused.lower()
    assert b"smuggled" not in bytes(upstream.received)
