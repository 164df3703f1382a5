"""WebSocket over HTTP/2 (RFC 8441 extended CONNECT) through a real proxy process.

The agent is tests/h2_ws_client.py (the `h2` package's client and wsproto's frames: no
mainstream Python client speaks RFC 8441); the upstreams are `websockets` servers on loopback
("plain.test" resolves to 127.0.0.1, the crew's `ssrf_allow` opens loopback), reached by the
proxy with the HTTP/1.1 Upgrade. Every test checks the journal: one terminal event per session
with its byte, frame and message counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import ServerConnection, serve
from wsproto.events import (
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    TextMessage,
)

from appliance.demo_upstream import FakeServer
from proxycore.protocol.events import (
    CredentialInjected,
    RequestAllowed,
    RequestDenied,
    RequestRefused,
)
from tests.conftest import (
    PROVIDER_NAMES,
    REAL_KEYS,
    RunningProxy,
    free_port,
    start_proxy,
    write_proxy_config,
)
from tests.h2_ws_client import H2WebSocket, H2WsClient

pytest.importorskip("h2")

ENABLE_CONNECT_PROTOCOL = 0x8
CANCEL, NO_ERROR = 0x8, 0x0
SHORT_LIMITS = """
[limits]
ws_idle_timeout = 1.5
ws_close_timeout = 1.0
ws_max_message_bytes = 1048576
"""

Handler = Callable[[ServerConnection], None]


def echo(ws: ServerConnection) -> None:
    for message in ws:
        ws.send(message)


@contextlib.contextmanager
def upstream(handler: Handler = echo, **kwargs: Any) -> Iterator[int]:
    """A `websockets` server on loopback running `handler` per connection; yields its port."""
    kwargs.setdefault("max_size", None)
    kwargs.setdefault("ping_interval", None)
    server = serve(handler, "127.0.0.1", kwargs.pop("port", 0), **kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.socket.getsockname()[1])
    finally:
        server.shutdown()
        thread.join(5)


def sessions(proxy: RunningProxy, count: int = 1) -> list[RequestAllowed]:
    """The sessions' terminal events (status 101), once `count` of them are in."""
    deadline = time.monotonic() + 10
    while True:
        found = [e for e in proxy.events() if isinstance(e, RequestAllowed) and e.status == 101]
        if len(found) >= count or time.monotonic() > deadline:
            return found


def closed_cleanly(ws: H2WebSocket, code: int = 1000) -> None:
    """The agent closes: its Close, the answer relayed back, END_STREAM from the proxy."""
    ws.send(CloseConnection(code=code))
    answer = ws.close_event()
    assert answer.code == code
    state = ws.wait_over()
    assert state.ended and state.reset is None, state
    ws.client.end(ws.sid)


@pytest.fixture
def ws_proxy(make_proxy) -> RunningProxy:
    return make_proxy(allow=["plain.test"], extra=SHORT_LIMITS)


def authority(port: int) -> bytes:
    return b"plain.test:%d" % port


# -- relaying -------------------------------------------------------------------------------------


def test_echo_text_and_binary_over_a_stream(ws_proxy: RunningProxy) -> None:
    seen: dict[str, Any] = {}

    def recording_echo(ws: ServerConnection) -> None:
        seen["path"] = ws.request.path
        seen["headers"] = dict(ws.request.headers)
        echo(ws)
        seen["close"] = (ws.close_code, ws.close_reason)

    with upstream(recording_echo) as port, H2WsClient(ws_proxy) as client:
        client.wait(lambda: ENABLE_CONNECT_PROTOCOL in client.settings, what="SETTINGS")
        assert client.settings[ENABLE_CONNECT_PROTOCOL] == 1  # RFC 8441 3
        ws = client.websocket(1, "/chat?room=1", authority(port))
        assert ws.accepted() == 200
        # RFC 8441 5: no Accept over HTTP/2, and no END_STREAM on the 200.
        assert b"sec-websocket-accept" not in ws.state.headers and not ws.state.over
        ws.send(TextMessage("hello, é and ✓"))
        assert ws.message() == "hello, é and ✓"
        ws.send(BytesMessage(b"\x00\xff" * 1000))
        assert ws.message() == b"\x00\xff" * 1000
        ws.send(Ping(b"are you there"))  # answered end to end
        assert isinstance(ws.next_event(), Pong)
        closed_cleanly(ws)
        time.sleep(0.3)

    assert seen["path"] == "/chat?room=1"
    # The HTTP/1.1 Upgrade upstream, with a key the proxy made (the agent sent none).
    assert seen["headers"]["upgrade"] == "websocket"
    assert len(seen["headers"]["sec-websocket-key"]) == 24
    assert "sec-websocket-extensions" not in seen["headers"]
    assert seen["close"] == (1000, "")
    [session] = sessions(ws_proxy)
    assert (session.route, session.method, session.host) == ("forward", "GET", "plain.test")
    assert session.ended == "complete" and session.complete
    text = len("hello, é and ✓".encode())
    assert session.bytes_up == session.bytes_down == text + 2000
    assert session.websocket is not None
    assert (session.websocket.messages_up, session.websocket.messages_down) == (2, 2)
    assert (session.websocket.frames_up, session.websocket.frames_down) == (4, 4)
    assert (session.websocket.closed_by, session.websocket.close_code) == ("agent", 1000)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_large_messages_and_backpressure_through_flow_control(ws_proxy: RunningProxy) -> None:
    """Up: a message of the size limit, sent within the proxy's windows. Down: an agent that
    stops acknowledging (its stream window closes) stalls the upstream, and the proxy does not
    buffer for it; opening the window again releases everything, in order and whole."""
    chunk = os.urandom(512 * 1024)
    total = 64  # 32 MiB
    sent = {"bytes": 0}
    big = os.urandom(1024 * 1024)

    def firehose(ws: ServerConnection) -> None:
        ws.send(ws.recv())  # the agent's big message, back
        ws.recv()
        for _ in range(total):
            ws.send(chunk)
            sent["bytes"] += len(chunk)
        ws.recv()

    with upstream(firehose) as port, H2WsClient(ws_proxy) as client:
        before = _rss_kib(ws_proxy.process.pid)
        ws = client.websocket(1, "/", authority(port))
        assert ws.accepted() == 200
        ws.send(BytesMessage(big))
        assert ws.message() == big
        client.auto_ack = False
        mark = len(ws.state.data)
        ws.send(TextMessage("go"))
        stalled_at = -1
        for _ in range(40):
            end = time.monotonic() + 0.25
            while time.monotonic() < end:
                client.pump(0.05)
            if sent["bytes"] == stalled_at:
                break
            stalled_at = sent["bytes"]
        assert sent["bytes"] == stalled_at, "the upstream never stalled"
        assert sent["bytes"] < 24 * 1024 * 1024
        # The proxy sent no more than the stream window the agent gave (65535, and what h2's
        # window manager had not yet given back of earlier data).
        assert len(ws.state.data) - mark <= 2 * 65535
        grown = _rss_kib(ws_proxy.process.pid) - before
        assert grown < 16 * 1024, f"the proxy grew by {grown} KiB"
        client.auto_ack = True
        client.ack(1)
        client.flush()
        for _ in range(total):
            assert ws.message(timeout=30) == chunk
        ws.send(TextMessage("done"))
        ws.close_event()
        ws.send(CloseConnection(code=1000))
        ws.wait_over()

    [session] = sessions(ws_proxy)
    assert session.bytes_down == len(big) + total * len(chunk)
    assert session.bytes_up == len(big) + len("go") + len("done")
    assert session.websocket is not None
    assert session.websocket.messages_down == 1 + total
    assert session.websocket.messages_up == 3
    # Each side's messages in one frame each, and the Closes.
    assert (session.websocket.frames_up, session.websocket.frames_down) == (4, total + 2)


def test_a_window_the_agent_keeps_closed_resets_the_stream(make_proxy) -> None:
    """A zero-window stall lasts `h2_stall_timeout` at most (1 s here): the stream is reset,
    the upstream told 1001, the session's event says why."""
    proxy = make_proxy(allow=["plain.test"], extra=SHORT_LIMITS + "h2_stall_timeout = 1.0\n")
    upstream_close: dict[str, Any] = {}
    chunk = os.urandom(256 * 1024)

    def firehose(ws: ServerConnection) -> None:
        ws.recv()
        with contextlib.suppress(ConnectionClosed):
            for _ in range(64):
                ws.send(chunk)
            ws.recv()
        upstream_close["code"] = ws.close_code

    with upstream(firehose) as port, H2WsClient(proxy, auto_ack=False) as client:
        ws = client.websocket(1, "/", authority(port))
        assert ws.accepted() == 200
        ws.send(TextMessage("go"))
        started = time.monotonic()
        state = ws.wait_over(timeout=10)
        assert state.reset == CANCEL and 1.0 <= time.monotonic() - started < 6.0
        time.sleep(0.5)

    assert upstream_close["code"] == 1001
    [session] = sessions(proxy)
    assert "send window stalled" in session.ended and not session.complete
    assert session.bytes_up == 2 and session.bytes_down < 2 * len(chunk)
    assert session.websocket is not None
    assert (session.websocket.messages_up, session.websocket.frames_up) == (1, 1)


def test_close_begun_by_the_upstream(ws_proxy: RunningProxy) -> None:
    def close_after_one(ws: ServerConnection) -> None:
        ws.send(ws.recv())
        ws.close(4001, "done here")

    with upstream(close_after_one) as port, H2WsClient(ws_proxy) as client:
        ws = client.websocket(1, "/", authority(port))
        assert ws.accepted() == 200
        ws.send(TextMessage("one"))
        assert ws.message() == "one"
        close = ws.close_event()
        assert (close.code, close.reason) == (4001, "done here")
        ws.send(close.response())  # the agent answers: the handshake completes
        state = ws.wait_over()
        assert state.ended and state.reset is None

    [session] = sessions(ws_proxy)
    assert session.ended == "complete"
    assert session.websocket is not None
    assert (session.websocket.closed_by, session.websocket.close_code) == ("upstream", 4001)
    assert (session.websocket.frames_up, session.websocket.frames_down) == (2, 2)
    assert (session.websocket.messages_up, session.websocket.messages_down) == (1, 1)
    assert session.bytes_up == session.bytes_down == 3


def test_idle_session_is_closed_and_the_stream_ended(ws_proxy: RunningProxy) -> None:
    upstream_close: dict[str, Any] = {}

    def record(ws: ServerConnection) -> None:
        echo(ws)
        upstream_close["close"] = (ws.close_code, ws.close_reason)

    with upstream(record) as port, H2WsClient(ws_proxy) as client:
        ws = client.websocket(1, "/", authority(port))
        assert ws.accepted() == 200
        ws.send(TextMessage("hi"))
        assert ws.message() == "hi"
        started = time.monotonic()
        close = ws.close_event(timeout=10)
        waited = time.monotonic() - started
        assert (close.code, close.reason) == (1001, "idle timeout")
        assert 1.0 <= waited < 4.0
        ws.send(close.response())
        state = ws.wait_over()
        assert state.ended and state.reset is None
        time.sleep(0.3)

    assert upstream_close["close"] == (1001, "idle timeout")
    [session] = sessions(ws_proxy)
    assert session.ended == "idle_timeout"
    assert session.websocket is not None and session.websocket.closed_by == "proxy"
    assert session.websocket.messages_up == session.websocket.messages_down == 1
    # "hi" and the answer to the proxy's Close, each way.
    assert session.websocket.frames_up == session.websocket.frames_down == 2
    assert session.bytes_up == session.bytes_down == 2


def test_oversized_message_is_refused_1009(ws_proxy: RunningProxy) -> None:
    upstream_close: dict[str, Any] = {}

    def record(ws: ServerConnection) -> None:
        try:
            echo(ws)  # the message's first fragments came, then 1001: a protocol error to it
        except ConnectionClosed:
            pass
        upstream_close["code"] = ws.close_code

    with upstream(record) as port, H2WsClient(ws_proxy) as client:
        ws = client.websocket(1, "/", authority(port))
        assert ws.accepted() == 200
        ws.send(BytesMessage(b"x" * (1024 * 1024 + 1)))
        close = ws.close_event()
        assert close.code == 1009
        # The agent's Close was sent: the stream ends in order (RFC 8441 5).
        state = ws.wait_over()
        assert state.ended and state.reset is None
        time.sleep(0.3)

    assert upstream_close["code"] == 1001
    [session] = sessions(ws_proxy)
    assert session.ended.startswith("message_too_big")
    assert session.websocket is not None
    assert (session.websocket.closed_by, session.websocket.close_code) == ("proxy", 1009)
    # Counted up to the byte over the limit: its one frame, no message relayed whole.
    assert session.bytes_up == 1024 * 1024 + 1
    assert (session.websocket.messages_up, session.websocket.frames_up) == (0, 1)


# -- refusals, injection and scrubbing -----------------------------------------------------------


def test_denied_stream_is_refused_while_its_siblings_are_served(
    ws_proxy: RunningProxy, plain_host: FakeServer
) -> None:
    """One connection: a session to a denied host is refused 403 on its stream, an ordinary
    GET and a session next to it are served."""
    with upstream() as port, H2WsClient(ws_proxy) as client:
        denied = client.websocket(1, "/", b"denied.test:%d" % port)
        get = client.get(3, "/reflect?text=sibling&pieces=3&delay=0.2", authority(plain_host.port))
        ws = client.websocket(5, "/", authority(port))
        assert denied.accepted() == 403
        denied.wait_over()
        body = json.loads(bytes(denied.state.data))
        assert body["error"] == "egress_denied" and body["rule"] == "not_in_allowlist"
        assert ws.accepted() == 200
        ws.send(TextMessage("still here"))
        assert ws.message() == "still here"
        client.wait(lambda: get.over, what="the GET")
        assert get.status == 200 and bytes(get.data) == b"sibling" and get.reset is None
        closed_cleanly(ws)

    events = ws_proxy.events()
    denials = [e for e in events if isinstance(e, RequestDenied)]
    assert [(e.host, e.method, e.rule) for e in denials] == [
        ("denied.test", "GET", "not_in_allowlist")
    ]
    allowed = [e for e in events if isinstance(e, RequestAllowed) and e.status == 200]
    assert [e.host for e in allowed] == ["plain.test"]
    [session] = sessions(ws_proxy)
    assert session.ended == "complete" and session.websocket is not None
    assert session.websocket.messages_up == session.websocket.messages_down == 1
    assert session.bytes_up == session.bytes_down == len("still here")


@pytest.fixture
def provider_ws(tmp_path: Path, ca: trustme.CA, ca_file: str):
    """A proxy whose providers' base URLs point at a port for a TLS websockets server."""
    port = free_port()
    proxy_port = free_port()
    config, events, _ = write_proxy_config(
        tmp_path, port=proxy_port, provider_port=port, ca_file=ca_file, allow=[]
    )
    proxy = start_proxy(config, host="127.0.0.1", port=proxy_port, events=events)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*PROVIDER_NAMES, "127.0.0.1").configure_cert(context)
    yield proxy, port, context
    proxy.stop()


def test_provider_route_injects_on_the_handshake_and_scrubs_frames(provider_ws) -> None:
    """`/openai/realtime` on the gateway: verified TLS to the provider, the appliance's key on
    the handshake instead of the agent's, and the key echoed back in text frames (whole and
    split across fragments) reaches the agent redacted."""
    proxy, port, context = provider_ws
    key = REAL_KEYS["openai"]
    seen: dict[str, Any] = {}

    def realtime(ws: ServerConnection) -> None:
        seen["path"] = ws.request.path
        seen["authorization"] = ws.request.headers.get_all("authorization")
        ws.send(f"you sent {ws.request.headers['authorization']}")
        ws.send([f"split: {key[:5]}", key[5:9], key[9:]])
        echo(ws)

    with (
        upstream(realtime, port=port, ssl=context),
        H2WsClient(proxy) as client,
    ):
        ws = client.websocket(
            1,
            "/openai/realtime?model=m",
            extra=[(b"authorization", b"Bearer sk-agent-dummy")],
        )
        assert ws.accepted() == 200
        assert ws.message() == "you sent Bearer [REDACTED:openai]"
        assert ws.message() == "split: [REDACTED:openai]"
        ws.send(TextMessage("ping"))
        assert ws.message() == "ping"
        closed_cleanly(ws)

    assert seen["path"] == "/v1/realtime?model=m"
    assert seen["authorization"] == [f"Bearer {key}"]
    events = proxy.events()
    assert [e.provider for e in events if isinstance(e, CredentialInjected)] == ["openai"]
    [session] = sessions(proxy)
    assert session.route == "reverse" and session.rule == "provider"
    assert session.host == "api.openai.test" and session.redactions == 2
    assert session.websocket is not None
    assert (session.websocket.messages_up, session.websocket.messages_down) == (1, 3)


# -- the agent's side ending, and hostile input -------------------------------------------------


def test_agent_reset_ends_its_session_only(ws_proxy: RunningProxy, plain_host: FakeServer) -> None:
    upstream_closes: list[int | None] = []

    def record(ws: ServerConnection) -> None:
        echo(ws)
        upstream_closes.append(ws.close_code)

    with upstream(record) as port, H2WsClient(ws_proxy) as client:
        ws = client.websocket(1, "/", authority(port))
        assert ws.accepted() == 200
        ws.send(TextMessage("one"))
        assert ws.message() == "one"
        get = client.get(3, "/reflect?text=sibling&pieces=3&delay=0.2", authority(plain_host.port))
        client.reset(1, CANCEL)
        client.wait(lambda: get.over, what="the GET")
        assert get.status == 200 and bytes(get.data) == b"sibling" and get.reset is None
        # The connection serves a new session.
        again = client.websocket(5, "/", authority(port))
        assert again.accepted() == 200
        again.send(TextMessage("two"))
        assert again.message() == "two"
        closed_cleanly(again)
        time.sleep(0.3)

    assert sorted(upstream_closes, key=str) == [1000, 1001]
    first, second = sessions(ws_proxy, 2)
    assert first.ended.startswith("agent_reset") and not first.complete
    assert first.websocket is not None and first.websocket.closed_by == "agent"
    assert first.websocket.messages_up == first.websocket.messages_down == 1
    assert first.bytes_up == first.bytes_down == 3
    assert second.ended == "complete" and second.websocket is not None
    assert second.websocket.messages_up == 1 and second.bytes_down == 3


def test_end_stream_mid_message_is_a_lost_agent(ws_proxy: RunningProxy) -> None:
    """END_STREAM inside a message: the agent's side ended without a Close (a FIN mid-message,
    RFC 8441 5); the upstream is told 1001 and the stream is reset, not ended in order."""
    upstream_close: dict[str, Any] = {}

    def record(ws: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):
            echo(ws)
        upstream_close["code"] = ws.close_code

    with upstream(record) as port, H2WsClient(ws_proxy) as client:
        ws = client.websocket(1, "/", authority(port))
        assert ws.accepted() == 200
        client.send_data(1, ws.ws.send(TextMessage("half a messa", message_finished=False)))
        client.end(1)
        state = ws.wait_over()
        assert state.reset == CANCEL
        time.sleep(0.3)

    assert upstream_close["code"] == 1001
    [session] = sessions(ws_proxy)
    assert session.ended == "agent_closed"
    assert session.websocket is not None and session.websocket.closed_by == "agent"
    # The first fragment of the message went up; the message never finished.
    assert session.bytes_up == len("half a messa") and session.bytes_down == 0
    assert (session.websocket.frames_up, session.websocket.messages_up) == (1, 0)


def test_data_before_the_200_is_relayed_after_it(ws_proxy: RunningProxy) -> None:
    """Frames the agent sends before it has the 200 wait within the stream window and are
    relayed once the session is up; on a refused handshake they go with the stream."""
    with upstream() as port, H2WsClient(ws_proxy) as client:
        ws = client.websocket(1, "/", authority(port))
        ws.send(TextMessage("early"))  # before the 200 arrived
        assert ws.accepted() == 200
        assert ws.message() == "early"
        refused = client.websocket(3, "/", b"denied.test:%d" % port)
        refused.send(TextMessage("never relayed"))
        assert refused.accepted() == 403
        state = refused.wait_over()
        assert state.ended
        closed_cleanly(ws)

    [session] = sessions(ws_proxy)
    assert session.bytes_up == len("early") and session.ended == "complete"
    assert session.websocket is not None
    assert session.websocket.messages_up == session.websocket.messages_down == 1
    denied = [e for e in ws_proxy.events() if isinstance(e, RequestDenied)]
    assert [e.host for e in denied] == ["denied.test"]


def test_hostile_extended_connects_are_refused_on_their_stream(ws_proxy: RunningProxy) -> None:
    """Each refused readably on its own stream; the connection serves a session after them."""

    def refusal(state: Any) -> tuple[int, str]:
        return state.status, json.loads(bytes(state.data))["message"]

    with upstream() as port, H2WsClient(ws_proxy) as client:
        target = authority(port)
        unknown = client.websocket(1, "/", target, protocol=b"webtransport")
        no_version = client.websocket(3, "/", target, version=None)
        bad_version = client.websocket(5, "/", target, version=b"8")
        # CONNECT with :scheme and :path but no :protocol (RFC 9113 8.5: malformed).
        plain = client.request(
            7,
            [
                (b":method", b"CONNECT"),
                (b":scheme", b"http"),
                (b":authority", target),
                (b":path", b"/"),
            ],
        )
        # :protocol on a GET (RFC 8441 4: CONNECT only).
        on_get = client.request(
            9,
            [
                (b":method", b"GET"),
                (b":protocol", b"websocket"),
                (b":scheme", b"http"),
                (b":authority", target),
                (b":path", b"/"),
            ],
        )
        no_authority = client.request(
            11,
            [
                (b":method", b"CONNECT"),
                (b":protocol", b"websocket"),
                (b":scheme", b"http"),
                (b":path", b"/"),
                (b"sec-websocket-version", b"13"),
            ],
        )
        secure = client.websocket(13, "/", target, scheme=b"https")
        keyed = client.websocket(
            15, "/", target, extra=[(b"sec-websocket-key", b"dGhlIHNhbXBsZSBub25jZQ==")]
        )
        for ws in (unknown, no_version, bad_version, secure):
            ws.wait_over()
        for state in (plain, on_get, no_authority):
            client.wait(lambda s=state: s.over, what="a refusal")
        status, message = refusal(unknown.state)
        assert status == 501 and "webtransport" in message
        status, message = refusal(no_version.state)
        assert status == 400 and "Sec-WebSocket-Version must be 13" in message
        status, message = refusal(bad_version.state)
        assert status == 400 and "Sec-WebSocket-Version must be 13" in message
        status, message = refusal(plain)
        assert status == 400 and "CONNECT with :scheme or :path" in message
        status, message = refusal(on_get)
        assert status == 400 and ":protocol" in message
        status, message = refusal(no_authority)
        assert status == 400 and ":authority" in message
        # wss: the agent's client tunnels it (CONNECT over HTTP/1.1), as on HTTP/1.1.
        status, message = refusal(secure.state)
        assert status == 400 and "https:// targets must use CONNECT" in message
        # A key the agent sent anyway is not the one used (RFC 8441 5): the session works.
        assert keyed.accepted() == 200
        keyed.send(TextMessage("fine"))
        assert keyed.message() == "fine"
        closed_cleanly(keyed)

    events = ws_proxy.events()
    refused = sorted(e.status for e in events if isinstance(e, RequestRefused))
    assert refused == [400, 400, 400, 400, 400, 400, 501]
    [session] = sessions(ws_proxy)
    assert session.ended == "complete" and session.websocket is not None
    assert session.websocket.messages_up == session.websocket.messages_down == 1
    assert session.bytes_up == session.bytes_down == len("fine")


# -- another HTTP/2 implementation ----------------------------------------------------------------


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_nodes_http2_client_speaks_extended_connect_to_the_proxy(ws_proxy: RunningProxy) -> None:
    """Node's own http2 client (nghttp2): it sends `:protocol` only once the proxy's SETTINGS
    allow it; the WebSocket frames are written by hand in tests/node_ws_h2.js."""
    with upstream() as port:
        done = subprocess.run(
            [
                "node",
                str(Path(__file__).with_name("node_ws_h2.js")),
                ws_proxy.url,
                f"plain.test:{port}",
                "/node",
                "hello from node",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 0, (done.stdout, done.stderr)
    out = json.loads(done.stdout)
    assert out["enableConnectProtocol"] is True and out["status"] == 200
    assert out["echo"] == "hello from node" and out["close"] == 1000
    assert out["ended"] and out["rstCode"] == 0  # END_STREAM, no reset (RFC 8441 5)
    [session] = sessions(ws_proxy)
    assert session.ended == "complete" and session.websocket is not None
    assert session.bytes_up == session.bytes_down == len("hello from node")
    assert (session.websocket.messages_up, session.websocket.frames_up) == (1, 2)
