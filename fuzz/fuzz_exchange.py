"""Fuzz the exchange (proxycore/protocol/exchange.py, responses.py) with arbitrary sequences.

The input is a crew (mode, allowlist flags, journal state, a store credential or not) and a
sequence of steps, each one of: bytes the agent sends (parsed as pipelined requests, the way the
connection adapter parses them), an upstream's response head for the last forward plan, a
keeper body for the last keeper plan. No socket: the adapter's decisions are all here.

Invariants:
- only `HttpProtocolError` escapes the parsers; nothing escapes the planners;
- a refusal's terminal event agrees with it (status, denied iff 403), its bytes read as one
  well-formed HTTP/1.1 response (h11 as the client), and it closes the connection whenever the
  refused request's body cannot be drained;
- a forward plan's upstream head reads as one well-formed request (h11 as the server) with
  exactly one Host, none of the agent's credential or hop-by-hop fields, the appliance's key
  only towards the exact provider host over TLS, and never an agent's framing;
- a response plan's head reads as a well-formed response, holds no secret, and a refusal of a
  response is a 502;
- no credential ever appears in a refusal, a response head or an event;
- with method and path rules (flag 128), every forward plan to a ruled host is one the rules
  allow, and a CONNECT is terminated only to a host the crew holds a leaf for;
- inside a terminated tunnel (flag 32; the tunnel's host by flag 64), every plan is a refusal or
  a forward (or WebSocket) plan to exactly the tunnel's host and port over TLS: never a tunnel,
  the local API or the keeper.
"""

from __future__ import annotations

import os
import sys

import h11
import msgspec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from native.scrub import Scrubber
from native.scrub_patterns import DEFAULT_SHAPES
from proxycore.errors import HttpProtocolError
from proxycore.protocol import http1
from proxycore.protocol.credentials import Credential, Provider, Routes, route_for
from proxycore.protocol.events import RequestDenied
from proxycore.protocol.exchange import check_keeper_call, close_after_refusal, plan_request
from proxycore.protocol.l7 import HostRule, L7Rules
from proxycore.protocol.plans import (
    Forward,
    OpenTunnel,
    OpenWebSocket,
    Refuse,
    ServeKeeper,
    ServeLocal,
    TerminateTunnel,
)
from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode
from proxycore.protocol.responses import ResponsePlan, plan_response

KEY = "sk-ant-api03-FUZZEXCHANGE-key-0123456789abcdef"
STORE = "sk-ant-api03-FUZZSTORE-crew-9876543210fedcba"
OPENAI = "sk-proj-FUZZEXCHANGE-openai-0123456789abcdef"
SECRETS = (KEY, STORE, OPENAI)
_SCRUBBER = Scrubber(
    [("anthropic", KEY.encode()), ("anthropic", STORE.encode()), ("openai", OPENAI.encode())],
    DEFAULT_SHAPES,
)
_ANTHROPIC = route_for("https://api.anthropic.test", Provider.ANTHROPIC, Credential(KEY))
_OPENAI = route_for("https://api.openai.test/v1", Provider.OPENAI, Credential(OPENAI))
_LIMITS = http1.Limits(max_request_line=512, max_header_count=32, max_header_bytes=4096)
_AGENT_CREDENTIAL_FIELDS = (b"x-api-key", b"authorization", b"proxy-authorization", b"cookie")
_UPGRADE_FIELDS = b"\r\nconnection: Upgrade\r\nupgrade: websocket"
_MODES = (NetworkMode.RESTRICTED, NetworkMode.FREE, NetworkMode.NONE)


def _routes(store: bool) -> Routes:
    credentials = {"fuzz": {Provider.ANTHROPIC: Credential(STORE)}} if store else {}
    return Routes(
        {b"anthropic": _ANTHROPIC, b"openai": _OPENAI},
        {_ANTHROPIC.host: _ANTHROPIC, _OPENAI.host: _OPENAI},
        credentials,
    )


def _steps(data: bytes) -> list[tuple[int, bytes]]:
    """Split the input into (kind, payload) steps: a kind byte, a length byte, the payload."""
    steps = []
    i = 0
    while i + 2 <= len(data):
        kind, length = data[i] % 3, data[i + 1]
        steps.append((kind, data[i + 2 : i + 2 + length]))
        i += 2 + length
    return steps


def _check_response_bytes(data: bytes, what: str) -> None:
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    try:
        event = client.next_event()
    except h11.RemoteProtocolError as exc:
        raise AssertionError(f"{what} is not a valid response: {exc}: {data[:300]!r}") from exc
    assert isinstance(event, h11.Response), (what, event, data[:300])


def _check_refusal(
    plan: Refuse, head: http1.RequestHead, crew: str, *, body_read: bool = False
) -> None:
    assert 400 <= plan.status <= 599, plan
    event = plan.event
    assert event.status == plan.status and event.crew == crew, plan
    assert (plan.status == 403) == isinstance(event, RequestDenied), plan
    if not head.keep_alive:
        assert plan.close, ("a refusal keeps a connection the agent asked to close", plan)
    if not body_read and close_after_refusal(head):
        assert plan.close, ("a refusal that cannot drain the body keeps the connection", plan)
    response = plan.response()
    _check_response_bytes(response, "a refusal")
    for secret in SECRETS:
        assert secret.encode() not in response and secret not in repr(event)


def _check_forward(plan: Forward, head: http1.RequestHead) -> None:
    sent = plan.upstream_head(5)
    server = h11.Connection(h11.SERVER)
    server.receive_data(sent + b"hello")
    try:
        request = server.next_event()
    except h11.RemoteProtocolError as exc:
        raise AssertionError(f"upstream head is not a valid request: {exc}: {sent!r}") from exc
    assert isinstance(request, h11.Request), (request, sent)
    names = [name for name, _ in request.headers]
    assert names.count(b"host") == 1, sent
    assert b"transfer-encoding" not in names and names.count(b"content-length") == 1, sent
    assert not {b"connection", b"keep-alive", b"te", b"upgrade", b"proxy-connection"} & set(
        names
    ), sent
    keys = [secret for secret in SECRETS if secret.encode() in sent]
    if plan.provider is None:
        assert not keys, ("a credential travelled without a provider plan", sent)
    else:
        assert plan.tls and plan.host in (_ANTHROPIC.host, _OPENAI.host), plan
        assert len(keys) == 1, sent
        for name, value in request.headers:
            if name in _AGENT_CREDENTIAL_FIELDS:
                assert any(secret.encode() in value for secret in SECRETS), (
                    "an agent's credential field travelled to a provider",
                    sent,
                )


def _check_response(plan: Forward, head: http1.RequestHead, payload: bytes) -> None:
    buffer = payload + b"\r\n\r\n"
    try:
        parsed = http1.parse_response_head(buffer, _LIMITS, request_method=head.method)
    except HttpProtocolError:
        return
    if parsed is None:
        return
    response, _ = parsed
    if 100 <= response.status < 200:
        return
    decided = plan_response(plan, head, response, _SCRUBBER, whole_limit=payload[0] * 256)
    if isinstance(decided, Refuse):
        assert decided.status == 502, decided
        _check_response_bytes(decided.response(), "a refused response")
        return
    assert isinstance(decided, ResponsePlan)
    out = bytes(decided.head(7 if decided.mode.value == "whole" else None))
    for secret in SECRETS:
        assert secret.encode() not in out, out
    if decided.mode.value == "stream" and not decided.rechunk:
        assert not decided.keep_client
    _check_response_bytes(out + (b"1234567" if decided.mode.value == "whole" else b""), "a head")


_RULES = L7Rules(
    [
        HostRule.make("allowed.test", preset="read-only", paths=["/docs/**"]),
        HostRule.make(_ANTHROPIC.host, methods=["POST"], paths=["/v1/messages"]),
    ]
)
_LEAVES = frozenset({"allowed.test", _ANTHROPIC.host})


def _check_rules_and_tunnel(
    plan: object, head: http1.RequestHead, crew: CrewPolicy, tunnel: tuple[str, int] | None
) -> None:
    forward = plan.forward if isinstance(plan, OpenWebSocket) else plan
    if isinstance(forward, Forward) and crew.rules:
        path = forward.head.split(b" ", 2)[1]
        assert crew.rules.check(forward.host, head.method, path, head.headers) is None, (
            "a forward plan the rules refuse",
            forward.head,
        )
    if isinstance(plan, TerminateTunnel):
        assert plan.host in _LEAVES, plan
    if tunnel is not None:
        assert isinstance(plan, Refuse | Forward | OpenWebSocket), plan
        if isinstance(forward, Forward):
            assert (forward.host, forward.port, forward.tls) == (*tunnel, True), forward


def _check_name_policy(plan: object, crew: CrewPolicy) -> None:
    """A restricted crew reaches its allowlist and the hosts granted to it, nothing else."""
    if crew.mode is not NetworkMode.RESTRICTED:
        return
    target = plan.forward if isinstance(plan, OpenWebSocket) else plan
    if isinstance(target, Forward | OpenTunnel | TerminateTunnel):
        host = target.host
        assert host in crew.allowlist or host in crew.grants, ("outside the allowlist", plan)


def TestOneInput(data: bytes) -> None:
    if len(data) < 2:
        return
    flags = data[0]
    allow = ["allowed.test", "api.anthropic.test"] if flags & 4 else ["api.anthropic.test"]
    rules = _RULES if flags & 128 else L7Rules()
    crew = CrewPolicy("fuzz", _MODES[flags % 3], Allowlist(allow), rules)
    if len(data) & 1:
        # Run-time approvals on (every flag bit is taken: the input's length decides): the
        # refusal's wording changes, never what is refused; a grant admits one host only.
        crew.approval_window = 900.0
        crew.denied = {"denied.test": float("inf")}
        crew.grants = {"granted.test": float("inf")}
    tunnel = None
    if flags & 32:
        tunnel = ("api.anthropic.test", 443) if flags & 64 else ("allowed.test", 443)
    routes = _routes(store=bool(flags & 8))
    audit_blocked = bool(flags & 16)
    buffer = bytearray()
    last: tuple[Forward | ServeKeeper, http1.RequestHead] | None = None
    for kind, payload in _steps(data[1:]):
        if kind == 0:
            buffer += payload
            while buffer:
                try:
                    parsed = http1.parse_request_head(buffer, _LIMITS)
                except HttpProtocolError:
                    buffer.clear()  # the adapter closes the connection: nothing more to read
                    break
                if parsed is None:
                    break
                head, consumed = parsed
                del buffer[:consumed]
                plan = plan_request(
                    head,
                    crew,
                    routes,
                    audit_blocked=audit_blocked,
                    max_body=4096,
                    leaves=_LEAVES,
                    tunnel=tunnel,
                )
                _check_rules_and_tunnel(plan, head, crew, tunnel)
                _check_name_policy(plan, crew)
                if isinstance(plan, Refuse):
                    _check_refusal(plan, head, crew.name)
                elif isinstance(plan, Forward):
                    assert not audit_blocked and crew.mode is not NetworkMode.NONE, plan
                    _check_forward(plan, head)
                    last = (plan, head)
                elif isinstance(plan, OpenWebSocket):
                    # A handshake is a forward plan plus the upgrade (and never a body).
                    assert not audit_blocked and crew.mode is not NetworkMode.NONE, plan
                    assert head.body_kind is http1.BodyKind.NONE, plan
                    assert plan.forward.head.endswith(
                        b"\r\nconnection: Upgrade\r\nupgrade: websocket"
                    )
                    assert b"sec-websocket-extensions" not in plan.forward.head.lower()
                    # Without its upgrade fields it passes every check of a forward head.
                    bare = plan.forward.head[: -len(_UPGRADE_FIELDS)]
                    _check_forward(msgspec.structs.replace(plan.forward, head=bare), head)
                elif isinstance(plan, ServeKeeper):
                    last = (plan, head)
                else:
                    assert isinstance(plan, ServeLocal | OpenTunnel | TerminateTunnel), plan
                    if isinstance(plan, OpenTunnel | TerminateTunnel):
                        assert not audit_blocked and crew.mode is not NetworkMode.NONE, plan
        elif kind == 1 and last is not None and isinstance(last[0], Forward) and payload:
            _check_response(last[0], last[1], payload)
        elif kind == 2 and last is not None and isinstance(last[0], ServeKeeper):
            keeper, keeper_head = last
            close = not keeper_head.keep_alive  # as proxycore/io/keeper_client.py decides
            refused = check_keeper_call(keeper.request, keeper.action, payload, close=close)
            if refused is not None:
                _check_refusal(refused, keeper_head, crew.name, body_read=True)


def _seed(*steps: tuple[int, bytes], flags: int = 4) -> bytes:
    out = bytearray([flags])
    for kind, payload in steps:
        out += bytes([kind, len(payload)]) + payload
    return bytes(out)


SEEDS = [
    _seed((0, b"GET http://allowed.test/ HTTP/1.1\r\nHost: a\r\n\r\n")),
    _seed(
        (
            0,
            b"POST http://api.anthropic.test/v1/messages HTTP/1.1\r\nHost: a\r\nx-api-key: own\r\n"
            b"Content-Length: 2\r\n\r\n",
        ),
        (1, b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\nx-k: " + KEY.encode()),
    ),
    _seed((0, b"POST /anthropic/v1/messages HTTP/1.1\r\nHost: a\r\n\r\n"), flags=12),
    _seed((0, b"CONNECT allowed.test.:443 HTTP/1.1\r\nHost: a\r\n\r\n")),
    _seed((0, b"GET http://other.test/ HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc")),
    _seed(
        (0, b"POST /keeper/request HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\n"),
        (2, b"[" * 100),
    ),
    _seed((0, b"GET http://allowed.test/ HTTP/1.1\r\nHost: a\r\n\r\n"), flags=4 | 16),
    _seed(
        (
            0,
            b"GET ws://api.anthropic.test/v1/x HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            b"Sec-WebSocket-Version: 13\r\nx-api-key: own\r\nSec-WebSocket-Extensions: x\r\n\r\n",
        ),
    ),
    _seed(
        (0, b"GET http://allowed.test/ HTTP/1.1\r\nHost: a\r\n\r\n"),
        (1, b"HTTP/1.1 200 \xff" + KEY.encode() + b"\r\ntransfer-encoding: chunked"),
    ),
    # Method and path rules; a CONNECT to a host with a leaf; requests inside tunnels.
    _seed((0, b"DELETE http://allowed.test/docs/a HTTP/1.1\r\nHost: a\r\n\r\n"), flags=4 | 128),
    _seed((0, b"GET http://allowed.test/docs/%2e%2e/x HTTP/1.1\r\nHost: a\r\n\r\n"), flags=132),
    _seed((0, b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: a\r\n\r\n"), flags=4 | 128),
    _seed((0, b"GET /docs/a HTTP/1.1\r\nHost: allowed.test\r\n\r\n"), flags=4 | 32 | 128),
    _seed((0, b"GET /docs/a HTTP/1.1\r\nHost: evil.test\r\n\r\n"), flags=4 | 32),
    _seed(
        (
            0,
            b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.test\r\nx-api-key: own\r\n"
            b"Content-Length: 2\r\n\r\n",
        ),
        (1, b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\nx-k: " + KEY.encode()),
        flags=4 | 32 | 64,
    ),
    _seed((0, b"POST /keeper/request HTTP/1.1\r\nHost: allowed.test\r\n\r\n"), flags=4 | 32),
]


if __name__ == "__main__":
    from seeded import fuzz

    fuzz("exchange", SEEDS, TestOneInput)
