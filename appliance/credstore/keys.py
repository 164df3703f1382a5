"""The store's 256-bit key: from an environment variable or from a key file.

Theory of operation: `ENCRYPTION_KEY` (the variable name is configurable) holds 32 bytes as hex
(64 digits) or base64 (standard or URL-safe, padded or not); anything else is an error that says
which forms are accepted, never echoing the text. The variable is removed from `os.environ` once
read, so no child (the proxy, an `exec` in a container) inherits it. Without the variable, the key
file is used: created at first start with `O_CREAT | O_EXCL` and mode 0600 (no window in which it
exists with wider permissions, and two starts cannot both create it), 32 random bytes written as
base64. An existing key file is opened with `O_NOFOLLOW` and refused if anyone but its owner can
read or write it, or if its owner is not root (the daemon's user).
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
import stat
from pathlib import Path

from .errors import KeyUnusable

KEY_BYTES = 32


def parse_key(text: str | bytes, *, source: str) -> bytes:
    """32 bytes from hex or base64 text; `source` names where it came from in the error."""
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            raise KeyUnusable(f"{source}: not ASCII text (expected hex or base64)") from None
    text = text.strip()
    candidates: list[bytes] = []
    if len(text) == 2 * KEY_BYTES:
        try:
            candidates.append(bytes.fromhex(text))
        except ValueError:
            pass
    # URL-safe base64 is standard base64 with two letters swapped; padding is optional.
    standard = text.translate(str.maketrans("-_", "+/"))
    standard += "=" * (-len(standard) % 4)
    try:
        candidates.append(base64.b64decode(standard, validate=True))
    except (binascii.Error, ValueError):
        pass
    for key in candidates:
        if len(key) == KEY_BYTES:
            return key
    raise KeyUnusable(
        f"{source}: not a 256-bit key: expected 32 bytes as 64 hex digits or as base64 "
        "(e.g. the output of `openssl rand -base64 32`)"
    )


def key_from_env(variable: str) -> bytes | None:
    """The key in `variable`, or None if it is not set. The variable is removed from the
    environment either way, so children never inherit it."""
    text = os.environ.pop(variable, None)
    if text is None:
        return None
    return parse_key(text, source=f"environment variable {variable}")


def key_from_file(path: Path, *, create: bool = True) -> bytes:
    """Read the key file, or create it (0600, exclusive) if it does not exist and `create`."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if not create:
            raise KeyUnusable(f"key file {path}: does not exist") from None
        return _create_key_file(path)
    except OSError as exc:
        raise KeyUnusable(f"key file {path}: cannot open: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyUnusable(f"key file {path}: not a regular file")
        if info.st_mode & 0o077:
            raise KeyUnusable(
                f"key file {path}: mode {stat.S_IMODE(info.st_mode):04o} lets others read or "
                "write it; it must be 0600 (chmod 600, and consider the key exposed)"
            )
        if info.st_uid not in (0, os.geteuid()):
            raise KeyUnusable(f"key file {path}: owned by uid {info.st_uid}, not root")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return parse_key(data, source=f"key file {path}")


def _create_key_file(path: Path) -> bytes:
    key = secrets.token_bytes(KEY_BYTES)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        # Another process created it between our open and this one: read theirs.
        return key_from_file(path, create=False)
    except OSError as exc:
        raise KeyUnusable(f"key file {path}: cannot create: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # the umask cannot widen it, but be explicit
        os.write(fd, base64.b64encode(key) + b"\n")
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise KeyUnusable(f"key file {path}: cannot write: {exc.strerror}") from None
    os.close(fd)
    return key


def load_key(variable: str | None, path: Path) -> tuple[bytes, str]:
    """(key, where it came from): the variable if set, else the key file (created if absent)."""
    if variable:
        key = key_from_env(variable)
        if key is not None:
            return key, f"environment variable {variable}"
    return key_from_file(path), f"key file {path}"
