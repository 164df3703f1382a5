"""The credential store against a real SQLite file: round trip, wrong key, every tamper case,
key file permissions, ENCRYPTION_KEY formats, grants and levels, rotation versions."""

from __future__ import annotations

import base64
import os
import pickle
import sqlite3
import stat
from pathlib import Path

import pytest

from appliance.credstore import (
    CredentialConflict,
    CredentialExists,
    CredentialNotFound,
    CredentialStore,
    InvalidCredential,
    KeyUnusable,
    SecretValue,
    TamperedRecord,
    WrongKey,
    key_from_env,
    key_from_file,
    load_key,
    parse_key,
)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
VALUE = b"sk-ant-api03-planted-VALUE-0123456789"


@pytest.fixture
def store(tmp_path: Path) -> CredentialStore:
    opened = CredentialStore(tmp_path / "credentials.db", KEY)
    yield opened  # type: ignore[misc]
    opened.close()


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def test_round_trip_and_file_modes(tmp_path: Path, store: CredentialStore) -> None:
    info = store.add("main", "anthropic", VALUE, level="L1")
    assert (info.name, info.provider, info.kind, info.level, info.version) == (
        "main",
        "anthropic",
        "api_key",
        "L1",
        1,
    )
    assert store.value("main").reveal() == VALUE
    store.close()
    reopened = CredentialStore(tmp_path / "credentials.db", KEY)
    assert reopened.value("main").reveal() == VALUE
    reopened.close()
    for path in tmp_path.iterdir():
        if path.name.startswith("credentials.db"):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # The value is not in the file in clear.
    for path in tmp_path.iterdir():
        assert VALUE not in path.read_bytes()
    assert raw(tmp_path / "credentials.db").execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_kinds_and_validation(store: CredentialStore) -> None:
    assert store.add("oauth", "anthropic", b"sk-ant-oat01-xyz").kind == "oauth_token"
    assert store.add("gh", "github", b"\x00binary\nsecret").kind == "secret"
    assert store.value("gh").reveal() == b"\x00binary\nsecret"
    with pytest.raises(InvalidCredential, match="value: a openai key must be printable"):
        store.add("bad", "openai", b"sk-with\nnewline")
    with pytest.raises(InvalidCredential, match="value: empty"):
        store.add("empty", "github", b"")
    with pytest.raises(InvalidCredential, match="name"):
        store.add("../x", "github", b"v")
    with pytest.raises(InvalidCredential, match="provider"):
        store.add("x", "Bad Provider", b"v")
    with pytest.raises(InvalidCredential, match="level"):
        store.add("x", "github", b"v", level="L4")
    with pytest.raises(CredentialExists):
        store.add("gh", "github", b"other")


def test_a_fresh_nonce_per_write(tmp_path: Path, store: CredentialStore) -> None:
    store.add("a", "github", b"same")
    db = raw(tmp_path / "credentials.db")
    first = db.execute("SELECT nonce, ciphertext FROM credentials").fetchone()
    store.rotate("a", b"same")
    second = db.execute("SELECT nonce, ciphertext FROM credentials").fetchone()
    assert len(first[0]) == len(second[0]) == 12
    assert first[0] != second[0] and first[1] != second[1]


def test_wrong_key_is_refused_at_open(tmp_path: Path, store: CredentialStore) -> None:
    store.add("main", "anthropic", VALUE)
    store.close()
    with pytest.raises(WrongKey, match="another key"):
        CredentialStore(tmp_path / "credentials.db", OTHER_KEY)


def test_a_record_under_another_key_names_the_credential(tmp_path: Path) -> None:
    # Rows copied from another store (another key) past the check record.
    with CredentialStore(tmp_path / "a.db", KEY) as a:
        a.add("main", "anthropic", VALUE)
    with CredentialStore(tmp_path / "b.db", OTHER_KEY) as b:
        b.add("seed", "github", b"x")
    db = raw(tmp_path / "b.db")
    db.execute("ATTACH ? AS a", (str(tmp_path / "a.db"),))
    db.execute("INSERT INTO credentials SELECT * FROM a.credentials")
    db.close()
    with CredentialStore(tmp_path / "b.db", OTHER_KEY) as b:
        with pytest.raises(TamperedRecord, match="'main'") as info:
            b.value("main")
        assert VALUE.decode() not in str(info.value)


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE credentials SET ciphertext = ? WHERE name = 'main'",
        "UPDATE credentials SET nonce = ? WHERE name = 'main'",
        "UPDATE credentials SET level = 'L1' WHERE name = 'main' AND ? IS NOT NULL",
        "UPDATE credentials SET provider = 'openai' WHERE name = 'main' AND ? IS NOT NULL",
        "UPDATE credentials SET kind = 'oauth_token' WHERE name = 'main' AND ? IS NOT NULL",
        "UPDATE credentials SET version = 7 WHERE name = 'main' AND ? IS NOT NULL",
    ],
    ids=["ciphertext", "nonce", "level", "provider", "kind", "version"],
)
def test_each_tamper_is_a_clear_error(tmp_path: Path, store: CredentialStore, edit: str) -> None:
    store.add("main", "anthropic", VALUE, level="L3")
    db = raw(tmp_path / "credentials.db")
    nonce, ciphertext = db.execute("SELECT nonce, ciphertext FROM credentials").fetchone()
    if "ciphertext = ?" in edit:
        flipped = bytes([ciphertext[0] ^ 1]) + ciphertext[1:]
        db.execute(edit, (flipped,))
    elif "nonce = ?" in edit:
        db.execute(edit, (bytes([nonce[0] ^ 1]) + nonce[1:],))
    else:
        db.execute(edit, (1,))
    db.close()
    with pytest.raises(TamperedRecord, match="credential 'main' does not authenticate"):
        store.value("main")


def test_swapped_names_and_truncated_nonce(tmp_path: Path, store: CredentialStore) -> None:
    store.add("one", "github", b"value-one")
    store.add("two", "github", b"value-two")
    db = raw(tmp_path / "credentials.db")
    db.execute("UPDATE credentials SET name = 'tmp' WHERE name = 'one'")
    db.execute("UPDATE credentials SET name = 'one' WHERE name = 'two'")
    db.execute("UPDATE credentials SET name = 'two' WHERE name = 'tmp'")
    with pytest.raises(TamperedRecord, match="'one'"):
        store.value("one")
    with pytest.raises(TamperedRecord, match="'two'"):
        store.value("two")
    db.execute("UPDATE credentials SET nonce = x'00' WHERE name = 'two'")
    with pytest.raises(TamperedRecord, match="'two'"):
        store.value("two")


def test_rotation_keeps_a_version_and_refuses_a_tampered_record(
    tmp_path: Path, store: CredentialStore
) -> None:
    store.add("main", "openai", b"sk-one")
    info = store.rotate("main", b"sk-two")
    assert info.version == 2 and info.rotated >= info.created
    assert store.value("main").reveal() == b"sk-two"
    assert store.rotate("main", b"sk-three", level="L1").version == 3
    assert store.info("main").level == "L1" and store.value("main").reveal() == b"sk-three"
    with pytest.raises(CredentialNotFound):
        store.rotate("nope", b"x")


def test_grants_levels_and_revocation(store: CredentialStore) -> None:
    store.add("claude", "anthropic", VALUE, level="L2")
    store.add("gh", "github", b"ghp_secret", level="L1")
    assert store.proxy_credentials() == {}
    assert not store.is_granted("claude", "alpha")
    with pytest.raises(CredentialNotFound):
        store.value_for("claude", "alpha")

    store.grant("claude", "alpha")
    store.grant("gh", "alpha", agent="agent-1")
    assert store.value_for("claude", "alpha", "anyone").reveal() == VALUE
    assert store.value_for("gh", "alpha", "agent-1").reveal() == b"ghp_secret"
    with pytest.raises(CredentialNotFound):
        store.value_for("gh", "alpha", "agent-2")  # granted to one agent only
    with pytest.raises(CredentialNotFound):
        store.value_for("claude", "beta")
    proxied = store.proxy_credentials()
    assert list(proxied) == ["alpha"] and proxied["alpha"]["anthropic"].reveal() == VALUE
    assert [g.crew for g in store.info("claude").grants] == ["alpha"]
    assert store.info("gh").grants[0].agent == "agent-1"

    # One key per provider per crew: which one the proxy injects is never ambiguous.
    store.add("claude2", "anthropic", b"sk-ant-other")
    with pytest.raises(CredentialConflict, match="already has the anthropic credential"):
        store.grant("claude2", "alpha")

    store.grant("claude", "beta")
    store.revoke("claude", "alpha")
    assert list(store.proxy_credentials()) == ["beta"]
    store.grant("claude2", "alpha")
    assert store.proxy_credentials()["alpha"]["anthropic"].reveal() == b"sk-ant-other"

    info = store.revoke("claude")
    assert info.revoked is not None and info.grants == ()
    assert "beta" not in store.proxy_credentials()
    with pytest.raises(CredentialConflict, match="revoked"):
        store.grant("claude", "beta")
    assert store.rotate("claude", b"sk-ant-new").revoked is None
    store.grant("claude", "beta")
    assert store.proxy_credentials()["beta"]["anthropic"].reveal() == b"sk-ant-new"
    with pytest.raises(InvalidCredential, match="crew"):
        store.grant("claude", "bad crew")


def test_secret_value_never_shows() -> None:
    secret = SecretValue(VALUE)
    assert VALUE.decode() not in repr(secret) and VALUE.decode() not in str(secret)
    assert VALUE.decode() not in f"{secret} {[secret]} {dict(v=secret)}"
    with pytest.raises(TypeError):
        pickle.dumps(secret)
    assert secret == SecretValue(VALUE)
    with secret:
        assert secret.reveal() == VALUE
    assert secret.reveal() == b""


def test_encryption_key_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_key(KEY.hex(), source="s") == KEY
    assert parse_key(KEY.hex().upper(), source="s") == KEY
    assert parse_key(base64.b64encode(KEY).decode(), source="s") == KEY
    assert parse_key(base64.urlsafe_b64encode(KEY).decode().rstrip("="), source="s") == KEY
    assert parse_key(base64.b64encode(KEY).decode() + "\n", source="s") == KEY
    for bad in ["", "short", KEY.hex()[:-2], base64.b64encode(KEY[:31]).decode(), "z" * 64]:
        with pytest.raises(KeyUnusable, match="not a 256-bit key") as info:
            parse_key(bad, source="environment variable ENCRYPTION_KEY")
        assert "ENCRYPTION_KEY" in str(info.value)
        if bad:
            assert bad not in str(info.value)
    monkeypatch.setenv("ENCRYPTION_KEY", KEY.hex())
    assert key_from_env("ENCRYPTION_KEY") == KEY
    assert "ENCRYPTION_KEY" not in os.environ  # children never inherit it
    assert key_from_env("ENCRYPTION_KEY") is None


def test_key_file_created_0600_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENCRYPTION_KEY", raising=False)
    path = tmp_path / "state" / "credentials.key"
    key, source = load_key("ENCRYPTION_KEY", path)
    assert len(key) == 32 and "key file" in source
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert key_from_file(path) == key
    monkeypatch.setenv("ENCRYPTION_KEY", OTHER_KEY.hex())
    assert load_key("ENCRYPTION_KEY", path) == (OTHER_KEY, "environment variable ENCRYPTION_KEY")


def test_key_file_refused_when_unsafe(tmp_path: Path) -> None:
    path = tmp_path / "credentials.key"
    key_from_file(path)
    os.chmod(path, 0o640)
    with pytest.raises(KeyUnusable, match="mode 0640"):
        key_from_file(path)
    os.chmod(path, 0o600)
    if os.geteuid() == 0:
        os.chown(path, 12345, -1)
        with pytest.raises(KeyUnusable, match="owned by uid 12345"):
            key_from_file(path)
        os.chown(path, 0, -1)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(KeyUnusable, match="cannot open"):
        key_from_file(link)
    garbage = tmp_path / "garbage.key"
    fd = os.open(garbage, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not a key")
    os.close(fd)
    with pytest.raises(KeyUnusable, match="not a 256-bit key"):
        key_from_file(garbage)
