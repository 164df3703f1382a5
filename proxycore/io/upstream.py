"""Reaching upstreams: resolve once, check every address, dial exactly what was checked, pool.

Theory of operation: `Dialer.open` resolves a host once (proxycore/io/dns.py, within the crew's
share of lookups), checks every answer, and connects to a checked address itself, never to the
name, so a second resolution cannot swap the destination between check and use. If any answer is
refused the whole name is refused: a name that resolves to both a public and a private address is
the shape of a DNS-rebinding attack.

An address passes when the SSRF guard (proxycore/protocol/ssrf.py) finds it global or inside an
allowed range, and it is not the appliance itself: an address of the network namespace the proxy
dials from (any interface, IPv4 or IPv6: the host's public address included, which the guard
alone would call global) or of the crews' address pool (`[upstream] appliance_ranges`: other
crews and their gateways). Those are refused whatever `[upstream] ssrf_allow` says, unless the
crew names them in its own `ssrf_allow`. "Local" is asked of the kernel: binding a socket to the
address succeeds exactly for the addresses of this namespace (with `ip_nonlocal_bind` off, which
the worker checks at start and otherwise asks the routing table).

Pooling: kept-alive upstream connections are pooled per (crew, tls, host, port): never shared
between crews. Every crew has a cap on open upstream connections (pooled, in use and tunnels)
and on idle ones; idle connections older than `upstream_idle_timeout` are reaped by a task, so a
crew that touches many hosts cannot pin descriptors. A pooled connection was checked when it was
opened, so its reuse needs no new resolution. TLS to upstreams always verifies the certificate
against the host name (credentials only ever travel on such connections).

HTTP/2: with `offer_h2`, TLS offers ALPN ["h2", "http/1.1"] and `alpn` says what the upstream
chose; a connection that speaks h2 is handed to proxycore/io/upstream_h2.py, which pools it
per (crew, tls, host, port) the same way (it stays counted in `open`), and each request on it
is an `UpstreamConnection` marked `multiplexed`: never pooled itself, not counted again.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import trio

from proxycore.errors import PolicyDenied, UpstreamError
from proxycore.io.dns import Resolver
from proxycore.io.fastio import ByteStream, PlainStream, TlsStream
from proxycore.protocol.netrules import NetRules
from proxycore.protocol.ssrf import AddressGuard

PoolKey = tuple[str, bool, str, int]  # crew, tls, host, port
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Overloaded(UpstreamError):
    """A crew's share (or the process's descriptors) is used up: 503, try again later."""

    status_hint = 503


@dataclass(frozen=True, slots=True)
class CrewReach:
    """What one crew may reach beyond the appliance-wide checks: the ranges it alone may reach
    past the SSRF guard (`CrewConfig.ssrf_allow`) and its address rules (`CrewConfig.net`,
    proxycore/protocol/netrules.py: a deny rule refuses whatever else allows the address)."""

    ranges: AddressGuard | None = None
    net: NetRules = field(default_factory=NetRules)


@dataclass(slots=True, eq=False)
class CrewUpstreams:
    """One crew's upstream connections: how many are open, and the idle ones by key."""

    open: int = 0
    idle: dict[PoolKey, list[UpstreamConnection]] = field(default_factory=dict)
    idle_count: int = 0


@dataclass(slots=True, eq=False)
class UpstreamConnection:
    """One connection to an upstream, with the bytes read past the last response."""

    key: PoolKey
    address: str
    stream: ByteStream
    owner: CrewUpstreams
    buffer: bytearray = field(default_factory=bytearray)
    reused: bool = False
    idle_since: float = 0.0
    closed: bool = False
    # One stream of an HTTP/2 connection (proxycore/io/upstream_h2.py): never pooled itself,
    # and not counted as a connection (its connection is).
    multiplexed: bool = False
    # What TLS ALPN selected ("h2", "http/1.1"), "" when nothing was negotiated.
    alpn: str = ""

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.multiplexed:
                self.owner.open -= 1
            self.stream.close()


def make_tls_context(
    ca_file: str | None, ca_file_only: bool, alpn: tuple[str, ...] = ("http/1.1",)
) -> ssl.SSLContext:
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
    context.set_alpn_protocols(list(alpn))
    return context


class LocalAddresses:
    """Whether an address belongs to this network namespace (see the module docstring)."""

    def __init__(self) -> None:
        self._nonlocal_bind = any(
            _sysctl_on(path)
            for path in (
                "/proc/sys/net/ipv4/ip_nonlocal_bind",
                "/proc/sys/net/ipv6/ip_nonlocal_bind",
            )
        )

    def __contains__(self, address: str) -> bool:
        parsed = ipaddress.ip_address(address.partition("%")[0])
        if parsed.is_loopback or parsed.is_unspecified:
            return True
        if self._nonlocal_bind:
            # bind() would succeed for any address: ask where a datagram would go instead; the
            # kernel picks the destination itself as the source of a local destination.
            return _source_for(str(parsed)) == str(parsed)
        family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((str(parsed), 0))
            except OSError as exc:
                # EADDRNOTAVAIL: not ours. Anything else (EINVAL for a link-local address
                # without a scope): refused by the guard's tables anyway; say not local.
                return exc.errno not in (errno.EADDRNOTAVAIL, errno.EINVAL)
            return True


def _sysctl_on(path: str) -> bool:
    try:
        with open(path) as file:
            return file.read().strip() == "1"
    except OSError:
        return False


def _source_for(address: str) -> str:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
        except OSError:
            return ""
        return str(probe.getsockname()[0])


class Dialer:
    def __init__(
        self,
        guard: AddressGuard,
        resolver: Resolver,
        tls: ssl.SSLContext,
        *,
        appliance_ranges: Iterable[str] = (),
        connect_timeout: float,
        max_open_per_crew: int,
        max_idle_per_crew: int,
        idle_timeout: float,
        tls_h2: ssl.SSLContext | None = None,
    ) -> None:
        self.guard = guard
        self.resolver = resolver
        self.tls = tls
        # Offers ALPN ["h2", "http/1.1"] (proxycore/io/upstream_h2.py takes h2 connections).
        self.tls_h2 = tls_h2
        self.local = LocalAddresses()
        self.appliance_ranges = tuple(ipaddress.ip_network(r) for r in appliance_ranges)
        self.connect_timeout = connect_timeout
        self.max_open_per_crew = max_open_per_crew
        self.max_idle_per_crew = max_idle_per_crew
        self.idle_timeout = idle_timeout
        self.crews: dict[str, CrewUpstreams] = {}

    def crew(self, name: str) -> CrewUpstreams:
        upstreams = self.crews.get(name)
        if upstreams is None:
            upstreams = self.crews[name] = CrewUpstreams()
        return upstreams

    # -- checking ---------------------------------------------------------------------------

    def check(
        self, host: str, addresses: Iterable[str], crew_guard: CrewReach | None, port: int = 0
    ) -> None:
        """Raise PolicyDenied naming the first refused address (see the module docstring)."""
        ranges = crew_guard.ranges if crew_guard is not None else None
        net = crew_guard.net if crew_guard is not None else None
        for address in addresses:
            # The crew's address rules first: a deny rule refuses whatever else would allow
            # the address; an allow rule opens it as the kernel does for the crew's packets.
            rule = net.verdict(address, port) if net else None
            if rule is not None and rule.action == "deny":
                raise PolicyDenied(
                    f"{host} resolves to {address}:{port}, which the crew's rule {rule.spec} "
                    "refuses",
                    host=host,
                    rule="net_deny",
                )
            if rule is not None:
                # The crews' pool stays closed: no allow rule may name it (the kernel drops it
                # whatever the rules say), or a crew could speak as another to the proxy.
                if self._is_appliance(address):
                    raise _refused(host, address, "appliance")
                continue
            # Only a range the crew names opens what the appliance keeps for itself.
            named = ranges is not None and ranges.check(address).reason == "operator_allowed"
            if not named:
                verdict = self.guard.check(address)
                if not verdict.allowed:
                    raise _refused(host, address, verdict.reason)
                if self._is_appliance(address):
                    raise _refused(host, address, "appliance")
                if address in self.local:
                    raise _refused(host, address, "local")

    def _is_appliance(self, address: str) -> bool:
        if not self.appliance_ranges:
            return False
        parsed = ipaddress.ip_address(address.partition("%")[0])
        return any(parsed in network for network in self.appliance_ranges)

    async def resolve(
        self,
        host: str,
        port: int,
        limiter: trio.CapacityLimiter,
        crew_guard: CrewReach | None,
    ) -> list[str]:
        addresses = await self.resolver.resolve(host, port, limiter)
        self.check(host, addresses, crew_guard, port)
        return addresses

    # -- the pool -----------------------------------------------------------------------------

    def checkout(self, crew: str, tls: bool, host: str, port: int) -> UpstreamConnection | None:
        """An idle connection to reuse, or None."""
        upstreams = self.crews.get(crew)
        if upstreams is None:
            return None
        idle = upstreams.idle.get((crew, tls, host, port))
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            upstreams.idle_count -= 1
            if now - connection.idle_since > self.idle_timeout:
                # Servers close idle keep-alive connections after a few seconds (nginx 75 s,
                # many APIs less); older ones are likelier dead than reusable.
                connection.close()
                continue
            connection.reused = True
            return connection
        return None

    def checkin(self, connection: UpstreamConnection) -> bool:
        """Return a connection with a complete exchange behind it to its crew's pool."""
        upstreams = connection.owner
        if connection.closed or connection.buffer or connection.multiplexed:
            return False
        if upstreams.idle_count >= self.max_idle_per_crew:
            self._evict_oldest(upstreams)
        connection.idle_since = time.monotonic()
        connection.reused = False
        upstreams.idle.setdefault(connection.key, []).append(connection)
        upstreams.idle_count += 1
        return True

    def _evict_oldest(self, upstreams: CrewUpstreams) -> bool:
        oldest: list[UpstreamConnection] | None = None
        for idle in upstreams.idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest[0].idle_since):
                oldest = idle
        if oldest is None:
            return False
        oldest.pop(0).close()
        upstreams.idle_count -= 1
        return True

    def reserve(self, crew: str) -> CrewUpstreams:
        """Count one more open upstream connection for `crew` (an idle one is closed to make
        room if needed); Overloaded when all of its share is in use."""
        upstreams = self.crew(crew)
        if upstreams.open >= self.max_open_per_crew and not self._evict_oldest(upstreams):
            raise Overloaded(
                f"crew {crew} has {upstreams.open} upstream connections open (the limit)"
            )
        upstreams.open += 1
        return upstreams

    def reap_idle(self) -> int:
        """Close idle connections past the idle timeout; returns how many."""
        deadline = time.monotonic() - self.idle_timeout
        reaped = 0
        for upstreams in self.crews.values():
            for key, idle in list(upstreams.idle.items()):
                keep = [c for c in idle if c.idle_since >= deadline]
                for connection in idle:
                    if connection.idle_since < deadline:
                        connection.close()
                        reaped += 1
                upstreams.idle_count -= len(idle) - len(keep)
                if keep:
                    upstreams.idle[key] = keep
                else:
                    del upstreams.idle[key]
        return reaped

    def close_idle(self, crew: str) -> None:
        """Close a crew's idle connections, keeping its count of those in use (its rules
        changed: a pooled connection was checked under the former ones)."""
        upstreams = self.crews.get(crew)
        if upstreams is not None:
            _close_idle(upstreams)

    def forget_crew(self, crew: str) -> None:
        """Close a removed crew's idle connections (those in use close when their task ends)."""
        upstreams = self.crews.pop(crew, None)
        if upstreams is not None:
            _close_idle(upstreams)

    def discard_idle(self) -> None:
        for crew in list(self.crews):
            self.forget_crew(crew)

    # -- dialing ------------------------------------------------------------------------------

    async def open(
        self,
        crew: str,
        limiter: trio.CapacityLimiter,
        crew_guard: CrewReach | None,
        tls: bool,
        host: str,
        port: int,
        *,
        offer_h2: bool = False,
    ) -> UpstreamConnection:
        """A checked, connected (and verified TLS) connection; `offer_h2`: ALPN offers h2
        first (the caller reads `alpn`)."""
        addresses = await self.resolve(host, port, limiter, crew_guard)
        upstreams = self.reserve(crew)
        key = (crew, tls, host, port)
        try:
            sock = await self.connect_checked(addresses, port, host)
        except BaseException:
            upstreams.open -= 1
            raise
        peer = str(sock.getpeername()[0])
        if not tls:
            return UpstreamConnection(key, peer, PlainStream(sock), upstreams)
        connection = UpstreamConnection(key, peer, PlainStream(sock), upstreams)
        context = self.tls_h2 if offer_h2 and self.tls_h2 is not None else self.tls
        try:
            tls_sock = context.wrap_socket(
                sock, server_hostname=host, do_handshake_on_connect=False
            )
        except BaseException:
            connection.close()
            raise
        # wrap_socket detached `sock` into `tls_sock`: from here on that is what closes.
        stream = connection.stream = TlsStream(tls_sock)
        try:
            with trio.fail_after(self.connect_timeout):
                await stream.handshake()
        except trio.TooSlowError:
            connection.close()
            raise UpstreamError(f"TLS handshake with {host} timed out", status_hint=504) from None
        except OSError as exc:  # ssl.SSLError (a refused certificate among them) or a reset
            connection.close()
            raise UpstreamError(f"TLS with {host} failed: {exc}") from None
        except BaseException:
            connection.close()
            raise
        connection.alpn = tls_sock.selected_alpn_protocol() or ""
        return connection

    async def connect_checked(
        self, addresses: Iterable[str], port: int, host: str
    ) -> socket.socket:
        """Connect (non-blocking) to the first reachable address of those already checked."""
        last_error = "no address"
        for address in addresses:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            try:
                sock = socket.socket(family, socket.SOCK_STREAM)
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    raise Overloaded(
                        "the proxy is out of file descriptors; try again shortly"
                    ) from None
                raise UpstreamError(f"cannot create a socket: {exc.strerror}") from None
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
                last_error = f"connect to {address}:{port} timed out"
            except OSError as exc:
                last_error = f"connect to {address}:{port} failed: {exc.strerror or exc}"
            except BaseException:
                trio.lowlevel.notify_closing(sock)
                sock.close()
                raise
            trio.lowlevel.notify_closing(sock)
            sock.close()
        raise UpstreamError(f"cannot reach {host}: {last_error}")


def _refused(host: str, address: str, reason: str) -> PolicyDenied:
    what = {
        "local": "an address of the appliance's own host",
        "appliance": "an address of the appliance's crews",
    }.get(reason, "not a public address")
    return PolicyDenied(
        f"{host} resolves to {address} ({reason}), which is {what}",
        host=host,
        rule=f"ssrf_{reason}",
    )


def _close_idle(upstreams: CrewUpstreams) -> None:
    for idle in upstreams.idle.values():
        for connection in idle:
            connection.close()
    upstreams.idle.clear()
    upstreams.idle_count = 0
