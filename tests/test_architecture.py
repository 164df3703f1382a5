"""The dependency direction of docs/architecture.md, enforced on the import graph.

- protocol modules (sans-IO) import no trio and no socket;
- proxycore/ (the unprivileged data plane) imports nothing from appliance/ or netns/;
- native/ is a leaf.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SANS_IO = [
    "http1",
    "policy",
    "ssrf",
    "credentials",
    "refusals",
    "control",
    "config",
    "errors",
    "keeper",
]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("module", SANS_IO)
def test_protocol_modules_are_sans_io(module: str) -> None:
    imports = imported_modules(ROOT / "proxycore" / f"{module}.py")
    assert not imports & {"trio", "socket", "asyncio", "ssl", "selectors"}, imports


def test_data_plane_cannot_name_the_control_plane() -> None:
    for path in (ROOT / "proxycore").rglob("*.py"):
        imports = imported_modules(path)
        assert not imports & {"appliance", "netns"}, (path, imports)


def test_native_is_a_leaf() -> None:
    for path in (ROOT / "native").rglob("*.py"):
        imports = imported_modules(path)
        assert not imports & {"appliance", "netns", "proxycore"}, (path, imports)
