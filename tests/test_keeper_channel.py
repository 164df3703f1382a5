"""The keeper end to end through a real proxy process: agent -> crew gateway (`/keeper/...`) ->
proxy worker -> Unix socket (SO_PEERCRED + X-Internal-Token) -> KeeperService -> fake Ollama /
real command; and the channel's own refusals (a foreign process, a wrong token)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from appliance.credstore import CredentialStore, SecretValue
from appliance.journal.recorder import JournalRecorder
from appliance.journal.store import Journal
from appliance.keeper.channel import KeeperChannel, new_token, token_matches
from appliance.keeper.gatekeeper import GatekeeperConfig
from appliance.keeper.service import KeeperService
from appliance.runtime.base import CrewSpec
from appliance.runtime.subprocess_provider import SubprocessProvider
from proxycore import control
from proxycore.io.keeper_client import KeeperUnavailable, forward_to_keeper
from tests.conftest import free_port, proxy_env, write_proxy_config
from tests.fake_ollama import MODEL, Content, FakeOllama, Slow, running_fake_ollama
from tests.test_daemon_proxy_channel import curl, listening, request

KEY = bytes(range(32))
VALUE = "ghp_channelPlantedValue0123456789abcdefXYZ"
ALPHA, BETA = "127.0.0.41", "127.0.0.42"
INTENT = "list the open pull requests of org/repo"


@pytest.fixture
def ollama() -> Iterator[FakeOllama]:
    with running_fake_ollama() as fake:
        yield fake


def test_token_comparison() -> None:
    token = new_token()
    assert len(token) >= 43 and token != new_token()
    assert token_matches(token.encode(), token)
    assert not token_matches(None, token)
    assert not token_matches(token.encode()[:-1], token)
    assert not token_matches(b"", token)


class Proxy:
    def __init__(self, tmp_path: Path, ca_file: str) -> None:
        self.port = free_port()
        config, _, _ = write_proxy_config(
            tmp_path,
            port=self.port,
            provider_port=free_port(),
            ca_file=ca_file,
            # Shorter than a slow model's answer: the decision is not cut by the read deadline.
            extra="[limits]\nread_timeout = 1.0\nhead_timeout = 1.0\n",
        )
        self.channel, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "proxycore.worker", "--config", str(config)),
                *("--control-fd", str(theirs.fileno())),
            ],
            env=proxy_env(),
            pass_fds=[theirs.fileno()],
            stderr=subprocess.PIPE,
        )
        theirs.close()
        self.channel.settimeout(15)
        assert request(self.channel, control.Ping()) == {"ok": True}
        for name, gateway in (("alpha", ALPHA), ("beta", BETA)):
            sock = listening(gateway, self.port)
            reply = request(
                self.channel,
                control.CrewAdd(
                    name=name, gateway=gateway, listener=True, ssrf_allow=("127.0.0.0/8",)
                ),
                sock,
            )
            sock.close()
            assert reply["ok"], reply

    def close(self) -> None:
        self.channel.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def agent(gateway: str, port: int, route: str, fields: dict[str, object]) -> tuple[int, dict]:
    done = await trio.to_thread.run_sync(
        lambda: curl(
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "--data-binary",
            json.dumps(fields),
            "-w",
            "\n%{http_code}",
            f"http://{gateway}:{port}{route}",
        )
    )
    body, _, code = done.stdout.rpartition("\n")
    return int(code), json.loads(body) if body else {}


async def slow_body(gateway: str, port: int, route: str, fields: dict[str, object]) -> bytes:
    body = json.dumps(fields).encode()
    stream = await trio.open_tcp_stream(gateway, port)
    async with stream:
        await stream.send_all(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % (route.encode(), len(body))
        )
        await trio.sleep(0.3)
        await stream.send_all(body)
        answer = b""
        with trio.fail_after(20):
            while data := await stream.receive_some(65536):
                answer += data
    return answer


async def test_keeper_through_the_proxy(tmp_path: Path, ollama: FakeOllama, ca_file: str) -> None:
    store = CredentialStore(tmp_path / "credentials.db", KEY)
    with SecretValue(VALUE.encode()) as value:
        store.add("github-token", "github", value, level="L1", kind="secret")
    store.grant("github-token", "alpha")
    journal = Journal(tmp_path / "journal.db")
    provider = SubprocessProvider(tmp_path / "crews")
    spec = CrewSpec(name="alpha", image="-", infra_image="-")
    provider.start_agent(spec, provider.create_infra(spec))
    service = KeeperService(
        store,
        GatekeeperConfig(model=MODEL, url=ollama.url, timeout_seconds=5),
        JournalRecorder(journal),
        provider,
    )
    proxy = Proxy(tmp_path, ca_file)
    token = new_token()
    path = tmp_path / "keeper.sock"
    keeper = KeeperChannel(service, path, token, lambda pid, uid, gid: pid == proxy.process.pid)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(keeper.serve)
            assert (path.stat().st_mode & 0o777) == 0o600

            # Before applianced tells the worker where the keeper is: 503, fail closed.
            status, answer = await agent(
                ALPHA,
                proxy.port,
                "/keeper/request",
                {"credential": "github-token", "intent": INTENT},
            )
            assert (status, answer["error"]) == (503, "keeper_unavailable")

            reply = request(proxy.channel, control.KeeperChannelSet(path=str(path), token=token))
            assert reply == {"ok": True, "changed": True}
            assert token not in json.dumps(reply)

            # L1 request: the value, through the fast path, for the crew of the gateway.
            status, answer = await agent(
                ALPHA,
                proxy.port,
                "/keeper/request",
                {"credential": "github-token", "intent": INTENT},
            )
            assert status == 200 and answer["value"] == VALUE, answer
            assert ollama.requests == []

            # Another crew's gateway: the same body is not this crew's credential. The body
            # cannot name a crew (unknown fields are refused).
            status, answer = await agent(
                BETA,
                proxy.port,
                "/keeper/request",
                {"credential": "github-token", "intent": INTENT},
            )
            assert status == 404 and "value" not in answer
            status, answer = await agent(
                BETA,
                proxy.port,
                "/keeper/request",
                {"credential": "github-token", "intent": INTENT, "crew": "alpha"},
            )
            assert status == 400 and "value" not in answer

            # Execute: refused in the worker before anything is forwarded...
            status, answer = await agent(
                ALPHA,
                proxy.port,
                "/keeper/execute",
                {"credential": "github-token", "intent": INTENT, "command": "env; id"},
            )
            assert (status, answer["error"]) == (400, "shell_metacharacter")
            # (applianced journals it from the proxy's events: docs/keeper.md)
            events = tmp_path / "events.jsonl"
            with trio.fail_after(5):
                while b"shell_metacharacter" not in events.read_bytes():
                    await trio.sleep(0.05)
            refusals = [
                json.loads(line)
                for line in events.read_bytes().splitlines()
                if b"keeper_call_refused" in line
            ]
            # Beta's body above named a field the keeper does not know ("crew"): refused in
            # the worker too, under beta's name.
            assert [(r["crew"], r["rule"]) for r in refusals] == [
                ("beta", "bad_body"),
                ("alpha", "shell_metacharacter"),
            ]
            # ...allowed by the model: run, the value scrubbed from the output.
            status, answer = await agent(
                ALPHA,
                proxy.port,
                "/keeper/execute",
                {
                    "credential": "github-token",
                    "intent": INTENT,
                    "command": "sh -c 'echo token=$GITHUB_TOKEN'",
                },
            )
            assert status == 200 and answer["exit_code"] == 0, answer
            assert VALUE not in json.dumps(answer) and answer["stdout"].startswith("token=")
            # ...a model slower than the proxy's read deadline still decides.
            ollama.behaviour = lambda _: Slow(
                2.0, Content('{"decision":"ALLOW","reason":"","risk":""}')
            )
            # (The body arrives after the head: the proxy waited for it under its 1 s deadline.)
            raw = await slow_body(
                ALPHA,
                proxy.port,
                "/keeper/execute",
                {"credential": "github-token", "intent": INTENT, "command": "true"},
            )
            assert raw.startswith(b"HTTP/1.1 200 "), raw
            # ...denied by the model: nothing runs.
            ollama.behaviour = lambda _: Content('{"decision":"DENY","reason":"no","risk":"high"}')
            status, answer = await agent(
                ALPHA,
                proxy.port,
                "/keeper/execute",
                {"credential": "github-token", "intent": INTENT, "command": "touch ran"},
            )
            assert status == 403 and not (provider.home("alpha") / "ran").exists()

            # The channel itself: this test process is not the proxy (SO_PEERCRED)...
            with pytest.raises(KeeperUnavailable):
                await forward_to_keeper(str(path), token, "request", "alpha", b"{}")
            assert keeper.refused_peers == 1
            # ...and the proxy's pid with a wrong token is refused too.
            keeper.peer_allowed = lambda pid, uid, gid: pid == os.getpid()
            status, body = await forward_to_keeper(str(path), "x" * 43, "request", "alpha", b"{}")
            assert status == 401 and b"value" not in body
            # A peer that closes at once, or sends garbage, does not take the channel down.
            for junk in (b"", b"\x00\x01garbage\r\n\r\n", b"POST /internal/keeper/request"):
                conn = await trio.open_unix_socket(str(path))
                async with conn:
                    if junk:
                        await conn.send_all(junk)
                    await conn.send_eof()
                    with trio.fail_after(5):
                        while await conn.receive_some(65536):
                            pass
            status, body = await forward_to_keeper(
                str(path),
                token,
                "request",
                "alpha",
                json.dumps({"credential": "github-token", "intent": INTENT}).encode(),
            )
            assert status == 200 and VALUE.encode() in body
            nursery.cancel_scope.cancel()
    finally:
        proxy.close()
        journal.close()
        store.close()
    types = [r.type for r in Journal(tmp_path / "journal.db").tail(50)]
    # The calls the worker refused itself (the unknown field, the metacharacter) are in its
    # events (events.jsonl here; applianced journals those too), not in the keeper's decisions.
    assert types.count("keeper.decision") == 6 and types.count("command.executed") == 2
