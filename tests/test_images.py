"""The images, built for real: debootstrap, chroot, npm and the local Docker engine.

The first run on a machine builds the three images (about a minute, see images/README.md); every
later run, and `make images` before it, makes the session fixture a cache hit. The tests that build
something else (a changed infra recipe, a broken one) use recipes of their own and remove what they
made; none touches the images the real recipes name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from images.build import (
    LABEL_KIND,
    LABEL_RECIPE,
    AgentRecipe,
    BaseRecipe,
    BuildStepError,
    ClaudeCodePin,
    ImageSet,
    InfraRecipe,
    RecipeError,
    Recipes,
    ToolMissingError,
    build_images,
    cached_tree_names,
    ensure_images,
    image_tag,
    image_tags,
    prune_cache,
    prune_images,
    recipe_hashes,
)

ROOT = Path(__file__).resolve().parent.parent
# The images the tests build from recipes of their own go here, never next to the real ones.
TEST_REPOSITORY = "agent-appliance-test"


def _engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "version"], capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (debootstrap, chroot)"),
    pytest.mark.skipif(not _engine_answers(), reason="needs Docker (a running engine)"),
]

HARDENED = [
    "--rm", "--network", "none", "--read-only", "--cap-drop", "ALL",
    "--security-opt", "no-new-privileges",
]  # fmt: skip


def docker(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=check
    )


def labels(tag: str) -> dict[str, str]:
    out = docker("image", "inspect", "--format", "{{json .Config.Labels}}", tag).stdout
    return dict(json.loads(out))


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag, check=False).returncode == 0


@pytest.fixture(scope="session")
def images() -> ImageSet:
    return ensure_images()


def test_ensure_images_builds_or_finds_all_three(images: ImageSet) -> None:
    hashes = recipe_hashes(Recipes())
    assert images == image_tags()
    for kind in ("base", "infra", "agent"):
        tag = getattr(images, kind)
        assert tag == f"agent-appliance/{kind}:{hashes[kind][:16]}"
        found = labels(tag)
        assert found[LABEL_KIND] == kind
        assert found[LABEL_RECIPE] == hashes[kind]
    assert labels(images.agent)["org.agent-appliance.claude-code"] == ClaudeCodePin().version


def test_second_call_is_a_fast_cache_hit(images: ImageSet) -> None:
    started = time.monotonic()
    again = ensure_images()
    elapsed = time.monotonic() - started
    assert again == images
    # Three `docker image inspect` calls (about 0.1 s); the bound is loose on purpose: what the
    # test holds is that nothing is built, not a timing (a busy engine answers slower).
    assert elapsed < 10.0, f"a cache hit took {elapsed:.2f} s"
    assert not any(result.built for result in build_images().values())


def test_cli_reports_a_cache_hit_as_json(images: ImageSet) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "images.build", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    report = json.loads(run.stdout)
    assert {kind: report[kind]["tag"] for kind in report} == dataclasses.asdict(images)
    assert not any(entry["built"] for entry in report.values())
    assert "Warning" not in run.stderr
    only = subprocess.run(
        [sys.executable, "-m", "images.build", "--only", "infra", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert list(json.loads(only.stdout)) == ["infra"]


def test_agent_image_runs_hardened_as_1001_with_its_tools(images: ImageSet) -> None:
    script = (
        "id -u; id -g; echo $HOME; pwd; echo $LANG; git --version; curl --version | head -n1;"
        " python3 --version; node --version; claude --version"
    )
    run = docker("run", *HARDENED, images.agent, "sh", "-c", script)
    lines = run.stdout.splitlines()
    assert lines[:5] == ["1001", "1001", "/home/agent", "/home/agent", "C.UTF-8"]
    assert lines[5].startswith("git version ")
    assert lines[6].startswith("curl ")
    assert lines[7].startswith("Python 3.")
    assert re.fullmatch(r"v\d+\.\d+\.\d+", lines[8])
    assert re.match(r"\d+\.\d+\.\d+", lines[9]) and ClaudeCodePin().version in lines[9]


def test_agent_image_has_no_setuid_programs_and_a_read_only_root(images: ImageSet) -> None:
    run = docker(
        "run", *HARDENED, images.agent, "sh", "-c",
        "find / -xdev -type f -perm /6000; touch /usr/x 2>/dev/null && echo WROTE; true",
    )  # fmt: skip
    assert run.stdout == ""


def test_base_image_runs_read_only_as_an_unprivileged_user(images: ImageSet) -> None:
    run = docker("run", *HARDENED, "--user", "1001:1001", images.base, "sh", "-c", "id -u; ls /")
    assert run.stdout.splitlines()[0] == "1001"
    # Built from Debian's archive with the suite's updates and no apt lists or package cache left.
    show = "ls /var/lib/apt/lists; cat /etc/apt/sources.list"
    lists = docker("run", *HARDENED, images.base, "sh", "-c", show)
    assert "-security" in lists.stdout and "Packages" not in lists.stdout


def test_infra_image_holds_a_network_namespace_and_stops_at_once(images: ImageSet) -> None:
    name = f"test-images-infra-{os.getpid()}"
    started = docker(
        "run", "-d", "--name", name, "--network", "none", "--read-only", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", images.infra,
    )  # fmt: skip
    try:
        assert started.stdout.strip()
        time.sleep(1.0)
        state = json.loads(docker("inspect", "--format", "{{json .State}}", name).stdout)
        assert state["Running"] is True
        assert docker("inspect", "--format", "{{.Config.User}}", name).stdout.strip() == (
            "65534:65534"
        )
        # Its namespace holds loopback only (network none): the appliance adds the crew's veth.
        pid = str(state["Pid"])
        links = subprocess.run(
            ["nsenter", f"--net=/proc/{pid}/ns/net", "ip", "-o", "link"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
        # PID 1 handles SIGTERM: docker stop does not wait out its 10 s grace period.
        stopping = time.monotonic()
        docker("stop", "--time", "10", name)
        assert time.monotonic() - stopping < 5.0
        exit_code = docker("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        assert exit_code == str(128 + 15)
    finally:
        docker("rm", "--force", name, check=False)


def test_any_change_to_a_recipe_changes_its_hash(tmp_path: Path) -> None:
    default = recipe_hashes(Recipes())
    assert recipe_hashes(Recipes()) == default  # deterministic

    more_packages = Recipes(agent=AgentRecipe(packages=(*AgentRecipe().packages, "jq")))
    changed = recipe_hashes(more_packages)
    assert changed["agent"] != default["agent"]
    assert changed["base"] == default["base"] and changed["infra"] == default["infra"]

    # The agent starts from the base: a change to the base changes both.
    other_base = recipe_hashes(Recipes(base=BaseRecipe(include=("jq",))))
    assert other_base["base"] != default["base"] and other_base["agent"] != default["agent"]

    newer_claude = ClaudeCodePin(version="9.9.9")
    assert (
        recipe_hashes(Recipes(agent=AgentRecipe(claude_code=newer_claude)))["agent"]
        != default["agent"]
    )

    # The bytes of the script run in the chroot are part of the recipe.
    script = tmp_path / "agent-setup.sh"
    script.write_bytes(AgentRecipe().setup_script.read_bytes() + b"\n# changed\n")
    edited = recipe_hashes(Recipes(agent=AgentRecipe(setup_script=script)))
    assert edited["agent"] != default["agent"]

    flags = recipe_hashes(Recipes(infra=InfraRecipe(cflags=("-static", "-O2"))))
    assert flags["infra"] != default["infra"] and flags["agent"] == default["agent"]


def test_changed_infra_recipe_builds_a_new_image(images: ImageSet, tmp_path: Path) -> None:
    recipes = Recipes(
        infra=InfraRecipe(cflags=(*InfraRecipe().cflags, "-DTEST_IMAGES_VARIANT")),
        repository=TEST_REPOSITORY,
    )
    new_hash = recipe_hashes(recipes)["infra"]
    assert new_hash != recipe_hashes(Recipes())["infra"]
    tag = image_tag("infra", new_hash, TEST_REPOSITORY)
    assert tag != images.infra
    docker("image", "rm", "--force", tag, check=False)
    try:
        results = build_images(["infra"], recipes=recipes, cache_dir=tmp_path, log=lambda _: None)
        assert results["infra"].built and results["infra"].tag == tag
        assert labels(tag)[LABEL_RECIPE] == new_hash
        assert image_exists(images.infra)  # the image of the real recipe is untouched
        again = build_images(["infra"], recipes=recipes, cache_dir=tmp_path, log=lambda _: None)
        assert not again["infra"].built
    finally:
        docker("image", "rm", "--force", tag, check=False)


def test_prune_untags_older_images_but_not_one_in_use(images: ImageSet, tmp_path: Path) -> None:
    old_recipes = [
        Recipes(
            infra=InfraRecipe(cflags=(*InfraRecipe().cflags, f"-DTEST_PRUNE_{n}")),
            repository=TEST_REPOSITORY,
        )
        for n in (1, 2)
    ]
    old_tags = [image_tag("infra", recipe_hashes(r)["infra"], TEST_REPOSITORY) for r in old_recipes]
    container = f"test-images-prune-{os.getpid()}"
    other = f"{TEST_REPOSITORY}/infra:kept-{os.getpid()}"  # a tag this module did not make
    try:
        for recipes in old_recipes:
            build_images(["infra"], recipes=recipes, cache_dir=tmp_path, log=lambda _: None)
        docker("create", "--name", container, old_tags[1])
        docker("tag", old_tags[0], other)
        removed, kept = prune_images(Recipes(repository=TEST_REPOSITORY))
        assert old_tags[0] in removed and not image_exists(old_tags[0])
        assert other not in removed and image_exists(other)
        assert old_tags[1] in kept and image_exists(old_tags[1])
        assert all(image_exists(tag) for tag in dataclasses.asdict(images).values())
    finally:
        docker("rm", "--force", container, check=False)
        for tag in [*old_tags, other]:
            docker("image", "rm", "--force", tag, check=False)


def test_prune_cache_keeps_what_the_recipes_name(tmp_path: Path) -> None:
    recipes = Recipes()
    named = cached_tree_names(recipes)
    for name in [*named, "base-0123456789abcdef", "debootstrap-0123456789abcdef"]:
        (tmp_path / "trees" / name).mkdir(parents=True)
        (tmp_path / "trees" / name / "etc").mkdir()
    (tmp_path / "npm").mkdir()
    (tmp_path / "npm" / "old-claude.tgz").write_bytes(b"x")
    removed = prune_cache(recipes, tmp_path)
    assert sorted(path.name for path in removed) == [
        "base-0123456789abcdef", "debootstrap-0123456789abcdef", "old-claude.tgz",
    ]  # fmt: skip
    assert sorted(path.name for path in (tmp_path / "trees").iterdir()) == sorted(named)


def test_a_tree_with_a_mount_inside_is_never_deleted(tmp_path: Path) -> None:
    stale = tmp_path / "trees" / "base-0123456789abcdef"
    (stale / "proc").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(stale / "proc")], check=True)
    try:
        (stale / "proc" / "keep").write_text("host file")
        with pytest.raises(BuildStepError) as refused:
            prune_cache(Recipes(), tmp_path)
        assert refused.value.step == "cleanup"
        assert (stale / "proc" / "keep").read_text() == "host file"
    finally:
        subprocess.run(["umount", str(stale / "proc")], check=True)


def test_a_failed_build_names_its_step_and_tags_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "pause.c"
    broken.write_text("int main(void) { return not_declared; }\n")
    recipes = Recipes(infra=InfraRecipe(source=broken), repository=TEST_REPOSITORY)
    tag = image_tag("infra", recipe_hashes(recipes)["infra"], TEST_REPOSITORY)
    with pytest.raises(BuildStepError) as failed:
        build_images(["infra"], recipes=recipes, cache_dir=tmp_path / "cache", log=lambda _: None)
    assert failed.value.step == "compile pause"
    assert "not_declared" in str(failed.value)
    assert not image_exists(tag)
    assert list((tmp_path / "cache" / "work").iterdir()) == []  # scratch removed


def test_a_tarball_that_does_not_match_the_pin_is_refused(tmp_path: Path) -> None:
    wrong = ClaudeCodePin(integrity="sha512-" + "A" * 86 + "==")
    recipes = Recipes(agent=AgentRecipe(claude_code=wrong), repository=TEST_REPOSITORY)
    tag = image_tag("agent", recipe_hashes(recipes)["agent"], TEST_REPOSITORY)
    with pytest.raises(BuildStepError) as failed:
        build_images(["agent"], recipes=recipes, cache_dir=tmp_path, log=lambda _: None)
    assert failed.value.step == "npm pack"
    assert "refusing" in str(failed.value)
    assert not image_exists(tag)
    assert list((tmp_path / "npm").iterdir()) == []


def test_missing_debootstrap_is_named_with_its_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A PATH with the engine's client only; a base recipe of its own so nothing is cached.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker_path = shutil.which("docker")
    assert docker_path is not None
    (bin_dir / "docker").symlink_to(docker_path)
    monkeypatch.setenv("PATH", str(bin_dir))
    recipes = Recipes(base=BaseRecipe(include=("jq",)), repository=TEST_REPOSITORY)
    with pytest.raises(ToolMissingError, match=r"debootstrap is not installed \(apt-get install"):
        build_images(["base"], recipes=recipes, cache_dir=tmp_path / "cache", log=lambda _: None)


def test_an_unreachable_mirror_is_named_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A mirror on a loopback port nobody listens on: debootstrap fails at its first fetch.
    monkeypatch.setenv("AGENT_APPLIANCE_DEBIAN_MIRROR", "http://127.0.0.1:9/debian")
    recipes = Recipes(base=BaseRecipe(include=("jq",)), repository=TEST_REPOSITORY)
    cache = tmp_path / "cache"
    with pytest.raises(BuildStepError) as failed:
        build_images(["base"], recipes=recipes, cache_dir=cache, log=lambda _: None)
    assert failed.value.step == "debootstrap"
    assert "package archive reachable" in str(failed.value)
    assert not image_exists(image_tag("base", recipe_hashes(recipes)["base"], TEST_REPOSITORY))
    assert list((cache / "trees").iterdir()) == [] and list((cache / "work").iterdir()) == []
    assert str(cache) not in Path("/proc/self/mountinfo").read_text()


def test_an_unreachable_engine_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    with pytest.raises(BuildStepError) as failed:
        ensure_images()
    assert failed.value.step == "engine"
    assert "dockerd" in str(failed.value)


@pytest.mark.parametrize(
    ("make", "field_name"),
    [
        (lambda: AgentRecipe(packages=("git", "-oAPT::Get=1")), "agent.packages"),
        (lambda: BaseRecipe(suite="bookworm main"), "base.suite"),
        (lambda: AgentRecipe(home="/home/../etc"), "agent.home"),
        (lambda: ClaudeCodePin(version="latest"), "agent.claude_code.version"),
        (lambda: InfraRecipe(uid=0), "infra.uid"),
        (lambda: Recipes(repository="Agent Appliance"), "repository"),
    ],
)
def test_bad_recipe_values_are_refused_by_name(make: object, field_name: str) -> None:
    assert callable(make)
    with pytest.raises(RecipeError, match=re.escape(repr(field_name))):
        make()
