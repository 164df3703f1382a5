"""How this install starts one of its own programs: `python -m MODULE`, or the artifact itself.

The artifact (appliance/entry.py, docs/artifact.md) has no `python -m`: whatever the project
starts as a program of its own (applianced's workers, `appliancectl up --detach`, the demo's
daemon and CLI) asks `self_command(MODULE)` for its command line. Kept apart from entry.py, which
imports every program it dispatches to, so that the programs can ask without an import circle.
"""

from __future__ import annotations

import sys

# Each subcommand and the module that `python -m` runs for it outside the artifact.
SUBCOMMANDS: dict[str, str] = {
    "applianced": "appliance.daemon.main",
    "appliancectl": "appliance.cli",
    "proxy-worker": "proxycore.worker",
}
MODULES: dict[str, str] = {module: name for name, module in SUBCOMMANDS.items()}
PROGRAM = "agent-appliance"


def frozen() -> bool:
    """True in the artifact (PyInstaller sets `sys.frozen`)."""
    return bool(getattr(sys, "frozen", False))


def self_command(module: str, *, python: str | None = None) -> list[str]:
    """The command line that runs `module` as a program of this install: `python -m module`,
    or the artifact's own executable with the module's subcommand. `python` replaces the
    interpreter (a test's other Python) and is honoured only outside the artifact."""
    if frozen():
        return [sys.executable, MODULES[module]]
    return [python or sys.executable, "-m", module]
