/* fold: the scrubber's second stage (the fold matcher), in C.
 *
 * The Python reference (native/scrub_fold.py) defines the output; this engine must produce the
 * same bytes for every input, secret set and chunking, and release feed by feed what the
 * reference releases (tests/test_scrub_fold.py, fuzz/fuzz_scrub_fold_differential.py). The
 * secrets' folded forms are computed by the reference (`scrub_fold.qualified_pieces`) and
 * handed over flattened by the wrapper (native/scrub_fold_native.py); the code point table is
 * native/src/fold_table.h, generated with the reference's own (native/build_fold_table.py).
 *
 * Three objects, as in scrub.h:
 * - fold_tables: the windows in one open-addressing table behind a Bloom filter, a filter of
 *   their grams, and the names; immutable after construction, shared by any number of streams and threads;
 * - fold_stream: one stream's pending raw bytes (from a unit boundary). One thread at a time:
 *   a second concurrent call returns FOLD_EBUSY;
 * - fold_work: a call's scratch (the view of a piece of at most 64 KiB plus the pending bytes)
 *   and its output, one per thread.
 *
 * Every allocation is sized from the window set or from one call's input and checked; a failed
 * one is FOLD_ENOMEM and the stream then refuses further input (FOLD_EFAILED). What a stream
 * holds is what the reference holds: at most FoldTables.hold_bound_bytes.
 *
 * Flattened input of fold_tables_new (the engine makes the windows: every W characters of a
 * piece, a piece shorter than W whole; a window two pieces hold keeps its first owner):
 *   pieces     the folded pieces of the secrets' derived forms (0-9, a-z), concatenated, in
 *              the order of the secrets
 *   plen[i]    the length of piece i (at least MIN_SHORT)
 *   powner[i]  the secret (index into the names) piece i belongs to
 *   names      the secrets' names, concatenated; name_len[k] the length of name k
 */
#ifndef FOLD_H
#define FOLD_H

#include <stddef.h>
#include <stdint.h>

#define FOLD_OK 0
#define FOLD_ENOMEM (-1)   /* an allocation failed */
#define FOLD_EINVAL (-2)   /* the flattened windows are inconsistent */
#define FOLD_EFLUSHED (-3) /* input after the end of the stream */
#define FOLD_EBUSY (-4)    /* the stream or the work area is in use by another thread */
#define FOLD_ETOOBIG (-5)  /* a size does not fit the engine's integers */
#define FOLD_EFAILED (-6)  /* an earlier call on this stream failed; its state is undefined */

typedef struct fold_tables fold_tables;
typedef struct fold_stream fold_stream;
typedef struct fold_work fold_work;

int fold_tables_new(const char *pieces, size_t pieces_len, const int32_t *plen,
                    const int32_t *powner, size_t npieces, const char *names, size_t names_len,
                    const int32_t *name_len, size_t nnames, fold_tables **out);
/* The names of stage-1 markers (`[REDACTED:<name>]`, compared in ASCII lower case) that decode
 * to a BREAK: each 1-64 of A-Za-z0-9_.:@/+-, concatenated. Once, right after fold_tables_new,
 * before the tables are shared (FOLD_EINVAL on a second call or a bad name). */
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

/* Scrub `len` more bytes of the stream (eof: they end it). The output is out[0:*out_len], valid
 * until w's next call and while `in` is unchanged: it is in w, or (when it is the input as it
 * came, without the pending tail) `in` itself. */
int fold_feed(fold_stream *st, fold_work *w, const char *in, size_t len, int eof, const char **out,
              size_t *out_len);

/* fold_feed of in_a[0:len_a] + in_b[0:len_b], without joining them first (the engine copies its
 * input after the pending tail anyway): the output is valid while both are unchanged. */
int fold_feed2(fold_stream *st, fold_work *w, const char *in_a, size_t len_a, const char *in_b,
               size_t len_b, int eof, const char **out, size_t *out_len);

/* The constants the engine was built with (W, MIN_SHORT, MAX_GAP, GAP_BYTES, GROUP_CAP,
 * ANSI_CSI_MAX, ANSI_OSC_MAX), for the wrapper to check against the reference's; the count
 * written (at most n). */
int fold_constants(int32_t *out, size_t n);

#endif
