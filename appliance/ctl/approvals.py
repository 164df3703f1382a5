"""`appliancectl approvals list|allow|deny`: answering the hosts crews were refused.

A restricted crew refused a host outside its allowlist files a pending request in applianced
(appliance/daemon/approvals.py); the agent's refusal says so, for how long, and what to run.
`list --watch` long-polls applianced (`GET /v1/approvals?since=N&wait=30`) and prints each new
request as it is filed, until Ctrl-C (exit 130). `allow` adds the host to the crew's allowlist
(as `crew allow`), `allow --once [--for 10m]` lets the crew reach it for a while, `deny` drops
the request and refuses the host for the window without filing a new one.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import time
from typing import Any

from appliance.daemon import messages

from . import context, exits, output
from .events import parse_duration
from .output import Output

# Seconds one long poll of `list --watch` may wait for a request (applianced caps it at 60).
WATCH_WAIT = 30.0
HEADER = ["CREW", "HOST", "PORT", "COUNT", "FIRST SEEN", "LAST SEEN", "EXPIRES IN"]


def operator() -> str | None:
    """Who answers, as this machine names them (journaled beside the admin connection's peer,
    which is what applianced itself vouches for)."""
    name = os.environ.get("SUDO_USER")
    if not name:
        try:
            name = getpass.getuser()
        except (KeyError, OSError):
            return None
    return name[:64]  # applianced takes no more


def left(until: float) -> str:
    """Seconds from now to `until` as 14m05s, 45s, 2h10m."""
    seconds = max(0, int(until - time.time()))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def row(request: messages.ApprovalRequest) -> list[str]:
    return [
        request.crew,
        request.host,
        str(request.port),
        str(request.count),
        output.clock(request.first_seen),
        output.clock(request.last_seen),
        left(request.expires),
    ]


def listing_text(listing: messages.ApprovalList) -> str:
    lines = [
        output.table(HEADER, (row(r) for r in listing.requests))
        if listing.requests
        else "no pending approval requests"
    ]
    for title, entries in (("allowed for now", listing.grants), ("denied", listing.denied)):
        if entries:
            lines.append(f"\n{title}:")
            lines += [f"  {e.crew}  {e.host}  ({left(e.until)} left)" for e in entries]
    return "\n".join(lines)


def request_line(request: messages.ApprovalRequest) -> str:
    return (
        f"{output.clock(request.first_seen)}  {request.crew}  {request.host}:{request.port}  "
        f"pending, expires in {left(request.expires)}  (appliancectl approvals allow "
        f"{request.crew} {request.host} [--once])"
    )


def emit_request(out: Output, request: messages.ApprovalRequest) -> None:
    """One request as it arrives: a line, or one JSON (or YAML) document per request."""
    if out.format == "json":
        print(json.dumps(output.builtins(request)), flush=True)
    elif out.format == "yaml":
        print("---\n" + output.to_yaml(output.builtins(request)).rstrip("\n"), flush=True)
    elif out.format == "name":
        print(f"{request.crew}/{request.host}", flush=True)
    else:
        print(request_line(request), flush=True)


def cmd_list(args: argparse.Namespace, out: Output) -> int:
    client = context.client(args, timeout=WATCH_WAIT + 60)
    if not args.watch:
        listing = client.approvals(crew=args.crew)
        names = [f"{r.crew}/{r.host}" for r in listing.requests]
        out.emit({"ok": True, **output.builtins(listing)}, listing_text(listing), names)
        return exits.OK
    # The requests pending now, then each new one as applianced files it; Ctrl-C ends it
    # (KeyboardInterrupt: main.py exits 130 without a traceback). A request refreshed by
    # another refusal keeps its seq: it is printed once.
    since, wait = 0, 0.0
    while True:
        listing = client.approvals(crew=args.crew, since=since, wait=wait)
        for request in listing.requests:
            emit_request(out, request)
        since, wait = max(since, listing.seq), WATCH_WAIT


def cmd_allow(args: argparse.Namespace, out: Output) -> int:
    if args.duration is not None and not args.once:
        raise context.UsageError("argument --for: only with --once (a permanent allow has none)")
    decision = messages.ApprovalDecision(
        host=args.host, once=args.once, duration=args.duration, by=operator()
    )
    result = context.client(args).approve(args.crew, decision)
    if result.decision == "allowed_once" and result.until is not None:
        human = (
            f"{result.host}: allowed for crew {result.crew} until "
            f"{output.clock(result.until)} ({left(result.until)})"
        )
    else:
        state = "added to the allowlist" if result.changed else "already on the allowlist"
        human = f"{result.host}: {state} of crew {result.crew}"
    out.emit({"ok": True, **output.builtins(result)}, human, [result.host])
    return exits.OK


def cmd_deny(args: argparse.Namespace, out: Output) -> int:
    decision = messages.ApprovalDecision(host=args.host, by=operator())
    result = context.client(args).deny(args.crew, decision)
    until = result.until or time.time()
    human = (
        f"{result.host}: denied for crew {result.crew} until {output.clock(until)} "
        f"({left(until)}); no new request is filed meanwhile"
    )
    out.emit({"ok": True, **output.builtins(result)}, human, [result.host])
    return exits.OK


def positive_duration(text: str) -> float:
    seconds = parse_duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return seconds


def add_parsers(commands: Any, leaf: Any) -> None:
    approvals = commands.add_parser(
        "approvals", help="answer the hosts crews were refused (pending approval requests)"
    )
    sub = approvals.add_subparsers(dest="approvals_command", required=True, metavar="COMMAND")
    listing = leaf(sub.add_parser("list", aliases=["ls"], help="the pending requests"))
    listing.add_argument("--crew", help="only this crew's requests")
    listing.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="print each new request as it is filed, until Ctrl-C",
    )
    listing.set_defaults(func=cmd_list)
    allow = leaf(sub.add_parser("allow", help="allow a crew a host: permanently, or --once"))
    allow.add_argument("crew")
    allow.add_argument("host")
    allow.add_argument(
        "--once",
        action="store_true",
        help="for a while only (--for, default [approvals] once: 10m), then refused again",
    )
    allow.add_argument(
        "--for",
        dest="duration",
        type=positive_duration,
        metavar="DURATION",
        help="with --once: how long, e.g. 90s, 10m, 2h",
    )
    allow.set_defaults(func=cmd_allow)
    deny = leaf(sub.add_parser("deny", help="refuse a crew a host for the window, no new request"))
    deny.add_argument("crew")
    deny.add_argument("host")
    deny.set_defaults(func=cmd_deny)
