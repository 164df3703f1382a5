"""The tamper-evident, append-only journal (docs/journal.md)."""

from . import entries
from .rows import JournalError, Row, chain_hash, export, search, tail
from .store import Journal, JournalClosed, JournalFull, Ticket
from .verify import Problem, VerifyReport, verify, verify_file

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
    "verify_file",
]
