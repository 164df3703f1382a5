"""The proxy worker's side of the keeper: serve a crew's keeper call, forward it to applianced.

`serve_keeper` runs a `ServeKeeper` plan on an agent connection: it reads the body (bounded),
lets the exchange check it (proxycore/protocol/exchange.py `check_keeper_call`), and forwards it.

One Unix-socket connection per call (`Connection: close`), one HTTP/1.1 exchange through h11,
everything under one deadline. applianced authenticates the connection by SO_PEERCRED and the
`X-Internal-Token` header; the crew travels in `X-Crew` and is always the crew of the gateway the
agent's connection arrived on (the caller passes `ConnectionTask.crew.name`), never a field of the
agent's body. Failures read as `KeeperUnavailable` (503): the agent gets no credential and no
command runs (fail closed).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import h11
import trio

from proxycore.errors import ProxyError
from proxycore.io.progress import Phase, Refused
from proxycore.protocol import http1
from proxycore.protocol.exchange import check_keeper_call, keeper_refused_event
from proxycore.protocol.keeper import KEEPER_BODY_BYTES, scrub_keeper_answer
from proxycore.protocol.plans import ServeKeeper
from proxycore.protocol.refusals import json_response

if TYPE_CHECKING:
    from proxycore.io.connection import ClientConnection

# An execute may run for its 120 s limit after the model's answer: the worker waits longer.
FORWARD_TIMEOUT_SECONDS = 180.0
MAX_ANSWER_BYTES = 4 << 20
INTERNAL_PREFIX = "/internal/keeper/"


class KeeperUnavailable(ProxyError):
    """applianced's keeper could not be reached or broke the protocol."""

    status_hint = 503


async def forward_to_keeper(
    socket_path: str,
    token: str,
    action: str,
    crew: str,
    body: bytes,
    *,
    timeout: float = FORWARD_TIMEOUT_SECONDS,
) -> tuple[int, bytes]:
    """(status, JSON body) of applianced's answer; KeeperUnavailable on any failure."""
    client = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target=INTERNAL_PREFIX + action,
        headers=[
            ("Host", "applianced"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
            ("X-Internal-Token", token),
            ("X-Crew", crew),
        ],
    )
    outgoing = b"".join(
        client.send(event) or b"" for event in (request, h11.Data(data=body), h11.EndOfMessage())
    )
    status = 0
    answer = bytearray()
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_unix_socket(socket_path)
            async with stream:
                await stream.send_all(outgoing)
                while True:
                    event = client.next_event()
                    if event is h11.NEED_DATA:
                        client.receive_data(await stream.receive_some(65536))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.Data):
                        answer += event.data
                        if len(answer) > MAX_ANSWER_BYTES:
                            raise KeeperUnavailable("the keeper's answer is too large")
                    elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                        break
    except trio.TooSlowError:
        raise KeeperUnavailable("the keeper did not answer in time") from None
    except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
        raise KeeperUnavailable(f"the keeper is unreachable ({type(exc).__name__})") from None
    if status == 0:
        raise KeeperUnavailable("the keeper closed the connection without an answer")
    return status, bytes(answer)


async def serve_keeper(conn: ClientConnection, plan: ServeKeeper, head: http1.RequestHead) -> bool:
    """`POST /keeper/request|execute`: checked here, decided by applianced (docs/keeper.md).

    The crew is this connection's (its gateway), whatever the body says. applianced has
    scrubbed an `execute`'s output with the store's values; every text field of the answer but
    a granted `request`'s value (which it must deliver) passes through this worker's scrubber
    too, for the keys only the proxy holds.
    """
    close = not plan.keep_alive
    body = b""
    if head.body_kind is not http1.BodyKind.NONE:
        reader = http1.BodyReader.for_request(head, conn.runtime.http_limits)
        body = await conn.read_body(reader, KEEPER_BODY_BYTES)
    refused = check_keeper_call(plan.request, plan.action, body, close=close)
    if refused is not None:
        conn.emit(keeper_refused_event(plan.request, plan.action, body, refused.event.rule))
        raise Refused(refused)
    channel = conn.runtime.keeper_channel
    if channel is None:
        raise Refused(
            plan.request.refused(
                503, "keeper_unavailable", "the keeper is not connected yet", close=close
            )
        )
    # The read deadline of the body must not cut the decision short (a model round-trip and
    # an execute's 120 s): forward_to_keeper bounds the wait itself, and answers 503.
    conn.phase = Phase.UPSTREAM
    conn.deadline = math.inf
    try:
        status, answer = await forward_to_keeper(
            channel.path, channel.token, plan.action.value, conn.crew.name, body
        )
    except KeeperUnavailable as exc:
        raise Refused(
            plan.request.refused(503, "keeper_unavailable", str(exc), close=close)
        ) from None
    scrubbed = scrub_keeper_answer(conn.runtime.scrubbers.current, plan.action, answer)
    if scrubbed is None:
        raise Refused(
            plan.request.refused(
                503, "keeper_unavailable", "the keeper's answer is not readable", close=close
            )
        )
    conn.response_started = True
    await conn.stream.send_all(json_response(status, scrubbed, close=close))
    conn.emit_allowed(status=status)
    return not close
