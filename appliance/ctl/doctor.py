"""`appliancectl doctor`: can this host run the appliance (appliance/daemon/doctor.py)."""

from __future__ import annotations

import argparse
from typing import Any

from . import context, exits
from .output import Output


def cmd_doctor(args: argparse.Namespace, out: Output) -> int:
    from appliance.daemon.doctor import run_checks

    config = context.daemon_config(args)
    report = run_checks(config)
    lines = [
        f"{'ok  ' if c.ok else ('FAIL' if c.required else 'no  ')} {c.name}: {c.detail}"
        for c in report.checks
    ]
    lines.append("all required checks passed" if report.ok else "a required check failed")
    out.emit(report, "\n".join(lines), [c.name for c in report.checks if not c.ok])
    return exits.OK if report.ok else exits.FAILURE


def add_parsers(commands: Any, leaf: Any) -> None:
    leaf(
        commands.add_parser("doctor", help="check that this host can run the appliance")
    ).set_defaults(func=cmd_doctor)
