"""cffi build script for native._scrub (out-of-line API mode): the declarations live here.

The whole scrubber is one module: stage 1 (src/scrub.c), stage 2 (src/fold.c, whose
declarations and sources are in _build_fold.py) and src/composed.c, which runs both in one call.
One module, so a stream of one holds tables the other built (a second copy of fold.c in another
module would have its own struct layouts).

Used by setup.py (`pip install .` builds it) and by `python -m native.build` (in-place, for a
source checkout). Warnings are errors. The flattened pattern layout is described in
src/scrub.h; native/scrub_native.py and native/scrub_fold_native.py are the only callers.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
# By path, not `from native import ...`: setuptools runs this file as a script, without the
# project on sys.path.
_FOLD = runpy.run_path(str(HERE / "_build_fold.py"))
FOLD_CDEF: str = _FOLD["CDEF"]
FOLD_SOURCES: tuple[str, ...] = _FOLD["SOURCES"]

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

COMPOSED_CDEF = """
#define COMPOSED_OTHER -1
#define COMPOSED_SAME -2

typedef struct composed_stream composed_stream;
typedef struct {
    int64_t len;
    const char *out;
    int rc, stage;
    size_t head, start, end;
} composed_result;

int composed_new(const scrub_tables *first, const fold_tables *second, composed_stream **out);
void composed_free(composed_stream *cs);
void composed_reset(composed_stream *cs);
size_t composed_pending(const composed_stream *cs);
const scrub_stream *composed_first(const composed_stream *cs);
const composed_result *composed_feed(composed_stream *cs, const char *in, size_t len, int eof);
"""

CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden", "-pthread"]


def make_ffi(extra_cflags: list[str] | None = None, *, relative: bool = False) -> FFI:
    """The builder. setuptools wants source paths relative to setup.py (`relative=True`);
    `ffi.compile` runs in a temporary directory and wants them absolute."""
    src = Path("native/src") if relative else SRC
    ffi = FFI()
    ffi.cdef(CDEF + FOLD_CDEF + COMPOSED_CDEF)
    ffi.set_source(
        "native._scrub",
        '#include "scrub.h"\n#include "fold.h"\n#include "composed.h"',
        sources=[str(src / name) for name in ("scrub.c", *FOLD_SOURCES, "composed.c")],
        include_dirs=[str(src)],
        extra_compile_args=CFLAGS + (extra_cflags or []),
        extra_link_args=["-pthread", *(extra_cflags or [])],
    )
    return ffi


ffibuilder = make_ffi(relative=True)  # for setup.py

if __name__ == "__main__":
    make_ffi().compile(verbose=True)
