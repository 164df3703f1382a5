"""cffi build script for native._headscan (out-of-line API mode): the declarations live here.

Used by setup.py (`pip install .` builds it) and by `python -m native.build` (in-place, for a
source checkout). Warnings are errors.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"

CDEF = """
#define APX_OUT_SIZE 8
#define APX_FLAG_CHUNKED 1
#define APX_FLAG_CLOSE 2
#define APX_FLAG_EXPECT_CONTINUE 4
#define APX_FLAG_NOMINATES 8

int apx_scan_head(const char *buf, size_t len, int is_request, size_t max_line, size_t max_count,
                  size_t max_bytes, int64_t out[8]);
long apx_relay_fields(const char *buf, size_t start_len, size_t head_len, uint32_t drop_mask,
                      char *out, size_t cap);
"""

CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]


def make_ffi(extra_cflags: list[str] | None = None, *, relative: bool = False) -> FFI:
    """The builder. setuptools wants source paths relative to setup.py (`relative=True`);
    `ffi.compile` runs in a temporary directory and wants them absolute."""
    src = Path("native/src") if relative else SRC
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "native._headscan",
        '#include "headscan.h"',
        sources=[str(src / "headscan.c")],
        include_dirs=[str(src)],
        extra_compile_args=CFLAGS + (extra_cflags or []),
        extra_link_args=list(extra_cflags or []),
    )
    return ffi


ffibuilder = make_ffi(relative=True)  # for setup.py

if __name__ == "__main__":
    make_ffi().compile(verbose=True)
