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

Address allocations are not duplicated here: the network layer keeps them in its own state file
(`<state_dir>/net/netns-state.json`, written atomically by `netns/`), and a crew row refers to its
allocation by the crew name. Two stores could disagree after a crash; reconciliation treats the
crew row as the intent and the network file as the allocation (docs/daemon.md).

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

from .errors import DaemonError

SCHEMA_VERSION = 1
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
    error TEXT
);
"""


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
            " agent_id, gateway, created, updated, error) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
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
            ),
        )

    _UPDATABLE = frozenset({"phase", "infra_id", "agent_id", "gateway", "error", "allow"})

    def update(self, name: str, **fields: object) -> None:
        unknown = set(fields) - self._UPDATABLE
        if unknown:
            raise ValueError(f"not updatable: {sorted(unknown)}")
        values: list[object] = []
        for key, value in fields.items():
            if isinstance(value, enum.Enum):
                value = value.value
            elif key == "allow":
                value = json.dumps(list(value))  # type: ignore[call-overload]
            values.append(value)
        # The column names come from _UPDATABLE (checked above), never from a caller's data.
        assignments = ", ".join(f"{key}=?" for key in fields)
        self.db.execute(
            f"UPDATE crews SET {assignments}, updated=? WHERE name=?",  # noqa: S608
            (*values, time.time(), name),
        )

    def delete(self, name: str) -> None:
        self.db.execute("DELETE FROM crews WHERE name=?", (name,))
