"""HTTPS through CONNECT: our terminated path vs our opaque tunnel vs mitmdump, and leaf mint time.

The origin is nginx over TLS on loopback (one worker, /1k = 1 KiB), with a certificate for
`term.test` and `opaque.test` signed by a bench upstream CA. Rows:
- direct: the client's TLS straight to nginx (no proxy): the ceiling;
- ours opaque: `CONNECT opaque.test` through our proxy (no leaf for it: a splice tunnel), the
  client's TLS end to end with nginx;
- ours terminated: `CONNECT term.test`, for which the crew holds a leaf signed by its crew CA
  (`[[crew.leaves]]`): the proxy does the TLS with the client, reads each request, and forwards
  it over verified TLS (`[upstream] ca_file` = the bench upstream CA) from its upstream pool;
- mitmdump: regular proxy mode, upstream verified against the bench upstream CA, the client
  trusting mitmdump's own CA. mitmdump has no resolve table, so the client sends
  `CONNECT 127.0.0.1:PORT` and names `term.test` in its SNI: mitmdump passes the client's SNI
  upstream and verifies nginx's certificate against it (checked: a wrong CA fails the run).

Our proxy names both hosts in its split-horizon table (127.0.0.1) and its crew allows both. Each
proxy is pinned to core 0; the load (`bench/tls_load.py`, asyncio, across --procs processes) and
nginx share core 1. Two modes: keep-alive (CONNECT + handshake once per connection, requests
back to back) and new connections (CONNECT + handshake + one request + close each time), under
--connections (16) and, for the latency a proxy adds when nothing queues, keep-alive over one
connection. Per row:
req/s, latency p50/p99 under that closed-loop load, and the proxy's CPU per request (its process
group's CPU time over the run / requests), since a Python client on one core can be the limit of
the opaque path, not the proxy. Leaf mint time (cold and cached) comes from bench/bench_crew_ca.py
run on core 1.

Run `python bench/bench_terminate.py --help` for the options.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common
from common import Service, Unavailable, Workspace
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from appliance.crew_ca import CrewCA, new_ca

TERM_HOST = "term.test"
OPAQUE_HOST = "opaque.test"
MODES = ("keepalive", "new")
# A load: MODE or MODE:CONNECTIONS (default --connections). One keep-alive connection alone gives
# the latency a proxy adds to a request when nothing queues.
LOADS = "keepalive,new,keepalive:1"
ROWS = ("direct", "ours-opaque", "ours-terminated", "mitmdump")


def origin_certificate(ca: CrewCA, names: tuple[str, ...]) -> tuple[bytes, bytes]:
    """A server certificate for all of `names` signed by `ca` (crew_ca.mint makes one name)."""
    ca_key = serialization.load_pem_private_key(ca.key_pem(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False)
        .sign(ca_key, hashes.SHA256())
    )
    return (
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o644)
    return path


def load_argv(
    row: dict[str, Any], args: argparse.Namespace, mode: str, duration: float, connections: int
) -> list[str]:
    return common.pinned(
        common.LOAD_CORE,
        [
            sys.executable,
            str(common.BENCH_DIR / "tls_load.py"),
            *row["where"],
            "--cafile",
            str(row["cafile"]),
            "--mode",
            mode,
            "--connections",
            str(connections),
            "--procs",
            str(min(args.procs, connections)),
            "--duration",
            str(duration),
        ],
    )


def run_load(
    ws: Workspace,
    row: dict[str, Any],
    args: argparse.Namespace,
    mode: str,
    *,
    duration: float,
    connections: int,
    warmup: bool = False,
) -> dict[str, Any]:
    service: Service | None = row["service"]
    output, report = common.run_measured(
        ws,
        load_argv(row, args, mode, duration, connections),
        timeout=duration + 90,
        warmup=warmup,
        watch_pgid=service.pid if service else None,
    )
    result: dict[str, Any] = json.loads(output)
    result.update(report)
    if service is not None and result["requests"]:
        result["proxy_cpu_us_per_req"] = result["watched_cpu_s"] * 1e6 / result["requests"]
    return result


def mint_figures(ws: Workspace, count: int) -> dict[str, Any]:
    argv = common.pinned(
        common.LOAD_CORE,
        [sys.executable, str(common.BENCH_DIR / "bench_crew_ca.py"), "--count", str(count)],
    )
    output, report = common.run_measured(ws, argv, timeout=600)
    result: dict[str, Any] = json.loads(output)
    result.update(report)
    return result


def start_rows(ws: Workspace, args: argparse.Namespace) -> tuple[list[dict[str, Any]], Any]:
    pki = ws.subdir("pki")
    upstream_ca = new_ca("bench-upstream", common_name="bench upstream CA")
    upstream_ca_file = write(pki / "upstream-ca.pem", upstream_ca.cert_pem)
    cert, key = origin_certificate(upstream_ca, (TERM_HOST, OPAQUE_HOST))
    nginx = common.start_nginx(
        ws, tls=(write(pki / "origin.crt", cert), write(pki / "origin.key", key))
    )
    crew_ca = new_ca("bench0")
    crew_ca_file = write(pki / "crew-ca.pem", crew_ca.cert_pem)
    leaf = crew_ca.mint(TERM_HOST)
    leaf_cert = write(pki / "term.crt", leaf.cert_pem)
    leaf_key = write(pki / "term.key", leaf.key_pem)
    ours = common.start_ours(
        ws,
        source=args.source,
        allow=(TERM_HOST, OPAQUE_HOST),
        upstream=[f'ca_file = "{upstream_ca_file}"'],
        crew_lines=[
            "[[crew.leaves]]",
            f'host = "{TERM_HOST}"',
            f'cert_file = "{leaf_cert}"',
            f'key_file = "{leaf_key}"',
            "",
        ],
    )
    origin = ["--name", TERM_HOST, "--port", str(nginx.port)]
    rows: list[dict[str, Any]] = [
        {
            "name": "direct",
            "label": "client TLS straight to nginx (no proxy)",
            "service": None,
            "where": ["--direct", f"127.0.0.1:{nginx.port}", *origin],
            "cafile": upstream_ca_file,
        },
        {
            "name": "ours-opaque",
            "label": f"ours, CONNECT {OPAQUE_HOST} (no leaf: splice tunnel), 1 worker (core 0)",
            "service": ours,
            "where": [
                "--proxy",
                f"{ours.host}:{ours.port}",
                "--name",
                OPAQUE_HOST,
                "--port",
                str(nginx.port),
            ],
            "cafile": upstream_ca_file,
        },
        {
            "name": "ours-terminated",
            "label": f"ours, CONNECT {TERM_HOST} (leaf: terminated, pooled verified TLS "
            "upstream), 1 worker (core 0)",
            "service": ours,
            "where": ["--proxy", f"{ours.host}:{ours.port}", *origin],
            "cafile": crew_ca_file,
        },
    ]
    unavailable: dict[str, str] = {}
    if "mitmdump" in args.peers:
        try:
            mitm = common.start_mitmdump(
                ws, extra=["--set", f"ssl_verify_upstream_trusted_ca={upstream_ca_file}"]
            )
            mitm_ca = mitm.log.parent / "conf" / "mitmproxy-ca-cert.pem"
            deadline = time.monotonic() + 10
            while not mitm_ca.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            rows.append(
                {
                    "name": "mitmdump",
                    "label": f"mitmdump, CONNECT 127.0.0.1:{nginx.port} + SNI {TERM_HOST}, "
                    "upstream verified against the bench CA (core 0)",
                    "service": mitm,
                    "where": [
                        "--proxy",
                        f"{mitm.host}:{mitm.port}",
                        *origin,
                        "--connect-to",
                        f"127.0.0.1:{nginx.port}",
                    ],
                    "cafile": mitm_ca,
                }
            )
        except Unavailable as exc:
            print(f"  ! mitmdump: not available: {exc}", flush=True)
            unavailable["mitmdump"] = str(exc)
    for row in rows:
        # One request per mode before measuring: the path works, certificates check out. A
        # failure of ours is a finding and stops the run; a peer's is reported.
        for mode in MODES:
            check = run_load(ws, row, args, mode, duration=1.0, connections=1, warmup=True)
            if check["requests"] == 0 or check["errors"]:
                message = f"{row['name']} {mode}: sanity run failed: {check}"
                if row["name"].startswith("ours"):
                    tail = row["service"].log_tail() if row["service"] else ""
                    raise RuntimeError(f"{message}\n{tail}")
                print(f"  ! {message}", flush=True)
                unavailable[row["name"]] = message
    rows = [row for row in rows if row["name"] not in unavailable]
    return rows, unavailable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="All traffic stays on 127.0.0.0/8; every load run is bounded by --duration.",
    )
    common.common_arguments(parser, duration=10.0)
    parser.add_argument("--connections", type=int, default=16, help="concurrent connections (16)")
    parser.add_argument("--procs", type=int, default=2, help="load processes on core 1 (2)")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds (2)")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per row (2)")
    parser.add_argument(
        "--loads",
        default=LOADS,
        help=f"MODE[:CONNECTIONS],... with MODE one of {', '.join(MODES)} ({LOADS})",
    )
    parser.add_argument("--peers", default="mitmdump", help="peers besides ours (mitmdump)")
    parser.add_argument("--mint-count", type=int, default=2000, help="bench_crew_ca.py --count")
    args = parser.parse_args(argv)
    args.peers = [p for p in args.peers.split(",") if p]
    loads: list[tuple[str, str, int]] = []
    for item in (m for m in args.loads.split(",") if m):
        mode, _, count = item.partition(":")
        if mode not in MODES:
            parser.error(f"--loads: unknown mode {mode!r}")
        loads.append((item, mode, int(count) if count else args.connections))
    common.raise_fd_limit()
    common.configure(wait_quiet=args.wait_quiet, retry_busy=args.retry_busy)
    started = time.monotonic()
    machine = common.describe_machine(args.source)
    print(f"# bench_terminate: {machine['date']}, source {args.source} ({machine['revision']})")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with Workspace(prefix="bench-terminate-") as ws:
        rows, unavailable = start_rows(ws, args)
        for key, mode, connections in loads:
            with common.section(f"{mode}: {connections} connections, {args.duration:g} s"):
                for round_index in range(args.repeat):
                    for row in rows:
                        if round_index == 0 and args.warmup > 0:
                            run_load(
                                ws,
                                row,
                                args,
                                mode,
                                duration=args.warmup,
                                connections=connections,
                                warmup=True,
                            )
                        result = run_load(
                            ws,
                            row,
                            args,
                            mode,
                            duration=args.duration,
                            connections=connections,
                        )
                        cpu = result.get("proxy_cpu_us_per_req")
                        print(
                            f"  round {round_index + 1} {row['name']}: "
                            f"{result['requests_per_s']:,.0f} req/s, "
                            f"p50 {result['latency_ms']['p50']:.2f} ms, "
                            f"p99 {result['latency_ms']['p99']:.2f} ms"
                            + (f", proxy {cpu:.0f} us/req" if cpu is not None else "")
                            + f", errors {result['errors']}",
                            flush=True,
                        )
                        if result["errors"]:
                            print(f"  ! {row['name']}: {result['error_messages']}", flush=True)
                        common.warn_if_loaded(row["name"], result)
                        runs.setdefault(key, {}).setdefault(row["name"], []).append(result)
        with common.section(f"leaf mint, {args.mint_count} calls each (bench_crew_ca.py, core 1)"):
            mint = mint_figures(ws, args.mint_count)
            print(f"  {json.dumps(mint)}", flush=True)
            common.warn_if_loaded("mint", mint)
    summary = {
        "benchmark": "terminate",
        "parameters": {
            "duration_s": args.duration,
            "connections": args.connections,
            "procs": args.procs,
            "repeat": args.repeat,
            "warmup_s": args.warmup,
            "loads": [
                {"key": key, "mode": mode, "connections": connections}
                for key, mode, connections in loads
            ],
        },
        "subjects": [
            {"name": row["name"], "label": row["label"], "available": True} for row in rows
        ]
        + [{"name": n, "available": False, "reason": r} for n, r in unavailable.items()],
        "loads": {key: summarize(runs[key]) for key, _, _ in loads},
        "mint": mint,
        "machine": machine,
        "elapsed_s": round(time.monotonic() - started),
    }
    print_tables(summary)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    json_out = args.json_out or common.RESULTS_DIR / f"terminate-{stamp}.json"
    common.write_json(json_out, summary)
    return 0


def summarize(by_row: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per row: the median over rounds of each figure; then the ratios the targets are about."""
    out: dict[str, Any] = {}
    for name, results in by_row.items():
        cpu = [r["proxy_cpu_us_per_req"] for r in results if "proxy_cpu_us_per_req" in r]
        out[name] = {
            "requests_per_s": common.median([r["requests_per_s"] for r in results]),
            "requests_per_s_runs": [r["requests_per_s"] for r in results],
            "p50_ms": common.median([r["latency_ms"]["p50"] for r in results]),
            "p99_ms": common.median([r["latency_ms"]["p99"] for r in results]),
            "proxy_cpu_us_per_req": common.median(cpu) if cpu else None,
            "proxy_cpu_pct": common.median([r.get("watched_cpu_pct", 0.0) for r in results])
            if cpu
            else None,
            "errors": sum(r["errors"] for r in results),
            "foreign_cpu_pct_max": max(r["foreign_cpu_pct"] for r in results),
            "runs": results,
        }
    term = out.get("ours-terminated")
    ratios: dict[str, Any] = {}
    for other, short in (("ours-opaque", "opaque"), ("mitmdump", "mitmdump")):
        if not term or other not in out:
            continue
        # End to end: what the targets are worded in (>= 0.75 opaque, >= 10 mitmdump).
        ratios[f"rps_terminated_over_{short}"] = (
            term["requests_per_s"] / out[other]["requests_per_s"]
        )
        # The same question asked of the proxy alone: the req/s ratio the two would reach if
        # the proxy's core, not the client, were the limit (its CPU per request, inverted).
        if term["proxy_cpu_us_per_req"] and out[other]["proxy_cpu_us_per_req"]:
            ratios[f"capacity_terminated_over_{short}"] = (
                out[other]["proxy_cpu_us_per_req"] / term["proxy_cpu_us_per_req"]
            )
    out["ratios"] = ratios
    return out


def print_tables(summary: dict[str, Any]) -> None:
    params = summary["parameters"]
    for load in params["loads"]:
        figures = summary["loads"][load["key"]]
        title = "keep-alive" if load["mode"] == "keepalive" else "new connection per request"
        common.header(
            f"HTTPS GET /1k, {title}: {load['connections']} connection(s), "
            f"{params['duration_s']:g} s, median of {params['repeat']}"
        )
        rows = []
        direct = figures.get("direct")
        for name in ROWS:
            if name not in figures:
                continue
            f = figures[name]
            rows.append(
                [
                    name,
                    f["requests_per_s"],
                    f["p50_ms"],
                    f["p99_ms"],
                    # Added latency: this path minus direct (meaningful at low concurrency;
                    # under a saturating load it is mostly queueing).
                    f["p50_ms"] - direct["p50_ms"] if direct and name != "direct" else None,
                    f["p99_ms"] - direct["p99_ms"] if direct and name != "direct" else None,
                    f["proxy_cpu_us_per_req"],
                    f["proxy_cpu_pct"],
                    f["errors"],
                    round(f["foreign_cpu_pct_max"]),
                ]
            )
        print(
            common.table(
                [
                    "path",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    "added p50",
                    "added p99",
                    "proxy CPU us/req",
                    "proxy CPU %",
                    "errors",
                    "others' CPU %",
                ],
                rows,
            )
        )
        ratios = figures["ratios"]
        print()
        for key, value in ratios.items():
            print(f"- {key}: {value:.2f}")
    mint = summary["mint"]
    common.header("leaf mint (bench_crew_ca.py)")
    print(
        common.table(
            ["", "p50 us", "p99 us", "others' CPU %"],
            [
                [
                    label,
                    mint[key]["p50_ms"] * 1e3,
                    mint[key]["p99_ms"] * 1e3,
                    round(mint["foreign_cpu_pct"]),
                ]
                for key, label in (
                    ("cold", "cold (new key + signature)"),
                    ("cached", "cached (LeafCache.get)"),
                )
            ],
        )
    )


if __name__ == "__main__":
    sys.exit(main())
