"""A crew's method and path rules and its placeholder keys through the control plane, without
Docker or a kernel: appliancectl's `--rule` spelling, applianced's validation (the proxy's own),
the state that keeps them (and migrates a state from before them), the CrewAdd every worker is
sent, and the agent environment's per-crew placeholders. tests/test_daemon_rules.py drives the
same through a real applianced."""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path

import msgspec
import pytest
import trio

from appliance.ctl.crew import parse_rule, rule_spec
from appliance.ctl.main import main as ctl_main
from appliance.daemon import messages
from appliance.daemon.config import parse_config
from appliance.daemon.crews import CrewManager, agent_environment
from appliance.daemon.errors import InvalidRequest
from appliance.daemon.proxy import CrewEntry, _crew_add
from appliance.daemon.state import SCHEMA_VERSION, CrewPhase, CrewRow, StateStore
from appliance.runtime.base import AGENT_KEY_VARIABLES, agent_keys
from proxycore.config import RuleConfig
from proxycore.protocol.credentials import Provider
from proxycore.protocol.placeholders import misdirected_placeholder, placeholder

GITHUB_READ = "api.github.com read-only /repos/acme/** /user"
GITHUB_ISSUES = "api.github.com POST /repos/acme/*/issues"


def test_the_api_rule_is_the_proxys_rule_field_for_field() -> None:
    """messages.CrewRule exists so that appliancectl need not import the proxy; it must not
    drift from what the workers are sent."""
    ours = msgspec.structs.fields(messages.CrewRule)
    theirs = msgspec.structs.fields(RuleConfig)
    assert [(f.name, f.type, f.default) for f in ours] == [
        (f.name, f.type, f.default) for f in theirs
    ]


@pytest.mark.parametrize(
    ("spec", "rule"),
    [
        (
            GITHUB_READ,
            messages.CrewRule("api.github.com", (), "read-only", ("/repos/acme/**", "/user")),
        ),
        (
            GITHUB_ISSUES,
            messages.CrewRule("api.github.com", ("POST",), None, ("/repos/acme/*/issues",)),
        ),
        ("h.test", messages.CrewRule("h.test")),
        ("h.test /exact", messages.CrewRule("h.test", paths=("/exact",))),
        (
            "h.test read-only,POST,PATCH",
            messages.CrewRule("h.test", ("POST", "PATCH"), "read-only"),
        ),
    ],
)
def test_a_rule_is_one_shell_word_read_back_as_written(spec: str, rule: messages.CrewRule) -> None:
    parsed = parse_rule(spec)
    assert parsed == rule
    assert rule_spec(parsed) == spec


@pytest.mark.parametrize(
    "spec", ["", "   ", "h.test get /x", "h.test readonly", "h.test GET,,POST"]
)
def test_a_rule_the_cli_cannot_read_is_a_usage_error(spec: str) -> None:
    """A lower-case method would never match (methods are case-sensitive) and a misspelled
    preset would be taken for a method: both refused before anything is sent."""
    with pytest.raises(argparse.ArgumentTypeError):
        parse_rule(spec)


def test_a_bad_rule_exits_2_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = ctl_main(
        ["--socket", str(tmp_path / "none.sock"), "crew", "create", "c", "--rule", "h.test get"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "argument --rule" in err and "Traceback" not in err


class _Runtimes:
    def runtimes(self) -> list[str]:
        return ["runc"]


def _manager(tmp_path: Path) -> CrewManager:
    # Only validate() is called: no network, proxy or container is touched.
    return CrewManager(
        parse_config(b""),
        _Runtimes(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        StateStore(tmp_path),
        None,  # type: ignore[arg-type]
        ("agent", "infra"),
    )


def test_applianced_checks_rules_with_the_proxys_validation(tmp_path: Path) -> None:
    manager = _manager(tmp_path)

    def validate(*rules: messages.CrewRule) -> CrewRow:
        return trio.run(manager.validate, messages.CreateCrew(name="c1", rules=rules))

    row = validate(parse_rule("API.GitHub.com read-only /repos/acme/**"), parse_rule(GITHUB_ISSUES))
    # The host as the proxy compares it (lower case).
    assert row.rules == (
        RuleConfig("api.github.com", (), "read-only", ("/repos/acme/**",)),
        RuleConfig("api.github.com", ("POST",), None, ("/repos/acme/*/issues",)),
    )
    bad = {
        "argument rule[1]: path pattern 'x': must start with /": messages.CrewRule(
            "h", paths=("x",)
        ),
        "argument rule[1]: method 'CONNECT'": messages.CrewRule("h", ("CONNECT",)),
        "argument rule[1]: preset 'write-only': unknown": messages.CrewRule(
            "h", preset="write-only"
        ),
        "argument rule[1]: host 'a b': not a valid host name": messages.CrewRule("a b"),
        "argument rule[1]: path pattern '/a/../b'": messages.CrewRule("h", paths=("/a/../b",)),
    }
    for message, rule in bad.items():
        with pytest.raises(InvalidRequest) as caught:
            validate(parse_rule(GITHUB_ISSUES), rule)
        assert str(caught.value).startswith(message), caught.value
    with pytest.raises(InvalidRequest, match=r"^argument rule: over 256 rules"):
        validate(*[messages.CrewRule("h")] * 257)
    manager.store.close()


def test_the_state_keeps_rules_and_crew_add_carries_them(tmp_path: Path) -> None:
    rules = (RuleConfig("api.github.com", ("POST",), "read-only", ("/repos/acme/**",)),)
    row = CrewRow("c1", "restricted", ("api.github.com",), "runc", 1, 1.0, CrewPhase.READY, 0, 0)
    store = StateStore(tmp_path)
    store.insert(msgspec.structs.replace(row, rules=rules))
    store.insert(msgspec.structs.replace(row, name="c2"))
    store.close()
    store = StateStore(tmp_path)  # a restart reads them back
    assert [r.rules for r in store.crews()] == [rules, ()]
    store.close()
    entry = CrewEntry("c1", "100.64.0.1", "restricted", ("api.github.com",), rules=rules)
    assert _crew_add(entry).rules == rules


# A state of schema version 4 (before method and path rules), as that applianced wrote it.
_V4 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '4');
INSERT INTO meta VALUES ('instance_id', 'prod');
CREATE TABLE crews (
    name TEXT PRIMARY KEY, mode TEXT NOT NULL, allow TEXT NOT NULL, runtime TEXT NOT NULL,
    memory_bytes INTEGER NOT NULL, cpus REAL NOT NULL, phase TEXT NOT NULL, infra_id TEXT,
    agent_id TEXT, gateway TEXT, created REAL NOT NULL, updated REAL NOT NULL, error TEXT,
    slot TEXT, ssrf_allow TEXT NOT NULL DEFAULT '[]');
CREATE TABLE pool (slot TEXT PRIMARY KEY, phase TEXT NOT NULL, infra_id TEXT,
    infra_pid INTEGER, gateway TEXT, created REAL NOT NULL);
INSERT INTO crews VALUES ('a', 'restricted', '["x.test"]', 'runc', 1, 1.0, 'ready', 'infra-a',
    'agent-a', '100.64.0.1', 0, 0, NULL, NULL, '["10.0.0.0/8"]');
"""


def test_a_state_from_before_rules_migrates(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "applianced.db")
    db.executescript(_V4)
    db.close()
    store = StateStore(tmp_path)
    try:
        (row,) = store.crews()
        assert (row.name, row.allow, row.ssrf_allow, row.rules, row.net) == (
            "a",
            ("x.test",),
            ("10.0.0.0/8",),
            (),
            (),
        )
        # Not a state from before instance ids: nothing to adopt by legacy names.
        assert store.adoptable() == ({"infra-a", "agent-a"}, set())
        assert store.instance_id(None, "derived") == "prod"
    finally:
        store.close()
    db = sqlite3.connect(tmp_path / "applianced.db")
    meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    db.close()
    assert meta["schema_version"] == str(SCHEMA_VERSION) == "6"
    assert "legacy_crews" not in meta
    StateStore(tmp_path).close()  # opened again: nothing migrates twice


def test_each_crew_holds_its_own_placeholders() -> None:
    """Per crew and provider, so that a refusal names whose it was; the proxy recognizes
    exactly these values (its tripwire reads what this environment holds)."""
    config = parse_config(b"")
    one = agent_environment(config, "crew-one", "100.64.0.1")
    two = agent_environment(config, "crew-two", "100.64.0.5")
    assert {name: one[name] for name in AGENT_KEY_VARIABLES} == {
        "ANTHROPIC_API_KEY": "appliance-placeholder-anthropic-crew-one",
        "OPENAI_API_KEY": "appliance-placeholder-openai-crew-one",
        "GEMINI_API_KEY": "appliance-placeholder-google-crew-one",
    }
    assert agent_keys("crew-two") == {name: two[name] for name in AGENT_KEY_VARIABLES}
    assert one["OPENAI_API_KEY"] == placeholder(Provider.OPENAI, "crew-one")
    head = f"GET / HTTP/1.1\r\nAuthorization: Bearer {one['OPENAI_API_KEY']}\r\n\r\n".encode()
    assert misdirected_placeholder(head, None) is Provider.OPENAI
    assert misdirected_placeholder(head, Provider.OPENAI) is None
    # Nothing else key-like, and no credential.
    assert [k for k in one if "KEY" in k or "TOKEN" in k] == list(AGENT_KEY_VARIABLES)
    assert json.dumps(one).count("appliance-placeholder-") == 3
