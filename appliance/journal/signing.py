"""The journal's signing key: Ed25519, for retention checkpoints and backup heads.

Theory of operation
-------------------
The hash chain proves order and integrity of what is there, not who wrote it: whoever can
write journal.db can delete its oldest entries and the rest still chains. Retention must delete
them, so a cut must be told from an attack by something the attacker cannot make: a signature.

Why Ed25519 and not an HMAC under a key derived from the credential store's key: verifying an
HMAC needs the secret, so every verifier (an auditor checking an export offline, a restore on
another machine) would hold a key that forges checkpoints, and, derived from the credential key,
one tied to every stored credential. With Ed25519 a verifier needs only the public key (64 hex
digits, printed by `appliancectl journal verify`), which can be written down anywhere; the
private key never leaves applianced's state directory. It also keeps the journal independent of
how the credential key is supplied (`ENCRYPTION_KEY` from a secret manager, a key file).

The key is 32 random bytes (the Ed25519 seed) in `<state_dir>/journal.key` (`[journal]
key_file`), created at first start and checked exactly as the credential store's key file is
(appliance/credstore/keys.py: O_CREAT|O_EXCL, mode 0600, O_NOFOLLOW, refused if others may read
it or root does not own it). Every signed message starts with a domain string of its own, so a
signature over one kind of message is never valid for another.
"""

from __future__ import annotations

import binascii
from collections.abc import Collection
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from appliance.credstore.keys import key_from_file

from . import entries as E

KEY_FILE = "journal.key"
CHECKPOINT_DOMAIN = b"agent-appliance/journal/v1/checkpoint\n"
BACKUP_HEAD_DOMAIN = b"agent-appliance/journal/v1/backup-head\n"


class Signer:
    """applianced's journal key; `public` is its public key as 64 hex digits."""

    def __init__(self, seed: bytes) -> None:
        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        self.public = self._key.public_key().public_bytes_raw().hex()

    def sign(self, message: bytes) -> str:
        return self._key.sign(message).hex()

    def sign_checkpoint(self, checkpoint: E.Checkpoint) -> E.Checkpoint:
        unsigned = msgspec.structs.replace(checkpoint, key=self.public, signature="")
        return msgspec.structs.replace(unsigned, signature=self.sign(checkpoint_message(unsigned)))


def load_signer(path: Path, *, create: bool = True) -> Signer:
    """The key in `path` (created, 0600, if absent and `create`); credstore's KeyUnusable if it
    cannot be used."""
    return Signer(key_from_file(path, create=create))


def checkpoint_message(checkpoint: E.Checkpoint) -> bytes:
    """What a checkpoint's signature covers: its canonical encoding with `signature` empty
    (every field, the head it was cut at and its own time included)."""
    return CHECKPOINT_DOMAIN + E.encode(msgspec.structs.replace(checkpoint, signature=""))


def backup_head_message(head_seq: int, head_hash: str, taken: float) -> bytes:
    return BACKUP_HEAD_DOMAIN + f"{head_seq}\n{head_hash}\n{taken!r}".encode()


def parse_public_key(text: str) -> str:
    """A public key as given by an operator (64 hex digits, optionally `ed25519:` first) in the
    normal form; ValueError naming what is wrong."""
    value = text.strip().lower().removeprefix("ed25519:")
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{text!r}: not a public key (64 hex digits)") from None
    if len(raw) != 32:
        raise ValueError(f"{text!r}: not a public key (64 hex digits, got {len(raw)} bytes)")
    return raw.hex()


def signature_valid(public: str, message: bytes, signature: str) -> bool:
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public))
        key.verify(bytes.fromhex(signature), message)
    except (ValueError, binascii.Error, InvalidSignature):
        return False
    return True


def check_checkpoint(checkpoint: E.Checkpoint, trusted: Collection[str]) -> str | None:
    """None if the checkpoint is signed by a trusted key; else why not (for the report)."""
    if checkpoint.key not in trusted:
        hint = (
            "no key is trusted: give the appliance's public key (`journal verify` on the "
            "appliance prints it)"
            if not trusted
            else "not the appliance's journal key"
        )
        return f"signed by key {checkpoint.key[:16]}..., which is not trusted ({hint})"
    if not signature_valid(checkpoint.key, checkpoint_message(checkpoint), checkpoint.signature):
        return "its signature does not verify"
    return None
