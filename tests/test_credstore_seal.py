"""Sealed grants and access state against a real SQLite file: an attacker who can write the
database but has no key edits it with plain SQL, and every edit that would change who gets what
is refused, named, and never used; a sealed grant round-trips; rotate, revoke and grant keep
working and never bless a forged row; a store from before sealing is upgraded once."""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from appliance.credstore import (
    CredentialNotFound,
    CredentialStore,
    TamperedGrant,
    TamperedRecord,
)
from appliance.credstore.store import CHECK_AD_V1, CHECK_PLAINTEXT, associated_data

KEY = bytes(range(32))
CLAUDE = b"sk-ant-api03-sealed-CLAUDE-0123456789"
OTHER = b"sk-ant-api03-sealed-OTHER-9876543210"


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "credentials.db"


@pytest.fixture
def store(path: Path) -> Iterator[CredentialStore]:
    opened = CredentialStore(path, KEY)
    yield opened
    opened.close()


def sql(path: Path, *statements: str | tuple[str, tuple[object, ...]]) -> None:
    """What someone with write access to the file (and no key) does."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in statements:
            if isinstance(statement, tuple):
                db.execute(*statement)
            else:
                db.execute(statement)
    finally:
        db.close()


def refused(store: CredentialStore, name: str) -> list[tuple[str, str | None, str]]:
    return [(r.crew, r.agent, r.reason) for r in store.info(name).refused]


def granted_crews(store: CredentialStore, name: str) -> list[tuple[str, str | None]]:
    return [(g.crew, g.agent) for g in store.info(name).grants]


def test_a_sealed_grant_round_trips(path: Path, store: CredentialStore) -> None:
    store.add("claude", "anthropic", CLAUDE, level="L2")
    store.add("gh", "github", b"ghp_sealed", level="L1")
    store.grant("claude", "alpha")
    store.grant("gh", "alpha", agent="agent-1")
    store.close()
    with CredentialStore(path, KEY) as reopened:
        assert reopened.is_granted("claude", "alpha")
        assert reopened.value_for("claude", "alpha", "anyone").reveal() == CLAUDE
        assert reopened.value_for("gh", "alpha", "agent-1").reveal() == b"ghp_sealed"
        assert not reopened.is_granted("gh", "alpha", "agent-2")
        assert reopened.proxy_credentials()["alpha"]["anthropic"].reveal() == CLAUDE
        infos = reopened.list()
        assert all(not i.tampered and i.refused == () for i in infos)
        # The seals are in the file, one per row, and differ.
        db = sqlite3.connect(path)
        seals = [r[0] for r in db.execute("SELECT seal FROM grants")]
        db.close()
        assert len(seals) == 2 and all(len(s) == 32 for s in seals) and seals[0] != seals[1]


def test_a_forged_grant_row_is_refused_and_never_used(path: Path, store: CredentialStore) -> None:
    store.add("claude", "anthropic", CLAUDE)
    store.grant("claude", "alpha")
    # Without a seal, with a random one, and with alpha's genuine seal put on a new crew.
    real_seal = sqlite3.connect(path).execute("SELECT seal FROM grants").fetchone()[0]
    sql(
        path,
        ("INSERT INTO grants VALUES ('claude', 'mallory', '', ?, NULL)", (time.time(),)),
        ("INSERT INTO grants VALUES ('claude', 'eve', '', ?, ?)", (time.time(), os.urandom(32))),
        ("INSERT INTO grants VALUES ('claude', 'trudy', '', ?, ?)", (time.time(), real_seal)),
    )
    for crew, reason in (
        ("mallory", "unsealed"),
        ("eve", "does not authenticate"),
        ("trudy", "does not authenticate"),
    ):
        with pytest.raises(TamperedGrant, match=f"to crew '{crew}' is refused") as error:
            store.value_for("claude", crew)
        assert error.value.reason == reason and error.value.status == 500
        assert error.value.code == "grant_tampered" and CLAUDE.decode() not in str(error.value)
    assert list(store.proxy_credentials()) == ["alpha"]  # the genuine grant still works
    assert store.value_for("claude", "alpha").reveal() == CLAUDE
    assert refused(store, "claude") == [
        ("eve", None, "does not authenticate"),
        ("mallory", None, "unsealed"),
        ("trudy", None, "does not authenticate"),
    ]


@pytest.mark.parametrize(
    ("edit", "asked"),
    [
        ("UPDATE grants SET crew = 'beta'", ("beta", "agent-1")),
        ("UPDATE grants SET agent = '' WHERE agent = 'agent-1'", ("alpha", "agent-2")),
        ("UPDATE grants SET agent = 'agent-2' WHERE agent = 'agent-1'", ("alpha", "agent-2")),
        ("UPDATE grants SET granted = granted - 86400", ("alpha", "agent-1")),
    ],
    ids=["crew", "agent-widened", "agent-changed", "granted-time"],
)
def test_an_edited_grant_is_refused(
    path: Path, store: CredentialStore, edit: str, asked: tuple[str, str | None]
) -> None:
    store.add("gh", "github", b"ghp_edited")
    store.grant("gh", "alpha", agent="agent-1")
    sql(path, edit)
    with pytest.raises(TamperedGrant):
        store.value_for("gh", *asked)
    assert store.info("gh").grants == ()
    assert [r.reason for r in store.info("gh").refused] == ["does not authenticate"]


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE credentials SET level = 'L1'",
        "UPDATE credentials SET provider = 'openai'",
        "UPDATE credentials SET epoch = randomblob(16)",
        "UPDATE credentials SET seal = NULL",
        "UPDATE credentials SET version = 9",
        "UPDATE credentials SET revoked = 1.0",
        "UPDATE credentials SET rotated = 1.0",
    ],
    ids=["level", "provider", "epoch", "seal-deleted", "version", "revoked", "rotated"],
)
def test_an_edited_credential_state_refuses_the_credential(
    path: Path, store: CredentialStore, edit: str
) -> None:
    store.add("claude", "anthropic", CLAUDE, level="L3")
    store.grant("claude", "alpha")
    sql(path, edit)
    with pytest.raises(TamperedRecord, match="credential 'claude' does not authenticate"):
        store.is_granted("claude", "alpha")
    with pytest.raises(TamperedRecord):
        store.value_for("claude", "alpha")
    with pytest.raises(TamperedRecord):
        store.value("claude")
    assert store.proxy_credentials() == {}
    (info,) = store.list()  # the listing itself still works, and says what is wrong
    assert info.tampered and info.grants == ()
    assert refused(store, "claude") == [("alpha", None, "its credential does not authenticate")]


def test_a_grant_copied_to_another_credential_is_refused(
    path: Path, store: CredentialStore
) -> None:
    store.add("claude", "anthropic", CLAUDE)
    store.add("other", "openai", b"sk-other-openai")
    store.grant("claude", "alpha")
    sql(
        path,
        "INSERT INTO grants SELECT 'other', crew, agent, granted, seal FROM grants "
        "WHERE name = 'claude'",
    )
    with pytest.raises(TamperedGrant, match="grant of credential 'other' to crew 'alpha'"):
        store.value_for("other", "alpha")
    assert "alpha" in store.proxy_credentials()
    assert "openai" not in store.proxy_credentials()["alpha"]


def test_a_grant_kept_from_before_a_revocation_does_not_come_back(
    path: Path, store: CredentialStore
) -> None:
    store.add("claude", "anthropic", CLAUDE)
    store.grant("claude", "alpha")
    store.grant("claude", "beta")
    db = sqlite3.connect(path)
    saved = db.execute("SELECT * FROM grants WHERE crew = 'alpha'").fetchone()
    saved_credential = db.execute("SELECT * FROM credentials").fetchone()
    db.close()
    # Revoked from one crew, then the row is put back: its epoch is gone.
    store.revoke("claude", "alpha")
    sql(path, ("INSERT INTO grants VALUES (?, ?, ?, ?, ?)", saved))
    with pytest.raises(TamperedGrant):
        store.value_for("claude", "alpha")
    assert list(store.proxy_credentials()) == ["beta"]
    # Revoked everywhere, then `revoked` cleared and the grant put back: the credential's seal
    # covers `revoked`, so the credential itself is refused.
    store.revoke("claude")
    sql(
        path,
        "UPDATE credentials SET revoked = NULL",
        ("INSERT OR REPLACE INTO grants VALUES (?, ?, ?, ?, ?)", saved),
    )
    with pytest.raises(TamperedRecord):
        store.value_for("claude", "alpha")
    # The whole old row put back (a consistent rollback of this credential and its grant) is
    # the one edit a key-less writer can make verify: see docs/credentials.md, "Not covered".
    sql(
        path,
        "DELETE FROM credentials",
        ("INSERT INTO credentials VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", saved_credential),
        ("INSERT OR REPLACE INTO grants VALUES (?, ?, ?, ?, ?)", saved),
    )
    assert store.is_granted("claude", "alpha")


def test_rotate_revoke_and_grant_keep_working_and_never_bless_a_forged_row(
    path: Path, store: CredentialStore
) -> None:
    store.add("claude", "anthropic", CLAUDE)
    store.grant("claude", "alpha")
    store.grant("claude", "beta", agent="a1")
    sql(path, ("INSERT INTO grants VALUES ('claude', 'mallory', '', ?, NULL)", (1.0,)))

    info = store.rotate("claude", OTHER, level="L1")
    assert info.version == 2 and info.level == "L1"
    assert granted_crews(store, "claude") == [("alpha", None), ("beta", "a1")]
    assert store.value_for("claude", "beta", "a1").reveal() == OTHER
    assert refused(store, "claude") == [("mallory", None, "unsealed")]  # still refused

    store.revoke("claude", "beta", agent="a1")
    assert granted_crews(store, "claude") == [("alpha", None)]
    assert store.value_for("claude", "alpha").reveal() == OTHER
    store.revoke("claude", "mallory")  # an operator removes the bad row
    assert store.info("claude").refused == ()

    # A grant over a refused row replaces it with a sealed one (the operator vouches now).
    sql(path, "UPDATE grants SET seal = NULL WHERE crew = 'alpha'")
    with pytest.raises(TamperedGrant, match="grant it again"):
        store.value_for("claude", "alpha")
    store.grant("claude", "alpha")
    assert store.value_for("claude", "alpha").reveal() == OTHER

    store.revoke("claude")
    assert store.info("claude").revoked is not None and not store.info("claude").tampered
    assert store.rotate("claude", CLAUDE).revoked is None
    store.grant("claude", "gamma")
    assert store.proxy_credentials()["gamma"]["anthropic"].reveal() == CLAUDE


def test_revoke_works_on_a_credential_that_no_longer_authenticates(
    path: Path, store: CredentialStore
) -> None:
    store.add("claude", "anthropic", CLAUDE)
    store.grant("claude", "alpha")
    sql(path, "UPDATE credentials SET level = 'L1'")
    info = store.revoke("claude")
    assert info.revoked is not None and info.tampered and info.grants == info.refused == ()
    # Rotation replaces it with an authenticated record; no grant is carried over.
    fresh = store.rotate("claude", OTHER)
    assert not fresh.tampered and fresh.grants == () and fresh.revoked is None


def _v1_store(path: Path) -> None:
    """A store as the code before sealing wrote it: v1 schema, v1 check record."""
    aead = AESGCM(KEY)
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, nonce BLOB NOT NULL, sealed BLOB NOT NULL);
        CREATE TABLE credentials (
            name TEXT PRIMARY KEY, provider TEXT NOT NULL, kind TEXT NOT NULL,
            level TEXT NOT NULL, version INTEGER NOT NULL, nonce BLOB NOT NULL,
            ciphertext BLOB NOT NULL, created REAL NOT NULL, rotated REAL NOT NULL, revoked REAL
        );
        CREATE TABLE grants (
            name TEXT NOT NULL REFERENCES credentials(name) ON DELETE CASCADE,
            crew TEXT NOT NULL, agent TEXT NOT NULL DEFAULT '', granted REAL NOT NULL,
            PRIMARY KEY (name, crew, agent)
        );
        """
    )
    nonce = os.urandom(12)
    db.execute(
        "INSERT INTO meta VALUES ('check', ?, ?)",
        (nonce, aead.encrypt(nonce, CHECK_PLAINTEXT, CHECK_AD_V1)),
    )
    for name, value in (("claude", CLAUDE), ("broken", OTHER)):
        nonce = os.urandom(12)
        sealed = aead.encrypt(nonce, value, associated_data(name, "anthropic", "api_key", "L3", 1))
        db.execute(
            "INSERT INTO credentials VALUES (?, 'anthropic', 'api_key', 'L3', 1, ?, ?, 1.0, 1.0, "
            "NULL)",
            (name, nonce, sealed),
        )
        db.execute("INSERT INTO grants VALUES (?, ?, '', 1.0)", (name, f"crew-{name}"))
    db.execute("UPDATE credentials SET level = 'L1' WHERE name = 'broken'")  # tampered in v1
    db.close()


def test_a_store_from_before_sealing_is_upgraded_once(path: Path) -> None:
    _v1_store(path)
    with CredentialStore(path, KEY) as store:
        assert store.upgraded_unsealed_grants == 2
        claude = store.info("claude")
        assert not claude.tampered and claude.grants == ()
        assert refused(store, "claude") == [("crew-claude", None, "unsealed")]
        assert store.info("broken").tampered  # its value did not authenticate: not sealed
        assert store.value("claude").reveal() == CLAUDE
        assert store.proxy_credentials() == {}
        with pytest.raises(TamperedGrant, match="predates sealed grants"):
            store.value_for("claude", "crew-claude")
        store.grant("claude", "crew-claude")  # the operator vouches for it
        assert store.value_for("claude", "crew-claude").reveal() == CLAUDE
    # Once: reopening does not upgrade again, and a seal stripped now is tampering.
    with CredentialStore(path, KEY) as store:
        assert store.upgraded_unsealed_grants == 0
    sql(path, "UPDATE credentials SET seal = NULL, epoch = NULL WHERE name = 'claude'")
    with CredentialStore(path, KEY) as store:
        assert store.info("claude").tampered
        with pytest.raises(TamperedRecord):
            store.value_for("claude", "crew-claude")
    with pytest.raises(CredentialNotFound):
        CredentialStore(path, KEY).value_for("nosuch", "crew")
