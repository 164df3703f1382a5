"""WebSocket sessions on an agent connection: the handshake upstream, then frames both ways.

Theory of operation: the exchange has planned an `OpenWebSocket` (proxycore/protocol/
websocket.py: policy, injection and the agent's offer checked). `serve_websocket` dials a fresh
upstream connection (never a pooled one: it will not come back), sends the handshake and reads
the answer. Anything but a 101 is an ordinary response, relayed as the forward path relays any
(proxycore/io/forward.py `relay_response`). A 101 that fails the client's checks is a 502; a
good one is answered to the agent and the session begins.

The session is a reader and a writer per side around one sans-IO `WebSocketRelay`
(proxycore/protocol/wsrelay.py). A reader reads its side, hands the bytes to the relay and
waits until the writer of the other side has sent what that made before it reads again:
backpressure, so a session holds at most what one read brought in per direction. A writer
sends its side what the relay has for it, in the order the relay made it. Each direction waits
only on its own peer: one that stops reading stalls its direction, never the other (a proxy
must not add a coupling that a direct connection would not have). A read is `READ_SIZE` bytes
while the crew's buffer budget (`max_buffered_bytes_per_crew`, shared with bodies) has room for
it and its output, else `SMALL_READ` bytes: what a crew's sessions hold is bounded by its budget
plus that small read per direction and connection.

A fifth task keeps the deadlines: no byte moved either way for `ws_idle_timeout` starts a close
with both sides (1001); once a Close has been sent, an answer is awaited for `ws_close_timeout`
at most, then the connections are dropped. The sides are byte streams (`receive`, `send_all`),
so the same session runs over an HTTP/2 stream (RFC 8441 extended CONNECT,
proxycore/io/websocket_h2.py): that stream is the agent's side, and is told at the end whether
the agent was sent its Close (`SessionCarrier`).

The session's request ends in one terminal event, `request_allowed` with status 101, when the
session ends, whatever ends it: payload bytes both ways, frames and messages, who closed, why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import trio

from proxycore.errors import HttpProtocolError, PolicyDenied, UpstreamError
from proxycore.io.forward import relay_response
from proxycore.io.progress import Phase, Refused, upstream_refusal
from proxycore.io.upstream import UpstreamConnection
from proxycore.protocol import http1
from proxycore.protocol.events import CredentialInjected, WebSocketSession
from proxycore.protocol.plans import OpenWebSocket, Refuse
from proxycore.protocol.websocket import check_switch, switching_head
from proxycore.protocol.wsrelay import Side, WebSocketLimits, WebSocketRelay

if TYPE_CHECKING:
    from proxycore.io.connection import ClientConnection
    from proxycore.runtime import BufferBudget

READ_SIZE = 64 * 1024
SMALL_READ = 4 * 1024
# How long a session ended from outside may take to tell its peers (a Close each).
GOING_AWAY_SECONDS = 0.5
_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class FrameStream(Protocol):
    """What a session needs of each side: a byte stream (a socket, TLS, an h2 stream)."""

    async def receive(self, max_bytes: int) -> bytes: ...

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...


@runtime_checkable
class SessionCarrier(Protocol):
    """An agent side that carries the session on a stream of its own (an HTTP/2 stream, RFC
    8441: proxycore/io/websocket_h2.py), told at the end whether it may end in order."""

    def session_ended(self, in_order: bool) -> None: ...


def websocket_limits(conn: ClientConnection) -> WebSocketLimits:
    limits = conn.limits
    return WebSocketLimits(
        max_message_bytes=limits.ws_max_message_bytes,
        control_per_second=limits.ws_control_frames_per_second,
        idle_timeout=limits.ws_idle_timeout,
        close_timeout=limits.ws_close_timeout,
    )


async def serve_websocket(
    conn: ClientConnection, plan: OpenWebSocket, head: http1.RequestHead
) -> bool:
    """Carry out an OpenWebSocket plan; returns whether the agent's connection stays open (only
    after an upstream refused the upgrade with an ordinary response)."""
    forward = plan.forward
    progress = conn.progress
    assert progress is not None
    if forward.provider is not None:
        progress.rule = "provider"
    upstream = await _open(conn, plan)
    response = await _handshake(conn, plan, upstream)
    if response.status != 101:
        return await relay_response(conn, forward, head, upstream, response)
    why = check_switch(plan, response)
    if why is not None:
        raise Refused(_failed(plan, f"{forward.host} failed the websocket handshake: {why}"))
    progress.address = upstream.address
    progress.status = 101
    if forward.provider is not None:
        conn.emit(
            CredentialInjected(
                crew=conn.crew.name, provider=forward.provider.value, host=forward.host
            )
        )
    scrubber = conn.runtime.scrubbers.current
    relay = WebSocketRelay(scrubber, websocket_limits(conn))
    try:
        conn.response_started = True
        await conn.stream.send_all(switching_head(response, scrubber))
        # The session keeps its own deadlines; lift the connection's.
        conn.phase = Phase.RELAY
        conn.deadline = math.inf
        agent_prefix = bytes(conn.buffer)
        conn.buffer.clear()
        upstream_prefix = bytes(upstream.buffer)
        upstream.buffer.clear()
        await run_session(
            relay,
            conn.stream,
            upstream.stream,
            conn.crew.buffered,
            agent_prefix=agent_prefix,
            upstream_prefix=upstream_prefix,
        )
    except _BROKEN as exc:
        relay.lost(Side.AGENT, f"agent_reset: {exc}")
    finally:
        if not relay.done:
            # Ended from outside (the crew removed, the worker stopping): say so to both sides,
            # briefly, rather than drop them without a Close.
            relay.go_away(conn.ended_by or "shutdown", "going away")
            with trio.CancelScope(shield=True), trio.move_on_after(GOING_AWAY_SECONDS):
                for side, stream in ((Side.AGENT, conn.stream), (Side.UPSTREAM, upstream.stream)):
                    out = relay.take(side)
                    if out:
                        try:
                            await stream.send_all(out)
                        except _BROKEN:
                            pass
        if isinstance(conn.stream, SessionCarrier):
            # RFC 8441 5: END_STREAM once the agent has its Close, else RST_STREAM.
            conn.stream.session_ended(relay.closed_in_order(Side.AGENT))
        upstream.close()
        conn.upstream = None
        ended = conn.ended_by or relay.ended or "shutdown"
        bytes_up, frames_up, messages_up = relay.stats(Side.AGENT)
        _, frames_down, messages_down = relay.stats(Side.UPSTREAM)
        progress.bytes_up = bytes_up
        progress.bytes_down = relay.bytes_down
        progress.redactions = relay.redactions
        conn.emit_allowed(
            101,
            ended,
            WebSocketSession(
                frames_up=frames_up,
                frames_down=frames_down,
                messages_up=messages_up,
                messages_down=messages_down,
                closed_by=relay.closed_by,
                close_code=relay.close_code,
            ),
        )
    return False


# -- the handshake ------------------------------------------------------------------------------


def _failed(plan: OpenWebSocket, message: str, rule: str = "websocket_handshake") -> Refuse:
    return plan.request.refused(502, "upstream_failed", message, rule=rule, close=True)


async def _open(conn: ClientConnection, plan: OpenWebSocket) -> UpstreamConnection:
    """A fresh upstream connection: a session never returns its connection to the pool."""
    crew, forward = conn.crew, plan.forward
    conn.phase = Phase.UPSTREAM
    conn.deadline = math.inf  # the dialer bounds lookups, connects and handshakes itself
    try:
        upstream = await conn.runtime.dialer.open(
            crew.name, crew.lookups, crew.guard, forward.tls, forward.host, forward.port
        )
    except PolicyDenied as exc:
        raise Refused(plan.request.denied(exc.rule, str(exc), close=True)) from None
    except UpstreamError as exc:
        raise Refused(upstream_refusal(plan.request, exc, close=True)) from None
    conn.upstream = upstream
    return upstream


async def _handshake(
    conn: ClientConnection, plan: OpenWebSocket, upstream: UpstreamConnection
) -> http1.ResponseHead:
    """Send the handshake; the upstream's final answer (interim 1xx but 101 dropped)."""
    forward = plan.forward
    deadline = time.monotonic() + conn.limits.read_timeout
    conn.phase = Phase.UPSTREAM
    conn.deadline = deadline
    buffer = upstream.buffer
    try:
        await upstream.stream.send_all(forward.upstream_head(None))
        answer_pending = True
        while True:
            if buffer:
                parsed = http1.parse_response_head(
                    buffer, conn.runtime.http_limits, request_method=b"GET"
                )
                if parsed is not None:
                    response, consumed = parsed
                    del buffer[:consumed]
                    if 100 <= response.status < 200 and response.status != 101:
                        continue  # interim (103 Early Hints): not relayed
                    return response
            data = await conn._receive(
                upstream.stream, Phase.UPSTREAM, deadline, answer_pending=answer_pending
            )
            answer_pending = False
            if not data:
                raise Refused(
                    _failed(
                        plan,
                        f"{forward.host} closed the connection before answering the handshake",
                        "upstream_closed",
                    )
                )
            buffer += data
    except HttpProtocolError as exc:
        raise Refused(
            _failed(
                plan, f"{forward.host} sent a malformed response: {exc}", "upstream_protocol_error"
            )
        ) from None
    except _BROKEN as exc:
        raise Refused(
            _failed(plan, f"{forward.host} closed the connection: {exc}", "upstream_closed")
        ) from None


# -- the session --------------------------------------------------------------------------------


async def run_session(
    relay: WebSocketRelay,
    agent: FrameStream,
    upstream: FrameStream,
    budget: BufferBudget,
    *,
    agent_prefix: bytes = b"",
    upstream_prefix: bytes = b"",
) -> None:
    """Relay until the relay is done or a deadline gives up on it (see the module docstring).
    Raises nothing for what a peer does; only cancellation from outside propagates."""
    session = Session(relay, agent, upstream, budget)
    now = trio.current_time()
    if agent_prefix:
        relay.receive(Side.AGENT, agent_prefix, now)
    if upstream_prefix:
        relay.receive(Side.UPSTREAM, upstream_prefix, now)
    async with trio.open_nursery() as nursery:
        session.nursery = nursery
        nursery.start_soon(session.keep_deadlines)
        for side in Side:
            nursery.start_soon(session.write, side)
            nursery.start_soon(session.read, side)
        session.changed()


class Session:
    """The trio side of one relayed session: a reader and a writer per side, and the deadlines.

    A reader reads its side, hands the bytes to the relay, and waits until what that made for
    the other side has been sent before it reads again (backpressure). A writer sends its side
    whatever the relay has for it, in the order the relay made it. So a direction blocked on a
    peer that does not read never holds up the other direction: each waits only on its own.
    """

    def __init__(
        self,
        relay: WebSocketRelay,
        agent: FrameStream,
        upstream: FrameStream,
        budget: BufferBudget,
    ) -> None:
        self.relay = relay
        self.streams = {Side.AGENT: agent, Side.UPSTREAM: upstream}
        self.budget = budget
        self.nursery: trio.Nursery | None = None
        self.idle_deadline = trio.current_time() + relay.limits.idle_timeout
        self.close_deadline = math.inf
        self._changed = trio.Event()  # set, and replaced, whenever the relay's state moves

    def touch(self) -> None:
        self.idle_deadline = trio.current_time() + self.relay.limits.idle_timeout

    def changed(self) -> None:
        """The relay's state moved: arm the close deadline, end a finished session, wake all."""
        relay = self.relay
        if (relay.closing or relay.done) and self.close_deadline == math.inf:
            # A Close awaits its answer, or the last frames of a finished session go out: both
            # are bounded by the close timeout.
            self.close_deadline = trio.current_time() + relay.limits.close_timeout
        if relay.done and not self._pending() and self.nursery is not None:
            self.nursery.cancel_scope.cancel()
        self._changed.set()
        self._changed = trio.Event()

    def _pending(self) -> bool:
        return self.relay.pending(Side.AGENT) or self.relay.pending(Side.UPSTREAM)

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    async def read(self, side: Side) -> None:
        relay, stream, budget = self.relay, self.streams[side], self.budget
        other = side.other
        while relay.wants_input(side):
            # The read and what it becomes are held against the crew's budget until sent.
            held = 2 * READ_SIZE if budget.take(2 * READ_SIZE) else 0
            try:
                try:
                    data = await stream.receive(READ_SIZE if held else SMALL_READ)
                except _BROKEN as exc:
                    relay.lost(side, f"{side.value}_reset: {exc}")
                else:
                    self.touch()
                    relay.receive(side, data, trio.current_time())
                self.changed()
                await self._until(lambda: not relay.pending(other))
            finally:
                if held:
                    budget.give_back(held)

    async def write(self, side: Side) -> None:
        relay, stream = self.relay, self.streams[side]
        while True:
            await self._until(lambda: relay.pending(side))
            out = relay.take(side)
            try:
                await stream.send_all(out)
            except _BROKEN as exc:
                relay.lost(side, f"{side.value}_reset: {exc}")
            else:
                self.touch()
            self.changed()

    async def keep_deadlines(self) -> None:
        relay = self.relay
        while True:
            closing = self.close_deadline != math.inf
            with trio.move_on_at(self.close_deadline if closing else self.idle_deadline):
                await self._changed.wait()
            now = trio.current_time()
            if now >= self.close_deadline:
                relay.expire_close()
                self.changed()
                # Whatever Close answers are owed go out if they can, briefly.
                with trio.move_on_after(min(1.0, relay.limits.close_timeout)):
                    await self._until(lambda: not self._pending())
                assert self.nursery is not None
                self.nursery.cancel_scope.cancel()
                return
            if now >= self.idle_deadline and not closing:
                relay.expire_idle()
                self.changed()
