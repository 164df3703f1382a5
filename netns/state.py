"""The persistent record of which crew holds which subnet, and how far its setup got.

Theory of operation: one JSON file, `netns-state.json`, in a directory given by the caller,
rewritten whole on every change: written to a temporary file in the same directory, fsync'd,
renamed over the old one, and the directory fsync'd, so that after a crash the file is either
the old or the new version, never a mix (rename(2) is atomic within a file system; the directory
fsync makes the rename itself durable, see fsync(2) "NOTES").

Each crew record carries a phase, written *before* the kernel is touched:

    CREATING  -> rules, then veth, then addresses are being made   (crash: next start undoes them)
    READY     -> everything is in place                            (crash: next start restores)
    DETACHING -> veth, then rules are being removed                (crash: next start finishes)
    DETACHED  -> the subnet stays reserved for the crew, no kernel objects

so that `CrewNetworks.reconcile` knows, for every crew, whether to finish or undo. A lock file
(`flock(2)`, held for the manager's lifetime) keeps a second manager off the same state.

Version 2 also records the names the kernel objects were made under (`naming`: the table and
the interface prefix, marked with the instance id) and `owner`, a random token that the
appliance writes into its table, so that a second appliance configured with the same instance
id is recognised and refused rather than taking the table over. A version 1 file (from before
instance ids) has neither: its objects carry the configured names as they are, and the next
`reconcile` renames them (docs/netns.md, "Instances").

Version 3 records each crew's address rules (`CrewRecord.net`), so that `reconcile` restores
its sets after a restart; an older file's crews have none.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
from pathlib import Path

import msgspec

from .addressing import Naming
from .errors import StateError

STATE_FILE = "netns-state.json"
LOCK_FILE = "netns-state.lock"
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


class Phase(enum.Enum):
    CREATING = "creating"
    READY = "ready"
    DETACHING = "detaching"
    DETACHED = "detached"


class NetnsIdentity(msgspec.Struct, frozen=True):
    """A network namespace as the kernel knows it: the nsfs inode behind the path.

    A path such as /proc/PID/ns/net can later name another namespace (the PID is reused);
    the (device, inode) pair cannot, as long as the namespace lives.
    """

    path: str
    dev: int
    ino: int


class CrewRecord(msgspec.Struct, frozen=True):
    crew: str
    index: int
    phase: Phase
    netns: NetnsIdentity | None = None
    # The crew's address rules in their one spelling (netrules.py); version 3. A record of an
    # older file has none.
    net: tuple[str, ...] = ()


class NetState(msgspec.Struct, frozen=True):
    pool: str
    crews: tuple[CrewRecord, ...] = ()
    version: int = VERSION
    # The names the crews' kernel objects carry (None: a version 1 file, the configured names).
    naming: Naming | None = None
    owner: str | None = None

    def by_crew(self) -> dict[str, CrewRecord]:
        return {record.crew: record for record in self.crews}

    def with_record(self, record: CrewRecord) -> NetState:
        others = tuple(r for r in self.crews if r.crew != record.crew)
        return msgspec.structs.replace(self, crews=(*others, record))

    def without(self, crew: str) -> NetState:
        return msgspec.structs.replace(self, crews=tuple(r for r in self.crews if r.crew != crew))


class StateStore:
    """The state file of one appliance, locked for the lifetime of this object."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.path = self.directory / STATE_FILE
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock_fd = os.open(
                self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        except OSError as exc:
            raise StateError(f"cannot open state directory {self.directory}: {exc}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise StateError(
                f"state directory {self.directory} is in use by another process"
            ) from None

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def load(self, pool: str) -> NetState:
        """The recorded state, or an empty one; refuses a state made for another pool."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return NetState(pool=pool)
        except OSError as exc:
            raise StateError(f"cannot read {self.path}: {exc}") from None
        try:
            state = msgspec.json.decode(data, type=NetState)
        except msgspec.DecodeError as exc:
            raise StateError(f"{self.path} is not a valid state file: {exc}") from None
        if state.version not in READABLE_VERSIONS:
            raise StateError(f"{self.path}: unknown state version {state.version}")
        if state.pool != pool and state.crews:
            # Re-numbering crews would change their gateway addresses, i.e. their identity at
            # the proxy: refuse rather than guess.
            raise StateError(
                f"{self.path} allocates from pool {state.pool}, the configuration says {pool}: "
                "release the crews first or restore the pool"
            )
        return NetState(pool=pool, crews=state.crews, naming=state.naming, owner=state.owner)

    def save(self, state: NetState) -> None:
        data = msgspec.json.encode(msgspec.structs.replace(state, version=VERSION))
        tmp = self.path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StateError(f"cannot write {self.path}: {exc}") from None
