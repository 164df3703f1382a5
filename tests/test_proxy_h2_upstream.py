"""HTTP/2 to upstreams, with real components: a proxy process on loopback, nginx over TLS that
negotiates h2 (and one that offers only http/1.1: the fallback), nginx h2c, curl and httpx as
agents over HTTP/1.1 and h2c, and a raw h2 server in this file for what no well-behaved server
sends (GOAWAY, resets, SETTINGS and PING floods, oversized headers, trailers on demand).

What is asserted upstream: nginx's access log names the protocol and the connection serial
number of every request, so the tests see whether a request went over h2, and that two crews
never share an upstream connection while one crew's requests do."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio
import trustme

from proxycore.protocol.events import RequestAllowed
from tests.conftest import (
    PROVIDER_NAMES,
    REAL_KEYS,
    RunningProxy,
    free_port,
    start_proxy,
    wait_for_port,
    write_proxy_config,
)

pytestmark = pytest.mark.skipif(
    not Path("/usr/sbin/nginx").exists(), reason="nginx is not installed"
)

LOG_FORMAT = (
    "$server_port $connection $connection_requests $server_protocol $http_x_crew $request_uri"
)


# -- nginx ------------------------------------------------------------------------------------


@dataclass
class Nginx:
    root: Path
    tls_h2: int
    tls_h1: int
    h2c: int
    process: subprocess.Popen[bytes]

    def log(self) -> list[list[str]]:
        path = self.root / "access.log"
        return [line.split() for line in path.read_text().splitlines()] if path.exists() else []

    def seen(self, uri: str) -> list[list[str]]:
        return [entry for entry in self.log() if entry[-1] == uri]


@pytest.fixture(scope="module")
def nginx(tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA) -> Iterator[Nginx]:
    root = tmp_path_factory.mktemp("nginx-h2")
    cert = ca.issue_cert(*PROVIDER_NAMES, "plain.test", "other.test")
    cert.private_key_pem.write_to_path(str(root / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(root / "cert.pem"))
    (root / "www" / "up").mkdir(parents=True)
    (root / "www" / "big").write_bytes(os.urandom(3 * 1024 * 1024))
    tls_h2, tls_h1, h2c = free_port(), free_port(), free_port()
    locations = f"""
        root {root}/www;
        location = /echo {{
            default_type text/plain;
            return 200 "proto=$server_protocol key=$http_x_api_key crew=$http_x_crew\\n";
        }}
        location /up/ {{
            dav_methods PUT;
            create_full_put_path on;
            client_max_body_size 20m;
        }}
    """
    (root / "nginx.conf").write_text(
        f"""
daemon off;
user root;
worker_processes 1;
error_log {root}/error.log;
pid {root}/nginx.pid;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    log_format h2log '{LOG_FORMAT}';
    access_log {root}/access.log h2log;
    ssl_certificate {root}/cert.pem;
    ssl_certificate_key {root}/key.pem;
    keepalive_timeout 60s;
    server {{ listen 127.0.0.1:{tls_h2} ssl http2; {locations} }}
    server {{ listen 127.0.0.1:{tls_h1} ssl; {locations} }}
    server {{ listen 127.0.0.1:{h2c} http2; {locations} }}
}}
"""
    )
    process = subprocess.Popen(
        ["nginx", "-p", str(root), "-c", str(root / "nginx.conf")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    for port in (tls_h2, tls_h1, h2c):
        wait_for_port("127.0.0.1", port, process=process)
    yield Nginx(root, tls_h2, tls_h1, h2c, process)
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=10)


# -- the proxy --------------------------------------------------------------------------------


@pytest.fixture
def start(tmp_path: Path, ca_file: str) -> Iterator[Callable[..., RunningProxy]]:
    """A proxy with two crews (127.0.0.1 "test" and 127.0.0.2 "second"), its providers at
    `provider_port` (nginx, to see what is injected), the upstream config `upstream` added."""
    started: list[RunningProxy] = []

    def make(provider_port: int, upstream: str = "", **kwargs: object) -> RunningProxy:
        port = free_port()
        sub = tmp_path / f"p{len(started)}"
        sub.mkdir()
        config, events, control = write_proxy_config(
            sub,
            port=port,
            provider_port=provider_port,
            ca_file=ca_file,
            allow=["plain.test", "other.test"],
            listen_addresses=["127.0.0.1", "127.0.0.2"],
            extra="""
[[crew]]
name = "second"
gateway = "127.0.0.2"
mode = "restricted"
allow = ["plain.test", "other.test"]
ssrf_allow = ["127.0.0.0/8"]
""",
            **kwargs,  # type: ignore[arg-type]
        )
        if upstream:
            text = config.read_text().replace("[upstream]\n", "[upstream]\n" + upstream + "\n")
            config.write_text(text)
        proxy = start_proxy(config, host="127.0.0.1", port=port, events=events, control=control)
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "--max-time", "20", *args], capture_output=True, text=True, timeout=30
    )


def allowed(proxy: RunningProxy, count: int, timeout: float = 5.0) -> list[RequestAllowed]:
    deadline = time.monotonic() + timeout
    while True:
        events = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


# -- TLS: ALPN h2, and the HTTP/1.1 fallback ----------------------------------------------------


def test_provider_route_goes_h2_with_injection(start, nginx: Nginx) -> None:
    """HTTP/1.1 agent -> h2 upstream: the reverse route injects the key, nginx sees HTTP/2."""
    proxy = start(nginx.tls_h2)
    done = curl(
        "-H",
        "x-api-key: agent-should-not-keep-this",
        "-H",
        "x-crew: one",
        f"{proxy.url}/anthropic/echo",
    )
    assert done.stdout.startswith("proto=HTTP/2.0 "), (done.stdout, done.stderr)
    # The scrubber hides the injected key from the agent: what nginx saw is redacted in the
    # body the agent reads; the agent's own key never reached it.
    assert "agent-should-not-keep-this" not in done.stdout
    assert REAL_KEYS["anthropic"] not in done.stdout
    [event] = allowed(proxy, 1)
    assert event.status == 200 and event.complete and event.host == "api.anthropic.test"


def test_fallback_to_http1_when_alpn_offers_only_http1(start, nginx: Nginx) -> None:
    proxy = start(nginx.tls_h1)
    for _ in range(2):
        done = curl("-H", "x-crew: fallback", f"{proxy.url}/anthropic/echo")
        assert done.stdout.startswith("proto=HTTP/1.1 "), (done.stdout, done.stderr)
    entries = [e for e in nginx.seen("/echo") if e[4] == "fallback"]
    assert len(entries) == 2
    assert entries[0][1] == entries[1][1]  # the pooled HTTP/1.1 connection, reused


def test_h2_disabled_by_config_uses_http1(start, nginx: Nginx) -> None:
    proxy = start(nginx.tls_h2, upstream="h2 = false")
    done = curl("-H", "x-crew: noh2", f"{proxy.url}/anthropic/echo")
    assert done.stdout.startswith("proto=HTTP/1.1 "), (done.stdout, done.stderr)


def test_one_connection_per_crew_and_host_never_shared(start, nginx: Nginx) -> None:
    """Concurrent requests of one crew ride one upstream h2 connection; the other crew's ride
    their own (asserted on nginx's side: its connection serial numbers)."""
    proxy = start(nginx.tls_h2)

    async def run() -> None:
        async with (
            httpx.AsyncClient(timeout=20) as one,
            httpx.AsyncClient(timeout=20) as two,
            trio.open_nursery() as nursery,
        ):
            for index in range(6):
                nursery.start_soon(
                    _get, one, f"http://127.0.0.1:{proxy.port}/anthropic/echo", f"a{index}"
                )
                nursery.start_soon(
                    _get, two, f"http://127.0.0.2:{proxy.port}/anthropic/echo", f"b{index}"
                )

    trio.run(run)
    entries = [e for e in nginx.seen("/echo") if e[4][:1] in ("a", "b") and len(e[4]) == 2]
    first = {e[1] for e in entries if e[4].startswith("a")}
    second = {e[1] for e in entries if e[4].startswith("b")}
    assert len([e for e in entries if e[3] == "HTTP/2.0"]) == 12
    assert first and second and not first & second
    assert len(first) == 1 and len(second) == 1, (first, second)


async def _get(client: httpx.AsyncClient, url: str, tag: str) -> None:
    response = await client.get(url, headers={"x-crew": tag})
    assert response.status_code == 200 and "proto=HTTP/2.0" in response.text


def test_bodies_both_ways_over_h2(start, nginx: Nginx) -> None:
    """A streamed (large) and a small request body up, and a 3 MiB response down (flow
    control on both windows), HTTP/1.1 agent -> h2 upstream."""
    proxy = start(nginx.tls_h2)
    big = os.urandom(2 * 1024 * 1024 + 17)
    small = b"small body"
    for name, body in (("big", big), ("small", small)):
        with httpx.Client(timeout=30) as client:
            put = client.put(f"{proxy.url}/anthropic/up/{name}", content=body)
            assert put.status_code in (201, 204), put.text
            got = client.get(f"{proxy.url}/anthropic/up/{name}")
            assert got.content == body
    with httpx.Client(timeout=30) as client:
        got = client.get(f"{proxy.url}/anthropic/big")
        assert got.content == (nginx.root / "www" / "big").read_bytes()
    assert all(e[3] == "HTTP/2.0" for e in nginx.log() if e[-1].startswith("/up/"))


def test_h2_agent_to_h2_upstream_with_curl_and_httpx(start, nginx: Nginx) -> None:
    proxy = start(nginx.tls_h2)
    done = curl("--http2-prior-knowledge", "-H", "x-crew: h2h2", f"{proxy.url}/anthropic/echo")
    assert done.stdout.startswith("proto=HTTP/2.0 "), (done.stdout, done.stderr)

    async def run() -> None:
        async with (
            httpx.AsyncClient(http1=False, http2=True, timeout=20) as client,
            trio.open_nursery() as nursery,
        ):
            for index in range(5):
                nursery.start_soon(_get, client, f"{proxy.url}/anthropic/echo", f"h{index}")

    trio.run(run)
    assert len(allowed(proxy, 6)) == 6


def test_h2c_upstream_by_config(start, nginx: Nginx) -> None:
    """A cleartext host listed in [upstream] h2c is reached with prior knowledge."""
    proxy = start(nginx.tls_h2, upstream='h2c = ["plain.test"]')
    done = curl("-x", proxy.url, "-H", "x-crew: h2c", f"http://plain.test:{nginx.h2c}/echo")
    assert done.stdout.startswith("proto=HTTP/2.0 "), (done.stdout, done.stderr)
    # Another host, not listed: HTTP/1.1 (nginx's h2c port cannot answer it: 502 is expected,
    # not a hang).
    refused = curl(
        "-x",
        proxy.url,
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        f"http://other.test:{nginx.h2c}/echo",
    )
    assert refused.stdout in ("400", "502"), refused.stdout
