"""Process hardening for the processes that hold credential values: applianced (the store's key,
values while it pushes them) and the proxy (every injected key).

`forbid_core_dumps()` sets RLIMIT_CORE to 0 (no core file, whatever the system's core_pattern
asks, except a pipe handler: hence also) and clears the dumpable flag with
prctl(PR_SET_DUMPABLE, 0), which also makes /proc/PID/{mem,environ,maps,...} root-owned and
refuses ptrace from the same uid (proc(5), PR_SET_DUMPABLE in prctl(2)). The flag is reset by
execve(2), so each process calls this itself, first thing. A failure is an error: a process that
cannot drop it should not go on to hold secrets.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource

PR_SET_DUMPABLE = 4
PR_GET_DUMPABLE = 3


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
