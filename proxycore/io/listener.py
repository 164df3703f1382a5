"""Accepting agent connections: one task per connection, and the worker's task tree.

Theory of operation: `serve` runs the worker's services in one nursery (the event sink, the
reaper, the control channel) and an accept loop per listening socket; each accepted connection
gets its own task running `ClientConnection.run`, which contains every failure of its own
(proxycore/io/connection.py), so an accept loop only ever ends with the worker.

Before a connection gets a task it must arrive on a crew's gateway (else 403 `unknown_gateway`)
and fit the limits: the worker's connections, the crew's connections, and the worker's file
descriptors. Linux gives a new socket the lowest free descriptor number, so an accepted
descriptor numbered within `FD_HEADROOM` of RLIMIT_NOFILE means fewer than that many are left:
the connection is answered 503 while the ones already open keep the headroom for their
upstreams and tunnels. If accept itself fails for want of a descriptor, one held in reserve is
released to accept the connection, answer it 503 and close it, as nginx and Envoy do.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Sequence

import trio

from proxycore import control
from proxycore.config import ProxyConfig
from proxycore.errors import ProxyError
from proxycore.io.connection import ClientConnection
from proxycore.io.control_server import serve_control_channel, serve_control_socket
from proxycore.io.dns_server import DnsServer, proxy_resolve
from proxycore.io.fastio import LINGER_SECONDS, PlainStream, lingering_close
from proxycore.io.sinks import BatchingSink, EventSink
from proxycore.io.transparent import original_destination
from proxycore.protocol.dns_responder import DnsRefusal, DnsResponder
from proxycore.protocol.events import DnsRefused, RequestRefused
from proxycore.protocol.refusals import Refusal, refusal
from proxycore.protocol.scrubbing import scrub_json_lines
from proxycore.protocol.ssrf import AddressGuard
from proxycore.runtime import CrewState, ProxyRuntime

log = logging.getLogger("proxycore")

# Descriptors kept free for the connections already open (each may need an upstream socket, and
# a tunnel two pipes): new connections are refused 503 within this distance of the limit.
FD_HEADROOM = 64
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def bind_listeners(config: ProxyConfig, *, reuse_port: bool) -> list[trio.SocketListener]:
    """Bind the proxy port on every crew gateway and extra listen address."""
    addresses = dict.fromkeys([*(c.gateway for c in config.crew), *config.listen.addresses])
    bound: list[socket.socket] = []
    try:
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            bound.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                # Worker processes share the port; the kernel spreads connections among them.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address, config.listen.port))
            except OSError as exc:
                raise ProxyError(
                    f"cannot listen on {address}:{config.listen.port}: {exc.strerror}"
                ) from None
            sock.listen(config.listen.backlog)
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return [trio.SocketListener(trio.socket.from_stdlib_socket(sock)) for sock in bound]


class Acceptor:
    """What every accept loop shares: the runtime, the descriptor limit and the reserve."""

    def __init__(self, runtime: ProxyRuntime) -> None:
        self.runtime = runtime
        self.fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.reserve: int | None = _open_reserve()

    async def handle(self, sock: trio.socket.SocketType) -> None:
        """One accepted connection, from its first byte to its close. Never raises but for
        cancellation (ClientConnection.run contains its own failures)."""
        runtime = self.runtime
        limits = runtime.limits
        stream = PlainStream.adopt(sock)
        try:
            stream.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            local_address = stream.sock.getsockname()
            local = str(local_address[0]).split("%", 1)[0]
        except OSError:
            stream.close()
            return
        crew = runtime.crew_for(local)
        if crew is None:
            await self.refuse(
                stream,
                "-",
                403,
                Refusal(
                    error="unknown_gateway",
                    rule="unknown_gateway",
                    message=f"no crew is served on {local}",
                ),
            )
            return
        overloaded = None
        if stream.sock.fileno() >= self.fd_limit - FD_HEADROOM:
            overloaded = ("open_files", "the proxy is near its file descriptor limit")
        elif runtime.connections >= limits.max_connections:
            overloaded = ("max_connections", "the proxy has too many connections")
        elif crew.connections >= limits.max_connections_per_crew:
            overloaded = (
                "max_connections_per_crew",
                f"crew {crew.name} has {crew.connections} open connections",
            )
        if overloaded is not None:
            rule, why = overloaded
            body = Refusal(
                error="overloaded", rule=rule, crew=crew.name, message=f"{why}; try again shortly"
            )
            await self.refuse(stream, crew.name, 503, body)
            return
        runtime.connections += 1
        crew.connections += 1
        try:
            captured = original_destination(stream.sock, local, local_address[1])
            await ClientConnection(runtime, stream, crew, captured).run()
        finally:
            runtime.connections -= 1
            crew.connections -= 1

    async def refuse(self, stream: PlainStream, crew: str, status: int, body: Refusal) -> None:
        """A connection refused before any request was read: answered, recorded, closed."""
        state = self.runtime.crew_named(crew)
        mode = "" if state is None else state.mode
        self.runtime.sink.emit(
            RequestRefused(
                crew=crew,
                mode=mode,
                route="connection",
                method="",
                host="",
                port=0,
                rule=body.rule or body.error,
                status=status,
                message=body.message,
            )
        )
        with trio.move_on_after(LINGER_SECONDS):
            try:
                await stream.send_all(refusal(status, body, close=True))
            except trio.BrokenResourceError:
                pass
        await lingering_close(stream)

    async def accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        sock = listener.socket
        runtime = self.runtime
        try:
            # The crew this listening socket serves (its gateway), to pace its connections.
            local = str(sock.getsockname()[0]).split("%", 1)[0]
        except OSError:
            local = ""
        while True:
            crew = runtime.crew_for(local)
            if crew is not None:
                now = time.monotonic()
                if runtime.activity.contended(crew.name, now):
                    # Another crew is active: this crew's new connections keep to its pace and
                    # wait in its own listening socket's backlog meanwhile (fairness.py).
                    wait = crew.accepts.delay(now)
                    if wait:
                        await trio.sleep(wait)
            try:
                accepted, _ = await sock.accept()
            except OSError as exc:
                if exc.errno not in _OUT_OF_FDS:
                    if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                        continue  # the peer gave up while queued: nothing to serve
                    raise
                await self._accept_without_descriptors(sock)
                continue
            nursery.start_soon(self.handle, accepted)

    async def _accept_without_descriptors(self, sock: trio.socket.SocketType) -> None:
        """Out of descriptors: release the reserve to accept and refuse one connection (so
        the agent reads a 503 instead of waiting in the backlog), then back off briefly."""
        log.warning("proxy: out of file descriptors; refusing new connections with 503")
        if self.reserve is not None:
            os.close(self.reserve)
            self.reserve = None
            try:
                with trio.move_on_after(0.1):
                    accepted, _ = await sock.accept()
                    stream = PlainStream.adopt(accepted)
                    with trio.move_on_after(LINGER_SECONDS):
                        try:
                            await stream.send_all(
                                refusal(
                                    503,
                                    Refusal(
                                        error="overloaded",
                                        rule="open_files",
                                        message="the proxy is out of file descriptors; "
                                        "try again shortly",
                                    ),
                                    close=True,
                                )
                            )
                        except trio.BrokenResourceError:
                            pass
                    stream.close()
            except OSError:
                pass
            self.reserve = _open_reserve()
        await trio.sleep(0.1)


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


async def serve(
    config: ProxyConfig,
    sink: EventSink,
    *,
    listeners: list[trio.SocketListener] | None = None,
    control_channel: trio.SocketStream | None = None,
    runtime: ProxyRuntime | None = None,
    task_status: trio.TaskStatus[ProxyRuntime] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy until cancelled.

    `runtime` may be built beforehand (from `config` and `sink`): a worker that drops its
    privileges builds it first, while it can still read its CA bundle and credential files.
    """
    if runtime is None:
        runtime = ProxyRuntime(config, sink)
    if isinstance(sink, BatchingSink):
        scrubbers = runtime.scrubbers
        # Read at each write, so a credential added at run time is scrubbed from then on.
        sink.scrub = lambda batch: scrub_json_lines(scrubbers.current, batch)
    if listeners is None:
        listeners = bind_listeners(config, reuse_port=config.listen.workers > 1)
    acceptor = Acceptor(runtime)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(sink.run)
            nursery.start_soon(runtime.reap_expired)
            await nursery.start(runtime.h2.run)
            if control_channel is not None:
                nursery.start_soon(
                    _serve_control_channel, runtime, acceptor, control_channel, nursery
                )
            elif config.control.socket:
                await nursery.start(
                    serve_control_socket, config.control.socket, runtime.handle_control_async
                )
            for listener in listeners:
                nursery.start_soon(acceptor.accept_loop, listener, nursery)
            task_status.started(runtime)
    finally:
        runtime.dialer.discard_idle()
        if acceptor.reserve is not None:
            os.close(acceptor.reserve)


async def _serve_control_channel(
    runtime: ProxyRuntime,
    acceptor: Acceptor,
    channel: trio.SocketStream,
    nursery: trio.Nursery,
) -> None:
    """A child of applianced or of the worker supervisor: control messages (and the sockets of
    crews added at run time: a listening socket, and the crew's DNS sockets) arrive over a
    socketpair. When the parent is gone, the worker stops rather than serve a policy nobody can
    change (fail closed)."""
    scopes_by_crew: dict[str, list[trio.CancelScope]] = {}

    async def handler(
        message: control.ControlMessage, passed: tuple[socket.socket, ...]
    ) -> control.ControlReply:
        if passed and not isinstance(message, control.CrewAdd):
            for sock in passed:
                sock.close()
            passed = ()
        reply = runtime.handle_control(message)
        if isinstance(message, control.CrewRemove):
            for scope in scopes_by_crew.pop(message.name, ()):
                scope.cancel()
        elif isinstance(message, control.CrewAdd) and passed:
            if not reply.ok:
                for sock in passed:
                    sock.close()
                return reply
            rest = list(passed)
            scopes = scopes_by_crew.setdefault(message.name, [])
            if message.listener:
                scopes.append(await nursery.start(_serve_listener, rest.pop(0), acceptor, nursery))
            if message.dns:
                udp, tcp = rest
                crew = runtime.crew_named(message.name)
                assert crew is not None  # just added, no await since
                scopes.append(await nursery.start(_serve_dns, runtime, crew, udp, tcp))
        return reply

    await serve_control_channel(channel.socket, handler)
    # applianced closed it: it is stopping, or it stopped this worker (an expected end).
    log.info("control channel closed; stopping")
    nursery.cancel_scope.cancel()


async def _serve_dns(
    runtime: ProxyRuntime,
    crew: CrewState,
    udp: socket.socket,
    tcp: socket.socket,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the crew's DNS responder on the sockets applianced bound on its gateway, port 53,
    until the scope is cancelled (the crew removed, the worker stopping); the sockets close.

    The responder decides with the crew's own `CrewPolicy` object, so `crew allow`, approvals
    and address rules apply to its next query; it resolves with the proxy's resolver (the same
    split-horizon table and nameservers as the proxy's connections) under the crew's lookup
    limiter. `before_answer` does nothing: an answer opens nothing in the kernel (docs/proxy.md
    "DNS"). Every refusal is a `dns_refused` event."""
    dialer = runtime.dialer
    # The appliance-wide SSRF exceptions and the crew's own: the addresses the proxy would dial
    # for this crew (its address rules still decide each connection).
    ranges = crew.guard.ranges if crew.guard is not None else None
    guard = AddressGuard(
        (*dialer.guard.allowed_ranges, *(ranges.allowed_ranges if ranges is not None else ()))
    )
    sink = runtime.sink

    def journal(refusal: DnsRefusal) -> None:
        sink.emit(
            DnsRefused(
                crew=refusal.crew,
                name=refusal.name,
                qtype=refusal.qtype,
                rule=refusal.rule,
                rcode=refusal.rcode,
                count=refusal.count,
            )
        )

    async def before_answer(crew: str, addresses: Sequence[str], ttl: int) -> None:
        return None

    server = DnsServer(
        DnsResponder(crew.policy, guard=guard),
        resolve=proxy_resolve(dialer.resolver, crew.lookups),
        before_answer=before_answer,
        journal=journal,
    )
    with udp, tcp, trio.CancelScope() as scope:
        task_status.started(scope)
        try:
            await server.serve(udp, tcp)
        except Exception:
            # The server contains each query's failures; one that escapes it anyway (a bug)
            # ends this crew's DNS, never the worker and every other crew with it.
            log.exception("proxy: crew %s's DNS stopped on an unexpected error", crew.name)


async def _serve_listener(
    sock: socket.socket,
    acceptor: Acceptor,
    nursery: trio.Nursery,
    *,
    task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept on a listening socket handed down by the parent until the scope is cancelled."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    with trio.CancelScope() as scope:
        task_status.started(scope)
        try:
            await acceptor.accept_loop(listener, nursery)
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()
