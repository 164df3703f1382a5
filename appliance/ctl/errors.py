"""The errors a command raises for main.py to turn into an exit code (context.py re-exports
them; contexts.py and transport.py raise them without importing context.py)."""

from __future__ import annotations

from . import exits


class CtlError(Exception):
    """A failure the command reports (one line) with an exit code of exits.py."""

    def __init__(self, message: str, code: int = exits.FAILURE, kind: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.kind = kind


class UsageError(CtlError):
    def __init__(self, message: str) -> None:
        super().__init__(message, exits.USAGE, "usage")
