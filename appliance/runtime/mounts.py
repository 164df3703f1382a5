"""The check every host path goes through before it is mounted into a crew's container.

Only host paths in the crew's spec are ever mounted: the operator's, and applianced's read-only
trust files (appliance/daemon/crew_tls.py); the provider adds none of its own besides the crew's
named volumes. Whatever the configuration says, a container
engine's socket is refused, and so is any directory that holds one: write access to it is root on
the host (`docker run -v /:/host --privileged ...`). The check resolves symbolic links first, so
`/tmp/innocent -> /var/run/docker.sock` is refused too.

The check looks at the well-known socket paths (the engine detection's list, plus the engine
actually in use), at names that engines use for their sockets anywhere, and at the first levels
of a mounted directory (bounded, so mounting a large tree stays fast). Directories that hold the
usual socket locations (/, /run, /var, /var/run, a home with ~/.docker) are refused by the
first rule, whatever is in them at the moment.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

from .engine import engine_socket_paths
from .errors import InvalidSpec, UnsafeMount

# Names of engine sockets wherever they are (podman's per-user, containerd's shims, buildkit).
ENGINE_SOCKET_NAMES = (
    "docker.sock",
    "podman.sock",
    "containerd.sock",
    "containerd.sock.ttrpc",
    "buildkitd.sock",
    "dockershim.sock",
    "crio.sock",
)
SCAN_DEPTH = 3
SCAN_ENTRIES = 20_000


def check_mounts(
    mounts: Sequence[tuple[str, str, bool]], *, extra_sockets: Iterable[str] = ()
) -> list[tuple[str, str, bool]]:
    """The mounts with their sources resolved; UnsafeMount / InvalidSpec before anything runs."""
    sockets = [os.path.realpath(p) for p in [*engine_socket_paths(), *extra_sockets]]
    # A hard link to an engine's socket reaches the same listener under any name: compare inodes.
    identities = {_identity(p) for p in sockets} - {None}
    checked: list[tuple[str, str, bool]] = []
    targets: set[str] = set()
    for index, mount in enumerate(mounts):
        if not (isinstance(mount, tuple | list) and len(mount) == 3):
            raise InvalidSpec(f"mounts[{index}]", "must be (host path, container path, read_only)")
        source, target, read_only = mount
        if not isinstance(source, str) or not os.path.isabs(source):
            raise InvalidSpec(f"mounts[{index}]", f"host path {source!r} must be absolute")
        if not isinstance(target, str) or not os.path.isabs(target) or "\0" in target:
            raise InvalidSpec(f"mounts[{index}]", f"container path {target!r} must be absolute")
        if os.path.normpath(target) == "/":
            raise InvalidSpec(f"mounts[{index}]", "cannot mount over the container's root")
        if os.path.normpath(target) in targets:
            raise InvalidSpec(f"mounts[{index}]", f"container path {target!r} mounted twice")
        targets.add(os.path.normpath(target))
        resolved = os.path.realpath(source)
        _refuse_engine_sockets(source, target, resolved, sockets, identities)
        checked.append((resolved, target, bool(read_only)))
    return checked


def _identity(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISSOCK(info.st_mode) else None


def _is_engine_socket(path: str, name: str, identities: set[tuple[int, int] | None]) -> bool:
    return name in ENGINE_SOCKET_NAMES or _identity(path) in identities


def _refuse_engine_sockets(
    source: str,
    target: str,
    resolved: str,
    sockets: list[str],
    identities: set[tuple[int, int] | None],
) -> None:
    shown = source if source == resolved else f"{source} (resolves to {resolved})"
    try:
        mode = os.stat(resolved).st_mode
    except OSError as exc:
        raise UnsafeMount(source, target, f"{shown}: {exc.strerror or exc}") from None
    here = Path(resolved)
    for socket_path in sockets:
        if resolved == socket_path:
            raise UnsafeMount(source, target, f"{shown} is a container engine's socket")
        if Path(socket_path).is_relative_to(here):
            raise UnsafeMount(
                source, target, f"{shown} holds the container engine socket path {socket_path}"
            )
    if stat.S_ISSOCK(mode):
        if _is_engine_socket(resolved, here.name, identities):
            raise UnsafeMount(source, target, f"{shown} is a container engine's socket")
        return
    if stat.S_ISDIR(mode):
        found = _find_engine_socket(here, identities)
        if found is not None:
            raise UnsafeMount(source, target, f"{shown} holds a container engine socket: {found}")


def _find_engine_socket(root: Path, identities: set[tuple[int, int] | None]) -> str | None:
    """A socket with an engine's name within SCAN_DEPTH levels under root (bounded walk)."""
    seen = 0
    level = [root]
    for _ in range(SCAN_DEPTH):
        below: list[Path] = []
        for directory in level:
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if seen > SCAN_ENTRIES:
                    return None
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode
                    if stat.S_ISSOCK(mode) and _is_engine_socket(
                        entry.path, entry.name, identities
                    ):
                        return entry.path
                    if stat.S_ISDIR(mode):
                        below.append(Path(entry.path))
                except OSError:
                    continue
        level = below
    return None
