"""Time to last byte of a streamed model answer through our proxy, with and without the SSE layer.

Theory of operation
-------------------
An upstream in this process (loopback, core 1) serves one Anthropic Messages stream: `--events`
`content_block_delta` events of 1 to 7 bytes of text each (about 150 bytes per event, as the real
API sends them), written as fast as the socket takes them, in chunked framing. The same bytes
are served with `content-type: text/event-stream` (the proxy runs the SSE layer: per-channel
scrubbing of the concatenated deltas, events parsed and checked) and with `text/plain` (the
byte scrubber only, as before the SSE layer existed). A client fetches it through our proxy
(pinned to core 0) on a fresh connection and stops the clock at the body's last byte. The two
variants alternate, `--repeat` times each; the figure is the ratio of the medians. Unpaced, this
is the worst case: a real model paces its events (tens of milliseconds apart), and the layer's
cost then hides in the gaps; `--pace-ms` writes one event at a time that far apart.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


def anthropic_stream(events: int) -> bytes:
    text = "The quick brown fox jumps over the lazy dog, and then some more words. " * 200
    out = bytearray()
    at, size = 0, 1
    for _ in range(events):
        piece = text[at % len(text) : at % len(text) + size]
        at += size
        size = size % 7 + 1
        data = {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": piece},
        }
        out += b"event: content_block_delta\ndata: %s\n\n" % json.dumps(data).encode()
    out += b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    out += b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    return bytes(out)


def serve(body: bytes, pace: float) -> ThreadingHTTPServer:
    """Unpaced: the body in 4 KiB chunks at once. Paced: one event per write, `pace` s apart."""
    if pace:
        pieces = [event + b"\n\n" for event in body.split(b"\n\n") if event]
    else:
        pieces = [body[i : i + 4096] for i in range(0, len(body), 4096)]
    framed = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces] + [b"0\r\n\r\n"]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            kind = "text/event-stream" if self.path.startswith("/sse") else "text/plain"
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            if not pace:
                self.wfile.write(b"".join(framed))
            for piece in framed if pace else ():
                self.wfile.write(piece)
                self.wfile.flush()
                time.sleep(pace)
            self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def fetch(proxy: common.Service, port: int, path: str) -> tuple[float, int]:
    authority = f"{common.UPSTREAM_HOST}:{port}"
    request = (
        f"GET http://{authority}{path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    ).encode()
    start = time.perf_counter()
    size = 0
    with socket.create_connection((proxy.host, proxy.port), timeout=60) as sock:
        sock.sendall(request)
        while chunk := sock.recv(1 << 16):
            size += len(chunk)
    return time.perf_counter() - start, size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--pace-ms", type=float, default=0.0, help="between events (0: unpaced)")
    args = parser.parse_args()
    body = anthropic_stream(args.events)
    server = serve(body, args.pace_ms / 1000)
    port = server.server_address[1]
    with common.Workspace(prefix="bench-sse-") as ws:
        proxy = common.start_ours(ws)
        for path in ("/sse", "/plain"):  # warm up both paths
            fetch(proxy, port, path)
        times: dict[str, list[float]] = {"/sse": [], "/plain": []}
        for _ in range(args.repeat):
            for path in times:
                elapsed, size = fetch(proxy, port, path)
                assert size > len(body), (path, size)
                times[path].append(elapsed)
    server.shutdown()
    sse, plain = statistics.median(times["/sse"]), statistics.median(times["/plain"])
    result = {
        "events": args.events,
        "pace_ms": args.pace_ms,
        "body_bytes": len(body),
        "repeat": args.repeat,
        "ttlb_sse_ms": round(sse * 1000, 2),
        "ttlb_byte_scrubber_only_ms": round(plain * 1000, 2),
        "sse_over_plain": round(sse / plain, 3),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
