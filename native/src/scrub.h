/* scrub: the streaming secret scrubber's engine, in C.
 *
 * The Python reference (native/scrub_reference.py) defines the output; this engine must produce
 * the same bytes for every input, pattern set and chunking (tests/test_native_scrub.py,
 * fuzz/fuzz_scrub_differential.py, fuzz/fuzz_scrub_secret_sets.py). The patterns are compiled by
 * native/scrub_patterns.py and handed over flattened by the wrapper (native/scrub_native.py).
 *
 * Three objects:
 * - scrub_tables: everything looked up while scanning, built once from the flattened patterns,
 *   immutable afterwards, so any number of streams in any number of threads share it;
 * - scrub_stream: one stream's state (its position, the pending tail of its input, per-shape
 *   positions). One thread at a time: a second concurrent call on the same stream returns
 *   SCRUB_EBUSY instead of racing;
 * - scrub_work: a call's scratch and output, one per thread (not per stream, so an idle stream
 *   holds only its state and pending tail).
 *
 * Nothing here keeps global mutable state. Every allocation is sized from the pattern set or
 * from the input of one call (scratch for a 64 KiB piece plus the pending tail, the output); a
 * failed allocation is SCRUB_ENOMEM, after which the stream refuses further input
 * (SCRUB_EFAILED). The pending tail is what the reference holds back: at most
 * Patterns.hold_bound bytes of skeleton, each with the (at most ZW_RUN_MAX = 2) zero-width
 * characters before it, plus the start of a zero-width character cut by the end of the input:
 * Patterns.hold_bound_bytes in all.
 *
 * Flattened pattern layout (all int32, offsets into one byte blob):
 *   names   [off, len]                               per name (literal and shape names)
 *   lits    [off, len, name, window]                 per literal, in priority order
 *   shapes  [seg_first, seg_count, redact_from, redact_to, name_from, optional_from, name,
 *            not_after_off, check, entropy_k,        per shape (-1: none, for the three that
 *            placeholder, not_before_off]            may be; redact_to is resolved; check,
 *                                                    entropy_k, placeholder: the validators,
 *                                                    0 for none, scrub_patterns.Shape)
 *   segs    [kind, fold, lit_off, lit_len, class_off, min, max, stop_off, stop_len, suf_first,
 *            suf_count]                              per segment; class_off and not_after_off
 *                                                    and not_after_off / not_before_off
 *                                                    name 32-byte bitmaps (bit b of byte b/8)
 *   sufs    [off, len]                               per suffix, lowercase
 */
#ifndef SCRUB_H
#define SCRUB_H

#include <stddef.h>
#include <stdint.h>

#define SCRUB_OK 0
#define SCRUB_ENOMEM (-1)   /* an allocation failed */
#define SCRUB_EINVAL (-2)   /* the flattened patterns are inconsistent */
#define SCRUB_EFLUSHED (-3) /* input after the end of the stream */
#define SCRUB_EBUSY (-4)    /* the stream is in use by another thread */
#define SCRUB_ETOOBIG (-5)  /* a size does not fit the engine's integers */
#define SCRUB_EFAILED (-6)  /* an earlier call on this stream failed; its state is undefined */

/* scrub_tables_new flags */
#define SCRUB_NO_SIMD 1 /* the portable scalar loops even where AVX2 is there (for tests) */

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
/* 1 when the tables use the AVX2 loops (x86-64 with AVX2, SCRUB_NO_SIMD not given). */
int scrub_tables_simd(const scrub_tables *t);

int scrub_stream_new(const scrub_tables *t, scrub_stream **out);
void scrub_stream_free(scrub_stream *st);
/* Back to a fresh stream over the same tables (for reuse by one-shot calls). */
void scrub_stream_reset(scrub_stream *st);
/* Input bytes held back, waiting to know whether they start something. */
size_t scrub_stream_pending(const scrub_stream *st);
/* Bytes allocated for this stream (its state and its pending tail). */
size_t scrub_stream_footprint(const scrub_stream *st);

/* A work area: a call's scratch and its output. One per thread, used by one call at a time (a
 * second concurrent call returns SCRUB_EBUSY); it serves any stream over any tables. Its
 * buffers are kept between calls (large ones shrink again when calls get small). */
int scrub_work_new(scrub_work **out);
void scrub_work_free(scrub_work *w);
void scrub_work_trim(scrub_work *w); /* gives every buffer back */
size_t scrub_work_footprint(const scrub_work *w);

/* Scrub `len` more bytes of the stream (eof: they end it; then the stream takes no more). The
 * output of this call is out[0:*out_len] (in w, valid until w's next call) followed by
 * in[*in_from:*in_to]: what comes out unchanged after the last redaction is not copied. */
int scrub_feed(scrub_stream *st, scrub_work *w, const char *in, size_t len, int eof,
               const char **out, size_t *out_len, size_t *in_from, size_t *in_to);

#endif
