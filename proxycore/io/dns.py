"""Name resolution for the proxy: once per dial, every answer returned, each crew its own share.

Theory of operation: a host is resolved by the operator's split-horizon table first
(`[upstream] resolve`), an IP literal is its own answer, and anything else is asked of the
nameservers (`[upstream] nameservers`, else those of /etc/resolv.conf, read once at start while
the worker can still read it) with dnspython's async resolver on trio: A and AAAA at once, under
`[upstream] dns_timeout`, every answer returned so that the caller can check every one. The
hosts file is not read (the split-horizon table is the proxy's own, explicit version of it).

Each crew has a `CapacityLimiter` of `[limits] dns_lookups_per_crew` lookups in flight: a crew
whose lookups hang (a resolver that never answers for its names, a flood of random names) waits
for its own slots and never for another crew's. Waiting for a slot counts against the lookup's
timeout. No thread is used: the whole lookup is trio I/O on one UDP (or TCP) socket.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

import dns._features
import trio

from proxycore.config import parse_nameserver
from proxycore.errors import PolicyDenied

# The proxy asks its nameservers over plain DNS (UDP, then TCP). DNS over HTTPS or QUIC would
# have dnspython load httpx, anyio or aioquic into every worker whenever they happen to be
# installed: memory, and modules imported after the privilege drop, for nothing.
dns._features.force("doh", False)
dns._features.force("doq", False)
# dnspython asks importlib.metadata whether an optional package is there on first use of a
# feature, which reads site-packages: ask now, while the worker can still read it.
for _feature in ("dnssec", "idna", "trio", "wmi"):
    dns._features.have(_feature)

import dns.asyncresolver  # noqa: E402 (after the features are settled)
import dns.exception  # noqa: E402
import dns.inet  # noqa: E402
import dns.nameserver  # noqa: E402
import dns.rdatatype  # noqa: E402
import dns.resolver  # noqa: E402

__all__ = ["PRELOAD_MODULES", "Resolver"]


# dnspython imports its record classes and its trio backend on first use; a worker must have
# them before it drops privileges (proxycore/worker.py imports these).
def _record_modules() -> tuple[str, ...]:
    """Every record class dnspython has: a message it parses (an answer from a nameserver, or a
    crew's query to its DNS responder, whose additional section can hold any type) imports the
    class of each record it holds on first use."""
    import dns.rdtypes.ANY
    import dns.rdtypes.CH
    import dns.rdtypes.IN

    packages = (dns.rdtypes.ANY, dns.rdtypes.IN, dns.rdtypes.CH)
    # dnspython looks a type up in the record's class first (dns.rdtypes.IN.TXT), then in ANY:
    # every name under every class, so that the ones that do not exist are known not to (the
    # worker's import guard then refuses them silently, as before the drop).
    names = sorted({name for package in packages for name in package.__all__})
    return tuple(f"{package.__name__}.{name}" for package in packages for name in names)


PRELOAD_MODULES = (
    "dns.asyncbackend",
    "dns._trio_backend",
    "dns.rdtypes.IN.A",
    "dns.rdtypes.IN.AAAA",
    "dns.rdtypes.ANY.CNAME",
    "dns.rdtypes.ANY.DNAME",
    "dns.rdtypes.ANY.SOA",
    "dns.rdtypes.ANY.OPT",
    "dns.rdtypes.ANY.RRSIG",
    "dns.rdtypes.ANY.NS",
    # dns.message imports it to read a message whose opcode is UPDATE: a hostile nameserver
    # can send one.
    "dns.update",
    *_record_modules(),
)


class Resolver:
    def __init__(
        self,
        overrides: Mapping[str, str],
        nameservers: tuple[str, ...],
        *,
        timeout: float,
    ) -> None:
        self.overrides = {host.lower(): address for host, address in overrides.items()}
        self.timeout = timeout
        if nameservers:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [
                dns.nameserver.Do53Nameserver(address, port)
                for address, port in map(parse_nameserver, nameservers)
            ]
        else:
            try:
                resolver = dns.asyncresolver.Resolver(configure=True)
            except dns.resolver.NoResolverConfiguration:
                # No /etc/resolv.conf (a minimal host): names fail, overrides and literals work.
                resolver = dns.asyncresolver.Resolver(configure=False)
                resolver.nameservers = []
        resolver.lifetime = timeout
        resolver.timeout = timeout
        resolver.cache = None
        self._resolver = resolver

    async def resolve(self, host: str, port: int, limiter: trio.CapacityLimiter) -> list[str]:
        """Every address of `host`; PolicyDenied("dns_resolution_failed") if there is none."""
        override = self.overrides.get(host)
        if override is not None:
            return [override]
        if dns.inet.is_address(host):
            return [host]
        if not self._resolver.nameservers:
            raise _failed(host, "no nameserver is configured")
        answers: dict[dns.rdatatype.RdataType, list[str]] = {}
        errors: list[str] = []
        with trio.move_on_after(self.timeout) as scope:
            async with limiter, trio.open_nursery() as nursery:
                for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    nursery.start_soon(self._query, host, rdtype, answers, errors)
        if scope.cancelled_caught:
            raise _failed(host, "the lookup timed out")
        addresses = [*answers.get(dns.rdatatype.A, []), *answers.get(dns.rdatatype.AAAA, [])]
        if not addresses:
            raise _failed(host, errors[0] if errors else "no address")
        return list(dict.fromkeys(addresses))

    async def _query(
        self,
        host: str,
        rdtype: dns.rdatatype.RdataType,
        answers: dict[dns.rdatatype.RdataType, list[str]],
        errors: list[str],
    ) -> None:
        # Never raises: an error here would take the sibling query down with it.
        try:
            answer = await self._resolver.resolve(host, rdtype, search=False)
        except dns.resolver.NXDOMAIN:
            errors.append("no such name")
        except dns.resolver.NoAnswer:
            pass
        except (dns.exception.DNSException, OSError, ValueError) as exc:
            errors.append(type(exc).__name__)
        else:
            answers[rdtype] = [rdata.address for rdata in answer]


def _failed(host: str, why: str) -> PolicyDenied:
    return PolicyDenied(f"cannot resolve {host}: {why}", host=host, rule="dns_resolution_failed")


def is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True
