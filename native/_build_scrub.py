"""cffi build script for native._scrub (out-of-line API mode): the declarations live here.

Used by setup.py (`pip install .` builds it) and by `python -m native.build` (in-place, for a
source checkout). Warnings are errors. The flattened pattern layout is described in
src/scrub.h; native/scrub_native.py is the only caller.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"

CDEF = """
#define SCRUB_OK 0
#define SCRUB_ENOMEM -1
#define SCRUB_EINVAL -2
#define SCRUB_EFLUSHED -3
#define SCRUB_EBUSY -4
#define SCRUB_ETOOBIG -5
#define SCRUB_EFAILED -6
#define SCRUB_NO_SIMD 1
#define SCRUB_NAME_FIELDS 2
#define SCRUB_LIT_FIELDS 4
#define SCRUB_SHAPE_FIELDS 12
#define SCRUB_SEG_FIELDS 11
#define SCRUB_SUF_FIELDS 2

typedef struct scrub_tables scrub_tables;
typedef struct scrub_stream scrub_stream;
typedef struct scrub_work scrub_work;

int scrub_tables_new(const char *blob, size_t blob_len, const int32_t *names, size_t nnames,
                     const int32_t *lits, size_t nlits, const int32_t *shapes, size_t nshapes,
                     const int32_t *segs, size_t nsegs, const int32_t *sufs, size_t nsufs,
                     uint32_t flags, scrub_tables **out);
void scrub_tables_free(scrub_tables *t);
size_t scrub_tables_footprint(const scrub_tables *t);
int scrub_tables_simd(const scrub_tables *t);
int scrub_stream_new(const scrub_tables *t, scrub_stream **out);
void scrub_stream_free(scrub_stream *st);
void scrub_stream_reset(scrub_stream *st);
size_t scrub_stream_pending(const scrub_stream *st);
size_t scrub_stream_footprint(const scrub_stream *st);
int scrub_work_new(scrub_work **out);
void scrub_work_free(scrub_work *w);
void scrub_work_trim(scrub_work *w);
size_t scrub_work_footprint(const scrub_work *w);
int scrub_feed(scrub_stream *st, scrub_work *w, const char *in, size_t len, int eof,
               const char **out, size_t *out_len, size_t *in_from, size_t *in_to);
"""

CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]


def make_ffi(extra_cflags: list[str] | None = None, *, relative: bool = False) -> FFI:
    """The builder. setuptools wants source paths relative to setup.py (`relative=True`);
    `ffi.compile` runs in a temporary directory and wants them absolute."""
    src = Path("native/src") if relative else SRC
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "native._scrub",
        '#include "scrub.h"',
        sources=[str(src / "scrub.c")],
        include_dirs=[str(src)],
        extra_compile_args=CFLAGS + (extra_cflags or []),
        extra_link_args=list(extra_cflags or []),
    )
    return ffi


ffibuilder = make_ffi(relative=True)  # for setup.py

if __name__ == "__main__":
    make_ffi().compile(verbose=True)
