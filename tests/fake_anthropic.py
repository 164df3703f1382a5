"""A fake Anthropic Messages API for the end-to-end tests: real TLS, streaming SSE, a record of
every request, and a listening socket that may live in a network namespace the test made.

It answers what Claude Code and `curl` send, and nothing else:

- `HEAD` / `GET /api/hello`: 200 `{}` (Claude Code's reachability probe);
- `POST /v1/messages` with `"stream": true`: 200 `text/event-stream`, the Messages API's event
  sequence (`message_start`, `content_block_start`, `ping`, `content_block_delta` x2,
  `content_block_stop`, `message_delta`, `message_stop`) in chunked framing;
- `POST /v1/messages`: 200, one JSON message;
- `POST /v1/messages/count_tokens`: 200 `{"input_tokens": 12}`;
- `POST /v1/chat/completions`: 200, one OpenAI chat completion (the same fake answers for an
  OpenAI host name, so that the openai SDK has something to talk to);
- `GET /v1/echo`: 200, the request's own fields as JSON, credentials included: an upstream that
  echoes the key, so that a test can show the scrubber removes it on the way back;
- anything else: 404 in Anthropic's error shape. Every request is recorded, answered or not, so a
  test can show what a client asked for.

The reply text is `REPLY`; query strings (Claude Code sends `?beta=true`) are ignored for routing.
It is built on the standard library so that it shares no code with the proxy under test.

Why a socket bound through `netns.kernel.run_in_namespace`: setns(2) changes the namespace of the
calling thread only, so a helper thread joins the test's namespace, binds, and ends; the socket
stays in that namespace, and the server threads that accept on it need not be in it. The test
process itself never leaves the host's namespace.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

# No 8-byte run in common with the tests' keys (tests/conftest.py REAL_KEYS, which contain
# "-appliance-only-"): the scrubber redacts any 8-byte run of a key it holds (docs/scrubber.md),
# and a reply saying "appliance" comes back with it redacted.
REPLY = "Hi! The fake Anthropic API in the test namespace says hello."


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, list[str]]
    body: bytes

    def all(self, name: str) -> list[str]:
        return self.headers.get(name.lower(), [])

    @property
    def route(self) -> str:
        return urlsplit(self.path).path

    def summary(self) -> str:
        return f"{self.method} {self.path}"


class FakeAnthropic:
    """A threaded HTTPS server on a socket given to it; `requests` lists what it received."""

    def __init__(self, listener: socket.socket, tls: ssl.SSLContext) -> None:
        self.requests: list[Request] = []
        self.peers: list[str] = []  # the source address of every TCP connection, before TLS
        self._lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"fake": self})
        # bind_and_activate=False: the socket is already bound (maybe in another namespace).
        self.server = _TLSServer(listener.getsockname(), handler, bind_and_activate=False)
        self.server.socket.close()
        self.server.socket = listener
        self.server.tls = tls
        self.server.fake = self
        self.server.daemon_threads = True
        self.address: tuple[str, int] = listener.getsockname()[:2]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def messages(self) -> list[Request]:
        return [r for r in self.requests if r.route == "/v1/messages"]

    def log(self) -> str:
        return ", ".join(r.summary() for r in self.requests) or "(nothing)"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _TLSServer(ThreadingHTTPServer):
    """Accepts plain TCP, counts it, and does the TLS handshake in the connection's own thread
    (a client that connects and sends nothing must not stall the accept loop)."""

    tls: ssl.SSLContext
    fake: FakeAnthropic

    def get_request(self) -> tuple[Any, Any]:
        conn, peer = self.socket.accept()
        with self.fake._lock:
            self.fake.peers.append(str(peer[0]))
        return self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False), peer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer that connects and closes without TLS (a reachability probe) is not news; a
        # handler's own bug is, and is raised past this (it is not an OSError).
        if not isinstance(sys.exception(), OSError):
            super().handle_error(request, client_address)


def bind_listener(host: str, port: int = 0, netns_path: str | None = None) -> socket.socket:
    """A listening TCP socket on host:port, inside the namespace `netns_path` if given."""

    def bind() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
        return sock

    if netns_path is None:
        return bind()
    from netns.kernel import run_in_namespace

    fd = os.open(netns_path, os.O_RDONLY)
    try:
        return run_in_namespace(fd, bind)
    finally:
        os.close(fd)


@contextmanager
def running_fake(listener: socket.socket, tls: ssl.SSLContext) -> Iterator[FakeAnthropic]:
    fake = FakeAnthropic(listener, tls)
    try:
        yield fake
    finally:
        fake.close()


def _sse_events(model: str) -> list[tuple[str, dict[str, Any]]]:
    half = len(REPLY) // 2
    return [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_fake_e2e",
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 12, "output_tokens": 1},
                },
            },
        ),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        ("ping", {"type": "ping"}),
        *(
            (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": part},
                },
            )
            for part in (REPLY[:half], REPLY[half:])
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 12},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def _message(model: str) -> dict[str, Any]:
    return {
        "id": "msg_fake_e2e",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": REPLY}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 12},
    }


def _chat_completion(model: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake-e2e",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": REPLY},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 12, "total_tokens": 24},
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeAnthropic

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        self.request.settimeout(30)
        self.request.do_handshake()
        super().setup()

    def _record(self) -> bytes:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        headers: dict[str, list[str]] = {}
        for name, value in self.headers.items():
            headers.setdefault(name.lower(), []).append(value)
        self.fake.record(Request(self.command, self.path, headers, body))
        return body

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _not_found(self) -> None:
        self._json(
            404,
            {"type": "error", "error": {"type": "not_found_error", "message": "not in the fake"}},
        )

    def do_HEAD(self) -> None:
        self._record()
        route = urlsplit(self.path).path
        if route == "/api/hello":
            self._json(200, {})
        elif route == "/v1/echo" and self.command == "GET":
            self._json(200, {"headers": dict(self.headers.items())})
        else:
            self._not_found()

    do_GET = do_HEAD

    def do_POST(self) -> None:
        body = self._record()
        route = urlsplit(self.path).path
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            self._json(400, {"type": "error", "error": {"type": "invalid_request_error"}})
            return
        model = str(request.get("model") or "claude-fake")
        if route == "/v1/messages/count_tokens":
            self._json(200, {"input_tokens": 12})
        elif route == "/v1/messages" and request.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("cache-control", "no-cache")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for name, data in _sse_events(model):
                payload = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        elif route == "/v1/messages":
            self._json(200, _message(model))
        elif route == "/v1/chat/completions":
            self._json(200, _chat_completion(model))
        else:
            self._not_found()
