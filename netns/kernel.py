"""Links, addresses, routes and sysctls, through netlink (pyroute2) and /proc/sys. No `ip` command.

Theory of operation
-------------------
A crew's namespace is given as a file: `/proc/PID/ns/net` of its infra container in production,
`/run/netns/NAME` in tests. It is opened once per operation and everything is done through that
file descriptor, so a PID reused in the meantime cannot redirect the work to another namespace;
its (device, inode) is compared with the one recorded at attach time.

The veth pair is created with its peer directly in the crew's namespace (IFLA_NET_NS_FD on the
peer, veth(4)), so the crew end never exists in the host namespace, not even for a moment.

Work inside the crew's namespace runs in a short-lived helper thread that calls setns(2) with
CLONE_NEWNET: setns changes the namespace of the calling thread only, and the thread ends when
the work is done, so the process's other threads never leave the host namespace and nothing has
to be switched back. A netlink socket opened in that thread belongs to the crew's namespace, and
so does /proc/sys/net as seen from that thread (net sysctls are resolved against the current
task's namespace, fs/proc/proc_sysctl.c and net/sysctl_net.c). pyroute2's own netns support forks
a helper process per socket; a thread is cheaper by an order of magnitude here.

IPv6 is switched off inside the namespace (all, default and the crew interface) *before* the
veth exists, so the crew end is born without a link-local address and never processes a router
advertisement (accept_ra=0 as well, should anything turn IPv6 back on); the host end gets
disable_ipv6=1 before it is brought up. The host end also gets IPv4 forwarding off (on only for a
crew with an allow rule, whose packets the table forwards): the nftables rules already drop
everything that is not for the proxy, this holds even with no table.

Every library error is converted here, once, into `KernelError` naming what was being done.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_codes
import fcntl
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

import msgspec
from pyroute2 import IPRoute, NetlinkError

from .addressing import CrewPlan, HostUse
from .errors import KernelError, NetnsError
from .state import NetnsIdentity

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
# include/uapi/linux/nsfs.h: _IO(0xb7, 0x3)
NS_GET_NSTYPE = 0xB703
IFF_UP = 0x1
# RTM_F_FIB_MATCH (include/uapi/linux/rtnetlink.h): answer with the matching FIB entry, so its
# prefix length tells a default route from a specific one ("ip route get fibmatch").
RTM_F_FIB_MATCH = 0x2000
RTN_LOCAL = 2
MAIN_TABLE = 254

_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def _converting(what: str) -> Iterator[None]:
    """The one place where pyroute2's and the OS's errors become KernelError."""
    try:
        yield
    except NetnsError:
        raise
    except NetlinkError as exc:
        code = int(exc.code) if isinstance(exc.code, int) else None
        detail = os.strerror(code) if code else str(exc)
        raise KernelError(what, code, detail) from None
    except OSError as exc:
        raise KernelError(what, exc.errno, exc.strerror or str(exc)) from None


# --- namespaces -----------------------------------------------------------------------------------


class Namespace:
    """An open network namespace file: its fd and identity. Close it (or use `with`)."""

    def __init__(self, path: str) -> None:
        with _converting(f"open network namespace {path}"):
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with _converting(f"stat network namespace {path}"):
                st = os.fstat(self.fd)
            self.identity = NetnsIdentity(path=path, dev=st.st_dev, ino=st.st_ino)
            host = os.stat("/proc/self/ns/net")
            if (host.st_dev, host.st_ino) == (st.st_dev, st.st_ino):
                # A crew in the host namespace would have the host's whole network.
                raise KernelError(f"network namespace {path}", None, "is the host's own namespace")
            with _converting(f"check network namespace {path}"):
                # NS_GET_NSTYPE (ioctl_ns(2), Linux 4.11): is this a network namespace at all?
                # Catches a wrong path here rather than in the middle of the setup.
                kind = fcntl.ioctl(self.fd, NS_GET_NSTYPE)
            if kind != CLONE_NEWNET:
                raise KernelError(f"network namespace {path}", None, "is not a network namespace")
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Namespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def current_identity(path: str) -> NetnsIdentity | None:
    """The identity of the namespace a path names now, or None if it names nothing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return NetnsIdentity(path=path, dev=st.st_dev, ino=st.st_ino)


def run_in_namespace(fd: int, work: Callable[[], T]) -> T:
    """Run `work` in a fresh thread that has joined the network namespace `fd`."""
    result: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"setns: {os.strerror(code)}")
            result.append(work())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="netns-helper", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


# --- sysctls --------------------------------------------------------------------------------------


def _write_sysctl(path: str, value: str) -> bool:
    """Write a /proc/sys value if it differs; True if it changed."""
    with open(path, "r+") as handle:
        if handle.read().strip() == value:
            return False
        handle.seek(0)
        handle.write(value)
    return True


def _ipv6_off(devices: tuple[str, ...]) -> list[str]:
    changed: list[str] = []
    base = "/proc/sys/net/ipv6/conf"
    if not os.path.isdir(base):
        return changed  # IPv6 not built or disabled at boot (ipv6.disable=1): nothing to do
    for device in devices:
        for key, value in (("disable_ipv6", "1"), ("accept_ra", "0")):
            if _write_sysctl(f"{base}/{device}/{key}", value):
                changed.append(f"net.ipv6.conf.{device}.{key}={value}")
    return changed


def harden_namespace(ns: Namespace) -> list[str]:
    """IPv6 off for every interface of the namespace, present and future."""
    with _converting("disable IPv6 in the crew namespace"):
        return run_in_namespace(ns.fd, lambda: _ipv6_off(("all", "default")))


# --- links and addresses --------------------------------------------------------------------------


class LinkInfo(msgspec.Struct, frozen=True):
    ifname: str
    index: int
    kind: str | None
    up: bool
    addresses: tuple[str, ...] = ()
    alias: str | None = None


def _link_info(message: Any, addresses: tuple[str, ...] = ()) -> LinkInfo:
    linkinfo = message.get_attr("IFLA_LINKINFO")
    kind = linkinfo.get_attr("IFLA_INFO_KIND") if linkinfo is not None else None
    return LinkInfo(
        ifname=str(message.get_attr("IFLA_IFNAME")),
        index=int(message["index"]),
        kind=kind,
        up=bool(message["flags"] & IFF_UP),
        addresses=addresses,
        alias=message.get_attr("IFLA_IFALIAS"),
    )


def _ipv4_addresses(ipr: IPRoute, index: int | None = None) -> dict[int, tuple[str, ...]]:
    """IPv4 addresses by interface index, from one dump.

    pyroute2 filters dumps in Python, after the kernel has sent every address of the namespace:
    asking once per interface would make the cost of N crews grow with N squared. One dump,
    grouped here, keeps reconcile and show linear.
    """
    found: dict[int, list[str]] = {}
    for message in ipr.get_addr(family=socket.AF_INET):
        if index is None or message["index"] == index:
            address = f"{message.get_attr('IFA_ADDRESS')}/{message['prefixlen']}"
            found.setdefault(int(message["index"]), []).append(address)
    return {key: tuple(value) for key, value in found.items()}


def _ensure_addresses(
    ipr: IPRoute,
    index: int,
    want: str,
    present: tuple[str, ...],
    changes: list[str],
    where: str,
) -> None:
    """Exactly one IPv4 address on the link: `want` (address/prefixlen)."""
    for address in present:
        if address != want:
            host, prefixlen = address.split("/")
            ipr.addr("del", index=index, address=host, prefixlen=int(prefixlen))
            changes.append(f"removed address {address} from {where}")
    if want not in present:
        host, prefixlen = want.split("/")
        ipr.addr("add", index=index, address=host, prefixlen=int(prefixlen))
        changes.append(f"added address {want} to {where}")


def _ensure_up(ipr: IPRoute, message: Any, changes: list[str], where: str) -> None:
    if not message["flags"] & IFF_UP:
        ipr.link("set", index=message["index"], state="up")
        changes.append(f"brought {where} up")


def _get_link(ipr: IPRoute, ifname: str) -> Any | None:
    try:
        return ipr.link("get", ifname=ifname)[0]
    except NetlinkError as exc:
        if exc.code == errno_codes.ENODEV:
            return None
        raise


class HostNetwork:
    """The host namespace's side: one netlink socket, used under the manager's lock."""

    def __init__(self) -> None:
        self._ipr: IPRoute | None = None
        self._depth = 0

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """A netlink socket for the duration of one operation, opened and closed in the caller's
        thread. pyroute2 keeps per-thread state (an event loop, its epoll descriptor and a
        socket pair) that only a close() *in the same thread* releases: a socket kept open and
        used from a thread pool (trio.to_thread) would leak a few descriptors per thread.
        Opening one costs about a millisecond. Sessions nest; callers serialize them."""
        if self._ipr is None:
            with _converting("open a netlink socket"):
                self._ipr = IPRoute()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.close()

    @property
    def ipr(self) -> IPRoute:
        if self._ipr is None:
            raise RuntimeError("HostNetwork used outside session()")
        return self._ipr

    def close(self) -> None:
        if self._ipr is not None:
            ipr, self._ipr = self._ipr, None
            ipr.close()

    def link(self, ifname: str) -> LinkInfo | None:
        with _converting(f"look up link {ifname}"):
            message = _get_link(self.ipr, ifname)
            if message is None:
                return None
            index = int(message["index"])
            return _link_info(message, _ipv4_addresses(self.ipr, index).get(index, ()))

    def links_with_prefix(self, prefix: str) -> dict[str, LinkInfo]:
        """The appliance's links with their IPv4 addresses: two dumps, whatever their number."""
        with _converting("list links"):
            addresses = _ipv4_addresses(self.ipr)
            found: dict[str, LinkInfo] = {}
            for message in self.ipr.get_links():
                name = message.get_attr("IFLA_IFNAME")
                if isinstance(name, str) and name.startswith(prefix):
                    found[name] = _link_info(message, addresses.get(int(message["index"]), ()))
            return found

    def create_veth(self, plan: CrewPlan, inner_ifname: str, ns: Namespace) -> None:
        with _converting(f"create veth {plan.ifname} <-> {inner_ifname} in {ns.identity.path}"):
            self.ipr.link(
                "add",
                ifname=plan.ifname,
                kind="veth",
                peer={"ifname": inner_ifname, "net_ns_fd": ns.fd},
            )

    def delete_link(self, ifname: str) -> bool:
        """Delete a link (and so its veth peer); False if it did not exist."""
        with _converting(f"delete link {ifname}"):
            message = _get_link(self.ipr, ifname)
            if message is None:
                return False
            try:
                self.ipr.link("del", index=message["index"])
            except NetlinkError as exc:
                if exc.code == errno_codes.ENODEV:
                    return False  # gone with its namespace meanwhile
                raise
            return True

    def ensure_host_end(
        self, plan: CrewPlan, present: tuple[str, ...] | None = None, *, forward: bool = False
    ) -> list[str]:
        """Host end: IPv6 off, forwarding off (on for a crew with an allow rule: `forward`),
        the gateway address, up. Returns what changed.

        `present` is the link's IPv4 addresses if the caller already knows them (a link it just
        created has none; reconcile reads all links at once); otherwise they are read here.
        """
        changes: list[str] = []
        where = f"host end {plan.ifname}"
        with _converting(f"configure {where}"):
            message = _get_link(self.ipr, plan.ifname)
            if message is None:
                raise KernelError(f"configure {where}", errno_codes.ENODEV, "link does not exist")
            index = int(message["index"])
            if present is None:
                present = _ipv4_addresses(self.ipr, index).get(index, ())
            changes += _ipv6_off((plan.ifname,))
            changes += self.set_forwarding(plan.ifname, forward)
            alias = f"appliance crew {plan.crew}"
            if message.get_attr("IFLA_IFALIAS") != alias:
                self.ipr.link("set", index=index, ifalias=alias)
            want = f"{plan.gateway}/{plan.prefixlen}"
            _ensure_addresses(self.ipr, index, want, present, changes, where)
            _ensure_up(self.ipr, message, changes, where)
        return changes

    @staticmethod
    def set_forwarding(ifname: str, on: bool) -> list[str]:
        """IPv4 forwarding of packets that come in on a crew's host end (the kernel decides by
        the input interface's setting): on only for a crew with an allow rule, so that a crew
        without one is cut off from forwarding even with no table."""
        value = "1" if on else "0"
        with _converting(f"set forwarding on {ifname}"):
            if _write_sysctl(f"/proc/sys/net/ipv4/conf/{ifname}/forwarding", value):
                return [f"net.ipv4.conf.{ifname}.forwarding={value}"]
        return []

    # Address-plan checks.

    def host_uses(self, exclude_prefix: str, exclude_names: Collection[str] = ()) -> list[HostUse]:
        """Every IPv4 address and route of the host, except those of the appliance's links
        (names with the prefix, and `exclude_names`)."""
        uses: list[HostUse] = []
        with _converting("list host addresses and routes"):
            names = {
                int(message["index"]): str(message.get_attr("IFLA_IFNAME"))
                for message in self.ipr.get_links()
            }
            ours = {
                index
                for index, name in names.items()
                if name.startswith(exclude_prefix) or name in exclude_names
            }
            for message in self.ipr.get_addr(family=socket.AF_INET):
                if message["index"] in ours:
                    continue
                address = f"{message.get_attr('IFA_ADDRESS')}/{message['prefixlen']}"
                device = names.get(message["index"], "?")
                uses.append(HostUse(address, f"address {address} on {device}"))
            for message in self.ipr.route("dump", family=socket.AF_INET):
                oif = message.get_attr("RTA_OIF")
                if oif in ours:
                    continue
                destination = message.get_attr("RTA_DST") or "0.0.0.0"
                network = f"{destination}/{message['dst_len']}"
                table = message.get_attr("RTA_TABLE") or message["table"]
                device = names.get(oif, "-") if oif is not None else "-"
                uses.append(HostUse(network, f"route {network} dev {device} table {table}"))
        return uses

    def subnet_in_use(self, subnet: ipaddress.IPv4Network) -> bool:
        """Does any route other than a default route, or any local address, cover the subnet?

        One FIB lookup per address (policy rules included), so the cost does not depend on how
        many routes the host has.
        """
        with _converting(f"check subnet {subnet}"):
            for address in subnet:
                try:
                    found = self.ipr.route("get", dst=str(address), flags=RTM_F_FIB_MATCH)
                except NetlinkError as exc:
                    if exc.code == errno_codes.ENETUNREACH:
                        continue  # no route at all, not even a default one: free
                    return True  # unreachable/prohibit routes and the like: not ours to take
                if found and (found[0]["dst_len"] > 0 or found[0]["type"] == RTN_LOCAL):
                    return True
        return False


# --- the crew end ---------------------------------------------------------------------------------


def _ensure_inner_in_thread(plan: CrewPlan, inner_ifname: str) -> list[str]:
    where = f"crew end {inner_ifname}"
    with IPRoute() as ipr:  # opened in this thread, so in the crew's namespace
        message = _get_link(ipr, inner_ifname)
        if message is None:
            raise KernelError(f"configure {where}", errno_codes.ENODEV, "link does not exist")
        changes = _ipv6_off(("all", "default", inner_ifname))
        index = int(message["index"])
        present = _ipv4_addresses(ipr, index).get(index, ())
        _ensure_addresses(ipr, index, f"{plan.address}/{plan.prefixlen}", present, changes, where)
        _ensure_up(ipr, message, changes, where)
        loopback = _get_link(ipr, "lo")
        if loopback is not None:
            _ensure_up(ipr, loopback, changes, "lo")
        defaults = [
            route
            for route in ipr.route("dump", family=socket.AF_INET)
            if route["dst_len"] == 0
            and (route.get_attr("RTA_TABLE") or route["table"]) == MAIN_TABLE
        ]
        if [route.get_attr("RTA_GATEWAY") for route in defaults] != [plan.gateway]:
            for route in defaults:
                spec: dict[str, Any] = {"dst": "0.0.0.0/0"}
                for key, attr in (("gateway", "RTA_GATEWAY"), ("oif", "RTA_OIF")):
                    if route.get_attr(attr) is not None:
                        spec[key] = route.get_attr(attr)
                ipr.route("del", **spec)
            ipr.route("add", dst="0.0.0.0/0", gateway=plan.gateway, oif=int(message["index"]))
            changes.append(f"default route via {plan.gateway}")
    return changes


def ensure_inner(ns: Namespace, plan: CrewPlan, inner_ifname: str) -> list[str]:
    """Crew end: IPv6 off, the crew address, up, lo up, default route via the gateway."""
    with _converting(f"configure crew end {inner_ifname} in {ns.identity.path}"):
        return run_in_namespace(ns.fd, lambda: _ensure_inner_in_thread(plan, inner_ifname))


class InnerView(msgspec.Struct, frozen=True):
    """The crew end as seen from inside the namespace."""

    present: bool
    up: bool = False
    addresses: tuple[str, ...] = ()
    default_gateway: str | None = None
    ipv6_disabled: bool = True


def _inspect_in_thread(inner_ifname: str) -> InnerView:
    ipv6_disabled = True
    path = f"/proc/sys/net/ipv6/conf/{inner_ifname}/disable_ipv6"
    if os.path.exists(path):
        with open(path) as handle:
            ipv6_disabled = handle.read().strip() == "1"
    with IPRoute() as ipr:
        message = _get_link(ipr, inner_ifname)
        if message is None:
            return InnerView(present=False, ipv6_disabled=ipv6_disabled)
        gateway = next(
            (
                route.get_attr("RTA_GATEWAY")
                for route in ipr.route("dump", family=socket.AF_INET)
                if route["dst_len"] == 0
            ),
            None,
        )
        return InnerView(
            present=True,
            up=bool(message["flags"] & IFF_UP),
            addresses=_ipv4_addresses(ipr).get(int(message["index"]), ()),
            default_gateway=gateway,
            ipv6_disabled=ipv6_disabled,
        )


def inspect_inner(ns: Namespace, inner_ifname: str) -> InnerView:
    with _converting(f"inspect crew end in {ns.identity.path}"):
        return run_in_namespace(ns.fd, lambda: _inspect_in_thread(inner_ifname))
