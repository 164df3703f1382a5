"""The artifact (`make dist`, docs/artifact.md) for the tests that run it, built once per source.

- `built_artifact()`: the onedir of `scripts/dist`, built into a cache directory named after the
  hash of everything that goes into it (the packages, packaging/, scripts/dist, pyproject.toml,
  setup.py), so a session, or the next one on unchanged sources, reuses it. A build takes about
  30 s here with the build virtualenv kept (ARTIFACT_CACHE/venv-X.Y), about a minute without
  it. Two processes that want it at once build it once (a lock).
- `hide_python()`: the prefix of a command that runs it in a mount namespace of its own where
  this checkout, its virtualenv and every Python installation of the host are empty
  directories: what the artifact runs there, it brought.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("ARTIFACT_CACHE", "/var/tmp/agent-appliance-artifact"))
# What the artifact is made of: a change to any of these is a new artifact.
SOURCES = ("appliance", "proxycore", "native", "netns", "images", "packaging")
SOURCE_FILES = ("scripts/dist", "pyproject.toml", "setup.py")
SUFFIXES = {".py", ".c", ".h", ".sh", ".spec", ".typed"}


def source_hash() -> str:
    digest = hashlib.sha256()
    files = [ROOT / name for name in SOURCE_FILES]
    for top in SOURCES:
        files += [
            path
            for path in (ROOT / top).rglob("*")
            if path.suffix in SUFFIXES and "__pycache__" not in path.parts and path.is_file()
        ]
    for path in sorted(files):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def base_python() -> str:
    """The interpreter the virtualenv was made from (PyInstaller freezes a Python, not a venv)."""
    return str(getattr(sys, "_base_executable", None) or sys.executable)


def _run_dist(tree: Path, out: Path) -> str:
    """`scripts/dist OUT` of `tree`, with the shared build virtualenv; its standard output."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {**os.environ, "DIST_PYTHON": base_python(), "DIST_VENV": str(CACHE / f"venv-{version}")}
    done = subprocess.run(
        ["nice", "-n", "10", str(tree / "scripts" / "dist"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise AssertionError(f"scripts/dist failed:\n{done.stdout}\n{done.stderr[-4000:]}")
    return done.stdout


def built_artifact() -> Path:
    """The artifact's directory (agent-appliance/), built now if this source has none yet."""
    out = CACHE / source_hash()
    app = out / "agent-appliance"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (app / "agent-appliance").is_file() and (out / "built").is_file():
            return app
        shutil.rmtree(out, ignore_errors=True)
        started = time.monotonic()
        stdout = _run_dist(ROOT, out)
        (out / "built").write_text(f"{time.monotonic() - started:.1f} s\n{stdout}")
        # Older sources' artifacts: one is enough to keep.
        for old in CACHE.iterdir():
            if old.is_dir() and old != out and not old.name.startswith(("venv-", "upgrade-")):
                shutil.rmtree(old, ignore_errors=True)
        return app


def tarball(app: Path) -> Path:
    """The tarball `scripts/dist` packed beside the artifact's directory."""
    (found,) = app.parent.glob("agent-appliance-*-linux-*.tar.gz")
    return found


_TOP_LEVEL_SKIPPED = {".git", ".venv", "build", "dist", "tests", "bench", "fuzz", "node_modules"}
_SKIPPED = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", ".*_cache")


def _not_built_from(directory: str, names: list[str]) -> set[str]:
    skipped = set(_SKIPPED(directory, names))
    if Path(directory) == ROOT:
        skipped |= _TOP_LEVEL_SKIPPED & set(names)
    return skipped


def upgrade_artifact() -> Path:
    """An artifact one version newer than this tree's (`+upgrade.test`, a PEP 440 local version,
    sorts after it), built from a copy of the tree, for the provisioning test's upgrade. Cached
    like built_artifact(), under its own name (about 30 s to build)."""
    from appliance._version import __version__

    version = f"{__version__}+upgrade.test"
    out = CACHE / f"upgrade-{source_hash()}"
    app = out / "agent-appliance"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (app / "agent-appliance").is_file() and (out / "built").is_file():
            return app
        for old in CACHE.glob("upgrade-*"):
            shutil.rmtree(old, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="upgrade-tree-") as work:
            tree = Path(work) / "tree"
            # The checkout as it is (uncommitted changes too), less what is not built from.
            shutil.copytree(ROOT, tree, symlinks=True, ignore=_not_built_from)
            version_file = tree / "appliance" / "_version.py"
            version_file.write_text(
                version_file.read_text().replace(
                    f'__version__ = "{__version__}"', f'__version__ = "{version}"'
                )
            )
            stdout = _run_dist(tree, out)
        (out / "built").write_text(stdout)
        return app


def python_locations() -> list[str]:
    """Every directory where this host keeps a Python or the project's packages."""
    places = {
        str(ROOT),
        sys.prefix,
        sys.base_prefix,
        sysconfig.get_paths()["stdlib"],
        "/usr/lib/python3",
        "/usr/local/lib",
    }
    places |= {str(p) for p in Path("/usr/lib").glob("python3*")}
    places |= {str(p) for p in Path("/usr/lib/x86_64-linux-gnu").glob("libpython3*")}
    pyenv = Path.home() / ".pyenv"
    if pyenv.is_dir():
        places.add(str(pyenv))
    kept: list[str] = []
    # mount(8) follows a symbolic link (libpython3.X.so): the file it names is what is hidden.
    for place in sorted({os.path.realpath(p) for p in places if os.path.exists(p)}):
        # Under a directory already hidden: it no longer exists in the namespace.
        if not any(place.startswith(parent.rstrip("/") + "/") for parent in kept):
            kept.append(place)
    return kept


def private_copy(app: Path, directory: Path) -> Path:
    """A copy of the artifact in `directory`, made root-owned 0700: a worker that has dropped
    to its UID can no longer read a file of it (the strictest case for its late imports)."""
    os.chown(directory, 0, 0)
    os.chmod(directory, 0o700)
    copy = directory / "agent-appliance"
    shutil.copytree(app, copy, symlinks=True)
    return copy


def hidden_env(*argv: str) -> list[str]:
    """argv run where no Python is (`hide_python`), with an empty environment but PATH."""
    return [*hide_python(), "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", *argv]


# Runs "$@" after an empty read-only file system (or /dev/null, for a file) is mounted over every
# path given before `--`, in the mount namespace `unshare --mount` gave it.
_HIDE = """
while [ "$1" != -- ]; do
    if [ -d "$1" ]; then mount -t tmpfs -o ro,size=4k none "$1"
    else mount --bind /dev/null "$1"; fi
    shift
done
shift
exec "$@"
"""


def hide_python() -> list[str]:
    """A command prefix: what follows runs where `python_locations()` are empty."""
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-ec",
        _HIDE,
        "hide-python",
        *python_locations(),
        "--",
    ]
