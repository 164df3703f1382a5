"""One version, everywhere: appliance/_version.py is the only place it is written.

The package's metadata is built from it (pyproject.toml declares the version dynamic, read from
that attribute), and `appliancectl --version` (the launcher a host runs, and `python -m`) and
`applianced --version` print it. The installed distribution's metadata must say the same: a
development install made before the version changed says otherwise, and `make install` fixes it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# As in a venv's bin/: the launcher starts the python3 on PATH, here this venv's.
LAUNCHER_ENV = {
    **os.environ,
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
}
# Semantic Versioning's MAJOR.MINOR.PATCH, pre-releases and development releases in PEP 440's
# spelling (CHANGELOG.md, "Versions").
VERSION = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)((a|b|rc)(0|[1-9]\d*))?(\.dev\d+)?")


def source_version() -> str:
    """The literal in appliance/_version.py, read as setuptools reads it: without importing."""
    tree = ast.parse((ROOT / "appliance" / "_version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "__version__"
        ]:
            assert isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            return node.value.value
    raise AssertionError("appliance/_version.py assigns no __version__ literal")


def run(*argv: str) -> str:
    done = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=60, cwd=ROOT, env=LAUNCHER_ENV
    )
    assert done.returncode == 0, done
    return done.stdout


def test_the_package_takes_its_version_from_one_place() -> None:
    version = source_version()
    assert VERSION.fullmatch(version), version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "the version is written in _version.py only"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "appliance._version.__version__"
    }
    installed = importlib.metadata.version("agent-appliance")
    assert installed == version, (
        f"the installed package says {installed}, appliance/_version.py {version}: "
        "reinstall (make install)"
    )


def test_appliancectl_and_applianced_print_the_package_version() -> None:
    version = importlib.metadata.version("agent-appliance")
    assert run(str(ROOT / "bin" / "appliancectl"), "--version") == f"appliancectl {version}\n"
    assert run(sys.executable, "-m", "appliance.cli", "--version") == f"appliancectl {version}\n"
    assert (
        run(sys.executable, "-m", "appliance.daemon.main", "--version") == f"applianced {version}\n"
    )
