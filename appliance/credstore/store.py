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
that crew, only if a row says so. A crew-wide grant of a provider credential (anthropic, openai,
google) makes the proxy inject it for that crew (`proxy_credentials`); a crew has at most one per
provider, so which key is injected is never ambiguous.

Sealed access state
-------------------
The value's associated data authenticates a credential's identity, but only when the value is
opened; what decides *who gets what* is read without opening it: the grant rows, the `revoked`
mark, the level the keeper reads. Those are sealed too, with HMAC-SHA256 under a key derived from
the store key by HKDF-SHA256 (info `agent-appliance/credstore/v2/seal`: a separate key, so a tag
can never be confused with a GCM computation under the store key):

    credential  epoch   16 random bytes, new at every change of the credential or its grants
                seal    HMAC(["credential", name, provider, kind, level, version, epoch,
                              created, rotated, revoked])
    grant       seal    HMAC(["grant", name, provider, kind, level, version, epoch, crew, agent,
                              granted])

A grant is bound to its credential's whole sealed state through the epoch, so a grant row forged,
edited (crew, agent, time), copied to another credential, or kept from before a revocation and
put back (its epoch is gone) does not verify. Every read checks the seals: a credential whose
seal fails is `TamperedRecord` (and none of its grants count); a grant whose seal fails, or that
has none, is refused (`TamperedGrant` when it is the one a crew asks through; listed under
`CredentialInfo.refused` so `cred ls` names it) and never used: fail closed. Each change re-seals
the grants that verified under the old epoch and only those, so a change never launders a forged
row; `revoke` deletes rows whether they verify or not (revocation must always work).

Stores from before sealing (check record under the v1 associated data) are upgraded once at
open: each credential whose value still authenticates gets an epoch and a seal; grants are *not*
sealed: they are refused ("unsealed") until the operator grants them again. Sealing them at open
would bless whatever rows were in the file at that moment, including one inserted by whoever
could write it, which is exactly the attack sealing closes (docs/credentials.md, "Upgrading").
The check record is then rewritten under the v2 associated data, so a store is upgraded once; an
unsealed credential row in a v2 store is tampering, not history.

Crew CAs (`crew_cas` table): each crew's CA key (appliance/crew_ca.py), sealed with AES-256-GCM
under the same store key, associated data `b"agent-appliance/credstore/v2/crew-ca\0"` + JSON
[crew, SHA-256 of the CA certificate PEM]; the certificate itself is public and kept in clear next
to it. A table of its own, not a credential kind: a credential can be listed, granted to a crew,
read by the keeper (`value_for`) and sent to the proxy (`proxy_credentials`), and a CA key must be
none of these; nothing that reads `credentials` can reach this table. The associated data ties a
key to its crew and its certificate: a row copied to another crew, or paired with another
certificate, does not authenticate (`TamperedCrewCA`).

Revocation: `revoke(name, crew)` removes that crew's grants; `revoke(name)` removes all of them
and marks the credential revoked (it cannot be granted again until it is rotated).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import re
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import (
    CredentialConflict,
    CredentialExists,
    CredentialNotFound,
    InvalidCredential,
    TamperedCrewCA,
    TamperedGrant,
    TamperedRecord,
    WrongKey,
)
from .keys import KEY_BYTES
from .secret import SecretValue

NONCE_BYTES = 12  # 96 bits, the GCM nonce size NIST SP 800-38D recommends
AD_PREFIX = b"agent-appliance/credstore/v1\0"
CHECK_AD_V1 = b"agent-appliance/credstore/v1/key-check\0"  # a store from before sealed grants
CHECK_AD = b"agent-appliance/credstore/v2/key-check\0"
SEAL_KEY_INFO = b"agent-appliance/credstore/v2/seal"
SEAL_PREFIX = b"agent-appliance/credstore/v2/seal\0"
EPOCH_BYTES = 16
CREW_CA_AD = b"agent-appliance/credstore/v2/crew-ca\0"
# Why a grant row is refused (RefusedGrant.reason, TamperedGrant).
UNSEALED = "unsealed"
NOT_AUTHENTIC = "does not authenticate"
CREDENTIAL_REFUSED = "its credential does not authenticate"
CHECK_PLAINTEXT = b"agent-appliance credential store key check"
MAX_VALUE_BYTES = 64 * 1024
# Random nonces: NIST's limit for one key is 2**32 encryptions; a store writes a handful a day.

# The providers the proxy injects for (proxycore.protocol.credentials.Provider); other providers are
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
    revoked REAL,
    epoch BLOB,
    seal BLOB
);
CREATE TABLE IF NOT EXISTS grants (
    name TEXT NOT NULL REFERENCES credentials(name) ON DELETE CASCADE,
    crew TEXT NOT NULL,
    agent TEXT NOT NULL DEFAULT '',  -- '' means every agent of the crew
    granted REAL NOT NULL,
    seal BLOB,
    PRIMARY KEY (name, crew, agent)
);
CREATE TABLE IF NOT EXISTS crew_cas (
    crew TEXT PRIMARY KEY,
    cert_pem BLOB NOT NULL,
    nonce BLOB NOT NULL,
    ciphertext BLOB NOT NULL,
    created REAL NOT NULL
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


class RefusedGrant(msgspec.Struct, frozen=True):
    """A grant row that does not verify: shown to the operator (crew and agent as the row says,
    unauthenticated), never used."""

    crew: str
    agent: str | None
    reason: str  # "unsealed" | "does not authenticate" | "its credential does not authenticate"


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
    grants: tuple[Grant, ...]  # the grants that verify: the only ones ever used
    refused: tuple[RefusedGrant, ...] = ()
    tampered: bool = False  # the credential's own seal fails: unusable until rotated


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


_SELECT = (
    "SELECT name, provider, kind, level, version, nonce, ciphertext, created, rotated, revoked, "
    "epoch, seal FROM credentials"
)


class _Row(msgspec.Struct, frozen=True):
    """A credentials row whose columns have the right types (not yet verified)."""

    name: str
    provider: str
    kind: str
    level: str
    version: int
    nonce: bytes
    ciphertext: bytes
    created: float
    rotated: float
    revoked: float | None
    epoch: bytes | None
    seal: bytes | None


def _parse(row: tuple[object, ...]) -> _Row | None:
    """The row with its types checked; None if a column holds what no write of ours puts there
    (SQLite stores any type in any column: an edit can put text in `version`)."""
    (name, provider, kind, level, version, nonce, ciphertext, created, rotated, revoked) = row[:10]
    epoch, seal = row[10:12]
    texts = (name, provider, kind, level)
    if not all(isinstance(t, str) for t in texts) or type(version) is not int:
        return None
    if not isinstance(nonce, bytes) or not isinstance(ciphertext, bytes):
        return None
    times = (created, rotated) if revoked is None else (created, rotated, revoked)
    if not all(type(t) in (int, float) for t in times):
        return None
    if not (epoch is None or isinstance(epoch, bytes)) or not (
        seal is None or isinstance(seal, bytes)
    ):
        return None
    return _Row(
        name=str(name),
        provider=str(provider),
        kind=str(kind),
        level=str(level),
        version=version,
        nonce=nonce,
        ciphertext=ciphertext,
        created=float(created),  # type: ignore[arg-type]
        rotated=float(rotated),  # type: ignore[arg-type]
        revoked=None if revoked is None else float(revoked),  # type: ignore[arg-type]
        epoch=epoch,
        seal=seal,
    )


class CredentialStore:
    """One open store. Synchronous and quick (a row, an AES call): the daemon calls it from its
    trio thread, as it does the state store."""

    def __init__(self, path: Path, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise InvalidCredential("key: must be 32 bytes")
        self.path = Path(path)
        self._aead = AESGCM(key)
        self._seal_key = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=SEAL_KEY_INFO
        ).derive(key)
        # Grants found unsealed when a store from before sealing was upgraded at this open.
        self.upgraded_unsealed_grants = 0
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
            self._add_seal_columns()
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

    # -- the key check and the upgrade of stores from before sealing --------------------------

    def _add_seal_columns(self) -> None:
        """A v1 file has no epoch/seal columns (CREATE TABLE IF NOT EXISTS kept its tables)."""
        added = (("credentials", "epoch"), ("credentials", "seal"), ("grants", "seal"))
        for table, column in added:
            have = {str(r[1]) for r in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} BLOB")

    def _opens_check(self, nonce: object, sealed: object, ad: bytes) -> bool:
        try:
            return self._aead.decrypt(nonce, sealed, ad) == CHECK_PLAINTEXT  # type: ignore[arg-type]
        except (InvalidTag, ValueError, TypeError):
            return False

    def _check_key(self) -> None:
        row = self._db.execute("SELECT nonce, sealed FROM meta WHERE key = 'check'").fetchone()
        if row is None:
            self._db.execute(
                "INSERT INTO meta (key, nonce, sealed) VALUES ('check', ?, ?)", self._check_record()
            )
            return
        if self._opens_check(row[0], row[1], CHECK_AD):
            return
        if self._opens_check(row[0], row[1], CHECK_AD_V1):
            self._upgrade()
            return
        raise WrongKey(
            f"credential store {self.path}: the key does not open it (the store was written "
            "with another key, or its check record was altered)"
        )

    def _check_record(self) -> tuple[bytes, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        return nonce, self._aead.encrypt(nonce, CHECK_PLAINTEXT, CHECK_AD)

    def _upgrade(self) -> None:
        """Once, for a store from before sealing: seal each credential whose value still
        authenticates (its identity is then proven); leave its grants unsealed, hence refused
        until granted again (see the theory of operation for why)."""
        with self._transaction() as db:
            for raw in db.execute(_SELECT).fetchall():
                row = _parse(tuple(raw))
                if row is None:
                    continue
                try:
                    self._open(row).wipe()
                except TamperedRecord:
                    continue  # stays unsealed: refused as tampered, as it was before
                self._write_state(db, row, epoch=os.urandom(EPOCH_BYTES))
            self.upgraded_unsealed_grants = int(
                db.execute("SELECT count(*) FROM grants WHERE seal IS NULL").fetchone()[0]
            )
            db.execute(
                "UPDATE meta SET nonce = ?, sealed = ? WHERE key = 'check'", self._check_record()
            )

    # -- sealing ------------------------------------------------------------------------------

    def _mac(self, *fields: object) -> bytes:
        message = SEAL_PREFIX + msgspec.json.encode(list(fields))
        return hmac.new(self._seal_key, message, hashlib.sha256).digest()

    def _credential_seal(self, row: _Row, epoch: bytes) -> bytes:
        return self._mac(
            "credential", row.name, row.provider, row.kind, row.level, row.version,
            epoch.hex(), row.created, row.rotated, row.revoked,
        )  # fmt: skip

    def _grant_seal(self, row: _Row, epoch: bytes, crew: str, agent: str, granted: float) -> bytes:
        return self._mac(
            "grant", row.name, row.provider, row.kind, row.level, row.version, epoch.hex(),
            crew, agent, granted,
        )  # fmt: skip

    def _trusted(self, row: _Row | None) -> bool:
        """The credential row's access state (level, revoked, epoch...) is as we sealed it."""
        if row is None or row.epoch is None or row.seal is None or len(row.epoch) != EPOCH_BYTES:
            return False
        return hmac.compare_digest(row.seal, self._credential_seal(row, row.epoch))

    def _write_state(self, db: sqlite3.Connection, row: _Row, *, epoch: bytes) -> _Row:
        """Write the row's state columns (and value) with a new epoch, sealed."""
        sealed = msgspec.structs.replace(row, epoch=epoch, seal=self._credential_seal(row, epoch))
        db.execute(
            "UPDATE credentials SET provider = ?, kind = ?, level = ?, version = ?, nonce = ?, "
            "ciphertext = ?, created = ?, rotated = ?, revoked = ?, epoch = ?, seal = ? "
            "WHERE name = ?",
            (
                sealed.provider, sealed.kind, sealed.level, sealed.version, sealed.nonce,
                sealed.ciphertext, sealed.created, sealed.rotated, sealed.revoked, sealed.epoch,
                sealed.seal, sealed.name,
            ),
        )  # fmt: skip
        return sealed

    def _reseal_grants(self, db: sqlite3.Connection, row: _Row, grants: Iterable[Grant]) -> None:
        """Seal these grants (verified under the old epoch) to the row's new epoch."""
        assert row.epoch is not None
        for grant in grants:
            agent = grant.agent or ""
            db.execute(
                "UPDATE grants SET seal = ? WHERE name = ? AND crew = ? AND agent = ?",
                (self._grant_seal(row, row.epoch, grant.crew, agent, grant.granted), row.name,
                 grant.crew, agent),
            )  # fmt: skip

    def _encrypt(
        self, value: bytes, name: str, provider: str, kind: str, level: str, version: int
    ) -> tuple[bytes, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        ad = associated_data(name, provider, kind, level, version)
        return nonce, self._aead.encrypt(nonce, value, ad)

    def _open(self, row: _Row) -> SecretValue:
        try:
            if len(row.nonce) != NONCE_BYTES:
                raise ValueError("nonce size")
            ad = associated_data(row.name, row.provider, row.kind, row.level, row.version)
            plaintext = self._aead.decrypt(row.nonce, row.ciphertext, ad)
        except (InvalidTag, ValueError, TypeError):
            raise TamperedRecord(row.name) from None
        return SecretValue(plaintext)

    # -- reading ------------------------------------------------------------------------------

    def _raw(self, name: str) -> tuple[object, ...]:
        row = self._db.execute(_SELECT + " WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise CredentialNotFound(name)
        return tuple(row)

    def _verified(self, name: str) -> _Row:
        """The credential's row, its seal verified; TamperedRecord if it does not verify."""
        row = _parse(self._raw(name))
        if row is None or not self._trusted(row):
            raise TamperedRecord(name)
        return row

    def _grants(self, row: _Row | None, name: str) -> tuple[list[Grant], list[RefusedGrant]]:
        """(verified, refused) grants of a credential; `row` None or untrusted: all refused."""
        trusted = row is not None and self._trusted(row)
        verified: list[Grant] = []
        refused: list[RefusedGrant] = []
        for crew, agent, granted, seal in self._db.execute(
            "SELECT crew, agent, granted, seal FROM grants WHERE name = ? ORDER BY crew, agent",
            (name,),
        ):
            shown = RefusedGrant(crew=str(crew), agent=str(agent) or None, reason="")
            if not trusted:
                refused.append(msgspec.structs.replace(shown, reason=CREDENTIAL_REFUSED))
                continue
            assert row is not None and row.epoch is not None
            if seal is None:
                refused.append(msgspec.structs.replace(shown, reason=UNSEALED))
                continue
            well_typed = (
                isinstance(crew, str)
                and isinstance(agent, str)
                and type(granted) in (int, float)
                and isinstance(seal, bytes)
            )
            if not well_typed or not hmac.compare_digest(
                seal, self._grant_seal(row, row.epoch, crew, agent, float(granted))
            ):
                refused.append(msgspec.structs.replace(shown, reason=NOT_AUTHENTIC))
                continue
            verified.append(Grant(crew=crew, agent=agent or None, granted=float(granted)))
        return verified, refused

    def values_to_scrub(self) -> list[tuple[str, SecretValue]]:
        """(name, value) of every credential whose value authenticates, whatever its access
        state: what must never reach an agent or the journal (scrubbing more is safe; a
        credential refused for use is still a secret). The caller wipes them."""
        out: list[tuple[str, SecretValue]] = []
        for raw in self._db.execute(_SELECT + " ORDER BY name").fetchall():
            row = _parse(tuple(raw))
            if row is None:
                continue
            try:
                out.append((row.name, self._open(row)))
            except TamperedRecord:
                continue
        return out

    def info(self, name: str) -> CredentialInfo:
        return self._info(self._raw(name))

    def _info(self, raw: tuple[object, ...]) -> CredentialInfo:
        """Never raises for tampering: an operator listing the store must see what is wrong."""
        name = str(raw[0])
        row = _parse(raw)
        grants, refused = self._grants(row, name)
        if row is None:
            return CredentialInfo(
                name=name, provider=str(raw[1]), kind=str(raw[2]), level=str(raw[3]),
                version=0, created=0.0, rotated=0.0, revoked=None, grants=(),
                refused=tuple(refused), tampered=True,
            )  # fmt: skip
        return CredentialInfo(
            name=name,
            provider=row.provider,
            kind=row.kind,
            level=row.level,
            version=row.version,
            created=row.created,
            rotated=row.rotated,
            revoked=row.revoked,
            grants=tuple(grants),
            refused=tuple(refused),
            tampered=not self._trusted(row),
        )

    def list(self) -> list[CredentialInfo]:
        rows = self._db.execute(_SELECT + " ORDER BY name").fetchall()
        return [self._info(tuple(row)) for row in rows]

    def value(self, name: str) -> SecretValue:
        """The value, authenticated; the caller wipes it when done. No grant check: for the
        daemon's own use (the proxy's map); a crew's request goes through `value_for`."""
        return self._open(self._verified(name))

    def is_granted(self, name: str, crew: str, agent: str | None = None) -> bool:
        """Whether a grant that verifies lets `crew` (and `agent`) use the credential. A grant
        row that would, but does not verify, raises TamperedGrant (never True); a credential
        whose own seal fails raises TamperedRecord."""
        try:
            row = self._verified(name)
        except CredentialNotFound:
            return False
        if row.revoked is not None:
            return False
        grants, refused = self._grants(row, name)

        def matches(grant_crew: str, grant_agent: str | None) -> bool:
            return grant_crew == crew and (grant_agent is None or grant_agent == agent)

        if any(matches(g.crew, g.agent) for g in grants):
            return True
        for bad in refused:
            if matches(bad.crew, bad.agent):
                raise TamperedGrant(name, bad.crew, bad.agent, bad.reason)
        return False

    def value_for(self, name: str, crew: str, agent: str | None = None) -> SecretValue:
        """The value if `crew` (and `agent`) holds a grant that verifies; else
        CredentialNotFound, the same answer as for a credential that does not exist (a crew
        learns nothing of others'), or TamperedGrant/TamperedRecord (never the value)."""
        if not self.is_granted(name, crew, agent):
            raise CredentialNotFound(name)
        return self.value(name)

    def proxy_credentials(self) -> dict[str, dict[str, SecretValue]]:
        """crew -> provider -> value, for every crew-wide grant of a provider credential that is
        not revoked and verifies: what the proxy injects. Agent-specific grants are the keeper's
        only (the proxy serves a crew's agents on one gateway and cannot tell them apart). A
        credential or grant that does not verify is left out (`list()` names it); so is a crew
        with two verified grants of one provider (only a rollback of the file to an older
        state can make one): which key to inject would be ambiguous, so neither is."""
        rows = self._db.execute(
            _SELECT + " WHERE provider IN (?, ?, ?) ORDER BY name",
            PROXY_PROVIDERS,
        ).fetchall()
        out: dict[str, dict[str, SecretValue]] = {}
        ambiguous: set[tuple[str, str]] = set()
        for raw in rows:
            row = _parse(tuple(raw))
            if row is None or not self._trusted(row) or row.revoked is not None:
                continue
            crews = [g.crew for g in self._grants(row, row.name)[0] if g.agent is None]
            if not crews:
                continue
            try:
                value = self._open(row)
            except TamperedRecord:
                continue
            with value:
                for crew in crews:
                    if row.provider in out.get(crew, {}):
                        ambiguous.add((crew, row.provider))
                    out.setdefault(crew, {})[row.provider] = SecretValue(value.reveal())
        for crew, provider in ambiguous:
            out[crew].pop(provider).wipe()
            if not out[crew]:
                del out[crew]
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
        nonce, ciphertext = self._encrypt(plain, name, provider, kind.value, level.value, 1)
        row = _Row(
            name=name, provider=provider, kind=kind.value, level=level.value, version=1,
            nonce=nonce, ciphertext=ciphertext, created=now, rotated=now, revoked=None,
            epoch=None, seal=None,
        )  # fmt: skip
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM credentials WHERE name = ?", (name,)).fetchone():
                raise CredentialExists(name)
            db.execute(
                "INSERT INTO credentials (name, provider, kind, level, version, nonce, "
                "ciphertext, created, rotated, revoked) VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?, NULL)",
                (name, provider, kind.value, level.value, nonce, ciphertext, now, now),
            )
            self._write_state(db, row, epoch=os.urandom(EPOCH_BYTES))
        return self.info(name)

    def rotate(
        self, name: str, value: bytes | bytearray | SecretValue, *, level: Level | str | None = None
    ) -> CredentialInfo:
        """A new value under version + 1 (and a fresh nonce and epoch); clears a revocation.
        Works on a record that no longer authenticates (it is how the operator replaces one:
        the old value is not needed); then none of its grants is carried over (none can be
        trusted): the operator grants it again."""
        plain = value.reveal() if isinstance(value, SecretValue) else bytes(value)
        with self._transaction() as db:
            raw = self._raw(name)
            row = _parse(raw)
            if row is None:
                raise TamperedRecord(name)  # not even a row we could have written
            keep = self._grants(row, name)[0]  # [] unless the row verifies
            new_level = row.level if level is None else _level(level).value
            check_value(plain, row.provider)
            version = row.version + 1
            nonce, ciphertext = self._encrypt(
                plain, name, row.provider, row.kind, new_level, version
            )
            new = msgspec.structs.replace(
                row, level=new_level, version=version, nonce=nonce, ciphertext=ciphertext,
                rotated=time.time(), revoked=None,
            )  # fmt: skip
            new = self._write_state(db, new, epoch=os.urandom(EPOCH_BYTES))
            self._reseal_grants(db, new, keep)
        return self.info(name)

    def grant(self, name: str, crew: str, agent: str | None = None) -> CredentialInfo:
        """Seal a grant; a row already there for (crew, agent) that does not verify is replaced
        by the sealed one (the operator vouches for it now: this is how an unsealed grant from
        before sealing is brought back)."""
        check_name(crew, "crew")
        if agent is not None:
            check_name(agent, "agent")
        with self._transaction() as db:
            row = self._verified(name)
            if row.revoked is not None:
                raise CredentialConflict(f"credential {name!r} is revoked; rotate it first")
            if agent is None and row.provider in PROXY_PROVIDERS:
                other = self._crew_wide_holder(crew, row.provider, besides=name)
                if other is not None:
                    raise CredentialConflict(
                        f"crew {crew!r} already has the {row.provider} credential {other!r}; "
                        "revoke it from the crew first (the proxy injects one per provider)"
                    )
            keep = self._grants(row, name)[0]
            granted = next(
                (g.granted for g in keep if g.crew == crew and g.agent == agent), time.time()
            )
            keep = [g for g in keep if not (g.crew == crew and g.agent == agent)]
            new = self._write_state(db, row, epoch=os.urandom(EPOCH_BYTES))
            assert new.epoch is not None
            db.execute(
                "INSERT OR REPLACE INTO grants (name, crew, agent, granted, seal) "
                "VALUES (?, ?, ?, ?, ?)",
                (name, crew, agent or "", granted,
                 self._grant_seal(new, new.epoch, crew, agent or "", granted)),
            )  # fmt: skip
            self._reseal_grants(db, new, keep)
        return self.info(name)

    def _crew_wide_holder(self, crew: str, provider: str, *, besides: str) -> str | None:
        """The other credential of `provider` the crew holds a verified crew-wide grant of."""
        for raw in self._db.execute(
            _SELECT + " WHERE provider = ? AND name != ? ORDER BY name",
            (provider, besides),
        ).fetchall():
            row = _parse(tuple(raw))
            if row is None or row.revoked is not None:
                continue
            if any(g.crew == crew and g.agent is None for g in self._grants(row, row.name)[0]):
                return row.name
        return None

    # -- crew CAs (see the theory of operation) ------------------------------------------------

    def put_crew_ca(self, crew: str, cert_pem: bytes, key_pem: SecretValue) -> None:
        """Keep `crew`'s CA (replacing any it had: a rotation)."""
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, key_pem.reveal(), _crew_ca_ad(crew, cert_pem))
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO crew_cas (crew, cert_pem, nonce, ciphertext, created) "
                "VALUES (?, ?, ?, ?, ?)",
                (crew, cert_pem, nonce, sealed, time.time()),
            )

    def crew_ca(self, crew: str) -> tuple[bytes, SecretValue] | None:
        """(certificate PEM, key PEM) of `crew`'s CA, None if it has none; TamperedCrewCA if
        its row does not authenticate (never a key that might not be the one we sealed)."""
        row = self._db.execute(
            "SELECT cert_pem, nonce, ciphertext FROM crew_cas WHERE crew = ?", (crew,)
        ).fetchone()
        if row is None:
            return None
        cert_pem, nonce, sealed = row
        try:
            if not isinstance(cert_pem, bytes) or len(nonce) != NONCE_BYTES:
                raise ValueError("row types")
            key_pem = self._aead.decrypt(nonce, sealed, _crew_ca_ad(crew, cert_pem))
        except (InvalidTag, ValueError, TypeError):
            raise TamperedCrewCA(crew) from None
        return cert_pem, SecretValue(key_pem)

    def crew_ca_names(self) -> tuple[str, ...]:
        return tuple(str(r[0]) for r in self._db.execute("SELECT crew FROM crew_cas ORDER BY crew"))

    def delete_crew_ca(self, crew: str) -> None:
        """Idempotent."""
        with self._transaction() as db:
            db.execute("DELETE FROM crew_cas WHERE crew = ?", (crew,))

    def revoke(
        self, name: str, crew: str | None = None, agent: str | None = None
    ) -> CredentialInfo:
        """Without a crew: every grant removed and the credential marked revoked. With one: that
        crew's grants (only the agent's, if given). Rows are removed whether they verify or
        not, and on a credential that no longer authenticates too: revocation always works."""
        if crew is not None:
            check_name(crew, "crew")
        if agent is not None:
            if crew is None:
                raise InvalidCredential("agent: needs a crew")
            check_name(agent, "agent")
        with self._transaction() as db:
            row = _parse(self._raw(name))
            keep = self._grants(row, name)[0]
            if crew is None:
                db.execute("DELETE FROM grants WHERE name = ?", (name,))
                keep = []
            elif agent is None:
                db.execute("DELETE FROM grants WHERE name = ? AND crew = ?", (name, crew))
                keep = [g for g in keep if g.crew != crew]
            else:
                db.execute(
                    "DELETE FROM grants WHERE name = ? AND crew = ? AND agent = ?",
                    (name, crew, agent),
                )
                keep = [g for g in keep if (g.crew, g.agent) != (crew, agent)]
            revoked = time.time() if crew is None else None
            if row is not None and self._trusted(row):
                if revoked is not None:
                    row = msgspec.structs.replace(row, revoked=revoked)
                new = self._write_state(db, row, epoch=os.urandom(EPOCH_BYTES))
                self._reseal_grants(db, new, keep)
            elif revoked is not None:
                # Marked, not sealed: the row stays refused (sealing it would bless the edit).
                db.execute("UPDATE credentials SET revoked = ? WHERE name = ?", (revoked, name))
        return self.info(name)


def _crew_ca_ad(crew: str, cert_pem: bytes) -> bytes:
    return CREW_CA_AD + msgspec.json.encode([crew, hashlib.sha256(cert_pem).hexdigest()])


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
