"""Signed exports: a range of the journal as JSON lines that verifies offline.

Theory of operation
-------------------
An export is three kinds of line:

    {"export": ExportHeader}    what was asked (since, until, crew), the appliance's public key,
                                the journal's checkpoints (what retention removed before), and
                                the result of verifying the live journal just before
    Row ...                     the selected entries in seq order, as stored (prev_hash, hash)
    {"export_end": ExportEnd}   how many rows, the first and last seq, sha256 over every line
                                before this one, and an Ed25519 signature over all of that

Each row carries its own prev_hash, so its hash is recomputed from it alone; rows adjacent in
seq must link. An export filtered by time only is contiguous, so the whole range is a chain
whose first link the signed trailer vouches for; one filtered by crew has gaps, and there the
signature (made by applianced, which verified the journal first: `verified` in the header) binds
the rows that are there. A missing or cut trailer, a line added, removed or edited, a key
swapped: the digest or the signature fails, with the reason named (`verify_export`).

Offline, the trusted key is the operator's `--public-key` (written down from `journal verify`
on the appliance); without one the file's own key is used and the report says so: that shows
the file is intact, not who made it.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from . import entries as E
from . import signing
from .rows import CHECKPOINT_TYPE, JournalError, Row, chain_hash, checkpoint_rows, connect

FORMAT = "agent-appliance-journal-export/1"
EXPORT_DOMAIN = b"agent-appliance/journal/v1/export\n"


class ExportFilter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    since: float | None = None  # entries with ts >= since
    until: float | None = None  # ... and ts < until
    crew: str | None = None


class ExportHeader(msgspec.Struct, frozen=True):
    format: str
    taken: float
    filter: ExportFilter
    key: str  # the appliance's journal public key (64 hex digits)
    retired_keys: tuple[str, ...]  # earlier keys it still trusts (checkpoints from before)
    checkpoints: tuple[Row, ...]  # every retention checkpoint of the journal, signed
    verified: bool  # the live journal verified just before the export
    verify_problem: str | None = None


class ExportEnd(msgspec.Struct, frozen=True):
    entries: int
    first_seq: int
    last_seq: int
    last_hash: str
    digest: str  # sha256 over every line before this one, newlines included
    signature: str  # Ed25519 over export_message(this, signature "")


class _HeaderLine(msgspec.Struct, frozen=True):
    export: ExportHeader


class _EndLine(msgspec.Struct, frozen=True):
    export_end: ExportEnd


class ExportReport(msgspec.Struct, frozen=True):
    ok: bool
    entries: int
    first_seq: int
    last_seq: int
    key: str
    key_trusted: bool  # False: checked against the file's own key only
    filter: ExportFilter | None = None
    checkpoints: int = 0
    journal_verified: bool | None = None  # what applianced found before it exported
    problem: str | None = None


_encoder = msgspec.json.Encoder(order="deterministic")


def export_message(end: ExportEnd) -> bytes:
    return EXPORT_DOMAIN + _encoder.encode(msgspec.structs.replace(end, signature=""))


_COLUMNS = (
    "seq, ts, type, workspace, crew, agent, mission, trace_id, summary, payload, prev_hash, hash"
)


def _select(conn: sqlite3.Connection, where: ExportFilter) -> Iterator[Row]:
    clauses: list[str] = ["1"]
    args: list[float | str] = []
    if where.since is not None:
        clauses.append("ts >= ?")
        args.append(where.since)
    if where.until is not None:
        clauses.append("ts < ?")
        args.append(where.until)
    if where.crew is not None:
        clauses.append("crew = ?")
        args.append(where.crew)
    where_sql = " AND ".join(clauses)
    sql = f"SELECT {_COLUMNS} FROM entries WHERE {where_sql} ORDER BY seq"  # noqa: S608
    cursor = conn.execute(sql, args)
    while page := cursor.fetchmany(1000):
        yield from (Row(*r) for r in page)


def export_lines(
    path: Path,
    signer: signing.Signer,
    where: ExportFilter,
    *,
    retired_keys: tuple[str, ...] = (),
    verified: bool,
    verify_problem: str | None = None,
) -> Iterator[bytes]:
    """The export's lines (each ends in a newline), read from one snapshot of the journal."""
    conn = connect(path, readonly=True)
    try:
        conn.execute("BEGIN")
        header = ExportHeader(
            format=FORMAT,
            taken=time.time(),
            filter=where,
            key=signer.public,
            retired_keys=retired_keys,
            checkpoints=tuple(checkpoint_rows(conn)),
            verified=verified,
            verify_problem=verify_problem,
        )
        digest = hashlib.sha256()
        line = _encoder.encode(_HeaderLine(header)) + b"\n"
        digest.update(line)
        yield line
        count, first, last, last_hash = 0, 0, 0, ""
        for row in _select(conn, where):
            line = _encoder.encode(row) + b"\n"
            digest.update(line)
            yield line
            count += 1
            first = first or row.seq
            last, last_hash = row.seq, row.hash
        end = ExportEnd(count, first, last, last_hash, digest.hexdigest(), "")
        end = msgspec.structs.replace(end, signature=signer.sign(export_message(end)))
        yield _encoder.encode(_EndLine(end)) + b"\n"
    finally:
        conn.close()


_header_decoder = msgspec.json.Decoder(_HeaderLine)
_end_decoder = msgspec.json.Decoder(_EndLine)
_row_decoder = msgspec.json.Decoder(Row)


class _Bad(Exception):
    pass


def is_export(first_line: bytes) -> bool:
    return first_line.lstrip().startswith(b'{"export":')


def verify_export(lines: Iterable[bytes], keys: Iterable[str] = ()) -> ExportReport:
    """Check an export offline; `keys`: the trusted public keys (empty: the file's own)."""
    trusted = tuple(keys)
    state = _State()
    try:
        _check(lines, trusted, state)
    except _Bad as exc:
        return state.report(str(exc), trusted)
    return state.report(None, trusted)


class _State:
    def __init__(self) -> None:
        self.header: ExportHeader | None = None
        self.count = 0
        self.first = 0
        self.last = 0
        self.checkpoints = 0

    def report(self, problem: str | None, trusted: tuple[str, ...]) -> ExportReport:
        header = self.header
        return ExportReport(
            ok=problem is None,
            entries=self.count,
            first_seq=self.first,
            last_seq=self.last,
            key=header.key if header else "",
            key_trusted=bool(trusted) and header is not None and header.key in trusted,
            filter=header.filter if header else None,
            checkpoints=self.checkpoints,
            journal_verified=header.verified if header else None,
            problem=problem,
        )


def _check(lines: Iterable[bytes], trusted: tuple[str, ...], state: _State) -> None:
    digest = hashlib.sha256()
    end: ExportEnd | None = None
    prev: Row | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if end is not None:
            raise _Bad(f"line {number}: lines after the signed end of the export")
        if number == 1:
            try:
                state.header = _header_decoder.decode(line).export
            except msgspec.DecodeError as exc:
                raise _Bad(f"line 1 is not an export header: {exc}") from None
            if state.header.format != FORMAT:
                raise _Bad(f"line 1: unknown export format {state.header.format!r}")
            key = state.header.key
            if trusted and key not in trusted:
                raise _Bad(f"the export is signed by key {key[:16]}..., which is not trusted")
            for row in state.header.checkpoints:
                why = _checkpoint_problem(row, (key, *state.header.retired_keys))
                if why:
                    raise _Bad(f"the header's checkpoint {row.seq}: {why}")
            digest.update(line)
            continue
        if line.lstrip().startswith(b'{"export_end":'):
            try:
                end = _end_decoder.decode(line).export_end
            except msgspec.DecodeError as exc:
                raise _Bad(f"line {number}: unreadable end of export: {exc}") from None
            continue
        try:
            row = _row_decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise _Bad(f"line {number} is not a journal row: {exc}") from None
        digest.update(line)
        _check_row(row, prev, state)
        prev = row
    header = state.header
    if header is None:
        raise _Bad("the export is empty")
    if end is None:
        raise _Bad(
            f"truncated: the export ends after {state.count} rows (seq {state.last}) without "
            "its signed end line"
        )
    if digest.hexdigest() != end.digest:
        raise _Bad("the rows differ from what was exported: their digest does not match")
    if (end.entries, end.first_seq, end.last_seq) != (state.count, state.first, state.last):
        raise _Bad(
            f"the end line names {end.entries} rows ({end.first_seq}..{end.last_seq}); the "
            f"file holds {state.count} ({state.first}..{state.last})"
        )
    if prev is not None and prev.hash != end.last_hash:
        raise _Bad(f"entry {prev.seq} does not have the hash the end line names")
    if not signing.signature_valid(header.key, export_message(end), end.signature):
        raise _Bad("the export's signature does not verify (its end line was edited)")


def _check_row(row: Row, prev: Row | None, state: _State) -> None:
    header = state.header
    assert header is not None
    if chain_hash(row.prev_hash, row.seq, row.summary, row.payload) != row.hash:
        raise _Bad(f"entry {row.seq}: content does not match its hash")
    try:
        entry = E.decode(row.payload)
    except msgspec.DecodeError as exc:
        raise _Bad(f"entry {row.seq}: payload unreadable: {exc}") from None
    tag = str(type(entry).__struct_config__.tag)
    scope = (entry.workspace, entry.crew, entry.agent, entry.mission, entry.trace_id)
    columns = (row.ts, row.type, row.workspace, row.crew, row.agent, row.mission, row.trace_id)
    if columns != (entry.ts, tag, *scope):
        raise _Bad(f"entry {row.seq}: columns differ from its payload")
    if prev is not None:
        if row.seq <= prev.seq:
            raise _Bad(f"entry {row.seq} comes after entry {prev.seq}: reordered")
        if row.seq == prev.seq + 1 and row.prev_hash != prev.hash:
            raise _Bad(f"entry {row.seq} does not link to entry {prev.seq}")
        if row.seq != prev.seq + 1 and header.filter.crew is None:
            raise _Bad(f"entries {prev.seq + 1}..{row.seq - 1} are missing")
    if row.type == CHECKPOINT_TYPE:
        why = _checkpoint_problem(row, (header.key, *header.retired_keys))
        if why:
            raise _Bad(f"checkpoint {row.seq}: {why}")
        state.checkpoints += 1
    state.count += 1
    state.first = state.first or row.seq
    state.last = row.seq


def _checkpoint_problem(row: Row, keys: tuple[str, ...]) -> str | None:
    try:
        entry = E.decode(row.payload)
    except msgspec.DecodeError:
        return "payload unreadable"
    if not isinstance(entry, E.Checkpoint):
        return "not a checkpoint"
    if chain_hash(row.prev_hash, row.seq, row.summary, row.payload) != row.hash:
        return "content does not match its hash"
    return signing.check_checkpoint(entry, keys)


def read_lines(path: Path) -> Iterator[bytes]:
    try:
        with open(path, "rb") as file:
            yield from file
    except OSError as exc:
        raise JournalError(f"cannot read {path}: {exc.strerror}") from None


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}


def parse_time(text: str, *, now: float | None = None) -> float:
    """A time as the CLI takes it: seconds since the epoch, an ISO 8601 date or date-time (UTC
    unless it names its zone), or an age (`30m`, `12h`, `7d`: that long before now);
    ValueError naming the forms."""
    import datetime

    value = text.strip()
    if value[-1:] in _UNITS and value[:-1].replace(".", "", 1).isdigit():
        return (time.time() if now is None else now) - float(value[:-1]) * _UNITS[value[-1]]
    try:
        return float(value)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time (seconds since the epoch, 2026-01-31, "
            "2026-01-31T12:00:00+01:00, or an age: 30m, 12h, 7d)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()
