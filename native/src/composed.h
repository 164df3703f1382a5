/* composed: the whole scrubber (stage 1, src/scrub.c, then stage 2, src/fold.c) in one call.
 *
 * A composed stream is a stage-1 stream and, when the scrubber has a stage 2, a fold stream:
 * one feed runs stage 1 on the input and hands what it releases straight to stage 2, with the
 * semantics of native/scrub.py's ComposedStream (stage 2 is fed only when stage 1 released
 * something or at the end; the same bytes come out, at the same feeds). Without stage 2 it is
 * stage 1 alone, with the output made contiguous. Both stages are used only through their
 * public APIs (scrub.h, fold.h).
 *
 * Why one call: at 1 KiB a feed, the Python glue around two cffi calls (the thread-local work
 * lookup, nine arguments, the out-parameters read back one by one, an intermediate bytes
 * object) cost as much as the scanning. Here the work areas are found in C (one set per thread,
 * behind a pthread key whose destructor frees them when the thread ends: memory stays bounded
 * by the number of threads, as with the per-thread work areas of each stage), and the result
 * comes back as a pointer to the calling thread's own result record, so a call takes four
 * arguments and the caller reads two fields.
 *
 * The result record and the output it points to are the calling thread's, valid until that
 * thread's next composed_feed (and, as the output may lie in the caller's input, not copied,
 * while that input is unchanged): another thread's calls never touch them (each thread has its
 * own), and a stream used by two threads at once refuses the second call (COMPOSED busy:
 * SCRUB_EBUSY) instead of interleaving the two stages' order. */
#ifndef COMPOSED_H
#define COMPOSED_H

#include <stddef.h>
#include <stdint.h>

#include "fold.h"
#include "scrub.h"

typedef struct composed_stream composed_stream;

#define COMPOSED_OTHER (-1)
#define COMPOSED_SAME (-2)

typedef struct {
    /* >= 0: the output is out[0:len]. COMPOSED_SAME: the output is the caller's input itself
     * (stage 1 alone changed and held nothing). COMPOSED_OTHER: rc says: an error (rc < 0, of
     * stage `stage`: SCRUB_* codes for 1, FOLD_* for 2), or (rc == 0, stage 1 alone) the output
     * is out[0:head] followed by in[start:end], a long unchanged end of the caller's input, not
     * copied. */
    int64_t len;
    const char *out;
    int rc, stage;
    size_t head, start, end;
} composed_result;

/* second: NULL for stage 1 alone. The tables must outlive the stream. */
int composed_new(const scrub_tables *first, const fold_tables *second, composed_stream **out);
void composed_free(composed_stream *cs);
/* Back to a fresh stream (for reuse by one-shot calls). */
void composed_reset(composed_stream *cs);
/* Input bytes held back by both stages. */
size_t composed_pending(const composed_stream *cs);
/* The stage-1 stream (for its footprint). */
const scrub_stream *composed_first(const composed_stream *cs);

/* Scrub `len` more bytes (eof: they end the stream). Never NULL. */
const composed_result *composed_feed(composed_stream *cs, const char *in, size_t len, int eof);

#endif
