"""Real servers that stand in for providers and "the internet" in the demo and the tests.

They are real TLS/HTTP servers on loopback (or inside a test's own network namespace), built on
the standard library so they share no code with the proxy under test. Each records what it
received, so a test can assert, for example, that the upstream saw the appliance's key and never
the agent's.
"""

from __future__ import annotations

import gzip
import json
import ssl
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType
from typing import Any
from urllib.parse import parse_qs, urlsplit

# The fake also runs on a bare Debian python3 (the provisioned machine of tests/test_provision.py):
# the standard library only there, so brotli is optional (`encoding=br` needs it).
brotli: ModuleType | None
try:
    import brotli  # type: ignore[no-redef,unused-ignore]
except ImportError:  # the appliance's own Python has it
    brotli = None


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, list[str]]
    body: bytes

    def header(self, name: str) -> str | None:
        values = self.headers.get(name.lower())
        return values[0] if values else None

    def all(self, name: str) -> list[str]:
        return self.headers.get(name.lower(), [])


@dataclass
class FakeServer:
    server: ThreadingHTTPServer
    thread: threading.Thread
    tls: bool
    received: list[Received] = field(default_factory=list)
    connections: int = 0

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def clear(self) -> None:
        self.received.clear()

    def last(self) -> Received:
        assert self.received, "the fake upstream received nothing"
        return self.received[-1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


SSE_EVENTS = [
    (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_fake",
                "type": "message",
                "role": "assistant",
                "model": "claude-fake",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 3, "output_tokens": 1},
            },
        },
    ),
    (
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    ),
    (
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": "Hello from the "},
        },
    ),
    (
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "text_delta", "text": "fake provider."},
        },
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": 5},
        },
    ),
    ("message_stop", {"type": "message_stop"}),
]


def anthropic_message(text: str = "Hello from the fake provider.") -> dict[str, Any]:
    return {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": "claude-fake",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 5},
    }


def openai_completion() -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "gpt-fake",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "Hello from fake OpenAI."},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            # The handshake runs here, in this connection's thread, not in the accept loop:
            # there it would serialize every client's handshake behind the slowest one.
            self.request.settimeout(10)
            self.request.do_handshake()
            self.request.settimeout(None)
        super().setup()
        self.fake.connections += 1

    def _record(self) -> bytes:
        if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
            body = self._read_chunked()
        else:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
        headers: dict[str, list[str]] = {}
        for name, value in self.headers.items():
            headers.setdefault(name.lower(), []).append(value)
        self.fake.received.append(Received(self.command, self.path, headers, body))
        return body

    def _read_chunked(self) -> bytes:
        """A chunked request body (RFC 9112 7.1.3): sizes, data, then the trailer section."""
        body = bytearray()
        while True:
            size = int(self.rfile.readline(1024).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                break
            body += self.rfile.read(size)
            self.rfile.readline(16)  # the CRLF after the data
        while self.rfile.readline(8192) not in (b"\r\n", b"\n", b""):
            pass  # trailer fields: not kept
        return bytes(body)

    def _json(self, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _sse(self, events: list[tuple[str, Any]], delay: float) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for name, data in events:
            payload = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            self.wfile.flush()
            if delay:
                time.sleep(delay)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _spell(self, how: str, key: str) -> None:
        """A model that spells the key out 1 to 7 bytes per text delta (Anthropic, OpenAI chat
        or OpenAI Responses framing), events `x-fake-eol` apart (LF by default), chunked or
        with a Content-Length (`x-fake-framing: length`)."""
        text = f"The key is {key}. Done."
        pieces, at, size = [], 0, 1
        while at < len(text):
            pieces.append(text[at : at + size])
            at += size
            size = size % 7 + 1
        if how == "spell-openai":
            chunk = {"id": "c1", "object": "chat.completion.chunk", "model": "gpt-fake"}
            events: list[tuple[str | None, Any]] = [
                (None, {**chunk, "choices": [{"index": 0, "delta": {"content": piece}}]})
                for piece in pieces
            ]
            events.append(
                (None, {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            )
            events.append((None, "[DONE]"))
        elif how == "spell-responses":
            item = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
            events = [
                ("response.output_text.delta", {"type": "response.output_text.delta", **item,
                                                "delta": piece})
                for piece in pieces
            ]  # fmt: skip
            events.append(("response.completed", {"type": "response.completed"}))
        else:
            events = [*SSE_EVENTS[:2]]
            events += [
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": {"type": "text_delta", "text": piece},
                    },
                )
                for piece in pieces
            ]
            events += list(SSE_EVENTS[4:])
        eol = {"crlf": "\r\n", "cr": "\r"}.get(self.headers.get("x-fake-eol") or "", "\n")
        raws = []
        for name, data in events:
            payload = data if isinstance(data, str) else json.dumps(data)
            event = (f"event: {name}{eol}" if name else "") + f"data: {payload}{eol}{eol}"
            raws.append(event.encode())
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        if self.headers.get("x-fake-framing") == "length":  # a body the proxy reads whole
            self.send_header("content-length", str(sum(map(len, raws))))
            self.end_headers()
            self.wfile.write(b"".join(raws))
            return
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for raw in raws:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _echo(self, query: dict[str, list[str]]) -> None:
        """`text` (+ `fill` x `repeat`) back as the body: `framing` length|chunked|close, in
        `pieces` writes `delay` seconds apart, also in an `x-echo` field with `header=1`,
        encoded with `encoding=gzip|deflate|deflate-raw|br` (labelled so; any other value is sent
        labelled with it and not encoded), or compressed but
        labelled identity with `encoding=gzip-as-identity|zlib-as-identity`. For the scrubber's
        tests: an upstream that echoes what it is given."""
        text = query.get("text", [""])[0].encode("utf-8", "surrogateescape")
        # `fill` repeated `repeat` times after `text`: bodies longer than a request line.
        text += query.get("fill", [""])[0].encode() * int(query.get("repeat", ["0"])[0])
        framing = query.get("framing", ["length"])[0]
        pieces = max(1, int(query.get("pieces", ["1"])[0]))
        delay = float(query.get("delay", ["0"])[0])
        encoding = query.get("encoding", [""])[0]
        if encoding in ("gzip", "gzip-as-identity"):
            text = gzip.compress(text)
        elif encoding in ("deflate", "zlib-as-identity"):
            text = zlib.compress(text)
        elif encoding == "br" and brotli is not None:
            text = brotli.compress(text)
        elif encoding == "deflate-raw":
            raw = zlib.compressobj(6, zlib.DEFLATED, -15)
            text = raw.compress(text) + raw.flush()
            encoding = "deflate"
        if encoding.endswith("-as-identity"):
            encoding = "identity"
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        if query.get("header") == ["1"]:
            self.send_header("x-echo", text.decode("latin-1"))
        if encoding:
            self.send_header("content-encoding", encoding)
        if framing == "length":
            self.send_header("content-length", str(len(text)))
        elif framing == "chunked":
            self.send_header("transfer-encoding", "chunked")
        else:
            self.send_header("connection", "close")
            self.close_connection = True
        self.end_headers()
        step = -(-len(text) // pieces) if text else 1
        for start in range(0, len(text), step):
            part = text[start : start + step]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part) if framing == "chunked" else part)
            self.wfile.flush()
            if delay:
                time.sleep(delay)
        if framing == "chunked":
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    def _leak_key(self, how: str) -> None:
        """A provider that echoes the key it was sent (as some do in auth errors)."""
        key = self.headers.get("x-api-key") or self.headers.get("authorization") or ""
        key = key.removeprefix("Bearer ")
        if how.startswith("spell"):
            self._spell(how, key)
        elif how == "sse":
            half = len(key) // 2
            self._sse(
                [
                    ("error", {"message": f"bad key {key[:half]}"}),
                    ("more", {"rest": key[half:] + "!"}),
                    ("error", {"message": f"key was {key}"}),
                ],
                0.05,
            )
        elif how == "header":
            self._json(401, {"error": "see header"}, {"x-echo-key": key})
        else:
            self._json(401, {"type": "error", "error": {"message": f"invalid x-api-key: {key}"}})

    def do_HEAD(self) -> None:
        self._record()
        self._json(200, {"ok": True})

    def do_GET(self) -> None:
        self._record()
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/redirect":
            self.send_response(302)
            self.send_header("location", query["to"][0])
            self.send_header("content-length", "0")
            self.end_headers()
        elif url.path == "/sse":
            count = int(query.get("n", ["5"])[0])
            delay = float(query.get("delay", ["0.2"])[0])
            self._sse([("tick", {"i": i}) for i in range(count)], delay)
        elif url.path == "/reflect":
            self._echo(query)
        elif url.path == "/size":
            size = int(query.get("n", ["1024"])[0])
            data = b"x" * size
            self.send_response(200)
            self.send_header("content-length", str(size))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(200, {"path": self.path, "host": self.headers.get("host")})

    def do_POST(self) -> None:
        body = self._record()
        url = urlsplit(self.path)
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            request = {}
        leak = self.headers.get("x-fake-leak")
        if leak:
            self._leak_key(leak)
        elif url.path.endswith("/v1/messages"):
            if request.get("stream"):
                self._sse(SSE_EVENTS, 0.0)
            else:
                self._json(200, anthropic_message())
        elif url.path.endswith("/chat/completions"):
            self._json(200, openai_completion())
        elif ":generateContent" in url.path:
            self._json(
                200,
                {
                    "candidates": [
                        {
                            "content": {
                                "parts": [{"text": "Hello from fake Gemini."}],
                                "role": "model",
                            },
                            "finishReason": "STOP",
                        }
                    ]
                },
            )
        else:
            self._json(200, {"path": self.path, "length": len(body)})

    do_PUT = do_POST
    do_DELETE = do_GET


class _Server(ThreadingHTTPServer):
    # The default backlog (5) drops the SYNs of a burst of new connections (an h2 agent's
    # many streams each dialing its own upstream connection), which then look like timeouts.
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that fails its TLS handshake, resets or times out is routine here (tests
        # attack the proxy, which passes that on); anything else is printed as before.
        if not isinstance(sys.exc_info()[1], ssl.SSLError | ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


def start_fake(
    host: str = "127.0.0.1", port: int = 0, tls_context: ssl.SSLContext | None = None
) -> FakeServer:
    handler = type("Handler", (_Handler,), {})
    server = _Server((host, port), handler)
    server.daemon_threads = True
    if tls_context is not None:
        server.socket = tls_context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    fake = FakeServer(server, thread, tls_context is not None)
    handler.fake = fake  # type: ignore[attr-defined]
    thread.start()
    return fake
