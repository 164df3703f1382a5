"""A small blocking HTTP/2 client (h2c, prior knowledge) and h2load's output, for bench_h2.py.

Theory of operation: the `h2` package's state machine on a blocking socket, one request at a
time: enough for a sanity request through each subject and for opening N connections that each
carry one request and then idle (the memory measurement). The load itself is h2load's. Nothing
here starts a process; the parsers are pure functions of h2load's text.
"""

from __future__ import annotations

import math
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions


class NotH2(Exception):
    """The server did not speak HTTP/2 after our preface; the message says what it did."""


@dataclass
class H2Session:
    """One h2c connection: the socket and its state machine."""

    sock: socket.socket
    conn: h2.connection.H2Connection

    @classmethod
    def open(cls, host: str, port: int, timeout: float = 10.0) -> H2Session:
        sock = socket.create_connection((host, port), timeout=timeout)
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        conn.initiate_connection()  # the preface (RFC 9113 section 3.4) and our SETTINGS
        sock.sendall(conn.data_to_send())
        return cls(sock, conn)

    def get(self, authority: str, path: str) -> tuple[int, int]:
        """One GET on a new stream; returns (status, body bytes). Raises NotH2 on non-h2."""
        stream_id = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "GET"),
            (":scheme", "http"),
            (":authority", authority),
            (":path", path),
        ]
        self.conn.send_headers(stream_id, headers, end_stream=True)
        self.sock.sendall(self.conn.data_to_send())
        status, body, first = 0, 0, b""
        while True:
            data = self.sock.recv(65536)
            first = first or data
            if not data:
                raise NotH2(f"connection closed; it had sent {describe_bytes(first)}")
            try:
                events = self.conn.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                raise NotH2(f"{type(exc).__name__}; it sent {describe_bytes(first)}") from None
            ended = False
            for event in events:
                if getattr(event, "stream_id", None) != stream_id:
                    if isinstance(event, h2.events.ConnectionTerminated):
                        raise NotH2(f"GOAWAY, error code {event.error_code}")
                    continue
                if isinstance(event, h2.events.ResponseReceived):
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    body += len(event.data)
                    self.conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    raise NotH2(f"stream reset, error code {event.error_code}")
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            pending = self.conn.data_to_send()
            if pending:
                self.sock.sendall(pending)
            if ended:
                return status, body

    def close(self) -> None:
        self.sock.close()


def describe_bytes(data: bytes) -> str:
    """What a server sent instead of HTTP/2: its first line if it is text, else its size."""
    if data.startswith(b"HTTP/"):
        return repr(data.split(b"\r\n", 1)[0].decode("latin-1"))
    return f"{len(data)} bytes" if data else "nothing"


def h2_get(host: str, port: int, authority: str, path: str) -> tuple[int, int]:
    session = H2Session.open(host, port)
    try:
        return session.get(authority, path)
    finally:
        session.close()


# --------------------------------------------------------------------------- h2load's output


_COUNTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored, (\d+) timeout"
)
_STATUS = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")
_RATE = re.compile(r"finished in [\d.]+\w+, ([\d.]+) req/s")
_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
_MEAN = re.compile(r"time for request:\s+(\S+)\s+(\S+)\s+(\S+)")


def _to_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not match:
        raise ValueError(f"unexpected h2load time {text!r}")
    return float(match.group(1)) * _UNITS_MS[match.group(2)]


def parse_h2load(output: str) -> dict[str, Any]:
    """The figures of h2load's summary. With -D, req/s counts the main duration only."""
    rate, counts, status = _RATE.search(output), _COUNTS.search(output), _STATUS.search(output)
    if not rate or not counts or not status:
        raise RuntimeError(f"cannot parse h2load output:\n{output}")
    names = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    result: dict[str, Any] = {"streams_per_s": float(rate.group(1))}
    result.update(zip(names, map(int, counts.groups()), strict=True))
    classes = ("2xx", "3xx", "4xx", "5xx")
    result["status"] = dict(zip(classes, map(int, status.groups()), strict=True))
    times = _MEAN.search(output)
    if times:
        result["min_ms"], result["max_ms"], result["mean_ms"] = map(_to_ms, times.groups())
    return result


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (q in 0..100)."""
    if not ordered:
        raise ValueError("no values")
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def parse_h2load_log(lines: Sequence[str]) -> dict[str, Any]:
    """Latency percentiles (ms) from h2load --log-file lines: start us, status, duration us.

    With -D and --warm-up-time, h2load logs the main duration's requests only.
    """
    durations: list[float] = []
    statuses: dict[str, int] = {}
    for line in lines:
        fields = line.split("\t")
        if len(fields) < 3:
            continue
        statuses[fields[1]] = statuses.get(fields[1], 0) + 1
        if _answered(fields[1]):
            durations.append(int(fields[2]) / 1000.0)
    durations.sort()
    # Status 0: a stream still in flight when -D ended (at most C x M of them), logged with the
    # time until the cut; neither an answer nor a latency.
    unfinished = sum(n for code, n in statuses.items() if not _answered(code))
    non_2xx = sum(n for code, n in statuses.items() if _answered(code) and code[0] != "2")
    base = {"logged": len(durations), "unfinished": unfinished, "non_2xx": non_2xx}
    if not durations:
        return {**base, "statuses": statuses}
    return {
        **base,
        "statuses": statuses,
        "p50_ms": round(percentile(durations, 50), 3),
        "p90_ms": round(percentile(durations, 90), 3),
        "p99_ms": round(percentile(durations, 99), 3),
        "max_ms": round(durations[-1], 3),
    }


def _answered(code: str) -> bool:
    return len(code) == 3 and code.isdigit()


def read_h2load_log(path: Path) -> dict[str, Any]:
    try:
        return parse_h2load_log(path.read_text().splitlines())
    finally:
        path.unlink(missing_ok=True)
