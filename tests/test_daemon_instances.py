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
import sys
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
    assert [app.ctl_json("status")[1]["instance"] for app in (bare, other)] == [
        bare.instance,
        other.instance,
    ]
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
    assert twin.instance is None  # the refused start recorded no id in its state


# The last commit before instance ids: the applianced whose state and crews must migrate.
BEFORE_INSTANCE_IDS = "1d20c89"


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """That applianced's source tree (git archive), its native modules built from its own C
    (3 s): a module built from newer C does not match its older wrapper."""
    root = Path(__file__).parents[1]
    tree = tmp_path_factory.mktemp("before-instance-ids")
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", BEFORE_INSTANCE_IDS], capture_output=True
    )
    if archive.returncode != 0:
        pytest.skip(f"needs the git history (commit {BEFORE_INSTANCE_IDS}): a shallow clone?")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    subprocess.run(
        [sys.executable, "-m", "native.build"], cwd=tree, check=True, capture_output=True
    )
    return tree


def legacy_world(app: Appliance) -> dict[str, object]:
    """What an applianced from before instance ids made: by the names of its config."""
    listed = subprocess.run(
        [
            "docker",
            "ps",
            "-a",
            "--filter",
            f"name=^/appliance-{app.name_prefix}",
            "--format",
            "{{.ID}} {{.State}} {{.Names}} {{.Labels}}",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    links = sorted(
        name
        for name in (line.split(":")[1].strip().split("@")[0] for line in out.splitlines())
        if name.startswith(app.config_prefix)
    )
    table = subprocess.run(
        ["nft", "-s", "list", "table", "inet", app.config_table], capture_output=True, text=True
    ).stdout
    return {"containers": sorted(listed.splitlines()), "links": links, "table": table}


def test_crews_from_before_instance_ids_are_adopted_by_their_own_only(
    make: MakeAppliance, old_tree: Path
) -> None:
    """Two appliances of the former version (partitioned by their config, as they had to be),
    each with a crew and a pool slot. One is upgraded: it adopts its crew and slot (the same
    containers, kept running, in the same namespaces; its network renamed, with the same
    gateway) and serves its crew again. The other's containers, links and table stay as they
    are, also when a new instance with the default empty crew-name prefix starts beside them."""
    upgraded = make("upgraded", configure_instance=False, legacy=True)
    kept_old = make("kept-old", configure_instance=False, legacy=True)
    crew = upgraded.crew("x")
    for app in (upgraded, kept_old):
        app.start(tree=old_tree)
        app.wait_pool()
        done = app.ctl("crew", "create", app.crew("x"), *REACH_TEST_HOSTS)
        assert done.returncode == 0, (done.stderr, app.log_text()[-3000:])
    upgraded.stop()
    before_upgrade = legacy_world(upgraded)
    others = legacy_world(kept_old)
    assert upgraded.instance is None  # the former state has none
    assert "io.agent-appliance.instance" not in str(before_upgrade["containers"])
    _, old_shown = kept_old.ctl_json("crew", "show", kept_old.crew("x"))

    upgraded.start()  # this version, on the former state
    instance = upgraded.instance
    assert instance is not None and f"instance {instance})" in upgraded.log_text()
    _, status = upgraded.ctl_json("status")
    reconcile = status["reconcile"]
    assert not any(crew in c and "re-created" in c for c in reconcile), reconcile
    assert not any("no crew row" in c or "pool slot" in c for c in reconcile), reconcile
    after = world(upgraded)  # what carries its instance id: its links and table
    # The same three containers, running (adopted by the ids in its state: no instance label).
    old_ids = {line.split()[0] for line in before_upgrade["containers"]}  # type: ignore[attr-defined]
    running = {
        line.split()[0]
        for line in legacy_world(upgraded)["containers"]  # type: ignore[attr-defined]
        if line.split()[1] == "running"
    }
    assert old_ids == running and len(old_ids) == 3, (before_upgrade, reconcile)
    # Renamed: its links and table now carry the instance id; the former table is gone.
    assert all(link.startswith(upgraded.prefix) for link in after["links"])  # type: ignore[attr-defined]
    assert len(after["links"]) == 2 and after["table"]  # type: ignore[arg-type]
    assert legacy_world(upgraded)["table"] == ""
    _, shown = upgraded.ctl_json("crew", "show", crew)
    assert shown["crew"]["phase"] == "ready"
    crew_works(upgraded, crew)
    assert legacy_world(kept_old) == others
    crew_works(kept_old, kept_old.crew("x"))

    # A new instance with the default empty crew-name prefix: the former version's containers
    # carry the appliance's labels and no instance id, and its state does not name them.
    bare = make("bare", name_prefix="", configure_instance=False, infra_pool=0)
    bare.start()
    _, status = bare.ctl_json("status")
    assert [c.split(" inet")[0] for c in status["reconcile"]] == ["network: created table"]
    assert legacy_world(kept_old) == others
    assert legacy_world(upgraded)["containers"] == before_upgrade["containers"]
    _, still = kept_old.ctl_json("crew", "show", kept_old.crew("x"))
    assert still == old_shown
    # Removing the adopted crew removes its (former) containers; its free pool slot stays.
    assert upgraded.ctl("crew", "rm", crew).returncode == 0
    left = [line.split() for line in legacy_world(upgraded)["containers"]]  # type: ignore[attr-defined]
    (slot,) = upgraded.pool_slots()
    assert [name for cid, _, name, *_ in left if cid in old_ids] == [f"appliance-{slot}-infra"]
