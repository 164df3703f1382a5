"""`appliancectl`: the operator's command line.

Exit codes: 0 success, 1 a runtime failure (could not listen, peer refused), 2 bad usage or a bad
configuration (the message names the key or argument). Every command takes `--json`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import resource
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

import trio

from native import headscan
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
            await nursery.start(
                functools.partial(serve, control_channel=channel),
                config,
                make_sink(config, worker),
            )
            where = ", ".join(
                f"{address}:{config.listen.port}"
                for address in dict.fromkeys(
                    [*(c.gateway for c in config.crew), *config.listen.addresses]
                )
            )
            print(f"proxy worker {worker}: listening on {where}", file=sys.stderr, flush=True)
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


def cmd_proxy(args: argparse.Namespace, out: _Output) -> int:
    try:
        config = load_config(args.config)
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


def cmd_proxy_allow(args: argparse.Namespace, out: _Output) -> int:
    message = control.AllowHost(crew=args.crew, host=args.host)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(args.socket)
            sock.sendall(control.encoder.encode(message) + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        return out.error(f"cannot reach control socket {args.socket}: {exc}", EXIT_FAILURE)
    reply = control.reply_decoder.decode(data)
    if not reply.ok:
        return out.error(reply.error or "refused", EXIT_FAILURE)
    state = "added" if reply.changed else "already allowed"
    out.result(
        f"{args.host}: {state} for crew {args.crew}",
        {"ok": True, "crew": args.crew, "host": args.host, "changed": reply.changed},
    )
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
