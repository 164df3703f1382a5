"""A fake Ollama server on loopback that speaks the real Ollama HTTP API, for the keeper tests.

Routes, as Ollama answers them: `GET /api/version`, `GET /api/tags` (the installed models),
`POST /api/chat` and `POST /api/generate` (non-streaming; an unknown model is 404
`{"error": "model \\"NAME\\" not found, try pulling it first"}`, a body that is not JSON is 400).
A reply to `/api/chat` is the real envelope: model, created_at, message {role, content},
done_reason, done, and the duration/count fields.

Each test scripts the answer with `behaviour`, a function of the decoded request body that
returns one of: `Content(text)` (the assistant message content, in a well-formed envelope),
`Raw(bytes)` (whole response bytes written as they are: hostile framing, wrong envelopes),
`Status(code, body)`, `Slow(seconds, then)` (sleep before answering) or `Hang()` (accept, read,
never answer). Every request is recorded so a test can show what the client sent.

Built on the standard library (threads), so it shares no code with the trio/h11 client.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "llama3.2:3b"


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Raw:
    data: bytes


@dataclass(frozen=True)
class Status:
    code: int
    body: bytes = b'{"error": "internal error"}'


@dataclass(frozen=True)
class Slow:
    seconds: float
    then: Content | Raw | Status


@dataclass(frozen=True)
class Hang:
    pass


Answer = Content | Raw | Status | Slow | Hang
Behaviour = Callable[[dict[str, Any]], Answer]


def allow(_: dict[str, Any]) -> Answer:
    return Content('{"decision": "ALLOW", "reason": "matches the intent", "risk": "low"}')


@dataclass
class FakeOllama:
    port: int
    behaviour: Behaviour = allow
    requests: list[tuple[str, str, dict[str, Any] | None]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _envelope(content: str, model: str) -> bytes:
    return json.dumps(
        {
            "model": model,
            "created_at": "2026-11-22T06:00:00.000000Z",
            "message": {"role": "assistant", "content": content},
            "done_reason": "stop",
            "done": True,
            "total_duration": 812345678,
            "load_duration": 1234567,
            "prompt_eval_count": 321,
            "prompt_eval_duration": 123456789,
            "eval_count": 24,
            "eval_duration": 98765432,
        }
    ).encode()


def _handler(fake: FakeOllama) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            fake.requests.append(("GET", self.path, None))
            if self.path == "/api/version":
                self._send(200, b'{"version": "0.5.7"}')
            elif self.path == "/api/tags":
                self._send(200, json.dumps({"models": [{"name": MODEL, "model": MODEL}]}).encode())
            else:
                self._send(404, b"404 page not found")

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            try:
                body = json.loads(raw)
            except ValueError:
                fake.requests.append(("POST", self.path, None))
                self._send(400, b'{"error": "invalid character in request body"}')
                return
            fake.requests.append(("POST", self.path, body))
            if self.path not in ("/api/chat", "/api/generate"):
                self._send(404, b"404 page not found")
                return
            if body.get("model") != MODEL:
                error = {"error": f'model "{body.get("model")}" not found, try pulling it first'}
                self._send(404, json.dumps(error).encode())
                return
            self._answer(fake.behaviour(body), body)

        def _answer(self, answer: Answer, body: dict[str, Any]) -> None:
            if isinstance(answer, Slow):
                time.sleep(answer.seconds)
                answer = answer.then
            if isinstance(answer, Hang):
                fake.release.wait(30)
                return
            if isinstance(answer, Raw):
                self.wfile.write(answer.data)
                self.close_connection = True
                return
            if isinstance(answer, Status):
                self._send(answer.code, answer.body)
                return
            if self.path == "/api/generate":
                generated = {"model": MODEL, "response": answer.text, "done": True}
                self._send(200, json.dumps(generated).encode())
                return
            self._send(200, _envelope(answer.text, MODEL))

    return Handler


@contextmanager
def running_fake_ollama() -> Iterator[FakeOllama]:
    fake = FakeOllama(port=0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    server.daemon_threads = True
    fake.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield fake
    finally:
        fake.release.set()
        server.shutdown()
        server.server_close()
        thread.join()
