"""A crew's legitimate traffic: a fixed-rate stream of requests through the proxy, measured.

Run inside the crew's namespace (`ip netns exec CREW python tests/chaos_client.py ...`) by the
chaos suite and by bench/bench_under_attack.py. It prints "ready", then sends requests until
its standard input closes (the attack is over), `--max-seconds` have passed or `--max-requests`
were due, whichever comes first; then it prints one JSON object and exits.

Theory of operation: open loop, as bench/fixed_rate.py. Request i is due at start + i / rate,
whatever happened to earlier ones, and its latency runs from that due time to the last byte of
its response, so a stalled proxy pays for every request queued behind the stall. The requests
alternate between `--keepalive` threads, each holding one kept-alive connection (reconnected
if the proxy closes it), and `--fresh` threads that open a new connection per request (these
go through the workers' accept path, where a starved worker shows first). Each request's
target is `--url` with "{i}" replaced by its index (distinct names defeat every cache).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field


class ResponseReader:
    """One HTTP/1.1 response (Content-Length, chunked or no body) from a blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the proxy")
        self.buffer += chunk

    def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def _skip(self, size: int) -> None:
        while len(self.buffer) < size:
            self._fill()
        del self.buffer[:size]

    def read(self) -> tuple[int, bool]:
        """(status, keep_alive)"""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            self._fill()
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        del self.buffer[: end + 4]
        status = int(lines[0].split(b" ", 2)[1])
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip().lower()
        keep_alive = fields.get(b"connection") != b"close"
        if fields.get(b"transfer-encoding") == b"chunked":
            while (size := int(self._line().split(b";")[0], 16)) != 0:
                self._skip(size + 2)
            while self._line():
                pass
        else:
            self._skip(int(fields.get(b"content-length", b"0")))
        return status, keep_alive


@dataclass
class Log:
    latencies: list[float] = field(default_factory=list)
    sent: int = 0  # request heads written whole: each must reach the journal
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_thread(
    args: argparse.Namespace,
    fresh: bool,
    due_times: list[float],
    stop: threading.Event,
    log: Log,
) -> None:
    host, port = args.proxy.rsplit(":", 1)
    sock: socket.socket | None = None
    reader: ResponseReader | None = None
    for index, due in due_times:
        if stop.is_set():
            break
        delay = due - time.perf_counter()
        if delay > 0 and stop.wait(delay):
            break
        url = args.url.replace("{i}", str(index))
        authority = url.split("://", 1)[1].split("/", 1)[0]
        request = (
            f"GET {url} HTTP/1.1\r\nHost: {authority}\r\n"
            + ("Connection: close\r\n" if fresh else "")
            + "\r\n"
        ).encode()
        written = False
        try:
            if sock is None:
                sock = socket.create_connection((host, int(port)), timeout=args.timeout)
                reader = ResponseReader(sock)
            assert reader is not None
            sock.sendall(request)
            written = True
            with log.lock:
                log.sent += 1
            status, keep_alive = reader.read()
            latency = time.perf_counter() - due
            with log.lock:
                log.latencies.append(latency)
                if status == 200:
                    log.ok += 1
                else:
                    log.failures.append(f"request {index}: status {status}")
            if fresh or not keep_alive:
                sock.close()
                sock = None
        except (OSError, ValueError, IndexError) as exc:
            with log.lock:
                log.failures.append(
                    f"request {index} ({'sent' if written else 'not sent'}): "
                    f"{type(exc).__name__}: {exc}"
                )
            if sock is not None:
                sock.close()
            sock = None
    if sock is not None:
        sock.close()


def percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    rank = min(len(ordered) - 1, max(0, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", required=True, help="the crew's gateway HOST:PORT")
    parser.add_argument("--url", required=True, help='absolute-form target; "{i}" = index')
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second in all")
    parser.add_argument("--keepalive", type=int, default=1, help="kept-alive threads")
    parser.add_argument("--fresh", type=int, default=1, help="connection-per-request threads")
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=10.0, help="per socket operation")
    args = parser.parse_args(argv)
    threads_count = args.keepalive + args.fresh
    total = int(args.rate * args.max_seconds)
    stop = threading.Event()
    log = Log()
    start = time.perf_counter() + 0.05
    schedule: list[list[tuple[int, float]]] = [[] for _ in range(threads_count)]
    for index in range(total):
        schedule[index % threads_count].append((index, start + index / args.rate))
    threads = [
        threading.Thread(
            target=run_thread, args=(args, n >= args.keepalive, schedule[n], stop, log)
        )
        for n in range(threads_count)
    ]
    for thread in threads:
        thread.start()
    print("ready", flush=True)

    def wait_for_stdin() -> None:
        sys.stdin.buffer.read()
        stop.set()

    threading.Thread(target=wait_for_stdin, daemon=True).start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    ordered = sorted(log.latencies)
    result = {
        "sent": log.sent,
        "ok": log.ok,
        "completed": len(ordered),
        "failures": log.failures[:20],
        "failure_count": len(log.failures),
        "seconds": round(elapsed, 3),
        "latency_ms": {
            "p50": round(percentile(ordered, 50) * 1e3, 3),
            "p99": round(percentile(ordered, 99) * 1e3, 3),
            "max": round(ordered[-1] * 1e3, 3) if ordered else float("nan"),
        },
        "latencies_ms": [round(x * 1e3, 3) for x in log.latencies],
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
