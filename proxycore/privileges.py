"""Process hardening for the processes that hold credential values: applianced (the store's key,
values while it pushes them) and the proxy workers (every injected key). It lives in the data
plane because a worker needs it and must not import the control plane; applianced imports it
from here.

`forbid_core_dumps()` sets RLIMIT_CORE to 0 (no core file, whatever the system's core_pattern
asks, except a pipe handler: hence also) and clears the dumpable flag with
prctl(PR_SET_DUMPABLE, 0), which also makes /proc/PID/{mem,environ,maps,...} root-owned and
refuses ptrace from the same uid (proc(5), PR_SET_DUMPABLE in prctl(2)). The flag is reset by
execve(2), so each process calls this itself, first thing. A failure is an error: a process that
cannot drop it should not go on to hold secrets.

`drop_privileges(uid, gid)` is how a proxy worker leaves root for good after it has read what it
needs (its config, CA bundle, its inherited sockets), in an order where each step still has the
privilege it needs: empty the capability bounding set (needs CAP_SETPCAP) and the ambient set;
setgroups([]), setresgid, setresuid (all three ids, so no saved id can win root back; the kernel
clears the permitted and effective sets on that transition); capset() to clear what is left (the
inheritable set); PR_SET_NO_NEW_PRIVS (no execve can grant anything again, setuid binaries or
file capabilities included); and the dumpable flag once more (a uid change resets it). Then it
checks the result (`check_dropped`, the worker's self-check) from /proc/self/status and by
trying to become root again: anything but UID and GID `uid`:`gid` in all four slots, no
supplementary group, five empty capability sets, NoNewPrivs 1 and a cleared dumpable flag is an
error, and the caller exits. It must run while the process has a single thread (capabilities and
no_new_privs are per thread), which it checks.

libc is opened once, before the drop: `ctypes.util.find_library` runs `ldconfig -p` in a child
process, which a worker should not need to do once it has no privilege left.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import resource

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
CAPABILITY_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")


class PrivilegeDropError(OSError):
    """The process could not shed its privileges completely: it must not go on."""


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def forbid_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = _libc()
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_DUMPABLE, 0): {os.strerror(error)}")


def is_dumpable() -> bool:
    return bool(_libc().prctl(PR_GET_DUMPABLE, 0, 0, 0, 0))


def _prctl(libc: ctypes.CDLL, option: int, arg: int, what: str) -> None:
    if libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise PrivilegeDropError(error, f"prctl({what}): {os.strerror(error)}")


def _last_capability() -> int:
    try:
        return int(open("/proc/sys/kernel/cap_last_cap").read())
    except OSError:
        return 63  # PR_CAPBSET_DROP of an unknown capability fails with EINVAL: caught below


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def process_status(pid: int | str = "self") -> dict[str, str]:
    """/proc/PID/status as a dict (Uid, Gid, Cap*, NoNewPrivs...)."""
    fields: dict[str, str] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def drop_privileges(uid: int, gid: int) -> None:
    """Become `uid`:`gid` with no capability and no way back; raises PrivilegeDropError."""
    if uid == 0 or gid == 0:
        raise PrivilegeDropError(0, "refusing to drop privileges to uid or gid 0")
    # Capability sets and no_new_privs belong to a thread: a thread started before the drop
    # would keep them. Only the calling thread may exist (threads started later inherit all).
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        raise PrivilegeDropError(0, f"{len(threads)} threads at the privilege drop; must be one")
    libc = _libc()
    for cap in range(_last_capability() + 1):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            error = ctypes.get_errno()
            if error != errno.EINVAL:  # a capability this kernel does not know
                raise PrivilegeDropError(
                    error, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(error)}"
                )
    _prctl(libc, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, "PR_CAP_AMBIENT_CLEAR_ALL")
    try:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        raise PrivilegeDropError(
            exc.errno or 0, f"cannot become {uid}:{gid}: {exc.strerror}"
        ) from None
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()  # all zero: no capability in any set
    if libc.capset(ctypes.byref(header), ctypes.byref(data)) != 0:
        error = ctypes.get_errno()
        raise PrivilegeDropError(error, f"capset: {os.strerror(error)}")
    _prctl(libc, PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")
    forbid_core_dumps()
    check_dropped(uid, gid)


def check_dropped(uid: int, gid: int) -> None:
    """The worker's self-check: raises PrivilegeDropError naming every privilege still held."""
    status = process_status()
    problems = []
    if status.get("Uid", "").split() != [str(uid)] * 4:
        problems.append(f"Uid {status.get('Uid')!r}")
    if status.get("Gid", "").split() != [str(gid)] * 4:
        problems.append(f"Gid {status.get('Gid')!r}")
    if status.get("Groups", "") != "":
        problems.append(f"Groups {status.get('Groups')!r}")
    for field in CAPABILITY_FIELDS:
        if int(status.get(field, "1"), 16) != 0:
            problems.append(f"{field} {status.get(field)}")
    if status.get("NoNewPrivs") != "1":
        problems.append(f"NoNewPrivs {status.get('NoNewPrivs')!r}")
    if is_dumpable():
        problems.append("dumpable")
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        problems.append("setuid(0) succeeded")
    if problems:
        raise PrivilegeDropError(0, "privileges not dropped: " + ", ".join(problems))
