"""The keeper through a real applianced: a Docker crew (busybox) asks its gateway for a credential
and runs a command with one; applianced decides (L1 fast path, or the fake Ollama on loopback),
runs the command in the crew's agent container with the value in that command's environment
only, scrubs the output and journals every decision."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from appliance.journal.store import tail
from tests.daemon_support import REACH_TEST_HOSTS, Appliance
from tests.fake_ollama import MODEL, Content, FakeOllama, running_fake_ollama
from tests.test_credentials_cli import STORE_KEY

pytestmark = pytest.mark.docker

VALUE = "ghp_daemonPlantedValue0123456789abcdefXYZ"
INTENT = "list the open pull requests of org/repo"


@pytest.fixture
def ollama() -> Iterator[FakeOllama]:
    with running_fake_ollama() as fake:
        yield fake


def keeper_call(app: Appliance, crew: str, gateway: str, route: str, fields: dict[str, str]) -> str:
    """From inside the crew's agent container: one raw HTTP POST to the gateway's local API."""
    body = json.dumps(fields).replace("'", "'\\''")
    raw = (
        f"body='{body}'; "
        f'printf "POST {route} HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n'
        f'Content-Length: %d\\r\\nConnection: close\\r\\n\\r\\n%s" "${{#body}}" "$body" | '
        f"nc -w 10 {gateway} {app.port}"
    )
    done = app.ctl("run", crew, "--", "sh", "-c", raw)
    assert done.returncode == 0, done.stderr
    return done.stdout


def answer(raw: str) -> tuple[int, dict[str, object]]:
    # (`appliancectl run` passes output on line by line, with bare newlines)
    head, _, body = raw.replace("\r\n", "\n").partition("\n\n")
    assert body, repr(raw)
    return int(head.split()[1]), json.loads(body)


def test_keeper_through_a_real_daemon(appliance: Appliance, ollama: FakeOllama) -> None:
    app = appliance
    with open(app.config, "a") as config:
        config.write(f'\n[keeper]\nmodel = "{MODEL}"\nurl = "{ollama.url}"\ntimeout_seconds = 10\n')
    app.start(env={"ENCRYPTION_KEY": STORE_KEY})
    crew = app.crew("keep")
    code, created = app.ctl_json("crew", "create", crew, *REACH_TEST_HOSTS)
    assert code == 0, (created, app.log_text())
    gateway = created["crew"]["gateway"]
    done = app.ctl_stdin(VALUE, "cred", "add", "gh", "--provider", "github", "--level", "L1")
    assert done.returncode == 0, done.stderr
    code, _ = app.ctl_json("cred", "grant", "gh", crew)
    assert code == 0

    request = {"credential": "gh", "intent": INTENT}
    status, reply = answer(keeper_call(app, crew, gateway, "/keeper/request", request))
    assert status == 200 and reply["value"] == VALUE, reply
    assert ollama.requests == []  # L1 fast path

    command = {**request, "command": "sh -c 'echo tok=$GH; id -u'"}
    status, reply = answer(keeper_call(app, crew, gateway, "/keeper/execute", command))
    assert status == 200 and reply["exit_code"] == 0, reply
    stdout = str(reply["stdout"])
    assert VALUE not in stdout and stdout.startswith("tok=") and "1001" in stdout
    assert len(ollama.requests) == 1
    # The value was in that command's environment only: the agent's own env does not have it.
    env = app.ctl("run", crew, "--", "env")
    assert VALUE not in env.stdout and "GH=" not in env.stdout

    ollama.behaviour = lambda _: Content('{"decision": "DENY", "reason": "no", "risk": "high"}')
    status, reply = answer(keeper_call(app, crew, gateway, "/keeper/execute", command))
    assert status == 403 and "stdout" not in reply
    status, reply = answer(
        keeper_call(app, crew, gateway, "/keeper/execute", {**request, "command": "env; id"})
    )
    assert status == 400 and reply["error"] == "shell_metacharacter"

    # The proxy's refusal reaches the journal through its event file (followed, not awaited).
    deadline = time.monotonic() + 10
    while True:
        entries = tail(app.state_dir / "journal.db", 100, crew=crew)
        decided = [json.loads(e.payload) for e in entries if e.type == "keeper.decision"]
        if len(decided) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [d["decision"] for d in decided] == ["allow", "allow", "deny", "deny"]
    assert decided[-1]["reason"] == "refused by the proxy: shell_metacharacter"
    assert decided[-1]["credential"] == "gh"
    assert [e.type for e in entries].count("command.executed") == 1
    assert VALUE not in json.dumps([e.payload for e in entries])
    assert VALUE not in app.log_text()
