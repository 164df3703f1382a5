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
# The ground (typed config, messages, errors) and every module of proxycore/protocol/.
GROUND = ["control", "config", "errors"]
SANS_IO = [
    *(ROOT / "proxycore" / f"{name}.py" for name in GROUND),
    *sorted((ROOT / "proxycore" / "protocol").rglob("*.py")),
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


@pytest.mark.parametrize(
    "path", SANS_IO, ids=lambda path: str(path.relative_to(ROOT / "proxycore"))
)
def test_protocol_modules_are_sans_io(path: Path) -> None:
    imports = imported_modules(path)
    assert not imports & {"trio", "socket", "asyncio", "ssl", "selectors"}, imports


def test_data_plane_cannot_name_the_control_plane() -> None:
    for path in (ROOT / "proxycore").rglob("*.py"):
        imports = imported_modules(path)
        assert not imports & {"appliance", "netns"}, (path, imports)


def test_native_is_a_leaf() -> None:
    for path in (ROOT / "native").rglob("*.py"):
        imports = imported_modules(path)
        assert not imports & {"appliance", "netns", "proxycore"}, (path, imports)
