"""`appliancectl doctor`: can this host run the appliance (appliance/daemon/doctor.py)."""

from __future__ import annotations

import argparse
from typing import Any

from . import context, exits
from .output import Output


def cmd_doctor(args: argparse.Namespace, out: Output) -> int:
    from appliance.daemon.doctor import format_report, run_checks

    config = context.daemon_config(args)
    report = run_checks(config)
    out.emit(report, format_report(report), [c.name for c in report.checks if not c.ok])
    return exits.OK if report.ok else exits.FAILURE


def cmd_config_check(args: argparse.Namespace, out: Output) -> int:
    """The checks applianced makes at start (appliance/daemon/preflight.py), and nothing else:
    0 valid, 2 not (each problem on stderr, naming the file, the key and the reason)."""
    from appliance.daemon.main import check_file

    return check_file(args.config, as_json=out.as_json, prog="appliancectl")


def add_parsers(commands: Any, leaf: Any) -> None:
    leaf(
        commands.add_parser("doctor", help="check that this host can run the appliance")
    ).set_defaults(func=cmd_doctor)
    config = commands.add_parser("config", help="applianced's configuration")
    configs = config.add_subparsers(dest="config_command", required=True)
    leaf(
        configs.add_parser(
            "check", help="check the configuration and this host against it (0 valid, 2 not)"
        )
    ).set_defaults(func=cmd_config_check)
