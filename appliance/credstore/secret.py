"""`SecretValue`: a credential's plaintext, kept out of every repr, str, log and pickle.

Python cannot promise that no copy of a value survives (the decrypted `bytes`, the JSON a request
body arrived in, the proxy's header strings are all immutable objects the collector frees when it
likes). What this type does: the value lives in one `bytearray` that `wipe()` overwrites with zeros
(and `with` wipes on exit), it never prints, it refuses pickling, and comparing two of them is
constant time. Core dumps of the processes that hold values are disabled (proxycore/privileges.py).
"""

from __future__ import annotations

import hmac
from types import TracebackType
from typing import NoReturn


class SecretValue:
    __slots__ = ("_buffer",)

    def __init__(self, value: bytes | bytearray | memoryview) -> None:
        self._buffer = bytearray(value)

    def reveal(self) -> bytes:
        """A copy of the value, for the one call that needs it (encrypt, send to the proxy)."""
        return bytes(self._buffer)

    def __len__(self) -> int:
        return len(self._buffer)

    def wipe(self) -> None:
        for index in range(len(self._buffer)):
            self._buffer[index] = 0
        self._buffer = bytearray()

    def __enter__(self) -> SecretValue:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.wipe()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SecretValue):
            return NotImplemented
        return hmac.compare_digest(bytes(self._buffer), bytes(other._buffer))

    __hash__ = None  # type: ignore[assignment]  # mutable (wipe): never a dict key

    def __repr__(self) -> str:
        return "SecretValue(<redacted>)"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("a SecretValue is never pickled")
