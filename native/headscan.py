"""Typed wrapper over the C head scanner (`native/src/headscan.c`).

`scan_head` returns the facts of a head the scanner accepted, or None: the caller then runs the
reference parser (proxycore.protocol.http1), which is also what happens when the extension is not
built (`AVAILABLE` is False). The scanner never refuses anything itself; see headscan.h.

The boundary is kept thin on purpose (one call, one `ffi.unpack`): on a head of a few hundred
bytes, crossing into C costs as much as the scan.
"""

from __future__ import annotations

import threading

try:
    from native._headscan import ffi, lib

    AVAILABLE = True
except ImportError:  # not built (no C compiler at install time): the reference parser serves
    ffi = lib = None
    AVAILABLE = False

# Field names of headscan.h's drop mask, in bit order.
MASK_NAMES: tuple[bytes, ...] = (
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"proxy-connection",
    b"te",
    b"trailer",
    b"trailers",
    b"transfer-encoding",
    b"upgrade",
    b"host",
    b"content-length",
    b"expect",
    b"accept-encoding",
    b"content-encoding",
)

# Indexes into the list `scan_head` returns (headscan.h, APX_OUT_*).
HEAD_LEN, START_LEN, TOKEN_END, TARGET_END, CONTENT_LENGTH, STATUS, MINOR, FLAGS = range(8)
FLAG_CHUNKED = 1
FLAG_CLOSE = 2
FLAG_EXPECT_CONTINUE = 4
FLAG_NOMINATES = 8
# headscan.h APX_DROP_UNDERSCORE: drop every field whose name holds "_".
DROP_UNDERSCORE = 1 << 31


def drop_mask(names: frozenset[bytes], *, underscores: bool = False) -> int | None:
    """The drop mask for these (lowercase) field names, and for every name holding "_" if
    `underscores`; None if a name is not in MASK_NAMES."""
    mask = DROP_UNDERSCORE if underscores else 0
    for name in names:
        if name not in MASK_NAMES:
            return None
        mask |= 1 << MASK_NAMES.index(name)
    return mask


class _Scratch(threading.local):
    """One output array per thread (the proxy has one thread; tests and fuzzers may have more)."""

    def __init__(self) -> None:
        self.out = ffi.new("int64_t[8]")


if AVAILABLE:
    _scratch = _Scratch()
    _from_buffer = ffi.from_buffer
    _unpack = ffi.unpack
    _scan = lib.apx_scan_head
    _relay = lib.apx_relay_fields

    def scan_head(
        buf: bytes | bytearray, is_request: bool, max_line: int, max_count: int, max_bytes: int
    ) -> list[int] | None:
        """The APX_OUT_* facts of an accepted head, or None (defer to the reference parser)."""
        out = _scratch.out
        if _scan(_from_buffer(buf), len(buf), is_request, max_line, max_count, max_bytes, out):
            return _unpack(out, 8)  # type: ignore[no-any-return]
        return None

    def relay_fields(raw: bytes, start_len: int, mask: int) -> bytes | None:
        """The field lines of a parsed head `raw` minus the masked names, each led by CRLF; None
        (use the reference) if the C relay cannot read `raw` as a head."""
        head_len = len(raw) - 4
        size = head_len - start_len
        out = ffi.new("char[]", size + 1)
        written = _relay(raw, start_len, head_len, mask, out, size)
        if written < 0:
            return None
        return _unpack(out, written)  # type: ignore[no-any-return]

else:

    def scan_head(
        buf: bytes | bytearray, is_request: bool, max_line: int, max_count: int, max_bytes: int
    ) -> list[int] | None:
        return None

    def relay_fields(raw: bytes, start_len: int, mask: int) -> bytes | None:
        return None
