"""Shared machinery of the netns tests: a lab of namespaces, listeners that record every hit, and
probes that send real packets from inside a crew's namespace. No tests here.

Everything lives on this machine. The "internet" is a namespace the lab creates, addressed from
TEST-NET-2 (198.51.100.0/24, RFC 5737) and the IPv6 documentation prefix 2001:db8::/32
(RFC 3849); a control namespace uses TEST-NET-3 (203.0.113.0/24). Crews get a /24 of the shared
address space 100.64.0.0/10. The lab refuses to start if the host already routes any of these
(skip), so no probe can leave the machine. Probes only ever target the lab's own addresses and
the host's own addresses.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import selectors
import shutil
import socket
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

try:
    import pyroute2  # noqa: F401

    HAVE_PYROUTE2 = True
except ImportError:  # pragma: no cover - reported as a skip
    HAVE_PYROUTE2 = False

NEEDS_KERNEL = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, nftables)"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2 (`ip netns`)"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="needs nftables"),
    pytest.mark.skipif(not HAVE_PYROUTE2, reason="needs pyroute2"),
]

TIMEOUT = 1.0
INTERNET_HOST = "198.51.100.10"
INTERNET_GATEWAY = "198.51.100.1"
INTERNET_HOST6 = "2001:db8:10::10"
INTERNET_GATEWAY6 = "2001:db8:10::1"
CONTROL_HOST = "203.0.113.10"
CONTROL_GATEWAY = "203.0.113.1"
# A well-formed DNS query for "example." IN A (RFC 1035 4.1).
DNS_QUERY = (
    bytes.fromhex("123401000001000000000000") + b"\x07example\x00" + bytes.fromhex("00010001")
)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port the lab's listeners bind on every address later, taken from below the kernel's
    ephemeral range: a port the kernel handed out (port 0) is one it may hand again at once to
    another test's outgoing connection, and the listener's bind on 0.0.0.0 then fails."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def in_namespace(path: str, work):  # type: ignore[no-untyped-def]
    """Run `work` in a thread that joined the namespace (via the package's own helper)."""
    from netns.kernel import run_in_namespace

    fd = os.open(path, os.O_RDONLY)
    try:
        return run_in_namespace(fd, work)
    finally:
        os.close(fd)


def ns_path(name: str) -> str:
    return f"/run/netns/{name}"


def set_sysctl(name: str, value: str, netns: str | None = None) -> None:
    path = "/proc/sys/" + name.replace(".", "/")

    def write() -> None:
        with open(path, "w") as handle:
            handle.write(value)

    if netns is None:
        write()
    else:
        in_namespace(ns_path(netns), write)


# --- listeners ------------------------------------------------------------------------------------


@dataclass
class Listener:
    """Sockets that record every connection and datagram they receive."""

    hits: list[tuple[str, str, object]] = field(default_factory=list)
    sockets: list[socket.socket] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def tcp(self, host: str, port: int, netns: str | None = None, label: str = "") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def make() -> socket.socket:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
            sock.listen(64)
            return sock

        sock = in_namespace(ns_path(netns), make) if netns else make()
        self._serve(sock, label or f"tcp {host}:{port}", stream=True)

    def udp(self, host: str, port: int, netns: str | None = None, label: str = "") -> None:
        def make() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            return sock

        sock = in_namespace(ns_path(netns), make) if netns else make()
        self._serve(sock, label or f"udp {host}:{port}", stream=False)

    def _serve(self, sock: socket.socket, label: str, *, stream: bool) -> None:
        sock.settimeout(0.1)
        self.sockets.append(sock)

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    if stream:
                        conn, peer = sock.accept()
                        self.hits.append((label, "tcp", peer))
                        with contextlib.suppress(OSError):
                            conn.sendall(b"hello\n")
                        conn.close()
                    else:
                        _, peer = sock.recvfrom(2048)
                        self.hits.append((label, "udp", peer))
                        sock.sendto(b"answer", peer)
                except (TimeoutError, OSError):
                    continue

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        self._threads.append(thread)

    def wait_for(self, label: str, count: int = 1, timeout: float = 2.0) -> None:
        """Hits are recorded by the accepting thread: wait for them before looking."""
        deadline = time.monotonic() + timeout
        while self.labels().count(label) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{label} saw nothing: {self.hits}")
            time.sleep(0.01)

    def labels(self) -> list[str]:
        return [label for label, _, _ in self.hits]

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2)
        for sock in self.sockets:
            sock.close()


# --- probes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    kind: str  # tcp | udp | icmp
    host: str
    port: int = 0

    def __str__(self) -> str:
        return f"{self.kind} {self.host}:{self.port}" if self.port else f"{self.kind} {self.host}"


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _icmp_echo(ident: int) -> bytes:
    header = struct.pack("!BBHHH", 8, 0, 0, ident, 1)
    payload = b"appliance-netns-test"
    return struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, 1) + payload


def run_probes(netns: str, probes: list[Probe], timeout: float = TIMEOUT) -> dict[Probe, str]:
    """Send every probe at once from inside `netns`; results: connected, timeout, refused,
    reply, no reply, or error:<ERRNO>. One timeout for the whole batch keeps the suite fast."""

    def work() -> dict[Probe, str]:
        selector = selectors.DefaultSelector()
        results: dict[Probe, str] = {}
        sockets: list[socket.socket] = []
        ident = random.randrange(1, 0xFFFF)
        try:
            for probe in probes:
                family = socket.AF_INET6 if ":" in probe.host else socket.AF_INET
                try:
                    if probe.kind == "tcp":
                        sock = socket.socket(family, socket.SOCK_STREAM)
                        sock.setblocking(False)
                        sockets.append(sock)
                        code = sock.connect_ex(_address(probe, family))
                        if code == 0:
                            results[probe] = "connected"
                        elif code == errno.EINPROGRESS:
                            selector.register(sock, selectors.EVENT_WRITE, probe)
                        else:
                            results[probe] = f"error:{errno.errorcode[code]}"
                    elif probe.kind == "udp":
                        sock = socket.socket(family, socket.SOCK_DGRAM)
                        sock.setblocking(False)
                        sockets.append(sock)
                        sock.sendto(DNS_QUERY, _address(probe, family))
                        selector.register(sock, selectors.EVENT_READ, probe)
                    elif probe.kind == "icmp":
                        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
                        sock.setblocking(False)
                        sockets.append(sock)
                        sock.sendto(_icmp_echo(ident), (probe.host, 0))
                        selector.register(sock, selectors.EVENT_READ, probe)
                except OSError as exc:
                    results[probe] = f"error:{errno.errorcode.get(exc.errno or 0, str(exc))}"
            deadline = time.monotonic() + timeout
            while selector.get_map() and time.monotonic() < deadline:
                for key, _ in selector.select(max(0.0, deadline - time.monotonic())):
                    probe = key.data
                    sock = key.fileobj  # type: ignore[assignment]
                    if probe.kind == "tcp":
                        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        results[probe] = (
                            "connected"
                            if code == 0
                            else "refused"
                            if code == errno.ECONNREFUSED
                            else f"error:{errno.errorcode.get(code, code)}"
                        )
                        selector.unregister(sock)
                    elif probe.kind == "udp":
                        try:
                            sock.recv(2048)
                            results[probe] = "reply"
                        except OSError as exc:
                            results[probe] = f"error:{errno.errorcode.get(exc.errno or 0, exc)}"
                        selector.unregister(sock)
                    else:
                        packet = sock.recv(2048)
                        header_len = (packet[0] & 0x0F) * 4
                        source = socket.inet_ntoa(packet[12:16])
                        kind, _, _, got_ident = struct.unpack(
                            "!BBHH", packet[header_len : header_len + 6]
                        )
                        if source == probe.host and kind == 0 and got_ident == ident:
                            results[probe] = "reply"
                            selector.unregister(sock)
            for key in list(selector.get_map().values()):
                probe = key.data
                results[probe] = "timeout" if probe.kind == "tcp" else "no reply"
        finally:
            selector.close()
            for sock in sockets:
                sock.close()
        return results

    return in_namespace(ns_path(netns), work)  # type: ignore[no-any-return]


def _address(probe: Probe, family: int) -> tuple[object, ...]:
    if family == socket.AF_INET6:
        host, _, scope = probe.host.partition("%")
        index = socket.if_nametoindex(scope) if scope else 0
        return (host, probe.port, 0, index)
    return (probe.host, probe.port)


def raw_udp(netns: str, destination: str, port: int) -> None:
    """A UDP datagram built by hand on a raw IP socket (the kernel adds the IP header)."""

    def work() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP) as sock:
            payload = b"raw-udp"
            header = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0)
            sock.sendto(header + payload, (destination, 0))

    in_namespace(ns_path(netns), work)


def packet_ipv4(
    netns: str,
    ifname: str,
    destination_mac: str,
    source: str,
    destination: str,
    port: int,
    protocol: str = "udp",
) -> None:
    """A whole Ethernet frame on an AF_PACKET socket: any source, any destination; a UDP
    datagram or a TCP SYN."""

    def work() -> None:
        src, dst = socket.inet_aton(source), socket.inet_aton(destination)
        if protocol == "udp":
            payload = b"packet-udp"
            body = struct.pack("!HHHH", 40001, port, 8 + len(payload), 0) + payload
            number = socket.IPPROTO_UDP
        else:
            number = socket.IPPROTO_TCP
            header = struct.pack("!HHIIBBHHH", 40002, port, 1000, 0, 5 << 4, 0x02, 64240, 0, 0)
            pseudo = src + dst + struct.pack("!BBH", 0, number, len(header))
            body = header[:16] + struct.pack("!H", _checksum(pseudo + header)) + header[18:]
        ip = struct.pack(
            "!BBHHHBBH4s4s", 0x45, 0, 20 + len(body), 0x1234, 0, 64, number, 0, src, dst
        )
        ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as sock:
            sock.bind((ifname, 0))
            mac = sock.getsockname()[4]
            frame = bytes.fromhex(destination_mac.replace(":", "")) + mac + b"\x08\x00" + ip + body
            sock.send(frame)

    in_namespace(ns_path(netns), work)


# --- the lab --------------------------------------------------------------------------------------


@dataclass
class Lab:
    """Namespaces, the test table and crews' state dir for one test; cleaned up whatever happens."""

    tag: str
    state_dir: Path
    pool: str
    prefix: str
    table: str
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    listener: Listener = field(default_factory=Listener)
    # iptables rules added for the lab's own wires (removed at cleanup): see `wire`.
    forward_rules: list[list[str]] = field(default_factory=list)
    # The proxy stand-in's port (the crews' only allowed port) and another port on the host.
    port: int = 0
    other_port: int = 0

    def config(self, **overrides: object):  # type: ignore[no-untyped-def]
        from netns import NetConfig

        values: dict[str, object] = {
            "pool": self.pool,
            "table": self.table,
            "ifname_prefix": self.prefix,
            "proxy_ports": (self.port,),
            # Off unless a test turns it on (tests/test_netns_capture.py): the probes of the
            # other tests expect a crew's TCP to ports 80 and 443 to be dropped, not redirected.
            "capture_ports": (),
            # Off too: the probes expect a crew's packets to its gateway's port 53 dropped.
            "dns": False,
        }
        values.update(overrides)
        return NetConfig(**values)  # type: ignore[arg-type]

    def namespace(self, role: str) -> str:
        name = f"{role}-{self.tag}"
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def wire(self, role: str, host_address: str, inner_address: str, prefixlen: int = 24) -> str:
        """A plain namespace behind a veth of its own (not a crew interface), with forwarding on
        for its host end: a stand-in for the internet, or for a trusted peer."""
        name = self.namespace(role)
        host_end = f"x{role[:3]}{self.tag}"
        self.links.append(host_end)
        sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", name)
        sh("ip", "addr", "add", f"{host_address}/{prefixlen}", "dev", host_end)
        sh("ip", "link", "set", host_end, "up")
        sh("ip", "-n", name, "addr", "add", f"{inner_address}/{prefixlen}", "dev", "eth0")
        sh("ip", "-n", name, "link", "set", "eth0", "up")
        sh("ip", "-n", name, "route", "add", "default", "via", host_address)
        # Per-interface forwarding: IPv4 decides by the input device's setting
        # (net/ipv4/route.c, ip_route_input_slow), so this routes the lab's own traffic
        # without turning on forwarding for the host's real interfaces.
        set_sysctl(f"net.ipv4.conf.{host_end}.forwarding", "1")
        # A Docker engine on the host sets the iptables FORWARD policy to DROP, which would stop
        # the lab's stand-in traffic before our table sees it. Let the lab's own wires through
        # that chain; a crew's traffic still meets the appliance's table, whose drop is final
        # whatever another table accepts (each base chain's verdict stands on its own).
        if _forward_policy_drops():
            for direction in ("-i", "-o"):
                rule = ["FORWARD", direction, host_end, "-j", "ACCEPT"]
                sh("iptables", "-w", "-I", *rule)
                self.forward_rules.append(rule)
        return name

    def cleanup(self) -> None:
        self.listener.close()
        for name in self.namespaces:
            sh("ip", "netns", "del", name, check=False)
        for link in self.links:
            sh("ip", "link", "del", link, check=False)
        for line in sh("ip", "-o", "link", "show", check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith(self.prefix):
                sh("ip", "link", "del", name, check=False)
        sh("nft", "delete", "table", "inet", self.table, check=False)
        for rule in self.forward_rules:
            sh("iptables", "-w", "-D", *rule, check=False)


def _forward_policy_drops() -> bool:
    if shutil.which("iptables") is None:
        return False
    out = sh("iptables", "-w", "-S", "FORWARD", check=False).stdout
    return "-P FORWARD DROP" in out


def _host_routes_any(networks: list[str]) -> list[str]:
    import ipaddress

    from netns.kernel import HostNetwork

    host = HostNetwork()
    with host.session():
        return [n for n in networks if host.subnet_in_use(ipaddress.IPv4Network(n))]


@contextlib.contextmanager
def make_lab(tmp_path: Path) -> Iterator[Lab]:
    tag = uuid.uuid4().hex[:4]
    pool = f"100.90.{random.randrange(256)}.0/24"
    busy = _host_routes_any([pool, "198.51.100.0/24", "203.0.113.0/24"])
    if busy:
        pytest.skip(f"the host already uses the lab's test networks {busy}")
    lab = Lab(
        tag=tag,
        state_dir=tmp_path / "state",
        pool=pool,
        prefix=f"t{tag}",
        table=f"appliance_test_{tag}",
    )
    lab.port = free_port()
    lab.other_port = free_port()
    try:
        yield lab
    finally:
        lab.cleanup()


def host_mac(ifname: str) -> str:
    return Path(f"/sys/class/net/{ifname}/address").read_text().strip()


def host_ipv4_addresses() -> list[str]:
    out = sh("ip", "-4", "-o", "addr", "show").stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines()]


def nft_table_json(table: str) -> str:
    return sh("nft", "-j", "list", "table", "inet", table).stdout
