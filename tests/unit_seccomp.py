"""The seccomp half of applianced's systemd unit, applied without systemd.

systemd turns `SystemCallFilter=`, `SystemCallErrorNumber=`, `RestrictAddressFamilies=`,
`RestrictNamespaces=`, `MemoryDenyWriteExecute=`, `RestrictSUIDSGID=` (the chmod family) and
`LockPersonality=` into one seccomp filter (systemd.exec(5), "System Call Filtering" and
"Sandboxing"; src/shared/seccomp-util.c). This machine has no systemd as PID 1, so this module
builds the same filter with libseccomp (seccomp_rule_add(3)) and then execs its command, which
inherits it (seccomp(2): filters survive execve and fork):

    python tests/unit_seccomp.py --unit UNIT_FILE -- COMMAND...

The allow list is systemd's own: `systemd-analyze syscall-filter` prints each group, expanded
here recursively. What this does not reproduce: systemd's filters for non-native architectures
(`SystemCallArchitectures=native` has libseccomp's default: another architecture's call is
killed), `RestrictRealtime=`, and `RestrictSUIDSGID=` on open(2) with O_CREAT.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
from pathlib import Path

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ = 4
SCMP_CMP_MASKED_EQ = 7
PROT_WRITE, PROT_EXEC = 0x2, 0x4
SHM_EXEC = 0o100000
S_ISUID_ISGID = 0o6000
FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17}
NAMESPACES = {
    "mnt": 0x00020000,
    "cgroup": 0x02000000,
    "uts": 0x04000000,
    "ipc": 0x08000000,
    "user": 0x10000000,
    "pid": 0x20000000,
    "net": 0x40000000,
}
# The syscalls that get argument rules below instead of a plain allow.
CONDITIONAL = {
    "mmap",
    "mprotect",
    "pkey_mprotect",
    "shmat",
    "socket",
    "unshare",
    "clone",
    "clone3",
    "setns",
    "personality",
    "chmod",
    "fchmod",
    "fchmodat",
}


def act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


def syscall_groups() -> dict[str, list[str]]:
    """`systemd-analyze syscall-filter`: every @group and its members (names or @groups)."""
    out = subprocess.run(
        ["systemd-analyze", "syscall-filter", "--no-pager"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.append(line.strip())
        elif not line.strip():
            current = None
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    found: set[str] = set()
    for name in names:
        found |= expand(groups[name], groups) if name.startswith("@") else {name}
    return found


def unit_settings(unit: Path) -> tuple[dict[str, str], list[str]]:
    """The unit's directives (the last of each), and every `SystemCallFilter=` line in order."""
    settings: dict[str, str] = {}
    filters: list[str] = []
    for line in unit.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            settings[key.strip()] = value.strip()
            if key.strip() == "SystemCallFilter":
                filters.append(value.strip())
    return settings, filters


def allowed_calls(filters: list[str], groups: dict[str, list[str]]) -> set[str]:
    """systemd.exec(5): the first line is an allow list; a later line starting with "~" takes
    its calls out of it again, a later plain line adds to it."""
    allowed: set[str] = set()
    for value in filters:
        if value.startswith("~"):
            allowed -= expand(value[1:].split(), groups)
        else:
            allowed |= expand(value.split(), groups)
    return allowed


class Filter:
    def __init__(self, default_errno: int) -> None:
        self.lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
        self.lib.seccomp_init.restype = ctypes.c_void_p
        self.lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
        self.lib.seccomp_rule_add_array.argtypes = (
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(ArgCmp),
        )
        self.lib.seccomp_load.argtypes = (ctypes.c_void_p,)
        self.ctx = self.lib.seccomp_init(act_errno(default_errno))
        assert self.ctx, "seccomp_init failed"

    def number(self, name: str) -> int | None:
        number = int(self.lib.seccomp_syscall_resolve_name(name.encode()))
        return None if number < 0 else number  # not a call of this architecture

    def add(self, action: int, name: str, *conditions: tuple[int, int, int, int]) -> None:
        number = self.number(name)
        if number is None:
            return
        array = (ArgCmp * max(1, len(conditions)))(*(ArgCmp(*c) for c in conditions))
        result = self.lib.seccomp_rule_add_array(self.ctx, action, number, len(conditions), array)
        if result != 0:
            raise OSError(-result, f"seccomp_rule_add {name} {conditions}: {os.strerror(-result)}")

    def load(self) -> None:
        result = self.lib.seccomp_load(self.ctx)
        if result != 0:
            raise OSError(-result, f"seccomp_load: {os.strerror(-result)}")


def build(unit: Path) -> Filter:
    settings, filters = unit_settings(unit)
    groups = syscall_groups()
    assert filters and not filters[0].startswith("~"), "an allow list first, as the unit has"
    allowed = allowed_calls(filters, groups)
    code = getattr(errno, settings.get("SystemCallErrorNumber", "EPERM"))
    seccomp = Filter(code)
    for name in sorted(allowed - CONDITIONAL):
        seccomp.add(SCMP_ACT_ALLOW, name)
    allow = SCMP_ACT_ALLOW

    if settings.get("MemoryDenyWriteExecute") == "yes":
        # Never writable and executable at once, never made executable later (seccomp-util.c).
        for prot in (0, PROT_WRITE, PROT_EXEC):
            seccomp.add(allow, "mmap", (2, SCMP_CMP_MASKED_EQ, PROT_WRITE | PROT_EXEC, prot))
        for name in ("mprotect", "pkey_mprotect"):
            seccomp.add(allow, name, (2, SCMP_CMP_MASKED_EQ, PROT_EXEC, 0))
        seccomp.add(allow, "shmat", (2, SCMP_CMP_MASKED_EQ, SHM_EXEC, 0))
    else:
        for name in ("mmap", "mprotect", "pkey_mprotect", "shmat"):
            seccomp.add(allow, name)

    families = settings.get("RestrictAddressFamilies", "").split()
    for family in families or FAMILIES:
        seccomp.add(allow, "socket", (0, SCMP_CMP_EQ, FAMILIES[family], 0))

    kept = [NAMESPACES[n] for n in settings.get("RestrictNamespaces", "").split()]
    refused = sum(NAMESPACES.values()) - sum(kept)
    seccomp.add(allow, "unshare", (0, SCMP_CMP_MASKED_EQ, refused, 0))
    seccomp.add(allow, "clone", (0, SCMP_CMP_MASKED_EQ, refused, 0))
    for flag in kept:  # setns(fd, 0) would join any kind: only the kept kinds, named
        seccomp.add(allow, "setns", (1, SCMP_CMP_EQ, flag, 0))
    # clone3's flags are in memory seccomp cannot read: systemd answers ENOSYS, and the C
    # library falls back to clone.
    seccomp.add(act_errno(errno.ENOSYS), "clone3")

    if settings.get("RestrictSUIDSGID") == "yes":
        for name, index in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2)):
            seccomp.add(allow, name, (index, SCMP_CMP_MASKED_EQ, S_ISUID_ISGID, 0))
    if settings.get("LockPersonality") == "yes":
        for persona in (0, 0xFFFFFFFF):  # PER_LINUX, or a query
            seccomp.add(allow, "personality", (0, SCMP_CMP_EQ, persona, 0))
    return seccomp


def main(argv: list[str]) -> None:
    if len(argv) < 4 or argv[0] != "--unit" or argv[2] != "--":
        raise SystemExit("usage: unit_seccomp.py --unit UNIT_FILE -- COMMAND...")
    build(Path(argv[1])).load()
    os.execvp(argv[3], argv[3:])


if __name__ == "__main__":
    main(sys.argv[1:])
