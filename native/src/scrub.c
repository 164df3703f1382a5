/* scrub: see scrub.h. The reference is native/scrub_reference.py; names here follow it.
 *
 * One call to advance() is one ReferenceStream._advance over `raw` (the pending tail followed by
 * new input): split off the zero-width characters, scan the skeleton for spans, find the release
 * point, render the released part, keep the rest pending. scrub_feed() cuts large inputs into
 * pieces (PIECE bytes of new input per advance), which is the same as feeding them one by one:
 * the output does not depend on the chunking, and the release after the last piece is the one a
 * single advance over the whole input would make.
 *
 * Scanning, per skeleton position p:
 * - literals of >= 8 bytes: every 8-byte run of a window literal and the first 8 bytes of every
 *   whole literal are keys of one open-addressing table. A 4-byte filter runs first, once per 5
 *   positions: positions 5b..5b+4 all contain the 4 bytes at 5b+4 in their first 8, so a bloom
 *   filter over the 5 aligned 4-grams of every key rejects the whole block; on a hit each of the
 *   5 positions goes through a second bloom filter over the 8-byte keys, then the table;
 * - literals of < 8 bytes (raw secrets that short): a side pass, one hash table per length;
 * - shapes: a prefilter on the first bytes of their opening literal, in the same loop as the
 *   literals' filter: with AVX2 (x86-64, chosen at run time), a nibble filter ("Teddy") over the
 *   first four bytes of every shape in 16 buckets, 32 positions per step, whose candidates are
 *   queued and tested against a bitmap of the openings' first three bytes, both without a
 *   branch per candidate; else a table per byte (TRI) whose lanes, ANDed over three bytes, say
 *   which group of shapes may begin there. Then the shapes opening with exactly those three
 *   bytes (table k3), the opening literal itself, then the shape's possessive matcher
 *   (match_segment / match_shape of the reference), not_after, optional_from, per-shape
 *   non-overlap;
 * - at the end of a non-final buffer: which positions could still start a match (the "tails").
 *
 * The release point, the key/value rule, the merge of spans into named groups and the output
 * are ReferenceStream._advance and render(). The output of a call is written to a per-thread
 * work area, except the unchanged tail of the input after the last redaction, which the caller
 * already has (scrub_feed reports it as a range of its input).
 */
#include "scrub.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SCRUB_AVX2 1 /* compiled for any x86-64; used when the CPU has AVX2 (tables.simd) */
#endif

#define NO_MATCH (-1)
#define NEED_MORE (-2)
#define WINDOW 8
#define ZW_RUN_MAX 2 /* scrub_patterns.ZW_RUN_MAX */
#define PIECE ((size_t)64 * 1024)   /* new input bytes per advance */
/* ... when the pending tail has to be copied in front: a call of up to this many bytes is one
 * advance (a second one over the rest cost more than the copy: its setup and the positions at
 * its end that the vector loop leaves to the scalar one) */
#define FIRST_MIN ((size_t)4096)
#define DEFER_MIN ((size_t)8192)     /* shorter unchanged tails are copied into the output */
#define WORK_KEEP ((size_t)4 << 20)  /* a work area's buffers above this shrink for small calls */
#define PEND_KEEP ((size_t)4096)     /* pending buffer slack kept between calls */

enum { SEG_LITERAL = 0, SEG_CLASS = 1, SEG_JSON = 2 };

static const uint64_t K8 = 0x9E3779B97F4A7C15ull;
static const uint64_t K4 = 0xC2B2AE3D27D4EB4Full;
/* The shape prefilter: shapes are put in GROUPS groups by the first three bytes of their opening
 * literal; TRI[c] has bit g (+ 21 * j) when byte c can be byte j of an opener of group g. */
#define GROUPS 21

/* Two different bits of a byte, from 6 bits of hash: the byte-blocked bloom filters' probe. */
static const uint8_t MASK8[64] = {
#define M8(i) (uint8_t)((1u << ((i) & 7)) | (1u << ((((i) & 7) + 1 + ((i) >> 3) % 7) & 7)))
#define M8_8(i) M8(i), M8(i + 1), M8(i + 2), M8(i + 3), M8(i + 4), M8(i + 5), M8(i + 6), M8(i + 7)
    M8_8(0), M8_8(8), M8_8(16), M8_8(24), M8_8(32), M8_8(40), M8_8(48), M8_8(56),
#undef M8_8
#undef M8
};
#define LANE ((UINT64_C(1) << GROUPS) - 1)

/* Three different bits of a 16-bit word, from 8 bits of hash: the 4-gram filter's probe. With two
 * bits of a byte (MASK8) the filter let through one block in 70 to 90 of JSON and code, nearly
 * all of them for a few very common 4-grams (`e":"`, `":[{`, four spaces) that happened to land
 * on set bits; three bits of 16 in the same bytes make such a collision some 8 times rarer. */
static const uint16_t MASK16[256] = {
#define M16(i)                                                                                    \
    (uint16_t)((1u << ((i) & 15)) | (1u << (((i) + 3 + (((i) >> 4) & 3) * 2) & 15)) |            \
               (1u << (((i) + 10 + (((i) >> 6) & 3)) & 15)))
#define M16_4(i) M16(i), M16(i + 1), M16(i + 2), M16(i + 3)
#define M16_32(i)                                                                                 \
    M16_4(i), M16_4(i + 4), M16_4(i + 8), M16_4(i + 12), M16_4(i + 16), M16_4(i + 20),            \
        M16_4(i + 24), M16_4(i + 28)
    M16_32(0),   M16_32(32),  M16_32(64),  M16_32(96),
    M16_32(128), M16_32(160), M16_32(192), M16_32(224),
#undef M16_32
#undef M16_4
#undef M16
};

/* ------------------------------------------------------------------------------------------ */
/* small helpers */

static inline uint64_t ld64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

/* Is the 4-gram at g (one of the literals' keys' 4-grams, maybe) in the filter? */
static inline int b4_has(const uint16_t *b4, size_t b4_mask, const uint8_t *g) {
    uint64_t h = (uint64_t)ld32(g) * K4;
    uint16_t want = MASK16[h >> 56];
    return (b4[(h >> 32) & b4_mask] & want) == want;
}

/* The first `len` (< 8) bytes as a little-endian number. */
static inline uint64_t ld_short(const uint8_t *p, size_t len) {
    uint64_t v = 0;
    for (size_t i = 0; i < len; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/* The first `len` (<= 8) bytes in the high bytes of a number, so numbers sort as the bytes do. */
static inline uint64_t be_prefix(const uint8_t *p, size_t len) {
    uint64_t v = 0;
    for (size_t i = 0; i < len; i++) v |= (uint64_t)p[i] << (56 - 8 * i);
    return v;
}

static inline uint8_t lower(uint8_t c) { return (c >= 'A' && c <= 'Z') ? (uint8_t)(c + 32) : c; }

static inline int bit_of(const uint8_t *bits, unsigned b) { return (bits[b >> 3] >> (b & 7)) & 1; }

static inline int is_zw(const uint8_t *r) {
    if (r[0] == 0xE2)
        return (r[1] == 0x80 && r[2] >= 0x8B && r[2] <= 0x8D) || (r[1] == 0x81 && r[2] == 0xA0);
    return r[0] == 0xEF && r[1] == 0xBB && r[2] == 0xBF;
}

/* Offset of the first zero-width character wholly inside r[0:n], or n. Occurrences cannot
 * overlap (their continuation bytes are never 0xE2 / 0xEF), so this is where split() would
 * first take one out. */
static size_t find_zw(const uint8_t *r, size_t n) {
    size_t i = 0;
#if defined(__SSE2__)
    const __m128i e2 = _mm_set1_epi8((char)0xE2), ef = _mm_set1_epi8((char)0xEF);
    for (; i + 16 <= n; i += 16) {
        __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(r + i));
        unsigned m = (unsigned)_mm_movemask_epi8(
            _mm_or_si128(_mm_cmpeq_epi8(v, e2), _mm_cmpeq_epi8(v, ef)));
        while (m) {
            size_t j = i + (size_t)__builtin_ctz(m);
            if (j + 3 <= n && is_zw(r + j)) return j;
            m &= m - 1;
        }
    }
#endif
    for (; i + 3 <= n; i++) {
        if ((r[i] == 0xE2 || r[i] == 0xEF) && is_zw(r + i)) return i;
    }
    return n;
}

#if defined(SCRUB_AVX2)
__attribute__((target("avx2"))) static size_t find_zw_avx2(const uint8_t *r, size_t n) {
    const __m256i e2 = _mm256_set1_epi8((char)0xE2), ef = _mm256_set1_epi8((char)0xEF);
    size_t i = 0;
    /* 64 bytes a step: one mask for both halves */
    for (; i + 64 <= n; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(r + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(r + i + 32));
        uint64_t m = (uint32_t)_mm256_movemask_epi8(
            _mm256_or_si256(_mm256_cmpeq_epi8(a, e2), _mm256_cmpeq_epi8(a, ef)));
        m |= (uint64_t)(uint32_t)_mm256_movemask_epi8(
                 _mm256_or_si256(_mm256_cmpeq_epi8(b, e2), _mm256_cmpeq_epi8(b, ef)))
             << 32;
        while (m) {
            size_t j = i + (size_t)__builtin_ctzll(m);
            if (j + 3 <= n && is_zw(r + j)) return j;
            m &= m - 1;
        }
    }
    for (; i + 32 <= n; i += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(r + i));
        uint32_t m = (uint32_t)_mm256_movemask_epi8(
            _mm256_or_si256(_mm256_cmpeq_epi8(v, e2), _mm256_cmpeq_epi8(v, ef)));
        while (m) {
            size_t j = i + (size_t)__builtin_ctz(m);
            if (j + 3 <= n && is_zw(r + j)) return j;
            m &= m - 1;
        }
    }
    for (; i + 3 <= n; i++) {
        if ((r[i] == 0xE2 || r[i] == 0xEF) && is_zw(r + i)) return i;
    }
    return n;
}
#endif

static size_t pow2_at_least(size_t x) {
    size_t p = 1;
    while (p < x && p < ((size_t)1 << 62)) p <<= 1;
    return p;
}

static unsigned log2_of(size_t pow2) {
    unsigned b = 0;
    while (((size_t)1 << b) < pow2) b++;
    return b;
}

/* a * b + c, or SIZE_MAX on overflow */
static size_t mul_add(size_t a, size_t b, size_t c) {
    if (b && a > (SIZE_MAX - c) / b) return SIZE_MAX;
    return a * b + c;
}

static void *xmalloc(size_t count, size_t size) {
    if (count == 0) count = 1;
    if (size && count > SIZE_MAX / size) return NULL;
    return malloc(count * size);
}

static void *xcalloc(size_t count, size_t size) {
    if (count == 0) count = 1;
    return calloc(count, size);
}

/* ------------------------------------------------------------------------------------------ */
/* tables */

typedef struct {
    uint32_t off, len, name;
    uint32_t window;
} lit_t;

typedef struct {
    uint32_t kind, fold;
    uint32_t lit_off, lit_len;
    uint32_t min, max;
    uint32_t stop_off, stop_len;
    uint32_t suf_first, suf_count;
    const uint8_t *cls; /* 32-byte bitmap in the blob (CLASS) */
} seg_t;

typedef struct {
    uint32_t seg_first, nseg;
    int32_t redact_from, redact_to, name_from, optional_from;
    uint32_t name;
    const uint8_t *not_after; /* 32-byte bitmap in the blob, or NULL */
    const uint8_t *not_before; /* the byte after the match: 32-byte bitmap, or NULL */
    uint8_t open_low[3];      /* the opening literal's first three bytes, lowercase */
    uint8_t check;            /* CHECK_*: a checksum the body must satisfy */
    uint8_t placeholder;      /* PH_*: which placeholder bodies are no match */
    uint32_t entropy_k;       /* 0, or 2**min_entropy in 16.16 fixed point */
} shape_t;

#define PH_NONE 0
#define PH_TOKEN 1 /* scrub_patterns.Placeholder */
#define PH_VALUE 2
#define CHECK_NONE 0
#define CHECK_CRC32_BASE62 1 /* scrub_patterns.Check */
#define CHECK_PEM_KEY 2

typedef struct {
    uint64_t key;
    int32_t window; /* first window literal holding this 8-byte run, or -1 */
    uint32_t anch_off, anch_cnt;
    uint32_t used;
} hent_t;

/* A whole literal of >= 8 bytes, under the entry of its first 8: its next 8 bytes (as many as it
 * has) and their mask, so most of a long list is refused without a memcmp. */
typedef struct {
    uint64_t w2, m2;
    uint32_t idx, len;
} anch_t;

typedef struct {
    uint64_t key;
    int32_t idx;
    uint32_t used;
} sent_t;

typedef struct {
    uint64_t be; /* value in the high bytes */
    uint32_t len;
} sprefix_t;


typedef struct {
    uint32_t key; /* the three bytes + 1 (0: empty) */
    uint32_t first, count;
} key3_t;

struct scrub_tables {
    uint8_t *blob;
    size_t blob_len;
    uint32_t *names; /* off, len */
    size_t nnames;
    lit_t *lits;
    size_t nlits;
    seg_t *segs;
    size_t nsegs;
    uint32_t *sufs; /* off, len */
    size_t nsufs;
    shape_t *shapes;
    size_t nshapes;
    size_t max_nseg;

    /* 8-byte keys */
    hent_t *ht;
    size_t ht_mask;
    unsigned ht_shift;
    size_t nkeys;
    anch_t *anch;
    uint64_t *bloom8;
    unsigned b8_shift;
    uint16_t *bloom4; /* blocked: 3 bits of one 16-bit word per 4-gram (b4_has) */
    size_t b4_mask;
    uint64_t *pk; /* every key, big-endian, sorted: the tails of 8-byte keys */
    size_t npk;

    /* literals shorter than 8 bytes */
    sent_t *stab_len[WINDOW]; /* per length 1..7 */
    size_t smask_len[WINDOW];
    unsigned short_lens; /* bit L: a literal of length L exists */
    uint8_t short_first[32];
    sprefix_t *sp; /* (value, length) sorted: the tails of short literals */
    size_t nsp;
    /* tails, quickly: proper prefixes of 1 and 2 bytes exactly, longer ones through a filter */
    uint8_t tail1[32];
    uint8_t *tail2; /* 65536 bits */
    uint8_t *tailb; /* byte-blocked bloom over (prefix, length) for lengths 3..7 */
    size_t tailb_mask;

    /* shape prefilter */
    uint64_t tri[256];
    uint32_t gfirst[GROUPS + 1]; /* group g's shapes: gshapes[gfirst[g] .. gfirst[g + 1]] */
    uint32_t *gshapes;
    /* ... then exactly: the shapes whose opening literal can begin with these three bytes (every
     * case of a case-folded one), in an open-addressing table keyed by the bytes; the TRI lanes
     * alone let through many three-byte strings no shape opens with once there are more than
     * GROUPS distinct openings */
    key3_t *k3;
    size_t k3_mask;
    uint32_t *k3_shapes;
    /* ... and the same keys as bits of a 64 Kbit map (K3BITS_HASH): a test with no branch for
     * the AVX2 loop's candidates, which mostly stop there (a few keys share a bit: the table
     * decides) */
    uint8_t *k3bits;
    /* the shapes by the lowercase first byte of their opening (shape_tail): t1_shapes[t1_first[b]
     * .. t1_first[b + 1]], in shape order */
    uint32_t t1_first[257];
    uint32_t *t1_shapes;
    uint8_t open_first[32]; /* lowercase first bytes of the opening literals (shape_tail) */
    /* ... and before it on x86-64 with AVX2, a nibble filter over four bytes ("Teddy"): 16
     * buckets of shapes, two sets of 8 bits; a position is a candidate when, for each offset j,
     * lo[j][byte & 15] & hi[j][byte >> 4] keeps a bit of one bucket at all four offsets */
    int simd;
    uint8_t ted_lo[2][4][16], ted_hi[2][4][16];

    size_t footprint;
};

static size_t blob_ok(const scrub_tables *t, int64_t off, int64_t len) {
    return off >= 0 && len >= 0 && (uint64_t)off <= t->blob_len &&
           (uint64_t)len <= t->blob_len - (uint64_t)off;
}

void scrub_tables_free(scrub_tables *t) {
    if (!t) return;
    free(t->blob);
    free(t->names);
    free(t->lits);
    free(t->segs);
    free(t->sufs);
    free(t->shapes);
    free(t->ht);
    free(t->anch);
    free(t->bloom8);
    free(t->bloom4);
    free(t->pk);
    for (int L = 0; L < WINDOW; L++) free(t->stab_len[L]);
    free(t->sp);
    free(t->tail2);
    free(t->tailb);
    free(t->gshapes);
    free(t->k3);
    free(t->k3_shapes);
    free(t->k3bits);
    free(t->t1_shapes);
    free(t);
}

size_t scrub_tables_footprint(const scrub_tables *t) { return t ? t->footprint : 0; }

int scrub_tables_simd(const scrub_tables *t) { return t ? t->simd : 0; }

static hent_t *ht_slot(scrub_tables *t, uint64_t key) {
    size_t i = (size_t)((key * K8) >> t->ht_shift);
    while (t->ht[i].used && t->ht[i].key != key) i = (i + 1) & t->ht_mask;
    return &t->ht[i];
}

static void bloom_add(uint64_t *words, unsigned shift, uint64_t h) {
    uint64_t *w = &words[h >> shift];
    *w |= (uint64_t)1 << ((h >> (shift - 6)) & 63);
    *w |= (uint64_t)1 << ((h >> (shift - 12)) & 63);
}

static inline int bloom_has(const uint64_t *words, unsigned shift, uint64_t h) {
    uint64_t w = words[h >> shift];
    return (int)((w >> ((h >> (shift - 6)) & 63)) & (w >> ((h >> (shift - 12)) & 63)) & 1);
}

/* A bloom filter of 2^k 64-bit words with k from the number of keys; shift = 64 - k. */
static uint64_t *bloom_new(size_t keys, size_t bits_per_key, unsigned *shift, size_t *bytes) {
    size_t words = pow2_at_least(mul_add(keys, bits_per_key, 0) / 64 + 1);
    if (words < 8) words = 8;
    if (words > ((size_t)1 << 40)) return NULL;
    *shift = 64 - log2_of(words);
    *bytes += words * 8;
    return xcalloc(words, 8);
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static int cmp_sprefix(const void *a, const void *b) {
    const sprefix_t *x = a, *y = b;
    if (x->be != y->be) return (x->be > y->be) - (x->be < y->be);
    return (x->len > y->len) - (x->len < y->len);
}

static inline uint64_t tail_hash(const uint8_t *s, size_t m) {
    return (be_prefix(s, m) ^ (uint64_t)m) * K8;
}

static void tail_bloom_add(scrub_tables *t, const uint8_t *s, size_t m) {
    uint64_t h = tail_hash(s, m);
    t->tailb[(h >> 32) & t->tailb_mask] |= MASK8[h >> 58];
}

static int build_literals(scrub_tables *t) {
    /* Bound on distinct 8-byte keys: every run of every window literal, plus one per whole one. */
    size_t bound = 0, nshort = 0;
    for (size_t i = 0; i < t->nlits; i++) {
        const lit_t *L = &t->lits[i];
        if (L->window) bound += L->len - WINDOW + 1;
        else if (L->len >= WINDOW) bound += 1;
        else nshort++;
    }
    size_t cap = pow2_at_least(mul_add(bound, 2, 16));
    if (cap > ((size_t)1 << 40)) return SCRUB_ETOOBIG;
    t->ht = xcalloc(cap, sizeof(hent_t));
    if (!t->ht) return SCRUB_ENOMEM;
    t->footprint += cap * sizeof(hent_t);
    t->ht_mask = cap - 1;
    t->ht_shift = 64 - log2_of(cap);
    if (t->ht_shift == 64) t->ht_shift = 63;

    size_t nanch = 0;
    for (size_t i = 0; i < t->nlits; i++) {
        const lit_t *L = &t->lits[i];
        const uint8_t *v = t->blob + L->off;
        if (L->window) {
            for (size_t j = 0; j + WINDOW <= L->len; j++) {
                uint64_t key = ld64(v + j);
                hent_t *e = ht_slot(t, key);
                if (!e->used) {
                    e->used = 1;
                    e->key = key;
                    e->window = -1;
                    t->nkeys++;
                }
                if (e->window < 0) e->window = (int32_t)i;
            }
        } else if (L->len >= WINDOW) {
            hent_t *e = ht_slot(t, ld64(v));
            if (!e->used) {
                e->used = 1;
                e->key = ld64(v);
                e->window = -1;
                t->nkeys++;
            }
            e->anch_cnt++;
            nanch++;
        }
    }
    /* anchored lists, in literal order */
    t->anch = xmalloc(nanch, sizeof(anch_t));
    if (!t->anch) return SCRUB_ENOMEM;
    t->footprint += nanch * sizeof(anch_t);
    uint32_t off = 0;
    for (size_t i = 0; i < cap; i++) {
        if (t->ht[i].used) {
            t->ht[i].anch_off = off;
            off += t->ht[i].anch_cnt;
            t->ht[i].anch_cnt = 0;
        }
    }
    for (size_t i = 0; i < t->nlits; i++) {
        const lit_t *L = &t->lits[i];
        if (!L->window && L->len >= WINDOW) {
            hent_t *e = ht_slot(t, ld64(t->blob + L->off));
            anch_t *a = &t->anch[e->anch_off + e->anch_cnt++];
            size_t more = L->len - WINDOW < 8 ? L->len - WINDOW : 8;
            a->w2 = ld_short(t->blob + L->off + WINDOW, more);
            a->m2 = more == 8 ? ~(uint64_t)0 : ((uint64_t)1 << (8 * more)) - 1;
            a->idx = (uint32_t)i;
            a->len = L->len;
        }
    }
    /* filters and the sorted key list (tails) */
    t->bloom8 = bloom_new(t->nkeys, 32, &t->b8_shift, &t->footprint);
    /* 64 bits per key, 13 per 4-gram; at most 2**24 words, so the word's index (hash bits 32..55)
     * and its mask (56..63) do not share bits */
    size_t b4_words = pow2_at_least(mul_add(t->nkeys, 4, 32));
    if (b4_words > ((size_t)1 << 24)) b4_words = (size_t)1 << 24;
    t->bloom4 = xcalloc(b4_words, sizeof(uint16_t));
    t->b4_mask = b4_words - 1;
    t->footprint += b4_words * sizeof(uint16_t);
    t->pk = xmalloc(t->nkeys, sizeof(uint64_t));
    if (!t->bloom8 || !t->bloom4 || !t->pk) return SCRUB_ENOMEM;
    t->footprint += t->nkeys * sizeof(uint64_t);
    for (size_t i = 0; i < cap; i++) {
        if (!t->ht[i].used) continue;
        uint64_t key = t->ht[i].key;
        uint8_t bytes[8];
        for (int b = 0; b < 8; b++) bytes[b] = (uint8_t)(key >> (8 * b));
        bloom_add(t->bloom8, t->b8_shift, key * K8);
        for (int d = 0; d <= 4; d++) {
            uint64_t g = (uint64_t)ld32(bytes + d) * K4;
            t->bloom4[(g >> 32) & t->b4_mask] |= MASK16[g >> 56];
        }
        t->pk[t->npk++] = be_prefix(bytes, 8);
    }
    qsort(t->pk, t->npk, sizeof(uint64_t), cmp_u64);

    /* short literals: one table per length, the first literal of each value wins */
    t->sp = xmalloc(nshort, sizeof(sprefix_t));
    if (!t->sp) return SCRUB_ENOMEM;
    t->footprint += nshort * sizeof(sprefix_t);
    size_t per_len[WINDOW] = {0};
    for (size_t i = 0; i < t->nlits; i++) {
        if (t->lits[i].len < WINDOW) per_len[t->lits[i].len]++;
    }
    for (int L = 1; L < WINDOW; L++) {
        if (!per_len[L]) continue;
        size_t c = pow2_at_least(per_len[L] * 2 + 2);
        t->stab_len[L] = xcalloc(c, sizeof(sent_t));
        if (!t->stab_len[L]) return SCRUB_ENOMEM;
        t->footprint += c * sizeof(sent_t);
        t->smask_len[L] = c - 1;
        t->short_lens |= 1u << L;
    }
    for (size_t i = 0; i < t->nlits; i++) {
        const lit_t *L = &t->lits[i];
        if (L->len >= WINDOW) continue;
        const uint8_t *v = t->blob + L->off;
        uint64_t key = ld_short(v, L->len);
        size_t mask = t->smask_len[L->len];
        size_t j = (size_t)((key * K8) >> 20) & mask;
        sent_t *tab = t->stab_len[L->len];
        while (tab[j].used && tab[j].key != key) j = (j + 1) & mask;
        if (!tab[j].used) {
            tab[j].used = 1;
            tab[j].key = key;
            tab[j].idx = (int32_t)i;
        }
        t->short_first[v[0] >> 3] |= (uint8_t)(1u << (v[0] & 7));
        t->sp[t->nsp].be = be_prefix(v, L->len);
        t->sp[t->nsp].len = L->len;
        t->nsp++;
    }
    qsort(t->sp, t->nsp, sizeof(sprefix_t), cmp_sprefix);

    /* the tails' quick tests */
    size_t tb = pow2_at_least(mul_add(t->nkeys + t->nsp, 5 * 2, 64));
    if (tb > ((size_t)1 << 26)) tb = (size_t)1 << 26;
    t->tail2 = xcalloc(65536 / 8, 1);
    t->tailb = xcalloc(tb, 1);
    if (!t->tail2 || !t->tailb) return SCRUB_ENOMEM;
    t->tailb_mask = tb - 1;
    t->footprint += 65536 / 8 + tb;
    for (size_t i = 0; i < t->npk + t->nsp; i++) {
        uint8_t bytes[8];
        size_t len = i < t->npk ? 8 : t->sp[i - t->npk].len;
        uint64_t be = i < t->npk ? t->pk[i] : t->sp[i - t->npk].be;
        for (int b = 0; b < 8; b++) bytes[b] = (uint8_t)(be >> (56 - 8 * b));
        for (size_t m = 1; m < len; m++) {
            if (m == 1) t->tail1[bytes[0] >> 3] |= (uint8_t)(1u << (bytes[0] & 7));
            else if (m == 2) t->tail2[bytes[0] * 32 + (bytes[1] >> 3)] |= (uint8_t)(1u << (bytes[1] & 7));
            else tail_bloom_add(t, bytes, m);
        }
    }
    return SCRUB_OK;
}

static int build_shapes(scrub_tables *t) {
    /* group: the index of the shape's lowercase key among the distinct ones, modulo GROUPS (with
     * at most GROUPS distinct keys the filter is exact up to ASCII case) */
    uint32_t *keys = xmalloc(t->nshapes, sizeof(uint32_t));
    uint32_t *group = xmalloc(t->nshapes, sizeof(uint32_t));
    t->gshapes = xmalloc(t->nshapes, sizeof(uint32_t));
    if (!keys || !group || !t->gshapes) {
        free(keys);
        free(group);
        return SCRUB_ENOMEM;
    }
    t->footprint += t->nshapes * sizeof(uint32_t);
    size_t nkeys = 0;
    uint32_t count[GROUPS] = {0};
    for (size_t k = 0; k < t->nshapes; k++) {
        const uint8_t *o = t->shapes[k].open_low;
        uint32_t key = (uint32_t)o[0] | ((uint32_t)o[1] << 8) | ((uint32_t)o[2] << 16);
        size_t j = 0;
        while (j < nkeys && keys[j] != key) j++;
        if (j == nkeys) keys[nkeys++] = key;
        group[k] = (uint32_t)(j % GROUPS);
        t->open_first[o[0] >> 3] |= (uint8_t)(1u << (o[0] & 7));
        count[group[k]]++;
        const seg_t *g = &t->segs[t->shapes[k].seg_first];
        const uint8_t *lit = t->blob + g->lit_off;
        for (int b = 0; b < 3; b++) {
            uint64_t bit = UINT64_C(1) << (group[k] + GROUPS * (unsigned)b);
            uint8_t c = lit[b];
            t->tri[c] |= bit;
            if (g->fold) {
                t->tri[lower(c)] |= bit;
                if (c >= 'a' && c <= 'z') t->tri[c - 32] |= bit;
            }
        }
    }
    uint32_t off = 0;
    for (int g = 0; g < GROUPS; g++) {
        t->gfirst[g] = off;
        off += count[g];
        count[g] = 0;
    }
    t->gfirst[GROUPS] = off;
    for (size_t k = 0; k < t->nshapes; k++) {
        t->gshapes[t->gfirst[group[k]] + count[group[k]]++] = (uint32_t)k;
    }
    free(keys);
    free(group);
    return SCRUB_OK;
}

static inline uint32_t key3_of(const uint8_t *s) {
    return (uint32_t)s[0] | ((uint32_t)s[1] << 8) | ((uint32_t)s[2] << 16);
}

static inline size_t key3_slot(uint32_t key, size_t mask) {
    return (size_t)((key * UINT32_C(0x9E3779B1)) >> 7) & mask;
}

/* The bit of scrub_tables.k3bits for a key. */
#define K3BITS_HASH(key) ((uint32_t)((key) * UINT32_C(0x9E3779B1)) >> 16)

static int cmp_u64v(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The exact table of shape openings (scrub_tables.k3): (key << 16 | shape) pairs sorted, so each
 * key's shapes are consecutive and in shape order. */
static int build_key3(scrub_tables *t) {
    size_t npairs = 0;
    uint64_t *pairs = xmalloc(t->nshapes, 8 * sizeof(uint64_t));
    if (!pairs && t->nshapes) return SCRUB_ENOMEM;
    for (size_t k = 0; k < t->nshapes; k++) {
        const seg_t *g = &t->segs[t->shapes[k].seg_first];
        const uint8_t *lit = t->blob + g->lit_off;
        for (unsigned v = 0; v < 8; v++) { /* bit b of v: byte b in the other case */
            uint8_t b3[3];
            int same = 1;
            for (int b = 0; b < 3; b++) {
                uint8_t c = lit[b], o = c;
                if (g->fold && ((v >> b) & 1)) {
                    if (c >= 'a' && c <= 'z') o = (uint8_t)(c - 32);
                    else if (c >= 'A' && c <= 'Z') o = (uint8_t)(c + 32);
                }
                if ((v >> b) & 1 && o == c) same = 0; /* a variant equal to another: skip */
                b3[b] = o;
            }
            if (v && !same) continue;
            pairs[npairs++] = ((uint64_t)key3_of(b3) << 16) | (uint64_t)k;
            if (!g->fold) break;
        }
    }
    t->t1_shapes = xmalloc(t->nshapes ? t->nshapes : 1, sizeof(uint32_t));
    if (!t->t1_shapes) {
        free(pairs);
        return SCRUB_ENOMEM;
    }
    t->footprint += t->nshapes * sizeof(uint32_t);
    memset(t->t1_first, 0, sizeof(t->t1_first));
    for (size_t k = 0; k < t->nshapes; k++) t->t1_first[t->shapes[k].open_low[0] + 1]++;
    for (int b = 0; b < 256; b++) t->t1_first[b + 1] += t->t1_first[b];
    uint32_t fill[256];
    memcpy(fill, t->t1_first, sizeof(fill));
    for (size_t k = 0; k < t->nshapes; k++) t->t1_shapes[fill[t->shapes[k].open_low[0]]++] = (uint32_t)k;
    qsort(pairs, npairs, sizeof(uint64_t), cmp_u64v);
    size_t nkeys = 0;
    for (size_t i = 0; i < npairs; i++) nkeys += !i || (pairs[i] >> 16) != (pairs[i - 1] >> 16);
    size_t size = pow2_at_least(2 * nkeys + 2);
    t->k3 = xcalloc(size, sizeof(key3_t));
    t->k3_shapes = xmalloc(npairs ? npairs : 1, sizeof(uint32_t));
    t->k3bits = xcalloc(65536 / 8, 1);
    if (!t->k3 || !t->k3_shapes || !t->k3bits) {
        free(pairs);
        return SCRUB_ENOMEM;
    }
    t->k3_mask = size - 1;
    t->footprint += size * sizeof(key3_t) + npairs * sizeof(uint32_t) + 65536 / 8;
    for (size_t i = 0; i < npairs;) {
        uint32_t key = (uint32_t)(pairs[i] >> 16);
        size_t j = i;
        while (j < npairs && (uint32_t)(pairs[j] >> 16) == key) {
            t->k3_shapes[j] = (uint32_t)(pairs[j] & 0xFFFF);
            j++;
        }
        uint32_t bit = K3BITS_HASH(key);
        t->k3bits[bit >> 3] |= (uint8_t)(1u << (bit & 7));
        size_t slot = key3_slot(key, t->k3_mask);
        while (t->k3[slot].key) slot = (slot + 1) & t->k3_mask;
        t->k3[slot].key = key + 1;
        t->k3[slot].first = (uint32_t)i;
        t->k3[slot].count = (uint32_t)(j - i);
        i = j;
    }
    free(pairs);
    return SCRUB_OK;
}

/* A rough model of the text being scrubbed (English, code, JSON), used only to choose which
 * shapes share a bucket of the nibble filter: the cost of a bucket is the weight of what it lets
 * through. */
static double text_weight(unsigned b) {
    static const double EN[26] = {8.2, 1.5, 2.8, 4.3, 12.7, 2.2, 2.0, 6.1, 7.0, 0.15, 0.8, 4.0, 2.4,
                                  6.7, 7.5, 1.9, 0.1, 6.0, 6.3, 9.1, 2.8, 1.0, 2.4, 0.15, 2.0, 0.07};
    if (b >= 'a' && b <= 'z') return EN[b - 'a'];
    if (b >= 'A' && b <= 'Z') return EN[b - 'A'] * 0.08;
    if (b >= '0' && b <= '9') return 0.4;
    if (b == ' ') return 16.0;
    if (b == '\n') return 2.0;
    /* measured on source code (CPython's standard library): '_' 1.7 %, '.' 1.2 %, '(' and ')'
     * 1.1 % each of the bytes, against about 7 % for 'e' */
    if (b == '_') return 2.2;
    if (b == '.' || b == '(' || b == ')') return 1.6;
    if (strchr("-,\"':=/[]{}", (int)b) && b) return 0.6;
    if (b >= 0x21 && b < 0x7f) return 0.1;
    if (b >= 0x80) return 0.01;
    return 0.005;
}

typedef struct {
    uint16_t lo[4], hi[4]; /* nibble sets per offset */
} tbucket_t;

/* w[h][half][m]: the weight of the bytes with high nibble h and a low nibble in the 8-bit mask m
 * of the low (half 0) or high (half 1) eight low nibbles, so a bucket's cost takes 128 sums, not
 * 1,024 (the greedy merge below evaluates thousands of buckets for a large shape set). */
typedef double wtab_t[16][2][256];

static void weight_table(wtab_t w) {
    double one[256];
    for (unsigned c = 0; c < 256; c++) one[c] = text_weight(c);
    for (unsigned h = 0; h < 16; h++) {
        for (unsigned half = 0; half < 2; half++) {
            const double *row = one + h * 16 + half * 8;
            w[h][half][0] = 0.0;
            for (unsigned m = 1; m < 256; m++) { /* m without its lowest bit, plus that bit */
                unsigned low = (unsigned)__builtin_ctz(m);
                w[h][half][m] = w[h][half][m & (m - 1)] + row[low];
            }
        }
    }
}

static double bucket_cost(const tbucket_t *b, wtab_t w) {
    double cost = 1.0;
    for (int j = 0; j < 4; j++) {
        double sum = 0.0;
        unsigned lo = b->lo[j], hm = b->hi[j];
        while (hm) {
            unsigned h = (unsigned)__builtin_ctz(hm);
            hm &= hm - 1;
            sum += w[h][0][lo & 0xFF] + w[h][1][lo >> 8];
        }
        cost *= sum;
    }
    return cost;
}

static void bucket_add(tbucket_t *b, int j, unsigned byte) {
    b->lo[j] |= (uint16_t)(1u << (byte & 15));
    b->hi[j] |= (uint16_t)(1u << (byte >> 4));
}

static void bucket_merge(tbucket_t *into, const tbucket_t *from) {
    for (int j = 0; j < 4; j++) {
        into->lo[j] |= from->lo[j];
        into->hi[j] |= from->hi[j];
    }
}

/* The bytes shape sh lets through at offsets shift..shift+3 of a match: its opening literal,
 * then the first byte of the next segment when that segment must take one, then anything. A
 * shape whose match would begin at p can only do so (or need more text) when the bytes at
 * p+shift..p+shift+3 pass. */
static void shape_bucket(const scrub_tables *t, const shape_t *sh, tbucket_t *b, int shift) {
    memset(b, 0, sizeof(*b));
    const seg_t *open = &t->segs[sh->seg_first];
    const uint8_t *lit = t->blob + open->lit_off;
    for (int j = 0; j < 4; j++) {
        int pos = j + shift; /* the offset in the match of the byte at filter offset j */
        if ((uint32_t)pos < open->lit_len) {
            uint8_t c = lit[pos];
            bucket_add(b, j, c);
            if (open->fold) {
                bucket_add(b, j, lower(c));
                if (c >= 'a' && c <= 'z') bucket_add(b, j, (unsigned)c - 32);
            }
            continue;
        }
        const seg_t *next = (uint32_t)pos == open->lit_len && sh->nseg > 1 && sh->optional_from != 1
                                ? &t->segs[sh->seg_first + 1]
                                : NULL;
        if (next && next->kind == SEG_LITERAL) {
            uint8_t c = t->blob[next->lit_off];
            bucket_add(b, j, c);
            if (next->fold) {
                bucket_add(b, j, lower(c));
                if (c >= 'a' && c <= 'z') bucket_add(b, j, (unsigned)c - 32);
            }
        } else if (next && next->kind == SEG_CLASS && next->min >= 1) {
            for (unsigned c = 0; c < 256; c++) {
                if (bit_of(next->cls, c)) bucket_add(b, j, c);
            }
            if (next->stop_len) bucket_add(b, j, t->blob[next->stop_off]);
        } else {
            b->lo[j] = b->hi[j] = 0xFFFF;
        }
    }
}

#define TED_START 256

static size_t row_min(double (*extra)[TED_START], size_t nb, size_t a) {
    size_t best = a ? 0 : 1;
    for (size_t b = 0; b < nb; b++) {
        if (b != a && extra[a][b] < extra[a][best]) best = b;
    }
    return best;
}
#define TED_BUCKETS 16

/* Shapes into 16 buckets: at most TED_START to begin with (equal ones merge for free; beyond
 * that, arbitrary merges would make the filter let through most text: with 64 and the ~150
 * distinct openings of the default shapes it passed one position in 7 of source code), then
 * the two whose union lets through the least extra text merge, until 16 remain. */
static void build_ted(scrub_tables *t, int shift, uint8_t lo_out[2][4][16],
                      uint8_t hi_out[2][4][16]) {
    tbucket_t bk[TED_START];
    double cost[TED_START];
    size_t nb = 0;
    for (size_t k = 0; k < t->nshapes; k++) {
        tbucket_t b;
        shape_bucket(t, &t->shapes[k], &b, shift);
        size_t i = 0;
        while (i < nb && memcmp(&bk[i], &b, sizeof(b)) != 0) i++;
        if (i < nb) continue;
        if (nb < TED_START) {
            bk[nb++] = b;
        } else {
            bucket_merge(&bk[k % TED_START], &b);
        }
    }
    double(*w)[2][256] = malloc(sizeof(wtab_t));
    double(*extra)[TED_START] = w ? malloc(sizeof(double) * TED_START * TED_START) : NULL;
    if (!extra) { /* no memory: a coarser filter, still letting every shape through */
        for (size_t i = TED_BUCKETS; i < nb; i++) bucket_merge(&bk[i % TED_BUCKETS], &bk[i]);
        if (nb > TED_BUCKETS) nb = TED_BUCKETS;
    } else {
        weight_table(w);
    }
    for (size_t i = 0; extra && i < nb; i++) cost[i] = bucket_cost(&bk[i], w);
    /* extra[a][b]: what merging a and b lets through beyond each alone. Kept between rounds and
     * recomputed only for the bucket a merge changed (with a hundred shapes and more, computing
     * every pair every round took tens of milliseconds per table set). */
    for (size_t a = 0; extra && a < nb; a++) {
        for (size_t b = a + 1; b < nb; b++) {
            tbucket_t u = bk[a];
            bucket_merge(&u, &bk[b]);
            extra[a][b] = extra[b][a] =
                bucket_cost(&u, w) - cost[a] - cost[b];
        }
    }
    /* rmin[a]: a partner b of a with, as far as is known, the least extra[a][b]: never more than
     * the row's least after a round (a lower new entry replaces it), but it may be stale and too
     * low (its entry rose); the row with the least is checked against its whole row before it
     * merges (lazy greedy: a few rows a round, not nb) */
    size_t rmin[TED_START];
    double rval[TED_START];
    for (size_t a = 0; extra && a < nb; a++) {
        rmin[a] = row_min(extra, nb, a);
        rval[a] = extra[a][rmin[a]];
    }
    while (extra && nb > TED_BUCKETS) {
        size_t best_a;
        for (;;) {
            best_a = 0;
            for (size_t a = 1; a < nb; a++) {
                if (rval[a] < rval[best_a]) best_a = a;
            }
            size_t r = row_min(extra, nb, best_a);
            if (r == rmin[best_a] && extra[best_a][r] == rval[best_a]) break;
            rmin[best_a] = r; /* stale: the row's true least, then choose again */
            rval[best_a] = extra[best_a][r];
        }
        size_t best_b = rmin[best_a];
        if (best_b < best_a) {
            size_t x = best_a;
            best_a = best_b;
            best_b = x;
        }
        size_t last = nb - 1;
        bucket_merge(&bk[best_a], &bk[best_b]);
        cost[best_a] = bucket_cost(&bk[best_a], w);
        /* the last bucket takes best_b's place, with its row of the matrix */
        bk[best_b] = bk[last];
        cost[best_b] = cost[last];
        rmin[best_b] = rmin[last];
        rval[best_b] = rval[last];
        for (size_t i = 0; i < last; i++) {
            if (i != best_b) extra[i][best_b] = extra[best_b][i] = extra[i][last];
        }
        nb--;
        for (size_t i = 0; i < nb; i++) {
            if (i == best_a) continue;
            tbucket_t u = bk[best_a];
            bucket_merge(&u, &bk[i]);
            extra[i][best_a] = extra[best_a][i] = bucket_cost(&u, w) - cost[best_a] - cost[i];
        }
        rmin[best_a] = row_min(extra, nb, best_a);
        rval[best_a] = extra[best_a][rmin[best_a]];
        for (size_t i = 0; i < nb; i++) {
            if (i == best_a) continue;
            if (rmin[i] == last) rmin[i] = best_b; /* the moved bucket's new index */
            if (rmin[i] == i || rmin[i] >= nb) {
                rmin[i] = row_min(extra, nb, i);
                rval[i] = extra[i][rmin[i]];
            } else if (extra[i][best_a] < rval[i]) {
                rmin[i] = best_a;
                rval[i] = extra[i][best_a];
            }
        }
    }
    free(extra);
    free(w);
    memset(lo_out, 0, 2 * 4 * 16);
    memset(hi_out, 0, 2 * 4 * 16);
    for (size_t i = 0; i < nb; i++) {
        uint8_t bit = (uint8_t)(1u << (i % 8));
        for (int j = 0; j < 4; j++) {
            for (unsigned x = 0; x < 16; x++) {
                if ((bk[i].lo[j] >> x) & 1) lo_out[i / 8][j][x] |= bit;
                if ((bk[i].hi[j] >> x) & 1) hi_out[i / 8][j][x] |= bit;
            }
        }
    }
}

/* The nibble filter on the bytes at offsets 0..3 of a match. With the ~200 distinct openings of
 * the default shapes it lets through about one position in 50 of prose and code; those go on to
 * k3bits (fast_avx2). A second nibble filter, grouping the openings otherwise, halved that, but
 * computed in the loop it cost more than the candidates it saved, and on the branch taken when
 * the first let a position through it cost more again (mispredictions). */
static void build_teddy(scrub_tables *t, int simd) {
    build_ted(t, 0, t->ted_lo, t->ted_hi);
#if defined(SCRUB_AVX2)
    __builtin_cpu_init();
    t->simd = simd && t->nshapes > 0 && __builtin_cpu_supports("avx2");
#else
    (void)simd;
#endif
}

int scrub_tables_new(const char *blob, size_t blob_len, const int32_t *names, size_t nnames,
                     const int32_t *lits, size_t nlits, const int32_t *shapes, size_t nshapes,
                     const int32_t *segs, size_t nsegs, const int32_t *sufs, size_t nsufs,
                     uint32_t flags, scrub_tables **out) {
    *out = NULL;
    if (blob_len > (size_t)INT32_MAX || nnames > (size_t)INT32_MAX || nlits > (size_t)INT32_MAX ||
        nshapes > (size_t)UINT16_MAX || nsegs > (size_t)INT32_MAX || nsufs > (size_t)INT32_MAX)
        return SCRUB_ETOOBIG;
    scrub_tables *t = calloc(1, sizeof(*t));
    if (!t) return SCRUB_ENOMEM;
    t->footprint = sizeof(*t);
    int rc = SCRUB_ENOMEM;
    t->blob = xmalloc(blob_len, 1);
    t->names = xmalloc(nnames, 2 * sizeof(uint32_t));
    t->lits = xmalloc(nlits, sizeof(lit_t));
    t->segs = xmalloc(nsegs, sizeof(seg_t));
    t->sufs = xmalloc(nsufs, 2 * sizeof(uint32_t));
    t->shapes = xmalloc(nshapes, sizeof(shape_t));
    if (!t->blob || !t->names || !t->lits || !t->segs || !t->sufs || !t->shapes) goto fail;
    t->footprint += blob_len + nnames * 8 + nlits * sizeof(lit_t) + nsegs * sizeof(seg_t) +
                    nsufs * 8 + nshapes * sizeof(shape_t);
    if (blob_len) memcpy(t->blob, blob, blob_len);
    t->blob_len = blob_len;
    t->nnames = nnames;
    t->nlits = nlits;
    t->nsegs = nsegs;
    t->nsufs = nsufs;
    t->nshapes = nshapes;
    rc = SCRUB_EINVAL;
    for (size_t i = 0; i < nnames; i++) {
        int32_t o = names[2 * i], l = names[2 * i + 1];
        if (!blob_ok(t, o, l)) goto fail;
        t->names[2 * i] = (uint32_t)o;
        t->names[2 * i + 1] = (uint32_t)l;
    }
    for (size_t i = 0; i < nsufs; i++) {
        int32_t o = sufs[2 * i], l = sufs[2 * i + 1];
        if (!blob_ok(t, o, l)) goto fail;
        t->sufs[2 * i] = (uint32_t)o;
        t->sufs[2 * i + 1] = (uint32_t)l;
    }
    for (size_t i = 0; i < nlits; i++) {
        const int32_t *r = lits + SCRUB_LIT_FIELDS * i;
        if (!blob_ok(t, r[0], r[1]) || r[1] < 1 || r[2] < 0 || (size_t)r[2] >= nnames ||
            (r[3] != 0 && r[3] != 1) || (r[3] == 1 && r[1] < WINDOW))
            goto fail;
        t->lits[i].off = (uint32_t)r[0];
        t->lits[i].len = (uint32_t)r[1];
        t->lits[i].name = (uint32_t)r[2];
        t->lits[i].window = (uint32_t)r[3];
    }
    for (size_t i = 0; i < nsegs; i++) {
        const int32_t *r = segs + SCRUB_SEG_FIELDS * i;
        seg_t *g = &t->segs[i];
        memset(g, 0, sizeof(*g));
        g->kind = (uint32_t)r[0];
        g->fold = r[1] != 0;
        if (r[0] == SEG_LITERAL) {
            if (!blob_ok(t, r[2], r[3]) || r[3] < 1) goto fail;
            g->lit_off = (uint32_t)r[2];
            g->lit_len = (uint32_t)r[3];
        } else if (r[0] == SEG_CLASS || r[0] == SEG_JSON) {
            if (r[5] < 0 || r[6] < r[5]) goto fail;
            g->min = (uint32_t)r[5];
            g->max = (uint32_t)r[6];
            if (r[0] == SEG_CLASS) {
                if (!blob_ok(t, r[4], 32) || !blob_ok(t, r[7], r[8]) || r[9] < 0 || r[10] < 0 ||
                    (size_t)r[9] > nsufs || (size_t)r[10] > nsufs - (size_t)r[9])
                    goto fail;
                g->cls = t->blob + r[4];
                g->stop_off = (uint32_t)r[7];
                g->stop_len = (uint32_t)r[8];
                g->suf_first = (uint32_t)r[9];
                g->suf_count = (uint32_t)r[10];
            }
        } else {
            goto fail;
        }
    }
    for (size_t k = 0; k < nshapes; k++) {
        const int32_t *r = shapes + SCRUB_SHAPE_FIELDS * k;
        shape_t *s = &t->shapes[k];
        if (r[0] < 0 || r[1] < 1 || (size_t)r[0] > nsegs || (size_t)r[1] > nsegs - (size_t)r[0])
            goto fail;
        int32_t nseg = r[1];
        if (!(0 <= r[2] && r[2] < r[3] && r[3] <= nseg) || r[4] < -1 || r[4] >= nseg ||
            r[5] < -1 || r[5] == 0 || r[5] >= nseg || r[6] < 0 || (size_t)r[6] >= nnames)
            goto fail;
        const seg_t *first = &t->segs[r[0]];
        if (first->kind != SEG_LITERAL || first->lit_len < 3) goto fail;
        s->seg_first = (uint32_t)r[0];
        s->nseg = (uint32_t)nseg;
        s->redact_from = r[2];
        s->redact_to = r[3];
        s->name_from = r[4];
        s->optional_from = r[5];
        s->name = (uint32_t)r[6];
        if (r[7] == -1) {
            s->not_after = NULL;
        } else {
            if (!blob_ok(t, r[7], 32)) goto fail;
            s->not_after = t->blob + r[7];
        }
        /* 2**8 in 16.16 is the most (8 bits per byte); the integers of entropy_ok fit 64 bits */
        if (r[8] < CHECK_NONE || r[8] > CHECK_PEM_KEY || r[9] < 0 || r[9] > (1 << 24) ||
            r[10] < PH_NONE || r[10] > PH_VALUE)
            goto fail;
        s->check = (uint8_t)r[8];
        s->entropy_k = (uint32_t)r[9];
        s->placeholder = (uint8_t)r[10];
        if (r[11] == -1) {
            s->not_before = NULL;
        } else {
            if (!blob_ok(t, r[11], 32)) goto fail;
            s->not_before = t->blob + r[11];
        }
        for (int b = 0; b < 3; b++) s->open_low[b] = lower(t->blob[first->lit_off + (uint32_t)b]);
        if ((size_t)nseg > t->max_nseg) t->max_nseg = (size_t)nseg;
    }
    rc = build_literals(t);
    if (rc) goto fail;
    rc = build_shapes(t);
    if (rc) goto fail;
    rc = build_key3(t);
    if (rc) goto fail;
    build_teddy(t, !(flags & SCRUB_NO_SIMD));
    *out = t;
    return SCRUB_OK;
fail:
    scrub_tables_free(t);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* streams */

struct scrub_stream {
    const scrub_tables *t;
    atomic_int busy;
    int flushed, failed;
    int prev;         /* the skeleton byte before `base`, or -1 */
    int64_t base;     /* skeleton position of the first pending skeleton byte */
    int64_t open_end; /* end of a redaction group whose marker is out already, or 0 */
    int64_t *next_allowed;
    uint8_t *pend;
    size_t pend_len, pend_cap;
    /* the zero-width cap (cap_zero_width): the length of the run of zero-width characters last
     * let through, and the start of one cut by the end of the last input */
    int zw_run;
    uint8_t zw_carry[2];
    size_t zw_carry_len;
};

int scrub_stream_new(const scrub_tables *t, scrub_stream **out) {
    *out = NULL;
    scrub_stream *st = calloc(1, sizeof(*st));
    if (!st) return SCRUB_ENOMEM;
    st->next_allowed = xcalloc(t->nshapes, sizeof(int64_t));
    if (!st->next_allowed) {
        free(st);
        return SCRUB_ENOMEM;
    }
    st->t = t;
    st->prev = -1;
    atomic_init(&st->busy, 0);
    *out = st;
    return SCRUB_OK;
}

void scrub_stream_free(scrub_stream *st) {
    if (!st) return;
    free(st->next_allowed);
    free(st->pend);
    free(st);
}

void scrub_stream_reset(scrub_stream *st) {
    if (atomic_exchange(&st->busy, 1)) return;
    st->flushed = st->failed = 0;
    st->prev = -1;
    st->base = st->open_end = 0;
    memset(st->next_allowed, 0, (st->t->nshapes ? st->t->nshapes : 1) * sizeof(int64_t));
    st->pend_len = 0;
    st->zw_run = 0;
    st->zw_carry_len = 0;
    if (st->pend_cap > PEND_KEEP) {
        free(st->pend);
        st->pend = NULL;
        st->pend_cap = 0;
    }
    atomic_store(&st->busy, 0);
}

size_t scrub_stream_pending(const scrub_stream *st) { return st->pend_len + st->zw_carry_len; }

size_t scrub_stream_footprint(const scrub_stream *st) {
    return sizeof(*st) + (st->t->nshapes ? st->t->nshapes : 1) * sizeof(int64_t) + st->pend_cap;
}

/* Room for `need` bytes: at least 1.5 times the old size, so appends stay linear. */
static int grow(uint8_t **buf, size_t *cap, size_t need) {
    if (need <= *cap) return SCRUB_OK;
    size_t c = *cap + *cap / 2;
    if (c < need || c < *cap) c = need;
    uint8_t *p = realloc(*buf, c);
    if (!p) return SCRUB_ENOMEM;
    *buf = p;
    *cap = c;
    return SCRUB_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* work areas: the scan's scratch and the output of the last call, one per thread */

typedef struct {
    int64_t start, end;
    int64_t prio;
    const uint8_t *name;
    size_t name_len;
} rec_t;

typedef struct {
    int64_t k, start, end, rs, re;
} smatch_t;

struct scrub_work {
    atomic_int busy;
    /* The output of a call: out[0:out_len] followed by in[d_from:d_to] (the part of the input
     * that comes out unchanged after the last redaction is not copied here: the caller has it).
     * raw[raw_mirror:] of the current advance is in[in_base:]. */
    uint8_t *out;
    size_t out_len, out_cap;
    const uint8_t *in;
    size_t d_from, d_to;
    size_t raw_mirror, in_base;
    rec_t *recs; /* spans found by one advance */
    size_t nrec, rcap;
    smatch_t *ms; /* shape matches found by one advance */
    size_t nms, mcap;
    int64_t *next_at; /* per shape, valid when its sepoch is epoch (set on the shape's first try
                       * in a call: a call does not touch every shape of a large set) */
    uint8_t *stopped;
    uint32_t *sepoch;
    uint32_t epoch;
    size_t scap;
    int64_t *bounds; /* 2 per segment */
    size_t bcap;
    uint8_t *skel; /* the skeleton and the offset of each of its bytes, when there are
                      zero-width characters */
    uint32_t *soff;
    size_t zcap;
    uint8_t *capped; /* the input after the zero-width cap, when the cap changed it */
    size_t capped_cap;
    uint8_t *join; /* a stream's pending tail, then the first piece of its new input (scrub_feed's
                      phase 1): here rather than in the stream, so an idle stream holds only
                      its tail */
    size_t join_cap;
};

typedef struct {
    const scrub_tables *t;
    const uint8_t *S;
    size_t n;
    int eof;
    int prev;
    int64_t live; /* smallest position where a match may still begin */
    scrub_work *sc;
    int err;
    const int64_t *next_allowed; /* the stream's, for the shapes' first try in this call */
    int64_t base;
} scan_t;

int scrub_work_new(scrub_work **out) {
    *out = calloc(1, sizeof(scrub_work));
    if (!*out) return SCRUB_ENOMEM;
    atomic_init(&(*out)->busy, 0);
    return SCRUB_OK;
}

static void work_release(scrub_work *w) {
    free(w->out);
    free(w->recs);
    free(w->ms);
    free(w->next_at);
    free(w->stopped);
    free(w->sepoch);
    free(w->bounds);
    free(w->skel);
    free(w->soff);
    free(w->capped);
    w->capped = NULL;
    w->capped_cap = 0;
    free(w->join);
    w->join = NULL;
    w->join_cap = 0;
    w->out = w->skel = w->stopped = NULL;
    w->recs = NULL;
    w->ms = NULL;
    w->next_at = w->bounds = NULL;
    w->sepoch = NULL;
    w->soff = NULL;
    w->out_len = w->out_cap = w->nrec = w->rcap = w->nms = w->mcap = w->scap = w->bcap =
        w->zcap = 0;
}

void scrub_work_free(scrub_work *w) {
    if (!w) return;
    work_release(w);
    free(w);
}

void scrub_work_trim(scrub_work *w) {
    if (atomic_exchange(&w->busy, 1)) return;
    work_release(w);
    atomic_store(&w->busy, 0);
}

size_t scrub_work_footprint(const scrub_work *w) {
    return sizeof(*w) + w->out_cap + w->rcap * sizeof(rec_t) + w->mcap * sizeof(smatch_t) +
           w->scap * (sizeof(int64_t) + 1) + w->bcap * 2 * sizeof(int64_t) +
           w->zcap * (1 + sizeof(uint32_t)) + w->capped_cap + w->join_cap;
}

/* Per-shape arrays for these tables; the output buffer emptied (and given back when the last
 * output was much larger than this input can make). */
static int work_prepare(scrub_work *w, const scrub_tables *t, const uint8_t *in, size_t len) {
    w->out_len = 0;
    w->in = in;
    w->d_from = w->d_to = 0;
    if (w->out_cap > WORK_KEEP && w->out_cap / 4 > len) {
        free(w->out);
        w->out = NULL;
        w->out_cap = 0;
    }
    if (w->join_cap > WORK_KEEP && w->join_cap / 4 > len) {
        free(w->join);
        w->join = NULL;
        w->join_cap = 0;
    }
    if (w->zcap > WORK_KEEP && w->zcap / 4 > len) {
        free(w->skel);
        free(w->soff);
        w->skel = NULL;
        w->soff = NULL;
        w->zcap = 0;
    }
    if (w->scap < t->nshapes) {
        free(w->next_at);
        free(w->stopped);
        free(w->sepoch);
        w->next_at = xmalloc(t->nshapes, sizeof(int64_t));
        w->stopped = xmalloc(t->nshapes, 1);
        w->sepoch = xcalloc(t->nshapes, sizeof(uint32_t));
        w->scap = (w->next_at && w->stopped && w->sepoch) ? t->nshapes : 0;
        if (!w->scap) return SCRUB_ENOMEM;
    }
    if (w->bcap < t->max_nseg) {
        free(w->bounds);
        w->bounds = xmalloc(t->max_nseg, 2 * sizeof(int64_t));
        w->bcap = w->bounds ? t->max_nseg : 0;
        if (!w->bcap) return SCRUB_ENOMEM;
    }
    return SCRUB_OK;
}

static inline int copy_out(scrub_work *w, const uint8_t *p, size_t len) {
    if (!len) return SCRUB_OK;
    if (len > SIZE_MAX - w->out_len) return SCRUB_ETOOBIG;
    if (w->out_len + len > w->out_cap) {
        int rc = grow(&w->out, &w->out_cap, w->out_len + len);
        if (rc) return rc;
    }
    memcpy(w->out + w->out_len, p, len);
    w->out_len += len;
    return SCRUB_OK;
}

/* The deferred input range goes into the output buffer (something else follows it). */
static inline int settle(scrub_work *w) {
    int rc = copy_out(w, w->in + w->d_from, w->d_to - w->d_from);
    w->d_from = w->d_to = 0;
    return rc;
}

/* Bytes that are not in the input as they are (markers, a pending tail kept from before). */
static inline int emit(scrub_work *w, const uint8_t *p, size_t len) {
    if (!len) return SCRUB_OK;
    if (w->d_to != w->d_from) {
        int rc = settle(w);
        if (rc) return rc;
    }
    return copy_out(w, p, len);
}

/* raw[a:b] of the current advance, unchanged: what of it is in the input is deferred. */
static int emit_raw(scrub_work *w, const uint8_t *raw, size_t a, size_t b) {
    if (a < w->raw_mirror) {
        size_t e = b < w->raw_mirror ? b : w->raw_mirror;
        int rc = emit(w, raw + a, e - a);
        if (rc) return rc;
        a = e;
    }
    if (a >= b) return SCRUB_OK;
    size_t ia = w->in_base + (a - w->raw_mirror), ib = ia + (b - a);
    if (w->d_to != w->d_from && w->d_to != ia) {
        int rc = settle(w);
        if (rc) return rc;
    }
    if (w->d_to == w->d_from) w->d_from = ia;
    w->d_to = ib;
    return SCRUB_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* scanning */

static void add_rec(scan_t *c, int64_t start, int64_t end, int64_t prio, const uint8_t *name,
                    size_t name_len) {
    scrub_work *sc = c->sc;
    if (sc->nrec == sc->rcap) {
        size_t cap = sc->rcap ? sc->rcap * 2 : 64;
        rec_t *r = cap > SIZE_MAX / sizeof(rec_t) ? NULL : realloc(sc->recs, cap * sizeof(rec_t));
        if (!r) {
            c->err = SCRUB_ENOMEM;
            return;
        }
        sc->recs = r;
        sc->rcap = cap;
    }
    rec_t *r = &sc->recs[sc->nrec++];
    r->start = start;
    r->end = end;
    r->prio = prio;
    r->name = name;
    r->name_len = name_len;
}

static void add_match(scan_t *c, int64_t k, int64_t start, int64_t end, int64_t rs, int64_t re) {
    scrub_work *sc = c->sc;
    if (sc->nms == sc->mcap) {
        size_t cap = sc->mcap ? sc->mcap * 2 : 32;
        smatch_t *m =
            cap > SIZE_MAX / sizeof(smatch_t) ? NULL : realloc(sc->ms, cap * sizeof(smatch_t));
        if (!m) {
            c->err = SCRUB_ENOMEM;
            return;
        }
        sc->ms = m;
        sc->mcap = cap;
    }
    smatch_t *m = &sc->ms[sc->nms++];
    m->k = k;
    m->start = start;
    m->end = end;
    m->rs = rs;
    m->re = re;
}

static inline void set_live(scan_t *c, size_t p) {
    if ((int64_t)p < c->live) c->live = (int64_t)p;
}

static inline const uint8_t *lit_name(const scrub_tables *t, size_t lit, size_t *len) {
    uint32_t name = t->lits[lit].name;
    *len = t->names[2 * name + 1];
    return t->blob + t->names[2 * name];
}

/* The 8-byte key at p (p + 8 <= n): window and whole literals. */
static void lit8_at(scan_t *c, size_t p) {
    const scrub_tables *t = c->t;
    uint64_t key = ld64(c->S + p);
    uint64_t h = key * K8;
    if (!bloom_has(t->bloom8, t->b8_shift, h)) return;
    size_t i = (size_t)(h >> t->ht_shift);
    const hent_t *e;
    for (;;) {
        e = &t->ht[i];
        if (!e->used) return;
        if (e->key == key) break;
        i = (i + 1) & t->ht_mask;
    }
    int64_t best = INT64_MAX, end = 0;
    if (e->window >= 0) {
        best = e->window;
        end = (int64_t)p + WINDOW;
    }
    const uint8_t *S = c->S;
    size_t n = c->n;
    if (e->anch_cnt) {
        /* the text's next 8 bytes (as many as there are) against each literal's */
        size_t avail = n - p - WINDOW;
        uint64_t x = avail >= 8 ? ld64(S + p + WINDOW) : ld_short(S + p + WINDOW, avail);
        uint64_t xm = avail >= 8 ? ~(uint64_t)0 : ((uint64_t)1 << (8 * avail)) - 1;
        const anch_t *list = t->anch + e->anch_off;
        for (uint32_t k = 0; k < e->anch_cnt; k++) {
            const anch_t *a = &list[k];
            const uint8_t *v = t->blob + t->lits[a->idx].off;
            if (a->len <= n - p) {
                if ((x & a->m2) != a->w2) continue;
                if (a->len > 16 && memcmp(S + p + 16, v + 16, a->len - 16) != 0) continue;
                if ((int64_t)a->idx < best) best = a->idx;
                if ((int64_t)(p + a->len) > end) end = (int64_t)(p + a->len);
            } else if (!c->eof) { /* cut by the end: live if what there is agrees */
                if ((x & xm) != (a->w2 & xm)) continue;
                if (avail > 8 && memcmp(S + p + 16, v + 16, avail - 8) != 0) continue;
                set_live(c, p);
            }
        }
    }
    if (best != INT64_MAX) {
        size_t nl;
        const uint8_t *nm = lit_name(t, (size_t)best, &nl);
        add_rec(c, (int64_t)p, end, best, nm, nl);
    }
}

/* Is s[0:m] (1 <= m < 8) a proper prefix of a literal's 8-byte key or of a short literal? */
static int is_tail(const scrub_tables *t, const uint8_t *s, size_t m) {
    if (m == 1) return bit_of(t->tail1, s[0]);
    if (m == 2) return bit_of(t->tail2 + s[0] * 32, s[1]);
    uint64_t h = tail_hash(s, m);
    uint8_t want = MASK8[h >> 58];
    if ((t->tailb[(h >> 32) & t->tailb_mask] & want) != want) return 0;
    uint64_t lo = be_prefix(s, m);
    uint64_t hi = lo | (~(uint64_t)0 >> (8 * m));
    size_t a = 0, b = t->npk;
    while (a < b) {
        size_t mid = a + (b - a) / 2;
        if (t->pk[mid] < lo) a = mid + 1;
        else b = mid;
    }
    if (a < t->npk && t->pk[a] <= hi) return 1;
    a = 0;
    b = t->nsp;
    while (a < b) {
        size_t mid = a + (b - a) / 2;
        if (t->sp[mid].be < lo) a = mid + 1;
        else b = mid;
    }
    for (; a < t->nsp && t->sp[a].be <= hi; a++) {
        if (t->sp[a].len > m) return 1;
    }
    return 0;
}

static void short_at(scan_t *c, size_t p) {
    const scrub_tables *t = c->t;
    int64_t best = INT64_MAX, end = 0;
    for (size_t L = 1; L < WINDOW && p + L <= c->n; L++) {
        if (!((t->short_lens >> L) & 1)) continue;
        uint64_t key = ld_short(c->S + p, L);
        size_t mask = t->smask_len[L];
        size_t j = (size_t)((key * K8) >> 20) & mask;
        const sent_t *tab = t->stab_len[L];
        while (tab[j].used && tab[j].key != key) j = (j + 1) & mask;
        if (tab[j].used) {
            if (tab[j].idx < best) best = tab[j].idx;
            if ((int64_t)(p + L) > end) end = (int64_t)(p + L);
        }
    }
    if (best != INT64_MAX) {
        size_t nl;
        const uint8_t *nm = lit_name(t, (size_t)best, &nl);
        add_rec(c, (int64_t)p, end, best, nm, nl);
    }
}

/* match_segment of the reference: the end of seg at S[i:], NO_MATCH or NEED_MORE. */
static int64_t match_segment(const scrub_tables *t, const seg_t *g, const uint8_t *S, size_t n,
                             size_t i, int eof) {
    if (g->kind == SEG_LITERAL) {
        const uint8_t *want = t->blob + g->lit_off;
        size_t len = g->lit_len;
        size_t have = n - i < len ? n - i : len;
        size_t j = 0;
        if (g->fold) {
            while (j < have && lower(S[i + j]) == lower(want[j])) j++;
        } else {
            while (j < have && S[i + j] == want[j]) j++;
        }
        if (j == len) return (int64_t)(i + len);
        if (j == have && !eof) return NEED_MORE; /* a partial literal cut by the end */
        return NO_MATCH;
    }
    size_t j = i;
    if (g->kind == SEG_CLASS) {
        const uint8_t *cls = g->cls;
        const uint8_t *stop = t->blob + g->stop_off;
        size_t slen = g->stop_len;
        size_t limit = (size_t)g->max;
        while (j - i < limit) {
            if (j == n) {
                if (eof) break;
                return NEED_MORE;
            }
            if (slen && S[j] == stop[0]) {
                size_t avail = n - j;
                if (avail >= slen) {
                    if (memcmp(S + j, stop, slen) == 0) break;
                } else if (memcmp(S + j, stop, avail) == 0 && !eof) {
                    return NEED_MORE;
                }
            }
            if (!bit_of(cls, S[j])) break;
            j++;
        }
        if (j - i < g->min) return NO_MATCH;
        if (g->suf_count) {
            int ok = 0;
            for (uint32_t s = 0; s < g->suf_count && !ok; s++) {
                const uint32_t *sf = &t->sufs[2 * (g->suf_first + s)];
                size_t sl = sf[1];
                const uint8_t *sv = t->blob + sf[0];
                if (sl > j - i) continue;
                size_t q = 0;
                while (q < sl && lower(S[j - sl + q]) == lower(sv[q])) q++;
                ok = q == sl;
            }
            if (!ok) return NO_MATCH;
        }
        return (int64_t)j;
    }
    /* JSON_STRING: bytes up to an unescaped '"'; a backslash takes the next byte with it */
    size_t max = g->max;
    while (j - i < max) {
        if (j == n) {
            if (eof) break;
            return NEED_MORE;
        }
        uint8_t b = S[j];
        if (b == '"') break;
        if (b == '\\') {
            if (j - i + 2 > max) break;
            if (j + 1 == n) {
                if (eof) break;
                return NEED_MORE;
            }
            j += 2;
        } else {
            j++;
        }
    }
    return j - i < g->min ? NO_MATCH : (int64_t)j;
}

/* ---- post-match validators of a shape's body (scrub_patterns: Shape.body_ok) ---- */

/* scrub_patterns.PLACEHOLDER_WORDS, lowercase; matched as written, in upper case or capitalized */
static const char *const PLACEHOLDER_WORDS[] = {
    "example", "sample", "dummy", "placeholder", "your", "changeme", "redacted", "xxxx", "fake",
};
#define PLACEHOLDER_RUN 6 /* scrub_patterns.PLACEHOLDER_RUN */

/* scrub_patterns.is_template_value without its last rule (a run of equal bytes) */
static int is_template(const uint8_t *b, size_t n) {
    /* templates: ${ $( {{ %( %{ anywhere (shell, Jinja/Go/Helm, printf) */
    for (size_t i = 0; i + 1 < n; i++) {
        uint8_t a = b[i], z = b[i + 1];
        if ((a == '$' && (z == '{' || z == '(')) || (a == '{' && z == '{') ||
            (a == '%' && (z == '(' || z == '{')))
            return 1;
    }
    if (n >= 2 && ((b[0] == '<' && b[n - 1] == '>') || (b[0] == '{' && b[n - 1] == '}')))
        return 1; /* <your-token>, {Key} */
    if (n >= 2 && b[0] == '$') {                           /* $API_KEY */
        size_t i = 1;
        while (i < n && ((b[i] >= 'A' && b[i] <= 'Z') || (b[i] >= '0' && b[i] <= '9') || b[i] == '_'))
            i++;
        if (i == n) return 1;
    }
    return 0;
}

/* scrub_patterns.is_template_value */
static int is_template_value(const uint8_t *b, size_t n) {
    if (is_template(b, n)) return 1;
    unsigned run = 1;
    for (size_t i = 1; i < n; i++) {
        run = b[i] == b[i - 1] ? run + 1 : 1;
        if (run >= PLACEHOLDER_RUN) return 1;
    }
    return 0;
}

/* scrub_patterns.is_placeholder */
static int is_placeholder(const uint8_t *b, size_t n) {
    for (size_t w = 0; w < sizeof(PLACEHOLDER_WORDS) / sizeof(PLACEHOLDER_WORDS[0]); w++) {
        const uint8_t *word = (const uint8_t *)PLACEHOLDER_WORDS[w];
        size_t wl = strlen(PLACEHOLDER_WORDS[w]);
        for (size_t i = 0; i + wl <= n; i++) {
            uint8_t c = b[i];
            if (c != word[0] && c != word[0] - 32) continue;
            /* after the first letter: all lower case, or all upper case after an upper one */
            size_t q = 1;
            while (q < wl && b[i + q] == word[q]) q++;
            if (q == wl) return 1;
            if (c == word[0]) continue;
            q = 1;
            while (q < wl && b[i + q] == word[q] - 32) q++;
            if (q == wl) return 1;
        }
    }
    if (is_template(b, n)) return 1;
    unsigned same = 1, up = 1, down = 1;
    for (size_t i = 1; i < n; i++) {
        int d = (int)b[i] - (int)b[i - 1];
        same = d == 0 ? same + 1 : 1;
        up = d == 1 ? up + 1 : 1;
        down = d == -1 ? down + 1 : 1;
        if (same >= PLACEHOLDER_RUN || up >= PLACEHOLDER_RUN || down >= PLACEHOLDER_RUN) return 1;
    }
    return 0;
}

/* scrub_patterns.entropy_ok: n**2 * 2**16 >= k * sum(count**2); n <= 65536 (Shape checks it
 * and the wrapper passes only such shapes) and k <= 2**24, so both sides fit 64 bits. */
static int entropy_ok(uint32_t k, const uint8_t *b, size_t n) {
    uint32_t count[256] = {0};
    for (size_t i = 0; i < n; i++) count[b[i]]++;
    uint64_t squares = 0;
    for (int c = 0; c < 256; c++) squares += (uint64_t)count[c] * count[c];
    return (uint64_t)n * n * 65536u >= (uint64_t)k * squares;
}

/* CRC-32 (ISO-HDLC, zlib's), bit by bit: bodies are short and this runs once per match. */
static uint32_t crc32_of(const uint8_t *b, size_t n) {
    uint32_t crc = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        crc ^= b[i];
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

static int base62_digit(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'Z') return c - 'A' + 10;
    if (c >= 'a' && c <= 'z') return c - 'a' + 36;
    return -1;
}

#define PEM_MIN_BASE64 43 /* scrub_patterns.PEM_MIN_BASE64: the base64 of a 32-byte key */

static const uint8_t *find_bytes(const uint8_t *b, size_t n, const char *what, size_t wl) {
    for (size_t i = 0; i + wl <= n; i++)
        if (b[i] == (uint8_t)what[0] && memcmp(b + i, what, wl) == 0) return b + i;
    return NULL;
}

/* scrub_patterns.pem_key_ok: a block cut short, or one whose text between its BEGIN and END
 * lines holds PEM_MIN_BASE64 base64 characters */
static int pem_key_ok(const uint8_t *b, size_t n) {
    const uint8_t *start = find_bytes(b, n, "-----", 5); /* the label has no '-' */
    if (!start) return 1;
    start += 5;
    const uint8_t *end = find_bytes(start, (size_t)(b + n - start), "-----END ", 9);
    if (!end) return 1;
    size_t count = 0;
    for (const uint8_t *q = start; q < end; q++) {
        uint8_t c = *q;
        count += (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                 c == '+' || c == '/';
    }
    return count >= PEM_MIN_BASE64;
}

/* scrub_patterns.PUBLISHED_EXAMPLES: credentials their publisher gives out as examples, the
 * exact text a shape with the token placeholder filter would redact; never redacted by a shape
 * (a held credential is a literal and is redacted whatever its value). */
static const char *const PUBLISHED_EXAMPLES[] = {
    /* Google API keys published in Firebase's SDK sources and tests */
    "AIzaSyabcdefghijklmnopqrstuvwxyz1234567",
    "AIzaSyAnLA7NfeLquW1tJFpx_eQCxoX-oo6YyIs",
    "AIzaSyCkEhVjf3pduRDt6d1yKOMitrUEke8agEM",
    "AIzaSyDMAScliyLx7F0NPDEJi1QmyCgHIAODrlU",
    "AIzaSyD3asb-2pEZVqMkmL6M9N6nHZRR_znhrh0",
    "AIzayDNSXIbFmlXbIE6mCzDLQAqITYefhixbX4A",
    "AIzaSyAdOS2zB6NCsk1pCdZ4-P6GBdi_UUPwX7c",
    "AIzaSyASWm6HmTMdYWpgMnjRBjxcQ9CKctWmLd4",
    "AIzaSyANUvH9H9BsUccjsu2pCmEkOPjjaXeDQgY",
    "AIzaSyA5_iVawFQ8ABuTZNUdcwERLJv_a_p4wtM",
    "AIzaSyA4UrcGxgwQFTfaI3no3t7Lt1sjmdnP5sQ",
    "AIzaSyDSb51JiIcB6OJpwwMicseKRhhrOq1cS7g",
    "AIzaSyBF2RrAIm4a0mO64EShQfqfd2AFnzAvvuU",
    "AIzaSyBcE-OOIbhjyR83gm4r2MFCu4MJmprNXsw",
    "AIzaSyB8qGxt4ec15vitgn44duC5ucxaOi4FmqE",
    "AIzaSyA8vmApnrHNFE0bApF4hoZ11srVL_n0nvY",
};

static int published_example(const uint8_t *b, size_t n) {
    for (size_t e = 0; e < sizeof(PUBLISHED_EXAMPLES) / sizeof(PUBLISHED_EXAMPLES[0]); e++)
        if (strlen(PUBLISHED_EXAMPLES[e]) == n && memcmp(b, PUBLISHED_EXAMPLES[e], n) == 0)
            return 1;
    return 0;
}

/* scrub_patterns.checksum_ok */
static int checksum_ok(uint8_t check, const uint8_t *b, size_t n) {
    if (check == CHECK_PEM_KEY) return pem_key_ok(b, n);
    if (check != CHECK_CRC32_BASE62) return 1;
    if (n <= 6) return 0;
    uint64_t v = 0;
    for (size_t i = n - 6; i < n; i++) {
        int d = base62_digit(b[i]);
        if (d < 0) return 0;
        v = v * 62 + (uint64_t)d;
    }
    return v == (uint64_t)crc32_of(b, n - 6);
}

static int body_ok(const shape_t *sh, const uint8_t *b, size_t n) {
    if (sh->placeholder == PH_TOKEN && is_placeholder(b, n)) return 0;
    if (sh->placeholder == PH_VALUE && is_template_value(b, n)) return 0;
    if (sh->entropy_k && !entropy_ok(sh->entropy_k, b, n)) return 0;
    return checksum_ok(sh->check, b, n);
}

/* Shape k at p (not_after checked): records a match, or sets live on NEED_MORE. */
static void try_shape(scan_t *c, size_t k, size_t p) {
    scrub_work *sc = c->sc;
    if (sc->sepoch[k] != sc->epoch) {
        int64_t a = c->next_allowed[k] - c->base;
        sc->sepoch[k] = sc->epoch;
        sc->next_at[k] = a > 0 ? a : 0;
        sc->stopped[k] = 0;
    }
    if (sc->stopped[k] || (int64_t)p < sc->next_at[k]) return;
    const scrub_tables *t = c->t;
    const shape_t *sh = &t->shapes[k];
    if (sh->not_after) {
        int before = p ? c->S[p - 1] : c->prev;
        if (before >= 0 && bit_of(sh->not_after, (unsigned)before)) return;
    }
    int64_t *bounds = sc->bounds;
    size_t nb = 0, i = p;
    for (size_t s = 0; s < sh->nseg; s++) {
        int64_t e = match_segment(t, &t->segs[sh->seg_first + s], c->S, c->n, i, c->eof);
        if (e == NEED_MORE) {
            set_live(c, p);
            sc->stopped[k] = 1;
            return;
        }
        if (e == NO_MATCH) {
            if (sh->optional_from != -1 && (int64_t)s >= sh->optional_from) {
                nb = (size_t)sh->optional_from;
                i = (size_t)bounds[2 * nb - 1];
                break;
            }
            return;
        }
        bounds[2 * nb] = (int64_t)i;
        bounds[2 * nb + 1] = e;
        nb++;
        i = (size_t)e;
    }
    int rejected = 0;
    if (sh->not_before) {
        if (i == c->n) {
            if (!c->eof) { /* the next byte decides */
                set_live(c, p);
                sc->stopped[k] = 1;
                return;
            }
        } else if (bit_of(sh->not_before, c->S[i])) {
            rejected = 1;
        }
    }
    int64_t last = ((int64_t)nb < sh->redact_to ? (int64_t)nb : sh->redact_to) - 1;
    int64_t r0, r1;
    if (sh->redact_from < (int64_t)nb && last >= sh->redact_from) {
        r0 = bounds[2 * sh->redact_from];
        r1 = bounds[2 * last + 1];
    } else {
        r0 = r1 = (int64_t)i;
    }
    if (!rejected && (sh->check || sh->entropy_k || sh->placeholder)) {
        /* the body: the redacted segments less the opening literal */
        int64_t first = sh->redact_from > 1 ? sh->redact_from : 1;
        int64_t b0 = first <= last ? bounds[2 * first] : r1;
        rejected = !body_ok(sh, c->S + b0, (size_t)(r1 - b0)) ||
                   (sh->placeholder == PH_TOKEN &&
                    published_example(c->S + r0, (size_t)(r1 - r0)));
    }
    if (rejected) {
        /* redacts nothing, but the shape goes on after it as after a match (the reference's
         * match_shape says why) */
        add_match(c, (int64_t)k, (int64_t)p, (int64_t)i, (int64_t)i, (int64_t)i);
        sc->next_at[k] = (int64_t)i;
        return;
    }
    add_match(c, (int64_t)k, (int64_t)p, (int64_t)i, r0, r1);
    if (r1 > r0) {
        const uint8_t *nm;
        size_t nl;
        if (sh->name_from >= 0 && sh->name_from < (int64_t)nb) {
            nm = c->S + bounds[2 * sh->name_from];
            nl = (size_t)(bounds[2 * sh->name_from + 1] - bounds[2 * sh->name_from]);
        } else {
            nm = t->blob + t->names[2 * sh->name];
            nl = t->names[2 * sh->name + 1];
        }
        add_rec(c, r0, r1, (int64_t)(t->nlits + k), nm, nl);
    }
    sc->next_at[k] = (int64_t)i;
}

/* Shapes at p (p + 3 <= n): if the prefilter lets the three bytes through, the shapes that open
 * with exactly them (table k3), each whose opening literal the bytes after do not refuse. */
static __attribute__((noinline)) void shape_at_key(scan_t *c, size_t p) {
    const scrub_tables *t = c->t;
    const uint8_t *s = c->S + p;
    uint32_t key = key3_of(s);
    size_t slot = key3_slot(key, t->k3_mask);
    while (t->k3[slot].key && t->k3[slot].key != key + 1) slot = (slot + 1) & t->k3_mask;
    if (!t->k3[slot].key) return;
    size_t avail = c->n - p;
    for (uint32_t q = t->k3[slot].first, e = q + t->k3[slot].count; q < e; q++) {
        uint32_t k = t->k3_shapes[q];
        const seg_t *seg = &t->segs[t->shapes[k].seg_first];
        const uint8_t *lit = t->blob + seg->lit_off;
        size_t len = seg->lit_len < avail ? seg->lit_len : avail, j = 3;
        if (seg->fold) {
            while (j < len && lower(s[j]) == lower(lit[j])) j++;
        } else {
            while (j < len && s[j] == lit[j]) j++;
        }
        if (j == len) try_shape(c, k, p);
    }
}

/* The TRI lanes first, inline (most positions stop there): the portable loops and the positions
 * at the end of a buffer that the AVX2 loop leaves. */
static inline __attribute__((always_inline)) void shape_at(scan_t *c, size_t p) {
    const uint64_t *tri = c->t->tri;
    const uint8_t *s = c->S + p;
    if (tri[s[0]] & (tri[s[1]] >> GROUPS) & (tri[s[2]] >> (2 * GROUPS)) & LANE) shape_at_key(c, p);
}

/* Shapes at p with fewer than 3 bytes left (not at the end of the stream): every shape whose
 * opening literal, lowercased, begins with what is left. */
static void shape_tail(scan_t *c, size_t p) {
    const scrub_tables *t = c->t;
    size_t m = c->n - p;
    uint8_t first = lower(c->S[p]);
    if (!bit_of(t->open_first, first)) return;
    for (uint32_t i = t->t1_first[first]; i < t->t1_first[first + 1]; i++) {
        uint32_t k = t->t1_shapes[i];
        const uint8_t *o = t->shapes[k].open_low;
        size_t q = 1;
        while (q < m && lower(c->S[p + q]) == o[q]) q++;
        if (q == m) try_shape(c, k, p);
    }
}

static inline int lit_filter(const scrub_tables *t, const uint8_t *gram4) {
    return b4_has(t->bloom4, t->b4_mask, gram4);
}

/* A block the fast loop flagged: positions p0..p0+4, p0 + 8 <= n. */
static void block_hit(scan_t *c, size_t p0, int lits, int shapes) {
    if (lits && lit_filter(c->t, c->S + p0 + 4)) {
        for (size_t p = p0; p <= p0 + 4 && p + WINDOW <= c->n; p++) lit8_at(c, p);
    }
    if (shapes) {
        for (size_t p = p0; p <= p0 + 4; p++) shape_at(c, p);
    }
}

/* The hot loop: 5 positions per step, one branch. Literals: the 4-gram filter on bytes
 * p0+4..p0+7. Shapes: for each position, TRI of its three bytes, ANDed lane by lane. Returns the
 * first position it did not cover. */
static inline __attribute__((always_inline)) size_t fast_blocks(scan_t *c, int lits,
                                                                 int shapes) {
    const scrub_tables *t = c->t;
    const uint8_t *S = c->S;
    size_t n = c->n;
    if (n < WINDOW) return 0;
    const uint16_t *b4 = t->bloom4;
    const size_t b4_mask = t->b4_mask;
    const uint64_t *tri = t->tri;
    size_t p0 = 0;
    uint64_t e0 = 0, e1 = 0;
    if (shapes) {
        e0 = tri[S[0]];
        e1 = tri[S[1]];
    }
    for (; p0 + WINDOW <= n; p0 += 5) {
        const uint8_t *q = S + p0;
        uint64_t hit = 0;
        if (lits) hit = (uint64_t)b4_has(b4, b4_mask, q + 4);
        if (shapes) {
            uint64_t e2 = tri[q[2]], e3 = tri[q[3]], e4 = tri[q[4]], e5 = tri[q[5]],
                     e6 = tri[q[6]];
            uint64_t a1 = e1 >> GROUPS, a2 = e2 >> GROUPS, a3 = e3 >> GROUPS, a4 = e4 >> GROUPS,
                     a5 = e5 >> GROUPS;
            uint64_t b2 = e2 >> (2 * GROUPS), b3 = e3 >> (2 * GROUPS), b4_ = e4 >> (2 * GROUPS),
                     b5 = e5 >> (2 * GROUPS), b6 = e6 >> (2 * GROUPS);
            hit |= ((e0 & a1 & b2) | (e1 & a2 & b3) | (e2 & a3 & b4_) | (e3 & a4 & b5) |
                    (e4 & a5 & b6)) &
                   LANE;
            e0 = e5;
            e1 = e6;
        }
        if (__builtin_expect(hit != 0, 0)) {
            block_hit(c, p0, lits, shapes);
            if (c->err) return n;
        }
    }
    return p0;
}

#if defined(SCRUB_AVX2)
/* The AVX2 loop's shape candidates, in position order: those whose three bytes are a key of
 * k3bits go on to shape_at_key (exact). Kept without a branch per candidate: the candidates are
 * many (about one position in 50 of prose and code) and whether one passes is a coin toss to the
 * branch predictor; branching on them in the loop cost more than the filter itself. */
#define CAND_MAX 256

static void shape_cands(scan_t *c, uint32_t *cand, size_t nc) {
    const uint8_t *bits = c->t->k3bits;
    const uint8_t *S = c->S;
    size_t k = 0;
    for (size_t i = 0; i < nc; i++) {
        uint32_t q = cand[i];
        uint32_t h = K3BITS_HASH(key3_of(S + q));
        cand[k] = q;
        k += (bits[h >> 3] >> (h & 7)) & 1;
    }
    for (size_t i = 0; i < k && !c->err; i++) shape_at_key(c, cand[i]);
}

/* The loops with AVX2: per 32 positions, the shapes' nibble filter ("Teddy", 16 buckets); then,
 * over the whole input, the literals' 4-gram probes (block [lb, lb + 5) is probed at lb + 4, as
 * in fast_blocks). The filter's candidates are queued (cand) and go through shape_cands every
 * CAND_MAX or so, in order: nothing in the loop branches on them. The probes have a loop of
 * their own: inside the Teddy loop, which keeps its 16 tables in registers, the probe's
 * constants and bounds were spilled and reloaded at every probe (a third more instructions
 * per probe); the order in which literal and shape matches are recorded does not matter (they
 * are sorted before the release). Returns the first position whose shapes are not covered;
 * *lit_next: the first literal position not covered. */
__attribute__((target("avx2"))) static size_t fast_avx2(scan_t *c, int lits, size_t *lit_next) {
    const scrub_tables *t = c->t;
    const uint8_t *S = c->S;
    const size_t n = c->n;
    const uint16_t *b4 = t->bloom4;
    const size_t b4_mask = t->b4_mask;
    const __m256i nib = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256i lo[2][4], hi[2][4];
    for (int s = 0; s < 2; s++) {
        for (int j = 0; j < 4; j++) {
            lo[s][j] = _mm256_broadcastsi128_si256(
                _mm_loadu_si128((const __m128i *)(const void *)t->ted_lo[s][j]));
            hi[s][j] = _mm256_broadcastsi128_si256(
                _mm_loadu_si128((const __m128i *)(const void *)t->ted_hi[s][j]));
        }
    }
    /* room for a whole mask past CAND_MAX: the queue is emptied once it holds more */
    uint32_t cand[CAND_MAX + 32];
    size_t nc = 0;
    size_t p = 0, lb = 0;
    /* The last block is the one that ends 35 bytes before the end, overlapping the one before
     * it (its positions already done taken out of the mask): the positions it covers would
     * otherwise go one by one through shape_at, up to 31 of them on every call. */
    for (int last = 0; !last;) {
        size_t at = p;
        uint32_t done = 0;
        if (p + 35 > n) {
            if (n < 35 || p + 3 >= n) break;
            at = n - 35; /* < p, and p - at < 32 */
            done = (UINT32_C(1) << (p - at)) - 1;
            last = 1;
        }
        __m256i ra = _mm256_set1_epi8(-1), rb = ra;
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(S + at + (size_t)j));
            __m256i l = _mm256_and_si256(v, nib);
            __m256i h = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            ra = _mm256_and_si256(ra, _mm256_and_si256(_mm256_shuffle_epi8(lo[0][j], l),
                                                       _mm256_shuffle_epi8(hi[0][j], h)));
            rb = _mm256_and_si256(rb, _mm256_and_si256(_mm256_shuffle_epi8(lo[1][j], l),
                                                       _mm256_shuffle_epi8(hi[1][j], h)));
        }
        uint32_t m = ~(uint32_t)_mm256_movemask_epi8(
                         _mm256_cmpeq_epi8(_mm256_or_si256(ra, rb), zero)) &
                     ~done;
        p = at;
        /* the first two candidates with no branch (a mask seldom has more: writing four this
         * way cost more than the branch to the loop below); when m runs out, the entry written
         * is p + 31, not counted */
        for (int r = 0; r < 2; r++) {
            cand[nc] = (uint32_t)(p + (size_t)__builtin_ctz(m | UINT32_C(0x80000000)));
            nc += m != 0;
            m &= m - 1;
        }
        while (__builtin_expect(m != 0, 0)) {
            cand[nc++] = (uint32_t)(p + (size_t)__builtin_ctz(m));
            m &= m - 1;
        }
        if (__builtin_expect(nc > CAND_MAX, 0)) {
            shape_cands(c, cand, nc);
            nc = 0;
        }
        if (c->err) return n;
        p += 32;
    }
    shape_cands(c, cand, nc);
    /* the literal blocks that have their 8 bytes */
    if (lits && n >= WINDOW && !c->err) {
        const size_t lb_end = n - WINDOW + 1;
        for (; lb < lb_end; lb += 5) {
            if (__builtin_expect(b4_has(b4, b4_mask, S + lb + 4), 0)) {
                for (size_t q = lb; q <= lb + 4 && q + WINDOW <= n; q++) lit8_at(c, q);
                if (c->err) return n;
            }
        }
    }
    *lit_next = lb;
    return p;
}
#endif

static void scan(scan_t *c) {
    const scrub_tables *t = c->t;
    const size_t n = c->n;
    const int lits = t->nkeys > 0, shapes = t->nshapes > 0;
    size_t p = 0;
#if defined(SCRUB_AVX2)
    if (t->simd) {
        size_t lp = 0;
        for (p = fast_avx2(c, lits, &lp); p < n && !c->err; p++) {
            if (p + 3 <= n) shape_at(c, p);
            else if (!c->eof) shape_tail(c, p);
        }
        for (; lits && lp + WINDOW <= n && !c->err; lp++) lit8_at(c, lp);
        goto rest;
    }
#endif
    if (lits && shapes) p = fast_blocks(c, 1, 1);
    else if (lits) p = fast_blocks(c, 1, 0);
    else if (shapes) p = fast_blocks(c, 0, 1);
    else p = n;
    for (; p < n && !c->err; p++) {
        if (lits && p + WINDOW <= n) lit8_at(c, p);
        if (shapes) {
            if (p + 3 <= n) shape_at(c, p);
            else if (!c->eof) shape_tail(c, p);
        }
    }
#if defined(SCRUB_AVX2)
rest:
#endif
    if (!c->eof && (t->npk || t->nsp)) {
        for (size_t q = n > WINDOW - 1 ? n - (WINDOW - 1) : 0; q < n; q++) {
            if (is_tail(t, c->S + q, n - q)) {
                set_live(c, q);
                break;
            }
        }
    }
    if (t->short_lens) {
        for (size_t q = 0; q < n && !c->err; q++) {
            if (bit_of(t->short_first, c->S[q])) short_at(c, q);
        }
    }
}

static int cmp_rec(const void *a, const void *b) {
    const rec_t *x = a, *y = b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    if (x->prio != y->prio) return x->prio < y->prio ? -1 : 1;
    if (x->end != y->end) return x->end > y->end ? -1 : 1;
    return 0;
}

static const uint8_t MARK_OPEN[] = "[REDACTED:";

/* One ReferenceStream._advance over raw (the pending tail, then new input). Writes the released
 * output and sets *cut: raw[*cut:] stays pending. raw[clean:] is known to hold no zero-width
 * character (clean = rawlen: nothing is known). */
static int advance(scrub_stream *st, scrub_work *sc, const uint8_t *raw, size_t rawlen, int eof,
                   size_t clean, size_t *cut) {
    const scrub_tables *t = st->t;
    if (rawlen > (size_t)UINT32_MAX - 8) return SCRUB_ETOOBIG;
    /* split: a zero-width character cut by the end of the chunk waits for the next one */
    size_t held = 0;
    if (!eof && rawlen) {
        uint8_t a = raw[rawlen - 1];
        if (a == 0xE2 || a == 0xEF) {
            held = 1;
        } else if (rawlen >= 2) {
            uint8_t b = raw[rawlen - 2];
            if ((b == 0xE2 && (a == 0x80 || a == 0x81)) || (b == 0xEF && a == 0xBB)) held = 2;
        }
    }
    size_t lim = rawlen - held;
    /* a zero-width character beginning before `clean` ends by clean + 2 */
    size_t zlim = clean + 2 < lim ? clean + 2 : lim;
#if defined(SCRUB_AVX2)
    size_t z = t->simd ? find_zw_avx2(raw, zlim) : find_zw(raw, zlim);
#else
    size_t z = find_zw(raw, zlim);
#endif
    if (z == zlim) z = lim;
    const uint8_t *S = raw;
    const uint32_t *soff = NULL;
    size_t n = lim;
    if (z < lim) {
        if (sc->zcap < lim) {
            free(sc->skel);
            free(sc->soff);
            sc->skel = xmalloc(lim, 1);
            sc->soff = xmalloc(lim, sizeof(uint32_t));
            sc->zcap = (sc->skel && sc->soff) ? lim : 0;
            if (!sc->zcap) return SCRUB_ENOMEM;
        }
        uint8_t *sk = sc->skel;
        uint32_t *so = sc->soff;
        memcpy(sk, raw, z);
        for (size_t k = 0; k < z; k++) so[k] = (uint32_t)k;
        n = z;
        size_t i = z;
        while (i < lim) {
            if ((raw[i] == 0xE2 || raw[i] == 0xEF) && i + 3 <= lim && is_zw(raw + i)) {
                i += 3;
                continue;
            }
            sk[n] = raw[i];
            so[n] = (uint32_t)i;
            n++;
            i++;
        }
        S = sk;
        soff = so;
    }
#define ST(k) (soff ? ((k) ? (size_t)soff[(k) - 1] + 1 : (size_t)0) : (size_t)(k))
#define SOFF(k) (soff ? (size_t)soff[k] : (size_t)(k))

    /* scan */
    const int64_t base = st->base;
    if (++sc->epoch == 0) { /* wrapped: no entry may look current */
        memset(sc->sepoch, 0, t->nshapes * sizeof(uint32_t));
        sc->epoch = 1;
    }
    sc->nrec = sc->nms = 0;
    scan_t c = {t, S, n, eof, st->prev, INT64_MAX, sc, SCRUB_OK, st->next_allowed, base};
    scan(&c);
    if (c.err) return c.err;

    /* release point: the first live position; a finished key/value match that began before it
     * but redacts after it holds from its own start */
    int64_t upto = c.live < (int64_t)n ? c.live : (int64_t)n;
    for (int moved = 1; moved;) {
        moved = 0;
        for (size_t i = 0; i < sc->nms; i++) {
            const smatch_t *m = &sc->ms[i];
            if (m->start < upto && upto <= m->rs && m->re > m->rs) {
                upto = m->start;
                moved = 1;
            }
        }
    }

    /* render */
    if (sc->nrec > 1) qsort(sc->recs, sc->nrec, sizeof(rec_t), cmp_rec);
    int rc;
    int64_t lead = st->open_end - base;
    int have = 0;
    int64_t gend = 0;
    for (size_t ri = 0; ri < sc->nrec && sc->recs[ri].start < upto; ri++) {
        const rec_t *r = &sc->recs[ri];
        if (have) {
            if (r->start < gend) {
                if (r->end > gend) gend = r->end;
                continue;
            }
        } else if (r->start < lead) {
            if (r->end > lead) lead = r->end;
            continue;
        }
        int64_t from = have ? gend : (lead > 0 ? lead : 0);
        size_t a = ST((size_t)from), b = ST((size_t)r->start);
        if ((rc = emit_raw(sc, raw, a, b))) return rc;
        a = SOFF((size_t)r->start);
        if ((rc = emit_raw(sc, raw, b, a))) return rc;
        if ((rc = emit(sc, MARK_OPEN, sizeof(MARK_OPEN) - 1))) return rc;
        if ((rc = emit(sc, r->name, r->name_len))) return rc;
        if ((rc = emit(sc, (const uint8_t *)"]", 1))) return rc;
        have = 1;
        gend = r->end;
    }
    int64_t from = have ? gend : (lead > 0 ? lead : 0);
    if (from < upto) {
        size_t a = ST((size_t)from), b = ST((size_t)upto);
        if ((rc = emit_raw(sc, raw, a, b))) return rc;
    }
    int64_t cur_end = have ? gend : lead;
    st->open_end = cur_end > upto ? base + cur_end : 0;

    for (size_t i = 0; i < sc->nms; i++) {
        const smatch_t *m = &sc->ms[i];
        if (m->start < upto && base + m->end > st->next_allowed[m->k])
            st->next_allowed[m->k] = base + m->end;
    }
    if (upto > 0) st->prev = S[upto - 1];
    st->base = base + upto;
    if (eof) {
        size_t a = ST(n);
        if ((rc = emit_raw(sc, raw, a, rawlen))) return rc;
        *cut = rawlen;
    } else {
        *cut = ST((size_t)upto);
    }
    return SCRUB_OK;
#undef ST
#undef SOFF
}

/* How many bytes at the end of p[0:n] start a zero-width character that more input may complete
 * (0, 1 or 2). No zero-width character ends in 0xE2 / 0xEF / 0x80 / 0x81 / 0xBB, so such a start
 * is never the end of a complete one. */
static size_t zw_partial_tail(const uint8_t *p, size_t n) {
    if (n >= 2) {
        uint8_t b = p[n - 2], a = p[n - 1];
        if ((b == 0xE2 && (a == 0x80 || a == 0x81)) || (b == 0xEF && a == 0xBB)) return 2;
    }
    if (n >= 1 && (p[n - 1] == 0xE2 || p[n - 1] == 0xEF)) return 1;
    return 0;
}

/* The reference's ZeroWidthCap: a run of zero-width characters keeps its first ZW_RUN_MAX.
 * Leaves *in / *len alone when the cap changes nothing (no zero-width character, nothing carried,
 * no start of one at the end: nearly every input); otherwise points them at w->capped, which
 * holds the carried bytes, then the input, with the extra characters of long runs taken out, and
 * the start of a cut character at the end carried to the next call. */
static int zw_cap(scrub_stream *st, scrub_work *w, const uint8_t **in, size_t *len, int eof) {
    const uint8_t *p = *in;
    size_t n = *len;
    if (!st->zw_carry_len && (eof || !zw_partial_tail(p, n))) {
#if defined(SCRUB_AVX2)
        size_t z = st->t->simd ? find_zw_avx2(p, n) : find_zw(p, n);
#else
        size_t z = find_zw(p, n);
#endif
        if (z == n) {
            if (n) st->zw_run = 0;
            return SCRUB_OK;
        }
    }
    size_t m = st->zw_carry_len + n;
    if (m < n) return SCRUB_ETOOBIG;
    if (m > w->capped_cap || (w->capped_cap > WORK_KEEP && w->capped_cap / 4 > m)) {
        uint8_t *b = malloc(m);
        if (!b) return SCRUB_ENOMEM;
        free(w->capped);
        w->capped = b;
        w->capped_cap = m;
    }
    uint8_t *b = w->capped;
    memcpy(b, st->zw_carry, st->zw_carry_len);
    if (n) memcpy(b + st->zw_carry_len, p, n);
    size_t tail = eof ? 0 : zw_partial_tail(b, m);
    size_t end = m - tail, o = 0;
    int run = st->zw_run;
    for (size_t i = 0; i < end;) {
        if ((b[i] == 0xE2 || b[i] == 0xEF) && i + 3 <= end && is_zw(b + i)) {
            if (run < ZW_RUN_MAX) {
                memmove(b + o, b + i, 3);
                o += 3;
                run++;
            }
            i += 3;
            continue;
        }
        b[o++] = b[i++];
        run = 0;
    }
    st->zw_run = run;
    memcpy(st->zw_carry, b + end, tail);
    st->zw_carry_len = tail;
    *in = b;
    *len = o;
    return SCRUB_OK;
}

int scrub_feed(scrub_stream *st, scrub_work *w, const char *in_, size_t len, int eof,
               const char **out, size_t *out_len, size_t *in_from, size_t *in_to) {
    *out = NULL;
    *out_len = 0;
    *in_from = *in_to = 0;
    if (atomic_exchange(&st->busy, 1)) return SCRUB_EBUSY;
    if (atomic_exchange(&w->busy, 1)) {
        atomic_store(&st->busy, 0);
        return SCRUB_EBUSY;
    }
    int rc = SCRUB_OK;
    const uint8_t *in = (const uint8_t *)in_;
    if (st->failed) {
        rc = SCRUB_EFAILED;
        goto done;
    }
    if (st->flushed) {
        rc = SCRUB_EFLUSHED;
        goto done;
    }
    if (len == 0 && !eof) goto done;
    const uint8_t *given = in;
    if ((rc = zw_cap(st, w, &in, &len, eof))) goto fail;
    /* zw_cap leaves the input as it is only when it holds no zero-width character: then
     * neither does any part of it, and advance looks for one only in the pending tail */
    const int zw_free = in == given;
    if ((rc = work_prepare(w, st->t, in, len))) goto fail;
    if (len == 0 && !eof) goto done; /* all of it carried */
    if (st->pend_len == 0 && len == 0) {
        st->flushed = 1;
        goto done;
    }
    if (len > SIZE_MAX - 4096 - st->pend_len) {
        rc = SCRUB_ETOOBIG;
        goto fail;
    }
    /* output: about the input's size (markers are rarely longer than what they replace); it
     * grows when needed */
    if ((rc = grow(&w->out, &w->out_cap, len + 256))) goto fail;

    size_t pos = 0, cut = 0;
    size_t pstart = 0; /* start of the pending tail in `in`, once it lies there */
    int in_place = st->pend_len == 0, finished = 0;
    /* Phase 1: the pending tail is in st->pend; append a first piece of input and advance, until
     * the tail left over lies inside the input. */
    while (!in_place && !finished) {
        /* twice the tail, so a long tail (an open private key, zero-width characters) is
         * rescanned a bounded number of times per call */
        size_t take = len - pos, cap = 2 * st->pend_len;
        if (cap < FIRST_MIN) cap = FIRST_MIN;
        if (cap > PIECE && st->pend_len <= PIECE / 2) cap = PIECE;
        if (take > cap) take = cap;
        int last = pos + take == len;
        size_t old = st->pend_len, rawlen = old + take;
        if ((rc = grow(&w->join, &w->join_cap, rawlen))) goto fail;
        memcpy(w->join, st->pend, old);
        if (take) memcpy(w->join + old, in + pos, take);
        w->raw_mirror = old;
        w->in_base = pos;
        if ((rc = advance(st, w, w->join, rawlen, eof && last, zw_free ? old : rawlen, &cut)))
            goto fail;
        pos += take;
        if (eof && last) {
            st->pend_len = 0;
            finished = 1;
        } else if (cut >= old) {
            pstart = pos - take + (cut - old);
            st->pend_len = 0;
            in_place = 1;
        } else {
            if ((rc = grow(&st->pend, &st->pend_cap, rawlen - cut))) goto fail;
            memcpy(st->pend, w->join + cut, rawlen - cut);
            st->pend_len = rawlen - cut;
            if (last) finished = 1;
        }
    }
    if (in_place) {
        /* Phase 2: the pending tail is in[pstart:pos]; advance over it plus the next piece. */
        while (pos < len) {
            size_t take = len - pos < PIECE ? len - pos : PIECE;
            int last = pos + take == len;
            w->raw_mirror = 0;
            w->in_base = pstart;
            size_t rawlen = pos + take - pstart;
            if ((rc = advance(st, w, in + pstart, rawlen, eof && last, zw_free ? 0 : rawlen,
                              &cut)))
                goto fail;
            pstart += cut;
            pos += take;
        }
        if (!eof && pstart < len) {
            if ((rc = grow(&st->pend, &st->pend_cap, len - pstart))) goto fail;
            memcpy(st->pend, in + pstart, len - pstart);
            st->pend_len = len - pstart;
        }
    }
    if (eof) {
        st->flushed = 1;
        st->pend_len = 0;
    }
    /* keep the pending buffer near the pending tail's size */
    if (st->pend_cap > st->pend_len + PEND_KEEP) {
        size_t c = st->pend_len + 1024;
        uint8_t *p = realloc(st->pend, c);
        if (p) {
            st->pend = p;
            st->pend_cap = c;
        }
    }
    /* a short deferred range is cheaper to copy here than to join in the caller */
    /* the caller can take a deferred range from its own input only if that is what was scanned */
    if ((in != given || w->d_to - w->d_from < DEFER_MIN) && (rc = settle(w))) goto fail;
    *out = (const char *)w->out;
    *out_len = w->out_len;
    *in_from = w->d_from;
    *in_to = w->d_to;
    goto done;
fail:
    st->failed = 1;
    w->out_len = 0;
    w->d_from = w->d_to = 0;
done:
    atomic_store(&w->busy, 0);
    atomic_store(&st->busy, 0);
    return rc;
}
