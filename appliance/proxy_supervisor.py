"""Runs the proxy core as N worker processes sharing the port with SO_REUSEPORT.

Theory of operation: the supervisor forks the workers before it starts its own trio loop (forking
a running trio process is unsafe), giving each one end of a socketpair. Each worker binds the
listening sockets itself with SO_REUSEPORT, and the kernel spreads new connections among them.
Control messages (e.g. an allowlist entry added at run time) arrive at the supervisor's control
socket and are broadcast to every worker over its socketpair, so all workers hold the same policy;
the reply is ok only if every worker applied it. SIGTERM/SIGINT are passed on to the workers.
If any worker dies, the supervisor stops the others and exits non-zero: fail closed, and let the
service manager restart the whole set rather than run with a hole in the policy state.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
from multiprocessing.process import BaseProcess

import trio

from proxycore import control
from proxycore.config import ProxyConfig
from proxycore.io.control_server import ControlClient, serve_control_socket


def _worker_main(config: ProxyConfig, index: int, channel: socket.socket) -> None:
    from proxycore.worker import run_worker

    run_worker(config, index, control_channel=channel)


def run_supervised(config: ProxyConfig, workers: int) -> int:
    context = multiprocessing.get_context("fork")
    processes: list[BaseProcess] = []
    channels: list[socket.socket] = []
    for index in range(workers):
        ours, theirs = socket.socketpair()
        process = context.Process(target=_worker_main, args=(config, index, theirs), daemon=True)
        process.start()
        theirs.close()
        processes.append(process)
        channels.append(ours)
    return trio.run(_supervise, config, processes, channels)


async def _supervise(
    config: ProxyConfig, processes: list[BaseProcess], channels: list[socket.socket]
) -> int:
    clients = [
        ControlClient(trio.SocketStream(trio.socket.from_stdlib_socket(c))) for c in channels
    ]

    async def broadcast(message: control.ControlMessage) -> control.ControlReply:
        replies: list[control.ControlReply] = []
        try:
            for client in clients:
                replies.append(await client.request(message))
        except (trio.BrokenResourceError, OSError) as exc:
            return control.ControlReply(ok=False, error=f"a worker is gone: {exc}")
        errors = [r.error for r in replies if not r.ok]
        if errors:
            return control.ControlReply(ok=False, error=errors[0])
        return control.ControlReply(ok=True, changed=any(r.changed for r in replies))

    exit_code = 0
    async with trio.open_nursery() as nursery:
        if config.control.socket:
            await nursery.start(serve_control_socket, config.control.socket, broadcast)

        async def watch(process: BaseProcess) -> None:
            nonlocal exit_code
            await trio.to_thread.run_sync(process.join, abandon_on_cancel=True)
            if process.exitcode not in (0, -signal.SIGTERM, -signal.SIGINT):
                print(
                    f"proxy supervisor: worker {process.name} exited with {process.exitcode}; "
                    "stopping all workers",
                    file=sys.stderr,
                    flush=True,
                )
                exit_code = 1
            nursery.cancel_scope.cancel()

        for process in processes:
            nursery.start_soon(watch, process)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    for process in processes:
        _signal(process, signal.SIGTERM)
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            _signal(process, signal.SIGKILL)
            process.join()
    return exit_code


def _signal(process: BaseProcess, signum: int) -> None:
    if process.pid is None:
        return
    try:
        os.kill(process.pid, signum)
    except ProcessLookupError:
        pass  # it already exited (the signal reached the whole group, or it died)
