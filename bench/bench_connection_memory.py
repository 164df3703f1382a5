"""Live bytes per idle connection, measured inside the proxy (tracemalloc), not by RSS.

Theory of operation
-------------------
bench/bench_capacity.py reads a worker's RSS before and after it holds N idle connections. RSS
also moves with the allocator's state: memory freed earlier (by imports, by the warm-up
requests) is reused without growing RSS, and how much of it a tree happens to leave resident
changes the figure by more than a connection's own cost. (Shown here: after a warm-up round of
the same N connections, opened and closed, a second round costs almost no RSS in either tree.)
So this script measures what an idle connection holds: the proxy core runs in this process
under tracemalloc with the default allocator, N clients connect from a child process (their
memory is not ours), and the figure is the live bytes Python allocated for them, divided by N.

    python bench/bench_connection_memory.py [--connections 1000] [--source TREE]

`--source` measures another checkout of this project (before and after a change): the script
finds the proxy's `serve` there under either layout the project has had (proxycore.io.listener,
or the older proxycore.server). Only loopback; the child exits when the measurement is done.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CLIENT = (
    "import socket, sys, time\n"
    "socks = [socket.create_connection(('127.0.0.1', int(sys.argv[1])))"
    " for _ in range(int(sys.argv[2]))]\n"
    "print('ok', flush=True)\n"
    "time.sleep(60)\n"
)


def rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def measure(source: Path, connections: int, port: int) -> dict[str, Any]:
    sys.path.insert(0, str(source))
    import trio

    from proxycore.config import parse_config

    try:
        from proxycore.io.listener import serve
        from proxycore.io.sinks import NullSink
    except ImportError:  # the layout before proxycore/io/
        from proxycore.events import NullSink  # type: ignore[attr-defined,no-redef]
        from proxycore.server import serve  # type: ignore[import-not-found,no-redef]

    config = parse_config(
        f'[listen]\nport = {port}\n[[crew]]\nname = "bench"\ngateway = "127.0.0.1"\n'
        f"[limits]\nmax_connections_per_crew = {connections + 16}\n"
    )
    result: dict[str, Any] = {"source": str(source), "connections": connections}

    async def hold() -> subprocess.Popen[bytes]:
        child = subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(port), str(connections)], stdout=subprocess.PIPE
        )
        assert child.stdout is not None
        await trio.to_thread.run_sync(child.stdout.readline)
        await trio.sleep(1.0)  # every connection accepted and waiting for its first request
        return child

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, config, NullSink())
            gc.collect()
            rss_before = rss_kib()
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            child = await hold()
            gc.collect()
            after = tracemalloc.take_snapshot()
            rss_with = rss_kib()
            live = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
            result["live_bytes_per_connection"] = round(live / connections, 1)
            result["rss_kib_per_connection"] = round((rss_with - rss_before) / connections, 2)
            tracemalloc.stop()
            child.kill()
            child.wait()
            # The same number again, on an allocator that has served them once.
            await trio.sleep(1.5)
            gc.collect()
            rss_before = rss_kib()
            child = await hold()
            result["rss_kib_per_connection_second_round"] = round(
                (rss_kib() - rss_before) / connections, 2
            )
            child.kill()
            child.wait()
            nursery.cancel_scope.cancel()

    trio.run(main)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--source", type=Path, default=REPO, help="the tree to measure")
    parser.add_argument("--port", type=int, default=45171)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    result = measure(args.source.resolve(), args.connections, args.port)
    print(
        f"{result['source']}: {result['live_bytes_per_connection']:.0f} live bytes per idle "
        f"connection (tracemalloc); RSS {result['rss_kib_per_connection']:.2f} KiB per "
        f"connection, {result['rss_kib_per_connection_second_round']:.2f} on a second round"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
