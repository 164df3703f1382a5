"""A fixed-rate HTTP/1.1 client that measures per-request latency (wrk2 is not available here).

Theory of operation: the client is open-loop. Request i of connection k is due at
`start + k * period / connections + i * period` (period = connections / rate), whatever happened
to earlier requests, and its latency is counted from that due time to the last byte of its
response. A server that stalls therefore pays for every request queued behind the stall (the
"coordinated omission" correction of wrk2), instead of the client quietly slowing down.
Each connection is one thread with a blocking socket: `time.sleep` wakes it to within tens of
microseconds, and the same slack is in every target's figures, so it cancels in "proxy minus
direct". A server that closes the connection (tinyproxy does, after every response) is
reconnected before the next request, and that connect counts in the latency.

Prints one JSON object: counts, achieved rate, latency percentiles in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ConnectionLog:
    latencies: list[float] = field(default_factory=list)
    late: int = 0  # sent more than 1 ms after its due time (the previous response was slow)
    errors: int = 0
    connects: int = 0
    bad_status: int = 0
    not_sent: int = 0


class ResponseReader:
    """Reads one HTTP/1.1 response (Content-Length or chunked) from a blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.received = False  # any byte of a response yet (then a retry is not safe)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by peer")
        self.received = True
        self.buffer += chunk

    def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def _exactly(self, size: int) -> None:
        while len(self.buffer) < size:
            self._fill()
        del self.buffer[:size]

    def read(self) -> tuple[int, bool]:
        """Returns (status, keep_alive)."""
        self.received = bool(self.buffer)
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            self._fill()
        head = bytes(self.buffer[:end]).split(b"\r\n")
        del self.buffer[: end + 4]
        status = int(head[0].split(b" ", 2)[1])
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        keep_alive = headers.get(b"connection") != b"close" and head[0].startswith(b"HTTP/1.1")
        if headers.get(b"transfer-encoding") == b"chunked":
            while True:
                size = int(self._line().split(b";")[0], 16)
                if size == 0:
                    while self._line():
                        pass
                    break
                self._exactly(size + 2)
        else:
            self._exactly(int(headers.get(b"content-length", b"0")))
        return status, keep_alive


def dropped(sock: socket.socket) -> bool:
    """True if the peer has closed an idle kept-alive connection (a pending EOF or reset)."""
    timeout = sock.gettimeout()
    # With a timeout set, Python polls before recv even with MSG_DONTWAIT: go non-blocking.
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


def run_connection(
    index: int,
    args: argparse.Namespace,
    request: bytes,
    start: float,
    end: float,
    log: ConnectionLog,
) -> None:
    host, port = args.connect.rsplit(":", 1)
    period = args.connections / args.rate
    due = start + index * period / args.connections
    sock: socket.socket | None = None
    reader: ResponseReader | None = None
    while due < end:
        if time.perf_counter() > end + 1.0:
            # The target cannot keep up: stop (the run is bounded) and count what was not sent.
            log.not_sent += int((end - due) / period) + 1
            break
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        elif delay < -0.001:
            log.late += 1
        try:
            if sock is not None and dropped(sock):
                sock.close()
                sock = None
            for attempt in (1, 2):
                if sock is None:
                    sock = socket.create_connection((host, int(port)), timeout=10)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    reader = ResponseReader(sock)
                    log.connects += 1
                assert reader is not None
                try:
                    sock.sendall(request)
                    status, keep_alive = reader.read()
                    break
                except ConnectionError:
                    # A kept-alive connection the server closed under us: retry once on a new
                    # one, as clients do for an idempotent request (RFC 9110 section 9.2.2).
                    sock.close()
                    sock = None
                    if attempt == 2 or reader.received:
                        raise
            log.latencies.append(time.perf_counter() - due)
            if status != 200:
                log.bad_status += 1
            if not keep_alive:
                sock.close()
                sock = None
        except OSError:
            log.errors += 1
            if sock is not None:
                sock.close()
            sock = None
        due += period
    if sock is not None:
        sock.close()


def percentile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    rank = min(len(ordered) - 1, max(0, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connect", required=True, help="HOST:PORT to connect to (loopback)")
    parser.add_argument("--uri", default="/1k", help="request target (absolute-form via a proxy)")
    parser.add_argument("--host-header", required=True, help="value of the Host header")
    parser.add_argument("--rate", type=float, default=2000.0, help="requests per second in all")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds (bounded)")
    parser.add_argument("--connections", type=int, default=4, help="keep-alive connections")
    args = parser.parse_args(argv)
    if not args.connect.startswith("127.") and not args.connect.startswith("localhost:"):
        parser.error("--connect must be a loopback address")
    sys.setswitchinterval(0.0005)  # a thread woken by recv waits less for the GIL
    request = f"GET {args.uri} HTTP/1.1\r\nHost: {args.host_header}\r\n\r\n".encode()
    logs = [ConnectionLog() for _ in range(args.connections)]
    start = time.perf_counter() + 0.1
    end = start + args.duration
    threads = [
        threading.Thread(target=run_connection, args=(i, args, request, start, end, logs[i]))
        for i in range(args.connections)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    latencies = sorted(x for log in logs for x in log.latencies)
    ms = {
        f"p{q:g}".replace(".", "_"): round(percentile(latencies, q) * 1e3, 3)
        for q in (50, 90, 99, 99.9)
    }
    ms["max"] = round(latencies[-1] * 1e3, 3) if latencies else float("nan")
    result = {
        "target_rate": args.rate,
        "achieved_rate": round(len(latencies) / elapsed, 1),
        "completed": len(latencies),
        "late_sends": sum(log.late for log in logs),
        "not_sent": sum(log.not_sent for log in logs),
        "errors": sum(log.errors for log in logs),
        "non_200": sum(log.bad_status for log in logs),
        "connects": sum(log.connects for log in logs),
        "latency_ms": ms,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
