"""Proxy workers that cannot read their own interpreter once they have dropped to UID 1002.

A worker drops its privileges after start-up; from then on the interpreter's files may be out of
its reach (a Python built under /root, as pyenv does). Anything it had not loaded by then --
a codec looked up on first use, a module imported inside a function -- failed there: a CONNECT
to `allowed.test.:443` was closed instead of refused, and a credential grant took every worker
down. Here the workers run, under applianced's real ProxyPool (the real drop to UID 1002, crews'
listeners bound by the parent, events read back), from a copy of the interpreter in a root-only
directory, on any machine, and again as the artifact's `proxy-worker` (docs/artifact.md) from a
root-only copy where no Python of the host is visible. They are driven through every refusal
class, every injection path, keeper calls, control messages and credential grant, rotation and
revocation, and then:

- the workers are the ones that started (no restart, same pids);
- no worker refused a late import (proxycore/preload.py names one on stderr) or printed a
  traceback;
- every refusal was readable: a status and a JSON body that says why.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import select
import shutil
import socket
import ssl
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import brotli
import pytest
import trustme

from appliance.crew_ca import new_ca
from appliance.daemon.errors import Unavailable
from appliance.daemon.proxy import CrewEntry, ProxyPool
from appliance.demo_upstream import FakeServer
from appliance.keeper.channel import KeeperChannel, new_token
from proxycore import control
from proxycore.protocol.keeper import Action
from tests.artifact_support import built_artifact, hidden_env, private_copy
from tests.conftest import free_port
from tests.worker_support import (
    WORKER_IDS,
    PoolThread,
    RawUpstream,
    StubKeeperService,
    as_worker_uid,
    get,
    http_exchange,
    parse_answer,
    pool_config,
    post,
    read_to_eof,
    readable,
    unreadable_interpreter,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root (the workers drop to UID 1002)"
)

GATEWAY_A, GATEWAY_B, GATEWAY_C = "127.0.0.61", "127.0.0.62", "127.0.0.63"
GRANTED = "sk-ant-api03-GRANTED-one-0123456789abcdef"
ROTATED = "sk-ant-api03-ROTATED-two-0123456789abcdef"
OAUTH = "sk-ant-oat01-GRANTED-oauth-0123456789abcdef"
OPENAI = "sk-proj-GRANTED-openai-0123456789abcdef"
GOOGLE = "AIzaSyGRANTED-google-0123456789abcdefgh"
PER_CREW = 4  # [limits] max_connections_per_crew, per worker

# CONNECT authorities of every odd form: each is refused before anything is dialled.
ODD_AUTHORITIES = [
    b"allowed.test.:443",  # trailing dot
    b"allowed.test..:443",
    b"evil.test@allowed.test:443",  # userinfo
    b"user:pass@allowed.test:443",
    b"[fe80::1%25eth0]:443",  # IPv6 zone, percent-encoded
    b"[fe80::1%eth0]:443",  # IPv6 zone, raw
    b"[::1]:443",
    b"[::ffff:127.0.0.1]:443",
    b"allowed.t\xc3\xa9st:443",  # non-ASCII (UTF-8)
    b"allowed.t\xe9st:443",  # non-ASCII (Latin-1)
    b"xn--allwed-zxa.test:443",
    b"allowed%2etest:443",  # percent
    b"%61llowed.test:443",
    b":443",  # empty host
    b"allowed.test:",  # empty port
    b"allowed.test",  # no port
    b"allowed.test:99999999999999999999999999",  # huge port
    b"allowed.test:0",
    b"allowed.test:+443",
    b"allowed.test:0x1bb",
    b"allowed.test:443:443",
    b"127.1:443",  # numeric shorthand
    b"0x7f.0.0.1:443",
    b"2130706433:443",
    b"a" * 300 + b".test:443",  # label too long
    b"allowed.test\\:443",
    b"allowed test:443",
]
# Forward (absolute-form) targets with odd authorities: refused before anything is dialled.
ODD_FORWARD = [
    b"http://allowed.test./",
    b"http://evil.test@allowed.test/",
    b"http://[fe80::1%25eth0]/",
    b"http://t\xc3\xa9st.test/",
    b"http://%61llowed.test/",
    b"http://:80/",
    b"http:///x",
    b"http://allowed.test:99999999999/",
    b"http://allowed.test:-1/",
    b"http://127.1/",
    b"http://[::1]/",
    b"https://allowed.test/",  # https needs CONNECT
]


@pytest.fixture(scope="session")
def interpreter(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    directory = tmp_path_factory.mktemp("python")
    python, env = unreadable_interpreter(directory)
    # Out of the workers' reach: UID 1002 can neither run nor read it...
    stdlib = next((directory / "lib").glob("python3*/os.py"))
    denied = as_worker_uid("cat", str(stdlib))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    # ...and root can: it is a working interpreter whose prefix is the copy.
    done = _run_as_root([python, "-c", "import sys, ssl, trio; print(sys.prefix)"], env)
    assert done.strip() == str(directory), done
    return python, env


@pytest.fixture(scope="session", params=["interpreter", "artifact"])
def worker_command(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[str], dict[str, str] | None]:
    """The workers' command line and environment: `-m proxycore.worker` from the unreadable
    interpreter, or the artifact's `proxy-worker` (docs/artifact.md) from a root-only copy, where
    no Python of the host is visible (tests/artifact_support.py)."""
    if request.param == "interpreter":
        python, env = request.getfixturevalue("interpreter")
        return [python, "-m", "proxycore.worker"], env
    app = private_copy(built_artifact(), tmp_path_factory.mktemp("artifact"))
    denied = as_worker_uid("cat", str(app / "agent-appliance"))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    return hidden_env(str(app / "agent-appliance"), "proxy-worker"), None


def _run_as_root(argv: list[str], env: dict[str, str]) -> str:
    import subprocess

    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def keeper_dir() -> Iterator[Path]:
    # Reachable by UID 1002 (pytest's own temporary directories are root's 0700).
    directory = Path(tempfile.mkdtemp(prefix="worker-keeper-", dir="/tmp"))
    os.chmod(directory, 0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_workers_serve_every_path_without_reading_their_interpreter(
    worker_command: tuple[list[str], dict[str, str] | None],
    tmp_path: Path,
    keeper_dir: Path,
    provider: FakeServer,
    plain_host: FakeServer,
    ca: trustme.CA,
    ca_file: str,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The workers' lines become applianced's log records (appliance/logs.py WorkerLog).
    caplog.set_level(logging.INFO)
    command, env = worker_command
    bad = RawUpstream(b"HTTP/1.1 2x0 Nope\r\nContent-Length: 0\r\n\r\n")
    silent = RawUpstream(None)
    closed = free_port()  # nothing listens there
    port = free_port()
    ports = {"bad": bad.port, "silent": silent.port, "closed": closed}
    config = pool_config(port, provider.port, ca_file, ports, per_crew=PER_CREW)
    pool = ProxyPool(
        config, tmp_path, port, workers=2, drop_to=WORKER_IDS, command=command, env=env
    )
    credentials: dict[str, dict[str, str]] = {}
    pool.credentials_source = lambda: credentials
    service = StubKeeperService()
    keeper = KeeperChannel(
        service,  # type: ignore[arg-type]
        keeper_dir / "keeper" / "keeper.sock",
        new_token(),
        lambda pid, uid, gid: pid in pool.pids and (uid, gid) == WORKER_IDS,
    )
    pool.keeper_channel = control.KeeperChannelSet(path=str(keeper.path), token=keeper.token)
    runner = PoolThread(pool, keeper).start()
    try:
        # Not allowed.test: whatever an odd authority normalizes to, nothing is dialled.
        allow = ("plain.test", "bad.test", "silent.test", "closed.test")
        allow += ("metadata.test", "private.test", "localhost")
        # The test upstreams listen on this host's loopback: the crews name it (docs/proxy.md).
        loopback = ("127.0.0.0/8",)
        runner.call(pool.add_crew, CrewEntry("alpha", GATEWAY_A, "restricted", allow, loopback))
        runner.call(
            pool.add_crew, CrewEntry("beta", GATEWAY_B, "restricted", ("plain.test",), loopback)
        )
        pids = pool.pids
        assert len(pids) == 2
        for pid in pids:
            assert Path(f"/proc/{pid}/status").read_text().count("1002") >= 8

        a, b = (GATEWAY_A, port), (GATEWAY_B, port)
        _odd_authorities(a)
        _policy_and_ssrf(a, plain_host.port)
        _local_api_and_keeper(a, service)
        _http_limits(a, plain_host.port)
        _upstream_failures(a, plain_host.port, ports)
        _overload_and_audit(runner, pool, b)
        _tunnels(a, provider, plain_host, ca)
        _terminated_tunnels(runner, pool, a, provider, ca)
        _control_messages(runner, pool, port)
        _injection(a, b, provider, {})
        for change in [
            {"alpha": {"anthropic": GRANTED}},  # cred grant
            {"alpha": {"anthropic": ROTATED, "openai": OPENAI}, "beta": {"google": GOOGLE}},
            {"alpha": {"anthropic": OAUTH, "openai": OPENAI}},  # rotated again (OAuth)
            {"alpha": {"openai": OPENAI}},  # revoked
            {},  # all revoked
        ]:
            credentials = change
            assert runner.call(pool.set_credentials, change) == ()
            _injection(a, b, provider, change)
        # A map the workers refuse (a value no header can carry) changes nothing and harms none.
        with pytest.raises(Unavailable):
            runner.call(pool.set_credentials, {"alpha": {"anthropic": "sk-bad\nvalue"}})
        _injection(a, b, provider, {})

        runner.stop_keeper()  # applianced's keeper gone: 503, never a dead worker
        answer = http_exchange(
            a, post(b"/keeper/request", b'{"credential": "ci", "intent": "read the CI key"}')
        )
        assert readable(answer, {503}, "keeper gone")["error"] == "keeper_unavailable"

        assert pool.pids == pids and pool.restarts == 0
    finally:
        runner.stop()
        bad.close()
        silent.close()
    stderr = capfd.readouterr().err + caplog.text
    assert "late import refused" not in stderr, stderr
    # (the fake upstreams run in this process: socketserver reports a peer's reset its way)
    workers = re.sub(
        r"-{40}\nException occurred during processing.*?\n-{40}\n", "", stderr, flags=re.S
    )
    assert "Traceback" not in workers, stderr
    assert stderr.count("listening on") == 2, stderr

    events = runner.decoded_events()
    kinds = [event["event"] for event in events]
    assert "request_denied" in kinds and "policy_warning" in kinds, sorted(set(kinds))
    assert kinds.count("tunnel_opened") == kinds.count("tunnel_closed") >= 2


def _odd_authorities(a: tuple[str, int]) -> None:
    for authority in ODD_AUTHORITIES:
        for request in (
            b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (authority, authority),
            b"CONNECT %s HTTP/1.1\r\n\r\n" % authority,
        ):
            readable(http_exchange(a, request), {400, 403}, request)
    for target in ODD_FORWARD:
        request = get(target, b"allowed.test")
        readable(http_exchange(a, request), {400, 403}, request)
    # Odd bytes elsewhere in the head: refused, or (a Host field is not policy) answered.
    for request in (
        get(b"/_appliance/health", b"x\xc3\xa9"),
        get(b"/nowhere/\xc3\xa9", b"x"),
        get(b"/_appliance/health", b"x", b"X-\xc3\xa9: 1\r\n"),
        b"G\xc3\xa9T / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    ):
        answer = http_exchange(a, request)
        if answer.status != 200:
            readable(answer, {400, 404, 505}, request)


def _policy_and_ssrf(a: tuple[str, int], plain_port: int) -> None:
    for request, rule in (
        (b"CONNECT unlisted.test:443 HTTP/1.1\r\nHost: unlisted.test:443\r\n\r\n", None),
        (get(b"http://unlisted.test/", b"unlisted.test"), None),
        (get(b"http://127.0.0.1:%d/" % plain_port, b"127.0.0.1"), None),
        (get(b"http://metadata.test/latest/meta-data/", b"metadata.test"), None),
        (get(b"http://private.test/", b"private.test"), None),
        (b"CONNECT metadata.test:80 HTTP/1.1\r\nHost: metadata.test:80\r\n\r\n", None),
    ):
        body = readable(http_exchange(a, request), {403}, request)
        assert body["error"] == "egress_denied", (request, body, rule)


def _local_api_and_keeper(a: tuple[str, int], service: StubKeeperService) -> None:
    health = http_exchange(a, get(b"/_appliance/health"))
    assert health.status == 200 and health.json()["crew"] == "alpha"
    assert readable(http_exchange(a, get(b"/nowhere/x")), {404}, "404")["error"] == "not_found"
    readable(http_exchange(a, get(b"/keeper/request")), {405}, "keeper GET")
    for body, rule in (
        (b"not json", "bad_body"),
        (b"[1, 2]", "bad_body"),
        (b'{"credential": "ci"}', "bad_body"),  # no intent: not the keeper's body
        (b'{"credential": "ci", "intent": "x", "crew": "beta"}', "bad_body"),  # unknown field
        (b'{"credential": "ci", "intent": "   "}', "empty_intent"),
        (b'{"credential": "ci", "intent": "\\u00a0\\u2003"}', "empty_intent"),
        (b'{"credential": "ci", "intent": 7}', "bad_body"),
        (b'{"credential": "ci", "intent": "x\\u0000y"}', "nul_byte"),
        (b'{"credential": "ci", "intent": ' + b"[" * 2000 + b"]" * 2000 + b"}", "bad_body"),
    ):
        refused = readable(http_exchange(a, post(b"/keeper/request", body)), {400}, body)
        assert rule is None or refused["error"] == rule, (body, refused)
    for command in ("echo hi; id", "echo $(id)", "echo 'open", "echo \\"):
        body = json.dumps(
            {"credential": "ci", "intent": "run the deploy check", "command": command}
        ).encode()
        readable(http_exchange(a, post(b"/keeper/execute", body)), {400}, command)
    over = b'{"intent": "%s"}' % (b"x" * (20 * 1024))
    readable(http_exchange(a, post(b"/keeper/request", over)), {413}, "keeper body")

    asked = len(service.calls)
    for intent in ("read the CI deploy key", "\u00fcberpr\u00fcfe den Schl\u00fcssel \u2713"):
        body = json.dumps({"intent": intent, "credential": "ci"}).encode()
        answer = http_exchange(a, post(b"/keeper/request", body))
        assert answer.status == 200 and answer.json()["value"] == "kept-value", answer
    body = json.dumps(
        {"credential": "ci", "intent": "run the deploy check", "command": "echo 'a;b' \"c\""}
    ).encode()
    answer = http_exchange(a, post(b"/keeper/execute", body))
    assert answer.status == 200 and answer.json()["stdout"] == "h\u00e9llo\n", answer
    assert [(action, crew) for action, crew, _ in service.calls[asked:]] == [
        (Action.REQUEST, "alpha"),
        (Action.REQUEST, "alpha"),
        (Action.EXECUTE, "alpha"),
    ]


def _http_limits(a: tuple[str, int], plain_port: int) -> None:
    target = b"http://plain.test:%d/x" % plain_port
    for request, statuses in (
        (
            b"POST %s HTTP/1.1\r\nHost: plain.test\r\nContent-Length: 10485761\r\n\r\n" % target,
            {413},
        ),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", {414}),
        (get(b"/", b"x", b"".join(b"X-H%d: v\r\n" % i for i in range(150))), {431}),
        (get(b"/", b"x", b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(40))), {431}),
        (
            b"POST %s HTTP/1.1\r\nHost: plain.test\r\nTransfer-Encoding: xchunked\r\n\r\n" % target,
            {501},
        ),
        (
            b"POST %s HTTP/1.1\r\nHost: plain.test\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            % target,
            {501},
        ),
        (
            b"POST %s HTTP/1.1\r\nHost: plain.test\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Length: 5\r\n\r\n0\r\n\r\n" % target,
            {400},
        ),
        (b"GET %s HTTP/1.1\nHost: plain.test\n\n" % target, {400}),
        (get(target, b"plain.test", b"X-A: a\r\n b\r\n"), {400}),
        (get(target, b"plain.test", b"Content-Length: +5\r\n"), {400}),
    ):
        readable(http_exchange(a, request), statuses, request[:120])
    # Slowloris: a head that does not arrive whole within head_timeout (1 s).
    started = time.monotonic()
    answer = http_exchange(a, [b"GET /_appliance/health HTTP/1.1\r\n", b"X-Slow: 1\r\n"])
    readable(answer, {408}, "slow head")
    assert time.monotonic() - started < 5
    # A body that stops coming: 408 as well.
    answer = http_exchange(
        a, b"POST %s HTTP/1.1\r\nHost: plain.test\r\nContent-Length: 10\r\n\r\nabc" % target
    )
    readable(answer, {408}, "slow body")


def _upstream_failures(a: tuple[str, int], plain_port: int, ports: dict[str, int]) -> None:
    for request, status in (
        (get(b"http://closed.test:%d/" % ports["closed"], b"closed.test"), 502),
        (get(b"http://bad.test:%d/" % ports["bad"], b"bad.test"), 502),
        (
            # A coding the proxy cannot decode (zstd): refused, readably.
            get(b"http://plain.test:%d/reflect?text=x&encoding=zstd" % plain_port, b"plain.test"),
            502,
        ),
        (get(b"http://silent.test:%d/" % ports["silent"], b"silent.test"), 504),
        (
            b"CONNECT closed.test:%d HTTP/1.1\r\nHost: closed.test\r\n\r\n" % ports["closed"],
            502,
        ),
    ):
        readable(http_exchange(a, request), {status}, request)
    # A name the static table does not hold: the system resolver, on a thread trio starts after
    # the drop (localhost: /etc/hosts, nothing leaves the machine).
    answer = http_exchange(a, get(b"http://localhost:%d/" % plain_port, b"localhost"))
    if answer.status != 200:
        readable(answer, {403}, "localhost")
    # The good path of the same crew still works, scrubbed and streamed.
    for path in (
        b"/reflect?text=hello&framing=chunked&pieces=3",
        b"/sse?n=3&delay=0.01",
        # Compressed bodies are decoded, scrubbed and encoded again (zlib after the drop), and
        # compressed bytes labelled identity are read decoded.
        b"/reflect?text=hello&encoding=gzip",
        b"/reflect?text=hello&encoding=gzip-as-identity&framing=chunked",
        b"/reflect?text=hello&encoding=br&framing=chunked",
    ):
        answer = http_exchange(a, get(b"http://plain.test:%d%s" % (plain_port, path)))
        assert answer.status == 200, (path, answer)
        if b"gzip" in path:
            assert gzip.decompress(answer.body) == b"hello", (path, answer)
        elif b"br" in path:
            assert brotli.decompress(answer.body) == b"hello", (path, answer)
    chunked = (
        b"POST http://plain.test:%d/x HTTP/1.1\r\nHost: plain.test\r\nConnection: close\r\n"
        b"Transfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n" % plain_port
    )
    received = http_exchange(a, chunked)
    assert received.status == 100, received  # then the response: read after the interim one
    assert parse_answer(received.body).status == 200, received


def _overload_and_audit(runner: PoolThread, pool: ProxyPool, b: tuple[str, int]) -> None:
    # More idle connections than both workers take for one crew: the rest are refused, 503.
    held = [socket.create_connection(b, timeout=10) for _ in range(2 * PER_CREW + 4)]
    try:
        answered: list[bytes] = []
        deadline = time.monotonic() + 5
        waiting = list(held)
        while waiting and time.monotonic() < deadline and len(answered) < 4:
            ready, _, _ = select.select(waiting, [], [], 0.5)
            for sock in ready:
                waiting.remove(sock)
                answered.append(read_to_eof(sock))
        assert len(answered) >= 4, answered
        for data in answered:
            body = readable(parse_answer(data), {503}, "overloaded")
            assert body["error"] == "overloaded", body
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)  # the workers see the closes
    runner.call(pool.set_audit_paused, True)
    try:
        body = readable(http_exchange(b, get(b"http://plain.test/")), {503}, "audit paused")
        assert body["error"] == "audit_unavailable", body
    finally:
        runner.call(pool.set_audit_paused, False)


def _tunnels(
    a: tuple[str, int], provider: FakeServer, plain_host: FakeServer, ca: trustme.CA
) -> None:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    with socket.create_connection(a, timeout=10) as sock:
        sock.sendall(
            b"CONNECT api.anthropic.test:%d HTTP/1.1\r\nHost: api.anthropic.test\r\n\r\n"
            % provider.port
        )
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 "), "tunnel not established"
        with context.wrap_socket(sock, server_hostname="api.anthropic.test") as tls:
            tls.sendall(get(b"/v1/models", b"api.anthropic.test"))
            # Read to the end: a close with unread bytes would reset the tunnel.
            assert read_to_eof(tls).startswith(b"HTTP/1.1 200 ")
    with socket.create_connection(a, timeout=10) as sock:
        sock.sendall(
            b"CONNECT plain.test:%d HTTP/1.1\r\nHost: plain.test\r\n\r\n" % plain_host.port
            + get(b"/tunnelled", b"plain.test")  # sent before the 200: relayed after it
        )
        data = read_to_eof(sock)
        assert data.startswith(b"HTTP/1.1 200 ") and data.count(b"HTTP/1.") == 2, data[:300]


def _terminated_tunnels(
    runner: PoolThread, pool: ProxyPool, a: tuple[str, int], provider: FakeServer, ca: trustme.CA
) -> None:
    """Leaves pushed after the drop (their contexts built from memory, not a file), a tunnel
    terminated with one, and a client that refuses it (it trusts the real CA only)."""
    crew_ca = new_ca("alpha")
    leaf = crew_ca.mint("api.anthropic.test")
    pem = control.LeafPem(
        host=leaf.host, cert_pem=leaf.cert_pem.decode(), key_pem=leaf.key_pem.decode()
    )
    reply = runner.call(pool._request, control.CrewLeaves(crew="alpha", leaves=(pem,)))
    assert reply.ok, reply
    connect = b"CONNECT api.anthropic.test:%d HTTP/1.1\r\nHost: x\r\n\r\n" % provider.port
    trusting = ssl.create_default_context(cadata=crew_ca.cert_pem.decode())
    pinned = ssl.create_default_context()
    ca.configure_trust(pinned)
    for _ in range(2):  # each worker, likely
        with socket.create_connection(a, timeout=10) as sock:
            sock.sendall(connect)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 "), "tunnel not established"
            with trusting.wrap_socket(sock, server_hostname="api.anthropic.test") as tls:
                tls.sendall(get(b"/v1/models", b"api.anthropic.test"))
                assert read_to_eof(tls).startswith(b"HTTP/1.1 200 ")
        with socket.create_connection(a, timeout=10) as sock:
            sock.sendall(connect)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 "), "tunnel not established"
            with pytest.raises(ssl.SSLCertVerificationError):
                pinned.wrap_socket(sock, server_hostname="api.anthropic.test")
    assert runner.call(pool._request, control.CrewLeaves(crew="alpha")).ok


def _control_messages(runner: PoolThread, pool: ProxyPool, port: int) -> None:
    # An unknown network mode (non-ASCII at that): a warning quoting it, and restricted.
    runner.call(pool.add_crew, CrewEntry("gamma", GATEWAY_C, "wide-\u00f6pen\u2028", ()))
    body = readable(
        http_exchange((GATEWAY_C, port), get(b"http://plain.test/", b"plain.test")),
        {403},
        "gamma",
    )
    assert body["mode"] == "restricted", body
    assert runner.call(pool.allow, "gamma", "plain.test") is True
    for host in ("b\u00fccher.test", "allowed.test.", "evil@allowed.test", "[fe80::1%eth0]"):
        try:
            runner.call(pool.allow, "gamma", host)
        except Unavailable as exc:  # refused with a reason: fine; a dead worker is not
            assert "refused" in str(exc), exc
    runner.call(pool.remove_crew, "gamma")
    # Nothing serves the gateway any more: refused, or (a connection the closing listener still
    # had queued) closed or reset without an answer.
    try:
        with socket.create_connection((GATEWAY_C, port), timeout=5) as sock:
            sock.sendall(get(b"/_appliance/health"))
            assert read_to_eof(sock) == b""
    except (ConnectionRefusedError, ConnectionResetError):
        pass


def _injection(
    a: tuple[str, int],
    b: tuple[str, int],
    provider: FakeServer,
    granted: dict[str, dict[str, str]],
) -> None:
    """Every injection path carries exactly the crew's granted key (none if none); the agent's
    own key never reaches upstream, and no granted key comes back in a response."""
    agent = b"x-api-key: sk-agent-own-key\r\nAuthorization: Bearer sk-agent-own-key\r\n"
    body = b'{"model": "m", "messages": []}'
    for address, crew in ((a, "alpha"), (b, "beta")):
        keys = granted.get(crew, {})
        for request, provider_name in (
            (post(b"/anthropic/v1/messages", body, agent), "anthropic"),
            (post(b"http://api.anthropic.test/v1/messages", body, agent), "anthropic"),
            (post(b"/openai/chat/completions", body, agent), "openai"),
            (post(b"http://api.openai.test/v1/chat/completions", body, agent), "openai"),
            (post(b"/google/v1beta/models/m:generateContent?key=agent", body), "google"),
        ):
            provider.clear()
            answer = http_exchange(address, request)
            assert answer.status == 200, (request, answer)
            seen = provider.last()
            assert "sk-agent-own-key" not in json.dumps(seen.headers), seen.headers
            assert "key=agent" not in seen.path, seen.path
            key = keys.get(provider_name)
            expected = _expected_credential(provider_name, key)
            found = (seen.all("x-api-key"), seen.all("authorization"), _query_key(seen.path))
            assert found == expected, (crew, request, found, expected)
        # A granted key reflected back by the provider is scrubbed, whole or streamed.
        anthropic = keys.get("anthropic")
        for how in (b"body", b"sse", b"header"):
            answer = http_exchange(
                address, post(b"/anthropic/v1/messages", body, b"x-fake-leak: %s\r\n" % how)
            )
            if anthropic is not None:
                assert anthropic.encode() not in answer.head + answer.body, (how, answer)


def _expected_credential(
    provider_name: str, key: str | None
) -> tuple[list[str], list[str], str | None]:
    """(x-api-key values, authorization values, ?key=) as the provider should see them."""
    if key is None:
        return [], [], None
    if provider_name == "google":
        return [], [], key
    if provider_name == "anthropic" and not key.startswith("sk-ant-oat"):
        return [key], [], None
    return [], [f"Bearer {key}"], None


def _query_key(path: str) -> str | None:
    from urllib.parse import parse_qs, urlsplit

    values = parse_qs(urlsplit(path).query).get("key")
    return values[0] if values else None
