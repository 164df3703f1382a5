"""Reaching upstreams: resolve once, check every address, dial exactly what was checked.

Theory of operation: `Dialer.resolve` turns a host into addresses once (the operator's
split-horizon table first, then the system resolver; an IP literal is its own answer), and the
SSRF guard checks every answer. If any answer is refused the whole name is refused: a name that
resolves to both a public and a private address is the shape of a DNS-rebinding attack. The
socket is then connected to a checked address itself, never to the name, so a second resolution
can not swap the destination between check and use.

Kept-alive upstream connections are pooled per (tls, host, port); a pooled connection was checked
when it was opened, so its reuse needs no new resolution. TLS to upstreams always verifies the
certificate against the host name (credentials only ever travel on such connections).
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import trio

from proxycore.errors import PolicyDenied, UpstreamError
from proxycore.io.fastio import ByteStream, PlainStream, TlsStream
from proxycore.protocol.ssrf import AddressGuard

PoolKey = tuple[bool, str, int]
IDLE_POOL_SECONDS = 30.0


@dataclass(slots=True, eq=False)
class UpstreamConnection:
    """One connection to an upstream, with the bytes read past the last response."""

    key: PoolKey
    address: str
    stream: ByteStream
    buffer: bytearray = field(default_factory=bytearray)
    reused: bool = False
    idle_since: float = 0.0

    def close(self) -> None:
        self.stream.close()


def make_tls_context(ca_file: str | None, ca_file_only: bool) -> ssl.SSLContext:
    if ca_file_only:
        context = ssl.create_default_context(cafile=ca_file)
    else:
        context = ssl.create_default_context()
        if ca_file:
            context.load_verify_locations(cafile=ca_file)
    # create_default_context already sets CERT_REQUIRED and check_hostname; state it anyway
    # because credentials depend on it.
    context.verify_mode = ssl.CERT_REQUIRED
    context.check_hostname = True
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    return context


class Dialer:
    def __init__(
        self,
        guard: AddressGuard,
        overrides: Mapping[str, str],
        tls: ssl.SSLContext,
        *,
        connect_timeout: float,
        pool_per_host: int,
    ) -> None:
        self.guard = guard
        self.overrides = {host.lower(): address for host, address in overrides.items()}
        self.tls = tls
        self.connect_timeout = connect_timeout
        self.pool_per_host = pool_per_host
        self._idle: dict[PoolKey, list[UpstreamConnection]] = {}

    async def resolve(self, host: str, port: int) -> list[str]:
        """Resolve once and check every answer; raises PolicyDenied naming the refused one."""
        override = self.overrides.get(host)
        if override is not None:
            addresses = [override]
        elif _is_ip(host):
            addresses = [host]
        else:
            try:
                with trio.fail_after(self.connect_timeout):
                    infos = await trio.socket.getaddrinfo(
                        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                    )
            except (OSError, trio.TooSlowError):
                raise PolicyDenied(
                    f"cannot resolve {host}", host=host, rule="dns_resolution_failed"
                ) from None
            addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        for address in addresses:
            verdict = self.guard.check(address)
            if not verdict.allowed:
                raise PolicyDenied(
                    f"{host} resolves to {address} ({verdict.reason}), "
                    "which is not a public address",
                    host=host,
                    rule=f"ssrf_{verdict.reason}",
                )
        return addresses

    async def checkout(self, tls: bool, host: str, port: int) -> UpstreamConnection:
        key = (tls, host, port)
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if now - connection.idle_since > IDLE_POOL_SECONDS:
                # Servers close idle keep-alive connections after a few seconds (nginx 75 s,
                # many APIs less); older ones are likelier dead than reusable.
                connection.close()
                continue
            connection.reused = True
            return connection
        return await self.open(tls, host, port)

    async def open(self, tls: bool, host: str, port: int) -> UpstreamConnection:
        addresses = await self.resolve(host, port)
        sock = await self.connect_checked(addresses, port, host)
        peer = str(sock.getpeername()[0])
        if not tls:
            return UpstreamConnection((tls, host, port), peer, PlainStream(sock))
        transport = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        ssl_stream = trio.SSLStream(
            transport, self.tls, server_hostname=host, https_compatible=True
        )
        try:
            with trio.fail_after(self.connect_timeout):
                await ssl_stream.do_handshake()
        except trio.TooSlowError:
            await trio.aclose_forcefully(transport)
            raise UpstreamError(f"TLS handshake with {host} timed out", status_hint=504) from None
        except (trio.BrokenResourceError, ssl.SSLError) as exc:
            await trio.aclose_forcefully(transport)
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            raise UpstreamError(f"TLS with {host} failed: {cause}") from None
        return UpstreamConnection((tls, host, port), peer, TlsStream(ssl_stream, sock))

    async def connect_checked(
        self, addresses: Iterable[str], port: int, host: str
    ) -> socket.socket:
        """Connect (non-blocking) to the first reachable address of those already checked."""
        last_error = "no address"
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with trio.fail_after(self.connect_timeout):
                    try:
                        sock.connect((address, port))
                    except BlockingIOError:
                        await trio.lowlevel.wait_writable(sock)
                        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        if error:
                            raise OSError(error, os.strerror(error)) from None
                return sock
            except trio.TooSlowError:
                trio.lowlevel.notify_closing(sock)
                sock.close()
                last_error = f"connect to {address}:{port} timed out"
            except OSError as exc:
                trio.lowlevel.notify_closing(sock)
                sock.close()
                last_error = f"connect to {address}:{port} failed: {exc.strerror or exc}"
        raise UpstreamError(f"cannot reach {host}: {last_error}")

    def checkin(self, connection: UpstreamConnection) -> bool:
        """Return a connection with a complete exchange behind it to the pool."""
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= self.pool_per_host or connection.buffer:
            return False
        connection.idle_since = time.monotonic()
        idle.append(connection)
        return True

    def discard_idle(self) -> list[UpstreamConnection]:
        connections = [c for idle in self._idle.values() for c in idle]
        self._idle.clear()
        return connections


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True
