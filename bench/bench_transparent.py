"""Transparent capture against the explicit proxy: the same requests, the same proxy, two paths.

Target: the transparent path at least 0.9x the explicit path's requests per second.

Subjects, all against nginx serving /1k on loopback, our proxy with one worker pinned to core 0
(restricted policy, SSRF guard and events on, as in production), wrk and nginx on core 1:
- **direct**: wrk straight to nginx (the load side's ceiling, no proxy);
- **explicit**: wrk to the proxy, absolute-form `GET http://upstream.test:PORT/1k` (what an
  agent with HTTP_PROXY sends);
- **transparent**: wrk, as UID 65534, straight to nginx's address and port with `Host:
  upstream.test:PORT`; an nftables rule (DNAT in the output hook, matching that UID only) sends
  its connections to the proxy, which reads the original destination, checks that the host
  resolves to it and forwards (proxycore/io/transparent.py).
Two loads each: keep-alive (`wrk -c50`), and a new connection per request (`Connection:
close`, where the per-connection work shows: the accept, SO_ORIGINAL_DST, the agreement check).

Everything runs in a network namespace this script creates and deletes (its own loopback, its
own nftables table): the host's rules are never touched and no packet leaves it.

    python bench/bench_transparent.py --duration 10 --repeat 3 --wait-quiet 10 --retry-busy 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import UPSTREAM_HOST, Workspace

TOOL_UID = 65534
LOADS = ("keepalive", "new")


def wrk_argv(
    url: str, duration: float, connections: int, script: Path, *, as_tool: bool
) -> list[str]:
    argv = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(duration))}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        url,
    ]
    if as_tool:
        argv = ["setpriv", f"--reuid={TOOL_UID}", f"--regid={TOOL_UID}", "--clear-groups", *argv]
    return common.pinned(common.LOAD_CORE, argv)


def script(ws: Workspace, name: str, uri: str, authority: str, close: bool) -> Path:
    path = ws.path(f"{name}.lua")
    headers = f'["Host"] = "{authority}"' + (', ["Connection"] = "close"' if close else "")
    path.write_text(
        f'request = function()\n  return wrk.format("GET", "{uri}", {{{headers}}})\nend\n'
    )
    path.chmod(0o644)
    return path


def capture(proxy_port: int, nginx_port: int) -> None:
    """The tool's connections to nginx go to the proxy on the crew's gateway (127.0.0.1)."""
    rules = f"""
table ip capture {{
    chain output {{
        type nat hook output priority -100;
        meta skuid {TOOL_UID} ip daddr 127.0.0.1 tcp dport {nginx_port} \\
            dnat to 127.0.0.1:{proxy_port}
    }}
}}
"""
    subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": common.describe_machine(args.source), "runs": []}
    with Workspace(prefix="bench-transparent-") as ws:
        nginx = common.start_nginx(ws)
        ours = common.start_ours(ws, source=args.source)
        capture(ours.port, nginx.port)
        authority = f"{UPSTREAM_HOST}:{nginx.port}"
        subjects: dict[str, tuple[str, bool, str]] = {
            # name: (url wrk connects to, runs as the tool, request target)
            "direct": (f"http://127.0.0.1:{nginx.port}", False, "/1k"),
            "explicit": (f"http://{ours.host}:{ours.port}", False, f"http://{authority}/1k"),
            "transparent": (f"http://127.0.0.1:{nginx.port}", True, "/1k"),
        }
        # Each path answers once before anything is measured (and says what it is).
        for name, (url, as_tool, target) in subjects.items():
            check = script(ws, f"check-{name}", target, authority, True)
            argv = wrk_argv(url, 1, 1, check, as_tool=as_tool)
            out, _ = common.run_measured(ws, argv, timeout=60, warmup=True)
            parsed = common.parse_wrk(out)
            if not parsed.requests or parsed.non_2xx or any(parsed.socket_errors.values()):
                raise SystemExit(f"{name}: not answered as it should be:\n{out.strip()[-600:]}")
        for round_index in range(args.repeat):
            for load in args.loads:
                close = load == "new"
                connections = 50 if load == "keepalive" else 16
                for name, (url, as_tool, target) in subjects.items():
                    path = script(ws, f"{name}-{load}", target, authority, close)
                    argv = wrk_argv(url, args.duration, connections, path, as_tool=as_tool)
                    watch = None if name == "direct" else ours.proc.pid
                    out, load_report = common.run_measured(
                        ws, argv, timeout=args.duration + 60, watch_pgid=watch
                    )
                    parsed = common.parse_wrk(out)
                    row = {
                        "round": round_index,
                        "load": load,
                        "subject": name,
                        "rps": parsed.requests_per_s,
                        "p50_ms": parsed.latency_ms.get("p50"),
                        "p99_ms": parsed.latency_ms.get("p99"),
                        "non_2xx": parsed.non_2xx,
                        "socket_errors": parsed.socket_errors,
                        "proxy_cpu_pct": load_report.get("watched_cpu_pct"),
                        "proxy_cpu_us_per_req": (
                            round(1e6 * load_report["watched_cpu_s"] / parsed.requests, 1)
                            if watch is not None and parsed.requests
                            else None
                        ),
                        "foreign_cpu_pct": load_report["foreign_cpu_pct"],
                    }
                    results["runs"].append(row)
                    print(
                        f"  {load:9} {name:11} {row['rps']:10,.0f} req/s  p99 {row['p99_ms']} ms"
                        f"  proxy {row['proxy_cpu_pct']}% cpu, {row['proxy_cpu_us_per_req']} us/req"
                        f"  (others {row['foreign_cpu_pct']}%)",
                        flush=True,
                    )
    summary = []
    for load in args.loads:
        explicit = _median(results["runs"], load, "explicit", "rps")
        transparent = _median(results["runs"], load, "transparent", "rps")
        summary.append(
            [
                load,
                f"{_median(results['runs'], load, 'direct', 'rps'):,.0f}",
                f"{explicit:,.0f}",
                f"{transparent:,.0f}",
                f"{transparent / explicit:.2f}x" if explicit else "-",
                f"{_median(results['runs'], load, 'explicit', 'proxy_cpu_us_per_req'):.1f} / "
                f"{_median(results['runs'], load, 'transparent', 'proxy_cpu_us_per_req'):.1f}",
            ]
        )
    results["summary"] = summary
    print()
    print(
        common.table(
            [
                "load",
                "direct req/s",
                "explicit req/s",
                "transparent req/s",
                "transparent/explicit",
                "proxy us/req (explicit / transparent)",
            ],
            summary,
        )
    )
    return results


def _median(runs: list[dict[str, Any]], load: str, subject: str, key: str) -> float:
    values = [r[key] for r in runs if r["load"] == load and r["subject"] == subject]
    present = [v for v in values if v is not None]
    return common.median(present) if present else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.common_arguments(parser, duration=10.0)
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds, subjects interleaved (default 3)"
    )
    parser.add_argument("--loads", default=",".join(LOADS), help="keepalive,new (default both)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.loads = [load for load in args.loads.split(",") if load]
    for load in args.loads:
        if load not in LOADS:
            parser.error(f"--loads: {load!r} is not one of {', '.join(LOADS)}")
    if os.geteuid() != 0:
        raise SystemExit("bench_transparent: needs root (a network namespace and nftables)")
    for tool in ("ip", "nft", "setpriv", "wrk", "nginx"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench_transparent: {tool} is not installed")
    if not args.inside:
        # Run again inside a namespace of our own; deleted whatever happens.
        namespace = f"apx-bench-tp-{uuid.uuid4().hex[:6]}"
        subprocess.run(["ip", "netns", "add", namespace], check=True)
        try:
            subprocess.run(["ip", "-n", namespace, "link", "set", "lo", "up"], check=True)
            done = subprocess.run(
                ["ip", "netns", "exec", namespace, sys.executable, *sys.argv, "--inside"]
            )
        finally:
            subprocess.run(["ip", "netns", "del", namespace], check=False)
        raise SystemExit(done.returncode)
    common.configure(wait_quiet=args.wait_quiet, retry_busy=args.retry_busy)
    results = measure(args)
    common.write_json(args.json_out, results)


if __name__ == "__main__":
    main()
