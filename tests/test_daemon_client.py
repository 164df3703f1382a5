"""appliancectl's admin client (appliance/daemon/client.py) against canned HTTP answers on a real
Unix socket: Content-Length and chunked bodies, lines split across chunks, errors, and the
malformed answers it must refuse. The real daemon's answers are covered by test_daemon_cli.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from appliance.daemon.client import AdminClient, AdminError, RunExit, RunOutput, Unreachable


class CannedServer:
    """Answers each connection with `answer` after reading the request head and body."""

    def __init__(self, path: Path, answer: bytes) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        while len(body) < int(line.split(b":")[1]):
                            body += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + body)
                conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    servers: list[CannedServer] = []

    def start(answer: bytes) -> tuple[AdminClient, CannedServer]:
        path = tmp_path / f"admin{len(servers)}.sock"
        server = CannedServer(path, answer)
        servers.append(server)
        return AdminClient(str(path), timeout=5), server

    yield start
    for server in servers:
        server.close()


def _chunked(*chunks: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body


def test_json_answer_and_request_body(serve) -> None:  # type: ignore[no-untyped-def]
    body = b'{"name":"c1","x":1}'
    client, server = serve(
        b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert client.call("POST", "/v1/crews", {"name": "c1"}) == {"name": "c1", "x": 1}
    request = server.requests[0]
    assert request.startswith(b"POST /v1/crews HTTP/1.1\r\n")
    assert b"Content-Length: 13\r\n" in request and request.endswith(b'{"name":"c1"}')


def test_content_length_body_is_read_exactly(serve) -> None:  # type: ignore[no-untyped-def]
    body = b'{"crews":[{"name":"a"}]}'
    client, _ = serve(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    assert client.call("GET", "/v1/crews") == {"crews": [{"name": "a"}]}


def test_chunked_run_stream_with_lines_split_across_chunks(serve) -> None:  # type: ignore[no-untyped-def]
    answer = _chunked(
        b'{"stream":"stdout","li',
        b'ne":"hello\\n"}\n{"stream":"stderr","line":"oops\\n"}\n',
        b'{"exit_code":7,"timed_out":false}\n',
    )
    client, server = serve(answer)
    events = list(client.run("c1", ["sh", "-c", "x"], None))
    assert [type(e) for e in events] == [RunOutput, RunOutput, RunExit]
    assert (events[0].stream, events[0].line) == ("stdout", "hello\n")  # type: ignore[union-attr]
    assert (events[1].stream, events[1].line) == ("stderr", "oops\n")  # type: ignore[union-attr]
    assert events[2].exit_code == 7 and events[2].timed_out is False  # type: ignore[union-attr]
    assert server.requests[0].endswith(b'{"argv":["sh","-c","x"],"timeout":null}')


def test_error_answer_becomes_admin_error(serve) -> None:  # type: ignore[no-untyped-def]
    body = b'{"error":"not_found","message":"no crew named \'x\'"}'
    client, _ = serve(b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    with pytest.raises(AdminError) as caught:
        client.call("GET", "/v1/crews/x")
    assert caught.value.status == 404 and caught.value.error == "not_found"
    assert "no crew named" in caught.value.message


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n{}",  # neither Content-Length nor chunked
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}",  # closed inside the body
        _chunked(b'{"stream":"stdout","line":"x","extra":1}\n'),
        _chunked(b'{"exit_code":"0"}\n'),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
)
def test_malformed_answers_are_refused(serve, answer: bytes) -> None:  # type: ignore[no-untyped-def]
    client, _ = serve(answer)
    with pytest.raises(Unreachable):
        if b"chunked" in answer:
            list(client.run("c1", ["true"], None))
        else:
            client.call("GET", "/v1/status")


def test_nothing_listening(tmp_path: Path) -> None:
    with pytest.raises(Unreachable, match="not answering"):
        AdminClient(str(tmp_path / "none.sock")).call("GET", "/v1/status")


def test_admin_commands_import_nothing_heavy(tmp_path: Path) -> None:
    """The admin commands' start-up: no msgspec, trio, docker, netns, proxycore, native,
    http.client or logging in the process (docs/benchmarks.md, crews)."""
    probe = (
        "import sys, runpy\n"
        "sys.argv = ['appliancectl', '--socket', sys.argv[1], 'status']\n"
        "try:\n"
        "    runpy.run_module('appliance.cli', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('msgspec', 'trio', 'docker', 'netns', 'proxycore', 'native', 'http.client',"
        " 'logging', 'ssl')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "none.sock")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", (done.stdout, done.stderr)
