"""HTTP/2 to upstreams, with real components: a proxy process on loopback, nginx over TLS that
negotiates h2 (and one that offers only http/1.1: the fallback), nginx h2c, curl and httpx as
agents over HTTP/1.1 and h2c, and a raw h2 server in this file for what no well-behaved server
sends (GOAWAY, resets, SETTINGS and PING floods, oversized headers, trailers on demand).

What is asserted upstream: nginx's access log names the protocol and the connection serial
number of every request, so the tests see whether a request went over h2, and that two crews
never share an upstream connection while one crew's requests do."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import httpx
import pytest
import trio
import trustme
from hyperframe.frame import (
    ContinuationFrame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    SettingsFrame,
)

from proxycore.protocol.events import RequestAllowed, RequestRefused
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
    # What the upstream received as x-api-key: the key the proxy injected.
    log_format keys '$http_x_crew $server_protocol $http_x_api_key';
    access_log {root}/keys.log keys;
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

    def make(
        provider_port: int, upstream: str = "", limits: str = "", **kwargs: object
    ) -> RunningProxy:
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
"""
            + (f"\n[limits]\n{limits}\n" if limits else ""),
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
    assert "key=[REDACTED" in done.stdout
    # Upstream, over HTTP/2: the appliance's key, never the agent's.
    keys = (nginx.root / "keys.log").read_text().splitlines()
    assert f"one HTTP/2.0 {REAL_KEYS['anthropic']}" in keys
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


# -- a raw h2c server: trailers on demand, and what no well-behaved server sends ----------------


class RawH2Server:
    """h2c on loopback, one thread per connection, the h2 package's server side for the
    ordinary frames and raw frames (hyperframe) for the hostile ones. What it serves depends on
    the path (see `respond`); `connections` counts accepted connections."""

    def __init__(self, max_streams: int | None = None, window: int | None = None) -> None:
        self.max_streams = max_streams
        self.window = window  # SETTINGS_INITIAL_WINDOW_SIZE (0: never takes a body)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.closed = 0  # connections the proxy closed (or that ended)
        self.goaway_sent = False
        self.request_trailers: list[list[tuple[bytes, bytes]]] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        conn = h2.connection.H2Connection(config)
        conn.initiate_connection()
        if self.max_streams is not None:
            conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1})
        if self.window is not None:
            conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.window})
        sock.sendall(conn.data_to_send())
        paths: dict[int, bytes] = {}
        trailers: dict[int, list[tuple[bytes, bytes]]] = {}
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    return
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        paths[event.stream_id] = dict(event.headers)[b":path"]
                    elif isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                    elif isinstance(event, h2.events.TrailersReceived):
                        trailers[event.stream_id] = list(event.headers)
                    elif isinstance(event, h2.events.StreamEnded):
                        self.respond(sock, conn, event.stream_id, paths, trailers)
                sock.sendall(conn.data_to_send())
        except Exception as exc:  # recorded: the tests assert there was none
            self.errors.append(repr(exc))
        finally:
            sock.close()
            with self.lock:
                self.closed += 1

    def respond(
        self,
        sock: socket.socket,
        conn: h2.connection.H2Connection,
        stream_id: int,
        paths: dict[int, bytes],
        trailers: dict[int, list[tuple[bytes, bytes]]],
    ) -> None:
        path = paths.get(stream_id, b"")
        ok = [(b":status", b"200"), (b"content-type", b"text/plain")]
        if path == b"/goaway" and not self.goaway_sent:
            # RFC 9113 6.8: this stream (and any above) was never processed.
            self.goaway_sent = True
            sock.sendall(conn.data_to_send() + GoAwayFrame(0, last_stream_id=0).serialize())
        elif path == b"/reset":
            conn.reset_stream(stream_id, 2)
        elif path == b"/settings-flood":
            sock.sendall(conn.data_to_send() + SettingsFrame(0).serialize() * 200)
        elif path == b"/ping-flood":
            frame = PingFrame(0, opaque_data=b"12345678").serialize()
            sock.sendall(conn.data_to_send() + frame * 200)
        elif path == b"/big-headers":
            conn.send_headers(stream_id, [*ok, (b"x-big", b"a" * 100_000)], end_stream=True)
        elif path == b"/continuation":
            frames = HeadersFrame(stream_id, data=b"\x82").serialize()
            frames += b"".join(
                ContinuationFrame(stream_id, data=b"\x82").serialize() for _ in range(40)
            )
            sock.sendall(conn.data_to_send() + frames)
        elif path == b"/many-fields":
            # Within h2's header list limit, over the HTTP/1.1 parser's field count.
            many = [(b"x-f%d" % i, b"1") for i in range(150)]
            conn.send_headers(stream_id, [*ok, *many])
            conn.send_data(stream_id, b"ok", end_stream=True)
        elif path == b"/huge-length":
            # Digits only (the HTTP/2 side lets it through), over what the parser accepts.
            conn.send_headers(stream_id, [*ok, (b"content-length", b"9" * 20)])
        elif path == b"/slow":
            time.sleep(1.0)  # this connection's thread: its only stream waits
            conn.send_headers(stream_id, ok)
            conn.send_data(stream_id, b"slow", end_stream=True)
        elif path == b"/trailers":
            conn.send_headers(stream_id, ok)
            conn.send_data(stream_id, b"body")
            leak = REAL_KEYS["anthropic"].encode()
            conn.send_headers(
                stream_id, [(b"x-checksum", b"abc"), (b"x-leak", leak)], end_stream=True
            )
        elif path == b"/echo-trailers":
            got = trailers.get(stream_id, [])
            self.request_trailers.append(got)
            body = json.dumps([[n.decode(), v.decode()] for n, v in got]).encode()
            conn.send_headers(stream_id, ok)
            conn.send_data(stream_id, body, end_stream=True)
        else:
            conn.send_headers(stream_id, ok)
            conn.send_data(stream_id, b"ok:" + path, end_stream=True)


@pytest.fixture
def raw() -> Iterator[RawH2Server]:
    server = RawH2Server()
    yield server
    server.close()


def h1_exchange(proxy: RunningProxy, request: bytes, gateway: str = "127.0.0.1") -> bytes:
    """One HTTP/1.1 request on a raw socket; the whole answer (the proxy closes after it)."""
    with socket.create_connection((gateway, proxy.port), timeout=20) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_response_trailers_to_http1_agents_that_take_them(start, nginx: Nginx, raw) -> None:
    proxy = start(nginx.tls_h2, upstream='h2c = ["plain.test"]')
    target = f"http://plain.test:{raw.port}/trailers"
    with_te = h1_exchange(
        proxy,
        f"GET {target} HTTP/1.1\r\nHost: plain.test\r\nTE: trailers\r\n"
        "Connection: close\r\n\r\n".encode(),
    )
    head, _, body = with_te.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"transfer-encoding: chunked" in head.lower()
    data, trailer_section = dechunk(body)
    assert data == b"body"
    assert b"x-checksum: abc\r\n" in trailer_section
    # The credential the upstream echoed in a trailer is scrubbed like a response field.
    assert REAL_KEYS["anthropic"].encode() not in body and b"x-leak: [REDACTED" in body
    without = h1_exchange(
        proxy, f"GET {target} HTTP/1.1\r\nHost: plain.test\r\nConnection: close\r\n\r\n".encode()
    )
    # Dropped (RFC 9110 6.5.1).
    assert dechunk(without.partition(b"\r\n\r\n")[2]) == (b"body", b"")


def dechunk(body: bytes) -> tuple[bytes, bytes]:
    """A chunked body's data and its trailer section."""
    data = b""
    while True:
        line, _, body = body.partition(b"\r\n")
        size = int(line, 16)
        if size == 0:
            return data, body[: -len(b"\r\n")]
        data += body[:size]
        body = body[size + 2 :]


def test_trailers_both_ways_for_an_h2_agent(start, nginx: Nginx, raw) -> None:
    proxy = start(nginx.tls_h2, upstream='h2c = ["plain.test"]')
    authority = f"plain.test:{raw.port}".encode()
    with H2Agent(proxy) as agent:
        # Response trailers: a HEADERS frame with END_STREAM, scrubbed.
        agent.h2.send_headers(1, agent.request(authority, b"/trailers"), end_stream=True)
        agent.flush()
        status, body, trailers = agent.response(1)
        assert (status, body) == (200, b"body")
        assert trailers[b"x-checksum"] == b"abc"
        assert REAL_KEYS["anthropic"].encode() not in trailers[b"x-leak"]
        # Request trailers reach the h2 upstream; credential fields never ride them.
        agent.h2.send_headers(3, agent.request(authority, b"/echo-trailers", b"POST"))
        agent.h2.send_data(3, b"payload")
        agent.h2.send_headers(
            3, [(b"x-digest", b"sha-256=1"), (b"authorization", b"agent-token")], end_stream=True
        )
        agent.flush()
        status, body, _ = agent.response(3)
        assert status == 200
        assert json.loads(body) == [["x-digest", "sha-256=1"]]


class H2Agent:
    """An h2c agent on a raw socket that reports trailers (tests/h2_client.py does not)."""

    def __init__(self, proxy: RunningProxy) -> None:
        self.sock = socket.create_connection((proxy.host, proxy.port), timeout=20)
        config = h2.config.H2Configuration(client_side=True, header_encoding=None)
        self.h2 = h2.connection.H2Connection(config)
        self.h2.initiate_connection()
        self.flush()

    def __enter__(self) -> H2Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def request(
        self, authority: bytes, path: bytes, method: bytes = b"GET"
    ) -> list[tuple[bytes, bytes]]:
        return [
            (b":method", method),
            (b":scheme", b"http"),
            (b":authority", authority),
            (b":path", path),
        ]

    def flush(self) -> None:
        self.sock.sendall(self.h2.data_to_send())

    def response(self, stream_id: int) -> tuple[int, bytes, dict[bytes, bytes]]:
        status, body, trailers = 0, bytearray(), {}
        while True:
            data = self.sock.recv(65536)
            assert data, "the proxy closed the connection"
            for event in self.h2.receive_data(data):
                if getattr(event, "stream_id", None) != stream_id:
                    continue
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    self.h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
                elif isinstance(event, h2.events.TrailersReceived):
                    trailers = dict(event.headers)
                elif isinstance(event, h2.events.StreamEnded):
                    self.flush()
                    return status, bytes(body), trailers
                elif isinstance(event, h2.events.StreamReset):
                    raise ConnectionError(f"stream reset: {event.error_code}")
            self.flush()


def test_goaway_refused_stream_is_sent_again_on_a_fresh_connection(start, nginx, raw) -> None:
    proxy = start(nginx.tls_h2, upstream='h2c = ["plain.test"]')
    done = curl("-x", proxy.url, f"http://plain.test:{raw.port}/goaway")
    assert done.stdout == "ok:/goaway", (done.stdout, done.stderr)
    assert raw.connections == 2


@pytest.mark.parametrize(
    "path", ["/reset", "/settings-flood", "/ping-flood", "/big-headers", "/continuation"]
)
def test_hostile_upstream_ends_its_stream_only(start, nginx: Nginx, raw, path: str) -> None:
    """A reset, a SETTINGS or PING flood, an oversized header block, a CONTINUATION flood:
    the request gets a readable 502, the worker lives on, and the next request (same crew,
    other crew) is served."""
    proxy = start(nginx.tls_h2, upstream='h2c = ["plain.test"]')
    done = curl("-x", proxy.url, "-w", "\\n%{http_code}", f"http://plain.test:{raw.port}{path}")
    body, _, status = done.stdout.rpartition("\n")
    assert status == "502", done.stdout
    assert json.loads(body)["error"] == "upstream_failed"
    for gateway in ("127.0.0.1", "127.0.0.2"):
        again = curl("-x", f"http://{gateway}:{proxy.port}", f"http://plain.test:{raw.port}/ok")
        assert again.stdout == "ok:/ok", (gateway, again.stdout, again.stderr)
    refused = [e for e in proxy.events() if isinstance(e, RequestRefused)]
    assert len(refused) == 1 and refused[0].status == 502
    # The journal says why: the stream's reset, or the limit that ended the connection.
    why = {
        "/reset": "upstream reset the stream (error 2)",
        "/settings-flood": "h2_settings_flood",
        "/ping-flood": "h2_ping_flood",
        "/big-headers": "h2_header_list",  # the HPACK-decoded size (Huffman: 62.5 KiB sent)
        "/continuation": "h2_continuation",
    }[path]
    assert why in refused[0].message, refused[0].message
    assert proxy.process.poll() is None


@pytest.mark.parametrize("path", ["/many-fields", "/huge-length"])
def test_response_heads_the_parser_refuses_are_a_502(start, nginx: Nginx, raw, path: str) -> None:
    """An HTTP/2 upstream's response head is read by the same strict parser as an HTTP/1.1
    upstream's: more fields than `max_header_count`, or a Content-Length over its bound, is
    a readable 502 naming the malformed response, one terminal event; the next request on the
    same upstream connection is served."""
    proxy = start(nginx.tls_h2, upstream='h2c = ["plain.test"]')
    done = curl("-x", proxy.url, "-w", "\\n%{http_code}", f"http://plain.test:{raw.port}{path}")
    body, _, status = done.stdout.rpartition("\n")
    assert status == "502", done.stdout
    assert json.loads(body)["error"] == "upstream_failed"
    again = curl("-x", proxy.url, f"http://plain.test:{raw.port}/ok")
    assert again.stdout == "ok:/ok", (again.stdout, again.stderr)
    refused = [e for e in proxy.events() if isinstance(e, RequestRefused)]
    assert len(refused) == 1 and refused[0].status == 502
    assert refused[0].rule == "upstream_protocol_error"
    assert "sent a malformed response" in refused[0].message, refused[0].message
    assert proxy.process.poll() is None


def test_streams_per_connection_and_connections_per_crew_are_bounded(start, nginx: Nginx) -> None:
    """An upstream that allows one stream per connection: a second concurrent request of the
    crew opens a second connection (its streams never exceed the upstream's
    SETTINGS_MAX_CONCURRENT_STREAMS); with `upstream_connections_per_crew = 1` it is refused
    503 instead, as an HTTP/1.1 dial over the crew's share is."""
    server = RawH2Server(max_streams=1)
    try:
        for cap, expected in ((None, ["200", "200"]), (1, ["200", "503"])):
            proxy = start(
                nginx.tls_h2,
                upstream='h2c = ["plain.test"]',
                limits=f"upstream_connections_per_crew = {cap}" if cap else "",
            )
            before = server.connections
            codes: list[str] = []

            def get(codes: list[str] = codes, port: int = proxy.port) -> None:
                done = curl(
                    "-x",
                    f"http://127.0.0.1:{port}",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    f"http://plain.test:{server.port}/slow",
                )
                codes.append(done.stdout)

            first = threading.Thread(target=get)
            first.start()
            time.sleep(0.4)  # the upstream's SETTINGS (one stream) have arrived
            get()
            first.join()
            assert sorted(codes) == expected, codes
            assert server.connections - before == (2 if cap is None else 1)
            assert not server.errors
    finally:
        server.close()


def test_idle_upstream_h2_connections_are_reaped(start, nginx: Nginx, raw) -> None:
    proxy = start(nginx.tls_h2, upstream='h2c = ["plain.test"]', limits="upstream_idle_timeout = 1")
    for _ in range(2):
        done = curl("-x", proxy.url, f"http://plain.test:{raw.port}/ok")
        assert done.stdout == "ok:/ok"
    assert raw.connections == 1  # the second request rode the first one's connection
    deadline = time.monotonic() + 10
    while raw.closed < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert raw.closed == 1
    done = curl("-x", proxy.url, f"http://plain.test:{raw.port}/ok")
    assert done.stdout == "ok:/ok" and raw.connections == 2


def test_http1_agent_chunked_trailers_reach_an_h2_upstream(start, nginx: Nginx, raw) -> None:
    proxy = start(nginx.tls_h2, upstream='h2c = ["plain.test"]')
    body = b"7\r\npayload\r\n0\r\nx-digest: sha-256=2\r\nx-api-key: agent-key\r\n\r\n"
    answer = h1_exchange(
        proxy,
        f"POST http://plain.test:{raw.port}/echo-trailers HTTP/1.1\r\nHost: plain.test\r\n"
        "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n".encode()
        + body,
    )
    assert b" 200 " in answer.split(b"\r\n")[0]
    assert raw.request_trailers == [[(b"x-digest", b"sha-256=2")]]  # no credential field


def test_an_upstream_that_never_opens_its_window_stalls_one_request(start, nginx: Nginx) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE 0 and no WINDOW_UPDATE: the request body waits
    `h2_stall_timeout`, then its stream is reset and the agent reads a 502; the proxy goes on."""
    server = RawH2Server(window=0)
    try:
        proxy = start(nginx.tls_h2, upstream='h2c = ["plain.test"]', limits="h2_stall_timeout = 1")
        started = time.monotonic()
        done = curl(
            "-x",
            proxy.url,
            "-w",
            "\\n%{http_code}",
            "--data-binary",
            "x" * 100_000,
            f"http://plain.test:{server.port}/ok",
        )
        assert done.stdout.rpartition("\n")[2] == "502", done.stdout
        assert time.monotonic() - started < 10
        again = curl("-x", proxy.url, f"http://plain.test:{server.port}/ok")
        assert again.stdout == "ok:/ok"
    finally:
        server.close()
