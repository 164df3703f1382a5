"""`appliancectl`: the operator's command line.

Exit codes: 0 success, 1 a runtime failure (could not listen, peer refused), 2 bad usage or a bad
configuration (the message names the key or argument). Every command takes `--json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from native import headscan
from native.scrub import native_missing_notice
from proxycore import control
from proxycore.config import ProxyConfig, load_config, validate
from proxycore.errors import ConfigError, ProxyError
from proxycore.events import EventSink, JsonLinesSink, NullSink

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class _Output:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def result(self, human: str, data: dict[str, Any]) -> None:
        print(json.dumps(data) if self.as_json else human, flush=True)

    def error(self, message: str, code: int) -> int:
        if self.as_json:
            print(json.dumps({"ok": False, "error": message}), flush=True)
        else:
            print(f"appliancectl: error: {message}", file=sys.stderr, flush=True)
        return code


def make_sink(config: ProxyConfig, worker: int = 0) -> EventSink:
    events = config.events
    if events.path is None:
        return NullSink()
    return JsonLinesSink(
        events.path,
        flush_interval=events.flush_interval,
        max_batch=events.max_batch,
        max_pending=events.max_pending,
    )


def _raise_fd_limit() -> None:
    # Every tunnel holds two sockets and two pipes; the default soft limit (1024) is too low.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_proxy_worker(
    config: ProxyConfig, worker: int, control_channel: socket.socket | None = None
) -> None:
    from proxycore.server import serve

    _raise_fd_limit()

    async def main() -> None:
        channel = None
        if control_channel is not None:
            channel = trio.SocketStream(trio.socket.from_stdlib_socket(control_channel))
        async with trio.open_nursery() as nursery:

            async def serve_then_stop(task_status: trio.TaskStatus[object]) -> None:
                # serve() returns when its control channel closes (the parent is gone).
                await serve(
                    config,
                    make_sink(config, worker),
                    control_channel=channel,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()

            await nursery.start(serve_then_stop)
            where = ", ".join(
                f"{address}:{config.listen.port}"
                for address in dict.fromkeys(
                    [*(c.gateway for c in config.crew), *config.listen.addresses]
                )
            )
            print(f"proxy worker {worker}: listening on {where}", file=sys.stderr, flush=True)
            notice = native_missing_notice()
            if worker == 0 and notice:
                print(f"proxy: {notice}", file=sys.stderr, flush=True)
            if worker == 0 and not headscan.AVAILABLE:
                # Said once: the reference parser serves, correct but slower.
                print(
                    "proxy: native head scanner not built (no C compiler at install?); "
                    "using the Python parser",
                    file=sys.stderr,
                    flush=True,
                )
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

    trio.run(main)


def _load_proxy_config(path: str) -> ProxyConfig:
    """TOML, or JSON for a file applianced generated (the same Struct tree, same checks)."""
    if not path.endswith(".json"):
        return load_config(path)
    import msgspec

    try:
        config = msgspec.json.decode(Path(path).read_bytes(), type=ProxyConfig)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    validate(config, source=path)
    return config


def cmd_proxy(args: argparse.Namespace, out: _Output) -> int:
    try:
        config = _load_proxy_config(args.config)
        warnings = validate(config, source=args.config)
    except ConfigError as exc:
        return out.error(str(exc), EXIT_USAGE)
    for warning in warnings:
        print(f"appliancectl: warning: {warning}", file=sys.stderr, flush=True)
    workers = args.workers or config.listen.workers
    if workers > 1:
        import msgspec

        config = msgspec.structs.replace(
            config, listen=msgspec.structs.replace(config.listen, workers=workers)
        )
    if args.check:
        out.result(f"{args.config}: ok", {"ok": True, "warnings": warnings})
        return EXIT_OK
    try:
        if args.control_fd is not None:
            # A child of applianced: policy, crews and their listening sockets arrive over this
            # socketpair; the proxy stops when applianced closes it.
            if workers != 1:
                return out.error("argument --control-fd: needs a single worker", EXIT_USAGE)
            try:
                channel = socket.socket(fileno=args.control_fd)
            except OSError as exc:
                return out.error(f"argument --control-fd: {exc.strerror}", EXIT_USAGE)
            run_proxy_worker(config, 0, control_channel=channel)
            return EXIT_OK
        if workers == 1:
            # Bind before announcing readiness so a caller that sees "listening" can connect.
            run_proxy_worker(config, 0)
            return EXIT_OK
        return _run_workers(config, workers)
    except ConfigError as exc:
        return out.error(str(exc), EXIT_USAGE)
    except ProxyError as exc:
        return out.error(str(exc), EXIT_FAILURE)
    except KeyboardInterrupt:
        return EXIT_OK


def _run_workers(config: ProxyConfig, workers: int) -> int:
    from appliance.proxy_supervisor import run_supervised

    return run_supervised(config, workers)


def _control_request(path: str, message: control.ControlMessage) -> control.ControlReply:
    """One message to a proxy's control socket and its reply; OSError if unreachable."""
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
    return control.reply_decoder.decode(data)


def cmd_proxy_allow(args: argparse.Namespace, out: _Output) -> int:
    message = control.AllowHost(crew=args.crew, host=args.host)
    try:
        reply = _control_request(args.socket, message)
    except OSError as exc:
        return out.error(f"cannot reach control socket {args.socket}: {exc}", EXIT_FAILURE)
    if not reply.ok:
        return out.error(reply.error or "refused", EXIT_FAILURE)
    state = "added" if reply.changed else "already allowed"
    out.result(
        f"{args.host}: {state} for crew {args.crew}",
        {"ok": True, "crew": args.crew, "host": args.host, "changed": reply.changed},
    )
    return EXIT_OK


def cmd_proxy_reload_credentials(args: argparse.Namespace, out: _Output) -> int:
    try:
        reply = _control_request(args.socket, control.ReloadCredentials())
    except OSError as exc:
        return out.error(f"cannot reach control socket {args.socket}: {exc}", EXIT_FAILURE)
    if not reply.ok:
        return out.error(reply.error or "refused", EXIT_FAILURE)
    state = "changed" if reply.changed else "unchanged"
    out.result(f"credentials reloaded ({state})", {"ok": True, "changed": reply.changed})
    return EXIT_OK


def _named_secret(spec: str, *, from_env: bool) -> tuple[str, bytes]:
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        raise ValueError(f"{spec!r}: expected NAME={'VARIABLE' if from_env else 'PATH'}")
    if from_env:
        value = os.environ.get(where)
        if value is None:
            raise ValueError(f"--secret-env {name}: variable {where} is not set")
        return name, value.encode()
    try:
        return name, Path(where).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"--secret-file {name}: cannot read {where}: {exc.strerror}") from None


def cmd_scrub(args: argparse.Namespace, out: _Output) -> int:
    """Standard input to standard output through the scrubber, streaming (logs, command output)."""
    from native.scrub import PatternError, Scrubber

    try:
        secrets = [_named_secret(s, from_env=False) for s in args.secret_file]
        secrets += [_named_secret(s, from_env=True) for s in args.secret_env]
        scrubber = Scrubber(secrets)
    except (ValueError, PatternError) as exc:
        return out.error(str(exc), EXIT_USAGE)
    stream = scrubber.stream()
    sink = sys.stdout.buffer
    # os.read, not a buffered read: output follows input as it arrives (a tailed log).
    while chunk := os.read(sys.stdin.fileno(), 65536):
        sink.write(stream.feed(chunk))
        sink.flush()
    sink.write(stream.flush())
    sink.flush()
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, out: _Output) -> int:
    from appliance import demo

    return demo.main(as_json=out.as_json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliancectl", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    commands = parser.add_subparsers(dest="command", required=True)

    proxy = commands.add_parser("proxy", help="run the proxy core in the foreground")
    proxy.add_argument("--config", required=True, help="TOML configuration file")
    proxy.add_argument("--workers", type=int, default=0, help="worker processes (SO_REUSEPORT)")
    proxy.add_argument("--check", action="store_true", help="validate the config and exit")
    proxy.add_argument(
        "--control-fd",
        type=int,
        default=None,
        help="a socketpair end inherited from applianced: control messages and crew listeners",
    )
    proxy.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    proxy.set_defaults(func=cmd_proxy)

    allow = commands.add_parser("proxy-allow", help="add a host to a crew's allowlist at run time")
    allow.add_argument("--socket", required=True, help="the proxy's control socket")
    allow.add_argument("crew")
    allow.add_argument("host")
    allow.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    allow.set_defaults(func=cmd_proxy_allow)

    reload = commands.add_parser(
        "proxy-reload-credentials",
        help="make a running proxy read its provider credentials again (rotation) and rescrub",
    )
    reload.add_argument("--socket", required=True, help="the proxy's control socket")
    reload.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
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
    demo.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "proxy" and args.workers < 0:
        parser.error("argument --workers: must be >= 1")
    out = _Output(args.json)
    result: int = args.func(args, out)
    return result


if __name__ == "__main__":
    sys.exit(main())
