"""applianced's persistent state: SQLite in WAL mode under the state directory.

Theory of operation
-------------------
One row per crew, written *before* each step that changes the world, so that after a crash the
next start knows what to finish or undo (see `crews.py` for the rules):

    creating  -> containers, network, proxy being set up     (crash: next start rolls back)
    ready     -> everything in place
    removing  -> being torn down                              (crash: next start finishes)
    stopped   -> torn down on purpose at daemon exit          (next start re-creates it)
    failed    -> could not be restored at start; nothing left running (operator: `crew rm`)

A pool slot (`crews.py`, the pool) has a row of its own in `pool` ("filling", then "ready")
until a crew takes it: the crew's row is inserted with `slot` set and the pool row deleted in
one transaction (`take_slot`).

Address allocations are not duplicated here: the network layer keeps them in its own state file
(`<state_dir>/net/netns-state.json`, written atomically by `netns/`), and a crew row refers to its
allocation by the crew name. Two stores could disagree after a crash; reconciliation treats the
crew row as the intent and the network file as the allocation (docs/daemon.md).

The instance id (appliance/daemon/instance.py) is recorded in `meta.instance_id` at the first
start and never changes after: the labels of the crews' containers and the names of their kernel
objects carry it. Version 4 brought it; a state from before (version 1-3) records, at the
migration, the crews it had (`meta.legacy_crews`): their containers carry no instance label and
are adopted by the ids in their rows (`adoptable`), their volumes keep their former names.

Version 5 added each crew's method and path rules (`rules`; an older state's crews get none),
version 6 its address rules (`net`; an older state's crews get none).
The schema is versioned (`meta.schema_version`); an unknown newer version is refused, never
guessed at. Every write is one transaction (`with self.db:`); WAL lets readers (`crew ls`) run
beside a writer. Calls take well under a millisecond, so the trio daemon makes them inline.
"""

from __future__ import annotations

import enum
import json
import os
import sqlite3
import time
from pathlib import Path

import msgspec

from proxycore.config import RuleConfig

from .errors import DaemonError

SCHEMA_VERSION = 6
DB_FILE = "applianced.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS crews (
    name TEXT PRIMARY KEY,
    mode TEXT NOT NULL,
    allow TEXT NOT NULL,          -- JSON array of host names
    runtime TEXT NOT NULL,
    memory_bytes INTEGER NOT NULL,
    cpus REAL NOT NULL,
    phase TEXT NOT NULL,
    infra_id TEXT,
    agent_id TEXT,
    gateway TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    error TEXT,
    slot TEXT,                    -- the pool slot it took: its infra and network are keyed by it
    ssrf_allow TEXT NOT NULL DEFAULT '[]', -- JSON array of CIDRs only this crew may reach
    rules TEXT NOT NULL DEFAULT '[]',      -- JSON array of the proxy's RuleConfig objects
    net TEXT NOT NULL DEFAULT '[]'         -- JSON array of address rules ("allow:tcp:...")
);
-- Run-time approvals (approvals.py) in force: hosts a crew may reach until `until` ("once"),
-- and hosts the operator denied until then ("denied"). Additive: created at any start where it
-- is missing, whatever the schema version. An older applianced ignores it.
-- (No semicolon in these comments: the schema is split on them.)
CREATE TABLE IF NOT EXISTS approvals (
    crew TEXT NOT NULL,
    kind TEXT NOT NULL,           -- "once" or "denied"
    host TEXT NOT NULL,
    until REAL NOT NULL,          -- wall clock (seconds since the epoch)
    created REAL NOT NULL,
    PRIMARY KEY (crew, kind, host)
);
CREATE TABLE IF NOT EXISTS pool (
    slot TEXT PRIMARY KEY,
    phase TEXT NOT NULL,          -- "filling" (being set up) or "ready"
    infra_id TEXT,
    infra_pid INTEGER,
    gateway TEXT,
    created REAL NOT NULL
);
"""
# Version 1 had no pool: its crews table gains the slot column, the pool table is created above.
_MIGRATE_1_TO_2 = "ALTER TABLE crews ADD COLUMN slot TEXT"
# Version 2 had no per-crew destination ranges: none, as before.
_MIGRATE_2_TO_3 = "ALTER TABLE crews ADD COLUMN ssrf_allow TEXT NOT NULL DEFAULT '[]'"
# Version 4 had no method and path rules: none, as before (every method and path).
_MIGRATE_4_TO_5 = "ALTER TABLE crews ADD COLUMN rules TEXT NOT NULL DEFAULT '[]'"
# Version 5 had no address rules: none, as before (nothing past the proxy).
_MIGRATE_5_TO_6 = "ALTER TABLE crews ADD COLUMN net TEXT NOT NULL DEFAULT '[]'"


class CrewPhase(enum.StrEnum):
    CREATING = "creating"
    READY = "ready"
    REMOVING = "removing"
    STOPPED = "stopped"
    FAILED = "failed"


class CrewRow(msgspec.Struct, frozen=True):
    name: str
    mode: str
    allow: tuple[str, ...]
    runtime: str
    memory_bytes: int
    cpus: float
    phase: CrewPhase
    created: float
    updated: float
    infra_id: str | None = None
    agent_id: str | None = None
    gateway: str | None = None
    error: str | None = None
    slot: str | None = None
    ssrf_allow: tuple[str, ...] = ()
    # Method and path rules, validated and with their hosts normalized (crews.py), as the proxy
    # workers are sent them.
    rules: tuple[RuleConfig, ...] = ()
    # Address rules in their one spelling (proxycore/protocol/netrules.py), as the kernel and
    # the proxy are given them.
    net: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        """What its infra container's label and its network are keyed by: the pool slot it
        took, else its own name (labels are immutable, so a slot's id stays with it)."""
        return self.slot or self.name


class SlotPhase(enum.StrEnum):
    FILLING = "filling"
    READY = "ready"


class PoolSlot(msgspec.Struct, frozen=True):
    slot: str
    phase: SlotPhase
    created: float
    infra_id: str | None = None
    infra_pid: int | None = None
    gateway: str | None = None


class StateCorrupt(DaemonError):
    code = "state"


class StateStore:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / DB_FILE
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")  # a row is the intent: it must survive
            self.db.execute("BEGIN")
            for statement in _SCHEMA.strip().split(";"):
                if statement.strip():
                    self.db.execute(statement)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self.db.execute(
                    "INSERT INTO meta(key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
            elif int(row["value"]) in (1, 2, 3, 4, 5):
                version = int(row["value"])
                if version == 1:
                    self.db.execute(_MIGRATE_1_TO_2)
                if version <= 2:
                    self.db.execute(_MIGRATE_2_TO_3)
                if version <= 3:
                    # Version 3 had no instance id: the crews it has made carry none.
                    legacy = [r["name"] for r in self.db.execute("SELECT name FROM crews")]
                    self.db.execute(
                        "INSERT INTO meta(key, value) VALUES ('legacy_crews', ?)",
                        (json.dumps(legacy),),
                    )
                if version <= 4:
                    self.db.execute(_MIGRATE_4_TO_5)
                self.db.execute(_MIGRATE_5_TO_6)
                self.db.execute(
                    "UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),)
                )
            elif int(row["value"]) != SCHEMA_VERSION:
                raise StateCorrupt(
                    f"{self.path}: schema version {row['value']}, this applianced knows "
                    f"{SCHEMA_VERSION} (refusing to guess)"
                )
            self.db.execute("COMMIT")
        except BaseException:
            self.db.close()
            raise

    def close(self) -> None:
        self.db.close()

    # -- the instance (appliance/daemon/instance.py) --------------------------------------------

    def _meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row["value"])

    def instance_id(self, configured: str | None, derived: str) -> str:
        """The instance id this state belongs to: the recorded one (`record_instance_id`, at
        the first start), else the configured one, else `derived`. A configured id that differs
        from the recorded one is refused: the crews' containers and networks carry that one."""
        recorded = self._meta("instance_id")
        if recorded is None:
            return configured or derived
        if configured is not None and configured != recorded:
            raise StateCorrupt(
                f"{self.path.parent} belongs to instance {recorded!r} (its crews carry that id), "
                f"the configuration says `daemon.instance` = {configured!r}: set it to "
                f"{recorded!r}, or give the new id a new state directory"
            )
        return recorded

    def record_instance_id(self, instance: str) -> None:
        """Keep the id for every later start (once this daemon holds it: instance.py)."""
        self.db.execute(
            "INSERT OR IGNORE INTO meta(key, value) VALUES ('instance_id', ?)", (instance,)
        )

    def adoptable(self) -> tuple[set[str], set[str]]:
        """(container ids, crew names) from before instance ids: the containers the rows name
        (they may carry no instance label; the provider checks) and the crews that existed at
        the migration (their volumes keep their former names)."""
        ids = {
            value
            for row in self.db.execute("SELECT infra_id, agent_id FROM crews")
            for value in (row["infra_id"], row["agent_id"])
            if value
        }
        ids |= {slot.infra_id for slot in self.pool() if slot.infra_id}
        return ids, set(json.loads(self._meta("legacy_crews") or "[]"))

    @staticmethod
    def _row(row: sqlite3.Row) -> CrewRow:
        return CrewRow(
            name=row["name"],
            mode=row["mode"],
            allow=tuple(json.loads(row["allow"])),
            runtime=row["runtime"],
            memory_bytes=row["memory_bytes"],
            cpus=row["cpus"],
            phase=CrewPhase(row["phase"]),
            created=row["created"],
            updated=row["updated"],
            infra_id=row["infra_id"],
            agent_id=row["agent_id"],
            gateway=row["gateway"],
            error=row["error"],
            slot=row["slot"],
            ssrf_allow=tuple(json.loads(row["ssrf_allow"])),
            rules=msgspec.json.decode(row["rules"], type=tuple[RuleConfig, ...]),
            net=tuple(json.loads(row["net"])),
        )

    def crews(self) -> list[CrewRow]:
        rows = self.db.execute("SELECT * FROM crews ORDER BY name").fetchall()
        return [self._row(row) for row in rows]

    def get(self, name: str) -> CrewRow | None:
        row = self.db.execute("SELECT * FROM crews WHERE name=?", (name,)).fetchone()
        return None if row is None else self._row(row)

    def insert(self, crew: CrewRow) -> None:
        """Record the intent to create a crew. sqlite3.IntegrityError if the name is taken."""
        self.db.execute(
            "INSERT INTO crews(name, mode, allow, runtime, memory_bytes, cpus, phase, infra_id,"
            " agent_id, gateway, created, updated, error, slot, ssrf_allow, rules, net)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                crew.name,
                crew.mode,
                json.dumps(list(crew.allow)),
                crew.runtime,
                crew.memory_bytes,
                crew.cpus,
                crew.phase.value,
                crew.infra_id,
                crew.agent_id,
                crew.gateway,
                crew.created,
                crew.updated,
                crew.error,
                crew.slot,
                json.dumps(list(crew.ssrf_allow)),
                msgspec.json.encode(crew.rules).decode(),
                json.dumps(list(crew.net)),
            ),
        )

    def take_slot(self, crew: CrewRow, slot: PoolSlot) -> None:
        """Insert the crew's row (with its slot, infra and gateway) and delete the slot's pool
        row in one transaction: after a crash the slot is either free or the crew's, never both
        or neither. sqlite3.IntegrityError if the name is taken; DaemonError if the slot is."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            gone = self.db.execute(
                "DELETE FROM pool WHERE slot=? AND phase=?", (slot.slot, SlotPhase.READY.value)
            )
            if gone.rowcount != 1:
                raise DaemonError(f"pool slot {slot.slot} is not ready")
            self.insert(crew)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # -- the pool of pre-plumbed infra namespaces (crews.py, InfraPool) --------------------

    def pool(self) -> list[PoolSlot]:
        rows = self.db.execute("SELECT * FROM pool ORDER BY created, slot").fetchall()
        return [
            PoolSlot(
                slot=row["slot"],
                phase=SlotPhase(row["phase"]),
                created=row["created"],
                infra_id=row["infra_id"],
                infra_pid=row["infra_pid"],
                gateway=row["gateway"],
            )
            for row in rows
        ]

    def pool_insert(self, slot: str) -> None:
        self.db.execute(
            "INSERT INTO pool(slot, phase, created) VALUES (?,?,?)",
            (slot, SlotPhase.FILLING.value, time.time()),
        )

    def pool_ready(self, slot: str, infra_id: str, infra_pid: int, gateway: str) -> None:
        self.db.execute(
            "UPDATE pool SET phase=?, infra_id=?, infra_pid=?, gateway=? WHERE slot=?",
            (SlotPhase.READY.value, infra_id, infra_pid, gateway, slot),
        )

    def pool_delete(self, slot: str) -> None:
        self.db.execute("DELETE FROM pool WHERE slot=?", (slot,))

    _UPDATABLE = frozenset({"phase", "infra_id", "agent_id", "gateway", "error", "allow", "net"})

    def update(self, name: str, **fields: object) -> None:
        unknown = set(fields) - self._UPDATABLE
        if unknown:
            raise ValueError(f"not updatable: {sorted(unknown)}")
        values: list[object] = []
        for key, value in fields.items():
            if isinstance(value, enum.Enum):
                value = value.value
            elif key in ("allow", "net"):
                value = json.dumps(list(value))  # type: ignore[call-overload]
            values.append(value)
        # The column names come from _UPDATABLE (checked above), never from a caller's data.
        assignments = ", ".join(f"{key}=?" for key in fields)
        self.db.execute(
            f"UPDATE crews SET {assignments}, updated=? WHERE name=?",  # noqa: S608
            (*values, time.time(), name),
        )

    def delete(self, name: str) -> None:
        """The crew's row, and its approvals with it: whatever deletes a row (a removal, a
        create rolled back, reconcile), a crew made again under the name starts with none."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute("DELETE FROM crews WHERE name=?", (name,))
            self.db.execute("DELETE FROM approvals WHERE crew=?", (name,))
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # -- run-time approvals (approvals.py) ----------------------------------------------------

    def approvals(self) -> list[tuple[str, str, str, float]]:
        """(crew, kind, host, until) of every grant and denial stored, expired ones included."""
        rows = self.db.execute("SELECT crew, kind, host, until FROM approvals ORDER BY until")
        return [(r["crew"], r["kind"], r["host"], float(r["until"])) for r in rows]

    def approval_set(self, crew: str, kind: str, host: str, until: float) -> None:
        """One grant or denial; replaces the crew's other kind for that host in one
        transaction (a host is granted or denied, never both)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute("DELETE FROM approvals WHERE crew=? AND host=?", (crew, host))
            self.db.execute(
                "INSERT INTO approvals(crew, kind, host, until, created) VALUES (?,?,?,?,?)",
                (crew, kind, host, until, time.time()),
            )
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def approval_delete(self, crew: str, host: str | None = None) -> None:
        """A crew's entries for `host` (None: all of them)."""
        if host is None:
            self.db.execute("DELETE FROM approvals WHERE crew=?", (crew,))
        else:
            self.db.execute("DELETE FROM approvals WHERE crew=? AND host=?", (crew, host))

    def approvals_expire(self, now: float) -> int:
        return self.db.execute("DELETE FROM approvals WHERE until<=?", (now,)).rowcount
