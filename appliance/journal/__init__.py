"""The tamper-evident, append-only journal (docs/journal.md)."""

from . import entries
from .store import (
    Journal,
    JournalClosed,
    JournalError,
    JournalFull,
    Problem,
    Row,
    Ticket,
    VerifyReport,
    chain_hash,
    export,
    search,
    tail,
    verify,
)

__all__ = [
    "Journal",
    "JournalClosed",
    "JournalError",
    "JournalFull",
    "Problem",
    "Row",
    "Ticket",
    "VerifyReport",
    "chain_hash",
    "entries",
    "export",
    "search",
    "tail",
    "verify",
]
