"""The typed admin client (appliance/ctl/client.py) and its transport against canned HTTP answers
on a real Unix socket: Content-Length and chunked bodies, lines split across chunks, errors, the
malformed answers it must refuse, the run upgrade; and `status`'s exit code for a part that is
down. The real daemon's answers are covered by test_ctl_daemon.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from appliance.ctl import exits
from appliance.ctl.client import AdminClient, AdminError, Unreachable
from appliance.ctl.session import exited_of
from appliance.daemon import framing, messages
from appliance.journal.store import Row

ROOT = Path(__file__).resolve().parent.parent


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


def _json(status: str, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status.encode(),
        len(body),
        body,
    )


def _chunked(*chunks: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body


def test_typed_request_and_answer(serve) -> None:  # type: ignore[no-untyped-def]
    body = b'{"crew":"c1","host":"a.example","changed":true}'
    client, server = serve(_json("200 OK", body))
    result = client.allow("c1", "a.example")
    assert result == messages.AllowResult("c1", "a.example", True)
    request = server.requests[0]
    assert request.startswith(b"POST /v1/crews/c1/allow HTTP/1.1\r\n")
    assert request.endswith(b'{"host":"a.example"}')


def test_an_answer_of_the_wrong_shape_is_refused(serve) -> None:  # type: ignore[no-untyped-def]
    client, _ = serve(_json("200 OK", b'{"crews":[{"name":"a"}]}'))
    with pytest.raises(Unreachable, match="unexpected answer"):
        client.crews()


def test_chunked_json_lines_split_across_chunks(serve) -> None:  # type: ignore[no-untyped-def]
    row = msgspec.json.encode(
        Row(1, 1.0, "run.started", "w", "c1", None, None, "t", "s", "{}", "00", "11")
    )
    client, server = serve(_chunked(row[:10], row[10:] + b"\n" + row[:5], row[5:] + b"\n"))
    entries = list(client.events(crew="c1", follow=True))
    assert [e.seq for e in entries] == [1, 1] and entries[0].type == "run.started"
    assert b"GET /v1/events?crew=c1&follow=1 " in server.requests[0]


def test_error_answer_becomes_admin_error(serve) -> None:  # type: ignore[no-untyped-def]
    body = b'{"error":"not_found","message":"no crew named \'x\'"}'
    client, _ = serve(_json("404 Not Found", body))
    with pytest.raises(AdminError) as caught:
        client.crew("x")
    assert caught.value.status == 404 and caught.value.error == "not_found"
    assert exits.for_status(caught.value.status) == exits.NOT_FOUND


@pytest.mark.parametrize(
    "answer",
    [
        b"garbage\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n{}",  # neither Content-Length nor chunked
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}",  # closed inside the body
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
)
def test_malformed_answers_are_refused(serve, answer: bytes) -> None:  # type: ignore[no-untyped-def]
    client, _ = serve(answer)
    with pytest.raises(Unreachable):
        client.status()


def test_nothing_listening(tmp_path: Path) -> None:
    with pytest.raises(Unreachable, match="not answering"):
        AdminClient(str(tmp_path / "none.sock")).status()


def test_run_upgrades_and_reads_frames(serve) -> None:  # type: ignore[no-untyped-def]
    frames = (
        framing.frame(framing.STDOUT, b"hel")
        + framing.frame(framing.STDOUT, b"lo\n")
        + framing.frame(framing.EXIT, b'{"exit_code":7,"timed_out":false}')
    )
    answer = (
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: appliance-run/1\r\n"
        b"connection: Upgrade\r\n\r\n" + frames
    )
    client, server = serve(answer)
    session = client.run("c1", ["sh", "-c", "x"])
    try:
        got = list(session.frames())
    finally:
        session.close()
    assert got[:2] == [(framing.STDOUT, b"hel"), (framing.STDOUT, b"lo\n")]
    assert got[2][0] == framing.EXIT and exited_of(got[2][1]).exit_code == 7
    request = server.requests[0]
    assert b"Upgrade: appliance-run/1\r\n" in request
    assert json.loads(request.partition(b"\r\n\r\n")[2])["argv"] == ["sh", "-c", "x"]


def _status(health: tuple[messages.PartHealth, ...]) -> bytes:
    status = messages.Status(
        pid=1, state_dir="/s", admin_socket="/a", provider="docker", isolated=True,
        runtimes=("runc",), proxy_pid=2, proxy_alive=True, proxy_restarts=0, proxy_port=9119,
        crews=0, crews_ready=0, started=0.0, reconcile=(), health=health,
    )  # fmt: skip
    return messages.encoder.encode(status)


@pytest.mark.parametrize(
    ("health", "code"),
    [
        ((messages.PartHealth("proxy", True, "up"),), exits.OK),
        ((messages.PartHealth("engine", False, "no answer within 3 s"),), exits.DEGRADED),
    ],
)
def test_status_exit_code_follows_health(tmp_path: Path, health: tuple, code: int) -> None:  # type: ignore[type-arg]
    path = tmp_path / "admin.sock"
    server = CannedServer(path, _json("200 OK", _status(health)))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "appliance.cli", "--socket", str(path), "status"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
    finally:
        server.close()
    assert done.returncode == code, done
    if code == exits.DEGRADED:
        assert "DEGRADED: engine down (no answer within 3 s)" in done.stdout


def test_messages_mirror_the_journal_and_netns_types() -> None:
    """The client decodes the journal's and the network report's answers into messages.py's
    own types (it imports neither package): field for field the same."""
    from appliance.journal import store
    from appliance.journal.verify import CheckpointInfo, VerifyReport
    from netns import manager

    def fields(kind: type) -> list[str]:
        import dataclasses

        if dataclasses.is_dataclass(kind):
            return [f.name for f in dataclasses.fields(kind)]
        return list(kind.__struct_fields__)  # type: ignore[attr-defined]

    assert fields(messages.JournalEntry) == fields(store.Row)
    assert fields(messages.JournalVerify) == fields(VerifyReport)
    assert fields(messages.JournalCheckpoint) == fields(CheckpointInfo)
    assert fields(messages.NetReport) == fields(manager.NetworkReport)
    assert fields(messages.NetCrew) == fields(manager.CrewStatus)
