"""Queries per second on one core: the crew DNS responder against dnsmasq and unbound.

    flock /tmp/bench.lock python bench/bench_dns.py [--duration 5] [--rounds 3] [--json-out FILE]

Each server in turn is pinned to core 0 (`taskset -c 0`) and answers the same 1,000 names
(hostN.bench.example, one A record each) on 127.0.0.1 over UDP; dnsperf, pinned to core 1,
sends as fast as they answer (4 sockets, 200 queries outstanding) for `--duration` seconds.

- ours: proxycore/io/dns_server.py serving a `DnsResponder` for a RESTRICTED crew whose
  allowlist is the 1,000 names, resolving through a stand-in resolver that answers at once
  (so that the figure is the responder's, not a nameserver's), the per-crew rate limits opened
  wide (they would otherwise be what is measured). Started by this script as
  `python bench/bench_dns.py --serve PORT NAMES`.
- dnsmasq: `--no-resolv --no-hosts --addn-hosts=FILE`, its cache on (defaults), one process.
- unbound: `num-threads: 1`, the names as `local-data` in a static `local-zone`.

Two query mixes: "hits" (A for the 1,000 names, in order; after the first pass every server
answers from its cache or its local data) and "mixed" (A 50 %, AAAA 20 %, names no server knows
20 %, HTTPS 10 %: what a crew's resolver library sends, refusals included). Each server gets a
warm-up pass of 2 s before its measured runs. The servers take turns, `--rounds` times, and the
median of each is reported (the machine is shared; the load average is recorded per run).
Beside queries/s, each run reports the server's queries per CPU-second (dnsperf's completed
queries over the utime+stime the server's process used meanwhile): on a shared machine the
server does not get its core to itself, and this is what it would answer if it did.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    LOAD_CORE,
    PROXY_CORE,
    RESULTS_DIR,
    Workspace,
    describe_machine,
    free_port,
    group_cpu_ticks,
    median,
    pinned,
    show,
    table,
    write_json,
)

NAMES = 1000
_QPS = re.compile(r"Queries per second:\s+([0-9.]+)")
_LOST = re.compile(r"Queries lost:\s+([0-9]+)")
_COMPLETED = re.compile(r"Queries completed:\s+([0-9]+)")


def address(i: int) -> str:
    return f"93.184.{i // 250}.{i % 250 + 1}"


def serve(port: int, names_path: Path) -> None:
    """Our server, in its own process (`--serve`): the crew responder on 127.0.0.1:PORT."""
    import socket
    from collections.abc import Sequence

    import trio

    from proxycore.io.dns_server import DnsServer
    from proxycore.protocol.dns_responder import DnsLimits, DnsResponder
    from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode

    names = names_path.read_text().split()
    table_ = {name: [address(i)] for i, name in enumerate(names)}
    limits = DnsLimits(queries_rate=1e9, queries_burst=1e9, names_rate=1e9, names_burst=1e9)
    policy = CrewPolicy("bench", NetworkMode.RESTRICTED, Allowlist(names))
    responder = DnsResponder(policy, limits=limits)

    async def resolve(name: str) -> Sequence[str]:
        return table_[name]

    async def before_answer(crew: str, addresses: Sequence[str], ttl: int) -> None:
        return None

    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", port))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("127.0.0.1", port))
    tcp.listen(64)
    server = DnsServer(
        responder, resolve=resolve, before_answer=before_answer, journal=lambda _e: None
    )
    trio.run(server.serve, udp, tcp)


def write_inputs(ws: Workspace) -> dict[str, Path]:
    names = [f"host{i}.bench.example" for i in range(NAMES)]
    paths = {
        "names": ws.path("names.txt"),
        "hosts": ws.path("hosts"),
        "unbound": ws.path("unbound.conf"),
        "hits": ws.path("hits.txt"),
        "mixed": ws.path("mixed.txt"),
    }
    paths["names"].write_text("\n".join(names) + "\n")
    paths["hosts"].write_text("".join(f"{address(i)} {n}\n" for i, n in enumerate(names)))
    paths["hits"].write_text("".join(f"{n} A\n" for n in names))
    mixed = []
    for i, name in enumerate(names):
        kind = i % 10
        if kind < 5:
            mixed.append(f"{name} A")
        elif kind < 7:
            mixed.append(f"{name} AAAA")
        elif kind < 9:
            mixed.append(f"unknown{i}.bench.example A")
        else:
            mixed.append(f"{name} HTTPS")
    paths["mixed"].write_text("\n".join(mixed) + "\n")
    return paths


def unbound_config(ws: Workspace, paths: dict[str, Path], port: int) -> None:
    lines = [
        "server:",
        "  interface: 127.0.0.1",
        f"  port: {port}",
        "  num-threads: 1",
        "  do-daemonize: no",
        "  use-syslog: no",
        f'  directory: "{ws.dir}"',
        '  chroot: ""',
        '  username: ""',
        '  pidfile: ""',
        "  access-control: 127.0.0.0/8 allow",
        "  do-ip6: no",
        "  verbosity: 0",
        '  local-zone: "bench.example." static',
    ]
    for i, name in enumerate(paths["names"].read_text().split()):
        lines.append(f'  local-data: "{name}. 60 IN A {address(i)}"')
    paths["unbound"].write_text("\n".join(lines) + "\n")


def probe(port: int) -> bool:
    import dns.exception
    import dns.message
    import dns.query

    try:
        answer = dns.query.udp(
            dns.message.make_query("host1.bench.example", "A"), "127.0.0.1", timeout=1, port=port
        )
    except (dns.exception.DNSException, OSError):
        return False
    return bool(answer.answer)


def start(ws: Workspace, name: str, paths: dict[str, Path]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    if name == "ours":
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", str(port)]
        argv.append(str(paths["names"]))
    elif name == "dnsmasq":
        argv = ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv"]
        argv += ["--no-hosts", f"--addn-hosts={paths['hosts']}", "--listen-address=127.0.0.1"]
        argv += ["--bind-interfaces", f"--port={port}", "--user=root", "--pid-file="]
    else:
        unbound_config(ws, paths, port)
        argv = ["unbound", "-d", "-c", str(paths["unbound"])]
    proc = ws.spawn(pinned(PROXY_CORE, argv), log=ws.path(f"{name}.log"))
    # Ready when it answers a query.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {ws.path(f'{name}.log').read_text()[-2000:]}")
        if probe(port):
            return proc, port
        time.sleep(0.2)
    raise RuntimeError(f"{name} does not answer on port {port}")


def dnsperf(port: int, data: Path, duration: float, pgid: int) -> dict[str, Any]:
    load = ["dnsperf", "-s", "127.0.0.1", "-p", str(port), "-d", str(data), "-l", f"{duration:g}"]
    argv = pinned(LOAD_CORE, [*load, "-c", "4", "-q", "200", "-t", "2"])
    show(argv)
    ticks = group_cpu_ticks(pgid)
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    cpu = (group_cpu_ticks(pgid) - ticks) / os.sysconf("SC_CLK_TCK")
    qps = _QPS.search(out)
    if qps is None:
        raise RuntimeError(f"dnsperf said:\n{out}")
    lost = _LOST.search(out)
    completed = _COMPLETED.search(out)
    answered = int(completed.group(1)) if completed else 0
    return {
        "qps": round(float(qps.group(1))),
        "completed": answered,
        "lost": int(lost.group(1)) if lost else None,
        # The server's CPU seconds for the run: queries per CPU-second is what one core would
        # answer if the server had it to itself, which the shared machine does not give it.
        "cpu_s": round(cpu, 2),
        "per_cpu_s": round(answered / cpu) if cpu > 0 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--servers", default="ours,dnsmasq,unbound")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "NAMES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(int(args.serve[0]), Path(args.serve[1]))
        return
    json_out = args.json_out or RESULTS_DIR / f"dns-{time.strftime('%Y%m%d-%H%M%S')}.json"
    servers = args.servers.split(",")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    with Workspace(prefix="bench-dns-") as ws:
        paths = write_inputs(ws)
        # Rounds interleave the servers, so that a change in the machine's background load
        # falls on all of them rather than on whichever ran at that moment.
        for _ in range(args.rounds):
            for name in servers:
                proc, port = start(ws, name, paths)
                try:
                    dnsperf(port, paths["hits"], 2, proc.pid)  # warm-up: fills every cache
                    runs[name].append(
                        {
                            "hits": dnsperf(port, paths["hits"], args.duration, proc.pid),
                            "mixed": dnsperf(port, paths["mixed"], args.duration, proc.pid),
                            "loadavg": os.getloadavg()[0],
                        }
                    )
                finally:
                    ws.stop(proc)
    rows = []
    for name, results in runs.items():
        row: list[Any] = [name]
        for mix in ("hits", "mixed"):
            row.append(round(median([r[mix]["qps"] for r in results])))
            row.append(round(median([r[mix]["per_cpu_s"] or 0 for r in results])))
        row.append("/".join(f"{r['hits']['qps']}" for r in results))
        rows.append(row)
    headers = ["server (core 0)", "hits q/s", "hits q/CPU-s", "mixed q/s", "mixed q/CPU-s"]
    print()
    print(table([*headers, "hits q/s each round"], rows))
    write_json(json_out, {"machine": describe_machine(Path.cwd()), "runs": runs})


if __name__ == "__main__":
    main()
