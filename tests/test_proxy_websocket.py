"""WebSocket through the proxy over HTTP/1.1, with the real `websockets` library on both ends.

A real proxy process (tests/conftest.py), a `websockets` client that speaks to it as to an HTTP
proxy (the request target in absolute form, as aiohttp or node's `ws` with an HTTP proxy agent
send it; the library's own proxy support uses CONNECT, which tunnels), and `websockets` servers
on loopback as the upstreams ("plain.test" resolves to 127.0.0.1; the crew's `ssrf_allow` opens
loopback). Each test runs its asyncio world in `asyncio.run`; the proxy is a process of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidStatus

from proxycore.protocol.events import RequestAllowed, RequestDenied, RequestRefused
from tests.conftest import (
    PROVIDER_NAMES,
    REAL_KEYS,
    RunningProxy,
    free_port,
    start_proxy,
    write_proxy_config,
)

KEY = REAL_KEYS["anthropic"]
SHORT_LIMITS = """
[limits]
ws_idle_timeout = 1.5
ws_close_timeout = 1.0
ws_max_message_bytes = 4194304
ws_control_frames_per_second = 20
"""


def absolute_form(scheme: str) -> type[ClientConnection]:
    """A websockets client connection whose handshake names its target in absolute form, as
    a client configured with an HTTP proxy sends it (RFC 9112 3.2.2)."""

    class AbsoluteForm(ClientConnection):
        def __init__(self, protocol: Any, *args: Any, **kwargs: Any) -> None:
            plain_connect = protocol.connect

            def connect_absolute() -> Any:
                request = plain_connect()
                uri = protocol.uri
                request.path = f"{scheme}://{uri.host}:{uri.port}{request.path}"
                return request

            protocol.connect = connect_absolute
            super().__init__(protocol, *args, **kwargs)

    return AbsoluteForm


def via(proxy: RunningProxy, url: str, scheme: str = "http", **kwargs: Any) -> Any:
    """`websockets.connect` to `url` through the proxy as an HTTP proxy."""
    kwargs.setdefault("open_timeout", 10)
    kwargs.setdefault("ping_interval", None)
    kwargs.setdefault("max_size", None)
    kwargs.setdefault("host", proxy.host)
    kwargs.setdefault("port", proxy.port)
    return connect(url, proxy=None, create_connection=absolute_form(scheme), **kwargs)


async def echo(ws: ServerConnection) -> None:
    async for message in ws:
        await ws.send(message)


Handler = Callable[[ServerConnection], Awaitable[None]]


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 60))


async def upstream(handler: Handler = echo, **kwargs: Any) -> Any:
    kwargs.setdefault("max_size", None)
    kwargs.setdefault("ping_interval", None)
    return await serve(handler, "127.0.0.1", 0, **kwargs)


def port_of(server: Any) -> int:
    return int(server.sockets[0].getsockname()[1])


@contextlib.asynccontextmanager
async def relayed(proxy: RunningProxy, handler: Handler = echo) -> AsyncIterator[Any]:
    """A websockets upstream on loopback with `handler`, and a client to it through `proxy`."""
    async with (
        await upstream(handler) as server,
        via(proxy, f"ws://plain.test:{port_of(server)}/") as ws,
    ):
        yield ws


def sessions(proxy: RunningProxy, count: int = 1) -> list[RequestAllowed]:
    deadline = time.monotonic() + 10
    while True:
        found = [e for e in proxy.events() if isinstance(e, RequestAllowed) and e.status == 101]
        if len(found) >= count or time.monotonic() > deadline:
            return found


@pytest.fixture
def ws_proxy(make_proxy) -> RunningProxy:
    return make_proxy(allow=["plain.test"], extra=SHORT_LIMITS)


# -- relaying -------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["http", "ws"])
def test_text_and_binary_round_trip(ws_proxy: RunningProxy, scheme: str) -> None:
    seen: dict[str, Any] = {}

    async def recording_echo(ws: ServerConnection) -> None:
        seen["path"] = ws.request.path
        await echo(ws)
        seen["close"] = (ws.close_code, ws.close_reason)

    async def main() -> None:
        async with await upstream(recording_echo) as server:
            url = f"ws://plain.test:{port_of(server)}/chat?room=1"
            async with via(ws_proxy, url, scheme) as ws:
                await ws.send("hello, é and ✓")
                assert await ws.recv() == "hello, é and ✓"
                await ws.send(b"\x00\xff" * 1000)
                assert await ws.recv() == b"\x00\xff" * 1000
                await ws.ping(b"are you there")  # answered end to end
            await asyncio.sleep(0.3)

    run(main)
    assert seen["path"] == "/chat?room=1"
    assert seen["close"] == (1000, "")
    [session] = sessions(ws_proxy)
    assert session.route == "forward" and session.host == "plain.test"
    assert session.ended == "complete" and session.complete
    # Message payload bytes (control frames are counted as frames only).
    assert session.bytes_up == len("hello, é and ✓".encode()) + 2000
    assert session.bytes_down == len("hello, é and ✓".encode()) + 2000
    ws = session.websocket
    assert ws is not None
    assert (ws.messages_up, ws.messages_down) == (2, 2)
    # 2 messages, a ping and the Close each way; a pong and the Close back.
    assert (ws.frames_up, ws.frames_down) == (4, 4)
    assert (ws.closed_by, ws.close_code) == ("agent", 1000)


def test_large_fragmented_messages(ws_proxy: RunningProxy) -> None:
    """Messages larger than any read, sent in fragments, come back whole and unchanged: text
    whose multi-byte characters the proxy's reads cut anywhere included."""
    binary = os.urandom(3 * 1024 * 1024)
    text = "".join(chr(0x400 + i % 900) + "€𝄞a" for i in range(150_000))  # ~1.5 MiB, 1 to 4 bytes

    async def main() -> None:
        async with relayed(ws_proxy) as ws:
            await ws.send([binary[i : i + 65_000] for i in range(0, len(binary), 65_000)])
            assert await ws.recv() == binary
            await ws.send([text[i : i + 7_777] for i in range(0, len(text), 7_777)])
            assert await ws.recv() == text

    run(main)
    [session] = sessions(ws_proxy)
    assert session.websocket is not None and session.websocket.messages_down == 2
    assert session.bytes_down == len(binary) + len(text.encode())


def test_close_begun_by_the_upstream(ws_proxy: RunningProxy) -> None:
    async def close_after_one(ws: ServerConnection) -> None:
        await ws.send(await ws.recv())
        await ws.close(4001, "done here")

    async def main() -> None:
        async with relayed(ws_proxy, close_after_one) as ws:
            await ws.send("one")
            assert await ws.recv() == "one"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()

        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4001, "done here")
        assert closed.value.sent is not None and closed.value.sent.code == 4001  # echoed back

    run(main)
    [session] = sessions(ws_proxy)
    assert session.ended == "complete"
    assert session.websocket is not None
    assert (session.websocket.closed_by, session.websocket.close_code) == ("upstream", 4001)


# -- refusals ------------------------------------------------------------------------------------


def test_denied_host_gets_a_readable_403(ws_proxy: RunningProxy) -> None:
    async def main() -> None:
        async with await upstream() as server:
            with pytest.raises(InvalidStatus) as refused:
                async with via(ws_proxy, f"ws://other.test:{port_of(server)}/"):
                    pass
        response = refused.value.response
        assert response.status_code == 403
        body = json.loads(response.body)
        assert body["error"] == "egress_denied" and body["rule"] == "not_in_allowlist"
        assert body["host"] == "other.test"

    run(main)
    denied = [e for e in ws_proxy.events() if isinstance(e, RequestDenied)]
    assert [(e.host, e.rule) for e in denied] == [("other.test", "not_in_allowlist")]


async def _raw_upstream(answer: Callable[[bytes], bytes]) -> asyncio.Server:
    """An upstream that answers the handshake with `answer(request_head)` and then waits."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(answer(head))
        await writer.drain()
        await reader.read(65536)
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_upstream_with_a_wrong_accept_is_refused_502(ws_proxy: RunningProxy) -> None:
    def wrong_accept(head: bytes) -> bytes:
        return (
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            b"sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
        )

    async def main() -> None:
        server = await _raw_upstream(wrong_accept)
        async with server:
            port = server.sockets[0].getsockname()[1]
            with pytest.raises(InvalidStatus) as refused:
                async with via(ws_proxy, f"ws://plain.test:{port}/"):
                    pass
        response = refused.value.response
        assert response.status_code == 502
        body = json.loads(response.body)
        assert body["rule"] == "websocket_handshake"
        assert "Sec-WebSocket-Accept" in body["message"]

    run(main)
    refused = [e for e in ws_proxy.events() if isinstance(e, RequestRefused)]
    assert [(e.status, e.rule) for e in refused] == [(502, "websocket_handshake")]


def test_upgrade_refused_upstream_is_relayed_scrubbed(ws_proxy: RunningProxy) -> None:
    """An upstream that answers the handshake with an ordinary response: the agent reads it
    (through the scrubber, as any response)."""

    def unauthorized(head: bytes) -> bytes:
        body = f"bad key {KEY}".encode()
        return b"HTTP/1.1 401 Unauthorized\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    async def main() -> None:
        server = await _raw_upstream(unauthorized)
        async with server:
            port = server.sockets[0].getsockname()[1]
            with pytest.raises(InvalidStatus) as refused:
                async with via(ws_proxy, f"ws://plain.test:{port}/"):
                    pass
        assert refused.value.response.status_code == 401
        assert refused.value.response.body == b"bad key [REDACTED:anthropic]"

    run(main)


def test_malformed_handshakes_are_refused_400(ws_proxy: RunningProxy) -> None:
    def ask(head: str) -> tuple[int, dict[str, Any]]:
        with socket.create_connection((ws_proxy.host, ws_proxy.port), timeout=10) as sock:
            sock.sendall(head.encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        status = int(data.split(b" ", 2)[1])
        return status, json.loads(data.partition(b"\r\n\r\n")[2])

    upgrade = "GET ws://plain.test:9/ HTTP/1.1\r\nhost: plain.test:9\r\nupgrade: websocket\r\n"
    upgrade += "connection: Upgrade\r\nsec-websocket-version: 13\r\n"
    status, body = ask(upgrade + "\r\n")
    assert status == 400 and "Sec-WebSocket-Key" in body["message"]
    status, body = ask(upgrade + "sec-websocket-key: c2hvcnQ=\r\n\r\n")
    assert status == 400 and "16 bytes" in body["message"]
    status, body = ask(
        upgrade.replace("version: 13", "version: 8") + "sec-websocket-key: "
        "dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    assert status == 400 and "Version must be 13" in body["message"]
    status, body = ask(
        "GET ws://plain.test:9/ HTTP/1.1\r\nhost: plain.test:9\r\nconnection: close\r\n\r\n"
    )
    assert status == 400 and "ws:// targets are for WebSocket" in body["message"]
    status, body = ask(
        "GET wss://plain.test/ HTTP/1.1\r\nhost: plain.test\r\nconnection: close\r\n\r\n"
    )
    assert status == 400 and body["message"] == "wss:// targets must use CONNECT"


# -- scrubbing and injection ----------------------------------------------------------------------


def test_credential_echoed_in_frames_arrives_scrubbed(ws_proxy: RunningProxy) -> None:
    async def leak(ws: ServerConnection) -> None:
        await ws.recv()
        await ws.send(f"whole: {KEY}")
        # Split across fragments of one message, at awkward places.
        await ws.send([f"split: {KEY[:5]}", KEY[5:9], KEY[9:40], f"{KEY[40:]} é end"])
        await ws.send(f"binary {KEY}".encode())
        await ws.send("no secret here")

    async def main() -> None:
        async with relayed(ws_proxy, leak) as ws:
            await ws.send("go")
            got = [await ws.recv() for _ in range(4)]

        assert got == [
            "whole: [REDACTED:anthropic]",
            "split: [REDACTED:anthropic] é end",
            b"binary [REDACTED:anthropic]",
            "no secret here",
        ]

    run(main)
    [session] = sessions(ws_proxy)
    assert session.redactions == 3


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


def test_provider_route_injects_the_credential_and_scrubs_its_echo(provider_ws) -> None:
    """`ws://<proxy>/openai/realtime`: over verified TLS to the provider, the agent's key
    replaced by the appliance's on the handshake, and the key echoed back never reaches the
    agent (nor would the agent's own key reach the provider)."""
    proxy, port, context = provider_ws
    seen: dict[str, Any] = {}

    async def realtime(ws: ServerConnection) -> None:
        seen["path"] = ws.request.path
        seen["authorization"] = ws.request.headers.get_all("authorization")
        await ws.send(f"you sent {ws.request.headers['authorization']}")
        await echo(ws)

    async def main() -> None:
        server = await serve(realtime, "127.0.0.1", port, ssl=context, ping_interval=None)
        async with (
            server,
            connect(
                f"ws://{proxy.host}:{proxy.port}/openai/realtime?model=m",
                additional_headers={"authorization": "Bearer sk-agent-dummy"},
                ping_interval=None,
                proxy=None,
            ) as ws,
        ):
            assert await ws.recv() == "you sent Bearer [REDACTED:openai]"
            await ws.send("ping")
            assert await ws.recv() == "ping"

    run(main)
    assert seen["path"] == "/v1/realtime?model=m"
    assert seen["authorization"] == [f"Bearer {REAL_KEYS['openai']}"]
    [session] = sessions(proxy)
    assert session.route == "reverse" and session.rule == "provider"
    assert session.host == "api.openai.test" and session.redactions == 1


# -- limits and deadlines ---------------------------------------------------------------------


def test_ping_flood_is_cut_off(ws_proxy: RunningProxy) -> None:
    """Over `ws_control_frames_per_second` (20 here) the flooding side is closed with 1008; the
    upstream is told the session is going away."""
    upstream_close: dict[str, Any] = {}

    async def record(ws: ServerConnection) -> None:
        await echo(ws)
        upstream_close["code"] = ws.close_code

    async def main() -> None:
        async with await upstream(record) as server:
            async with via(ws_proxy, f"ws://plain.test:{port_of(server)}/") as ws:
                with pytest.raises(ConnectionClosed) as closed:
                    for i in range(1000):
                        await ws.ping(b"%d" % i)
                    await ws.recv()
            await asyncio.sleep(0.5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008

    run(main)
    assert upstream_close["code"] == 1001
    [session] = sessions(ws_proxy)
    assert session.ended.startswith("control_flood")
    assert session.websocket is not None and session.websocket.closed_by == "proxy"
    assert session.websocket.frames_up <= 25


def test_oversized_message_is_refused_1009(ws_proxy: RunningProxy) -> None:
    async def main() -> None:
        async with relayed(ws_proxy) as ws:
            await ws.send(b"x" * (4 * 1024 * 1024 + 1))
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()

        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009

    run(main)
    [session] = sessions(ws_proxy)
    assert session.ended.startswith("message_too_big")


def test_idle_session_is_closed_both_ways(ws_proxy: RunningProxy) -> None:
    upstream_close: dict[str, Any] = {}

    async def record(ws: ServerConnection) -> None:
        await echo(ws)
        upstream_close["close"] = (ws.close_code, ws.close_reason)

    async def main() -> None:
        async with await upstream(record) as server:
            async with via(ws_proxy, f"ws://plain.test:{port_of(server)}/") as ws:
                await ws.send("hi")
                assert await ws.recv() == "hi"
                started = time.monotonic()
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.recv()
                waited = time.monotonic() - started
            await asyncio.sleep(0.3)
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "idle timeout")
        assert 1.0 <= waited < 4.0

    run(main)
    assert upstream_close["close"] == (1001, "idle timeout")
    [session] = sessions(ws_proxy)
    assert session.ended == "idle_timeout"
    assert session.websocket is not None and session.websocket.closed_by == "proxy"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_slow_reader_gets_backpressure_not_buffering(ws_proxy: RunningProxy) -> None:
    """An agent that stops reading stalls its upstream: the proxy does not read on for it, so
    its memory stays flat while the upstream tries to send 256 MiB."""
    sent = {"bytes": 0}
    chunk = os.urandom(1024 * 1024)
    total = 256

    async def firehose(ws: ServerConnection) -> None:
        await ws.recv()
        for _ in range(total):
            await ws.send(chunk)
            sent["bytes"] += len(chunk)
        await ws.recv()

    async def main() -> None:
        before = _rss_kib(ws_proxy.process.pid)
        async with await upstream(firehose, write_limit=65536) as server:
            # A small receive buffer on the agent's socket, and a client that holds at most one
            # message before it stops reading from its socket.
            sock = socket.create_connection((ws_proxy.host, ws_proxy.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            async with via(
                ws_proxy,
                f"ws://plain.test:{port_of(server)}/",
                sock=sock,
                host=None,
                port=None,
                max_queue=1,
            ) as ws:
                await ws.send("go")
                stalled_at = -1
                for _ in range(40):
                    await asyncio.sleep(0.25)
                    if sent["bytes"] == stalled_at:
                        break
                    stalled_at = sent["bytes"]
                assert sent["bytes"] == stalled_at, "the upstream never stalled"
                assert sent["bytes"] < 160 * 1024 * 1024
                grown = _rss_kib(ws_proxy.process.pid) - before
                assert grown < 32 * 1024, f"the proxy grew by {grown} KiB"
                # Reading again releases the stream: everything arrives, in order, whole.
                for _ in range(total):
                    assert await ws.recv() == chunk
                await ws.send("done")

    run(main)
    [session] = sessions(ws_proxy)
    assert session.bytes_down == total * len(chunk) and session.ended == "complete"


def test_both_directions_stream_at_once(ws_proxy: RunningProxy) -> None:
    """An upstream that sends its whole stream before it reads, and an agent that does the
    same: each direction moves on its own (a direction blocked on a peer never holds up the
    other), so neither side waits for the idle timeout."""
    chunk = os.urandom(512 * 1024)
    count = 48

    async def send_then_read(ws: ServerConnection) -> None:
        for _ in range(count):
            await ws.send(chunk)
        for _ in range(count):
            assert await ws.recv() == chunk
        await ws.send("all read")

    async def main() -> None:
        async with (
            await upstream(send_then_read, max_queue=1) as server,
            via(ws_proxy, f"ws://plain.test:{port_of(server)}/", max_queue=1) as ws,
        ):

            async def send_all() -> None:
                for _ in range(count):
                    await ws.send(chunk)

            sender = asyncio.create_task(send_all())
            for _ in range(count):
                assert await ws.recv() == chunk
            assert await ws.recv() == "all read"
            await sender

    run(main)
    [session] = sessions(ws_proxy)
    assert session.ended == "complete"
    assert session.bytes_up == session.bytes_down - len("all read") == count * len(chunk)


def test_an_upstream_that_vanishes_gets_the_agent_a_1001(ws_proxy: RunningProxy) -> None:
    """The upstream's connection is cut without a Close: that session ends (and only it), the
    agent is told 1001, and the journal says why."""

    async def vanish(ws: ServerConnection) -> None:
        await ws.send(await ws.recv())
        ws.transport.abort()  # an RST, no Close

    async def main() -> None:
        async with relayed(ws_proxy, vanish) as ws:
            await ws.send("one")
            assert await ws.recv() == "one"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        # The proxy carries on: another session works.
        async with relayed(ws_proxy) as ws:
            await ws.send("two")
            assert await ws.recv() == "two"

    run(main)
    first, second = sessions(ws_proxy, 2)
    assert first.ended.startswith(("upstream_closed", "upstream_reset")), first.ended
    assert first.websocket is not None and first.websocket.closed_by == "upstream"
    assert second.ended == "complete"


def test_removing_the_crew_closes_its_sessions_with_1001(make_proxy) -> None:
    proxy = make_proxy(allow=["plain.test"], with_control=True)
    upstream_close: dict[str, Any] = {}

    async def record(ws: ServerConnection) -> None:
        await echo(ws)
        upstream_close["code"] = ws.close_code

    async def main() -> None:
        async with relayed(proxy, record) as ws:
            await ws.send("hi")
            assert await ws.recv() == "hi"
            reader, writer = await asyncio.open_unix_connection(str(proxy.control_socket))
            writer.write(b'{"type": "crew_remove", "name": "test"}\n')
            assert json.loads(await reader.readline())["ok"] is True
            writer.close()
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        await asyncio.sleep(0.3)

    run(main)
    assert upstream_close["code"] == 1001
    [session] = sessions(proxy)
    assert session.ended == "crew_removed"
