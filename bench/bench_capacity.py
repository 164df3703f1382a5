"""Capacity: memory per idle connection and per idle tunnel, and throughput as crews grow.

(a) Resident memory (VmRSS of /proc/PID/status) of the proxy idle (after a short warm-up, so
    lazily imported code is counted), then holding N idle keep-alive connections (each made one
    request through the proxy and stays open), then, on a fresh proxy, holding N idle CONNECT
    tunnels to nginx (each carried one request and stays open). KiB per connection is
    (rss_with - rss_idle) / N. VmRSS is user-space memory only: socket buffers, pipe buffers and
    kernel socket structures are not in it. squid is measured the same way for reference.
(b) Requests/s through our proxy's forward path as the number of configured crews grows (each
    crew has its own gateway address on 127/8 and its own allowlist); the load goes to the last
    crew configured. Reported with the ratio to the 1-crew figure.

Run `python bench/bench_capacity.py --help` for the options.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import Service, Unavailable, Workspace
from fixed_rate import ResponseReader, dropped


def vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def unreclaimable_slab_kib() -> int:
    """System-wide SUnreclaim (/proc/meminfo): socket and pipe structures live there."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SUnreclaim:"):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def request_bytes(uri: str, authority: str) -> bytes:
    return f"GET {uri} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


def one_exchange(sock: socket.socket, request: bytes) -> None:
    sock.sendall(request)
    status, keep_alive = ResponseReader(sock).read()
    if status != 200 or not keep_alive:
        raise RuntimeError(f"status {status}, keep-alive {keep_alive}")


def open_keepalive(service: Service, upstream_port: int, count: int) -> list[socket.socket]:
    uri, authority = common.forward_target(service.name, upstream_port)
    request = request_bytes(uri, authority)
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((service.host, service.port), timeout=10)
        sockets.append(sock)
        one_exchange(sock, request)
    return sockets


def open_tunnels(service: Service, upstream_port: int, count: int) -> list[socket.socket]:
    host = common.UPSTREAM_HOST if service.name.startswith("ours") else "127.0.0.1"
    authority = f"{host}:{upstream_port}"
    connect = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
    inner = request_bytes("/1k", f"127.0.0.1:{upstream_port}")
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((service.host, service.port), timeout=10)
        sockets.append(sock)
        sock.sendall(connect)
        head = bytearray()
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)  # byte by byte: nothing past the head may be consumed
            if not chunk:
                raise RuntimeError("proxy closed the connection instead of opening a tunnel")
            head += chunk
        if head.split(b" ", 2)[1] != b"200":
            raise RuntimeError(f"CONNECT refused: {bytes(head).splitlines()[0]!r}")
        one_exchange(sock, inner)  # the tunnel carries traffic, then idles
    return sockets


def settle_rss(pid: int, seconds: float = 1.0) -> int:
    time.sleep(seconds)
    return vm_rss_kib(pid)


def measure_memory(
    ws: Workspace,
    nginx: Service,
    start: Any,
    name: str,
    kind: str,
    count: int,
) -> dict[str, Any]:
    """Start a fresh subject, warm it up, then hold `count` idle connections of `kind`."""
    service: Service = start()
    try:
        common.check_forward(service, nginx.port)
        # Warm-up: a few requests on fresh connections plus a tunnel, then let it idle.
        for _ in range(20):
            common.check_forward(service, nginx.port)
        for sock in open_tunnels(service, nginx.port, 1) + open_keepalive(service, nginx.port, 1):
            sock.close()
        idle = settle_rss(service.pid)
        fds_idle = open_fds(service.pid)
        slab_idle = unreclaimable_slab_kib()
        opener = open_keepalive if kind == "keep-alive" else open_tunnels
        started = time.monotonic()
        print(f"  {name}: opening {count} idle {kind} connections", flush=True)
        sockets = opener(service, nginx.port, count)
        opened_in = time.monotonic() - started
        loaded = settle_rss(service.pid)
        fds_loaded = open_fds(service.pid)
        slab_loaded = unreclaimable_slab_kib()
        alive = sum(not dropped(sock) for sock in sockets)
        for sock in sockets:
            sock.close()
    finally:
        ws.stop(service.proc)
    result = {
        "subject": name,
        "kind": kind,
        "connections": count,
        "alive_at_measurement": alive,
        "rss_idle_kib": idle,
        "rss_with_kib": loaded,
        "kib_per_connection": (loaded - idle) / count,
        "fds_idle": fds_idle,
        "fds_with": fds_loaded,
        "fds_per_connection": (fds_loaded - fds_idle) / count,
        # Both ends' sockets (ours, the client's, nginx's) and pipes; other processes add noise.
        "kernel_slab_kib_per_connection": (slab_loaded - slab_idle) / count,
        "open_seconds": round(opened_in, 2),
    }
    print(
        f"  {name} {kind}: idle {idle} KiB, with {count}: {loaded} KiB, "
        f"{result['kib_per_connection']:.1f} KiB and {result['fds_per_connection']:.1f} fds "
        f"per connection ({alive} alive)",
        flush=True,
    )
    return result


def memory_suite(ws: Workspace, args: argparse.Namespace, nginx: Service) -> list[dict[str, Any]]:
    # The default per-crew caps (512 open connections, 512 upstream connections) would refuse
    # the rest with a 503; the measurement raises them, as an operator with a bigger crew would.
    # (A tree from before the upstream cap rejects its key: the source's own config decides.)
    limits = {"max_connections_per_crew": args.connections + 16}
    if "upstream_connections_per_crew" in (args.source / "proxycore" / "config.py").read_text():
        limits["upstream_connections_per_crew"] = args.connections + 16
    subjects: list[tuple[str, Any]] = [
        (
            "ours",
            lambda: common.start_ours(ws, source=args.source, limits=limits, tag="ours-memory"),
        ),
    ]
    if "squid" in args.peers:
        subjects.append(("squid", lambda: common.start_squid(ws)))
    results = []
    for name, start in subjects:
        for kind in ("keep-alive", "tunnel"):
            try:
                results.append(measure_memory(ws, nginx, start, name, kind, args.connections))
            except (Unavailable, RuntimeError, OSError) as exc:
                print(f"  ! {name} {kind}: not measured: {exc}", flush=True)
                results.append({"subject": name, "kind": kind, "error": str(exc)})
    return results


def crews_suite(ws: Workspace, args: argparse.Namespace, nginx: Service) -> list[dict[str, Any]]:
    configs = []
    for crews in args.crews:
        started = time.monotonic()
        service = common.start_ours(ws, source=args.source, crews=crews, tag=f"ours-{crews}crews")
        ready = time.monotonic() - started
        common.check_forward(service, nginx.port)
        uri, authority = common.forward_target(service.name, nginx.port)
        configs.append(
            {
                "crews": crews,
                "service": service,
                "script": common.wrk_script(ws, uri, authority),
                "startup_s": round(ready, 2),
                "rss_idle_kib": vm_rss_kib(service.pid),
                "rps": [],
                "foreign": [],
            }
        )
    for round_index in range(args.repeat):
        for config in configs:
            service = config["service"]
            url = f"http://{service.host}:{service.port}"
            if round_index == 0 and args.warmup > 0:
                common.run_wrk(
                    ws,
                    url,
                    duration=args.warmup,
                    warmup=True,
                    connections=50,
                    script=config["script"],
                )
            result = common.run_wrk(
                ws, url, duration=args.duration, connections=50, script=config["script"]
            )
            if result.non_2xx:
                raise RuntimeError(f"{config['crews']} crews: {result.non_2xx} non-2xx responses")
            print(
                f"  round {round_index + 1}, {config['crews']} crews (load to {service.host}): "
                f"{result.requests_per_s:,.0f} req/s",
                flush=True,
            )
            common.warn_if_loaded(f"{config['crews']} crews", result.foreign)
            config["rps"].append(result.requests_per_s)
            config["foreign"].append(result.foreign["foreign_cpu_pct"])
    results = []
    for config in configs:
        rps = common.median(config["rps"])
        results.append(
            {
                "crews": config["crews"],
                "gateway_loaded": config["service"].host,
                "req_per_s": rps,
                "req_per_s_runs": config["rps"],
                # Per round (interleaved), then the median.
                "ratio_to_first": common.median(
                    [r / b for r, b in zip(config["rps"], configs[0]["rps"], strict=True)]
                ),
                "startup_s": config["startup_s"],
                "rss_idle_kib": config["rss_idle_kib"],
                "foreign_cpu_pct": config["foreign"],
            }
        )
        ws.stop(config["service"].proc)
    return results


def print_tables(summary: dict[str, Any]) -> None:
    params = summary["parameters"]
    common.header(f"Memory per idle connection ({params['connections']:,} connections, VmRSS)")
    rows = []
    for row in summary["memory"]:
        if "error" in row:
            rows.append([row["subject"], row["kind"], None, None, None, None, None, row["error"]])
            continue
        rows.append(
            [
                row["subject"],
                row["kind"],
                row["rss_idle_kib"],
                row["rss_with_kib"],
                row["kib_per_connection"],
                row["fds_per_connection"],
                row["kernel_slab_kib_per_connection"],
                f"{row['alive_at_measurement']:,} alive",
            ]
        )
    print(
        common.table(
            [
                "subject",
                "idle kind",
                "RSS idle KiB",
                "RSS with KiB",
                "RSS KiB/conn",
                "fds/conn",
                "kernel slab KiB/conn (all ends)",
                "",
            ],
            rows,
        )
    )
    common.header(
        f"Throughput as crews grow (ours, 1 worker on core 0; wrk -c50, "
        f"{params['duration_s']:g} s x {params['repeat']}, median)"
    )
    rows = [
        [
            row["crews"],
            row["gateway_loaded"],
            row["req_per_s"],
            f"{min(row['req_per_s_runs']):,.0f}-{max(row['req_per_s_runs']):,.0f}",
            row["ratio_to_first"],
            row["startup_s"],
            row["rss_idle_kib"],
            round(max(row["foreign_cpu_pct"])),
        ]
        for row in summary["crews"]
    ]
    print(
        common.table(
            [
                "crews",
                "load to",
                "req/s",
                "range",
                "ratio to 1 crew",
                "startup s",
                "RSS idle KiB",
                "others' CPU %",
            ],
            rows,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="All traffic stays on 127.0.0.0/8; every run is bounded by --duration.",
    )
    common.common_arguments(parser, duration=10.0)
    parser.add_argument("--connections", type=int, default=1000, help="idle connections (1000)")
    parser.add_argument(
        "--crews", default="1,10,100,500", help="crew counts to compare (1,10,100,500)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unrecorded wrk seconds (2)")
    parser.add_argument("--peers", default="squid", help="memory reference peers ('' for none)")
    parser.add_argument("--skip-memory", action="store_true", help="only the crews suite")
    parser.add_argument("--skip-crews", action="store_true", help="only the memory suite")
    args = parser.parse_args(argv)
    args.crews = [int(n) for n in args.crews.split(",")]
    args.peers = [p for p in args.peers.split(",") if p]
    limit = common.raise_fd_limit()
    common.configure(wait_quiet=args.wait_quiet, retry_busy=args.retry_busy)
    if limit < 2 * args.connections + 100:
        parser.error(f"the fd limit ({limit}) is too low for {args.connections} connections")
    started = time.monotonic()
    machine = common.describe_machine(args.source)
    print(f"# bench_capacity: {machine['date']}, source {args.source} ({machine['revision']})")
    summary: dict[str, Any] = {
        "benchmark": "capacity",
        "parameters": {
            "connections": args.connections,
            "crews": args.crews,
            "duration_s": args.duration,
            "repeat": args.repeat,
        },
        "memory": [],
        "crews": [],
    }
    with Workspace(prefix="bench-capacity-") as ws:
        nginx = common.start_nginx(ws)
        if not args.skip_memory:
            with common.section("memory per idle connection"):
                summary["memory"] = memory_suite(ws, args, nginx)
        if not args.skip_crews:
            with common.section("throughput as crews grow"):
                summary["crews"] = crews_suite(ws, args, nginx)
    summary["machine"] = machine
    summary["elapsed_s"] = round(time.monotonic() - started)
    print_tables(summary)
    common.write_json(args.json_out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
