"""The appliance's instance id, and one applianced per id on a host.

Theory of operation
-------------------
Several applianced may run on one host (a test instance beside a real one, two tenants). Each has
an instance id, and everything it creates carries it: its containers' and volumes' labels and
names (appliance/runtime/docker.py), its nftables table and the prefix of its interfaces
(netns/addressing.py, `naming`). Everything it lists, reconciles or removes is selected by that
id, so an instance never touches another's crews, whatever their names (the default
`[crews] name_prefix = ""` included).

The id is `[daemon] instance`, else one derived from the state directory's real path (8 hex
digits of SHA-256: two directories, two ids; never empty). The state records it at the first
start and keeps it (state.py, `instance_id`): a moved state directory keeps its id, and a
configured id that differs from the recorded one is refused (the crews carry the recorded one).

One id, one applianced: two state directories configured with one id would share labels and
names, and each would take the other's crews for orphans of its own. `lock_instance` holds an
flock(2) on `<daemon.run_dir>/instance-<id>.lock` for the daemon's life (run_dir is on /run,
host-wide, and every applianced of the host writes there for its keeper socket already); the
holder's pid and state directory are written in it, for the message the second one prints.
netns checks it a second way, before it changes anything: the owner token in its table.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from pathlib import Path

from netns import NetnsError, check_instance_id

from .errors import ConfigInvalid, Unavailable

DERIVED_LENGTH = 8


def derive_instance_id(state_dir: str | os.PathLike[str]) -> str:
    """The default id: from the state directory's real path (symlinks resolved, so two paths
    to one directory give one id, and the state directory's own lock keeps them apart)."""
    digest = hashlib.sha256(os.fsencode(os.path.realpath(state_dir))).hexdigest()
    return digest[:DERIVED_LENGTH]


def lock_path(run_dir: str | os.PathLike[str], instance: str) -> Path:
    return Path(run_dir) / f"instance-{instance}.lock"


def lock_instance(
    run_dir: str | os.PathLike[str], instance: str, state_dir: str | os.PathLike[str]
) -> int:
    """Hold the host-wide lock of `instance` (the fd; closing it releases the lock), or raise
    Unavailable naming the applianced that holds it."""
    try:
        check_instance_id(instance)
    except NetnsError as exc:
        raise ConfigInvalid(f"`daemon.instance`: {exc}") from None
    path = lock_path(run_dir, instance)
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise Unavailable(
                f"instance id {instance!r} is in use by another applianced ({holder}): two "
                f"state directories were given one instance id (this one is "
                f"{os.fspath(state_dir)}); give each its own `daemon.instance`, or leave it "
                "unset (derived from the state directory)"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # The holder unlinks the file as it exits (`unlock_instance`): a lock taken on the
        # file it unlinked is no lock (a third process may have made a new one); open again.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}, state directory {os.fspath(state_dir)}\n".encode(), 0)
    return fd


def unlock_instance(fd: int, run_dir: str | os.PathLike[str], instance: str) -> None:
    """Release the lock and remove its file (unlinked while held: see `lock_instance`)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock_path(run_dir, instance))
    os.close(fd)
