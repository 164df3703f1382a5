"""The declarations and sources of the scrubber's second stage (src/fold.c, src/fold.h; the
reference is native/scrub_fold.py), compiled into native._scrub with stage 1 (_build_scrub.py):
one module, so the composed call (src/composed.c) runs both stages on tables either built.
native/scrub_fold_native.py is the typed wrapper.
"""

from __future__ import annotations

# The C files of stage 2, under native/src.
SOURCES = ("fold.c",)

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
