"""The WebSocket handshake (proxycore/protocol/websocket.py) and frame relay
(proxycore/protocol/wsrelay.py), sans-IO: plans and checks from bytes, sessions between two
wsproto peers. The real-client tests are in tests/test_proxy_websocket.py."""

from __future__ import annotations

import pytest
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

from native.scrub import Scrubber
from proxycore.protocol import http1
from proxycore.protocol.credentials import Provider
from proxycore.protocol.plans import Forward, OpenWebSocket, Refuse
from proxycore.protocol.policy import NetworkMode
from proxycore.protocol.websocket import accept_for, check_switch, switching_head
from proxycore.protocol.wsrelay import Side, WebSocketLimits, WebSocketRelay
from tests.test_exchange import KEY, crew, plan

NONCE = b"dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455 1.3's example key
HANDSHAKE = (
    b"Host: x\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\n"
    b"Sec-WebSocket-Key: " + NONCE + b"\r\nSec-WebSocket-Version: 13\r\n"
)


def handshake(target: bytes, extra: bytes = b"") -> OpenWebSocket | Forward | Refuse:
    return plan(b"GET " + target + b" HTTP/1.1\r\n" + HANDSHAKE + extra + b"\r\n")


# -- the handshake ------------------------------------------------------------------------------


def test_accept_is_rfc_6455s_example() -> None:
    assert accept_for(NONCE) == b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


@pytest.mark.parametrize("scheme", [b"http", b"ws"])
def test_a_forward_handshake_carries_the_upgrade_and_no_extension(scheme: bytes) -> None:
    got = handshake(
        scheme + b"://allowed.test:8080/chat",
        b"Sec-WebSocket-Extensions: permessage-deflate\r\nSec-WebSocket-Protocol: a, b\r\n",
    )
    assert isinstance(got, OpenWebSocket)
    assert (got.key, got.protocols) == (NONCE, (b"a", b"b"))
    forward = got.forward
    assert (forward.host, forward.port, forward.tls, forward.keep_alive) == (
        "allowed.test",
        8080,
        False,
        False,
    )
    sent = forward.upstream_head(None)
    assert sent.startswith(b"GET /chat HTTP/1.1\r\nhost: allowed.test:8080\r\n")
    assert b"Sec-WebSocket-Key: " + NONCE in sent and b"Sec-WebSocket-Version: 13" in sent
    assert b"xtensions" not in sent and b"keep-alive" not in sent
    assert sent.endswith(b"\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\r\n")
    assert b"content-length" not in sent


def test_a_provider_handshake_is_injected_over_tls() -> None:
    got = handshake(b"ws://api.anthropic.com/v1/live", b"x-api-key: sk-agent-own\r\n")
    assert isinstance(got, OpenWebSocket)
    assert got.forward.tls and got.forward.provider is Provider.ANTHROPIC
    sent = got.forward.upstream_head(None)
    assert b"x-api-key: " + KEY.encode() in sent and b"sk-agent-own" not in sent
    reverse = handshake(b"/anthropic/v1/live")
    assert isinstance(reverse, OpenWebSocket) and reverse.request.route == "reverse"


def test_policy_refuses_a_handshake_as_any_request() -> None:
    got = handshake(b"ws://other.test/")
    assert isinstance(got, Refuse) and got.status == 403
    none = plan(
        b"GET ws://allowed.test/ HTTP/1.1\r\n" + HANDSHAKE + b"\r\n", policy=crew(NetworkMode.NONE)
    )
    assert isinstance(none, Refuse) and none.event.rule == "mode_none"


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (b"Sec-WebSocket-Key: " + NONCE + b"\r\n", "exactly one Sec-WebSocket-Key"),
        (b"Content-Length: 2\r\n", "no body"),
        (b"Sec-WebSocket-Protocol: a b\r\n", "list of tokens"),
    ],
)
def test_bad_offers_are_refused_400(extra: bytes, why: str) -> None:
    got = handshake(b"ws://allowed.test/", extra)
    assert isinstance(got, Refuse) and got.status == 400 and got.close
    assert why in got.body.message


def test_other_upgrades_and_methods_stay_ordinary_requests() -> None:
    h2c = plan(
        b"GET http://allowed.test/ HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\n"
        b"Connection: Upgrade\r\n\r\n"
    )
    assert isinstance(h2c, Forward) and b"pgrade" not in h2c.head
    post = plan(b"POST http://allowed.test/ HTTP/1.1\r\n" + HANDSHAKE + b"\r\n")
    assert isinstance(post, Forward)
    plain_ws = plan(b"GET ws://allowed.test/ HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(plain_ws, Refuse) and plain_ws.status == 400
    wss = plan(b"GET wss://allowed.test/ HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(wss, Refuse) and wss.body.message == "wss:// targets must use CONNECT"


def response(fields: bytes) -> http1.ResponseHead:
    parsed = http1.parse_response_head(
        b"HTTP/1.1 101 Switching Protocols\r\n" + fields + b"\r\n", request_method=b"GET"
    )
    assert parsed is not None
    return parsed[0]


GOOD = b"Upgrade: WebSocket\r\nConnection: upgrade\r\nSec-WebSocket-Accept: %s\r\n" % accept_for(
    NONCE
)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        (GOOD, None),
        (GOOD + b"Sec-WebSocket-Protocol: b\r\n", None),
        (GOOD.replace(b"WebSocket", b"h2c"), "does not upgrade to websocket"),
        (GOOD.replace(b"Connection: upgrade", b"Connection: close"), "no Connection: Upgrade"),
        (GOOD.replace(b"s3pP", b"AAAA"), "Sec-WebSocket-Accept"),
        (GOOD + b"Sec-WebSocket-Accept: x\r\n", "Sec-WebSocket-Accept"),
        (GOOD + b"Sec-WebSocket-Extensions: permessage-deflate\r\n", "extension"),
        (GOOD + b"Sec-WebSocket-Protocol: c\r\n", "subprotocol"),
    ],
)
def test_the_upstreams_101_is_held_to_the_clients_checks(fields: bytes, why: str | None) -> None:
    offer = handshake(b"ws://allowed.test/", b"Sec-WebSocket-Protocol: a, b\r\n")
    assert isinstance(offer, OpenWebSocket)
    got = check_switch(offer, response(fields))
    assert got is None if why is None else (got is not None and why in got)


def test_the_agents_101_is_scrubbed_and_carries_no_extension() -> None:
    head = switching_head(
        response(GOOD + b"Set-Cookie: k=" + KEY.encode() + b"\r\nKeep-Alive: 5\r\n"),
        Scrubber([("anthropic", KEY)]),
    )
    assert head.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
    assert KEY.encode() not in head and b"[REDACTED:anthropic]" in head
    assert b"\r\nsec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n" in head
    assert head.lower().count(b"upgrade: websocket") == 1 and b"keep-alive" not in head.lower()
    assert head.endswith(b"\r\n\r\n")


# -- the relay ----------------------------------------------------------------------------------


class Session:
    """A relay between a wsproto client (the agent) and a wsproto server (the upstream)."""

    def __init__(self, **limits: object) -> None:
        self.relay = WebSocketRelay(Scrubber([("anthropic", KEY)]), WebSocketLimits(**limits))  # type: ignore[arg-type]
        self.peers = {
            Side.AGENT: Connection(ConnectionType.CLIENT),
            Side.UPSTREAM: Connection(ConnectionType.SERVER),
        }
        self.now = 0.0

    def send(self, side: Side, *events: object, raw: bytes = b"") -> dict[Side, list[object]]:
        data = raw + b"".join(self.peers[side].send(e) for e in events)  # type: ignore[arg-type]
        self.now += 0.01
        self.relay.receive(side, data, self.now)
        return self.deliver()

    def deliver(self) -> dict[Side, list[object]]:
        got: dict[Side, list[object]] = {}
        for side, peer in self.peers.items():
            out = self.relay.take(side)
            if out:
                peer.receive_data(out)
            got[side] = list(peer.events())
        return got


def test_a_close_from_the_upstream_is_relayed_and_its_answer_completes_it() -> None:
    s = Session()
    got = s.send(Side.UPSTREAM, CloseConnection(4000, "bye " + KEY))
    [close] = got[Side.AGENT]
    assert isinstance(close, CloseConnection) and close.code == 4000
    assert close.reason == "bye [REDACTED:anthropic]"
    assert not s.relay.done and s.relay.closing
    got = s.send(Side.AGENT, close.response())
    assert isinstance(got[Side.UPSTREAM][0], CloseConnection)
    assert s.relay.done and s.relay.ended == "complete"
    assert (s.relay.closed_by, s.relay.close_code) == ("upstream", 4000)


def test_a_text_message_cut_inside_characters_arrives_whole() -> None:
    s = Session()
    wire = s.peers[Side.UPSTREAM].send(TextMessage("é✓𝄞 and " + KEY + " ✓"))
    text = ""
    for i in range(len(wire)):  # byte by byte: every character cut somewhere
        s.relay.receive(Side.UPSTREAM, wire[i : i + 1], 0.0)
        for event in s.deliver()[Side.AGENT]:
            assert isinstance(event, TextMessage)
            text += event.data
    assert text == "é✓𝄞 and [REDACTED:anthropic] ✓"
    assert s.relay.redactions == 1


def test_an_unmasked_agent_frame_fails_the_agent_and_the_upstream_is_told() -> None:
    s = Session()
    got = s.send(Side.AGENT, raw=b"\x81\x02hi")  # RFC 6455 5.1: a client must mask
    assert [e.code for e in got[Side.AGENT] if isinstance(e, CloseConnection)] == [1002]
    assert [e.code for e in got[Side.UPSTREAM] if isinstance(e, CloseConnection)] == [1001]
    assert s.relay.ended.startswith("agent_protocol_error")
    assert not s.relay.wants_input(Side.AGENT)
    s.send(Side.UPSTREAM, CloseConnection(1001))  # the upstream's answer
    assert s.relay.done


def test_control_frames_over_125_bytes_and_floods_are_refused() -> None:
    s = Session(control_per_second=3)
    for _ in range(3):
        assert isinstance(s.send(Side.AGENT, Ping(b"x"))[Side.UPSTREAM][0], Ping)
    got = s.send(Side.AGENT, Ping(b"x"))
    assert [e.code for e in got[Side.AGENT] if isinstance(e, CloseConnection)] == [1008]
    big = Session()
    got = big.send(Side.UPSTREAM, raw=b"\x89\x7e\x00\x7e" + b"p" * 126)
    assert [e.code for e in got[Side.UPSTREAM] if isinstance(e, CloseConnection)] == [1002]


def test_a_message_over_the_limit_fails_its_sender_even_in_small_fragments() -> None:
    s = Session(max_message_bytes=10)
    s.send(Side.AGENT, BytesMessage(b"12345", message_finished=False))
    got = s.send(Side.AGENT, BytesMessage(b"123456", message_finished=True))
    assert [e.code for e in got[Side.AGENT] if isinstance(e, CloseConnection)] == [1009]
    assert s.relay.ended.startswith("message_too_big")


def test_idle_then_close_timeout_end_the_session_and_say_so() -> None:
    s = Session()
    s.relay.expire_idle()
    got = s.deliver()
    for side in Side:
        [close] = got[side]
        assert isinstance(close, CloseConnection) and close.code == 1001
    s.send(Side.AGENT, CloseConnection(1001))  # the agent answers, the upstream never does
    assert not s.relay.done
    s.relay.expire_close()
    assert s.relay.done and s.relay.ended == "idle_timeout"


def test_data_after_a_close_is_dropped_and_a_hang_up_after_it_changes_nothing() -> None:
    s = Session()
    s.send(Side.UPSTREAM, CloseConnection(1000))
    # The agent sends on before it reads the Close (its own client would refuse to after).
    late = Connection(ConnectionType.CLIENT).send(TextMessage("late"))
    got = s.send(Side.AGENT, raw=late)
    assert got[Side.UPSTREAM] == []
    s.relay.receive(Side.UPSTREAM, b"", 1.0)  # the upstream hangs up after its Close
    assert not s.relay.done and s.relay.ended == ""  # the agent's answer is still awaited
    s.send(Side.AGENT, CloseConnection(1000))
    assert s.relay.done and s.relay.ended == "complete"
    assert s.peers[Side.UPSTREAM].state is ConnectionState.CLOSED


def test_a_lost_side_closes_the_other_with_1001() -> None:
    s = Session()
    s.relay.receive(Side.UPSTREAM, b"", 1.0)
    [close] = s.deliver()[Side.AGENT]
    assert isinstance(close, CloseConnection) and close.code == 1001
    assert s.relay.ended == "upstream_closed" and s.relay.closed_by == "upstream"
    s.send(Side.AGENT, close.response())
    assert s.relay.done and s.relay.ended == "upstream_closed"
