"""The trio adapter for one agent connection: owns its socket, its deadlines and its failures.

Theory of operation
-------------------
One task per agent connection. It reads a request head (proxycore/protocol/http1), asks the
exchange what to do (`proxycore.protocol.exchange.plan_request`: the connection never decides),
and carries the plan out: a refusal, the local API, a keeper call, a forward exchange
(proxycore/io/forward.py) or a tunnel (proxycore/io/tunnel.py). Then the next request, until the
agent or a plan closes the connection.

Deadlines: one cancel scope covers the whole connection; before each wait the connection sets a
plain float deadline for the phase about to start (idle, head, body, upstream, relay), which the
runtime's reaper enforces. What an expired deadline means is decided by the phase: a 408 while a
request is read, a 504 while the upstream is awaited, a close once a response is on its way.

Fault containment: nothing raised while serving this connection leaves its task. A refusal is
answered; an I/O error from either peer ends the exchange; anything else (a bug) is logged, with
the scrubber over the traceback, and answered 500 if no response byte has been sent yet. Only
cancellation from outside (the worker stopping) propagates. The task that accepted the connection
can therefore never be torn down by one, and neither can the worker.

The journal: every request that reached the proxy ends in exactly one terminal event (allowed,
denied, refused, errored; proxycore/protocol/events.py). `self.progress` holds the request until
its event is emitted; whatever ends the connection emits the event of a request still in it.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from typing import TYPE_CHECKING

import msgspec
import trio

from proxycore.errors import HttpProtocolError
from proxycore.io.fastio import LINGER_SECONDS, ByteStream, PlainStream, lingering_close
from proxycore.io.forward import serve_forward
from proxycore.io.forward_grpc import serve_duplex, takes_duplex
from proxycore.io.http2 import (
    PrefaceReceived,
    h2c_settings,
    serve_http2,
    serve_http2_upgrade,
)
from proxycore.io.keeper_client import serve_keeper
from proxycore.io.progress import RECV_SIZE, Phase, Progress, Refused
from proxycore.io.terminate import TerminatedTunnel, serve_terminated
from proxycore.io.transparent import Transparent, first_head, refusal_for_tls
from proxycore.io.tunnel import serve_tunnel
from proxycore.io.upstream import UpstreamConnection
from proxycore.io.websocket import serve_websocket
from proxycore.protocol import http1
from proxycore.protocol.events import Event, RequestAllowed, WebSocketSession
from proxycore.protocol.exchange import (
    DRAIN_LIMIT,
    close_after_refusal,
    plan_request,
    refuse_unparsed,
)
from proxycore.protocol.http2 import preface_state
from proxycore.protocol.plans import (
    Forward,
    OpenTunnel,
    OpenWebSocket,
    Refuse,
    Request,
    ServeKeeper,
    ServeLocal,
    TerminateTunnel,
)
from proxycore.protocol.refusals import Refusal, refusal

if TYPE_CHECKING:
    from proxycore.io.h2_stream import StreamPipe
    from proxycore.runtime import CrewState, ProxyRuntime

log = logging.getLogger("proxycore")


class ClientConnection:
    """One agent connection. Owns its socket and, for the length of an exchange, an upstream."""

    # Slots: a worker holds thousands of these while they idle (bench/bench_capacity.py).
    __slots__ = (
        "buffer",
        "crew",
        "deadline",
        "ended_by",
        "head_started",
        "limits",
        "phase",
        "pipe",
        "progress",
        "requests",
        "response_started",
        "runtime",
        "scope",
        "stream",
        "terminated",
        "transparent",
        "tunnel",
        "upstream",
    )

    def __init__(
        self,
        runtime: ProxyRuntime,
        stream: PlainStream,
        crew: CrewState,
        transparent: Transparent | None = None,
    ) -> None:
        self.runtime = runtime
        self.stream = stream
        self.crew = crew
        self.buffer = bytearray()
        self.response_started = False
        self.limits = runtime.limits
        self.phase = Phase.IDLE
        self.scope = trio.CancelScope()
        # Enforced by the runtime's reaper (see `ProxyRuntime.reap_expired`).
        self.deadline = math.inf
        self.upstream: UpstreamConnection | None = None
        self.requests = 0  # request heads read on this connection
        self.progress: Progress | None = None
        # When the current request's head began to arrive (the request's duration runs from
        # there).
        self.head_started = 0.0
        # Why the connection was ended from outside ("crew_removed"), if it was.
        self.ended_by: str | None = None
        # The HTTP/2 stream this exchange serves (proxycore/io/http2.py), which hands over its
        # request head whole and takes a decided response as status and fields; None: a
        # connection of its own.
        self.pipe: StreamPipe | None = None
        # Inside a terminated CONNECT tunnel (proxycore/io/terminate.py): its (host, port),
        # which every request read from now on is planned against, and the tunnel itself.
        self.tunnel: tuple[str, int] | None = None
        self.terminated: TerminatedTunnel | None = None
        # Redirected to the proxy by the kernel (proxycore/io/transparent.py): where it was
        # going. Its first request is read from its first bytes, not from a CONNECT line.
        self.transparent = transparent

    def end(self, reason: str) -> None:
        """End this connection from outside (its crew was removed)."""
        self.ended_by = reason
        self.scope.cancel()

    # -- the connection's life ----------------------------------------------------------------

    async def run(self) -> None:
        """Serve until the connection ends. Raises nothing but cancellation from outside."""
        try:
            await self._run()
        finally:
            tunnel = self.terminated
            if tunnel is not None:
                # After the last request's terminal event: the tunnel brackets its requests.
                self.terminated = None
                if self.ended_by is not None:
                    reason = self.ended_by
                elif self.scope.cancelled_caught:
                    reason = f"{self.phase.value} timeout"
                else:
                    reason = "closed"
                self.emit(tunnel.closed_event(self.crew.name, reason))

    async def _run(self) -> None:
        runtime, crew = self.runtime, self.crew
        runtime.live.add(self)
        crew.live.add(self)
        final: bytes | None = None
        contained = False
        try:
            try:
                with self.scope:
                    final = await self._serve_requests()
            except BaseException as exc:
                failure = _without_cancellation(exc)
                if failure is None:
                    self._finish_unanswered("shutdown")
                    raise
                final = self._contain(failure)
                contained = True
                if failure is not exc:
                    raise  # a cancellation from outside travelled with it: let it through
        finally:
            runtime.live.discard(self)
            crew.live.discard(self)
            if self.upstream is not None:
                # Interrupted mid-exchange (timeout, broken agent socket): never pooled.
                self.upstream.close()
                self.upstream = None
        if self.scope.cancelled_caught and not contained:
            final = self._on_cancelled()
        if final is not None:
            with trio.move_on_after(LINGER_SECONDS):
                try:
                    await self.stream.send_all(final)
                except trio.BrokenResourceError:
                    pass
            await lingering_close(self.stream)
        else:
            self.stream.close()

    def _contain(self, exc: BaseException) -> bytes | None:
        """A failure nobody planned for: log it (scrubbed), record it, answer 500 if we can."""
        if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError | OSError):
            # A peer went away under us: not a bug, nothing to answer.
            self._finish_unanswered("connection broken: " + _cause(exc))
            return None
        scrubber = self.runtime.scrubbers.current
        trace = "".join(traceback.format_exception(exc))
        log.error(
            "proxy: unexpected error serving crew %s (connection ended, worker unaffected): %s",
            self.crew.name,
            scrubber.scrub_text(_cause(exc)),
            extra={"crew": self.crew.name, "trace": scrubber.scrub_text(trace)},
        )
        status = 0 if self.response_started else 500
        self._emit_terminal_errored(scrubber.scrub_text(_cause(exc)), status)
        if status == 0:
            return None
        return refusal(
            500,
            Refusal(
                error="internal_error",
                message="the proxy failed while serving this request; it was recorded",
                crew=self.crew.name,
            ),
            close=True,
        )

    def _on_cancelled(self) -> bytes | None:
        """The connection's own scope was cancelled: a deadline, or `end()`."""
        if self.ended_by is not None:
            self._finish_unanswered(self.ended_by)
            return None
        progress = self.progress
        if self.response_started or (progress is None and not self.buffer):
            self._finish_unanswered(f"{self.phase.value} timeout")
            return None
        crew = self.crew
        request = progress.request if progress is not None else Request(crew.name, crew.mode)
        if self.phase in (Phase.IDLE, Phase.HEAD, Phase.BODY):
            plan = request.refused(
                408,
                "request_timeout",
                f"request {'head' if self.phase is not Phase.BODY else 'body'} "
                "not received in time",
                close=True,
            )
        else:
            plan = request.refused(
                504,
                "upstream_timeout",
                "the upstream did not answer in time",
                rule="upstream_timeout",
                close=True,
            )
        if progress is None:
            self.progress = Progress(request, time.monotonic())
        return self._refusal_bytes(plan)

    async def _serve_requests(self) -> bytes | None:
        """Serve requests until the connection ends; returns a final answer to send, if any."""
        while True:
            self.response_started = False
            self.progress = None
            try:
                if self.pipe is not None:
                    head = self._stream_head()
                elif self.transparent is not None and self.requests == 0:
                    head = await first_head(self)
                else:
                    head = await self.read_head()
            except Refused as refused:
                # A captured connection refused from its first bytes (transparent.py).
                self.progress = Progress(_request_of(refused.plan, self.crew), self.head_started)
                return self._refusal_bytes(refused.plan)
            except PrefaceReceived:
                await serve_http2(self)
                return None
            except HttpProtocolError as exc:
                crew = self.crew
                plan = refuse_unparsed(crew.name, crew.mode, exc.status_hint, str(exc))
                self.progress = Progress(Request(crew.name, crew.mode), self.head_started)
                return self._refusal_bytes(plan)
            if head is None:
                return None
            try:
                keep_alive = await self._serve(head)
            except Refused as refused:
                if self.upstream is not None:
                    self.upstream.close()  # an exchange left half done is never pooled
                    self.upstream = None
                final = await self._answer_refusal(refused.plan, head)
                if final is not None:
                    return final
                continue
            if not keep_alive:
                return None

    async def _serve(self, head: http1.RequestHead) -> bool:
        """Carry out the exchange's plan for one request; returns whether to keep the
        connection. Raises Refused for an answer the caller writes."""
        runtime, crew = self.runtime, self.crew
        # Upgrade: h2c (RFC 7540 3.2): the request is served as HTTP/2 stream 1. Never inside
        # a terminated tunnel: h2c is for cleartext only (RFC 9113 3.1).
        settings = h2c_settings(head) if head.nominates and self.tunnel is None else None
        if settings is not None and await serve_http2_upgrade(self, head, settings):
            return False
        started = self.head_started
        activity = runtime.activity
        activity.note(crew.name, started)
        if activity.contended(crew.name, started):
            await self._wait_for_turn(head, started)
        plan = plan_request(
            head,
            crew.policy,
            runtime.routes,
            audit_blocked=runtime.audit_paused or runtime.sink.backlogged,
            max_body=self.limits.max_body_bytes,
            leaves=crew.leaves,
            tunnel=self.tunnel,
            # Only a captured cleartext connection is planned against its host in the clear.
            tunnel_tls=self.transparent is None or self.transparent.tls,
        )
        if isinstance(plan, Forward):
            self.progress = Progress(
                plan.request, started, body_consumed=head.body_kind is http1.BodyKind.NONE
            )
            if takes_duplex(head):  # gRPC: its body and its response stream together
                return await serve_duplex(self, plan, head)
            return await serve_forward(self, plan, head)
        if isinstance(plan, Refuse):
            self.progress = Progress(_request_of(plan, crew), started)
            raise Refused(plan)
        if isinstance(plan, OpenWebSocket):
            self.progress = Progress(plan.request, started, body_consumed=True)
            return await serve_websocket(self, plan, head)
        self.progress = Progress(
            plan.request, started, body_consumed=head.body_kind is http1.BodyKind.NONE
        )
        if isinstance(plan, ServeLocal):
            await self.discard_body(head, 0)
            self.response_started = True
            await self.stream.send_all(plan.response)
            self.emit_allowed(200)
            return plan.keep_alive
        if isinstance(plan, ServeKeeper):
            return await serve_keeper(self, plan, head)
        if isinstance(plan, TerminateTunnel):
            # True: the requests inside are read next, by this same loop.
            if not await serve_terminated(self, plan):
                return False
            assert self.terminated is not None
            if self.terminated.stream.tls.selected_alpn_protocol() == "h2":
                # The agent chose HTTP/2 (ALPN): the rest of the tunnel is one HTTP/2
                # connection, its streams planned against the tunnel as these requests are.
                await serve_http2(self)
                return False
            return True
        assert isinstance(plan, OpenTunnel)
        await serve_tunnel(self, plan)
        return False

    async def _wait_for_turn(self, head: http1.RequestHead, now: float) -> None:
        """Another crew is active: this crew's requests keep to their pace (fairness.py).
        Waiting costs nothing (asleep); a turn further away than `fair_max_wait` is a 429."""
        crew = self.crew
        wait = crew.requests.delay(now)
        if not wait:
            return
        if wait > crew.requests.max_wait:
            request = Request(crew.name, crew.mode, method=head.method.decode("ascii", "replace"))
            self.progress = Progress(request, now)
            raise Refused(
                request.refused(
                    429,
                    "rate_limited",
                    f"crew {crew.name} is sending requests faster than its share of the proxy "
                    "while other crews are active; retry shortly",
                    rule="fair_share",
                    close=close_after_refusal(head),
                )
            )
        self.phase = Phase.QUEUED
        self.deadline = math.inf
        await trio.sleep(wait)

    # -- terminal events ----------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        self.runtime.sink.emit(event)

    def emit_allowed(
        self, status: int, ended: str = "complete", websocket: WebSocketSession | None = None
    ) -> None:
        """The request's terminal event for an answer relayed (RequestAllowed)."""
        progress = self.progress
        if progress is None:
            return
        self.progress = None
        request = progress.request
        self.runtime.sink.emit(
            RequestAllowed(
                crew=request.crew,
                mode=request.mode,
                route=request.route,
                method=request.method,
                host=request.host,
                port=request.port,
                address=progress.address,
                rule=progress.rule,
                status=status,
                bytes_up=progress.bytes_up,
                bytes_down=progress.bytes_down,
                duration=time.monotonic() - progress.started,
                complete=ended == "complete",
                ended=ended,
                redactions=progress.redactions,
                websocket=websocket,
            )
        )

    def _emit_terminal_errored(self, cause: str, status: int) -> None:
        progress = self.progress
        if progress is None:
            return
        self.progress = None
        self.emit(progress.request.errored(cause, status))

    def _finish_unanswered(self, why: str) -> None:
        """The connection ends with a request still in it and nothing more to tell its agent:
        a response on its way was cut (allowed, not complete), or nothing was sent (errored)."""
        progress = self.progress
        if progress is None:
            return
        if self.response_started and progress.status:
            self.emit_allowed(progress.status, why)
        else:
            self._emit_terminal_errored(why, 0)

    def _refusal_bytes(self, plan: Refuse) -> bytes:
        """Emit the refusal's event (the request's terminal one) and render it, scrubbed."""
        if self.progress is not None:
            self.progress = None
            self.emit(plan.event)
        captured = self.transparent
        if captured is not None and captured.tls and self.terminated is None:
            # A TLS client that never asked for a proxy reads no HTTP: an alert.
            return refusal_for_tls(plan)
        return refusal(plan.status, self._scrubbed(plan.body), close=plan.close)

    def _scrubbed(self, body: Refusal) -> Refusal:
        """A refusal's message can quote an upstream or the agent's input: scrub it too."""
        message = self.runtime.scrubbers.current.scrub_text(body.message)
        return body if message == body.message else msgspec.structs.replace(body, message=message)

    async def _answer_refusal(self, plan: Refuse, head: http1.RequestHead) -> bytes | None:
        """Answer a refusal: returns the bytes to send before closing, or sends them itself
        and returns None when the connection carries on (its body drained first)."""
        if self.response_started:
            # Too late for an answer: the connection can only end.
            self._finish_unanswered(f"refused after the response began: {plan.event.rule}")
            return b""
        captured = self.transparent
        if captured is not None and captured.tls and self.terminated is None and not plan.close:
            # A TLS client refused with an alert (a fair-share wait, say) cannot go on: what
            # is buffered is its ClientHello, not a next request.
            plan = msgspec.structs.replace(plan, close=True)
        progress = self.progress
        if (
            not plan.close
            and progress is not None
            and not progress.body_consumed
            and (close_after_refusal(head) or not await self._drain(head))
        ):
            plan = msgspec.structs.replace(plan, close=True)
        data = self._refusal_bytes(plan)
        if plan.close:
            return data
        await self.stream.send_all(data)
        return None

    async def _drain(self, head: http1.RequestHead) -> bool:
        """Read and discard a refused request's body (at most DRAIN_LIMIT bytes, within the head
        timeout), so the next request starts where it should; False: close instead."""
        reader = http1.BodyReader.for_request(head, self.runtime.http_limits)
        deadline = time.monotonic() + self.limits.head_timeout
        drained = 0
        try:
            while not reader.done:
                data = await self._receive_body(deadline)
                if not data:
                    reader.feed_eof()
                drained += len(reader.feed(data))
                if drained > DRAIN_LIMIT:
                    return False
        except HttpProtocolError:
            return False
        self.buffer[:0] = reader.take_leftover()
        return True

    # -- reading ------------------------------------------------------------------------------

    async def _receive(
        self, stream: ByteStream, phase: Phase, deadline: float, *, answer_pending: bool = False
    ) -> bytes:
        """Receive for `phase`; the deadline is armed only if the kernel has nothing yet.

        `answer_pending`: we just sent something the peer must answer first (a request to the
        upstream, a response to the agent), so do not try the kernel before waiting.
        """
        if not answer_pending:
            data = stream.try_receive(RECV_SIZE)
            if data is not None:
                return data
        self.phase = phase
        self.deadline = deadline
        return await stream.receive_after_wait(RECV_SIZE)

    async def read_head(self) -> http1.RequestHead | None:
        """The next request head, or None when the agent closed the connection."""
        limits = self.limits
        buffer = self.buffer
        now = time.monotonic()
        # Idle between requests: the keep-alive timeout. From the first byte of a head, the whole
        # head must arrive within head_timeout (slowloris), however it is dribbled.
        head_deadline = now + limits.head_timeout if buffer else math.inf
        while True:
            if buffer[:3] == b"PRI" and self.requests == 0 and preface_state(buffer) is not False:
                # HTTP/2 with prior knowledge (RFC 9113 3.3): the client preface where the
                # first head would start; read on while it is only a prefix of it.
                if preface_state(buffer):
                    raise PrefaceReceived
            elif buffer:
                parsed = http1.parse_request_head(buffer, self.runtime.http_limits)
                if parsed is not None:
                    head, consumed = parsed
                    self.requests += 1
                    del buffer[:consumed]
                    self.head_started = now
                    return head
            if buffer:
                data = await self._receive(self.stream, Phase.HEAD, head_deadline)
            else:
                # After a response the agent has nothing more to say until it reads it.
                data = await self._receive(
                    self.stream,
                    Phase.IDLE,
                    now + limits.idle_keepalive_timeout,
                    answer_pending=self.requests > 0,
                )
            if not data:
                # Empty lines a client sent after its last request (RFC 9112 2.2 lets it send
                # them before the next one) are no request: the close is a quiet one.
                if buffer.strip(b"\r\n"):
                    raise HttpProtocolError("connection closed inside a request head")
                return None
            if not buffer:
                now = time.monotonic()
                head_deadline = now + limits.head_timeout
            buffer += data

    def _stream_head(self) -> http1.RequestHead | None:
        """The request head of this exchange's HTTP/2 stream, handed over whole: read by the
        same parser as a socket's (the same checks, the same refusals), once (a stream carries
        one exchange; None after it, as a socket's end reads)."""
        assert self.pipe is not None
        raw = self.pipe.take_head()
        if raw is None:
            return None
        self.head_started = time.monotonic()
        parsed = http1.parse_request_head(raw, self.runtime.http_limits)
        if parsed is None:
            raise HttpProtocolError("connection closed inside a request head")
        head, consumed = parsed
        self.requests += 1
        self.buffer += raw[consumed:]
        return head

    async def _receive_body(self, deadline: float | None = None) -> bytes:
        if self.buffer:
            data = bytes(self.buffer)
            self.buffer.clear()
            return data
        if deadline is None:
            deadline = time.monotonic() + self.limits.read_timeout
        return await self._receive(self.stream, Phase.BODY, deadline)

    async def read_body(self, reader: http1.BodyReader, cap: int) -> bytes:
        """Read a body whole; Refused (413) past `cap` bytes, (400) on bad framing."""
        body = bytearray()
        try:
            while not reader.done:
                data = await self._receive_body()
                if not data:
                    reader.feed_eof()
                body += reader.feed(data)
                if len(body) > cap:
                    raise Refused(self.too_large(cap))
        except HttpProtocolError as exc:
            raise Refused(self.bad_body(exc)) from None
        self.buffer[:0] = reader.take_leftover()
        if self.progress is not None:
            self.progress.body_consumed = True
        return bytes(body)

    async def discard_body(self, head: http1.RequestHead, cap: int) -> None:
        if head.body_kind is not http1.BodyKind.NONE:
            await self.read_body(http1.BodyReader.for_request(head, self.runtime.http_limits), cap)

    def too_large(self, cap: int) -> Refuse:
        return self.current_request().refused(
            413, "body_too_large", f"request body over {cap} bytes", close=True
        )

    def bad_body(self, exc: HttpProtocolError) -> Refuse:
        return self.current_request().refused(
            exc.status_hint, "bad_request", f"request body: {exc}", close=True
        )

    def current_request(self) -> Request:
        if self.progress is not None:
            return self.progress.request
        return Request(self.crew.name, self.crew.mode)


def _request_of(plan: Refuse, crew: CrewState) -> Request:
    event = plan.event
    return Request(crew.name, crew.mode, event.route, event.method, event.host, event.port)


def _without_cancellation(exc: BaseException) -> BaseException | None:
    """`exc` minus trio's cancellations (None if nothing else is left). KeyboardInterrupt and
    SystemExit are never contained."""
    if isinstance(exc, trio.Cancelled | KeyboardInterrupt | SystemExit | GeneratorExit):
        return None
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split((trio.Cancelled, KeyboardInterrupt, SystemExit, GeneratorExit))
        return rest
    return exc


def _cause(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_cause(inner) for inner in exc.exceptions)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
