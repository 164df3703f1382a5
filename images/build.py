"""Build the appliance's container images on this host, with no image registry.

Theory of operation
-------------------
Three images, each named ``agent-appliance/<kind>:<hash>`` where ``<hash>`` is the first 16 hex
digits of a SHA-256 over the image's *recipe*: the recipe's fields (suite, variant, packages, pinned
versions...), the bytes of every file the build feeds into the image (setup scripts, C source) and
the bytes of this module. Same recipe, same tag: if the tag exists (and its label carries the same
full hash) there is nothing to do, which costs one ``docker image inspect`` per image. Any change
to the recipe gives a new tag and so a rebuild; nothing is ever rebuilt in place.

- **base**: ``debootstrap --variant=minbase`` from Debian's archive into a tree, then in a chroot
  (``base-setup.sh``): the suite's updates and security sources, upgrade, no docs, no apt caches.
- **infra**: the process that holds a crew's network namespace: ``pause.c`` compiled statically,
  alone in the image, run as UID 65534.
- **agent**: a copy of the base tree plus, in a chroot (``agent-setup.sh``), git, curl, python3,
  Node.js, the user ``agent`` (UID 1001) and no set-user-ID programs; then Claude Code's native
  program at ``/usr/local/bin/claude``, from the npm package pinned by version *and* integrity.

A finished tree is streamed with ``tar`` into ``docker import`` (which makes a one-layer image) with
the image's configuration and labels. The import is done untagged; the image is tagged only when
the tar stream ended cleanly and, for the agent, a hardened smoke run passed. A failure anywhere
leaves no tag, and the untagged import is removed.

Every chroot runs under ``unshare --mount --pid --fork`` so the /proc it mounts (debootstrap mounts
its own too) lives in a mount namespace that dies with it: no mount can outlive a build, and a
tree is never deleted while something is mounted inside it (checked before every delete).

Slow inputs are cached under the cache directory (``/var/cache/agent-appliance/images``, or
``$AGENT_APPLIANCE_IMAGE_CACHE``): the pristine debootstrap tree (keyed by suite, variant and
extra packages), the finished base tree (keyed by the base hash; the agent starts from a copy) and
the verified npm tarball. Builds hold an exclusive lock on the cache directory, so two callers
(``make demo`` and a test run) never build the same thing at once.

The cached trees are snapshots: an unchanged recipe does not pick up Debian updates published later.
``--rebuild`` (``force=True``) drops the cached trees and rebuilds everything from the archive.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

HERE = Path(__file__).resolve().parent
REPOSITORY = "agent-appliance"
Kind = Literal["base", "infra", "agent"]
KINDS: tuple[Kind, ...] = ("base", "infra", "agent")

# Labels every image carries; `recipe` is what a cache hit is checked against.
LABEL_KIND = "org.agent-appliance.image"
LABEL_RECIPE = "org.agent-appliance.recipe"
LABEL_BUILDER = "org.agent-appliance.builder"
LABEL_CLAUDE_CODE = "org.agent-appliance.claude-code"

# Bump when the way a pristine debootstrap tree is made changes (its cache key does not cover
# this file's bytes, so that editing this module does not mean a new debootstrap).
DEBOOTSTRAP_TREE_FORMAT = 1
DEFAULT_CACHE_DIR = Path("/var/cache/agent-appliance/images")
CACHE_ENV = "AGENT_APPLIANCE_IMAGE_CACHE"
# Another Debian mirror for debootstrap (it must also serve the -security archive under
# "<mirror>-security"); not part of any hash: a mirror serves the same packages.
MIRROR_ENV = "AGENT_APPLIANCE_DEBIAN_MIRROR"

PATH_VALUE = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Build steps that can wait on the network get a bound; a stuck mirror is an error, not a hang.
NETWORK_STEP_TIMEOUT = 1800.0
LOCAL_STEP_TIMEOUT = 600.0

_DEBIAN_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+")
_SUITE = re.compile(r"[a-z]+")
_USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_NPM_PACKAGE = re.compile(r"(@[a-z0-9][a-z0-9._-]*/)?[a-z0-9][a-z0-9._-]*")
_VERSION = re.compile(r"\d+\.\d+\.\d+")
_CFLAG = re.compile(r"-[A-Za-z0-9=_.,+-]+")


class ImageError(Exception):
    """Base of this module's errors; never raised itself."""


class RecipeError(ImageError, ValueError):
    """A recipe field holds a value the build would not accept; the message names the field."""


class ToolMissingError(ImageError):
    """A program the build needs is not installed; the message says how to install it."""


class BuildStepError(ImageError):
    """One build step failed. ``step`` names it; the message carries the tail of its output."""

    def __init__(self, step: str, detail: str, hint: str = "") -> None:
        self.step = step
        self.detail = detail
        self.hint = hint
        message = f"images: step {step!r} failed"
        if hint:
            message += f" ({hint})"
        super().__init__(f"{message}: {detail}" if detail else message)


# -- recipes ---------------------------------------------------------------------------------------


def _check(name: str, value: str, pattern: re.Pattern[str]) -> None:
    if not pattern.fullmatch(value):
        raise RecipeError(f"recipe field {name!r}: {value!r} is not valid")


@dataclass(frozen=True, slots=True)
class BaseRecipe:
    suite: str = "bookworm"
    variant: str = "minbase"
    # Extra packages for debootstrap's --include (none: the agent adds its own on top).
    include: tuple[str, ...] = ()
    setup_script: Path = HERE / "base-setup.sh"

    def __post_init__(self) -> None:
        _check("base.suite", self.suite, _SUITE)
        if self.variant not in ("minbase", "buildd", "fakechroot"):
            raise RecipeError(f"recipe field 'base.variant': {self.variant!r} is not valid")
        for package in self.include:
            _check("base.include", package, _DEBIAN_PACKAGE)


@dataclass(frozen=True, slots=True)
class InfraRecipe:
    source: Path = HERE / "pause.c"
    cflags: tuple[str, ...] = ("-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror")
    uid: int = 65534

    def __post_init__(self) -> None:
        for flag in self.cflags:
            _check("infra.cflags", flag, _CFLAG)
        if not 0 < self.uid < 2**31:
            raise RecipeError(f"recipe field 'infra.uid': {self.uid!r} is not a non-root UID")


@dataclass(frozen=True, slots=True)
class ClaudeCodePin:
    """The npm package holding Claude Code's native program, pinned by version and integrity.

    The wrapper package ``@anthropic-ai/claude-code`` only picks this per-platform package as an
    optional dependency and runs its ``claude`` ELF; the image needs the ELF alone (no Node.js
    22, which the wrapper would require). Update both fields together:
    ``npm view @anthropic-ai/claude-code-linux-x64@VERSION dist.integrity``.
    """

    package: str = "@anthropic-ai/claude-code-linux-x64"
    version: str = "2.1.330"
    integrity: str = (
        "sha512-9Gn+V7DtJ8M1nztP9CeDVl9g3RtrepI7rOFTyPRRnZe8D6zebIHKmC7O"
        "vBauucuAP0X0k85SDN/LPVZyjsGezQ=="
    )
    # The member of the package tarball that is the program.
    member: str = "package/claude"

    def __post_init__(self) -> None:
        _check("agent.claude_code.package", self.package, _NPM_PACKAGE)
        _check("agent.claude_code.version", self.version, _VERSION)
        if not self.integrity.startswith("sha512-"):
            raise RecipeError("recipe field 'agent.claude_code.integrity': must be a sha512- value")


@dataclass(frozen=True, slots=True)
class AgentRecipe:
    packages: tuple[str, ...] = ("ca-certificates", "curl", "git", "nodejs", "python3")
    uid: int = 1001
    user: str = "agent"
    home: str = "/home/agent"
    setup_script: Path = HERE / "agent-setup.sh"
    claude_code: ClaudeCodePin = field(default_factory=ClaudeCodePin)

    def __post_init__(self) -> None:
        for package in self.packages:
            _check("agent.packages", package, _DEBIAN_PACKAGE)
        if not 0 < self.uid < 2**31:
            raise RecipeError(f"recipe field 'agent.uid': {self.uid!r} is not a non-root UID")
        _check("agent.user", self.user, _USER_NAME)
        if not re.fullmatch(r"/[A-Za-z0-9/_.-]+", self.home) or ".." in self.home:
            raise RecipeError(f"recipe field 'agent.home': {self.home!r} is not valid")


@dataclass(frozen=True, slots=True)
class Recipes:
    base: BaseRecipe = field(default_factory=BaseRecipe)
    infra: InfraRecipe = field(default_factory=InfraRecipe)
    agent: AgentRecipe = field(default_factory=AgentRecipe)


@dataclass(frozen=True, slots=True)
class ImageSet:
    """The tags of the three images, as `docker run` takes them."""

    base: str
    infra: str
    agent: str


@dataclass(frozen=True, slots=True)
class ImageResult:
    kind: Kind
    tag: str
    recipe_hash: str
    built: bool
    seconds: float


def _sha256_file(path: Path, field_name: str) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise RecipeError(f"recipe field {field_name!r}: cannot read {path}: {exc}") from exc


def _digest(document: dict[str, object]) -> str:
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def debootstrap_key(recipe: BaseRecipe) -> str:
    """Cache key of the pristine debootstrap tree: only what debootstrap itself is given."""
    return _digest(
        {
            "format": DEBOOTSTRAP_TREE_FORMAT,
            "suite": recipe.suite,
            "variant": recipe.variant,
            "include": sorted(recipe.include),
        }
    )


def recipe_hashes(recipes: Recipes) -> dict[Kind, str]:
    """Each image's full recipe SHA-256; the agent's covers the base's (it starts from it)."""
    builder = _sha256_file(Path(__file__), "builder")
    base = _digest(
        {
            "kind": "base",
            "builder": builder,
            "debootstrap": debootstrap_key(recipes.base),
            "setup_script": _sha256_file(recipes.base.setup_script, "base.setup_script"),
        }
    )
    infra = _digest(
        {
            "kind": "infra",
            "builder": builder,
            "source": _sha256_file(recipes.infra.source, "infra.source"),
            "cflags": list(recipes.infra.cflags),
            "uid": recipes.infra.uid,
        }
    )
    agent_recipe = recipes.agent
    agent = _digest(
        {
            "kind": "agent",
            "builder": builder,
            "base": base,
            "packages": sorted(agent_recipe.packages),
            "uid": agent_recipe.uid,
            "user": agent_recipe.user,
            "home": agent_recipe.home,
            "setup_script": _sha256_file(agent_recipe.setup_script, "agent.setup_script"),
            "claude_code": dataclasses.asdict(agent_recipe.claude_code),
        }
    )
    return {"base": base, "infra": infra, "agent": agent}


def image_tag(kind: Kind, recipe_hash: str) -> str:
    return f"{REPOSITORY}/{kind}:{recipe_hash[:16]}"


def image_tags(recipes: Recipes | None = None) -> ImageSet:
    """The tags the recipes name, whether or not they are built (nothing is run)."""
    hashes = recipe_hashes(recipes or Recipes())
    return ImageSet(**{kind: image_tag(kind, hashes[kind]) for kind in KINDS})


# -- running things --------------------------------------------------------------------------------

Log = Callable[[str], None]


def _log_to_stderr(message: str) -> None:
    print(f"images: {message}", file=sys.stderr, flush=True)


def require_tool(program: str, install_hint: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise ToolMissingError(f"images: {program} is not installed ({install_hint})")
    return path


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(
    step: str,
    argv: Sequence[str],
    *,
    log_file: Path,
    timeout: float = LOCAL_STEP_TIMEOUT,
    hint: str = "",
    env: dict[str, str] | None = None,
) -> None:
    """Run one build step with its output in `log_file`; any failure names the step."""
    with log_file.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        try:
            completed = subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                timeout=timeout, env=env, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise BuildStepError(step, f"no result after {timeout:.0f} s", hint) from None
        except OSError as exc:
            raise BuildStepError(step, str(exc), hint) from exc
    if completed.returncode != 0:
        detail = f"exit status {completed.returncode}\n{_tail(log_file)}"
        raise BuildStepError(step, detail, hint)


def _docker(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    require_tool("docker", "apt-get install docker.io, then start dockerd")
    try:
        return subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        detail = f"docker {args[0]} gave no answer in {timeout:.0f} s"
        raise BuildStepError("engine", detail, "is dockerd running?") from None


def _engine_error(result: subprocess.CompletedProcess[str]) -> BuildStepError:
    return BuildStepError(
        "engine", result.stderr.strip() or f"exit status {result.returncode}", "is dockerd running?"
    )


def _recipe_label(tag: str) -> str | None:
    """The recipe hash label of the image `tag`, or None when no such image exists."""
    template = "{{index .Config.Labels " + json.dumps(LABEL_RECIPE) + "}}"
    result = _docker("image", "inspect", "--format", template, tag)
    if result.returncode == 0:
        return result.stdout.strip()
    if "no such image" in result.stderr.lower():
        return None
    raise _engine_error(result)


def _mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve()).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            mount_point = line.split()[4].replace("\\040", " ")
            if mount_point.startswith(prefix) or mount_point == prefix[:-1]:
                found.append(mount_point)
    return found


def _remove_tree(path: Path) -> None:
    """Delete a build tree, refusing if anything is mounted inside it (a bind of /dev or /proc
    there would make rm delete the host's files)."""
    if not path.exists():
        return
    mounted = _mounts_under(path)
    if mounted:
        raise BuildStepError("cleanup", f"refusing to delete {path}: mounted inside: {mounted}")
    shutil.rmtree(path)


def _copy_tree(step: str, source: Path, target: Path, log_file: Path) -> None:
    # cp -a keeps device nodes, owners, hard links and modes (shutil.copytree does not).
    _run(step, ["cp", "-a", "--reflink=auto", f"{source}/.", str(target)], log_file=log_file)


def _chroot(step: str, root: Path, argv: Sequence[str], *, log_file: Path, hint: str = "") -> None:
    """Run `argv` chrooted in `root`, in a private mount and PID namespace with its own /proc,
    with the host's resolver configuration for the duration (apt needs names)."""
    resolv = root / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)
    try:
        _run(
            step,
            ["unshare", "--mount", "--propagation", "private", "--pid", "--fork",
             f"--mount-proc={root / 'proc'}", "chroot", str(root), *argv],
            log_file=log_file, timeout=NETWORK_STEP_TIMEOUT, hint=hint,
            env={"PATH": PATH_VALUE, "LC_ALL": "C", "HOME": "/root"},
        )  # fmt: skip
    finally:
        _normalise_host_files(root)


def _normalise_host_files(root: Path) -> None:
    """No trace of the build host: the engine mounts its own resolv.conf, hosts and hostname."""
    resolv = root / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_text("")
    (root / "etc" / "hostname").write_text("localhost\n")


def _project_version() -> str:
    try:
        from importlib.metadata import version

        return version("agent-appliance")
    except Exception:
        return "unknown"


def _import_tree(
    step: str,
    tag: str,
    *,
    tar_argv: Sequence[str],
    changes: Sequence[str],
    log_file: Path,
    verify: Callable[[str], None] | None = None,
) -> None:
    """Stream a tar into `docker import` untagged, check it, and only then give it `tag`."""
    change_args = [arg for change in changes for arg in ("--change", change)]
    with log_file.open("ab") as log:
        tar = subprocess.Popen(tar_argv, stdout=subprocess.PIPE, stderr=log)
        try:
            imported = subprocess.run(
                ["docker", "import", *change_args, "-"], stdin=tar.stdout, capture_output=True,
                text=True, timeout=LOCAL_STEP_TIMEOUT, check=False,
            )  # fmt: skip
        finally:
            assert tar.stdout is not None
            tar.stdout.close()
            tar_status = tar.wait()
    image_id = imported.stdout.strip() if imported.returncode == 0 else ""
    try:
        if tar_status != 0:
            # A tar that died between two members still looks like a complete archive.
            raise BuildStepError(step, f"tar exit status {tar_status}\n{_tail(log_file)}")
        if imported.returncode != 0:
            raise (
                _engine_error(imported)
                if "daemon" in imported.stderr
                else BuildStepError(step, imported.stderr.strip())
            )
        if verify is not None:
            verify(image_id)
        tagged = _docker("tag", image_id, tag)
        if tagged.returncode != 0:
            raise BuildStepError("tag", tagged.stderr.strip())
    except BaseException:
        if image_id:
            _docker("image", "rm", "--force", image_id)
        raise


def _labels(kind: Kind, recipe_hash: str, extra: dict[str, str] | None = None) -> list[str]:
    labels = {
        LABEL_KIND: kind,
        LABEL_RECIPE: recipe_hash,
        LABEL_BUILDER: f"images.build agent-appliance/{_project_version()}",
        **(extra or {}),
    }
    return [f"LABEL {key}={json.dumps(value)}" for key, value in labels.items()]


# -- the builder -----------------------------------------------------------------------------------


class _Builder:
    """One build run: holds the cache lock, a scratch directory and the step log."""

    def __init__(self, recipes: Recipes, cache_dir: Path, log: Log, work: Path) -> None:
        self.recipes = recipes
        self.hashes = recipe_hashes(recipes)
        self.cache_dir = cache_dir
        self.log = log
        self.work = work
        self.log_file = work / "build.log"
        self.trees = cache_dir / "trees"
        self.trees.mkdir(exist_ok=True)

    def _scratch(self, name: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.work))
        return path

    # The pristine debootstrap tree, cached by debootstrap_key.
    def debootstrap_tree(self) -> Path:
        recipe = self.recipes.base
        final = self.trees / f"debootstrap-{debootstrap_key(recipe)[:16]}"
        if final.is_dir():
            return final
        require_tool("debootstrap", "apt-get install debootstrap")
        require_tool("unshare", "apt-get install util-linux")
        target = self._scratch("debootstrap") / "tree"
        argv = ["unshare", "--mount", "--propagation", "private", "debootstrap",
                f"--variant={recipe.variant}"]  # fmt: skip
        if recipe.include:
            argv.append("--include=" + ",".join(recipe.include))
        argv += [recipe.suite, str(target)]
        mirror = os.environ.get(MIRROR_ENV)
        if mirror:
            argv.append(mirror)
        self.log(f"debootstrap --variant={recipe.variant} {recipe.suite} (about 25-45 s)")
        _run(
            "debootstrap", argv, log_file=self.log_file, timeout=NETWORK_STEP_TIMEOUT,
            hint="is Debian's package archive reachable?",
        )  # fmt: skip
        self._prune("debootstrap-")
        target.rename(final)
        return final

    # The base image's tree, cached by the base recipe hash; the agent starts from a copy.
    def base_tree(self) -> Path:
        final = self.trees / f"base-{self.hashes['base'][:16]}"
        if final.is_dir():
            return final
        pristine = self.debootstrap_tree()
        target = self._scratch("base") / "tree"
        self.log("base: updates, no docs, no apt caches (chroot)")
        _copy_tree("copy debootstrap tree", pristine, target, self.log_file)
        script = self.recipes.base.setup_script
        shutil.copyfile(script, target / "tmp" / "base-setup.sh")
        _chroot(
            "base setup (apt in chroot)", target,
            ["/bin/sh", "/tmp/base-setup.sh", self.recipes.base.suite],
            log_file=self.log_file, hint="is Debian's package archive reachable?",
        )  # fmt: skip
        (target / "tmp" / "base-setup.sh").unlink()
        self._prune("base-")
        target.rename(final)
        return final

    def _prune(self, prefix: str) -> None:
        """Older cached trees of the same kind are superseded by the one being made."""
        for old in self.trees.glob(f"{prefix}*"):
            _remove_tree(old)

    def build_base(self, tag: str) -> None:
        tree = self.base_tree()
        self.log(f"importing {tag}")
        _import_tree(
            "import base", tag,
            tar_argv=["tar", "-C", str(tree), "--numeric-owner", "-c", "."],
            changes=[*_labels("base", self.hashes["base"]), f"ENV PATH={PATH_VALUE}",
                     'CMD ["/bin/bash"]'],
            log_file=self.log_file,
        )  # fmt: skip

    def build_infra(self, tag: str) -> None:
        recipe = self.recipes.infra
        require_tool("gcc", "apt-get install gcc libc6-dev")
        scratch = self._scratch("infra")
        program = scratch / "pause"
        self.log("infra: compiling pause (static)")
        _run(
            "compile pause", ["gcc", *recipe.cflags, "-o", str(program), str(recipe.source)],
            log_file=self.log_file, hint="a static build needs libc6-dev (libc.a)",
        )  # fmt: skip
        archive = scratch / "rootfs.tar"
        # The image holds one file; a fixed mtime and owner keep the archive reproducible.
        with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
            info = tar.gettarinfo(str(program), arcname="pause")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o755
            with program.open("rb") as data:
                tar.addfile(info, data)
        self.log(f"importing {tag}")
        _import_tree(
            "import infra", tag,
            tar_argv=["cat", str(archive)],
            changes=[*_labels("infra", self.hashes["infra"]),
                     f"USER {recipe.uid}:{recipe.uid}", 'ENTRYPOINT ["/pause"]'],
            log_file=self.log_file,
        )  # fmt: skip

    def claude_code_tarball(self) -> Path:
        """The pinned npm tarball, downloaded once with npm and checked against the pin."""
        pin = self.recipes.agent.claude_code
        npm_cache = self.cache_dir / "npm"
        npm_cache.mkdir(exist_ok=True)
        digest = base64.b64decode(pin.integrity.removeprefix("sha512-")).hex()[:16]
        name = pin.package.strip("@").replace("/", "-")
        cached = npm_cache / f"{name}-{pin.version}-{digest}.tgz"
        if cached.is_file() and _integrity(cached) == pin.integrity:
            return cached
        require_tool("npm", "apt-get install npm")
        scratch = self._scratch("npm")
        self.log(f"npm pack {pin.package}@{pin.version} (about 175 MB)")
        _run(
            "npm pack", ["npm", "pack", "--silent", f"{pin.package}@{pin.version}",
                         "--pack-destination", str(scratch)],
            log_file=self.log_file, timeout=NETWORK_STEP_TIMEOUT,
            hint="is the npm registry reachable?",
        )  # fmt: skip
        packed = list(scratch.glob("*.tgz"))
        if len(packed) != 1:
            raise BuildStepError("npm pack", f"expected one tarball, found {packed}")
        actual = _integrity(packed[0])
        if actual != pin.integrity:
            raise BuildStepError(
                "npm pack", f"{pin.package}@{pin.version} has integrity {actual}, the recipe pins "
                f"{pin.integrity}: refusing it",
            )  # fmt: skip
        packed[0].rename(cached)
        return cached

    def build_agent(self, tag: str) -> None:
        recipe = self.recipes.agent
        tarball = self.claude_code_tarball()
        base = self.base_tree()
        root = self._scratch("agent") / "tree"
        self.log("agent: " + ", ".join(recipe.packages) + " (apt in chroot)")
        _copy_tree("copy base tree", base, root, self.log_file)
        shutil.copyfile(recipe.setup_script, root / "tmp" / "agent-setup.sh")
        _chroot(
            "agent setup (apt in chroot)", root,
            ["/bin/sh", "/tmp/agent-setup.sh", str(recipe.uid), recipe.user, recipe.home,
             *recipe.packages],
            log_file=self.log_file, hint="is Debian's package archive reachable?",
        )  # fmt: skip
        (root / "tmp" / "agent-setup.sh").unlink()
        self.log(f"agent: Claude Code {recipe.claude_code.version} -> /usr/local/bin/claude")
        _install_claude(tarball, recipe.claude_code, root)
        self.log(f"importing {tag}, then a hardened smoke run")
        _import_tree(
            "import agent", tag,
            tar_argv=["tar", "-C", str(root), "--numeric-owner", "-c", "."],
            changes=[
                *_labels("agent", self.hashes["agent"],
                         {LABEL_CLAUDE_CODE: recipe.claude_code.version}),
                f"ENV PATH={PATH_VALUE}", f"ENV HOME={recipe.home}",
                f"USER {recipe.uid}:{recipe.uid}", f"WORKDIR {recipe.home}",
                'CMD ["/bin/bash"]',
            ],
            log_file=self.log_file,
            verify=lambda image_id: _smoke_agent(image_id, recipe),
        )  # fmt: skip
        _remove_tree(root.parent)


def _integrity(path: Path) -> str:
    digest = hashlib.sha512()
    with path.open("rb") as data:
        for chunk in iter(lambda: data.read(1 << 20), b""):
            digest.update(chunk)
    return "sha512-" + base64.b64encode(digest.digest()).decode()


def _install_claude(tarball: Path, pin: ClaudeCodePin, root: Path) -> None:
    target = root / "usr" / "local" / "bin" / "claude"
    licence_dir = root / "usr" / "share" / "doc" / "claude-code"
    try:
        with tarfile.open(tarball, "r:gz") as archive:
            member = archive.getmember(pin.member)
            if not member.isfile():
                raise BuildStepError("install claude", f"{pin.member} is not a regular file")
            source = archive.extractfile(member)
            assert source is not None
            with source, target.open("wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
            with contextlib.suppress(KeyError):
                licence = archive.extractfile("package/LICENSE.md")
                if licence is not None:
                    licence_dir.mkdir(parents=True, exist_ok=True)
                    (licence_dir / "LICENSE.md").write_bytes(licence.read())
    except (OSError, KeyError, tarfile.TarError) as exc:
        raise BuildStepError("install claude", f"{tarball}: {exc}") from exc
    os.chown(target, 0, 0)
    target.chmod(0o755)


def _smoke_agent(image_id: str, recipe: AgentRecipe) -> None:
    """The image must do its job under the hardening the appliance runs it with, before it is
    tagged: a broken agent image must not become a cache hit."""
    script = "id -u && claude --version && git --version && python3 --version && node --version"
    result = _docker(
        "run", "--rm", "--network", "none", "--read-only", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", image_id, "sh", "-c", script,
        timeout=120.0,
    )  # fmt: skip
    lines = result.stdout.splitlines()
    if result.returncode != 0 or not lines or lines[0] != str(recipe.uid):
        detail = f"exit status {result.returncode}: {result.stdout.strip()} {result.stderr.strip()}"
        raise BuildStepError("agent smoke run", detail)
    if recipe.claude_code.version not in result.stdout:
        raise BuildStepError("agent smoke run", f"claude --version said {result.stdout.strip()!r}")


# -- entry points ----------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR)


@contextlib.contextmanager
def _locked(cache_dir: Path) -> Iterator[None]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_images(
    kinds: Sequence[Kind] = KINDS,
    *,
    recipes: Recipes | None = None,
    cache_dir: Path | None = None,
    force: bool = False,
    log: Log = _log_to_stderr,
) -> dict[Kind, ImageResult]:
    """Make sure the images of `kinds` exist, building what is missing; report what was done.

    `force` drops the cached trees (not the npm tarball, which is pinned by integrity) and
    rebuilds every image of `kinds` even if its tag exists.
    """
    recipes = recipes or Recipes()
    hashes = recipe_hashes(recipes)
    results: dict[Kind, ImageResult] = {}
    missing: list[Kind] = []
    for kind in kinds:
        started = time.monotonic()
        tag = image_tag(kind, hashes[kind])
        if not force and _recipe_label(tag) == hashes[kind]:
            results[kind] = ImageResult(kind, tag, hashes[kind], False, time.monotonic() - started)
        else:
            missing.append(kind)
    if not missing:
        return results

    if os.geteuid() != 0:
        raise ImageError("images: building needs root (debootstrap, chroot, unshare)")
    cache_dir = cache_dir or default_cache_dir()
    with _locked(cache_dir):
        work_root = cache_dir / "work"
        work_root.mkdir(exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="build-", dir=work_root))
        builder = _Builder(recipes, cache_dir, log, work)
        if force:
            builder._prune("")
        try:
            for kind in missing:
                started = time.monotonic()
                tag = image_tag(kind, hashes[kind])
                # Someone else may have built it while this run waited for the lock.
                built = force or _recipe_label(tag) != hashes[kind]
                if built:
                    getattr(builder, f"build_{kind}")(tag)
                    log(f"{tag} built in {time.monotonic() - started:.1f} s")
                results[kind] = ImageResult(
                    kind, tag, hashes[kind], built, time.monotonic() - started
                )
        finally:
            _remove_tree(work)
    return {kind: results[kind] for kind in kinds}


def ensure_images(
    *, recipes: Recipes | None = None, cache_dir: Path | None = None, log: Log = _log_to_stderr
) -> ImageSet:
    """The base, infra and agent images, built if missing; returns their tags."""
    results = build_images(KINDS, recipes=recipes, cache_dir=cache_dir, log=log)
    return ImageSet(**{kind: results[kind].tag for kind in KINDS})


def prune_images(recipes: Recipes | None = None) -> tuple[list[str], list[str]]:
    """Untag the images of this module's repositories that the recipes no longer name.

    Returns (removed, kept): an image a container still uses is kept (no --force), so pruning
    never pulls the root file system from under a running crew.
    """
    current = set(dataclasses.asdict(image_tags(recipes)).values())
    removed: list[str] = []
    kept: list[str] = []
    for kind in KINDS:
        listed = _docker(
            "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", f"{REPOSITORY}/{kind}"
        )
        if listed.returncode != 0:
            raise _engine_error(listed)
        for tag in listed.stdout.split():
            if tag in current or tag.endswith(":<none>"):
                continue
            (removed if _docker("image", "rm", tag).returncode == 0 else kept).append(tag)
    return removed, kept


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m images.build",
        description="Build the appliance's base, infra and agent images (cached by recipe hash).",
    )
    parser.add_argument("--only", choices=KINDS, action="append", help="build only this image")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--cache-dir", type=Path, help=f"default ${CACHE_ENV} or {DEFAULT_CACHE_DIR}"
    )
    parser.add_argument("--rebuild", action="store_true", help="ignore every cache and rebuild")
    parser.add_argument("--tags", action="store_true", help="print the tags only; build nothing")
    parser.add_argument(
        "--prune", action="store_true", help="then untag images that older recipes named"
    )
    args = parser.parse_args(argv)
    kinds: list[Kind] = args.only or list(KINDS)
    try:
        if args.tags:
            tags = dataclasses.asdict(image_tags())
            print(json.dumps(tags) if args.json else "\n".join(tags[k] for k in kinds))
            return 0
        results = build_images(kinds, cache_dir=args.cache_dir, force=args.rebuild)
        removed, kept = prune_images() if args.prune else ([], [])
    except ImageError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    if args.json:
        report: dict[str, object] = {k: dataclasses.asdict(r) for k, r in results.items()}
        if args.prune:
            report["pruned"] = {"removed": removed, "kept_in_use": kept}
        print(json.dumps(report))
    else:
        for result in results.values():
            state = f"built in {result.seconds:.1f} s" if result.built else "cached"
            print(f"{result.kind:<6} {result.tag}  {state}")
        for tag in removed:
            print(f"pruned {tag}")
        for tag in kept:
            print(f"kept   {tag} (a container uses it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
