"""gRPC through the proxy with a real `grpcio` client and server.

grpcio's client, given an HTTP proxy (the `grpc.http_proxy` channel argument, or the
`grpc_proxy` / `https_proxy` / `http_proxy` variables), opens a CONNECT tunnel to the target
and speaks HTTP/2 inside it: h2c (prior knowledge) on an insecure channel, h2 over TLS on a
secure one. So gRPC reaches its server through the proxy's tunnel path, where the proxy sees
the CONNECT (policy, SSRF guard, journal) and relays the bytes without reading them.

Pointed at the proxy itself with the target in :authority (`grpc.default_authority`), grpcio
speaks h2c to the proxy and each RPC is a stream the proxy checks and forwards on its own, over
HTTP/2 to the server (`test_per_rpc_*`): policy and an event per RPC, trailers relayed.

A real proxy process (tests/conftest.py, a restricted crew that may reach "plain.test", which
resolves to 127.0.0.1; its `ssrf_allow` opens loopback), grpcio servers on loopback (insecure,
and TLS with a certificate for plain.test from the tests' throw-away CA), and a client channel
per test. The service is written with grpc's generic handlers on raw bytes: the wire is what
generated stubs produce (length-prefixed messages in DATA frames, status in trailers), with no
generated code.
"""

from __future__ import annotations

import hashlib
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import trustme

from proxycore.protocol.events import (
    RequestAllowed,
    RequestDenied,
    RequestErrored,
    RequestRefused,
    TunnelClosed,
    TunnelOpened,
)
from tests.conftest import REAL_KEYS, RunningProxy

SERVICE = "appliance.test.Echo"
BIG = 4 * 1024 * 1024  # 4 MiB: grpcio's default receive limit, raised on both ends below
MESSAGE_LIMIT = 16 * 1024 * 1024
OPTIONS = [
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
]
# The server lets clients ping as often as test_silent_stream_... asks (its default answers a
# ping more often than every 5 minutes without data with GOAWAY "too_many_pings").
SERVER_OPTIONS = [
    *OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 100),
    ("grpc.http2.max_ping_strikes", 0),
]


@dataclass
class Seen:
    """What the server's handlers observed, keyed by the client's `token` metadata."""

    served: set[str] = field(default_factory=set)
    ended: dict[str, str] = field(default_factory=dict)
    remaining: dict[str, float] = field(default_factory=dict)
    done: dict[str, threading.Event] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def event(self, token: str) -> threading.Event:
        with self.lock:
            return self.done.setdefault(token, threading.Event())


def token_of(context: grpc.ServicerContext) -> str:
    return dict(context.invocation_metadata()).get("token", "")


class Echo:
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def unary(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self.seen.served.add(token_of(context))
        context.set_trailing_metadata((("served-by", "echo"),))
        return request

    def abort(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        code_name, _, details = request.decode().partition(":")
        context.set_trailing_metadata((("why", "asked-for"),))
        context.abort(grpc.StatusCode[code_name], details)
        raise AssertionError("abort returns only by raising")

    def count(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for index in range(int(request)):
            yield b"%d" % index

    def digest(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        total = hashlib.sha256()
        count = 0
        for message in requests:
            total.update(message)
            count += 1
        return b"%d:%s" % (count, total.hexdigest().encode())

    def chat(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from requests

    def hang(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Waits for the RPC to end from outside (deadline or cancellation); records how."""
        token = token_of(context)
        done = self.seen.event(token)
        if not context.add_callback(done.set):  # the RPC has ended already
            done.set()
        remaining = context.time_remaining()
        self.seen.remaining[token] = -1.0 if remaining is None else remaining
        done.wait(30)
        self.seen.ended[token] = "inactive" if not context.is_active() else "active"
        return b""

    def drip(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Streams slowly until the client goes away; records that it did (also when grpc
        abandons the generator at a send that failed, and closes it)."""
        token = token_of(context)
        done = self.seen.event(token)
        if not context.add_callback(done.set):
            done.set()
        try:
            for index in range(300):
                if not context.is_active():
                    break
                yield b"drip %d" % index
                time.sleep(0.1)
        finally:
            self.seen.ended[token] = "inactive" if not context.is_active() else "ran out"

    def pause(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """One message, silence for `request` seconds, another."""
        yield b"before"
        time.sleep(float(request))
        yield b"after"


def service(seen: Seen) -> grpc.GenericRpcHandler:
    echo = Echo(seen)
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(echo.unary),
            "Abort": grpc.unary_unary_rpc_method_handler(echo.abort),
            "Count": grpc.unary_stream_rpc_method_handler(echo.count),
            "Digest": grpc.stream_unary_rpc_method_handler(echo.digest),
            "Chat": grpc.stream_stream_rpc_method_handler(echo.chat),
            "Hang": grpc.unary_unary_rpc_method_handler(echo.hang),
            "Drip": grpc.unary_stream_rpc_method_handler(echo.drip),
            "Pause": grpc.unary_stream_rpc_method_handler(echo.pause),
        },
    )


@dataclass
class Server:
    port: int
    seen: Seen
    root: bytes | None  # the CA a client trusts (TLS), None for h2c
    server: grpc.Server

    def channel(
        self,
        proxy: RunningProxy | None,
        host: str = "plain.test",
        extra: list[tuple[str, int]] | None = None,
    ) -> grpc.Channel:
        options: list[tuple[str, object]] = [*OPTIONS, *(extra or [])]
        if proxy is not None:
            options.append(("grpc.http_proxy", proxy.url))
        target = f"{host}:{self.port}"
        if self.root is None:
            return grpc.insecure_channel(target, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.root)
        return grpc.secure_channel(target, credentials, options=options)


def start_server(ca: trustme.CA | None) -> Server:
    seen = Seen()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64),
        handlers=[service(seen)],
        options=SERVER_OPTIONS,
        maximum_concurrent_rpcs=None,
    )
    if ca is None:
        port = server.add_insecure_port("127.0.0.1:0")
        root = None
    else:
        cert = ca.issue_cert("plain.test", "other.test")
        credentials = grpc.ssl_server_credentials(
            [(cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes())]
        )
        port = server.add_secure_port("127.0.0.1:0", credentials)
        root = ca.cert_pem.bytes()
    server.start()
    return Server(port, seen, root, server)


@pytest.fixture(scope="module", params=["h2c", "tls"])
def upstream(request: pytest.FixtureRequest, ca: trustme.CA) -> Iterator[Server]:
    server = start_server(ca if request.param == "tls" else None)
    yield server
    server.server.stop(grace=None)


@pytest.fixture
def grpc_proxy(make_proxy) -> RunningProxy:
    return make_proxy(allow=["plain.test"])


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the channel argument names a proxy: a variable inherited from the machine must not
    add one (or exempt loopback)."""
    for name in ("grpc_proxy", "https_proxy", "http_proxy", "no_grpc_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def method(channel: grpc.Channel, kind: str, name: str) -> Any:
    return getattr(channel, kind)(f"/{SERVICE}/{name}")


def tunnels(proxy: RunningProxy, port: int, count: int) -> list[object]:
    """The proxy's events for tunnels to `port`, once `count` tunnels have closed."""
    deadline = time.monotonic() + 10
    while True:
        events = [e for e in proxy.events() if getattr(e, "port", None) == port]
        closed = [e for e in events if isinstance(e, TunnelClosed)]
        if len(closed) >= count or time.monotonic() > deadline:
            return events


def wait_for(probe: Callable[[], object], timeout: float = 5.0) -> object:
    deadline = time.monotonic() + timeout
    while not (value := probe()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def only(events: list[object], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def assert_one_tunnel(events: list[object], *, up: int = 1, down: int = 1) -> TunnelClosed:
    """One CONNECT allowed, one tunnel opened and closed, at least `up` / `down` bytes each way."""
    allowed = only(events, RequestAllowed)
    assert [(e.route, e.method, e.host, e.status) for e in allowed] == [
        ("tunnel", "CONNECT", "plain.test", 200)
    ]
    assert len(only(events, TunnelOpened)) == 1
    (closed,) = only(events, TunnelClosed)
    assert closed.reason == "closed"
    assert closed.bytes_up >= up and closed.bytes_down >= down
    return closed


# -- the four RPC shapes --------------------------------------------------------------------------


def test_unary_with_trailers(grpc_proxy: RunningProxy, upstream: Server) -> None:
    with upstream.channel(grpc_proxy) as channel:
        call = method(channel, "unary_unary", "Unary")
        answer, state = call.with_call(b"hello", timeout=10, metadata=(("token", "unary"),))
        assert answer == b"hello"
        assert state.code() == grpc.StatusCode.OK
        # Trailers (grpc-status and the handler's own) came back through the tunnel.
        assert ("served-by", "echo") in state.trailing_metadata()
    assert_one_tunnel(tunnels(grpc_proxy, upstream.port, 1))


def test_server_streaming(grpc_proxy: RunningProxy, upstream: Server) -> None:
    with upstream.channel(grpc_proxy) as channel:
        stream = method(channel, "unary_stream", "Count")(b"1000", timeout=20)
        assert list(stream) == [b"%d" % index for index in range(1000)]
        assert stream.code() == grpc.StatusCode.OK
    assert_one_tunnel(tunnels(grpc_proxy, upstream.port, 1))


def test_client_streaming(grpc_proxy: RunningProxy, upstream: Server) -> None:
    messages = [b"message %d" % index for index in range(1000)] + [os.urandom(BIG)]
    expected = hashlib.sha256(b"".join(messages)).hexdigest().encode()
    with upstream.channel(grpc_proxy) as channel:
        answer = method(channel, "stream_unary", "Digest")(iter(messages), timeout=30)
    assert answer == b"1001:" + expected
    assert_one_tunnel(tunnels(grpc_proxy, upstream.port, 1), up=BIG)


def test_bidirectional_ping_pong_and_a_big_message(
    grpc_proxy: RunningProxy, upstream: Server
) -> None:
    """1,000 messages each way, each sent only once the previous one came back (a proxy that
    held bytes back would stall it), then 4 MiB each way in the same stream."""
    outbox: queue.Queue[bytes | None] = queue.Queue()
    big = os.urandom(BIG)

    def requests() -> Iterator[bytes]:
        while (message := outbox.get(timeout=20)) is not None:
            yield message

    with upstream.channel(grpc_proxy) as channel:
        replies = method(channel, "stream_stream", "Chat")(requests(), timeout=60)
        for index in range(1000):
            outbox.put(b"ping %d" % index)
            assert next(replies) == b"ping %d" % index
        outbox.put(big)
        assert hashlib.sha256(next(replies)).digest() == hashlib.sha256(big).digest()
        outbox.put(None)
        assert list(replies) == []
        assert replies.code() == grpc.StatusCode.OK
    assert_one_tunnel(tunnels(grpc_proxy, upstream.port, 1), up=BIG, down=BIG)


# -- status, deadlines, cancellation --------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.PERMISSION_DENIED, "no entry"),
        (grpc.StatusCode.NOT_FOUND, "café ✓ 100% gone"),  # grpc-message is percent-encoded
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "quota"),
        (grpc.StatusCode.INVALID_ARGUMENT, "bad field"),
    ],
    ids=lambda value: getattr(value, "name", "details"),
)
def test_status_and_details_in_trailers(
    grpc_proxy: RunningProxy, upstream: Server, code: grpc.StatusCode, details: str
) -> None:
    with upstream.channel(grpc_proxy) as channel:
        call = method(channel, "unary_unary", "Abort")
        with pytest.raises(grpc.RpcError) as caught:
            call(f"{code.name}:{details}".encode(), timeout=10)
    assert caught.value.code() == code
    assert caught.value.details() == details
    assert ("why", "asked-for") in caught.value.trailing_metadata()
    assert_one_tunnel(tunnels(grpc_proxy, upstream.port, 1))


def test_deadline_exceeded_reaches_both_ends(grpc_proxy: RunningProxy, upstream: Server) -> None:
    token = f"deadline-{upstream.port}"
    with upstream.channel(grpc_proxy) as channel:
        call = method(channel, "unary_unary", "Hang")
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            call(b"", timeout=0.5, metadata=(("token", token),))
        took = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert took < 5
    # The deadline travelled (grpc-timeout) and the server's RPC ended with it.
    assert upstream.seen.event(token).wait(5)
    assert 0 < upstream.seen.remaining[token] <= 0.5
    assert wait_for(lambda: upstream.seen.ended.get(token)) == "inactive"


def test_cancellation_from_the_client_reaches_the_server(
    grpc_proxy: RunningProxy, upstream: Server
) -> None:
    stream_token, unary_token = f"drip-{upstream.port}", f"hang-{upstream.port}"
    with upstream.channel(grpc_proxy) as channel:
        drip = method(channel, "unary_stream", "Drip")(
            b"", timeout=30, metadata=(("token", stream_token),)
        )
        assert [next(drip) for _ in range(3)] == [b"drip 0", b"drip 1", b"drip 2"]
        drip.cancel()
        with pytest.raises(grpc.RpcError) as caught:
            list(drip)
        assert caught.value.code() == grpc.StatusCode.CANCELLED

        hang = method(channel, "unary_unary", "Hang").future(
            b"", timeout=30, metadata=(("token", unary_token),)
        )
        assert wait_for(lambda: unary_token in upstream.seen.remaining)
        assert hang.cancel()
        # The server saw both RPCs end (RST_STREAM through the tunnel), well before their
        # deadlines.
        assert upstream.seen.event(stream_token).wait(5)
        assert upstream.seen.event(unary_token).wait(5)
        assert wait_for(lambda: upstream.seen.ended.get(stream_token)) == "inactive"
        assert wait_for(lambda: upstream.seen.ended.get(unary_token)) == "inactive"
        # The channel (and its tunnel) carries on.
        assert method(channel, "unary_unary", "Unary")(b"after", timeout=10) == b"after"
    assert_one_tunnel(tunnels(grpc_proxy, upstream.port, 1))


def test_many_concurrent_rpcs_share_one_tunnel(grpc_proxy: RunningProxy, upstream: Server) -> None:
    with upstream.channel(grpc_proxy) as channel:
        unary = method(channel, "unary_unary", "Unary")
        count = method(channel, "unary_stream", "Count")
        calls = [unary.future(b"call %d" % index, timeout=30) for index in range(300)]
        streams = [count(b"50", timeout=30) for _ in range(20)]
        assert [call.result() for call in calls] == [b"call %d" % index for index in range(300)]
        for stream in streams:
            assert list(stream) == [b"%d" % index for index in range(50)]
    assert_one_tunnel(tunnels(grpc_proxy, upstream.port, 1))


# -- policy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("crew", "host", "rule"),
    [
        ({"allow": ["plain.test"]}, "other.test", "not_in_allowlist"),
        # Loopback is opened only by a range the crew names: here it names none.
        ({"allow": ["plain.test"], "ssrf_allow": []}, "plain.test", "ssrf_loopback"),
        ({"mode": "none"}, "plain.test", "mode_none"),
    ],
    ids=["not_allowlisted", "ssrf_guard", "mode_none"],
)
def test_refused_connect_is_unavailable(
    make_proxy, upstream: Server, crew: dict[str, object], host: str, rule: str
) -> None:
    proxy = make_proxy(**crew)
    with upstream.channel(proxy, host=host) as channel:
        call = method(channel, "unary_unary", "Unary")
        with pytest.raises(grpc.RpcError) as caught:
            call(b"hello", timeout=10)
    # grpcio reads the status line of the CONNECT's answer and nothing more: the proxy's JSON
    # body, which says why, does not reach the application; the journal has it.
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "HTTP proxy returned response code 403" in caught.value.details()
    events = [e for e in proxy.events() if getattr(e, "port", None) == upstream.port]
    denied = only(events, RequestDenied)
    assert denied
    assert {(e.route, e.method, e.host, e.status, e.rule) for e in denied} == {
        ("tunnel", "CONNECT", host, 403, rule)
    }
    assert not only(events, TunnelOpened) and not only(events, RequestAllowed)


# -- the tunnel's idle timeout --------------------------------------------------------------------


@pytest.fixture(scope="module")
def h2c_upstream() -> Iterator[Server]:
    server = start_server(None)
    yield server
    server.server.stop(grace=None)


def test_silent_stream_needs_keepalive_under_the_tunnel_idle_timeout(
    make_proxy, h2c_upstream: Server
) -> None:
    """A tunnel silent both ways for `tunnel_idle_timeout` is closed, a gRPC stream in it
    included; grpcio's keepalive pings (HTTP/2 PING frames) are bytes, so they keep it open.
    (grpcio sends a ping at most once a second whatever it is asked: hence 2 s here.)"""
    upstream = h2c_upstream
    proxy = make_proxy(allow=["plain.test"], extra="[limits]\ntunnel_idle_timeout = 2.0\n")
    with upstream.channel(proxy) as channel:
        pause = method(channel, "unary_stream", "Pause")(b"2.5", timeout=20)
        assert next(pause) == b"before"
        with pytest.raises(grpc.RpcError) as caught:
            list(pause)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    keepalive = [
        ("grpc.keepalive_time_ms", 500),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    with upstream.channel(proxy, extra=keepalive) as channel:
        pause = method(channel, "unary_stream", "Pause")(b"2.5", timeout=20)
        assert list(pause) == [b"before", b"after"]
    closed = only(tunnels(proxy, upstream.port, 2), TunnelClosed)
    assert sorted(e.reason for e in closed) == ["closed", "idle_timeout"]


@pytest.mark.parametrize("variable", ["grpc_proxy", "https_proxy", "http_proxy"])
def test_proxy_from_the_environment(
    grpc_proxy: RunningProxy,
    h2c_upstream: Server,
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
) -> None:
    """What an agent's environment sets (no channel argument): grpcio tunnels the same way."""
    monkeypatch.setenv(variable, grpc_proxy.url)
    with h2c_upstream.channel(None) as channel:
        assert method(channel, "unary_unary", "Unary")(b"env", timeout=10) == b"env"
    assert_one_tunnel(tunnels(grpc_proxy, h2c_upstream.port, 1))


# -- without CONNECT ------------------------------------------------------------------------------


def direct_channel(proxy: RunningProxy, server: Server, host: str = "plain.test") -> grpc.Channel:
    """A channel to the proxy itself naming the target in :authority (`grpc.default_authority`,
    how an HTTP/2 request names a proxy's target): h2c with prior knowledge to the proxy, each
    RPC one stream the proxy checks and forwards as a request of its own (no tunnel)."""
    options = [*OPTIONS, ("grpc.default_authority", f"{host}:{server.port}")]
    return grpc.insecure_channel(f"127.0.0.1:{proxy.port}", options=options)


def forwarded(proxy: RunningProxy, count: int) -> list[Any]:
    """The journal's terminal events of forwarded RPCs, once `count` have arrived."""
    deadline = time.monotonic() + 10
    while True:
        events = [
            e
            for e in proxy.events()
            if isinstance(e, RequestAllowed | RequestDenied | RequestRefused | RequestErrored)
            and e.route == "forward"
        ]
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def test_per_rpc_unary_with_trailing_metadata(
    grpc_proxy: RunningProxy, h2c_upstream: Server
) -> None:
    token = f"per-rpc-unary-{h2c_upstream.port}"
    with direct_channel(grpc_proxy, h2c_upstream) as channel:
        call = method(channel, "unary_unary", "Unary")
        reply, state = call.with_call(b"hello", timeout=10, metadata=(("token", token),))
    assert reply == b"hello"
    assert state.code() == grpc.StatusCode.OK
    assert ("served-by", "echo") in state.trailing_metadata()
    assert token in h2c_upstream.seen.served
    [event] = forwarded(grpc_proxy, 1)
    assert isinstance(event, RequestAllowed) and event.complete and event.status == 200
    assert event.host == "plain.test" and event.port == h2c_upstream.port
    assert not only(grpc_proxy.events(), TunnelOpened)


def test_per_rpc_streaming_shapes(grpc_proxy: RunningProxy, h2c_upstream: Server) -> None:
    with direct_channel(grpc_proxy, h2c_upstream) as channel:
        count = method(channel, "unary_stream", "Count")
        assert list(count(b"5", timeout=10)) == [b"0", b"1", b"2", b"3", b"4"]
        digest = method(channel, "stream_unary", "Digest")
        parts = [os.urandom(1000) for _ in range(20)]
        reply = digest(iter(parts), timeout=10)
        assert reply == b"20:" + hashlib.sha256(b"".join(parts)).hexdigest().encode()
        chat = method(channel, "stream_stream", "Chat")
        messages = [b"m%d" % i for i in range(10)]
        assert list(chat(iter(messages), timeout=10)) == messages
    events = forwarded(grpc_proxy, 3)
    assert len(events) == 3 and all(isinstance(e, RequestAllowed) and e.complete for e in events)


def test_per_rpc_status_and_details(grpc_proxy: RunningProxy, h2c_upstream: Server) -> None:
    with direct_channel(grpc_proxy, h2c_upstream) as channel:
        call = method(channel, "unary_unary", "Abort")
        with pytest.raises(grpc.RpcError) as caught:
            call(b"NOT_FOUND:no such thing", timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == "no such thing"
    assert ("why", "asked-for") in caught.value.trailing_metadata()


def test_per_rpc_policy_refusal_then_a_sibling_on_the_same_channel(
    make_proxy, h2c_upstream: Server
) -> None:
    """Policy applies per RPC: on one channel (one HTTP/2 connection to the proxy), an RPC to a
    host off the allowlist is a gRPC error (the proxy's 403 reads as PERMISSION_DENIED), the
    connection lives on, and once the host is allowed (at run time) the next RPC on the same
    channel goes through while a streaming RPC stays open beside it; one event per RPC."""
    proxy = make_proxy(allow=["plain.test"], with_control=True)
    token = f"sibling-{h2c_upstream.port}"
    with direct_channel(proxy, h2c_upstream, host="other.test") as channel:
        call = method(channel, "unary_unary", "Unary")
        with pytest.raises(grpc.RpcError) as caught:
            call(b"x", timeout=10, metadata=(("token", "denied"),))
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(proxy.control_socket))
            sock.sendall(b'{"type": "allow_host", "crew": "test", "host": "other.test"}\n')
            assert b'"ok":true' in sock.recv(4096)
        chat = method(channel, "stream_stream", "Chat")
        outgoing: queue.Queue[bytes | None] = queue.Queue()
        replies = chat(iter(outgoing.get, None), timeout=20)
        outgoing.put(b"first")
        assert next(replies) == b"first"
        assert call(b"hello", timeout=10, metadata=(("token", token),)) == b"hello"
        outgoing.put(b"second")
        assert next(replies) == b"second"
        outgoing.put(None)
        assert list(replies) == []
    assert token in h2c_upstream.seen.served and "denied" not in h2c_upstream.seen.served
    events = forwarded(proxy, 3)
    assert sorted(type(e).__name__ for e in events) == [
        "RequestAllowed",
        "RequestAllowed",
        "RequestDenied",
    ]


def test_per_rpc_cancellation_and_deadline_reach_the_server(
    grpc_proxy: RunningProxy, h2c_upstream: Server
) -> None:
    """A cancelled stream and a deadline on the forward path: the agent's RST_STREAM ends the
    RPC's exchange, whose upstream stream is reset in turn; grpc-timeout travels; the channel
    carries on; each RPC has its terminal event."""
    server = h2c_upstream
    stream_token, deadline_token = f"fw-drip-{server.port}", f"fw-deadline-{server.port}"
    with direct_channel(grpc_proxy, server) as channel:
        drip = method(channel, "unary_stream", "Drip")(
            b"", timeout=30, metadata=(("token", stream_token),)
        )
        assert [next(drip) for _ in range(3)] == [b"drip 0", b"drip 1", b"drip 2"]
        drip.cancel()
        with pytest.raises(grpc.RpcError) as caught:
            list(drip)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
        assert server.seen.event(stream_token).wait(5)
        assert wait_for(lambda: server.seen.ended.get(stream_token)) == "inactive"
        with pytest.raises(grpc.RpcError) as caught:
            method(channel, "unary_unary", "Hang")(
                b"", timeout=0.5, metadata=(("token", deadline_token),)
            )
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert server.seen.event(deadline_token).wait(5)
        # grpc-timeout is sent in whole units of at most 8 digits, rounded: allow a hair over.
        assert 0 < server.seen.remaining[deadline_token] <= 0.51
        assert method(channel, "unary_unary", "Unary")(b"after", timeout=10) == b"after"
    events = forwarded(grpc_proxy, 3)
    outcomes = sorted((type(e).__name__, getattr(e, "complete", None)) for e in events)
    # The cancelled stream cut after its first messages and the last RPC whole. The deadline
    # races two ends that are both correct: the agent's RST_STREAM at 0.5 s (no answer yet:
    # RequestErrored) or the server's own DEADLINE_EXCEEDED answer, sent at the same instant
    # because grpc-timeout travelled, relayed and then cut by that RST_STREAM.
    assert outcomes in (
        [("RequestAllowed", False), ("RequestAllowed", True), ("RequestErrored", None)],
        [("RequestAllowed", False), ("RequestAllowed", False), ("RequestAllowed", True)],
    ), outcomes


def test_per_rpc_response_messages_are_scrubbed_whole(
    grpc_proxy: RunningProxy, h2c_upstream: Server
) -> None:
    """A server that echoes a credential of the appliance's: the message comes back redacted,
    re-framed with its new length (so the call itself completes), never with the key; the
    messages around it pass as they are, none held back."""
    key = REAL_KEYS["anthropic"].encode()
    with direct_channel(grpc_proxy, h2c_upstream) as channel:
        chat = method(channel, "stream_stream", "Chat")
        outgoing: queue.Queue[bytes | None] = queue.Queue()
        replies = chat(iter(outgoing.get, None), timeout=20)
        outgoing.put(b"before")
        assert next(replies) == b"before"
        outgoing.put(b"the key is " + key)
        echoed = next(replies)
        assert key not in echoed and echoed.startswith(b"the key is ")
        outgoing.put(b"after")
        assert next(replies) == b"after"
        outgoing.put(None)
        assert list(replies) == []
    [event] = forwarded(grpc_proxy, 1)
    assert isinstance(event, RequestAllowed) and event.complete and event.redactions == 1
