"""Bulk-transfer endpoints for bench_connect.py: a source that writes N bytes of zeros, a sink.

`sink` accepts connections one after another (a probe that sends nothing is ignored); each starts
with an 8-byte big-endian length N, and once N more bytes have arrived the sink answers with the
count and a newline. `source` connects (directly, or through a proxy with CONNECT), starts the
clock once the path is open, writes the length and N bytes, and stops the clock when the sink's
count arrives: end to end, the last byte has reached the sink. The length prefix (rather than a
half-close) is there because squid closes a whole tunnel when one side half-closes. Prints one
JSON object. Loopback only, and bounded by --timeout.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

BUFFER = 1 << 20


def loopback(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host.startswith("127."):
        raise SystemExit(f"{address}: only loopback addresses are allowed")
    return host, int(port)


def serve_sink(args: argparse.Namespace) -> int:
    host, port = loopback(args.listen)
    buffer = bytearray(BUFFER)
    view = memoryview(buffer)
    with socket.create_server((host, port), reuse_port=False) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                prefix = b""
                while len(prefix) < 8 and (chunk := conn.recv(8 - len(prefix))):
                    prefix += chunk
                if len(prefix) < 8:
                    continue  # a readiness probe
                expected = int.from_bytes(prefix, "big")
                received = 0
                while received < expected:
                    count = conn.recv_into(view[: min(BUFFER, expected - received)])
                    if not count:
                        break
                    received += count
                conn.sendall(f"{received}\n".encode())
                print(json.dumps({"received": received}), flush=True)


def open_path(args: argparse.Namespace) -> socket.socket:
    if args.proxy:
        sock = socket.create_connection(loopback(args.proxy), timeout=args.timeout)
        target = args.target
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = bytearray()
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)  # nothing past the head may be consumed
            if not chunk:
                raise SystemExit("the proxy closed the connection instead of opening a tunnel")
            head += chunk
        status = bytes(head).split(b" ", 2)[1]
        if status != b"200":
            raise SystemExit(f"CONNECT refused: {bytes(head).splitlines()[0]!r}")
        return sock
    return socket.create_connection(loopback(args.target), timeout=args.timeout)


def run_source(args: argparse.Namespace) -> int:
    zeros = memoryview(bytes(BUFFER))
    sock = open_path(args)
    deadline = time.monotonic() + args.timeout
    with sock:
        started = time.perf_counter()
        sock.sendall(args.bytes.to_bytes(8, "big"))
        remaining = args.bytes
        while remaining > 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out with {args.bytes - remaining} of {args.bytes} sent")
            step = min(remaining, BUFFER)
            sock.sendall(zeros[:step])
            remaining -= step
        answer = bytearray()
        while not answer.endswith(b"\n"):
            chunk = sock.recv(64)
            if not chunk:
                raise SystemExit("the path closed before the sink answered")
            answer += chunk
        elapsed = time.perf_counter() - started
    received = int(answer)
    if received != args.bytes:
        raise SystemExit(f"the sink received {received} bytes, {args.bytes} were sent")
    print(
        json.dumps(
            {
                "bytes": args.bytes,
                "seconds": elapsed,
                "gb_per_s": args.bytes / elapsed / 1e9,
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sink = commands.add_parser("sink", help="read each connection to EOF, answer the count")
    sink.add_argument("--listen", required=True, help="127.x.y.z:PORT")
    source = commands.add_parser("source", help="write N bytes of zeros, time it end to end")
    source.add_argument("--target", required=True, help="HOST:PORT of the sink (or CONNECT target)")
    source.add_argument("--proxy", help="127.x.y.z:PORT of a proxy to CONNECT through")
    source.add_argument("--bytes", type=int, required=True)
    source.add_argument("--timeout", type=float, default=300.0, help="bound on the run (300 s)")
    args = parser.parse_args(argv)
    return serve_sink(args) if args.command == "sink" else run_source(args)


if __name__ == "__main__":
    sys.exit(main())
