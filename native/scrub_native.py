"""Typed wrapper over the C scrubber engine (`native/src/scrub.c`).

`NativeTables(patterns)` compiles a `Patterns` into the C tables (immutable, shared by every
stream and thread); `.stream()` gives a stream with the same contract as
`scrub_reference.ReferenceStream` (`feed`, `flush`, `pending`), `.scrub(data)` scrubs a whole
input. The output is byte for byte the reference's (`scrub_reference.scrub_whole`) for every
input and chunking; see tests/test_native_scrub.py. `.stream(fold_tables)` gives the whole
scrubber's stream: stage 1 then stage 2 (`scrub_fold_native.NativeFoldTables`) in one C call
per feed (`src/composed.c`; tests/test_scrub_composed.py). `AVAILABLE` is False when the
extension is not built, and `native.scrub` then uses the reference.

Flattening: every byte string the engine needs (literal values, names, shape literals, class
bitmaps, stops, suffixes) goes into one blob; the tables of int32 rows that index it are laid
out in src/scrub.h. Every C return code other than SCRUB_OK raises `ScrubEngineError` (a stream
fed after its flush raises `ScrubStateError`, also a ValueError like the reference's).
"""

from __future__ import annotations

import functools
import threading
from array import array
from typing import Any

from native import scrub_fold_native
from native.scrub_fold_native import NativeFoldTables
from native.scrub_patterns import Patterns, Segment, SegmentKind

try:
    from native._scrub import ffi, lib

    AVAILABLE = True
    _composed_feed = lib.composed_feed
    _unpack = ffi.unpack
except ImportError:  # not built (no C compiler at install time): the reference serves
    ffi = lib = _composed_feed = _unpack = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "NativeStream", "NativeTables", "ScrubEngineError", "ScrubStateError"]

_MESSAGES = {
    -1: "out of memory",
    -2: "the flattened patterns are inconsistent",
    -3: "feed after flush",
    -4: "the stream is in use by another thread",
    -5: "a size does not fit the engine",
    -6: "an earlier call on this stream failed",
}


class ScrubEngineError(RuntimeError):
    """The C engine returned an error code; the message says which."""

    def __init__(self, code: int, message: str | None = None) -> None:
        self.code = code
        super().__init__(message or f"scrub engine: {_MESSAGES.get(code, 'error')} ({code})")


class ScrubStateError(ScrubEngineError, ValueError):
    """A stream used after its flush (the reference raises ValueError for the same)."""


def _raise(code: int, eof: int = 0) -> None:
    if code == -3:
        raise ScrubStateError(code, "flush twice" if eof else "feed after flush")
    raise ScrubEngineError(code)


@functools.lru_cache(maxsize=1024)
def _bitmap(members: frozenset[int]) -> bytes:
    bits = bytearray(32)
    for b in members:
        bits[b >> 3] |= 1 << (b & 7)
    return bytes(bits)


class _Flat:
    """The patterns as one blob and int32 rows (see src/scrub.h)."""

    def __init__(self, patterns: Patterns) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self._interned: dict[bytes, int] = {}
        self._name_index: dict[bytes, int] = {}
        self.names = array("i")
        self.lits = array("i")
        self.shapes = array("i")
        self.segs = array("i")
        self.sufs = array("i")
        for literal in patterns.literals:
            self.lits.extend(
                (
                    self.put(literal.value),
                    len(literal.value),
                    self.name(literal.name.encode()),
                    int(literal.window),
                )
            )
        for shape in patterns.shapes:
            first = len(self.segs) // 11
            for seg in shape.segments:
                self._segment(seg)
            not_after = self.put(_bitmap(shape.not_after)) if shape.not_after else -1
            not_before = self.put(_bitmap(shape.not_before)) if shape.not_before else -1
            self.shapes.extend(
                (
                    first,
                    len(shape.segments),
                    shape.redact_from,
                    shape.redact_to,
                    shape.name_from,
                    shape.optional_from,
                    self.name(shape.name.encode()),
                    not_after,
                    int(shape.check),
                    shape.entropy_k,
                    int(shape.placeholder_filter),
                    not_before,
                )
            )

    def _segment(self, seg: Segment) -> None:
        kind = seg.kind
        lit_off = lit_len = cls_off = stop_off = stop_len = 0
        suf_first = len(self.sufs) // 2
        if kind is SegmentKind.LITERAL:
            lit_off, lit_len = self.put(seg.literal), len(seg.literal)
        elif kind is SegmentKind.CLASS:
            cls_off = self.put(_bitmap(seg.members))
            stop_off, stop_len = self.put(seg.stop), len(seg.stop)
            for suffix in seg.suffixes:
                self.sufs.extend((self.put(suffix.lower()), len(suffix)))
        self.segs.extend(
            (
                int(kind),
                int(seg.fold_case),
                lit_off,
                lit_len,
                cls_off,
                seg.min,
                seg.max,
                stop_off,
                stop_len,
                suf_first,
                len(self.sufs) // 2 - suf_first,
            )
        )

    def put(self, data: bytes) -> int:
        """Offset of data in the blob (equal byte strings are stored once)."""
        offset = self._interned.get(data)
        if offset is None:
            offset = self.size
            self._interned[data] = offset
            self.parts.append(data)
            self.size += len(data)
        return offset

    def name(self, name: bytes) -> int:
        index = self._name_index.get(name)
        if index is None:
            index = len(self.names) // 2
            self._name_index[name] = index
            self.names.extend((self.put(name), len(name)))
        return index

    def blob(self) -> bytes:
        return b"".join(self.parts)


def _int32s(rows: array[int]) -> Any:
    return ffi.from_buffer("int32_t[]", rows) if rows else ffi.NULL


def _composed_error(r: Any, eof: int) -> None:
    """Raise the error of a composed_feed result: stage 1's codes as ScrubEngineError, stage 2's
    as FoldEngineError (what each stage's own wrapper raises)."""
    if r.stage == 2:
        scrub_fold_native._raise(r.rc, eof)
    _raise(r.rc, eof)


def _other(r: Any, data: Any, eof: int) -> bytes:
    """A composed_feed result that is not plain output (composed.h): the input itself, a long
    unchanged end of the input to join, or an error."""
    n = r.len
    if n == lib.COMPOSED_SAME:
        return data if type(data) is bytes else bytes(data)
    if r.rc:
        _composed_error(r, eof)
    view = memoryview(data).cast("B")[r.start : r.end]
    head = r.head
    return b"".join((ffi.buffer(r.out, head), view)) if head else bytes(view)


def _composed_call(cs: Any, data: Any, eof: int) -> bytes:
    """composed_feed on any bytes-like input (the streams' fast paths take bytes only)."""
    buf = data if type(data) is bytes else ffi.from_buffer(data)
    r = _composed_feed(cs, buf, len(buf), eof)
    n = r.len
    if n > 0:
        out: bytes = _unpack(r.out, n)
        return out
    return _other(r, data, eof) if n else b""


def _new_composed(tables: Any, fold: Any) -> Any:
    out = ffi.new("composed_stream **")
    code = lib.composed_new(tables, fold, out)
    if code:
        _raise(code)
    return ffi.gc(out[0], lib.composed_free)


class NativeTables:
    """The C tables for a `Patterns`: immutable, shared by all streams and threads."""

    __slots__ = ("__weakref__", "_local", "_tables", "patterns")

    def __init__(self, patterns: Patterns, *, simd: bool = True) -> None:
        """simd=False: the portable loops even on a CPU with AVX2 (the tests run both)."""
        if not AVAILABLE:
            raise ScrubEngineError(0, "scrub engine: the C extension is not built")
        self.patterns = patterns
        flat = _Flat(patterns)
        blob = flat.blob()
        out = ffi.new("scrub_tables **")
        code = lib.scrub_tables_new(
            blob,
            len(blob),
            _int32s(flat.names),
            len(flat.names) // 2,
            _int32s(flat.lits),
            len(flat.lits) // 4,
            _int32s(flat.shapes),
            len(flat.shapes) // 12,
            _int32s(flat.segs),
            len(flat.segs) // 11,
            _int32s(flat.sufs),
            len(flat.sufs) // 2,
            0 if simd else lib.SCRUB_NO_SIMD,
            out,
        )
        if code:
            _raise(code)
        self._tables = ffi.gc(out[0], lib.scrub_tables_free)
        # One reusable C stream per thread for scrub(). It is freed with this object and does
        # not reference it back (no cycle).
        self._local = threading.local()

    @property
    def footprint(self) -> int:
        """Bytes the C tables take."""
        return int(lib.scrub_tables_footprint(self._tables))

    @property
    def simd(self) -> bool:
        """Whether the scan uses the AVX2 loops."""
        return bool(lib.scrub_tables_simd(self._tables))

    def stream(self, fold: NativeFoldTables | None = None) -> NativeStream:
        """A stream of stage 1 alone, or with `fold`, of stage 1 then that stage 2."""
        return NativeStream(self, fold)

    def scrub(self, data: bytes) -> bytes:
        """The scrubbed form of a complete input (`scrub_reference.scrub_whole`)."""
        cs = getattr(self._local, "stream", None)
        if cs is None:
            cs = self._local.stream = _new_composed(self._tables, ffi.NULL)
        try:
            return _composed_call(cs, data, 1)
        finally:
            lib.composed_reset(cs)


class NativeStream:
    """One stream over shared `NativeTables`: feed chunks, then flush once. With `fold`, the
    scrubber's stage 2 runs on what stage 1 releases, in the same C call (src/composed.c): the
    bytes and the feeds they come out at are `native.scrub.ComposedStream`'s over a stage-1
    stream and a `NativeFoldStream`. Not for concurrent use by several threads (the engine
    refuses a second concurrent call)."""

    __slots__ = ("_cs", "_fold", "_tables")

    def __init__(self, tables: NativeTables, fold: NativeFoldTables | None = None) -> None:
        # The references keep the C tables alive as long as the stream.
        self._tables = tables
        self._fold = fold
        self._cs = _new_composed(tables._tables, ffi.NULL if fold is None else fold._tables)

    @property
    def pending(self) -> int:
        """Input bytes held back (by both stages), waiting to know whether they are a secret."""
        return int(lib.composed_pending(self._cs))

    @property
    def footprint(self) -> int:
        """Bytes the C side of stage 1 holds for this stream (state and pending tail)."""
        return int(lib.scrub_stream_footprint(lib.composed_first(self._cs)))

    # The hot path: one cffi call of four arguments, whose result is this thread's own record
    # (composed.h), read at once; bytes only (cffi refuses anything else with a TypeError, before
    # the C runs: other buffers take the general path).
    def feed(self, chunk: bytes) -> bytes:
        """Scrubbed output that is final now (possibly empty)."""
        try:
            r = _composed_feed(self._cs, chunk, len(chunk), 0)
        except TypeError:
            return _composed_call(self._cs, chunk, 0)
        n = r.len
        if n > 0:
            out: bytes = _unpack(r.out, n)
            return out
        return _other(r, chunk, 0) if n else b""

    def flush(self) -> bytes:
        """The rest, at the end of the stream; the stream takes no more input after it."""
        return _composed_call(self._cs, b"", 1)

    def flush_with(self, data: bytes) -> bytes:
        """`feed(data) + flush()` in one call."""
        return _composed_call(self._cs, data, 1)
