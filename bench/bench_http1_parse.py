"""The HTTP/1.1 head parser alone, per call: the hot path of every forwarded request.

A typical agent request head (408 bytes, 11 fields: an SDK's POST to a Messages API) and a
typical response head, through the C scanner (`parse_*_head`), the Python reference the scanner
defers to, and the field relay (`relay_fields`) with the request and response drop sets. Each
figure is the best of --repeat timings of --number calls, in ns per call: the best, not the
mean, because a shared machine only ever adds time.

Compare two trees by running this script under each (the import follows PYTHONPATH):

    PYTHONPATH=/path/to/other/tree python bench/bench_http1_parse.py
    python bench/bench_http1_parse.py
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

from proxycore.protocol import http1

REQUEST = (
    b"POST http://api.example.test/v1/messages?beta=true HTTP/1.1\r\n"
    b"Host: api.example.test\r\n"
    b"User-Agent: claude-cli/2.1.38 (external, cli)\r\n"
    b"Accept: application/json\r\n"
    b"Content-Type: application/json\r\n"
    b"Anthropic-Version: 2023-06-01\r\n"
    b"X-Api-Key: sk-agent-dummy-key-0123456789abcdef\r\n"
    b"X-Stainless-Lang: js\r\n"
    b"X-Stainless-Package-Version: 0.60.0\r\n"
    b"Accept-Encoding: gzip, deflate\r\n"
    b"Connection: keep-alive\r\n"
    b"Content-Length: 1234\r\n\r\n"
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1024\r\n"
    b"Date: Mon, 24 Nov 2026 10:00:00 GMT\r\nRequest-Id: req_0123456789\r\n"
    b"Anthropic-Ratelimit-Requests-Remaining: 49\r\nConnection: keep-alive\r\n\r\n"
)


def cases() -> dict[str, Callable[[], object]]:
    # The server's request drop set: hop-by-hop plus the fields it replaces.
    drop = http1.compile_drop(
        http1.HOP_BY_HOP | {b"host", b"content-length", b"expect", b"accept-encoding"}
    )
    parsed = http1.parse_request_head(REQUEST)
    answered = http1.parse_response_head(RESPONSE, request_method=b"POST")
    assert parsed is not None and answered is not None
    head, response = parsed[0], answered[0]
    return {
        "parse_request_head": lambda: http1.parse_request_head(REQUEST),
        "reference_parse_request_head": lambda: http1.reference_parse_request_head(REQUEST),
        "relay_fields (request)": lambda: http1.relay_fields(head, drop),
        "parse_response_head": lambda: http1.parse_response_head(RESPONSE, request_method=b"POST"),
        "relay_fields (response)": lambda: http1.relay_fields(response, http1.RESPONSE_DROP),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=200_000, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=7, help="timings; the best is kept")
    args = parser.parse_args()
    print(f"{len(REQUEST)}-byte request head, {len(RESPONSE)}-byte response head")
    for name, call in cases().items():
        best = min(timeit.repeat(call, number=args.number, repeat=args.repeat)) / args.number
        print(f"{name:30} {best * 1e9:7.0f} ns")


if __name__ == "__main__":
    main()
