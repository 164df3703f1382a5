"""The commands that need no applianced: `proxy` (the standalone proxy core), `proxy-allow`,
`proxy-reload-credentials` (its control socket), `scrub` (a filter through the scrubber) and
`demo` (the scripted tour)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import exits
from .context import CtlError, UsageError
from .output import Output

if TYPE_CHECKING:
    from proxycore import control


def cmd_proxy(args: argparse.Namespace, out: Output) -> int:
    """The standalone proxy (no applianced): one worker in this process, or `--workers N`
    forked by appliance/proxy_supervisor.py. applianced's workers are `python -m
    proxycore.worker` processes of their own (appliance/daemon/proxy.py)."""
    from proxycore.config import load_config, validate
    from proxycore.errors import ConfigError, ProxyError

    if args.workers < 0:
        raise UsageError("argument --workers: must be >= 1")
    try:
        config = load_config(args.config)
        warnings = validate(config, source=args.config)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    for warning in warnings:
        out.warning(warning)
    workers = args.workers or config.listen.workers
    if workers > 1:
        import msgspec

        config = msgspec.structs.replace(
            config, listen=msgspec.structs.replace(config.listen, workers=workers)
        )
    if args.check:
        out.emit({"ok": True, "warnings": warnings}, f"{args.config}: ok")
        return exits.OK
    from proxycore import logs

    # A server in the foreground: its records (the workers' "listening" lines included) as
    # applianced's workers write them (proxycore/logs.py).
    logs.configure("text", "info", excepthook="proxycore.worker")
    try:
        if workers == 1:
            from proxycore.worker import run_worker

            # Binds before announcing readiness, so a caller that sees "listening" can connect.
            run_worker(config, 0)
            return exits.OK
        from appliance.proxy_supervisor import run_supervised

        return run_supervised(config, workers)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    except ProxyError as exc:
        raise CtlError(str(exc)) from None
    except KeyboardInterrupt:
        return exits.OK  # the foreground proxy's ordinary end


def _control_request(path: str, message: control.ControlMessage) -> control.ControlReply:
    """One message to a proxy's control socket and its reply."""
    from proxycore import control

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            sock.sendall(control.encoder.encode(message) + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        raise CtlError(f"cannot reach control socket {path}: {exc}") from None
    reply = control.reply_decoder.decode(data)
    if not reply.ok:
        raise CtlError(reply.error or "refused")
    return reply


def cmd_proxy_allow(args: argparse.Namespace, out: Output) -> int:
    from proxycore import control

    reply = _control_request(args.socket, control.AllowHost(crew=args.crew, host=args.host))
    state = "added" if reply.changed else "already allowed"
    out.emit(
        {"ok": True, "crew": args.crew, "host": args.host, "changed": reply.changed},
        f"{args.host}: {state} for crew {args.crew}",
        [args.host],
    )
    return exits.OK


def cmd_proxy_reload_credentials(args: argparse.Namespace, out: Output) -> int:
    from proxycore import control

    reply = _control_request(args.socket, control.ReloadCredentials())
    state = "changed" if reply.changed else "unchanged"
    out.emit({"ok": True, "changed": reply.changed}, f"credentials reloaded ({state})")
    return exits.OK


def _named_secret(spec: str, *, from_env: bool) -> tuple[str, bytes]:
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        raise UsageError(f"{spec!r}: expected NAME={'VARIABLE' if from_env else 'PATH'}")
    if from_env:
        value = os.environ.get(where)
        if value is None:
            raise UsageError(f"--secret-env {name}: variable {where} is not set")
        return name, value.encode()
    try:
        return name, Path(where).read_bytes().strip()
    except OSError as exc:
        raise UsageError(f"--secret-file {name}: cannot read {where}: {exc.strerror}") from None


def cmd_scrub(args: argparse.Namespace, out: Output) -> int:
    """Standard input to standard output through the scrubber, streaming (logs, command output)."""
    from native.scrub import PatternError, Scrubber

    secrets = [_named_secret(s, from_env=False) for s in args.secret_file]
    secrets += [_named_secret(s, from_env=True) for s in args.secret_env]
    try:
        scrubber = Scrubber(secrets)
    except PatternError as exc:
        raise UsageError(str(exc)) from None
    stream = scrubber.stream()
    sink = sys.stdout.buffer
    # os.read, not a buffered read: output follows input as it arrives (a tailed log).
    while chunk := os.read(sys.stdin.fileno(), 65536):
        sink.write(stream.feed(chunk))
        sink.flush()
    sink.write(stream.flush())
    sink.flush()
    return exits.OK


def cmd_demo(args: argparse.Namespace, out: Output) -> int:
    from appliance import demo

    return demo.main(as_json=out.as_json)


def add_parsers(commands: Any) -> None:
    hidden_json = {"action": "store_true", "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
    proxy = commands.add_parser("proxy", help="run the proxy core in the foreground")
    proxy.add_argument("--config", required=True, help="TOML configuration file")
    proxy.add_argument("--workers", type=int, default=0, help="worker processes (SO_REUSEPORT)")
    proxy.add_argument("--check", action="store_true", help="validate the config and exit")
    proxy.add_argument("--json", **hidden_json)
    proxy.set_defaults(func=cmd_proxy)

    allow = commands.add_parser("proxy-allow", help="add a host to a crew's allowlist at run time")
    allow.add_argument("--socket", required=True, help="the proxy's control socket")
    allow.add_argument("crew")
    allow.add_argument("host")
    allow.add_argument("--json", **hidden_json)
    allow.set_defaults(func=cmd_proxy_allow)

    reload = commands.add_parser(
        "proxy-reload-credentials",
        help="make a running proxy read its provider credentials again (rotation) and rescrub",
    )
    reload.add_argument("--socket", required=True, help="the proxy's control socket")
    reload.add_argument("--json", **hidden_json)
    reload.set_defaults(func=cmd_proxy_reload_credentials)

    scrub = commands.add_parser(
        "scrub", help="filter standard input to standard output through the secret scrubber"
    )
    scrub.add_argument(
        "--secret-file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a secret to redact, read from a file (repeatable)",
    )
    scrub.add_argument(
        "--secret-env",
        action="append",
        default=[],
        metavar="NAME=VARIABLE",
        help="a secret to redact, read from an environment variable (repeatable)",
    )
    scrub.set_defaults(func=cmd_scrub)

    demo = commands.add_parser("demo", help="a scripted tour against a local fake provider")
    demo.add_argument("--json", **hidden_json)
    demo.set_defaults(func=cmd_demo)
