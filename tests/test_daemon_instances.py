"""Two real applianced side by side (real Docker, real nftables, real veths), each with a crew of
the same name and a pool slot; one of them with the default empty crew-name prefix and no
configured instance id (derived from its state directory), both with one configured nftables
table and interface prefix. Each is restarted in turn: the other's crews are untouched (the
containers, their namespaces, the veths, the table), and the restarted one reconciles its own.
A third started with the id of a running one is refused with a readable line.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.demo_upstream import FakeServer
from tests.daemon_support import (
    REACH_TEST_HOSTS,
    Appliance,
    busybox_images,
    needs_root_and_docker,
    new_appliance,
)

MakeAppliance = Callable[..., Appliance]


@pytest.fixture
def make(
    tmp_path: Path, provider: FakeServer, plain_host: FakeServer, ca_file: str
) -> Iterator[MakeAppliance]:
    needs_root_and_docker()
    agent, infra = busybox_images()
    made: list[Appliance] = []

    def make_one(name: str, like: Appliance | None = None, **fields: object) -> Appliance:
        directory = tmp_path / name
        directory.mkdir()
        app = new_appliance(directory, provider.port, plain_host.port, ca_file)
        app.infra_pool = 1
        for key, value in fields.items():
            setattr(app, key, value)
        if like is not None:  # configured alike: one table name, one interface prefix
            app.config_table, app.config_prefix = like.config_table, like.config_prefix
        app.write_config(agent, infra)
        made.append(app)
        return app

    try:
        yield make_one
    finally:
        for app in reversed(made):
            app.cleanup()


def world(app: Appliance) -> dict[str, object]:
    """What the daemon made, read from the engine and the kernel: its containers (id, state,
    name) with the inode of each running one's network namespace, its veths, its table."""
    listed = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            f"label=io.agent-appliance.instance={app.instance}",
            "--format",
            "{{.ID}} {{.State}} {{.Names}}",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    containers = {}
    for line in filter(None, listed):
        container_id, state, name = line.split()
        netns = None
        if state == "running":
            pid = subprocess.run(
                ["docker", "inspect", "-f", "{{.State.Pid}}", container_id],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            netns = os.stat(f"/proc/{pid}/ns/net").st_ino
        containers[container_id] = (state, name, netns)
    table = subprocess.run(
        ["nft", "-s", "list", "table", "inet", app.table], capture_output=True, text=True
    ).stdout
    return {"containers": containers, "links": sorted(app.links(include_pool=True)), "table": table}


def crew_works(app: Appliance, crew: str) -> None:
    """The crew's agent runs, and reaches the fake provider through its proxy."""
    done = app.ctl(
        "run", crew, "--", "sh", "-c", 'wget -Y off -q -O- "$ANTHROPIC_BASE_URL/v1/models"'
    )
    assert done.returncode == 0, (done.stdout, done.stderr, app.log_text()[-3000:])


def test_two_instances_side_by_side_and_a_restart_of_each(make: MakeAppliance) -> None:
    bare = make("bare", name_prefix="", configure_instance=False)
    other = make("other", like=bare)
    crew = other.crew("x")  # the same crew name in both (the bare one takes any name)
    for app in (bare, other):
        app.start()
        app.wait_pool()
        done = app.ctl("crew", "create", crew, *REACH_TEST_HOSTS)
        assert done.returncode == 0, (done.stderr, app.log_text()[-3000:])
    assert bare.instance and bare.instance != other.instance
    assert bare.table != other.table and bare.prefix != other.prefix
    for app in (bare, other):
        shown = world(app)
        # A crew (infra, agent) and a pool slot (infra), each running in a namespace of its
        # own: the crew's two containers share one.
        states = [state for state, _, _ in shown["containers"].values()]  # type: ignore[attr-defined]
        assert states == ["running"] * 3, shown
        assert len(shown["links"]) == 2 and shown["table"], shown  # type: ignore[arg-type]
        crew_works(app, crew)

    for restarted, untouched, how in (
        (bare, other, signal.SIGTERM),
        (other, bare, signal.SIGKILL),
    ):
        before = world(untouched)
        mine = world(restarted)
        # Its own crew loses its agent container while it is down: the restart re-creates it.
        agent = next(
            cid
            for cid, (_, name, _) in mine["containers"].items()
            if "-agent." in name  # type: ignore[attr-defined]
        )
        restarted.stop(how)
        subprocess.run(["docker", "rm", "-f", agent], check=True, capture_output=True)
        restarted.start()
        _, status = restarted.ctl_json("status")
        reconcile = status["reconcile"]
        assert any(f"{crew}: lost a container or its network; re-created" in c for c in reconcile)
        assert not any("no crew row" in c for c in reconcile), reconcile
        assert world(untouched) == before
        crew_works(untouched, crew)
        crew_works(restarted, crew)
        after = world(restarted)
        # Its free pool slot kept (same container, same namespace); the crew re-created (its
        # infra is the pool slot it took at create: re-created under that slot's id, so its
        # link has the same name), and nothing else.
        free = restarted.pool_slots()
        slot = {c: v for c, v in mine["containers"].items() if any(f in v[1] for f in free)}  # type: ignore[attr-defined]
        assert len(slot) == 1 and all(after["containers"].get(c) == v for c, v in slot.items())  # type: ignore[attr-defined]
        assert len(after["containers"]) == 3 and after["links"] == mine["links"]  # type: ignore[arg-type]

    # A third applianced given the id of a running one: refused before it touches anything.
    before = (world(bare), world(other))
    twin = make("twin", like=other)
    twin.configured_instance = other.configured_instance
    twin.write_config(*busybox_images())
    with pytest.raises(RuntimeError, match="applianced exited") as refused:
        twin.start()
    assert f"instance id {other.instance!r} is in use by another applianced" in str(refused.value)
    assert "two state directories were given one instance id" in str(refused.value)
    assert "Traceback" not in str(refused.value)
    assert (world(bare), world(other)) == before
    twin.configure_instance = False  # its cleanup must not take the other's id for its own
