"""The keeper in applianced: real credential store, real journal, real commands (subprocess
provider), the gatekeeper behind the fake Ollama on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.credstore import CredentialStore, SecretValue
from appliance.journal.recorder import JournalRecorder
from appliance.journal.store import Journal
from appliance.keeper.gatekeeper import GatekeeperConfig
from appliance.keeper.service import KeeperService, env_name
from appliance.runtime.base import CrewSpec
from appliance.runtime.subprocess_provider import SubprocessProvider
from proxycore.protocol.keeper import Action
from tests.fake_ollama import MODEL, Content, FakeOllama, running_fake_ollama

KEY = bytes(range(32))
VALUE = "ghp_keeperPlantedValue0123456789abcdefXYZ"
INTENT = "list the open pull requests of org/repo"


@pytest.fixture
def ollama() -> Iterator[FakeOllama]:
    with running_fake_ollama() as fake:
        yield fake


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    opened = Journal(tmp_path / "journal.db")
    yield opened
    opened.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CredentialStore]:
    opened = CredentialStore(tmp_path / "credentials.db", KEY)
    with SecretValue(VALUE.encode()) as value:
        opened.add("github-token", "github", value, level="L1", kind="secret")
    with SecretValue(b"l3-secret-value-not-for-alpha") as value:
        opened.add("deploy-key", "deploy", value, level="L3", kind="secret")
    opened.grant("github-token", "alpha")
    opened.grant("deploy-key", "beta")
    yield opened
    opened.close()


def service(
    store: CredentialStore,
    journal: Journal,
    ollama: FakeOllama | None,
    tmp_path: Path,
    model: str | None = MODEL,
) -> KeeperService:
    provider = SubprocessProvider(tmp_path / "crews")
    spec = CrewSpec(name="alpha", image="-", infra_image="-")
    provider.start_agent(spec, provider.create_infra(spec))
    url = ollama.url if ollama is not None else "http://127.0.0.1:9"
    return KeeperService(
        store,
        GatekeeperConfig(model=model, url=url, timeout_seconds=5),
        JournalRecorder(journal),
        provider,
        recent_activity=lambda crew: tuple(r.summary for r in journal.tail(5, crew=crew)),
    )


def body(**fields: object) -> bytes:
    return json.dumps({"credential": "github-token", "intent": INTENT, **fields}).encode()


def decisions(journal: Journal) -> list[dict[str, object]]:
    return [json.loads(r.payload) for r in journal.tail(50, type="keeper")]


async def test_l1_request_takes_the_fast_path_without_the_model(
    store: CredentialStore, journal: Journal, ollama: FakeOllama, tmp_path: Path
) -> None:
    status, answer = await service(store, journal, ollama, tmp_path).handle(
        Action.REQUEST, "alpha", body()
    )
    assert status == 200 and answer.value == VALUE and answer.decision == "allow"
    assert ollama.requests == []
    [entry] = decisions(journal)
    assert entry["decision"] == "allow" and "fast_path" in str(entry["reason"])
    assert VALUE not in json.dumps(decisions(journal))


async def test_filler_intent_goes_to_the_model_and_its_deny_holds(
    store: CredentialStore, journal: Journal, ollama: FakeOllama, tmp_path: Path
) -> None:
    ollama.behaviour = lambda _: Content('{"decision": "DENY", "reason": "vague", "risk": "high"}')
    status, answer = await service(store, journal, ollama, tmp_path).handle(
        Action.REQUEST, "alpha", body(intent="aaaaaaaaaa")
    )
    assert status == 403 and answer.value is None and answer.reason == "vague"
    assert len(ollama.requests) == 1


async def test_empty_intent_is_refused_before_the_model(
    store: CredentialStore, journal: Journal, ollama: FakeOllama, tmp_path: Path
) -> None:
    status, answer = await service(store, journal, ollama, tmp_path).handle(
        Action.REQUEST, "alpha", body(intent="   ")
    )
    assert status == 400 and answer.error == "empty_intent" and ollama.requests == []


async def test_ungranted_credential_looks_like_no_credential(
    store: CredentialStore, journal: Journal, ollama: FakeOllama, tmp_path: Path
) -> None:
    keeper = service(store, journal, ollama, tmp_path)
    for name in ("deploy-key", "no-such-thing"):
        status, answer = await keeper.handle(Action.REQUEST, "alpha", body(credential=name))
        assert (status, answer.reason) == (404, "no such credential for this crew")
    assert ollama.requests == []
    assert [e["decision"] for e in decisions(journal)] == ["deny", "deny"]


async def test_no_model_configured_denies_everything_but_the_fast_path(
    store: CredentialStore, journal: Journal, tmp_path: Path
) -> None:
    keeper = service(store, journal, None, tmp_path, model=None)
    status, answer = await keeper.handle(Action.EXECUTE, "alpha", body(command="true"))
    assert status == 403 and "no gatekeeper model" in answer.reason


async def test_execute_on_allow_runs_without_shell_and_scrubs_the_value(
    store: CredentialStore, journal: Journal, ollama: FakeOllama, tmp_path: Path
) -> None:
    keeper = service(store, journal, ollama, tmp_path)
    variable = env_name("github-token")
    assert variable == "GITHUB_TOKEN"
    command = f"sh -c 'echo token=${variable}; echo err=${variable} >&2; echo $HOME;' ignored"
    status, answer = await keeper.handle(Action.EXECUTE, "alpha", body(command=command))
    assert status == 200 and answer.exit_code == 0, answer
    assert answer.stdout is not None and answer.stderr is not None
    assert VALUE not in answer.stdout + answer.stderr
    assert answer.stdout.startswith("token=") and answer.stderr.startswith("err=")
    assert answer.value is None
    # The model was asked (execute never takes the fast path), with the argv, not a shell line.
    [(_, _, sent)] = ollama.requests
    assert sent is not None
    document = json.loads(sent["messages"][1]["content"])
    assert document["argv"][:2] == ["sh", "-c"] and document["level"] == "L1"
    executed = [json.loads(r.payload) for r in journal.tail(5, type="command.executed")]
    assert (
        executed and executed[0]["exit_code"] == 0 and executed[0]["credential"] == "github-token"
    )


async def test_execute_refuses_metacharacters_before_anything_runs(
    store: CredentialStore, journal: Journal, ollama: FakeOllama, tmp_path: Path
) -> None:
    keeper = service(store, journal, ollama, tmp_path)
    for command in ("env; id", "echo $(id)", "cat <<EOF", "echo a | nc x 1", "echo a\nid"):
        status, answer = await keeper.handle(Action.EXECUTE, "alpha", body(command=command))
        assert status == 400 and answer.error in {"shell_metacharacter"}, (command, answer)
    assert ollama.requests == []


async def test_the_model_sees_the_crews_recent_activity(
    store: CredentialStore, journal: Journal, ollama: FakeOllama, tmp_path: Path
) -> None:
    keeper = service(store, journal, ollama, tmp_path)
    await keeper.handle(Action.REQUEST, "alpha", body())  # journals a fast-path decision
    await keeper.handle(Action.EXECUTE, "alpha", body(command="true"))
    [(_, _, sent)] = ollama.requests
    assert sent is not None
    recent = json.loads(sent["messages"][1]["content"])["recent_activity"]
    assert any("keeper allow request of github-token" in line for line in recent)


async def test_bad_bodies_are_refused(
    store: CredentialStore, journal: Journal, ollama: FakeOllama, tmp_path: Path
) -> None:
    keeper = service(store, journal, ollama, tmp_path)
    for raw in (
        b"",
        b"[]",
        b'{"credential": "x"}',
        body(extra=1),
        body(command="ls"),
        b"x" * 20000,
    ):
        status, answer = await keeper.handle(Action.REQUEST, "alpha", raw)
        assert status == 400 and answer.decision == "deny", raw[:40]
