"""The smuggling and conformance corpus (tests/http1_corpus.py) through a real proxy process.

Each case is sent on its own connection with a canary request pipelined behind it, then the
client half-closes. A recording upstream on loopback reads what the proxy forwards with h11 (a
strict reader). The invariant, per case: no desync. The requests the upstream received for the
case are exactly the first requests that a strict reader (h11, after the empty lines RFC 9112
2.2 lets a server skip) reads from the same bytes and that the proxy would forward -- same
method, path, body and end-to-end fields, in order. If fewer arrived, the proxy said why with
its own refusal. Nothing ever arrives that the strict reader did not read as a request (the
canary, or a request hidden in a body, never reaches the upstream as a request of its own
unless h11 reads it as one), the upstream never sees bytes it cannot read, and the proxy
process survives every case.
"""

from __future__ import annotations

import re
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import h11
import pytest
from h11._connection import _keep_alive

from proxycore.protocol.http1 import DEFAULT_LIMITS, HOP_BY_HOP
from tests.conftest import RunningProxy
from tests.http1_corpus import TAG, Case, conformance_cases, smuggling_cases
from tests.recording_upstream import Fields, RecordingUpstream, Seen

CONCURRENCY = 16
# Fields the proxy replaces with its own on every forwarded request, and the hop-by-hop ones.
_REPLACED = frozenset({b"host", b"content-length", b"expect", b"accept-encoding"})
_NEVER_NOMINATED = frozenset({b"content-length", b"host"})
_AUTHORITY_PATH = re.compile(rb"([^/?#]*)([^#]*)")
_TAG = re.compile(rb"/(\d{6})/")


@dataclass(frozen=True)
class Forwarded:
    """A request as the upstream should see it: what identifies it, and its end-to-end fields."""

    method: bytes
    path: bytes
    body: bytes
    fields: tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class Read:
    """A request as h11 reads it from the client's bytes."""

    method: bytes
    target: bytes
    headers: Fields
    body: bytes


def strict_reading(wire: bytes) -> list[Read]:
    """Every complete request h11 reads from `wire` followed by EOF, in order, until it stops."""
    out: list[Read] = []
    buf = wire
    while buf:
        skip = 0
        while skip < 2 * DEFAULT_LIMITS.max_empty_lines and buf[skip : skip + 2] == b"\r\n":
            skip += 2
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
        conn.receive_data(buf[skip:])
        conn.receive_data(b"")
        body = b""
        try:
            request = conn.next_event()
            if not isinstance(request, h11.Request):
                return out
            while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                if not isinstance(event, h11.Data):
                    return out
                body += event.data
        except h11.RemoteProtocolError:
            return out
        out.append(Read(request.method, request.target, list(request.headers), body))
        # An Upgrade request (h11: "might switch") carries on as HTTP once the answer is not
        # 101, and the proxy never lets an upgrade through; CONNECT never carries on.
        if request.method == b"CONNECT" or not _keep_alive(request):
            return out
        if conn.their_state not in (h11.DONE, h11.MIGHT_SWITCH_PROTOCOL):
            return out
        buf = conn.trailing_data[0]
    return out


def as_forwarded(read: Read, port: int) -> Forwarded | None:
    """What the proxy forwards for this request, or None if it is not a forward to the upstream
    (another host, origin-form, CONNECT...)."""
    target = read.target
    if read.method == b"CONNECT" or target[:7].lower() != b"http://":
        return None
    match = _AUTHORITY_PATH.match(target, 7)
    assert match is not None
    authority, path = match.groups()
    if authority.lower() != b"plain.test:%d" % port:
        return None
    if path[:1] != b"/":
        path = b"/" + path
    nominated: set[bytes] = set()
    for name, value in read.headers:
        if name == b"connection":
            nominated.update(t.strip(b" \t").lower() for t in value.split(b","))
    drop = HOP_BY_HOP | _REPLACED | (nominated - _NEVER_NOMINATED)
    fields = tuple((n, v) for n, v in read.headers if n not in drop and b"_" not in n)
    return Forwarded(read.method, path, read.body, fields)


def received_as_forwarded(seen: Seen) -> Forwarded:
    fields = tuple((n, v) for n, v in seen.headers if n not in _REPLACED and n != b"connection")
    return Forwarded(seen.method, seen.target, seen.body, fields)


def canary(port: int, index: int) -> bytes:
    return b"GET http://plain.test:%d/%06d/canary HTTP/1.1\r\nHost: plain.test\r\n\r\n" % (
        port,
        index,
    )


def send(proxy_port: int, wire: bytes) -> bytes:
    """Send `wire`, half-close, read to the end (the proxy closes after EOF)."""
    with socket.create_connection(("127.0.0.1", proxy_port), timeout=15) as sock:
        try:
            sock.sendall(wire)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed before everything was written: what was read counts
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received


@pytest.fixture
def upstream() -> Iterator[RecordingUpstream]:
    server = RecordingUpstream()
    yield server
    server.close()


def run_corpus(
    proxy: RunningProxy, upstream: RecordingUpstream, cases: list[Case]
) -> tuple[list[str], int]:
    """Run every case; return a description of each desync found, and the number of cases in
    which the proxy forwarded every request the strict reader read (at least one)."""
    port = upstream.port
    wires = [case.tagged(i) + canary(port, i) for i, case in enumerate(cases)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(lambda wire: send(proxy.port, wire), wires))
    by_case: dict[int, list[Forwarded]] = defaultdict(list)
    failures: list[str] = []
    for seen in upstream.requests:  # in arrival order; one case's requests arrive in order
        tag = _TAG.search(seen.target)
        if tag is None:
            failures.append(f"untagged request reached the upstream: {seen}")
            continue
        by_case[int(tag.group(1))].append(received_as_forwarded(seen))
    agreed = 0
    for i, case in enumerate(cases):
        expected = [f for r in strict_reading(wires[i]) if (f := as_forwarded(r, port))]
        got = by_case.get(i, [])
        agreed += bool(got) and got == expected
        if got != expected[: len(got)]:
            failures.append(f"{case.name}: upstream got {got}, a strict reader {expected}")
        elif len(got) < len(expected) and b"x-appliance-proxy: refusal" not in answers[i]:
            failures.append(f"{case.name}: stopped without a refusal: {answers[i][:300]!r}")
    failures += [f"upstream could not read what the proxy sent: {e}" for e in upstream.errors]
    if upstream.truncated:
        failures.append(f"{upstream.truncated} requests cut short on their way upstream")
    return failures, agreed


def test_smuggling_and_conformance_corpus_never_desyncs(
    make_proxy, upstream: RecordingUpstream
) -> None:
    proxy = make_proxy(allow=["plain.test"])
    port = upstream.port
    cases = smuggling_cases(port) + conformance_cases(port)
    assert len(cases) > 1800
    started = time.monotonic()
    failures, agreed = run_corpus(proxy, upstream, cases)
    elapsed = time.monotonic() - started
    assert proxy.process.poll() is None, "the proxy died: " + proxy.stop()
    assert not failures, "\n".join(failures[:40]) + f"\n({len(failures)} desyncs)"
    # Not vacuous: most variants are refused (as they should be), but in well over a hundred
    # cases the proxy forwarded exactly what the strict reader read, canary included.
    canaries = sum(1 for seen in upstream.requests if seen.target.endswith(b"/canary"))
    assert agreed > 120 and canaries > 60, (agreed, canaries, len(upstream.requests))
    # And the proxy still serves an ordinary request afterwards.
    upstream.clear()
    answer = send(proxy.port, canary(port, 999999))
    assert answer.startswith(b"HTTP/1.1 200 ") and len(upstream.requests) == 1
    assert elapsed < 60, elapsed


def test_corpus_oracle_flags_a_desync() -> None:
    # The invariant checker itself: a proxy that read CL where h11 reads TE would forward a
    # different body; one that forwarded the canary hidden in a body would forward an extra
    # request. Both must be told apart from the strict reading.
    port = 8080
    wire = (
        b"POST http://plain.test:8080/000001/main HTTP/1.1\r\nHost: plain.test\r\n"
        b"Content-Length: 6\r\n\r\nabcdef" + canary(port, 1)
    )
    reading = [f for r in strict_reading(wire) if (f := as_forwarded(r, port))]
    assert [(f.method, f.path, f.body) for f in reading] == [
        (b"POST", b"/000001/main", b"abcdef"),
        (b"GET", b"/000001/canary", b""),
    ]
    chunked = (
        b"POST http://plain.test:8080/000002/main HTTP/1.1\r\nHost: plain.test\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n0\r\nT: 1\r\n\r\n" + canary(port, 2)
    )
    reading = [f for r in strict_reading(b"\r\n" + chunked) if (f := as_forwarded(r, port))]
    assert [f.body for f in reading] == [b"abc", b""]
    assert strict_reading(b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n")[0].headers == [
        (b"host", b"a"),
        (b"x", b"a b"),  # h11 unfolds; the proxy refuses, which the invariant allows
    ]


def refused_with_body_cases(port: int) -> list[Case]:
    """Requests the proxy answers itself (403, 404) whose body holds a request: the body must
    never be read as the next request on the connection."""
    inner = b"GET http://plain.test:%d/%s/smuggled HTTP/1.1\r\nHost: plain.test\r\n\r\n" % (
        port,
        TAG,
    )
    denied = b"POST http://other.test:%d/%s/main HTTP/1.1\r\nHost: other.test\r\n" % (port, TAG)
    chunk = b"%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner)
    return [
        Case("denied-length", denied + b"Content-Length: %d\r\n\r\n" % len(inner) + inner),
        Case("denied-chunked", denied + b"Transfer-Encoding: chunked\r\n\r\n" + chunk),
        Case(
            "not-found-length",
            b"POST /nowhere/%s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
            % (TAG, len(inner))
            + inner,
        ),
    ]


def test_refused_request_bodies_are_never_read_as_requests(
    make_proxy, upstream: RecordingUpstream
) -> None:
    proxy = make_proxy(allow=["plain.test"])
    failures, _ = run_corpus(proxy, upstream, refused_with_body_cases(upstream.port))
    assert proxy.process.poll() is None
    assert not failures, "\n".join(failures)
