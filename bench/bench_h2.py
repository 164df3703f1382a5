"""HTTP/2 through the proxy: streams/s per core and p99 with h2c agents, against nghttpx, haproxy.

Theory of operation
-------------------
The agent side is h2c with prior knowledge (RFC 9113 section 3.3): h2load sends the HTTP/2
preface on a plain connection, `:authority` naming the origin. One nginx on core 1 is the origin
for every subject, on two ports: HTTP/1.1 (leg `h1`) and h2c (leg `h2c`, nginx's plain `http2`
listener), each serving /1k (1 KiB). Each proxy runs pinned to core 0; h2load and nginx share
core 1, as in bench_forward.py. Subjects, per leg:

- direct (leg h2c only): h2load -> nginx h2c, no proxy: the ceiling of the load side.
- ours: one worker, the production configuration (common.ours_config), as a forward proxy:
  `:authority: upstream.test:PORT`, resolved by its split-horizon table; the origin's h2c port
  is reached over HTTP/2 with prior knowledge (`[upstream] h2c = ["upstream.test:PORT"]`,
  docs/proxy.md "HTTP/2 to upstreams"), its HTTP/1.1 port over HTTP/1.1.
- nghttpx (reverse proxy, `no-tls` front end, so h2c with prior knowledge; backend HTTP/1.1, or
  `proto=h2` for h2c) and haproxy (`bind ... proto h2`; `server ... proto h2` for h2c). Neither
  is a forward proxy that dials the origin a request names (nghttpx's `--http2-proxy` forwards to
  another proxy; haproxy has no resolver per request), so both get a fixed backend: they do no
  policy, name resolution or event log, which ours does on every stream.

1. Throughput, per concurrency level `CxM` (h2load `-c C -m M`: C connections with M streams in
   flight each), interleaved subjects, `--repeat` rounds; median and range. Beside streams/s,
   the CPU the proxy's process group used during the run (% of one core): a peer that does not
   fill its core is limited by the load side, so "streams per core-second" (streams/s / CPU
   share) is the per-core figure. p50/p99 come from h2load's per-request log: closed-loop
   latency at that concurrency (queueing included), not latency at a fixed rate.
2. Ours over HTTP/1.1 in the same run, bench_forward's method (wrk -c50, absolute-form GETs,
   through the same worker to the h1 port): the target is h2 streams/s >= this, per core.
3. Memory per idle h2 connection, bench_capacity's method: a fresh subject, warmed up, its RSS
   (all processes of its group: nghttpx forks a worker), then N h2c connections that each carried
   one request and idle; (RSS with - RSS idle) / N, fds and the machine's SUnreclaim per connection.

Background load: every measurement records others' CPU (common.ForeignLoad) and honours
--wait-quiet / --retry-busy. All traffic stays on 127.0.0.0/8; every run is bounded in time.
Run `python bench/bench_h2.py --help` for the options.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import h2_client
from bench_capacity import open_fds, unreclaimable_slab_kib, vm_rss_kib
from bench_h2_report import print_tables, summarize
from common import Service, Unavailable, Workspace

PEERS = ("nghttpx", "haproxy")
LEGS = ("h1", "h2c")
PATH = "/1k"


@dataclass
class Origin:
    service: Service
    ports: dict[str, int]  # leg -> port


@dataclass
class Subject:
    name: str
    leg: str
    host: str
    port: int
    authority: str
    service: Service | None
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # level -> rounds


def start_origin(ws: Workspace, core: str | None = common.LOAD_CORE) -> Origin:
    """nginx, one worker: /1k over HTTP/1.1 on one port and over h2c on another."""
    if shutil.which("nginx") is None:
        raise Unavailable("nginx not installed (apt-get install -y nginx)")
    root = ws.subdir("nginx-h2")
    (root / "1k").write_bytes(b"a" * common.BODY_SIZE)
    ports = {leg: common.free_port() for leg in LEGS}
    servers = "".join(
        f"    server {{ listen 127.0.0.1:{ports[leg]} backlog=4096{flag}; root {root}; }}\n"
        for leg, flag in (("h1", ""), ("h2c", " http2"))
    )
    conf = root / "nginx.conf"
    conf.write_text(
        f"worker_processes 1;\nworker_rlimit_nofile 65536;\ndaemon off;\npid {root}/nginx.pid;\n"
        f"error_log {root}/error.log warn;\nevents {{ worker_connections 16384; }}\n"
        "http {\n    access_log off;\n    keepalive_requests 100000000;\n"
        "    keepalive_timeout 300s;\n    http2_max_concurrent_streams 1024;\n"
        f"{servers}}}\n"
    )
    argv = common.pinned(core, ["nginx", "-p", str(root), "-c", str(conf)])
    proc = ws.spawn(argv, log=root / "stdout.log", note="origin: HTTP/1.1 and h2c")
    service = Service("nginx", "127.0.0.1", ports["h1"], proc, argv, root / "stdout.log")
    common._started(ws, service)
    common.wait_for_port("127.0.0.1", ports["h2c"], proc)
    return Origin(service, ports)


def start_nghttpx(ws: Workspace, origin: Origin, leg: str) -> Service:
    if shutil.which("nghttpx") is None:
        raise Unavailable("nghttpx not installed (apt-get install -y nghttp2-proxy)")
    root = ws.subdir(f"nghttpx-{leg}")
    port = common.free_port()
    backend = f"127.0.0.1,{origin.ports[leg]}" + (";;proto=h2" if leg == "h2c" else "")
    argv = common.pinned(
        common.PROXY_CORE,
        [
            "nghttpx",
            "--conf=/dev/null",  # not /etc/nghttpx/nghttpx.conf
            f"--frontend=127.0.0.1,{port};no-tls",
            f"--backend={backend}",
            "--workers=1",
            f"--errorlog-file={root / 'error.log'}",
            f"--pid-file={root / 'nghttpx.pid'}",
        ],
    )
    proc = ws.spawn(argv, log=root / "stdout.log", note=f"reverse proxy, h2c front, {leg} back")
    service = Service("nghttpx", "127.0.0.1", port, proc, argv, root / "error.log")
    return common._started(ws, service)


def start_haproxy(ws: Workspace, origin: Origin, leg: str) -> Service:
    if shutil.which("haproxy") is None:
        raise Unavailable("haproxy not installed (apt-get install -y haproxy)")
    root = ws.subdir(f"haproxy-{leg}")
    port = common.free_port()
    proto = " proto h2" if leg == "h2c" else ""
    conf = root / "haproxy.cfg"
    conf.write_text(
        "global\n    nbthread 1\n    maxconn 8192\n"
        "defaults\n    mode http\n    timeout connect 5s\n    timeout client 300s\n"
        "    timeout server 300s\n"
        f"frontend fe\n    bind 127.0.0.1:{port} proto h2\n    default_backend be\n"
        "backend be\n    http-reuse always\n"
        f"    server origin 127.0.0.1:{origin.ports[leg]}{proto}\n"
    )
    argv = common.pinned(common.PROXY_CORE, ["haproxy", "-db", "-f", str(conf)])
    proc = ws.spawn(argv, log=root / "stdout.log", note=f"h2c front (proto h2), {leg} back")
    service = Service("haproxy", "127.0.0.1", port, proc, argv, root / "stdout.log")
    return common._started(ws, service)


def start_ours(
    ws: Workspace, args: argparse.Namespace, origin: Origin, tag: str = "ours"
) -> Service:
    limits = {"max_connections_per_crew": args.connections + 16}
    config = (args.source / "proxycore" / "config.py").read_text()
    if "upstream_connections_per_crew" in config:
        limits["upstream_connections_per_crew"] = args.connections + 16
    # The origin's h2c port is reached with prior knowledge (its HTTP/1.1 port as before).
    upstream = []
    if "h2c: tuple[str, ...]" in config:
        upstream.append(f'h2c = ["{common.UPSTREAM_HOST}:{origin.ports["h2c"]}"]')
    return common.start_ours(ws, source=args.source, limits=limits, tag=tag, upstream=upstream)


def authority_for(name: str, origin: Origin, leg: str) -> str:
    host = common.UPSTREAM_HOST if name == "ours" else "127.0.0.1"
    return f"{host}:{origin.ports[leg]}"


def check_h2(service_name: str, host: str, port: int, authority: str) -> None:
    """One h2c request through the subject: 200 and the whole body, or Unavailable."""
    try:
        status, body = h2_client.h2_get(host, port, authority, PATH)
    except (OSError, h2_client.NotH2) as exc:
        prefix = "no h2c yet: " if service_name == "ours" else ""
        raise Unavailable(f"{prefix}h2c request refused ({exc})") from None
    if status != 200 or body != common.BODY_SIZE:
        raise Unavailable(f"h2c request got status {status} and {body} body bytes")


def start_subjects(
    ws: Workspace, args: argparse.Namespace, origin: Origin, ours: Service | None
) -> tuple[list[Subject], dict[str, str]]:
    subjects: list[Subject] = []
    unavailable: dict[str, str] = {}
    for leg in args.legs:
        starters: list[tuple[str, Callable[[], Service | None]]] = []
        if leg == "h2c" and args.direct:
            starters.append(("direct", lambda: None))
        if "ours" in args.proxy and ours is not None:
            starters.append(("ours", functools.partial(lambda service: service, ours)))
        for peer in PEERS:
            if peer in args.proxy:
                start = start_nghttpx if peer == "nghttpx" else start_haproxy
                starters.append((peer, functools.partial(start, ws, origin, leg)))
        for name, starter in starters:
            authority = authority_for(name, origin, leg)
            try:
                service = starter()
                host, port = ("127.0.0.1", origin.ports[leg])
                if service is not None:
                    host, port = service.host, service.port
                check_h2(name, host, port, authority)
            except Unavailable as exc:
                print(f"  ! {name} ({leg} upstream): not measured: {exc}", flush=True)
                unavailable[f"{name}/{leg}"] = str(exc)
                continue
            subjects.append(Subject(name, leg, host, port, authority, service))
    return subjects, unavailable


def run_h2load(
    ws: Workspace, args: argparse.Namespace, subject: Subject, level: str
) -> dict[str, Any]:
    clients, streams = (int(n) for n in level.split("x"))
    log = ws.path(f"h2load-{subject.name}-{subject.leg}-{level}.tsv")
    argv = common.pinned(
        common.LOAD_CORE,
        [
            "h2load",
            "-t1",
            f"-c{clients}",
            f"-m{streams}",
            "-D",
            f"{round(args.duration * 1000)}ms",  # h2load takes only whole numbers with a unit
            "--warm-up-time",
            f"{round(args.warmup * 1000)}ms",
            "-H",
            f":authority: {subject.authority}",
            f"--log-file={log}",
            f"http://{subject.host}:{subject.port}{PATH}",
        ],
    )
    watch = subject.service.pid if subject.service else None
    output, load = common.run_measured(
        ws, argv, timeout=args.duration + args.warmup + 60, watch_pgid=watch
    )
    result = h2_client.parse_h2load(output)
    result.update(h2_client.read_h2load_log(log))
    result["foreign"] = load
    cpu = load.get("watched_cpu_pct")
    result["proxy_cpu_pct"] = cpu
    result["streams_per_core_s"] = result["streams_per_s"] / (cpu / 100) if cpu else None
    return result


def measure(
    ws: Workspace, args: argparse.Namespace, subjects: list[Subject], ours_h1: dict[str, Any]
) -> None:
    for round_index in range(args.repeat):
        for level in args.levels:
            for subject in subjects:
                result = run_h2load(ws, args, subject, level)
                subject.runs.setdefault(level, []).append(result)
                bad = result["failed"] + result["errored"] + result["timeout"]
                cpu = result["proxy_cpu_pct"]
                print(
                    f"  round {round_index + 1} {subject.name}/{subject.leg} {level}: "
                    f"{result['streams_per_s']:,.0f} streams/s, p99 {result.get('p99_ms')} ms"
                    + (f", proxy CPU {cpu:.0f}%" if cpu is not None else "")
                    + (f", {bad} failed" if bad else ""),
                    flush=True,
                )
                common.warn_if_loaded(f"{subject.name}/{subject.leg}", result["foreign"])
        if ours_h1.get("service") is not None:
            measure_ours_h1(ws, args, ours_h1)


def measure_ours_h1(ws: Workspace, args: argparse.Namespace, ours_h1: dict[str, Any]) -> None:
    """bench_forward's method: wrk -c50, absolute-form GETs through the worker to the h1 port."""
    service: Service = ours_h1["service"]
    url = f"http://{service.host}:{service.port}"
    result = common.run_wrk(
        ws,
        url,
        duration=args.duration,
        connections=50,
        script=ours_h1["script"],
        watch_pgid=service.pid,
    )
    cpu = result.foreign.get("watched_cpu_pct")
    run = result.as_dict()
    run["proxy_cpu_pct"] = cpu
    run["req_per_core_s"] = result.requests_per_s / (cpu / 100) if cpu else None
    ours_h1["runs"].append(run)
    print(
        f"  ours HTTP/1.1 (wrk -c50): {result.requests_per_s:,.0f} req/s, proxy CPU {cpu}%"
        f" (non-2xx {result.non_2xx})",
        flush=True,
    )
    common.warn_if_loaded("ours HTTP/1.1", result.foreign)


def rss_group_kib(pgid: int) -> int:
    """VmRSS summed over the process group (nghttpx's master and worker)."""
    total = 0
    for pid, (_, group, _, _) in common._process_ticks().items():
        if group == pgid:
            with contextlib.suppress(OSError, RuntimeError):  # gone, or a zombie
                total += vm_rss_kib(pid)
    return total


def group_fds(pgid: int) -> int:
    return sum(open_fds(pid) for pid, info in common._process_ticks().items() if info[1] == pgid)


def measure_memory(
    ws: Workspace, args: argparse.Namespace, origin: Origin, name: str, start: Callable[[], Service]
) -> dict[str, Any]:
    """A fresh subject, warmed up, then N idle h2c connections that each carried one request."""
    service = start()
    authority = authority_for(name, origin, "h1")
    sessions: list[h2_client.H2Session] = []
    try:
        check_h2(name, service.host, service.port, authority)
        for _ in range(20):
            check_h2(name, service.host, service.port, authority)
        time.sleep(1.0)
        idle, fds_idle, slab_idle = (
            rss_group_kib(service.pid),
            group_fds(service.pid),
            unreclaimable_slab_kib(),
        )
        print(f"  {name}: opening {args.connections} idle h2c connections", flush=True)
        for _ in range(args.connections):
            session = h2_client.H2Session.open(service.host, service.port)
            sessions.append(session)
            status, body = session.get(authority, PATH)
            if status != 200 or body != common.BODY_SIZE:
                raise RuntimeError(f"status {status}, {body} body bytes")
        time.sleep(1.0)
        loaded, fds_loaded, slab_loaded = (
            rss_group_kib(service.pid),
            group_fds(service.pid),
            unreclaimable_slab_kib(),
        )
    finally:
        for session in sessions:
            session.close()
        ws.stop(service.proc)
    count = args.connections
    result = {
        "subject": name,
        "connections": count,
        "rss_idle_kib": idle,
        "rss_with_kib": loaded,
        "kib_per_connection": (loaded - idle) / count,
        "fds_per_connection": (fds_loaded - fds_idle) / count,
        "kernel_slab_kib_per_connection": (slab_loaded - slab_idle) / count,
    }
    print(
        f"  {name}: idle {idle} KiB, with {count}: {loaded} KiB, "
        f"{result['kib_per_connection']:.1f} KiB per idle h2 connection",
        flush=True,
    )
    return result


def memory_suite(ws: Workspace, args: argparse.Namespace, origin: Origin) -> list[dict[str, Any]]:
    starts: list[tuple[str, Callable[[], Service]]] = []
    if "ours" in args.proxy:
        starts.append(("ours", lambda: start_ours(ws, args, origin, tag="ours-memory")))
    if "nghttpx" in args.proxy:
        starts.append(("nghttpx", lambda: start_nghttpx(ws, origin, "h1")))
    if "haproxy" in args.proxy:
        starts.append(("haproxy", lambda: start_haproxy(ws, origin, "h1")))
    results = []
    for name, start in starts:
        try:
            results.append(measure_memory(ws, args, origin, name, start))
        except (Unavailable, RuntimeError, OSError, h2_client.NotH2) as exc:
            print(f"  ! {name}: memory not measured: {exc}", flush=True)
            results.append({"subject": name, "error": str(exc)})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="All traffic stays on 127.0.0.0/8; every run is bounded by --duration.",
    )
    common.common_arguments(parser, duration=5.0)
    parser.add_argument(
        "--proxy",
        default="ours," + ",".join(PEERS),
        help="comma-separated subjects: ours, nghttpx, haproxy (default all)",
    )
    parser.add_argument(
        "--levels",
        default="1x64,10x10,50x1",
        help="comma-separated CxM: h2load -c C -m M (default 1x64,10x10,50x1)",
    )
    parser.add_argument(
        "--legs", default=",".join(LEGS), help="comma-separated upstream legs: h1, h2c (both)"
    )
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds (2)")
    parser.add_argument("--warmup", type=float, default=1.0, help="h2load --warm-up-time (1)")
    parser.add_argument(
        "--connections", type=int, default=1000, help="idle h2c connections for memory (1000)"
    )
    parser.add_argument("--no-direct", dest="direct", action="store_false")
    parser.add_argument("--no-memory", dest="memory", action="store_false")
    args = parser.parse_args(argv)
    args.proxy = [p for p in args.proxy.split(",") if p]
    for name in args.proxy:
        if name not in ("ours", *PEERS):
            parser.error(f"unknown subject {name!r}")
    args.legs = [leg for leg in args.legs.split(",") if leg]
    if not args.legs or any(leg not in LEGS for leg in args.legs):
        parser.error(f"legs are some of {', '.join(LEGS)}")
    args.levels = [level for level in args.levels.split(",") if level]
    for level in args.levels:
        if not all(part.isdigit() for part in level.split("x")) or level.count("x") != 1:
            parser.error(f"a level is CxM, e.g. 10x10: {level!r}")
    if shutil.which("h2load") is None:
        parser.error("h2load not installed (apt-get install -y nghttp2-client)")
    common.raise_fd_limit()
    common.configure(wait_quiet=args.wait_quiet, retry_busy=args.retry_busy)
    started = time.monotonic()
    machine = common.describe_machine(args.source)
    machine["versions"].update(versions())
    print(f"# bench_h2: {machine['date']}, source {args.source} ({machine['revision']})")
    with Workspace(prefix="bench-h2-") as ws:
        origin = start_origin(ws)
        ours_h1: dict[str, Any] = {"service": None, "runs": []}
        ours: Service | None = None
        if "ours" in args.proxy:
            ours = start_ours(ws, args, origin)
            common.check_forward(ours, origin.ports["h1"])
            uri, authority = common.forward_target("ours", origin.ports["h1"])
            ours_h1.update(service=ours, script=common.wrk_script(ws, uri, authority))
        subjects, unavailable = start_subjects(ws, args, origin, ours)
        with common.section("throughput (h2load), and ours over HTTP/1.1 (wrk)"):
            measure(ws, args, subjects, ours_h1)
        memory: list[dict[str, Any]] = []
        if args.memory:
            with common.section("memory per idle h2 connection"):
                memory = memory_suite(ws, args, origin)
        summary = summarize(args, subjects, unavailable, ours_h1["runs"], memory)
    summary["machine"] = machine
    summary["elapsed_s"] = round(time.monotonic() - started)
    print_tables(summary)
    common.write_json(args.json_out, summary)
    return 0


def versions() -> dict[str, str]:
    return {
        "h2load": common._first_line(["h2load", "--version"]),
        "nghttpx": common._first_line(["nghttpx", "--version"]),
        "haproxy": common._first_line(["haproxy", "-v"]),
    }


if __name__ == "__main__":
    sys.exit(main())
