"""HTTP/2 (h2c, prior knowledge) from the agent side, with real clients through a real proxy on
loopback: curl, httpx, concurrent streams, a refused stream next to an allowed one on one
connection, credential injection on a provider route, the scrubber, and the journal's terminal
event per stream with byte counts."""

from __future__ import annotations

import json
import subprocess
import time

import httpx
import pytest
import trio

from appliance.demo_upstream import FakeServer
from proxycore.protocol.events import RequestAllowed, RequestDenied, RequestRefused
from tests.conftest import REAL_KEYS, RunningProxy
from tests.h2_client import H2Client

pytest.importorskip("h2")


def curl_h2(proxy: RunningProxy, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "--http2-prior-knowledge", "--max-time", "20", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_curl_prior_knowledge_reverse_route_injects(
    proxy: RunningProxy, provider: FakeServer
) -> None:
    done = curl_h2(
        proxy,
        "-w",
        "\\n%{http_version} %{http_code}",
        "-H",
        "x-api-key: agent-should-not-keep-this",
        "--data",
        '{"model": "m"}',
        "-H",
        "content-type: application/json",
        f"{proxy.url}/anthropic/v1/messages",
    )
    body, _, status = done.stdout.rpartition("\n")
    assert status == "2 200", (done.stdout, done.stderr)
    assert json.loads(body)["type"] == "message"
    seen = provider.last()
    assert seen.all("x-api-key") == [REAL_KEYS["anthropic"]]
    allowed = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
    assert allowed[-1].route == "reverse" and allowed[-1].bytes_up == len('{"model": "m"}')
    assert allowed[-1].bytes_down == len(body.encode())


def test_curl_forward_request_and_denial_on_one_connection(
    proxy: RunningProxy, plain_host: FakeServer
) -> None:
    """An allowed host (absolute-form through the proxy, as the :authority names another host)
    and a denied one (curl opens a connection per host)."""
    allowed = f"http://plain.test:{plain_host.port}/hello"
    denied = f"http://denied.test:{plain_host.port}/nope"
    done = curl_h2(
        proxy,
        "--connect-to",
        f"plain.test:{plain_host.port}:{proxy.host}:{proxy.port}",
        "--connect-to",
        f"denied.test:{plain_host.port}:{proxy.host}:{proxy.port}",
        "-w",
        "\\n%{http_code} %{num_connects}\\n",
        allowed,
        denied,
    )
    lines = done.stdout.splitlines()
    assert "200 1" in lines and "403 1" in lines, (done.stdout, done.stderr)
    events = proxy.events()
    assert any(isinstance(e, RequestAllowed) and e.host == "plain.test" for e in events)
    assert any(isinstance(e, RequestDenied) and e.host == "denied.test" for e in events)


async def test_httpx_concurrent_streams_with_a_refusal(
    proxy: RunningProxy, plain_host: FakeServer
) -> None:
    async with httpx.AsyncClient(http1=False, http2=True, timeout=20) as client:

        async def fetch(path: str, results: dict[str, httpx.Response]) -> None:
            results[path] = await client.get(f"{proxy.url}{path}")

        results: dict[str, httpx.Response] = {}
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(fetch, f"/anthropic/v1/models?i={i}", results)
            nursery.start_soon(fetch, "/no-such-route", results)
            nursery.start_soon(fetch, "/_appliance/health", results)
        assert all(r.http_version == "HTTP/2" for r in results.values())
        assert results["/no-such-route"].status_code == 404
        assert results["/no-such-route"].json()["error"] == "not_found"
        assert results["/_appliance/health"].json()["ok"] is True
        assert all(results[f"/anthropic/v1/models?i={i}"].status_code == 200 for i in range(20))
        # The connection lives on after the refusal.
        again = await client.get(f"{proxy.url}/_appliance/health")
        assert again.status_code == 200
    events = proxy.events()
    refused = [e for e in events if isinstance(e, RequestRefused) and e.rule == "not_found"]
    assert len(refused) == 1
    allowed = [e for e in events if isinstance(e, RequestAllowed) and e.route == "reverse"]
    assert len(allowed) == 20


async def test_httpx_post_bodies_and_large_response(
    proxy: RunningProxy, plain_host: FakeServer
) -> None:
    """A body larger than the stream window (flow control both ways), and a large response."""
    body = b"y" * (300 * 1024)
    async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as client:
        answer = await client.post(f"{proxy.url}/anthropic/echo", content=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["length"] == len(body)
        big = await client.get(f"{proxy.url}/anthropic/size?n={2 * 1024 * 1024}")
        assert big.status_code == 200 and len(big.content) == 2 * 1024 * 1024
    allowed = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
    assert any(e.bytes_up == len(body) for e in allowed)
    assert any(e.bytes_down == 2 * 1024 * 1024 for e in allowed)


def test_refused_and_allowed_streams_share_a_connection(proxy: RunningProxy) -> None:
    """One after the other on one connection (a raw h2 client: curl 7.88.1, Debian 12's,
    cannot reuse a prior-knowledge connection, curl issue 10634, fixed in 8.0)."""
    with H2Client(proxy) as client:
        assert client.get(1, "/no-such-route")[0] == 404
        status, body = client.get(3, "/anthropic/v1/models")
        assert status == 200, body
        assert client.get(5, "/_appliance/health")[0] == 200


def test_http1_still_served(proxy: RunningProxy) -> None:
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "10", f"{proxy.url}/_appliance/health"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert json.loads(done.stdout)["ok"] is True


def test_a_reset_stream_never_ends_its_siblings(proxy: RunningProxy) -> None:
    """The agent resets one stream in the middle of a large response; the stream beside it
    completes, and each ends in its own terminal event (the reset one not complete)."""
    import h2.events

    with H2Client(proxy) as client:
        client.h2.send_headers(
            1, client.headers(f"/anthropic/size?n={4 * 1024 * 1024}"), end_stream=True
        )
        client.h2.send_headers(3, client.headers("/anthropic/size?n=300000"), end_stream=True)
        client.sock.sendall(client.h2.data_to_send())
        got = {1: 0, 3: 0}
        ended = set()
        reset_sent = False
        # Until the reset went out too: stream 3 may finish before stream 1 has sent 100 KB
        # (the two upstream answers race), and without the reset there is nothing to test.
        while 3 not in ended or not reset_sent:
            data = client.sock.recv(65536)
            assert data, "the connection closed"
            for event in client.h2.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    got[event.stream_id] += len(event.data)
                    client.h2.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                elif isinstance(event, h2.events.StreamEnded):
                    ended.add(event.stream_id)
            if got[1] > 100_000 and not reset_sent:
                client.h2.reset_stream(1)
                reset_sent = True
            client.sock.sendall(client.h2.data_to_send())
        assert got[3] == 300000 and 1 not in ended
        assert client.get(5, "/_appliance/health")[0] == 200
    by_size: dict[bool, RequestAllowed] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the events are written in batches
        allowed = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
        by_size = {e.complete: e for e in allowed if e.route == "reverse"}
        if len(by_size) == 2:
            break
        time.sleep(0.1)
    assert set(by_size) == {True, False}, allowed
    assert by_size[True].bytes_down == 300000
    assert "agent_reset" in by_size[False].ended
    assert 100_000 <= by_size[False].bytes_down < 4 * 1024 * 1024


def test_upgrade_h2c(proxy: RunningProxy, provider: FakeServer) -> None:
    """curl --http2 on http:// asks for Upgrade: h2c (RFC 7540 3.2): the request that asked is
    answered as stream 1 after the 101, through the same exchange (injection included)."""
    done = subprocess.run(
        [
            "curl",
            "-sS",
            "--http2",
            "-w",
            "\\n%{http_version} %{http_code}",
            f"{proxy.url}/anthropic/v1/models",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.stdout.endswith("\n2 200"), (done.stdout, done.stderr)
    assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]
    allowed = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
    assert allowed and allowed[-1].route == "reverse"


def test_upgrade_h2c_with_a_body_is_answered_in_http1(proxy: RunningProxy) -> None:
    """A request with a body is not upgraded (RFC 7540 3.2 lets a server ignore Upgrade)."""
    done = subprocess.run(
        [
            "curl",
            "-sS",
            "--http2",
            "--data",
            "{}",
            "-w",
            "\\n%{http_version} %{http_code}",
            f"{proxy.url}/anthropic/v1/messages",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert done.stdout.endswith("\n1.1 200"), (done.stdout, done.stderr)


def test_idle_timeout_with_streams_in_flight_leaves_the_connection_alone(
    make_proxy, provider: FakeServer
) -> None:
    """The agent sends nothing for longer than the keep-alive timeout while responses stream:
    the connection stays (the streams have their own deadlines), and the reader never takes its
    last input (here a request head) for new input."""
    import h2.events

    proxy = make_proxy(extra="[limits]\nidle_keepalive_timeout = 0.5\n")
    with H2Client(proxy) as client:
        for stream_id in (1, 3):
            client.h2.send_headers(
                stream_id, client.headers("/anthropic/sse?n=3&delay=0.7"), end_stream=True
            )
            client.sock.sendall(client.h2.data_to_send())
            time.sleep(0.2)  # two reads: the last one the proxy got is stream 3's head
        bodies = {1: b"", 3: b""}
        ended: set[int] = set()
        while ended != {1, 3}:
            data = client.sock.recv(65536)
            assert data, "the connection closed"
            for event in client.h2.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    bodies[event.stream_id] += event.data
                elif isinstance(event, h2.events.StreamEnded):
                    ended.add(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    raise AssertionError(f"stream {event.stream_id} reset")
        assert all(body.count(b"event: tick") == 3 for body in bodies.values()), bodies
        assert client.get(5, "/_appliance/health")[0] == 200


def test_idle_timeout_runs_from_the_agents_last_frame(make_proxy, provider: FakeServer) -> None:
    """An agent that keeps sending (each request well within the keep-alive timeout, the
    whole exchange longer than it) keeps its connection; one that then says nothing gets a
    GOAWAY (RFC 9113 6.8) and the connection closes."""
    import h2.events

    proxy = make_proxy(extra="[limits]\nidle_keepalive_timeout = 0.6\n")
    with H2Client(proxy) as client:
        started = time.monotonic()
        stream_id = 1
        while time.monotonic() - started < 1.5:
            last = time.monotonic()
            assert client.get(stream_id, "/_appliance/health")[0] == 200
            stream_id += 2
            time.sleep(0.25)
        client.sock.settimeout(5)
        goaway = False
        while True:
            data = client.sock.recv(65536)
            if not data:
                break
            for event in client.h2.receive_data(data):
                goaway = goaway or isinstance(event, h2.events.ConnectionTerminated)
        assert goaway
        assert 0.5 < time.monotonic() - last < 3


async def test_uploads_outlasting_the_idle_timeout_arrive_whole(
    make_proxy, provider: FakeServer
) -> None:
    """Request bodies stream in on one connection for several idle timeouts: the idle
    deadline passes while the reader is busy (full reads), and no read is lost to it."""
    proxy = make_proxy(extra="[limits]\nidle_keepalive_timeout = 0.2\n")
    body = b"z" * (1024 * 1024)
    async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as client:
        started = time.monotonic()
        sent = 0
        while time.monotonic() - started < 1.5:
            answer = await client.post(f"{proxy.url}/anthropic/echo", content=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["length"] == len(body)
            sent += 1
        assert answer.http_version == "HTTP/2"
    assert sent >= 2


async def test_whole_responses_go_out_as_status_and_fields(
    proxy: RunningProxy, plain_host: FakeServer
) -> None:
    """A whole response reaches the stream as status and fields (no HTTP/1.1 in between): a
    HEAD answer keeps its length and ends on its head, a body arrives whole with its length,
    and each stream ends in one terminal event with its byte counts."""
    async with httpx.AsyncClient(http1=False, http2=True, timeout=20) as client:
        head = await client.head(f"{proxy.url}/anthropic/v1/models")
        got = await client.get(f"{proxy.url}/anthropic/v1/models")
    assert head.http_version == got.http_version == "HTTP/2"
    assert head.status_code == got.status_code == 200
    # The fake provider answers HEAD with the length of {"ok": true}.
    assert head.content == b"" and head.headers["content-length"] == "12"
    assert int(got.headers["content-length"]) == len(got.content)
    assert "connection" not in got.headers and "transfer-encoding" not in got.headers
    allowed = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
    assert [(e.method, e.status, e.bytes_down, e.complete) for e in allowed[-2:]] == [
        ("HEAD", 200, 0, True),
        ("GET", 200, len(got.content), True),
    ]
