"""`appliancectl status` (exits 9 when a part is down) and `appliancectl up` (run applianced)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from appliance.daemon import messages

from . import context, exits, output
from .context import CtlError
from .output import Output


def worker_line(worker: messages.WorkerStatus) -> str:
    """One proxy worker: pid and uid (or when it restarts), restarts, last exit."""
    if worker.restart_at is not None:
        left = max(0.0, worker.restart_at - time.time())
        state = f"down, back in {left:.1f} s (backoff {worker.backoff or 0:.1f} s)"
    elif worker.pid is not None:
        state = f"pid {worker.pid}, uid {worker.uid}"
    else:
        state = "starting"
    line = f"  worker {worker.index}: {state}, restarts {worker.restarts}"
    if worker.last_exit:
        line += f"; last exit {output.clock(worker.last_exit_time)}: {worker.last_exit}"
        if worker.last_stderr:
            line += f" (stderr: {worker.last_stderr})"
    return line


def down(status: messages.Status) -> list[messages.PartHealth]:
    """The parts that are down. An older applianced without `health`: judged here from the
    proxy fields alone."""
    if status.health:
        return [part for part in status.health if not part.ok]
    if not status.proxy_alive:
        return [messages.PartHealth("proxy", False, "the workers do not answer")]
    return []


def human(status: messages.Status, wide: bool) -> str:
    pids = ", ".join(map(str, status.proxy_pids)) or "none"
    lines = [
        f"applianced pid {status.pid}, instance {status.instance or '-'}, state {status.state_dir}",
        f"provider {status.provider} (isolated: {status.isolated}), runtimes: "
        + ", ".join(status.runtimes),
        f"proxy workers {pids} (uid {status.proxy_uid}), alive: {status.proxy_alive}, port "
        f"{status.proxy_port}, restarts {status.proxy_restarts}",
        f"crews: {status.crews} ({status.crews_ready} ready)",
    ]
    lines += [worker_line(worker) for worker in status.proxy_workers]
    for part in status.health:
        lines.append(f"{'ok  ' if part.ok else 'DOWN'} {part.name}: {part.detail}")
    if wide:
        lines.append(f"infra pool: {status.pool_ready} of {status.pool_size} ready")
        lines.append(
            f"admin socket: {status.admin_socket}, up since {output.clock(status.started)}"
        )
    lines += [f"reconciled at start: {change}" for change in status.reconcile]
    bad = down(status)
    if bad:
        lines.append("DEGRADED: " + "; ".join(f"{p.name} down ({p.detail})" for p in bad))
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace, out: Output) -> int:
    client = context.client(args)

    def render() -> int:
        status = client.status()
        bad = down(status)
        document = {"ok": not bad, **output.builtins(status)}
        out.emit(document, lambda wide: human(status, wide), [p.name for p in status.health])
        return exits.DEGRADED if bad else exits.OK

    if args.watch:
        return output.watch(render, args.interval, out)
    return render()


def cmd_up(args: argparse.Namespace, out: Output) -> int:
    config = context.daemon_config(args)
    overrides = {
        key: value
        for key, value in (("log_format", args.log_format), ("log_level", args.log_level))
        if value is not None
    }
    if overrides:  # the command line over the file
        import msgspec

        config = msgspec.structs.replace(
            config, daemon=msgspec.structs.replace(config.daemon, **overrides)
        )
    if os.geteuid() != 0:
        raise CtlError("applianced needs root (netlink, nftables, the engine)")
    if args.detach:
        return _up_detached(args, config, out)
    from appliance.daemon.config import config_file
    from appliance.daemon.main import run_daemon

    return run_daemon(config, source=config_file(args.config) or "<defaults>")


def _up_detached(args: argparse.Namespace, config: Any, out: Output) -> int:
    """Start applianced in its own session, logging to a file; return once its socket answers."""
    import subprocess

    from .client import AdminClient, AdminError, Unreachable

    state_dir = Path(config.daemon.state_dir)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = Path(args.log) if args.log else state_dir / "applianced.log"
    from appliance.selfexec import self_command

    command = [*self_command("appliance.cli"), "up"]
    if args.config:
        command += ["--config", str(args.config)]
    for flag, value in (("--log-format", args.log_format), ("--log-level", args.log_level)):
        if value is not None:
            command += [flag, value]
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    client = AdminClient(config.daemon.admin_socket, timeout=5)
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-5:]
            raise CtlError(
                f"applianced exited with {process.returncode}; {log_path}: " + " | ".join(tail)
            )
        try:
            status = client.status()
        except (Unreachable, AdminError):
            time.sleep(0.2)
            continue
        if status.pid == process.pid:
            out.emit(
                {"ok": True, "pid": process.pid, "log": str(log_path), "status": status},
                f"applianced running (pid {process.pid}), log {log_path}",
                [str(process.pid)],
            )
            return exits.OK
        time.sleep(0.2)
    raise CtlError(f"applianced did not answer within {args.wait} s (log: {log_path})")


def add_parsers(commands: Any, leaf: Any, watchable: Any) -> None:
    up = leaf(commands.add_parser("up", help="run applianced (foreground unless --detach)"))
    up.add_argument("--detach", action="store_true", help="run in the background, return when up")
    up.add_argument("--log", help="log file with --detach (default <state_dir>/applianced.log)")
    up.add_argument("--wait", type=float, default=120.0, help="seconds to wait with --detach")
    up.add_argument(
        "--log-format", choices=("text", "json"), help="log lines (default: [daemon] log_format)"
    )
    up.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        help="least level logged (default: [daemon] log_level)",
    )
    up.set_defaults(func=cmd_up)
    watchable(
        leaf(
            commands.add_parser(
                "status", help="applianced's state; exit 9 if a part is down (docs/cli.md)"
            )
        )
    ).set_defaults(func=cmd_status)
