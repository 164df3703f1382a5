"""applianced's infra pool: pre-plumbed infra namespaces (infra container running, network
attached, rules in place, no agent ever), taken by `crew create`, refilled in the background,
destroyed with the crew that took one, reconciled at start. A real daemon on the real engine,
as in test_daemon_e2e.py."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
from typing import Any

import pytest

from netns.addressing import chain_name, interface_name
from tests.daemon_support import (
    REACH_TEST_HOSTS,
    Appliance,
    busybox_images,
)

pytestmark = pytest.mark.docker


def _configure(app: Appliance, pool: int, **daemon: Any) -> None:
    agent, infra = busybox_images()
    app.infra_pool = pool
    app.write_config(agent, infra, **daemon)


def _pool_rows(app: Appliance) -> dict[str, str]:
    """slot -> infra container id, for the ready slots."""
    db = sqlite3.connect(app.state_dir / "applianced.db")
    try:
        rows = db.execute("SELECT slot, infra_id FROM pool WHERE phase='ready'").fetchall()
    finally:
        db.close()
    return dict(rows)


def _containers_of(label: str) -> list[tuple[str, str, str]]:
    """(id, role, state) of every container with that crew label."""
    out = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--no-trunc",
            "--filter",
            f"label=io.agent-appliance.crew={label}",
            "--format",
            '{{.ID}} {{.Label "io.agent-appliance.role"}} {{.State}}',
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [tuple(line.split()) for line in out.splitlines()]  # type: ignore[misc]


def _assert_slot_plumbed(app: Appliance, slot: str, infra_id: str) -> None:
    # Exactly its infra container, running; its veth and its chain (rules before any agent).
    assert _containers_of(slot) == [(infra_id, "infra", "running")]
    ifname = interface_name(app.prefix, slot)
    assert ifname in app.links(include_pool=True)
    assert chain_name(ifname) in app.chains(include_pool=True)


def test_pool_is_filled_taken_by_create_refilled_and_never_recycled(appliance: Appliance) -> None:
    app = appliance
    _configure(app, 2)
    app.start()
    app.wait_pool()
    slots = _pool_rows(app)
    assert len(slots) == 2
    for slot, infra_id in slots.items():
        _assert_slot_plumbed(app, slot, infra_id)
    code, status = app.ctl_json("status")
    assert code == 0 and status["pool_size"] == 2 and status["pool_ready"] == 2
    # Free slots are not crews.
    assert app.ctl_json("crew", "ls")[1]["crews"] == []

    name = app.crew("pooled")
    code, created = app.ctl_json("crew", "create", name, *REACH_TEST_HOSTS)
    assert code == 0, created
    crew = created["crew"]
    taken = [slot for slot, infra_id in slots.items() if infra_id == crew["infra_id"]]
    assert len(taken) == 1, (crew, slots)
    slot = taken[0]
    # The infra container is the slot's (its label names the slot), the agent is the crew's.
    roles = {c["role"]: c["container_id"] for c in crew["containers"]}
    assert roles["infra"] == slots[slot] and "agent" in roles
    assert [c[1] for c in _containers_of(name)] == ["agent"]
    assert app.ctl("run", name, "--", "true").returncode == 0
    net = app.ctl_json("net", "show")[1]
    assert net["crews"][0]["crew"] == name
    assert net["crews"][0]["ifname"] == interface_name(app.prefix, slot)

    # Refilled in the background, with a new slot; the taken one is not in the pool.
    refilled = app.wait_pool()
    assert slot not in refilled and len(set(refilled) - set(slots)) == 1
    for free, infra_id in _pool_rows(app).items():
        _assert_slot_plumbed(app, free, infra_id)

    # crew rm destroys the slot it took: container, link and chain gone; the pool unchanged.
    before = _pool_rows(app)
    code, removed = app.ctl_json("crew", "rm", name)
    assert code == 0 and removed["removed"]
    assert _containers_of(slot) == [] and _containers_of(name) == []
    ifname = interface_name(app.prefix, slot)
    assert ifname not in app.links(include_pool=True)
    assert chain_name(ifname) not in app.chains(include_pool=True)
    assert _pool_rows(app) == before
    assert app.containers() == [] and app.links() == [] and app.chains() == []

    # stop_crews_on_exit is off: the free slots stay, and the next start keeps them.
    app.stop()
    app.start()
    assert app.wait_pool() and _pool_rows(app) == before


def test_pool_reconcile_after_sigkill(appliance: Appliance) -> None:
    app = appliance
    _configure(app, 2)
    app.start()
    app.wait_pool()
    name = app.crew("keep")
    assert app.ctl("crew", "create", name, *REACH_TEST_HOSTS).returncode == 0
    app.wait_pool()
    slots = _pool_rows(app)
    app.stop(signal.SIGKILL)

    # Behind the daemon's back: one free slot loses its infra container.
    lost, kept = sorted(slots)
    subprocess.run(["docker", "rm", "-f", slots[lost]], check=True, capture_output=True)
    app.start()
    _, status = app.ctl_json("status")
    assert any(
        f"pool slot {lost}: lost its container or network: destroyed" in change
        for change in status["reconcile"]
    ), status["reconcile"]
    refilled = app.wait_pool()
    assert kept in refilled and lost not in refilled
    assert interface_name(app.prefix, lost) not in app.links(include_pool=True)
    assert app.ctl("run", name, "--", "true").returncode == 0
    _, shown = app.ctl_json("crew", "show", name)
    assert shown["crew"]["phase"] == "ready"


def test_sigkill_mid_create_without_pool_rolls_back(appliance: Appliance) -> None:
    # The path a create takes when no slot is ready (and with infra_pool = 0): killed right
    # after the network was attached, rolled back at the next start.
    app = appliance
    _configure(app, 0)
    app.start(env={"APPLIANCED_TEST_KILL_AFTER_STEP": "attach network"})
    done = app.ctl("crew", "create", app.crew("half"))
    assert done.returncode in (1, 5)
    assert app.wait_exit() == -signal.SIGKILL
    assert len(app.containers()) == 1 and len(app.links()) == 1 and len(app.chains()) == 1
    app.start()
    assert app.containers(include_pool=True) == [] and app.links(include_pool=True) == []
    _, status = app.ctl_json("status")
    assert status["pool_size"] == 0 and status["pool_ready"] == 0
    assert any("rolled back an interrupted create" in c for c in status["reconcile"])


def test_stop_crews_on_exit_destroys_the_pool(appliance: Appliance) -> None:
    app = appliance
    _configure(app, 2, stop_crews_on_exit=True)
    app.start()
    app.wait_pool()
    app.stop()
    assert app.containers(include_pool=True) == []
    assert app.links(include_pool=True) == [] and app.chains(include_pool=True) == []
    assert app.pool_slots() == []
