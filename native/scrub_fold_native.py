"""Typed wrapper over the C fold engine (`native/src/fold.c`), the scrubber's second stage.

The C is compiled into native._scrub with stage 1 (one module: `scrub_native.NativeStream`
runs both stages in one call on tables built here); this module drives stage 2 alone.

`NativeFoldTables(secrets)` computes the secrets' folded forms with the reference
(`scrub_fold.qualified_pieces`) and hands them to C flattened (src/fold.h), which makes the
windows; `.stream()` gives a stream with the contract of
`scrub_fold.FoldStream` (`feed`, `flush`, `pending`), `.scrub(data)` scrubs a whole input. The
output is byte for byte the reference's, and each feed releases what the reference's releases
(tests/test_scrub_fold.py, fuzz/fuzz_scrub_fold_differential.py). `AVAILABLE` is False when the
extension is not built, or was built with other constants than the reference's; `native.scrub`
then uses the reference. Every C return code other than FOLD_OK raises `FoldEngineError` (a
stream fed after its flush raises `FoldStateError`, also a ValueError like the reference's).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable
from typing import Any

from native import scrub_fold

try:
    from native._scrub import ffi, lib

    _consts = ffi.new("int32_t[8]")
    _CONSTANTS = tuple(_consts[k] for k in range(lib.fold_constants(_consts, 8)))
    AVAILABLE = _CONSTANTS == (
        scrub_fold.W,
        scrub_fold.MIN_SHORT,
        scrub_fold.MAX_GAP,
        scrub_fold.GAP_BYTES,
        scrub_fold.GROUP_CAP,
        scrub_fold.ANSI_CSI_MAX,
        scrub_fold.ANSI_OSC_MAX,
    )
except ImportError:  # not built: the reference serves
    ffi = lib = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "FoldEngineError", "FoldStateError", "NativeFoldStream", "NativeFoldTables"]

_MESSAGES = {
    -1: "out of memory",
    -2: "the flattened windows are inconsistent",
    -3: "feed after flush",
    -4: "the stream is in use by another thread",
    -5: "a size does not fit the engine",
    -6: "an earlier call on this stream failed",
}


class FoldEngineError(RuntimeError):
    """The C engine returned an error code; the message says which."""

    def __init__(self, code: int, message: str | None = None) -> None:
        self.code = code
        super().__init__(message or f"fold engine: {_MESSAGES.get(code, 'error')} ({code})")


class FoldStateError(FoldEngineError, ValueError):
    """A stream used after its flush (the reference raises ValueError for the same)."""


def _raise(code: int, eof: int = 0) -> None:
    if code == -3:
        raise FoldStateError(code, "flush twice" if eof else "feed after flush")
    raise FoldEngineError(code)


class _Work(threading.local):
    """One C work area per thread, with the output slots of fold_feed."""

    def __init__(self) -> None:
        out = ffi.new("fold_work **")
        code = lib.fold_work_new(out)
        if code:
            _raise(code)
        self.work = ffi.gc(out[0], lib.fold_work_free)
        self.out = ffi.new("const char **")
        self.out_len = ffi.new("size_t *")


_local_work: _Work | None = _Work() if AVAILABLE else None
_fold_feed: Any = lib.fold_feed if AVAILABLE else None
_unpack: Any = ffi.unpack if AVAILABLE else None


def _call(st: Any, data: bytes, eof: int) -> bytes:
    # Every attribute read here is a dictionary lookup per feed (a thread-local's among them):
    # at 1 KiB chunks this function's Python is as long as the C's work.
    w = _local_work
    assert w is not None
    out, out_len = w.out, w.out_len
    code = _fold_feed(st, w.work, data, len(data), eof, out, out_len)
    if code:
        _raise(code, eof)
    n = out_len[0]
    return _unpack(out[0], n) if n else b""


def _new_stream(tables: Any) -> Any:
    out = ffi.new("fold_stream **")
    code = lib.fold_stream_new(tables, out)
    if code:
        _raise(code)
    return ffi.gc(out[0], lib.fold_stream_free)


class NativeFoldTables:
    """The C windows for a set of secrets: immutable, shared by all streams and threads."""

    __slots__ = ("__weakref__", "_local", "_tables", "hold_bound_bytes", "names")

    def __init__(
        self, secrets: Iterable[tuple[str, bytes]], marker_names: Iterable[str] = ()
    ) -> None:
        if not AVAILABLE:
            raise FoldEngineError(0, "fold engine: the C extension is not built")
        secrets = list(secrets)
        markers = sorted(scrub_fold.marker_set(secrets, marker_names))
        names_list, pieces = scrub_fold.qualified_pieces(secrets)
        if not names_list:
            raise FoldEngineError(-2, "fold engine: no secret passes the gate")
        # The C makes the windows from the pieces (a Python copy of them would be about ten
        # times their size).
        self.hold_bound_bytes = scrub_fold.HOLD_BOUND_BYTES
        self.names = tuple(names_list)
        blob = bytearray()
        lens = array("i")
        owners = array("i")
        for index, piece in pieces:
            blob += piece
            lens.append(len(piece))
            owners.append(index)
        names = b"".join(names_list)
        name_lens = array("i", (len(name) for name in names_list))
        out = ffi.new("fold_tables **")
        code = lib.fold_tables_new(
            bytes(blob),
            len(blob),
            ffi.from_buffer("int32_t[]", lens),
            ffi.from_buffer("int32_t[]", owners),
            len(lens),
            names,
            len(names),
            ffi.from_buffer("int32_t[]", name_lens),
            len(name_lens),
            out,
        )
        if code:
            _raise(code)
        self._tables = ffi.gc(out[0], lib.fold_tables_free)
        marker_lens = array("i", (len(name) for name in markers))
        code = lib.fold_tables_markers(
            self._tables,
            b"".join(markers),
            sum(marker_lens),
            ffi.from_buffer("int32_t[]", marker_lens),
            len(marker_lens),
        )
        if code:
            _raise(code)
        self._local = threading.local()

    @property
    def footprint(self) -> int:
        """Bytes the C tables take."""
        return int(lib.fold_tables_footprint(self._tables))

    def stream(self) -> NativeFoldStream:
        return NativeFoldStream(self)

    def scrub(self, data: bytes) -> bytes:
        """Stage 2 over a complete input (`scrub_fold.fold_whole`)."""
        st = getattr(self._local, "stream", None)
        if st is None:
            st = self._local.stream = _new_stream(self._tables)
        try:
            return _call(st, data, 1)
        finally:
            lib.fold_stream_reset(st)


class NativeFoldStream:
    """One stream over shared `NativeFoldTables`: feed chunks, then flush once. Not for
    concurrent use by several threads (the engine refuses a second concurrent call)."""

    __slots__ = ("_st", "_tables")

    def __init__(self, tables: NativeFoldTables) -> None:
        self._tables = tables  # keeps the C tables alive as long as the stream
        self._st = _new_stream(tables._tables)

    @property
    def pending(self) -> int:
        """Input bytes held back, waiting to know whether they are part of a secret."""
        return int(lib.fold_stream_pending(self._st))

    def feed(self, chunk: bytes) -> bytes:
        return _call(self._st, bytes(chunk), 0)

    def flush(self) -> bytes:
        return _call(self._st, b"", 1)
