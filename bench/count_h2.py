"""HTTP/2 through our proxy: CPU instructions per stream, counted (for A/B on a busy machine).

Theory of operation
-------------------
Wall-clock figures (bench_h2.py) move with whatever else the machine runs; an instruction count
does not. Our proxy runs under `valgrind --tool=callgrind` (one worker, the production
configuration of bench_h2.py, the same nginx origin on its HTTP/1.1 and h2c ports). For each leg
and level it is warmed up (pools filled, caches primed), its counters are zeroed
(`callgrind_control -z`), h2load sends exactly `--streams` streams (`-n N -c C -m M`), and the
counters are dumped (`callgrind_control -d`): the dump's total over N is the instructions one
stream costs the proxy, the connections' set-up included (at 50x1 a connection carries few
streams). Everything else in the process (the runtime's reaper, the journal writer) runs too,
as in production. Valgrind slows the proxy some 50-fold: timeouts do not fire in a run this
short, but a wall-clock figure from here means nothing.

The target's reference is our HTTP/1.1 path (bench_h2.py measures it with `wrk -t1 -c50`):
`--http1` also counts exactly `--streams` absolute-form GETs over 50 keep-alive HTTP/1.1
connections to the same origin (level `h1-50`, a client of this script's own, since wrk cannot
stop at a count), so that a tree's instructions per stream can be read as a ratio to its
instructions per HTTP/1.1 request.

    python bench/count_h2.py --source /work/tree --levels 50x1,10x10,1x64 --streams 2000
"""

from __future__ import annotations

import argparse
import os
import re
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_h2
import common
from common import Service, Workspace


def start_counted(ws: Workspace, source: Path, origin: bench_h2.Origin) -> tuple[Service, Path]:
    root = ws.subdir("ours")
    port = common.free_port()
    conf = root / "proxy.toml"
    conf.write_text(
        common.ours_config(
            port=port,
            events_path=root / "events.jsonl",
            limits={"max_connections_per_crew": 1016, "upstream_connections_per_crew": 1016},
            upstream=[f'h2c = ["{common.UPSTREAM_HOST}:{origin.ports["h2c"]}"]'],
        )
    )
    out = root / "callgrind.out"
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        "appliance.cli",
        "proxy",
        "--config",
        str(conf),
    ]
    env = {**os.environ, "PYTHONPATH": str(source)}
    proc = ws.spawn(argv, log=root / "stderr.log", note="ours under callgrind", cwd=source, env=env)
    service = Service("ours", "127.0.0.1", port, proc, argv, root / "stderr.log")
    return common._started(ws, service, timeout=300.0), out


def h2load(service: Service, authority: str, level: str, streams: int) -> str:
    clients, inflight = (int(n) for n in level.split("x"))
    argv = [
        "h2load",
        "-t1",
        f"-c{clients}",
        f"-m{inflight}",
        f"-n{streams}",
        "-H",
        f":authority: {authority}",
        f"http://{service.host}:{service.port}{bench_h2.PATH}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    output = done.stdout + done.stderr
    match = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", output)
    if not match or int(match.group(2)) != streams:
        raise RuntimeError(f"h2load did not complete {streams} streams:\n{output[-2000:]}")
    return output


def http1_requests(service: Service, authority: str, streams: int, clients: int = 50) -> None:
    """`streams` GETs over `clients` keep-alive connections, each sending its next request when
    its response is whole (wrk -c50's rhythm). The 1 KiB answers carry a content-length."""
    request = (
        f"GET http://{authority}{bench_h2.PATH} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
    ).encode()
    selector = selectors.DefaultSelector()
    buffers: dict[socket.socket, bytearray] = {}
    sent = done = 0
    for _ in range(min(clients, streams)):
        sock = socket.create_connection((service.host, service.port))
        sock.setblocking(False)
        sock.sendall(request)
        sent += 1
        buffers[sock] = bytearray()
        selector.register(sock, selectors.EVENT_READ)
    while done < streams:
        for key, _ in selector.select(timeout=600):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            data = sock.recv(65536)
            if not data:
                raise RuntimeError(f"the proxy closed a connection after {done} responses")
            buffer = buffers[sock]
            buffer += data
            while (end := buffer.find(b"\r\n\r\n")) >= 0:
                head = bytes(buffer[:end]).lower()
                if not head.startswith(b"http/1.1 200"):
                    raise RuntimeError(f"unexpected response: {head[:200]!r}")
                length = int(re.search(rb"content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
                if len(buffer) < end + 4 + length:
                    break
                del buffer[: end + 4 + length]
                done += 1
                if sent < streams:
                    sock.sendall(request)
                    sent += 1
    for sock in buffers:
        selector.unregister(sock)
        sock.close()


def counted(pid: int, out: Path, run: object, keep: Path | None = None) -> int:
    """Instructions the process ran while `run()` did (the dump copied into `keep`)."""
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    before = set(out.parent.glob(out.name + "*"))
    run()  # type: ignore[operator]
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    for _ in range(600):
        new = set(out.parent.glob(out.name + "*")) - before
        for path in new:
            text = path.read_text(errors="replace")
            match = re.search(r"^totals: (\d+)", text, re.M) or re.search(
                r"^summary: (\d+)", text, re.M
            )
            if match:
                if keep is not None:
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / path.name).write_text(text)
                return int(match.group(1))
        time.sleep(0.5)
    raise RuntimeError("no callgrind dump appeared")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=common.REPO, help="the tree to run")
    parser.add_argument("--levels", default="50x1,10x10,1x64", help="CxM, comma-separated")
    parser.add_argument("--legs", default="h1,h2c", help="upstream legs: h1, h2c")
    parser.add_argument("--streams", type=int, default=2000, help="streams counted per level")
    parser.add_argument(
        "--http1", action="store_true", help="also count HTTP/1.1 requests (50 connections)"
    )
    parser.add_argument("--keep", type=Path, help="copy each callgrind dump into this directory")
    args = parser.parse_args(argv)
    common.raise_fd_limit()
    with Workspace(prefix="count-h2-") as ws:
        origin = bench_h2.start_origin(ws, core=None)
        service, out = start_counted(ws, args.source, origin)
        print(f"# count_h2: source {args.source} ({common.source_revision(args.source)})")
        if args.http1:
            authority = bench_h2.authority_for("ours", origin, "h1")
            http1_requests(service, authority, 200)  # warm-up
            total = counted(
                service.pid,
                out,
                lambda: http1_requests(service, authority, args.streams),
                args.keep,
            )
            print(
                f"h1   h1-50  {args.streams} requests: {total:,} instructions, "
                f"{total // args.streams:,} per request (the HTTP/1.1 reference)",
                flush=True,
            )
        for leg in args.legs.split(","):
            authority = bench_h2.authority_for("ours", origin, leg)
            for level in args.levels.split(","):
                clients = int(level.split("x")[0])
                h2load(service, authority, level, max(200, clients * 4))  # warm-up
                total = counted(
                    service.pid,
                    out,
                    lambda level=level, authority=authority: h2load(
                        service, authority, level, args.streams
                    ),
                    args.keep,
                )
                print(
                    f"{leg:4} {level:6} {args.streams} streams: {total:,} instructions, "
                    f"{total // args.streams:,} per stream",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
