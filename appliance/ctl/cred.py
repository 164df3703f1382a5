"""`appliancectl cred add|ls|grant|revoke|rotate`: the credential store.

A value is read from a file (--from-file) or standard input (a prompt without echo on a TTY, or
piped), never from an argument: argv is readable by every user in /proc/PID/cmdline and lands in
shell histories. No option takes a value.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from appliance.daemon import messages

from . import context, exits, output
from .context import UsageError
from .output import Output


def read_value(args: argparse.Namespace) -> bytes:
    """The value from --from-file or stdin, one trailing newline removed."""
    if args.from_file:
        try:
            with open(args.from_file, "rb") as handle:
                data = handle.read(1 << 20)
        except OSError as exc:
            raise UsageError(
                f"argument --from-file: cannot read {args.from_file}: {exc.strerror}"
            ) from None
    elif sys.stdin.isatty():
        import getpass

        try:
            data = getpass.getpass(f"value for {args.name} (not echoed): ").encode()
        except EOFError:
            raise UsageError("no value entered") from None
    else:
        data = sys.stdin.buffer.read(1 << 20)
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        source = f"--from-file {args.from_file}" if args.from_file else "standard input"
        raise UsageError(f"the value from {source} is empty")
    return data


def _who(crew: str, agent: str | None) -> str:
    return crew + (f"/{agent}" if agent else "")


def state(cred: messages.CredentialInfo) -> str:
    return "TAMPERED" if cred.tampered else "revoked" if cred.revoked else "active"


HEADER = ["NAME", "PROVIDER", "KIND", "LEVEL", "VER", "STATE", "GRANTS"]


def line(cred: messages.CredentialInfo, wide: bool) -> list[str]:
    grants = ",".join(_who(g.crew, g.agent) for g in cred.grants) or "-"
    refused = "; ".join(f"{_who(r.crew, r.agent)} ({r.reason})" for r in cred.refused)
    cells = [cred.name, cred.provider, cred.kind, cred.level, str(cred.version), state(cred)]
    cells.append(grants + (f"  REFUSED: {refused}" if refused else ""))
    if wide:
        cells += [output.clock(cred.created), output.clock(cred.rotated)]
    return cells


def _result(out: Output, human: str, cred: messages.CredentialInfo) -> int:
    out.emit({"ok": True, "credential": cred}, human, [cred.name])
    return exits.OK


def cmd_add(args: argparse.Namespace, out: Output) -> int:
    value = read_value(args)
    request = messages.AddCredential(
        name=args.name, provider=args.provider, value=value, level=args.level, kind=args.kind
    )
    del value
    cred = context.client(args).add_credential(request)
    human = f"credential {cred.name} added ({cred.provider}, {cred.kind}, {cred.level})"
    return _result(out, human, cred)


def cmd_ls(args: argparse.Namespace, out: Output) -> int:
    listing = context.client(args).credentials()
    creds = listing.credentials
    # A record or grant that does not verify is never used; the listing exits 6 (as `journal
    # verify` does) so that a script notices.
    bad = [c.name for c in creds if c.tampered or c.refused]

    def human(wide: bool) -> str:
        header = [*HEADER, "CREATED", "ROTATED"] if wide else HEADER
        text = output.table(header, (line(c, wide) for c in creds))
        if bad:
            text += (
                f"\n{len(bad)} credential(s) with a record or grant that does not verify (never "
                f"used): {', '.join(bad)}; see docs/credentials.md"
            )
        return text

    out.emit({"ok": not bad, "credentials": creds}, human, [c.name for c in creds])
    return exits.TAMPERED if bad else exits.OK


def cmd_grant(args: argparse.Namespace, out: Output) -> int:
    request = messages.GrantCredential(crew=args.crew, agent=args.agent)
    cred = context.client(args).grant(args.name, request)
    who = f"agent {args.agent} of crew {args.crew}" if args.agent else f"crew {args.crew}"
    return _result(out, f"credential {args.name} granted to {who}", cred)


def cmd_revoke(args: argparse.Namespace, out: Output) -> int:
    request = messages.RevokeCredential(crew=args.crew, agent=args.agent)
    cred = context.client(args).revoke(args.name, request)
    who = f"crew {args.crew}" if args.crew else "every crew (marked revoked)"
    return _result(out, f"credential {args.name} revoked from {who}", cred)


def cmd_rotate(args: argparse.Namespace, out: Output) -> int:
    value = read_value(args)
    request = messages.RotateCredential(value=value, level=args.level)
    del value
    cred = context.client(args).rotate(args.name, request)
    return _result(out, f"credential {args.name} rotated to version {cred.version}", cred)


def add_parsers(commands: Any, leaf: Any) -> None:
    cred = commands.add_parser("cred", help="the credential store (values never in arguments)")
    creds = cred.add_subparsers(dest="cred_command", required=True, metavar="COMMAND")
    from_file = {
        "metavar": "FILE",
        "help": "read the value from this file (default: standard input; a prompt on a TTY)",
    }
    add = leaf(creds.add_parser("add", help="add a credential; the value from stdin or a file"))
    add.add_argument("name")
    add.add_argument(
        "--provider", required=True, help="anthropic, openai, google, or a keeper secret's name"
    )
    add.add_argument("--level", default="L3", choices=["L1", "L2", "L3"], help="default L3")
    add.add_argument("--kind", choices=["api_key", "oauth_token", "secret"], default=None)
    add.add_argument("--from-file", **from_file)
    add.set_defaults(func=cmd_add)
    leaf(creds.add_parser("ls", help="list credentials (never their values)")).set_defaults(
        func=cmd_ls
    )
    grant = leaf(creds.add_parser("grant", help="let a crew (or one agent) use a credential"))
    grant.add_argument("name")
    grant.add_argument("crew")
    grant.add_argument("--agent", metavar="ID", help="only this agent id of the crew")
    grant.set_defaults(func=cmd_grant)
    revoke = leaf(
        creds.add_parser("revoke", help="remove a crew's grants, or every grant and mark revoked")
    )
    revoke.add_argument("name")
    revoke.add_argument("crew", nargs="?")
    revoke.add_argument("--agent", metavar="ID", help="only this agent id's grant")
    revoke.set_defaults(func=cmd_revoke)
    rotate = leaf(
        creds.add_parser("rotate", help="a new value (version + 1), from stdin or a file")
    )
    rotate.add_argument("name")
    rotate.add_argument("--level", choices=["L1", "L2", "L3"], default=None)
    rotate.add_argument("--from-file", **from_file)
    rotate.set_defaults(func=cmd_rotate)
