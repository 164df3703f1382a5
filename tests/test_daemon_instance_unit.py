"""The instance id without Docker or a kernel: derived, recorded, kept, refused when changed;
state from before instance ids migrated; one lock per id on a host."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.daemon.config import parse_config
from appliance.daemon.errors import ConfigInvalid, Unavailable
from appliance.daemon.instance import (
    derive_instance_id,
    lock_instance,
    lock_path,
    unlock_instance,
)
from appliance.daemon.state import SCHEMA_VERSION, StateCorrupt, StateStore
from netns import check_instance_id

# A state of schema version 3 (before instance ids), as that applianced wrote it.
_V3 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '3');
CREATE TABLE crews (
    name TEXT PRIMARY KEY, mode TEXT NOT NULL, allow TEXT NOT NULL, runtime TEXT NOT NULL,
    memory_bytes INTEGER NOT NULL, cpus REAL NOT NULL, phase TEXT NOT NULL, infra_id TEXT,
    agent_id TEXT, gateway TEXT, created REAL NOT NULL, updated REAL NOT NULL, error TEXT,
    slot TEXT, ssrf_allow TEXT NOT NULL DEFAULT '[]');
CREATE TABLE pool (slot TEXT PRIMARY KEY, phase TEXT NOT NULL, infra_id TEXT,
    infra_pid INTEGER, gateway TEXT, created REAL NOT NULL);
INSERT INTO crews VALUES ('a', 'restricted', '[]', 'runc', 1, 1.0, 'ready', 'infra-a', 'agent-a',
    '100.64.0.1', 0, 0, NULL, NULL, '[]');
INSERT INTO crews VALUES ('b', 'free', '[]', 'runc', 1, 1.0, 'stopped', NULL, NULL, NULL, 0, 0,
    NULL, 'pool_1', '[]');
INSERT INTO pool VALUES ('pool_2', 'ready', 'infra-slot', 7, '100.64.0.5', 0);
"""


def test_the_derived_id_is_a_valid_id_of_the_real_path(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    (tmp_path / "link").symlink_to(one)
    assert check_instance_id(derive_instance_id(one)) == derive_instance_id(one)
    assert derive_instance_id(one) != derive_instance_id(two)
    assert derive_instance_id(tmp_path / "link") == derive_instance_id(one)


def test_the_state_records_the_id_and_keeps_it(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    try:
        assert store.instance_id(None, "derived1") == "derived1"
        assert store.instance_id(None, "derived2") == "derived2"  # not recorded yet
        store.record_instance_id("derived1")
        # Recorded: a moved directory (another derived id) keeps it.
        assert store.instance_id(None, "derived2") == "derived1"
        assert store.instance_id("derived1", "derived2") == "derived1"
        with pytest.raises(StateCorrupt, match=r"belongs to instance 'derived1'.*daemon.instance"):
            store.instance_id("prod", "derived1")
        assert store.adoptable() == (set(), set())
    finally:
        store.close()
    (tmp_path / "fresh").mkdir()
    configured = StateStore(tmp_path / "fresh")
    try:
        assert configured.instance_id("prod", "derived") == "prod"
        configured.record_instance_id("prod")
        configured.record_instance_id("other")  # the first one stays
        assert configured.instance_id(None, "derived") == "prod"
    finally:
        configured.close()


def test_a_state_from_before_instance_ids_migrates(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "applianced.db")
    db.executescript(_V3)
    db.close()
    store = StateStore(tmp_path)
    try:
        ids, legacy = store.adoptable()
        # The containers its rows and free slots name: adopted if they carry no instance label.
        assert ids == {"infra-a", "agent-a", "infra-slot"}
        assert legacy == {"a", "b"}
        assert [row.name for row in store.crews()] == ["a", "b"]
        assert [row.rules for row in store.crews()] == [(), ()]  # version 5's column, too
        assert store.instance_id(None, "derived") == "derived"
    finally:
        store.close()
    db = sqlite3.connect(tmp_path / "applianced.db")
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    db.close()
    assert meta["schema_version"] == str(SCHEMA_VERSION) == "6"
    assert json.loads(meta["legacy_crews"]) == ["a", "b"]
    # Opened again: nothing migrates twice.
    StateStore(tmp_path).close()


def test_the_config_key_is_validated() -> None:
    config = parse_config(b'[daemon]\ninstance = "prod-eu"\n', source="t.toml")
    assert config.daemon.instance == "prod-eu"
    assert parse_config(b"", source="t.toml").daemon.instance is None
    for bad in ("", "Prod", "a_b", "-a", "x" * 17):
        with pytest.raises(ConfigInvalid, match=r"t.toml: `daemon.instance`: instance id"):
            parse_config(f'[daemon]\ninstance = "{bad}"\n'.encode(), source="t.toml")


def test_one_id_is_held_by_one_daemon_at_a_time(tmp_path: Path) -> None:
    fd = lock_instance(tmp_path, "prod", "/state/one")
    try:
        assert "state directory /state/one" in lock_path(tmp_path, "prod").read_text()
        # Another process (flock is per open file description; a child is what a second
        # applianced is) is refused, and told who holds the id.
        code = (
            "import sys\n"
            "from appliance.daemon.instance import lock_instance\n"
            "from appliance.daemon.errors import Unavailable\n"
            "try:\n"
            f"    lock_instance({str(tmp_path)!r}, 'prod', '/state/two')\n"
            "except Unavailable as exc:\n"
            "    print(exc)\n"
            "    sys.exit(3)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parents[1],
        )
        assert done.returncode == 3, done.stderr
        assert f"pid {os.getpid()}, state directory /state/one" in done.stdout
        assert "two state directories were given one instance id" in done.stdout
        assert "/state/two" in done.stdout
        # Another id is free.
        os.close(lock_instance(tmp_path, "other", "/state/two"))
    finally:
        os.close(fd)
    os.close(lock_instance(tmp_path, "prod", "/state/two"))  # released with its holder
    # Released by unlock_instance: the file goes too, and the id can be taken again.
    fd = lock_instance(tmp_path, "prod", "/state/three")
    unlock_instance(fd, tmp_path, "prod")
    assert not lock_path(tmp_path, "prod").exists()
    os.close(lock_instance(tmp_path, "prod", "/state/four"))
    with pytest.raises(ConfigInvalid):
        lock_instance(tmp_path, "Bad", "/state")
    assert Unavailable.status == 503
