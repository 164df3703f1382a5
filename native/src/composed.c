/* composed: stage 1 then stage 2 in one call. See composed.h. */
#include "composed.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Stage 1 returns the unchanged end of a large input as a range of it (not copied). Alone, a
 * range this long is handed back as such (the caller joins it, one copy); a shorter one is
 * copied after stage 1's output here, so the caller makes one bytes object from one buffer. */
#define JOIN_MIN ((size_t)64 * 1024)
/* The contiguous buffer gives back its memory when it is far larger than a call needs (one
 * large response would otherwise pin its size in every thread that scrubbed it). */
#define BUF_KEEP ((size_t)1 << 20)

struct composed_stream {
    scrub_stream *first;
    fold_stream *second; /* NULL: stage 1 alone */
    atomic_int busy;
};

/* One per thread: both stages' work areas, the buffer that makes stage 1's output contiguous,
 * and the result record composed_feed returns. */
typedef struct {
    scrub_work *w1;
    fold_work *w2; /* made on the thread's first call with a stage 2 */
    char *buf;
    size_t cap;
    composed_result r;
} thread_work;

static pthread_key_t work_key;
static int work_key_rc = -1;
static pthread_once_t work_key_once = PTHREAD_ONCE_INIT;

static void thread_work_free(void *p) {
    thread_work *tw = p;
    if (!tw) return;
    scrub_work_free(tw->w1);
    fold_work_free(tw->w2);
    free(tw->buf);
    free(tw);
}

static void make_work_key(void) { work_key_rc = pthread_key_create(&work_key, thread_work_free); }

static thread_work *this_thread_work(void) {
    if (pthread_once(&work_key_once, make_work_key) || work_key_rc) return NULL;
    thread_work *tw = pthread_getspecific(work_key);
    if (tw) return tw;
    tw = calloc(1, sizeof *tw);
    if (!tw) return NULL;
    if (scrub_work_new(&tw->w1) != SCRUB_OK || pthread_setspecific(work_key, tw)) {
        scrub_work_free(tw->w1);
        free(tw);
        return NULL;
    }
    return tw;
}

/* Returned when there is no work area to hold a result (a failed allocation). */
static const composed_result no_memory = {COMPOSED_OTHER, NULL, SCRUB_ENOMEM, 1, 0, 0, 0};

int composed_new(const scrub_tables *first, const fold_tables *second, composed_stream **out) {
    *out = NULL;
    composed_stream *cs = calloc(1, sizeof *cs);
    if (!cs) return SCRUB_ENOMEM;
    int rc = scrub_stream_new(first, &cs->first);
    if (rc == SCRUB_OK && second && fold_stream_new(second, &cs->second) != FOLD_OK)
        rc = SCRUB_ENOMEM;
    if (rc != SCRUB_OK) {
        composed_free(cs);
        return rc;
    }
    atomic_init(&cs->busy, 0);
    *out = cs;
    return SCRUB_OK;
}

void composed_free(composed_stream *cs) {
    if (!cs) return;
    scrub_stream_free(cs->first);
    fold_stream_free(cs->second);
    free(cs);
}

void composed_reset(composed_stream *cs) {
    if (atomic_exchange(&cs->busy, 1)) return;
    scrub_stream_reset(cs->first);
    if (cs->second) fold_stream_reset(cs->second);
    atomic_store(&cs->busy, 0);
}

size_t composed_pending(const composed_stream *cs) {
    return scrub_stream_pending(cs->first) + (cs->second ? fold_stream_pending(cs->second) : 0);
}

const scrub_stream *composed_first(const composed_stream *cs) { return cs->first; }

/* Room for n bytes in the thread's contiguous buffer. */
static char *reserve(thread_work *tw, size_t n) {
    if (n > tw->cap || (tw->cap > BUF_KEEP && tw->cap / 4 > n)) {
        size_t cap = n < 4096 ? 4096 : n;
        char *p = malloc(cap);
        if (!p) return NULL;
        free(tw->buf);
        tw->buf = p;
        tw->cap = cap;
    }
    return tw->buf;
}

static const composed_result *fail(thread_work *tw, int rc, int stage) {
    tw->r.len = COMPOSED_OTHER;
    tw->r.out = NULL;
    tw->r.rc = rc;
    tw->r.stage = stage;
    return &tw->r;
}

const composed_result *composed_feed(composed_stream *cs, const char *in, size_t len, int eof) {
    thread_work *tw = this_thread_work();
    if (!tw) return &no_memory;
    composed_result *r = &tw->r;
    r->head = r->start = r->end = 0;
    r->rc = 0;
    r->stage = 1;
    if (atomic_exchange(&cs->busy, 1)) return fail(tw, SCRUB_EBUSY, 1);
    /* Stage 2's work area before stage 1 consumes anything: failing to get it afterwards would
     * leave stage 1's release neither given back nor passed on. */
    if (cs->second && !tw->w2 && fold_work_new(&tw->w2) != FOLD_OK) {
        tw->w2 = NULL;
        atomic_store(&cs->busy, 0);
        return fail(tw, FOLD_ENOMEM, 2);
    }

    const char *o1;
    size_t n1, from, to;
    int rc = scrub_feed(cs->first, tw->w1, in, len, eof, &o1, &n1, &from, &to);
    if (rc != SCRUB_OK) {
        atomic_store(&cs->busy, 0);
        return fail(tw, rc, 1);
    }
    size_t tail = to - from;
    /* Stage 1's release, contiguous: o1[0:n1] + in[from:to]. Stage 2 takes the two parts as
     * they are (it copies its input after its own pending tail anyway). */
    const char *rel = o1;
    size_t nrel = n1 + tail;
    if (tail && !cs->second) {
        if (n1 == 0) {
            rel = in + from;
        } else if (tail >= JOIN_MIN) {
            r->len = COMPOSED_OTHER;
            r->out = o1;
            r->head = n1;
            r->start = from;
            r->end = to;
            atomic_store(&cs->busy, 0);
            return r;
        } else {
            char *b = reserve(tw, nrel);
            if (!b) {
                atomic_store(&cs->busy, 0);
                return fail(tw, SCRUB_ENOMEM, 1);
            }
            memcpy(b, o1, n1);
            memcpy(b + n1, in + from, tail);
            rel = b;
        }
    }
    if (!cs->second) {
        r->len = n1 == 0 && tail && tail == len ? COMPOSED_SAME : (int64_t)nrel;
        r->out = rel;
        atomic_store(&cs->busy, 0);
        return r;
    }
    /* ComposedStream.feed: nothing released, nothing to feed stage 2 (its cut depends only on
     * what it holds, so a feed of nothing would release nothing, at the cost of decoding it
     * again). At the end, stage 2 takes stage 1's last release and its own end in one call
     * (ComposedStream feeds it, then flushes it: the same bytes, the output not depending on
     * how the input is cut). */
    if (nrel == 0 && !eof) {
        r->len = 0;
        r->out = NULL;
        atomic_store(&cs->busy, 0);
        return r;
    }
    const char *o2;
    size_t n2;
    rc = fold_feed2(cs->second, tw->w2, o1, n1, tail ? in + from : NULL, tail, eof, &o2, &n2);
    atomic_store(&cs->busy, 0);
    if (rc != FOLD_OK) return fail(tw, rc, 2);
    r->len = (int64_t)n2;
    r->out = o2;
    return r;
}
