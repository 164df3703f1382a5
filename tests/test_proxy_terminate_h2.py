"""HTTP/2 inside terminated CONNECT tunnels (docs/proxy.md "TLS termination"): the leaf's ALPN
offers h2 and http/1.1; an agent that selects h2 is served by the HTTP/2 session over the
tunnel's TLS, and every stream is planned as a request to the tunnel's host (injection, rules,
placeholders, scrubbing), an :authority naming another host refused on its own stream. Real
clients (httpx, curl, grpcio, the h2 library) on loopback; the crew trusts its own CA.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import pytest
import trustme
from websockets.sync.server import ServerConnection, serve
from wsproto.events import CloseConnection, TextMessage

from appliance.crew_ca import CrewCA
from appliance.demo_upstream import FakeServer
from proxycore.protocol.events import (
    CredentialInjected,
    RequestAllowed,
    RequestDenied,
    TunnelClosed,
    TunnelOpened,
)
from proxycore.protocol.exchange import RULE_TUNNEL_HOST
from tests.conftest import AGENT_DUMMY_KEY, REAL_KEYS, RunningProxy, leaf_toml
from tests.h2_ws_client import H2WsClient
from tests.test_proxy_grpc import Server, method, start_server

HOST = "api.anthropic.test"
KEY = REAL_KEYS["anthropic"]
ENABLE_CONNECT_PROTOCOL = 0x8


def _trusting(ca_file: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_file)


def _events(proxy: RunningProxy, count: int = 1) -> list[object]:
    """The proxy's events once `count` tunnels have closed (the journal is written as they do)."""
    deadline = time.monotonic() + 10
    while True:
        events = proxy.events()
        if len([e for e in events if isinstance(e, TunnelClosed)]) >= count:
            return events
        if time.monotonic() > deadline:
            return events
        time.sleep(0.05)


# -- ALPN -------------------------------------------------------------------------------------


def _connect_tls(proxy: RunningProxy, port: int, ca_file: str, alpn: list[str] | None):
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    sock.sendall(b"CONNECT %s:%d HTTP/1.1\r\nHost: x\r\n\r\n" % (HOST.encode(), port))
    assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    context = _trusting(ca_file)
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    return context.wrap_socket(sock, server_hostname=HOST)


def test_alpn_offers_h2_and_http1_and_http1_stays_as_it_was(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    for offered, chosen in (
        (["h2", "http/1.1"], "h2"),
        (["http/1.1", "h2"], "h2"),  # the server's order decides
        (["http/1.1"], "http/1.1"),
        (None, None),
    ):
        with _connect_tls(terminating, provider.port, crew_ca_file, offered) as tls:
            assert tls.selected_alpn_protocol() == chosen, offered
            if chosen == "h2":
                continue
            tls.sendall(b"GET /v1/models HTTP/1.1\r\nHost: %s\r\n\r\n" % HOST.encode())
            assert tls.recv(65536).startswith(b"HTTP/1.1 200 ")


# -- real clients -----------------------------------------------------------------------------


def test_httpx_http2_gets_the_key_injected_and_the_echo_scrubbed(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    with httpx.Client(
        proxy=terminating.url, verify=_trusting(crew_ca_file), http2=True, timeout=20
    ) as client:
        for _ in range(3):  # one tunnel, one HTTP/2 connection, three streams
            response = client.get(
                f"https://{HOST}:{provider.port}/v1/models",
                headers={"x-api-key": AGENT_DUMMY_KEY},
            )
            assert response.status_code == 200 and response.http_version == "HTTP/2"
            assert provider.last().all("x-api-key") == [KEY]
        for leak in ("error", "sse", "header"):
            response = client.post(
                f"https://{HOST}:{provider.port}/v1/messages",
                headers={"x-api-key": AGENT_DUMMY_KEY, "x-fake-leak": leak},
                json={},
            )
            assert response.http_version == "HTTP/2"
            seen = response.text + json.dumps(dict(response.headers))
            assert KEY not in seen and KEY[:20] not in seen, leak
            assert "[REDACTED:anthropic]" in seen, leak
    assert AGENT_DUMMY_KEY not in json.dumps([r.headers for r in provider.received])
    events = _events(terminating)
    assert [e for e in events if isinstance(e, CredentialInjected)]
    allowed = [e for e in events if isinstance(e, RequestAllowed)]
    assert [(e.route, e.method) for e in allowed] == [("tunnel", "CONNECT")] + [
        ("forward", "GET")
    ] * 3 + [("forward", "POST")] * 3
    assert all(e.host == HOST and e.port == provider.port for e in allowed[1:])
    # The tunnel brackets its streams: opened before the first, closed after the last.
    kinds = [type(e) for e in events if isinstance(e, TunnelOpened | TunnelClosed | RequestAllowed)]
    assert kinds[1] is TunnelOpened and kinds[-1] is TunnelClosed
    closed = [e for e in events if isinstance(e, TunnelClosed)][-1]
    assert closed.host == HOST and closed.reason == "closed" and closed.bytes_down > 1000


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "--noproxy", "", "--max-time", "20", *args],
        capture_output=True,
        text=True,
        timeout=25,
    )


def test_curl_http2_through_the_tunnel(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    result = curl(
        "--http2",
        "-x",
        terminating.url,
        "--cacert",
        crew_ca_file,
        "-w",
        "\\n%{http_version} %{http_code}",
        "-H",
        f"x-api-key: {AGENT_DUMMY_KEY}",
        "-H",
        "content-type: application/json",
        "-d",
        '{"model": "claude-fake", "max_tokens": 5, "messages": []}',
        f"https://{HOST}:{provider.port}/v1/messages",
    )
    body, _, status = result.stdout.rpartition("\n")
    assert status == "2 200", (result.stdout, result.stderr)
    assert json.loads(body)["type"] == "message"
    assert provider.last().all("x-api-key") == [KEY]


# -- several streams on one tunnel, with the h2 library ---------------------------------------


class TunnelH2:
    """An HTTP/2 client connection inside a terminated tunnel."""

    def __init__(
        self, proxy: RunningProxy, port: int, ca_file: str, *, window: int | None = None
    ) -> None:
        self.tls = _connect_tls(proxy, port, ca_file, ["h2"])
        assert self.tls.selected_alpn_protocol() == "h2"
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.h2.initiate_connection()
        if window is not None:  # windows wider than the socket buffers: the proxy's writes wait
            self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
            self.h2.increment_flow_control_window(window)
        self.tls.sendall(self.h2.data_to_send())
        self.authority = b"%s:%d" % (HOST.encode(), port)

    def request(
        self, stream_id: int, method: bytes, path: bytes, authority: bytes | None = None
    ) -> None:
        headers = [
            (b":method", method),
            (b":scheme", b"https"),
            (b":authority", authority or self.authority),
            (b":path", path),
            (b"x-api-key", AGENT_DUMMY_KEY.encode()),
        ]
        self.h2.send_headers(stream_id, headers, end_stream=True)
        self.tls.sendall(self.h2.data_to_send())

    def responses(self, stream_ids: set[int]) -> dict[int, tuple[int, bytes]]:
        status: dict[int, int] = {}
        bodies: dict[int, bytes] = {sid: b"" for sid in stream_ids}
        done: set[int] = set()
        while done != stream_ids:
            data = self.tls.recv(65536)
            assert data, f"connection closed with {stream_ids - done} open"
            for event in self.h2.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    status[event.stream_id] = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    bodies[event.stream_id] += event.data
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    done.add(event.stream_id)
            self.tls.sendall(self.h2.data_to_send())
        return {sid: (status.get(sid, 0), bodies[sid]) for sid in stream_ids}

    def close(self) -> None:
        self.h2.close_connection()
        self.tls.sendall(self.h2.data_to_send())
        self.tls.close()


def test_a_refused_stream_leaves_its_siblings_and_the_connection_alone(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    client = TunnelH2(terminating, provider.port, crew_ca_file)
    client.request(1, b"GET", b"/v1/models")
    client.request(3, b"DELETE", b"/v1/models")  # the rules allow GET and POST only
    client.request(5, b"GET", b"/v1/files")  # nor this path
    client.request(7, b"GET", b"/v1/models", authority=b"api.openai.test")  # fronting
    got = client.responses({1, 3, 5, 7})
    assert got[1][0] == 200
    assert got[3][0] == 403 and json.loads(got[3][1])["rule"] == "l7_method"
    assert got[5][0] == 403 and json.loads(got[5][1])["rule"] == "l7_path"
    assert got[7][0] == 403 and json.loads(got[7][1])["rule"] == RULE_TUNNEL_HOST
    # The connection goes on after the refusals.
    client.request(9, b"GET", b"/v1/models")
    assert client.responses({9})[9][0] == 200
    client.close()
    assert not [r for r in provider.received if r.method == "DELETE" or r.path == "/v1/files"]
    assert all(r.all("x-api-key") == [KEY] for r in provider.received)
    events = _events(terminating)
    denied = [e for e in events if isinstance(e, RequestDenied)]
    assert sorted((e.route, e.host, e.rule) for e in denied) == sorted(
        [
            ("forward", HOST, "l7_method"),
            ("forward", HOST, "l7_path"),
            ("forward", HOST, RULE_TUNNEL_HOST),
        ]
    )
    allowed = [e for e in events if isinstance(e, RequestAllowed) and e.route == "forward"]
    assert len(allowed) == 2
    assert [e.reason for e in events if isinstance(e, TunnelClosed)] == ["closed"]


# -- gRPC (grpcio over TLS through the proxy) ---------------------------------------------------


@pytest.fixture
def grpc_tls_server(ca: trustme.CA) -> Iterator[Server]:
    server = start_server(ca)  # a certificate for plain.test from the tests' CA
    yield server
    server.server.stop(grace=None)


def test_grpc_over_tls_is_served_per_rpc_inside_the_tunnel(
    make_proxy,
    crew_ca: CrewCA,
    tmp_path: Path,
    grpc_tls_server: Server,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """grpcio opens a CONNECT and speaks h2 over TLS in it (ALPN h2 is required by gRPC): with
    a leaf for the host, each RPC is a stream the proxy plans and forwards on its own (to the
    server over verified TLS), not bytes relayed blind."""
    for name in ("grpc_proxy", "https_proxy", "http_proxy", "no_grpc_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    proxy = make_proxy(allow=["plain.test"], extra=leaf_toml(crew_ca, tmp_path, "plain.test"))
    credentials = grpc.ssl_channel_credentials(root_certificates=crew_ca.cert_pem)
    options = [("grpc.http_proxy", proxy.url)]
    target = f"plain.test:{grpc_tls_server.port}"
    with grpc.secure_channel(target, credentials, options=options) as channel:
        call = method(channel, "unary_unary", "Unary")
        answer, state = call.with_call(b"hello", timeout=10, metadata=(("token", "tls"),))
        assert answer == b"hello" and state.code() == grpc.StatusCode.OK
        assert ("served-by", "echo") in state.trailing_metadata()
        stream = method(channel, "unary_stream", "Count")(b"300", timeout=20)
        assert list(stream) == [b"%d" % index for index in range(300)]
        chat = method(channel, "stream_stream", "Chat")(iter([b"a", b"b" * 100000]), timeout=20)
        assert list(chat) == [b"a", b"b" * 100000]
    events = _events(proxy)
    forwarded = [e for e in events if isinstance(e, RequestAllowed) and e.route == "forward"]
    assert [e.method for e in forwarded] == ["POST"] * 3
    assert all(e.host == "plain.test" and e.port == grpc_tls_server.port for e in forwarded)
    assert [e.reason for e in events if isinstance(e, TunnelClosed)] == ["closed"]
    assert "Traceback" not in proxy.stop()


# -- WebSocket over HTTP/2 (RFC 8441) inside the tunnel ----------------------------------------


class TunnelWsClient(H2WsClient):
    """tests/h2_ws_client.py's client over a terminated tunnel's TLS instead of h2c."""

    def __init__(self, proxy: RunningProxy, host: str, port: int, ca_file: str) -> None:
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        sock.sendall(b"CONNECT %s:%d HTTP/1.1\r\nHost: x\r\n\r\n" % (host.encode(), port))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        context = _trusting(ca_file)
        context.set_alpn_protocols(["h2"])
        self.sock = context.wrap_socket(sock, server_hostname=host)  # type: ignore[assignment]
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=True, header_encoding=None, validate_outbound_headers=False
            )
        )
        self.h2.initiate_connection()
        self.sock.sendall(self.h2.data_to_send())
        self.authority = b"%s:%d" % (host.encode(), port)
        self.streams = {}
        self.auto_ack = True
        self.closed = False
        self.settings = {}


def test_websocket_over_h2_inside_the_tunnel(
    make_proxy, ca: trustme.CA, crew_ca: CrewCA, crew_ca_file: str, tmp_path: Path
) -> None:
    seen: dict[str, object] = {}

    def echo(ws: ServerConnection) -> None:
        seen["path"] = ws.request.path
        seen["host"] = ws.request.headers.get("host")
        for message in ws:
            ws.send(message)

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("plain.test").configure_cert(context)
    server = serve(echo, "127.0.0.1", 0, ssl=context, max_size=None, ping_interval=None)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = int(server.socket.getsockname()[1])
    try:
        proxy = make_proxy(allow=["plain.test"], extra=leaf_toml(crew_ca, tmp_path, "plain.test"))
        with TunnelWsClient(proxy, "plain.test", port, crew_ca_file) as client:
            ws = client.websocket(1, "/chat?x=1", scheme=b"https")
            assert ws.accepted() == 200
            # RFC 8441 3: the server said it takes extended CONNECT, as on h2c.
            assert client.settings.get(ENABLE_CONNECT_PROTOCOL) == 1
            ws.send(TextMessage("over h2 in TLS"))
            assert ws.message() == "over h2 in TLS"
            # An :authority naming another host: refused on its own stream.
            fronted = client.websocket(3, "/chat", authority=b"other.test", scheme=b"https")
            assert fronted.accepted() == 403
            fronted.wait_over()
            assert json.loads(bytes(fronted.state.data))["rule"] == RULE_TUNNEL_HOST
            ws.send(TextMessage("still here"))
            assert ws.message() == "still here"
            ws.send(CloseConnection(code=1000))
            assert ws.close_event().code == 1000
            state = ws.wait_over()
            assert state.ended and state.reset is None
    finally:
        server.shutdown()
        thread.join(5)
    assert seen["path"] == "/chat?x=1" and seen["host"] == f"plain.test:{port}"
    events = _events(proxy)
    [session] = [e for e in events if isinstance(e, RequestAllowed) and e.status == 101]
    assert session.route == "forward" and session.host == "plain.test"
    assert session.websocket is not None and session.websocket.messages_up == 2
    denied = [e for e in events if isinstance(e, RequestDenied)]
    assert [(e.host, e.rule) for e in denied] == [("plain.test", RULE_TUNNEL_HOST)]
    assert [e.reason for e in events if isinstance(e, TunnelClosed)] == ["closed"]


def test_bulk_bytes_both_ways_on_concurrent_streams(
    make_proxy, provider: FakeServer, crew_ca: CrewCA, crew_ca_file: str, tmp_path: Path
) -> None:
    """Responses bigger than the windows and the socket buffers, on four streams at once: the
    session's writes wait for the agent (the TLS records a write could not finish go out whole
    and in order, or the agent's TLS would fail), and an upload is read as its window opens."""
    proxy = make_proxy(extra=leaf_toml(crew_ca, tmp_path, HOST))
    provider.clear()
    size = 3_000_000
    client = TunnelH2(proxy, provider.port, crew_ca_file, window=4 * size)
    for stream_id in (1, 3, 5, 7):
        client.request(stream_id, b"GET", b"/size?n=%d" % (size + stream_id))
    time.sleep(0.5)  # the proxy fills the socket buffers, and waits
    got = client.responses({1, 3, 5, 7})
    for stream_id in (1, 3, 5, 7):
        assert got[stream_id] == (200, b"x" * (size + stream_id))
    body = bytes(range(256)) * 8192  # 2 MiB up
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":authority", client.authority),
        (b":path", b"/v1/upload"),
        (b"content-length", b"%d" % len(body)),
    ]
    client.h2.send_headers(9, headers)
    view = memoryview(body)
    while view:
        window = min(client.h2.local_flow_control_window(9), client.h2.max_outbound_frame_size)
        if not window:
            for event in client.h2.receive_data(client.tls.recv(65536)):
                assert not isinstance(event, h2.events.StreamReset)
            continue
        client.h2.send_data(9, bytes(view[:window]), end_stream=len(view) <= window)
        client.tls.sendall(client.h2.data_to_send())
        view = view[window:]
    assert client.responses({9})[9][0] == 200
    client.close()
    upload = [r for r in provider.received if r.method == "POST"]
    assert upload and upload[-1].body == body
    closed = [e for e in _events(proxy) if isinstance(e, TunnelClosed)]
    assert closed[-1].bytes_down > 4 * size and closed[-1].bytes_up > len(body)
