"""cffi build script for native._fold (out-of-line API mode): the declarations live here.

The scrubber's second stage (src/fold.c, src/fold.h; the reference is native/scrub_fold.py).
Used by setup.py (`pip install .` builds it) and by `python -m native.build`. Warnings are
errors. native/scrub_fold_native.py is the only caller.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"

CDEF = """
#define FOLD_OK 0
#define FOLD_ENOMEM -1
#define FOLD_EINVAL -2
#define FOLD_EFLUSHED -3
#define FOLD_EBUSY -4
#define FOLD_ETOOBIG -5
#define FOLD_EFAILED -6

typedef struct fold_tables fold_tables;
typedef struct fold_stream fold_stream;
typedef struct fold_work fold_work;

int fold_tables_new(const char *pieces, size_t pieces_len, const int32_t *plen,
                    const int32_t *powner, size_t npieces, const char *names, size_t names_len,
                    const int32_t *name_len, size_t nnames, fold_tables **out);
int fold_tables_markers(fold_tables *t, const char *names, size_t names_len,
                        const int32_t *name_len, size_t n);
void fold_tables_free(fold_tables *t);
size_t fold_tables_footprint(const fold_tables *t);
int fold_stream_new(const fold_tables *t, fold_stream **out);
void fold_stream_free(fold_stream *st);
void fold_stream_reset(fold_stream *st);
size_t fold_stream_pending(const fold_stream *st);
int fold_work_new(fold_work **out);
void fold_work_free(fold_work *w);
int fold_feed(fold_stream *st, fold_work *w, const char *in, size_t len, int eof,
              const char **out, size_t *out_len);
int fold_constants(int32_t *out, size_t n);
"""

CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]


def make_ffi(extra_cflags: list[str] | None = None, *, relative: bool = False) -> FFI:
    """The builder (paths relative to setup.py for setuptools, absolute for `ffi.compile`)."""
    src = Path("native/src") if relative else SRC
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        "native._fold",
        '#include "fold.h"',
        sources=[str(src / "fold.c")],
        include_dirs=[str(src)],
        extra_compile_args=CFLAGS + (extra_cflags or []),
        extra_link_args=list(extra_cflags or []),
    )
    return ffi


ffibuilder = make_ffi(relative=True)  # for setup.py

if __name__ == "__main__":
    make_ffi().compile(verbose=True)
