"""HTTPS load through an HTTP proxy's CONNECT (or straight to the origin): closed loop, timed.

Each connection: TCP to the proxy, `CONNECT name:port`, then TLS to `name` (SNI and certificate
check against `--cafile`), then `GET /path` with HTTP/1.1. Two modes:
- keep-alive: CONNECT and handshake once per connection, then requests back to back on it;
- new connections: CONNECT + handshake + one request + close, again and again. A request's
  latency then includes the TCP connect, the CONNECT and both TLS legs' handshakes.

`--connections` are spread over `--procs` processes (asyncio, one loop each), so one GIL does not
cap the client; pin the whole thing with taskset. Only requests that finish inside `--duration`
count. Prints one JSON object: requests, errors (with the first few messages), req/s, and the
latency quantiles in ms. `--connect-to HOST:PORT` overrides where the TCP goes and what the
CONNECT names (mitmdump gets `CONNECT 127.0.0.1:PORT`, the TLS still names `--name`).

    python bench/tls_load.py --proxy 127.0.0.1:3128 --name term.test --port 8443 \\
        --cafile ca.pem --mode keepalive --connections 16 --procs 2 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import subprocess
import sys
import time
from typing import Any

MAX_ERROR_MESSAGES = 5


class Failed(Exception):
    pass


async def _head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200") and not head.startswith(b"HTTP/1.0 200"):
        status_line = head.split(b"\r\n", 1)[0]
        raise Failed(f"status line {status_line!r}")
    return head


async def _open(
    args: argparse.Namespace, context: ssl.SSLContext
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if args.proxy:
        host, port = args.proxy.rsplit(":", 1)
    else:
        host, port = args.direct.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    if args.proxy:
        target = args.connect_to or f"{args.name}:{args.port}"
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        await _head(reader)
    await writer.start_tls(context, server_hostname=args.name)
    return reader, writer


async def _request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> None:
    writer.write(request)
    head = await _head(reader)
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    if length is None:
        raise Failed("no content-length in the response")
    await reader.readexactly(length)


async def _connection(
    args: argparse.Namespace,
    context: ssl.SSLContext,
    deadline: float,
    latencies: list[float],
    errors: list[str],
) -> None:
    request = (
        f"GET {args.path} HTTP/1.1\r\nHost: {args.name}:{args.port}\r\nUser-Agent: tls_load\r\n"
        + ("Connection: close\r\n" if args.mode == "new" else "")
        + "\r\n"
    ).encode()
    writer: asyncio.StreamWriter | None = None
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            if writer is None:
                reader, writer = await _open(args, context)
            await _request(reader, writer, request)
        except (
            OSError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ssl.SSLError,
            Failed,
        ) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            if writer is not None:
                writer.transport.abort()
                writer = None
            await asyncio.sleep(0.01)  # no hot loop against a proxy that refuses
            continue
        done = time.monotonic()
        if done <= deadline:
            latencies.append(done - started)
        if args.mode == "new":
            # An abort, not a TLS close_notify exchange: the server side sees the close at once
            # and the client spends no round trip on it (as wrk does with plain HTTP).
            writer.transport.abort()
            writer = None
    if writer is not None:
        writer.transport.abort()


async def _worker(args: argparse.Namespace) -> dict[str, Any]:
    context = ssl.create_default_context(cafile=args.cafile)
    context.set_alpn_protocols(["http/1.1"])
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + args.duration
    await asyncio.gather(
        *(_connection(args, context, deadline, latencies, errors) for _ in range(args.connections))
    )
    return {
        "latencies_us": [round(value * 1e6) for value in latencies],
        "errors": len(errors),
        "error_messages": sorted(set(errors))[:MAX_ERROR_MESSAGES],
    }


def _quantile(ordered: list[int], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--proxy", help="HOST:PORT of the proxy (CONNECT)")
    where.add_argument("--direct", help="HOST:PORT of the origin itself (no proxy)")
    parser.add_argument("--name", required=True, help="the origin's name: SNI and certificate")
    parser.add_argument("--port", type=int, required=True, help="the origin's port")
    parser.add_argument("--connect-to", default="", help="CONNECT this HOST:PORT instead")
    parser.add_argument("--cafile", required=True, help="the CA the client trusts (PEM)")
    parser.add_argument("--path", default="/1k")
    parser.add_argument("--mode", choices=("keepalive", "new"), default="keepalive")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(asyncio.run(_worker(args))))
        return 0
    # The children: the same command, each with its share of the connections.
    procs = []
    shares = [
        args.connections // args.procs + (1 if i < args.connections % args.procs else 0)
        for i in range(args.procs)
    ]
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    started = time.monotonic()
    for share in shares:
        if share == 0:
            continue
        child = [
            sys.executable,
            os.path.abspath(__file__),
            *base,
            "--worker",
            "--connections",
            str(share),
            "--procs",
            "1",
        ]
        procs.append(subprocess.Popen(child, stdout=subprocess.PIPE))
    latencies: list[int] = []
    errors = 0
    messages: list[str] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=args.duration + 60)
        if proc.returncode != 0:
            raise SystemExit(f"a load process exited with {proc.returncode}")
        result = json.loads(out)
        latencies += result["latencies_us"]
        errors += result["errors"]
        messages += result["error_messages"]
    elapsed = time.monotonic() - started
    latencies.sort()
    print(
        json.dumps(
            {
                "mode": args.mode,
                "connections": args.connections,
                "procs": len(procs),
                "duration_s": args.duration,
                "requests": len(latencies),
                "requests_per_s": len(latencies) / args.duration,
                "errors": errors,
                "error_messages": sorted(set(messages))[:MAX_ERROR_MESSAGES],
                "latency_ms": {
                    "p50": _quantile(latencies, 0.50),
                    "p90": _quantile(latencies, 0.90),
                    "p99": _quantile(latencies, 0.99),
                },
                "wall_s": round(elapsed, 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
