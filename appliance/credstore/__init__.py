"""Credentials encrypted at rest (AES-256-GCM), granted to crews, with security levels.

See store.py for the theory of operation and docs/credentials.md for the format, key handling and
threat model. Nothing here logs; no error message holds a value or a key.
"""

from .errors import (
    CredentialConflict,
    CredentialExists,
    CredentialNotFound,
    CredStoreError,
    InvalidCredential,
    KeyUnusable,
    TamperedCrewCA,
    TamperedGrant,
    TamperedRecord,
    WrongKey,
)
from .keys import key_from_env, key_from_file, load_key, parse_key
from .secret import SecretValue
from .store import (
    PROXY_PROVIDERS,
    CredentialInfo,
    CredentialStore,
    Grant,
    Kind,
    Level,
    RefusedGrant,
)

__all__ = [
    "PROXY_PROVIDERS",
    "CredStoreError",
    "CredentialConflict",
    "CredentialExists",
    "CredentialInfo",
    "CredentialNotFound",
    "CredentialStore",
    "Grant",
    "InvalidCredential",
    "KeyUnusable",
    "Kind",
    "Level",
    "RefusedGrant",
    "SecretValue",
    "TamperedCrewCA",
    "TamperedGrant",
    "TamperedRecord",
    "WrongKey",
    "key_from_env",
    "key_from_file",
    "load_key",
    "parse_key",
]
