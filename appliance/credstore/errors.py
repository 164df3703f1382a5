"""The credential store's errors: one base, never raised directly. Messages name the credential,
the file or the setting, never a value or a key. Each carries the admin API status it maps to
(as appliance/daemon/errors.py does), so the daemon forwards them without a table."""

from __future__ import annotations


class CredStoreError(Exception):
    """Base of every error of appliance.credstore; never raised directly."""

    status = 500
    code = "credentials"


class KeyUnusable(CredStoreError):
    """The encryption key is missing, malformed, or its file is unsafe."""

    status = 500
    code = "credential_key"


class WrongKey(CredStoreError):
    """The store was written with another key (its check record does not open)."""

    status = 500
    code = "credential_key"


class TamperedRecord(CredStoreError):
    """A record does not authenticate: ciphertext, nonce or identity changed, or wrong key."""

    status = 500
    code = "credential_tampered"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"credential {name!r} does not authenticate: its record was altered (ciphertext, "
            "nonce, identity or sealed access state) or was written with another key; rotate "
            "it to replace it"
        )


class TamperedCrewCA(CredStoreError):
    """A crew CA's record does not authenticate (altered, moved to another crew, paired with
    another certificate, or written with another key)."""

    status = 500
    code = "credential_tampered"

    def __init__(self, crew: str) -> None:
        self.crew = crew
        super().__init__(
            f"the CA of crew {crew!r} does not authenticate: its record was altered or written "
            "with another key; recreate the crew to give it a new CA"
        )


class TamperedGrant(CredStoreError):
    """A grant row that would let a crew use a credential does not verify (forged, edited,
    copied from another credential, replayed from before a revocation, or unsealed): refused."""

    status = 500
    code = "grant_tampered"

    def __init__(self, name: str, crew: str, agent: str | None, reason: str) -> None:
        self.name = name
        self.crew = crew
        self.agent = agent
        self.reason = reason
        who = f"crew {crew!r}" + (f" (agent {agent!r})" if agent else "")
        if reason == "unsealed":
            remedy = (
                "it carries no seal (it predates sealed grants, or its seal was removed); "
                "if it is genuine, grant it again"
            )
        else:
            remedy = (
                f"it {reason}: it was added or altered without the store key; revoke it, and "
                "grant it again if it is genuine"
            )
        super().__init__(f"grant of credential {name!r} to {who} is refused: {remedy}")


class InvalidCredential(CredStoreError):
    """A request argument is invalid; the message names the argument."""

    status = 400
    code = "invalid"


class CredentialNotFound(CredStoreError):
    status = 404
    code = "not_found"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no credential named {name!r}")


class CredentialExists(CredStoreError):
    status = 409
    code = "exists"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"a credential named {name!r} already exists (rotate it instead)")


class CredentialConflict(CredStoreError):
    """The operation contradicts the store's state (granting a revoked credential, two
    credentials of one provider for one crew)."""

    status = 409
    code = "conflict"
