"""`appliancectl net show`: the crews' links, addresses, rules and counters."""

from __future__ import annotations

import argparse
from typing import Any

from . import context, exits
from .output import Output


def cmd_show(args: argparse.Namespace, out: Output) -> int:
    report = context.client(args).net()
    differs = "; ".join(report.base_differences)
    lines = [
        f"table {report.table}: {'present' if report.table_present else 'MISSING'}"
        + (f"; differs: {differs}" if differs else "")
    ]
    for crew in report.crews:
        lines.append(
            f"{crew.crew:<20} {crew.phase:<9} {crew.ifname} gw {crew.gateway} "
            f"crew {crew.address} ns {'alive' if crew.namespace_alive else 'gone'} "
            f"accepted {crew.accepted_packets} dropped {crew.dropped_packets}"
        )
    for counter in report.counters:
        lines.append(f"counter {counter.role}: {counter.packets} packets")
    if report.orphan_links or report.orphan_chains:
        lines.append(
            f"orphans: links {list(report.orphan_links)} chains {list(report.orphan_chains)}"
        )
    out.emit({"ok": True, **_plain(report)}, "\n".join(lines), [c.crew for c in report.crews])
    return exits.OK


def _plain(report: Any) -> dict[str, Any]:
    from .output import builtins

    data: dict[str, Any] = builtins(report)
    return data


def add_parsers(commands: Any, leaf: Any) -> None:
    net = commands.add_parser("net", help="the crews' networks")
    nets = net.add_subparsers(dest="net_command", required=True, metavar="COMMAND")
    leaf(nets.add_parser("show", help="links, addresses, rules and counters")).set_defaults(
        func=cmd_show
    )
