"""An execute's output on its way to the crew: through the crew's scrubber (applianced's, then the
proxy worker's), binary output withheld with a readable refusal, the encoder rule refusing
before anything runs; unit, KeeperService with real commands, and the real route (agent ->
proxy worker -> applianced's keeper)."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.credstore import CredentialStore, SecretValue
from appliance.daemon.config import parse_config
from appliance.daemon.main import keeper_secret_paths
from appliance.journal.recorder import JournalRecorder
from appliance.journal.store import Journal
from appliance.keeper.channel import KeeperChannel, new_token
from appliance.keeper.gatekeeper import GatekeeperConfig
from appliance.keeper.output import OutputGuard
from appliance.keeper.service import KeeperService
from appliance.runtime.base import CrewSpec
from appliance.runtime.subprocess_provider import SubprocessProvider
from native.scrub import Scrubber
from native.scrub_patterns import DEFAULT_SHAPES
from proxycore import control
from proxycore.protocol.keeper import Action, KeeperRefused, scrub_keeper_answer
from proxycore.protocol.keeper_encoders import SecretSources, check_secret_encoding
from proxycore.protocol.scrubbing import configured_shapes
from tests.conftest import REAL_KEYS
from tests.fake_ollama import MODEL, FakeOllama, running_fake_ollama
from tests.test_daemon_proxy_channel import request
from tests.test_keeper_channel import ALPHA, Proxy, agent

KEY = bytes(range(32))
VALUE = "ghp_outputPlantedValue0123456789abcdefXYZ"
OTHER = "deploy-Other-Crews-Value-0123456789-not-for-alpha"
INTENT = "list the open pull requests of org/repo"
# A key only the proxy holds (pushed to it for crew beta), in no shape the scrubber knows.
PROXY_ONLY = "proxyOnlyKey-Zq8vN3-kT5wR1-xY7uP2-mL4"


# -- the guard, alone ----------------------------------------------------------------------------


def guarded(chunks: list[bytes], limit: int = 1 << 20) -> OutputGuard:
    guard = OutputGuard("stdout", Scrubber([("github-token", VALUE)]).stream(), limit)
    for chunk in chunks:
        guard.feed(chunk)
    return guard


def test_text_is_scrubbed_however_it_is_cut() -> None:
    text = f"token={VALUE}\n\tcolour \x1b[1mbold\x1b[0m é ✓\r\n".encode()
    for size in (1, 2, 3, 7, len(text)):
        guard = guarded([text[i : i + size] for i in range(0, len(text), size)])
        out = guard.finish()
        assert guard.withheld is None
        assert VALUE not in out and out.startswith("token=[REDACTED:github-token]\n"), size
        assert out.endswith("é ✓\r\n")


@pytest.mark.parametrize(
    ("name", "payload"),
    [
        ("gzip", gzip.compress(VALUE.encode())),
        ("bzip2", bz2.compress(VALUE.encode())),
        ("xz", lzma.compress(VALUE.encode())),
        ("zlib", zlib.compress(VALUE.encode())),
        ("raw deflate", zlib.compress(VALUE.encode())[2:-4]),
        ("lz4 frame", b"\x04\x22\x4d\x18\x64\x40\xa7" + len(VALUE).to_bytes(4, "little")),
        ("zip", b"PK\x03\x04\x14\x00\x00\x00\x08\x00"),
        ("NUL", VALUE.encode() + b"\x00"),
        ("latin-1", "clé".encode("latin-1")),
        ("a UTF-8 character cut at the end", "é".encode()[:1]),
        ("bzip2 magic alone", b"text then BZh91AY&SY and text"),
    ],
)
def test_output_that_is_not_text_is_withheld_whole(name: str, payload: bytes) -> None:
    before = b"some text first, then:\n"
    for chunks in ([before + payload], [before, payload], [bytes([b]) for b in before + payload]):
        guard = guarded(chunks)
        out = guard.finish()
        assert guard.withheld is not None, name
        assert out.startswith("[keeper: stdout withheld: ") and "not text" in out
        assert f"its {len(before + payload)} bytes" in out
        assert "some text first" not in out and VALUE not in out


_PIECES = st.sampled_from(
    [VALUE.encode(), b"text ", b"\n", "é✓".encode(), b"\x1b[0m", b"\x00", b"\xff", b"BZh91AY&SY"]
)


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=8), cuts=st.lists(st.integers(1, 9), max_size=12))
def test_the_outcome_does_not_depend_on_how_the_pipe_was_written(
    pieces: list[bytes], cuts: list[int]
) -> None:
    data = b"".join(pieces)
    chunks, start = [], 0
    for cut in cuts:
        chunks.append(data[start : start + cut])
        start += cut
    chunks.append(data[start:])
    whole, split = guarded([data]), guarded(chunks)
    out_whole, out_split = whole.finish(), split.finish()
    assert (whole.withheld is None) == (split.withheld is None)
    if whole.withheld is None:
        assert out_whole == out_split and VALUE not in out_whole
    else:
        assert out_whole == out_split  # the same refusal, the same first bad byte
        assert VALUE not in out_whole


def test_output_over_the_limit_is_truncated_and_said_so() -> None:
    guard = guarded([b"a" * 100, b"b" * 100], limit=150)
    assert guard.finish() == "a" * 100 + "b" * 50 and guard.truncated


def test_the_worker_scrubs_every_field_but_the_delivered_value() -> None:
    scrubber = Scrubber([("anthropic", REAL_KEYS["anthropic"])])
    key = REAL_KEYS["anthropic"]
    answer = json.dumps(
        {"decision": "allow", "reason": key, "stdout": f"k={key}", "exit_code": 0}
    ).encode()
    scrubbed = scrub_keeper_answer(scrubber, Action.EXECUTE, answer)
    assert scrubbed is not None and key.encode() not in scrubbed
    assert json.loads(scrubbed)["stdout"] == "k=[REDACTED:anthropic]"
    delivered = json.dumps({"decision": "allow", "reason": "ok", "value": key}).encode()
    # What `request` is for; an execute delivers nothing, whatever its answer holds.
    assert scrub_keeper_answer(scrubber, Action.REQUEST, delivered) == delivered
    executed = scrub_keeper_answer(scrubber, Action.EXECUTE, delivered)
    assert executed is not None and key.encode() not in executed
    clean = b'{"decision":"deny","reason":"no"}'
    assert scrub_keeper_answer(scrubber, Action.EXECUTE, clean) == clean  # untouched
    for bad in (b"", b"[]", b'{"stdout": {"nested": 1}}', b"[[[[[[", b'{"a":'):
        assert scrub_keeper_answer(scrubber, Action.EXECUTE, bad) is None, bad


# -- KeeperService with real commands ------------------------------------------------------------


@pytest.fixture
def ollama() -> Iterator[FakeOllama]:
    with running_fake_ollama() as fake:
        yield fake


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CredentialStore]:
    opened = CredentialStore(tmp_path / "credentials.db", KEY)
    with SecretValue(VALUE.encode()) as value:
        opened.add("github-token", "github", value, level="L1", kind="secret")
    with SecretValue(OTHER.encode()) as value:
        opened.add("deploy-key", "deploy", value, level="L3", kind="secret")
    opened.grant("github-token", "alpha")
    opened.grant("deploy-key", "beta")
    yield opened
    opened.close()


def keeper_with_files(
    store: CredentialStore, journal: Journal, ollama: FakeOllama, tmp_path: Path
) -> tuple[KeeperService, SubprocessProvider]:
    provider = SubprocessProvider(tmp_path / "crews")
    spec = CrewSpec(name="alpha", image="-", infra_image="-")
    provider.start_agent(spec, provider.create_infra(spec))
    home = provider.home("alpha")
    # Files the agent could have written: the values it learnt some other way.
    (home / "value.txt").write_text(VALUE + "\n")
    (home / "other.txt").write_text(f"other={OTHER}\n")
    (home / "proxy-key.txt").write_text(PROXY_ONLY + "\n")
    keeper = KeeperService(
        store,
        GatekeeperConfig(model=MODEL, url=ollama.url, timeout_seconds=5),
        JournalRecorder(journal),
        provider,
        secret_paths=(str(tmp_path / "credentials.db"),),
    )
    return keeper, provider


def body(command: str) -> bytes:
    return json.dumps({"credential": "github-token", "intent": INTENT, "command": command}).encode()


async def test_execute_output_goes_through_the_crews_scrubber(
    store: CredentialStore, ollama: FakeOllama, tmp_path: Path
) -> None:
    journal = Journal(tmp_path / "journal.db")
    try:
        keeper, _ = keeper_with_files(store, journal, ollama, tmp_path)
        command = "sh -c 'echo env=$GITHUB_TOKEN; cat value.txt other.txt; cat value.txt >&2'"
        status, answer = await keeper.handle(Action.EXECUTE, "alpha", body(command))
        assert status == 200 and answer.exit_code == 0, answer
        assert answer.stdout == (
            "env=[REDACTED:github-token]\n[REDACTED:github-token]\nother=[REDACTED:deploy-key]\n"
        )
        assert answer.stderr == "[REDACTED:github-token]\n" and answer.withheld == ()

        # gzip of a file that holds the value: the encoder rule does not know the file, the
        # output is not text: withheld, with a readable refusal; the command did run.
        status, answer = await keeper.handle(Action.EXECUTE, "alpha", body("gzip -c value.txt"))
        assert status == 200 and answer.exit_code == 0 and answer.withheld == ("stdout",)
        assert answer.stdout is not None and answer.stdout.startswith("[keeper: stdout withheld")
        assert VALUE not in json.dumps(answer.stdout)

        # The encoder rule: refused before the model and before anything runs, journaled.
        asked = len(ollama.requests)
        for command in (
            "sh -c 'printf %s \"$GITHUB_TOKEN\" | base32'",
            f"xxd {tmp_path / 'credentials.db'}",
            "od -c /proc/self/environ",
        ):
            status, answer = await keeper.handle(Action.EXECUTE, "alpha", body(command))
            assert (status, answer.error) == (400, "secret_through_encoder"), answer
        assert len(ollama.requests) == asked
        refusals = [
            json.loads(row.payload)
            for row in journal.tail(50, type="keeper.decision")
            if b"secret_through_encoder" in row.payload.encode()
        ]
        assert len(refusals) == 3 and all(r["decision"] == "deny" for r in refusals)
        assert all(r["credential"] == "github-token" for r in refusals)
    finally:
        journal.close()


# -- the real route: agent -> gateway -> proxy worker -> applianced ------------------------------


async def test_keeper_output_through_the_proxy(
    store: CredentialStore, ollama: FakeOllama, tmp_path: Path, ca_file: str
) -> None:
    journal = Journal(tmp_path / "journal.db")
    keeper, _ = keeper_with_files(store, journal, ollama, tmp_path)
    proxy = Proxy(tmp_path, ca_file)
    token = new_token()
    path = tmp_path / "keeper.sock"
    channel = KeeperChannel(keeper, path, token, lambda pid, uid, gid: pid == proxy.process.pid)

    async def execute(command: str) -> tuple[int, dict]:
        fields = {"credential": "github-token", "intent": INTENT, "command": command}
        return await agent(ALPHA, proxy.port, "/keeper/execute", fields)

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(channel.serve)
            reply = request(proxy.channel, control.KeeperChannelSet(path=str(path), token=token))
            assert reply["ok"], reply
            reply = request(
                proxy.channel, control.CredentialsSet(crews={"beta": {"openai": PROXY_ONLY}})
            )
            assert reply["ok"], reply

            # A raw value in the output: applianced's scrubber (the store's values)...
            status, answer = await execute("sh -c 'cat value.txt; echo $GITHUB_TOKEN >&2'")
            assert status == 200, answer
            assert answer["stdout"] == "[REDACTED:github-token]\n"
            assert answer["stderr"] == "[REDACTED:github-token]\n"
            # ...and the worker's (a key only the proxy holds: applianced's store lacks it).
            assert Scrubber().scrub_text(PROXY_ONLY) == PROXY_ONLY  # no shape catches it
            status, answer = await execute("cat proxy-key.txt")
            assert status == 200 and answer["stdout"] == "[REDACTED:openai]\n", answer

            # Binary output: replaced by a readable refusal.
            status, answer = await execute("gzip -c value.txt")
            assert status == 200 and answer["withheld"] == ["stdout"], answer
            assert answer["stdout"].startswith("[keeper: stdout withheld: ")

            # The encoder rule in the worker: refused before forwarding, journaled by
            # applianced from the worker's events.
            status, answer = await execute("sh -c 'cat /proc/self/environ | xxd'")
            assert (status, answer["error"]) == (400, "secret_through_encoder"), answer
            assert "xxd" in json.dumps(answer) and "/proc/self/environ" in json.dumps(answer)
            events = tmp_path / "events.jsonl"
            with trio.fail_after(5):
                while b"secret_through_encoder" not in events.read_bytes():
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    finally:
        proxy.close()
        journal.close()
    raw = (tmp_path / "events.jsonl").read_bytes()
    assert VALUE.encode() not in raw and PROXY_ONLY.encode() not in raw


async def test_no_scrubber_no_execute(
    store: CredentialStore, ollama: FakeOllama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> Scrubber:
        raise MemoryError

    journal = Journal(tmp_path / "journal.db")
    try:
        keeper, provider = keeper_with_files(store, journal, ollama, tmp_path)
        monkeypatch.setattr("appliance.keeper.service.Scrubber", broken)
        status, answer = await keeper.handle(Action.EXECUTE, "alpha", body("touch ran"))
        assert status == 503 and "nothing was run" in answer.reason
        assert not (provider.home("alpha") / "ran").exists()
    finally:
        journal.close()


def test_applianced_names_its_secret_files_to_the_encoder_rule(tmp_path: Path) -> None:
    config = parse_config(
        f"""
[daemon]
state_dir = "{tmp_path}/state"
[credentials]
key_file = "/etc/appliance/store.key"
[journal]
key_file = "/etc/appliance/journal.key"
[proxy.providers.openai]
credential_file = "/etc/appliance/openai.key"
"""
    )
    paths = keeper_secret_paths(config)
    assert paths == (
        f"{tmp_path}/state/credentials.db",
        "/etc/appliance/store.key",
        "/etc/appliance/journal.key",
        "/etc/appliance/openai.key",
    )
    sources = SecretSources(("GITHUB_TOKEN",), paths)
    with pytest.raises(KeeperRefused) as info:
        check_secret_encoding(("base64", "/etc/appliance/journal.key"), sources)
    assert info.value.rule == "secret_through_encoder"
    # (and the output scrubber takes the proxy's configured shapes, as main.py passes them)
    assert configured_shapes(config.proxy.scrub.shapes) == DEFAULT_SHAPES
