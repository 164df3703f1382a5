"""The artifact's one executable: `applianced`, `appliancectl` and the proxy workers in one file.

Theory of operation
-------------------
`make dist` freezes the project with PyInstaller (packaging/agent-appliance.spec,
docs/artifact.md) into one directory whose executable, `agent-appliance`, starts here. It runs

    agent-appliance applianced ARGS      (also as a link named `applianced`)
    agent-appliance appliancectl ARGS    (also as a link named `appliancectl`)
    agent-appliance proxy-worker ARGS    (what applianced starts for each worker)

A frozen program has no `python -m`: whatever the project used to start as `python -m MODULE`
(applianced's workers, `appliancectl up --detach`, the demo's daemon and CLI) asks
`self_command(MODULE)` (appliance/selfexec.py) for its command line instead, which is
`[sys.executable, "-m", MODULE]` from a source tree or a virtualenv and
`[sys.executable, SUBCOMMAND]` in the artifact: the same files run every process, and no
process of the artifact needs a Python on the host.

The dispatch imports nothing but the command it runs, so `appliancectl --version` costs what it
costs from a virtualenv, plus the bootloader.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from appliance.selfexec import PROGRAM, SUBCOMMANDS, frozen


def _environment_for_children() -> None:
    """In the artifact: PyInstaller's bootloader has pointed LD_LIBRARY_PATH at the artifact's
    libraries (keeping an operator's own in LD_LIBRARY_PATH_ORIG) and left its _PYI_* variables.
    The loader read LD_LIBRARY_PATH when this process started, so what it has loaded and will
    load stays the artifact's; the programs applianced runs (nft, ip, dockerd, debootstrap) get
    the host's libraries back, and a process of the artifact started from here (a worker, a
    detached applianced) boots afresh rather than as the child of a bootloader
    (PYINSTALLER_RESET_ENVIRONMENT, PyInstaller's documented switch)."""
    original = os.environ.pop("LD_LIBRARY_PATH_ORIG", None)
    if original is None:
        os.environ.pop("LD_LIBRARY_PATH", None)
    else:
        os.environ["LD_LIBRARY_PATH"] = original
    os.environ["PYINSTALLER_RESET_ENVIRONMENT"] = "1"


def _run(name: str, argv: list[str]) -> int:
    # argparse names the program after argv[0]: the command the operator typed.
    sys.argv = [name, *argv]
    if name == "applianced":
        from appliance.daemon.main import main as daemon

        return daemon(argv)
    if name == "appliancectl":
        from appliance.ctl.fast import main as ctl

        return ctl()
    from proxycore.worker import main as worker

    return worker(argv)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv if argv is None else argv)
    if frozen():
        _environment_for_children()
    called = os.path.basename(arguments[0]) if arguments else PROGRAM
    if called in SUBCOMMANDS:
        return _run(called, arguments[1:])
    if len(arguments) > 1 and arguments[1] in SUBCOMMANDS:
        return _run(arguments[1], arguments[2:])
    if len(arguments) > 1 and arguments[1] == "--version":
        from appliance._version import __version__

        print(f"{PROGRAM} {__version__}")
        return 0
    sys.stderr.write(
        f"usage: {PROGRAM} {{{','.join(SUBCOMMANDS)}}} ARGS..."
        f" (or run it through a link named applianced or appliancectl)\n"
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
