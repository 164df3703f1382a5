"""The credential store: AES-256-GCM records in SQLite, with grants and security levels.

Theory of operation
-------------------
One SQLite file (WAL, `synchronous=FULL`: changes are rare and must survive a crash), created 0600
in the daemon's 0700 state directory. Each credential is one row: its identity in clear (name,
provider, kind, level, version) and its value sealed with AES-256-GCM under the store key:

    nonce       12 random bytes, fresh for every write of the row (add, rotate, re-level)
    ciphertext  AESGCM(key).encrypt(nonce, value, associated_data) (value + 16-byte tag)
    associated  b"agent-appliance/credstore/v1\\0" + JSON [name, provider, kind, level, version]

Binding the identity as associated data means a row cannot be edited into another credential
without the key: swapping two rows' names, lowering a level (L3 to L1, the keeper's fast path),
or replaying an old version all fail authentication, as does any change to the nonce or the
ciphertext. A failure raises `TamperedRecord` naming the credential: never garbage.

The `meta` table holds a check record sealed under the key when the store was created; opening
the store opens it first, so a wrong key is reported at start ("the store was written with
another key"), not at the first use of a credential.

Grants (`grants` table): a credential is usable by a crew, and optionally only by one agent id of
that crew, only if a row says so. Grants are not sealed: whoever can write this file can add one
(see docs/credentials.md, "what is not covered"). A crew-wide grant of a provider credential
(anthropic, openai, google) makes the proxy inject it for that crew (`proxy_credentials`); a crew
has at most one per provider, so which key is injected is never ambiguous.

Revocation: `revoke(name, crew)` removes that crew's grants; `revoke(name)` removes all of them
and marks the credential revoked (it cannot be granted again until it is rotated).
"""

from __future__ import annotations

import enum
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import (
    CredentialConflict,
    CredentialExists,
    CredentialNotFound,
    InvalidCredential,
    TamperedRecord,
    WrongKey,
)
from .keys import KEY_BYTES
from .secret import SecretValue

NONCE_BYTES = 12  # 96 bits, the GCM nonce size NIST SP 800-38D recommends
AD_PREFIX = b"agent-appliance/credstore/v1\0"
CHECK_AD = b"agent-appliance/credstore/v1/key-check\0"
CHECK_PLAINTEXT = b"agent-appliance credential store key check"
MAX_VALUE_BYTES = 64 * 1024
# Random nonces: NIST's limit for one key is 2**32 encryptions; a store writes a handful a day.

# The providers the proxy injects for (proxycore.credentials.Provider); other providers are
# named secrets for the keeper.
PROXY_PROVIDERS = ("anthropic", "openai", "google")
ANTHROPIC_OAUTH_PREFIX = b"sk-ant-oat"

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PROVIDER_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    nonce BLOB NOT NULL,
    sealed BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS credentials (
    name TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    kind TEXT NOT NULL,
    level TEXT NOT NULL,
    version INTEGER NOT NULL,
    nonce BLOB NOT NULL,
    ciphertext BLOB NOT NULL,
    created REAL NOT NULL,
    rotated REAL NOT NULL,
    revoked REAL
);
CREATE TABLE IF NOT EXISTS grants (
    name TEXT NOT NULL REFERENCES credentials(name) ON DELETE CASCADE,
    crew TEXT NOT NULL,
    agent TEXT NOT NULL DEFAULT '',  -- '' means every agent of the crew
    granted REAL NOT NULL,
    PRIMARY KEY (name, crew, agent)
);
"""


class Level(enum.Enum):
    """How much scrutiny the keeper gives a request for the credential (issue 6): L1 may take
    the fast path (request only, a real intent); L2 and L3 always go to the gatekeeper model."""

    L1 = "L1"
    L2 = "L2"
    L3 = "L3"


class Kind(enum.Enum):
    API_KEY = "api_key"
    OAUTH_TOKEN = "oauth_token"  # noqa: S105 (a kind, not a token)
    SECRET = "secret"  # noqa: S105 (a kind, not a secret)


class Grant(msgspec.Struct, frozen=True):
    crew: str
    agent: str | None
    granted: float


class CredentialInfo(msgspec.Struct, frozen=True):
    """Everything about a credential except its value."""

    name: str
    provider: str
    kind: str
    level: str
    version: int
    created: float
    rotated: float
    revoked: float | None
    grants: tuple[Grant, ...]


def check_name(value: str, argument: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise InvalidCredential(
            f"{argument}: {value!r} is not a valid name (1-64 of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit)"
        )
    return value


def check_provider(value: str) -> str:
    if not isinstance(value, str) or not _PROVIDER_RE.fullmatch(value):
        raise InvalidCredential(
            f"provider: {value!r} is not valid (anthropic, openai, google, or a lower-case "
            "name of up to 32 of a-z 0-9 . _ - for a keeper secret)"
        )
    return value


def check_value(value: bytes, provider: str) -> None:
    """Never quotes the value: only what is wrong with it."""
    if not value:
        raise InvalidCredential("value: empty")
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidCredential(f"value: longer than {MAX_VALUE_BYTES} bytes")
    if provider in PROXY_PROVIDERS and not all(0x21 <= b <= 0x7E for b in value):
        raise InvalidCredential(
            f"value: a {provider} key must be printable ASCII without spaces or line breaks "
            "(it travels in an HTTP header)"
        )


def default_kind(provider: str, value: bytes) -> Kind:
    if provider not in PROXY_PROVIDERS:
        return Kind.SECRET
    if provider == "anthropic" and value.startswith(ANTHROPIC_OAUTH_PREFIX):
        return Kind.OAUTH_TOKEN
    return Kind.API_KEY


def associated_data(name: str, provider: str, kind: str, level: str, version: int) -> bytes:
    return AD_PREFIX + msgspec.json.encode([name, provider, kind, level, version])


class CredentialStore:
    """One open store. Synchronous and quick (a row, an AES call): the daemon calls it from its
    trio thread, as it does the state store."""

    def __init__(self, path: Path, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise InvalidCredential("key: must be 32 bytes")
        self.path = Path(path)
        self._aead = AESGCM(key)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Born 0600 before SQLite opens it; SQLite gives the -wal and -shm files the same mode.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        self._db = sqlite3.connect(self.path, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(SCHEMA)
            self._check_key()
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> CredentialStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- sealing ------------------------------------------------------------------------------

    def _check_key(self) -> None:
        row = self._db.execute("SELECT nonce, sealed FROM meta WHERE key = 'check'").fetchone()
        if row is None:
            nonce = os.urandom(NONCE_BYTES)
            sealed = self._aead.encrypt(nonce, CHECK_PLAINTEXT, CHECK_AD)
            self._db.execute(
                "INSERT INTO meta (key, nonce, sealed) VALUES ('check', ?, ?)", (nonce, sealed)
            )
            return
        try:
            opened = self._aead.decrypt(row[0], row[1], CHECK_AD)
        except (InvalidTag, ValueError):
            opened = b""
        if opened != CHECK_PLAINTEXT:
            raise WrongKey(
                f"credential store {self.path}: the key does not open it (the store was written "
                "with another key, or its check record was altered)"
            )

    def _seal(
        self, value: bytes, name: str, provider: str, kind: str, level: str, version: int
    ) -> tuple[bytes, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        ad = associated_data(name, provider, kind, level, version)
        return nonce, self._aead.encrypt(nonce, value, ad)

    def _open_row(self, row: sqlite3.Row | tuple[object, ...]) -> SecretValue:
        name, provider, kind, level, version, nonce, ciphertext = row[:7]
        try:
            ad = associated_data(str(name), str(provider), str(kind), str(level), int(str(version)))
            if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
                raise ValueError("nonce size")
            if not isinstance(ciphertext, bytes):
                raise ValueError("ciphertext type")
            plaintext = self._aead.decrypt(nonce, ciphertext, ad)
        except (InvalidTag, ValueError, TypeError):
            raise TamperedRecord(str(name)) from None
        return SecretValue(plaintext)

    # -- reading ------------------------------------------------------------------------------

    def _row(self, name: str) -> tuple[object, ...]:
        row = self._db.execute(
            "SELECT name, provider, kind, level, version, nonce, ciphertext, created, rotated, "
            "revoked FROM credentials WHERE name = ?",
            (name,),
        ).fetchone()
        if row is None:
            raise CredentialNotFound(name)
        return tuple(row)

    def _grants(self, name: str) -> tuple[Grant, ...]:
        return tuple(
            Grant(crew=crew, agent=agent or None, granted=granted)
            for crew, agent, granted in self._db.execute(
                "SELECT crew, agent, granted FROM grants WHERE name = ? ORDER BY crew, agent",
                (name,),
            )
        )

    def info(self, name: str) -> CredentialInfo:
        row = self._row(name)
        return self._info(row)

    def _info(self, row: tuple[object, ...]) -> CredentialInfo:
        name = str(row[0])
        return CredentialInfo(
            name=name,
            provider=str(row[1]),
            kind=str(row[2]),
            level=str(row[3]),
            version=int(str(row[4])),
            created=float(str(row[7])),
            rotated=float(str(row[8])),
            revoked=None if row[9] is None else float(str(row[9])),
            grants=self._grants(name),
        )

    def list(self) -> list[CredentialInfo]:
        rows = self._db.execute(
            "SELECT name, provider, kind, level, version, nonce, ciphertext, created, rotated, "
            "revoked FROM credentials ORDER BY name"
        ).fetchall()
        return [self._info(tuple(row)) for row in rows]

    def value(self, name: str) -> SecretValue:
        """The value, authenticated; the caller wipes it when done. No grant check: for the
        daemon's own use (the proxy's map); a crew's request goes through `value_for`."""
        return self._open_row(self._row(name))

    def is_granted(self, name: str, crew: str, agent: str | None = None) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM grants g JOIN credentials c ON c.name = g.name "
            "WHERE g.name = ? AND g.crew = ? AND g.agent IN ('', ?) AND c.revoked IS NULL",
            (name, crew, agent or ""),
        ).fetchone()
        return row is not None

    def value_for(self, name: str, crew: str, agent: str | None = None) -> SecretValue:
        """The value if `crew` (and `agent`) holds a grant; else CredentialNotFound, the same
        answer as for a credential that does not exist (a crew learns nothing of others')."""
        if not self.is_granted(name, crew, agent):
            raise CredentialNotFound(name)
        return self.value(name)

    def proxy_credentials(self) -> dict[str, dict[str, SecretValue]]:
        """crew -> provider -> value, for every crew-wide grant of a provider credential that is
        not revoked: what the proxy injects. Agent-specific grants are the keeper's only (the
        proxy serves a crew's agents on one gateway and cannot tell them apart)."""
        rows = self._db.execute(
            "SELECT c.name, c.provider, c.kind, c.level, c.version, c.nonce, c.ciphertext, "
            "g.crew FROM credentials c JOIN grants g ON g.name = c.name "
            "WHERE g.agent = '' AND c.revoked IS NULL AND c.provider IN (?, ?, ?) "
            "ORDER BY g.crew, c.provider",
            PROXY_PROVIDERS,
        ).fetchall()
        out: dict[str, dict[str, SecretValue]] = {}
        for row in rows:
            out.setdefault(str(row[7]), {})[str(row[1])] = self._open_row(tuple(row))
        return out

    # -- changing -----------------------------------------------------------------------------

    def add(
        self,
        name: str,
        provider: str,
        value: bytes | bytearray | SecretValue,
        *,
        level: Level | str = Level.L3,
        kind: Kind | str | None = None,
    ) -> CredentialInfo:
        check_name(name, "name")
        check_provider(provider)
        level = _level(level)
        plain = value.reveal() if isinstance(value, SecretValue) else bytes(value)
        check_value(plain, provider)
        kind = default_kind(provider, plain) if kind is None else _kind(kind)
        now = time.time()
        nonce, ciphertext = self._seal(plain, name, provider, kind.value, level.value, 1)
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM credentials WHERE name = ?", (name,)).fetchone():
                raise CredentialExists(name)
            db.execute(
                "INSERT INTO credentials (name, provider, kind, level, version, nonce, "
                "ciphertext, created, rotated, revoked) VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?, NULL)",
                (name, provider, kind.value, level.value, nonce, ciphertext, now, now),
            )
        return self.info(name)

    def rotate(
        self, name: str, value: bytes | bytearray | SecretValue, *, level: Level | str | None = None
    ) -> CredentialInfo:
        """A new value under version + 1 (and a fresh nonce); clears a revocation. The old value
        must still authenticate: a tampered record is not silently replaced by a rotation."""
        plain = value.reveal() if isinstance(value, SecretValue) else bytes(value)
        with self._transaction() as db:
            row = self._row(name)
            provider, kind = str(row[1]), str(row[2])
            new_level = str(row[3]) if level is None else _level(level).value
            check_value(plain, provider)
            version = int(str(row[4])) + 1
            nonce, ciphertext = self._seal(plain, name, provider, kind, new_level, version)
            db.execute(
                "UPDATE credentials SET level = ?, version = ?, nonce = ?, ciphertext = ?, "
                "rotated = ?, revoked = NULL WHERE name = ?",
                (new_level, version, nonce, ciphertext, time.time(), name),
            )
        return self.info(name)

    def grant(self, name: str, crew: str, agent: str | None = None) -> CredentialInfo:
        check_name(crew, "crew")
        if agent is not None:
            check_name(agent, "agent")
        with self._transaction() as db:
            row = self._row(name)
            provider = str(row[1])
            if row[9] is not None:
                raise CredentialConflict(f"credential {name!r} is revoked; rotate it first")
            if agent is None and provider in PROXY_PROVIDERS:
                other = db.execute(
                    "SELECT c.name FROM credentials c JOIN grants g ON g.name = c.name "
                    "WHERE g.crew = ? AND g.agent = '' AND c.provider = ? AND c.name != ? "
                    "AND c.revoked IS NULL",
                    (crew, provider, name),
                ).fetchone()
                if other is not None:
                    raise CredentialConflict(
                        f"crew {crew!r} already has the {provider} credential {other[0]!r}; "
                        "revoke it from the crew first (the proxy injects one per provider)"
                    )
            db.execute(
                "INSERT OR IGNORE INTO grants (name, crew, agent, granted) VALUES (?, ?, ?, ?)",
                (name, crew, agent or "", time.time()),
            )
        return self.info(name)

    def revoke(
        self, name: str, crew: str | None = None, agent: str | None = None
    ) -> CredentialInfo:
        """Without a crew: every grant removed and the credential marked revoked. With one: that
        crew's grants (only the agent's, if given)."""
        if crew is not None:
            check_name(crew, "crew")
        if agent is not None:
            if crew is None:
                raise InvalidCredential("agent: needs a crew")
            check_name(agent, "agent")
        with self._transaction() as db:
            self._row(name)
            if crew is None:
                db.execute("DELETE FROM grants WHERE name = ?", (name,))
                db.execute("UPDATE credentials SET revoked = ? WHERE name = ?", (time.time(), name))
            elif agent is None:
                db.execute("DELETE FROM grants WHERE name = ? AND crew = ?", (name, crew))
            else:
                db.execute(
                    "DELETE FROM grants WHERE name = ? AND crew = ? AND agent = ?",
                    (name, crew, agent),
                )
        return self.info(name)


def _level(level: Level | str) -> Level:
    try:
        return level if isinstance(level, Level) else Level(level)
    except ValueError:
        raise InvalidCredential(f"level: {level!r} is not L1, L2 or L3") from None


def _kind(kind: Kind | str) -> Kind:
    try:
        return kind if isinstance(kind, Kind) else Kind(kind)
    except ValueError:
        raise InvalidCredential(
            f"kind: {kind!r} is not one of {', '.join(k.value for k in Kind)}"
        ) from None
