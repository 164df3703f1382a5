"""The proxy worker's entry point: one process of the data plane.

    python -m proxycore.worker --config PATH [--control-fd C] [--events-fd E]
        [--drop-to UID:GID] [--worker-index I] [--log-format text|json] [--log-level LEVEL]
    python -m proxycore.worker --preload-check

(In the artifact, `agent-appliance proxy-worker ...`: appliance/entry.py.)

Theory of operation
-------------------
applianced (appliance/daemon/proxy.py) starts each worker as root with two inherited socketpair
ends: the control channel (typed messages from proxycore/control.py; the crews' listening
sockets come with them) and the events channel (the worker's decisions, which applianced
journals). The worker boots on the data plane alone: it imports nothing of appliance/ (the admin
CLI, the daemon, the journal), so it starts without their modules and could not name them if it
tried (tests/test_architecture.py).

Start-up runs in this order, each step while the process still has what it needs:

1. no core dumps, not dumpable (it is about to hold every injected key), and RLIMIT_NOFILE up
   to its hard limit (every tunnel holds two sockets and two pipes);
2. the config is read and the runtime built: the CA bundle and any credential file are read now;
3. with --drop-to, `preload.preload()` imports every module the worker may ever need (every
   codec, the standard modules imported lazily on a worker's paths): after the drop the
   interpreter's files may be unreadable (a Python under /root);
4. `privileges.drop_privileges` makes it UID:GID with no capability, no supplementary group,
   no_new_privs and not dumpable, and checks the result (`check_dropped`); any shortfall is
   an error and the worker exits with status 1 before it serves anything (fail closed);
5. `preload.guard()`: from here every import is refused and named on standard error, the same
   way on every install, so that a missed preload is caught by the tests on any machine;
6. it serves until its control channel closes (the parent is gone: stop rather than serve a
   policy nobody can change) or SIGTERM/SIGINT.

It logs one line per record on standard error (proxycore/logs.py): under applianced in JSON,
which applianced reads, scrubs and writes again in the operator's format.

Without --control-fd the worker is the standalone proxy of `appliancectl proxy`: it binds its
own listeners and takes control messages on `[control] socket`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import resource
import signal
import socket
import sys
from collections.abc import Sequence

import trio

from native import headscan
from native.scrub import native_missing_notice
from proxycore import logs, preload
from proxycore.config import ProxyConfig, load_config, validate
from proxycore.errors import ConfigError, ProxyError
from proxycore.io.listener import serve
from proxycore.io.sinks import ChannelSink, EventSink, JsonLinesSink, NullSink
from proxycore.privileges import PrivilegeDropError, drop_privileges, forbid_core_dumps
from proxycore.runtime import ProxyRuntime

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

log = logging.getLogger("proxycore.worker")


def make_sink(config: ProxyConfig, events_channel: socket.socket | None = None) -> EventSink:
    """The events channel to applianced if there is one, else `[events] path` (or nothing)."""
    events = config.events
    if events_channel is not None:
        return ChannelSink(
            events_channel,
            flush_interval=events.flush_interval,
            max_batch=events.max_batch,
            max_pending=events.max_pending,
        )
    if events.path is None:
        return NullSink()
    return JsonLinesSink(
        events.path,
        flush_interval=events.flush_interval,
        max_batch=events.max_batch,
        max_pending=events.max_pending,
    )


def raise_fd_limit(wanted: int = 0) -> None:
    """The worker's descriptor limit: `[limits] open_files`, or (0) the hard limit. Every
    tunnel holds two sockets and up to four pipe ends; the default soft limit (1024) is too
    low. Near the limit the listener answers 503 (proxycore/io/listener.py)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if wanted == 0 else min(wanted, hard)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def run_worker(
    config: ProxyConfig,
    worker: int = 0,
    control_channel: socket.socket | None = None,
    *,
    events_channel: socket.socket | None = None,
    drop_to: tuple[int, int] | None = None,
) -> None:
    """Steps 1 to 6 above; returns when the worker stops. PrivilegeDropError if the drop (or
    its check) fails, ProxyError if it cannot listen."""
    # The proxy holds every key it injects: no core dump, no ptrace, /proc/PID root-only.
    forbid_core_dumps()
    raise_fd_limit(config.limits.open_files)
    sink = make_sink(config, events_channel)
    # Built before the drop: it reads the CA bundle and any credential file while it still can.
    runtime = ProxyRuntime(config, sink)
    if drop_to is not None:
        preloaded = preload.preload()
        drop_privileges(*drop_to)
        preload.guard(preloaded)

    # The cyclic collector (about 5 % of a stream's instructions): what start-up built (modules,
    # config, policy and scrubber tables) lives as long as the worker, so it is left out of
    # every collection; the youngest generation is collected after 10,000 new container
    # objects, not 700 (a request allocates hundreds, nearly all freed by reference counting:
    # only cyclic garbage waits the longer, bounded by those 10,000 objects).
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)

    async def main() -> None:
        channel = None
        if control_channel is not None:
            channel = trio.SocketStream(trio.socket.from_stdlib_socket(control_channel))
        async with trio.open_nursery() as nursery:

            async def serve_then_stop(task_status: trio.TaskStatus[object]) -> None:
                # serve() returns when its control channel closes (the parent is gone).
                await serve(
                    config, sink, control_channel=channel, runtime=runtime, task_status=task_status
                )
                nursery.cancel_scope.cancel()

            await nursery.start(serve_then_stop)
            _announce(config, worker)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

    trio.run(main)


def _announce(config: ProxyConfig, worker: int) -> None:
    where = ", ".join(
        f"{address}:{config.listen.port}"
        for address in dict.fromkeys([*(c.gateway for c in config.crew), *config.listen.addresses])
    )
    log.info("proxy worker %d: listening on %s", worker, where)
    if worker != 0:
        return  # said once, by the first worker
    notice = native_missing_notice()
    if notice:
        log.warning("proxy: %s", notice)
    if not headscan.AVAILABLE:
        # The reference parser serves, correct but slower.
        log.warning(
            "proxy: native head scanner not built (no C compiler at install?); "
            "using the Python parser"
        )


def _uid_gid(text: str) -> tuple[int, int]:
    uid, sep, gid = text.partition(":")
    if not (sep and uid.isdigit() and gid.isdigit()) or int(uid) == 0 or int(gid) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not UID:GID (numbers, not 0)")
    return int(uid), int(gid)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m proxycore.worker", description="one proxy worker process"
    )
    parser.add_argument("--config", help="TOML file, or applianced's JSON (required)")
    parser.add_argument(
        "--control-fd",
        type=int,
        default=None,
        help="an inherited socketpair end: control messages and crew listeners",
    )
    parser.add_argument(
        "--events-fd",
        type=int,
        default=None,
        help="an inherited socketpair end: the worker's events, as JSON lines",
    )
    parser.add_argument(
        "--drop-to",
        type=_uid_gid,
        default=None,
        metavar="UID:GID",
        help="after start-up, become UID:GID with no capabilities and no_new_privs",
    )
    parser.add_argument("--worker-index", type=int, default=0, help="this worker's number")
    parser.add_argument(
        "--log-format", choices=logs.FORMATS, default="text", help="standard error's lines"
    )
    parser.add_argument("--log-level", choices=logs.LEVELS, default="info")
    parser.add_argument(
        "--preload-check",
        action="store_true",
        help="print (JSON) the codecs and the modules the pre-drop preload found and missed, "
        "then exit: a frozen build (docs/artifact.md) must miss no more than a virtualenv",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preload_check:
        return _preload_check()
    if args.config is None:
        parser.error("the following arguments are required: --config")
    logs.configure(
        args.log_format, args.log_level, fields={"worker": args.worker_index}, excepthook=log.name
    )
    if args.control_fd is None and (args.events_fd is not None or args.drop_to is not None):
        return _error("arguments --events-fd and --drop-to: need --control-fd", EXIT_USAGE)
    try:
        config = load_config(args.config)
        warnings = validate(config, source=args.config)
    except ConfigError as exc:
        return _error(str(exc), EXIT_USAGE)
    for warning in warnings:
        log.warning("proxy worker: warning: %s", warning)
    try:
        channel = None if args.control_fd is None else socket.socket(fileno=args.control_fd)
        events = None if args.events_fd is None else socket.socket(fileno=args.events_fd)
    except OSError as exc:
        return _error(f"argument --control-fd/--events-fd: {exc.strerror}", EXIT_USAGE)
    try:
        run_worker(
            config,
            args.worker_index,
            control_channel=channel,
            events_channel=events,
            drop_to=args.drop_to,
        )
    except PrivilegeDropError as exc:
        return _error(f"cannot drop privileges: {exc.strerror}", EXIT_FAILURE)
    except ConfigError as exc:
        return _error(str(exc), EXIT_USAGE)
    except ProxyError as exc:
        return _error(str(exc), EXIT_FAILURE)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _preload_check() -> int:
    found = preload.preload()
    why: dict[str, str] = {}
    for name in sorted(found.absent):
        try:
            importlib.import_module(name)
        except ImportError as exc:  # the same failure again: say what it was
            why[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"codecs": sorted(found.codecs), "absent": why}))
    return EXIT_OK


def _error(message: str, code: int) -> int:
    log.error("proxy worker: error: %s", message)
    return code


if __name__ == "__main__":
    sys.exit(main())
