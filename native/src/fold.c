/* fold: the scrubber's second stage in C. See fold.h for the objects and native/scrub_fold.py
 * for the definition (this file follows its functions one for one: a unit decoder that reads
 * the same bytes in the same order, so it asks for more input exactly when the reference does;
 * the view; the windows; the groups; the cut of a stream).
 *
 * Speed: a call decodes its bytes into the view first (plain bytes, those that are one unit
 * each, 32 at a time with AVX2 (plain_avx2) or one branch per byte; whole valid two- and
 * three-byte UTF-8 characters in a run of their own; only `%`, `&`, `\`, ESC, `[` before `R`
 * and the other bytes that may start a UTF-8 character take the decoder), then looks for
 * windows. Every window of length L holds, at any S = L_min - G + 1 consecutive positions,
 * the start of one of its G-character grams (G = 8); so the view is probed only every S-th
 * position, against a
 * blocked Bloom filter of every gram of every window (its cache lines fetched a batch of probes
 * ahead: with hundreds of secrets it is larger than L2), and only around a hit are the windows
 * themselves (a 96-bit number, 6 bits per character) looked up, at each start the hit could
 * belong to. The result is exactly the reference's (every window occurrence is found, whatever
 * the phase of the sampling), at one filter probe per S folded characters. The cut of a
 * stream reads an exact set of the windows' 6-grams (`holds`), the reference's `grams`. */
#include "fold.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "fold_table.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FOLD_AVX2 1 /* compiled for any x86-64; used when the CPU has AVX2 (fold_simd) */
#endif

/* The constants of native/scrub_fold.py (the wrapper checks they agree). */
#define W 16
#define MIN_SHORT 12
#define MAX_GAP 8
#define GAP_BYTES 64
#define GROUP_CAP 1024
#define ANSI_CSI_MAX 32
#define ANSI_OSC_MAX 256
#define PIECE (64 * 1024)
#define MAX_NAME 64
#define GRAM 8 /* the filter's gram length (its 8 folded bytes, one 64-bit load) */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif
#define PROBE_BATCH 16 /* gram filter probes whose cache lines are fetched ahead */
#define HOLD_GRAM 6 /* scrub_fold.GRAM: a stream holds from a character that could begin a window */

#define K_IGNORED (-1)
#define K_BREAK (-2) /* a stage-1 marker */
#define K_NEED_MORE (-3)

static const uint64_t K1 = 0x9E3779B97F4A7C15ull;
static const uint64_t K2 = 0xC2B2AE3D27D4EB4Full;

typedef struct {
    uint64_t lo;  /* the window's last 10 characters (6 bits each, the first most significant) */
    uint64_t rest; /* its first characters (32 bits), its length (bits 32-39), its owner (40-63) */
} went_t;
#define EMPTY UINT64_MAX /* `rest` of an empty slot (owner 0xFFFFFF: no such secret) */
#define MAX_OWNERS 0xFFFFFF

struct fold_tables {
    went_t *slots;
    size_t mask;
    uint64_t *bloom;
    unsigned bloom_shift; /* bits of the hash that index the Bloom filter: 64 - log2(bits) */
    uint64_t *grams;      /* blocked Bloom filter of the windows' grams: two bits in one word */
    unsigned grams_shift; /* 64 - log2(words) */
    size_t stride;        /* S: the sampling step of the scan */
    uint64_t *holds;      /* exact set of the windows' HOLD_GRAM-grams (36 bits, 0: empty) */
    size_t holds_mask;
    uint8_t *markers;     /* the marker names (lower case) that decode to a BREAK */
    size_t *marker_off, *marker_len;
    size_t nmarkers;
    int nlen;
    int lengths[W - MIN_SHORT + 1]; /* window lengths present, ascending */
    uint8_t *names;
    size_t *name_off, *name_len;
    size_t nnames, max_name;
    size_t footprint;
    /* fold_cp of the code points below 0x800 (the two-byte UTF-8 characters: Latin, Greek,
     * Cyrillic, ...): one load instead of a search of the table. */
    int8_t fold2[0x800];
};

struct fold_stream {
    const fold_tables *t;
    uint8_t *pend;
    size_t pend_len, pend_cap;
    int flushed, failed;
    atomic_int busy;
};

typedef struct {
    uint32_t start, end;
    int32_t idx;
} span_t;

typedef struct {
    uint32_t start, end;
    int32_t idx;
    int full;
} group_t;

struct fold_work {
    uint8_t *scratch;
    size_t scratch_cap;
    uint8_t *chars;
    uint32_t *rs, *re; /* re[k] only where flags[k] has F_SLOW (else rs[k] + 1) */
    uint8_t *flags;     /* per folded character: F_BREAK (a BREAK before it), F_SLOW */
    size_t view_cap;
    span_t *spans;
    size_t spans_cap;
    group_t *groups;
    size_t groups_cap;
    uint8_t *out;
    size_t out_cap, out_len;
    /* The output when it is a prefix of one call's input as it was decoded (no marker in it,
     * nothing before it): the input itself, not copied (NULL: the output is in out). */
    const uint8_t *direct;
    size_t direct_len;
    atomic_int busy;
};

int fold_constants(int32_t *out, size_t n) {
    const int32_t values[] = {W, MIN_SHORT, MAX_GAP, GAP_BYTES, GROUP_CAP, ANSI_CSI_MAX, ANSI_OSC_MAX};
    size_t count = sizeof values / sizeof values[0];
    if (n < count) count = n;
    for (size_t k = 0; k < count; k++) out[k] = values[k];
    return (int)count;
}

/* -- small helpers ------------------------------------------------------------------------- */

static size_t pow2_at_least(size_t x) {
    size_t p = 1;
    while (p < x && p < ((size_t)1 << (sizeof(size_t) * 8 - 2))) p <<= 1;
    return p;
}

static void *xmalloc(size_t count, size_t size) {
    if (size && count > SIZE_MAX / size) return NULL;
    size_t bytes = count * size;
    return malloc(bytes ? bytes : 1);
}

static void *xcalloc(size_t count, size_t size) { return calloc(count ? count : 1, size ? size : 1); }

/* Grows *buf (elements of `size` bytes) to hold at least `need`; 0 or FOLD_ENOMEM. */
static int grow(void **buf, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return FOLD_OK;
    size_t want = *cap ? *cap : 256;
    while (want < need) {
        if (want > SIZE_MAX / 2) return FOLD_ETOOBIG;
        want *= 2;
    }
    if (want > SIZE_MAX / size) return FOLD_ETOOBIG;
    void *p = realloc(*buf, want * size);
    if (!p) return FOLD_ENOMEM;
    *buf = p;
    *cap = want;
    return FOLD_OK;
}

static inline int code_of(uint8_t c) { /* folded character -> 1..36 */
    return c <= '9' ? c - '0' + 1 : c - 'a' + 11;
}

static inline uint64_t hash_of(uint64_t lo, uint64_t hi) {
    uint64_t h = lo * K1 ^ (hi + 0x632BE59BD9B4E019ull) * K2;
    return h ^ (h >> 29);
}

/* -- the code point table ------------------------------------------------------------------ */

static int fold_cp(uint32_t cp) {
    size_t lo = 0, hi = FOLD_TABLE_ROWS; /* the last row whose first <= cp */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (fold_table[mid][0] <= cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0) return K_IGNORED;
    const uint32_t *row = fold_table[lo - 1];
    if (cp > row[1]) return K_IGNORED;
    return (int)(row[2] + (cp - row[0]) * row[3]);
}

/* Bytes: IGNORED (ASCII controls, white space, punctuation), SLOW (ESC, `%`, `&`, `\` and
 * bytes >= 0x80: the decoder), or the folded character itself. */
enum { A_IGNORED = 0, A_SLOW = 1, A_BRACKET = 2 }; /* `[`: the decoder only before `R` */
static const uint8_t ASCII_CLASS[256] = {
    /* bytes that may start a UTF-8 character (0xC2-0xF4): the decoder. The other bytes >= 0x80
     * (0x80-0xC1, 0xF5-0xFF) never do: each is one IGNORED byte, which utf8() decides
     * without reading further, so they are plain like ASCII punctuation. */
    [0xC2] = A_SLOW, [0xC3] = A_SLOW, [0xC4] = A_SLOW, [0xC5] = A_SLOW, [0xC6] = A_SLOW, [0xC7] = A_SLOW,
    [0xC8] = A_SLOW, [0xC9] = A_SLOW, [0xCA] = A_SLOW, [0xCB] = A_SLOW, [0xCC] = A_SLOW, [0xCD] = A_SLOW,
    [0xCE] = A_SLOW, [0xCF] = A_SLOW, [0xD0] = A_SLOW, [0xD1] = A_SLOW, [0xD2] = A_SLOW, [0xD3] = A_SLOW,
    [0xD4] = A_SLOW, [0xD5] = A_SLOW, [0xD6] = A_SLOW, [0xD7] = A_SLOW, [0xD8] = A_SLOW, [0xD9] = A_SLOW,
    [0xDA] = A_SLOW, [0xDB] = A_SLOW, [0xDC] = A_SLOW, [0xDD] = A_SLOW, [0xDE] = A_SLOW, [0xDF] = A_SLOW,
    [0xE0] = A_SLOW, [0xE1] = A_SLOW, [0xE2] = A_SLOW, [0xE3] = A_SLOW, [0xE4] = A_SLOW, [0xE5] = A_SLOW,
    [0xE6] = A_SLOW, [0xE7] = A_SLOW, [0xE8] = A_SLOW, [0xE9] = A_SLOW, [0xEA] = A_SLOW, [0xEB] = A_SLOW,
    [0xEC] = A_SLOW, [0xED] = A_SLOW, [0xEE] = A_SLOW, [0xEF] = A_SLOW, [0xF0] = A_SLOW, [0xF1] = A_SLOW,
    [0xF2] = A_SLOW, [0xF3] = A_SLOW, [0xF4] = A_SLOW,
    [0x1B] = A_SLOW, ['%'] = A_SLOW, ['&'] = A_SLOW, ['\\'] = A_SLOW, ['['] = A_BRACKET,
    ['0'] = '0', ['1'] = '1', ['2'] = '2', ['3'] = '3', ['4'] = '4', ['5'] = '5', ['6'] = '6', ['7'] = '7', ['8'] = '8', ['9'] = '9',
    ['a'] = 'a', ['b'] = 'b', ['c'] = 'c', ['d'] = 'd', ['e'] = 'e', ['f'] = 'f', ['g'] = 'g',
    ['h'] = 'h', ['i'] = 'i', ['j'] = 'j', ['k'] = 'k', ['l'] = 'l', ['m'] = 'm', ['n'] = 'n',
    ['o'] = 'o', ['p'] = 'p', ['q'] = 'q', ['r'] = 'r', ['s'] = 's', ['t'] = 't', ['u'] = 'u',
    ['v'] = 'v', ['w'] = 'w', ['x'] = 'x', ['y'] = 'y', ['z'] = 'z',
    ['A'] = 'a', ['B'] = 'b', ['C'] = 'c', ['D'] = 'd', ['E'] = 'e', ['F'] = 'f', ['G'] = 'g',
    ['H'] = 'h', ['I'] = 'i', ['J'] = 'j', ['K'] = 'k', ['L'] = 'l', ['M'] = 'm', ['N'] = 'n',
    ['O'] = 'o', ['P'] = 'p', ['Q'] = 'q', ['R'] = 'r', ['S'] = 's', ['T'] = 't', ['U'] = 'u',
    ['V'] = 'v', ['W'] = 'w', ['X'] = 'x', ['Y'] = 'y', ['Z'] = 'z',
};

/* Per folded character of the view: a BREAK before it; decoded (its end is in `re`). */
enum { F_BREAK = 1, F_SLOW = 2 };

/* A BREAK before any of the folded characters f[1 .. GRAM - 1] (the flags of a gram)? */
static inline int break_in_gram(const uint8_t *f) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ && GRAM == 8
    uint64_t x;
    memcpy(&x, f, sizeof x);
    return (x & 0x0101010101010100ull) != 0; /* F_BREAK of bytes 1-7 */
#else
    for (int j = 1; j < GRAM; j++)
        if (f[j] & F_BREAK) return 1;
    return 0;
#endif
}

/* -- plain stretches, 32 bytes at a time ------------------------------------------------------
 *
 * A plain byte is one unit of one byte that reads nothing after it: an ASCII letter or digit (a
 * folded character, lowered: `c | 0x20` leaves digits as they are) or anything IGNORED (ASCII
 * other than ESC `%` `&` `\` `[`, and the bytes >= 0x80 that cannot start a UTF-8 character).
 * Over a block of 32 plain bytes the view only needs each letter or digit's folded byte and raw
 * offset appended, and a BREAK flag where more than MAX_GAP bytes went by since the previous
 * one (a gap of plain bytes has as many units as bytes, and MAX_GAP < GAP_BYTES, so only the
 * unit count can break it... except across the block's start, which continues the gap state).
 * The classification is two masks of 32 bits; the letters and digits are packed eight bytes at
 * a time with one shuffle whose control (the positions of the set bits of an 8-bit mask) comes
 * from COMPRESS, and those same positions, widened, are the raw offsets. */
#if defined(FOLD_AVX2)
static const uint64_t COMPRESS[256] = {
    0x0000000000000000ull, 0x0000000000000000ull, 0x0000000000000001ull, 0x0000000000000100ull,
    0x0000000000000002ull, 0x0000000000000200ull, 0x0000000000000201ull, 0x0000000000020100ull,
    0x0000000000000003ull, 0x0000000000000300ull, 0x0000000000000301ull, 0x0000000000030100ull,
    0x0000000000000302ull, 0x0000000000030200ull, 0x0000000000030201ull, 0x0000000003020100ull,
    0x0000000000000004ull, 0x0000000000000400ull, 0x0000000000000401ull, 0x0000000000040100ull,
    0x0000000000000402ull, 0x0000000000040200ull, 0x0000000000040201ull, 0x0000000004020100ull,
    0x0000000000000403ull, 0x0000000000040300ull, 0x0000000000040301ull, 0x0000000004030100ull,
    0x0000000000040302ull, 0x0000000004030200ull, 0x0000000004030201ull, 0x0000000403020100ull,
    0x0000000000000005ull, 0x0000000000000500ull, 0x0000000000000501ull, 0x0000000000050100ull,
    0x0000000000000502ull, 0x0000000000050200ull, 0x0000000000050201ull, 0x0000000005020100ull,
    0x0000000000000503ull, 0x0000000000050300ull, 0x0000000000050301ull, 0x0000000005030100ull,
    0x0000000000050302ull, 0x0000000005030200ull, 0x0000000005030201ull, 0x0000000503020100ull,
    0x0000000000000504ull, 0x0000000000050400ull, 0x0000000000050401ull, 0x0000000005040100ull,
    0x0000000000050402ull, 0x0000000005040200ull, 0x0000000005040201ull, 0x0000000504020100ull,
    0x0000000000050403ull, 0x0000000005040300ull, 0x0000000005040301ull, 0x0000000504030100ull,
    0x0000000005040302ull, 0x0000000504030200ull, 0x0000000504030201ull, 0x0000050403020100ull,
    0x0000000000000006ull, 0x0000000000000600ull, 0x0000000000000601ull, 0x0000000000060100ull,
    0x0000000000000602ull, 0x0000000000060200ull, 0x0000000000060201ull, 0x0000000006020100ull,
    0x0000000000000603ull, 0x0000000000060300ull, 0x0000000000060301ull, 0x0000000006030100ull,
    0x0000000000060302ull, 0x0000000006030200ull, 0x0000000006030201ull, 0x0000000603020100ull,
    0x0000000000000604ull, 0x0000000000060400ull, 0x0000000000060401ull, 0x0000000006040100ull,
    0x0000000000060402ull, 0x0000000006040200ull, 0x0000000006040201ull, 0x0000000604020100ull,
    0x0000000000060403ull, 0x0000000006040300ull, 0x0000000006040301ull, 0x0000000604030100ull,
    0x0000000006040302ull, 0x0000000604030200ull, 0x0000000604030201ull, 0x0000060403020100ull,
    0x0000000000000605ull, 0x0000000000060500ull, 0x0000000000060501ull, 0x0000000006050100ull,
    0x0000000000060502ull, 0x0000000006050200ull, 0x0000000006050201ull, 0x0000000605020100ull,
    0x0000000000060503ull, 0x0000000006050300ull, 0x0000000006050301ull, 0x0000000605030100ull,
    0x0000000006050302ull, 0x0000000605030200ull, 0x0000000605030201ull, 0x0000060503020100ull,
    0x0000000000060504ull, 0x0000000006050400ull, 0x0000000006050401ull, 0x0000000605040100ull,
    0x0000000006050402ull, 0x0000000605040200ull, 0x0000000605040201ull, 0x0000060504020100ull,
    0x0000000006050403ull, 0x0000000605040300ull, 0x0000000605040301ull, 0x0000060504030100ull,
    0x0000000605040302ull, 0x0000060504030200ull, 0x0000060504030201ull, 0x0006050403020100ull,
    0x0000000000000007ull, 0x0000000000000700ull, 0x0000000000000701ull, 0x0000000000070100ull,
    0x0000000000000702ull, 0x0000000000070200ull, 0x0000000000070201ull, 0x0000000007020100ull,
    0x0000000000000703ull, 0x0000000000070300ull, 0x0000000000070301ull, 0x0000000007030100ull,
    0x0000000000070302ull, 0x0000000007030200ull, 0x0000000007030201ull, 0x0000000703020100ull,
    0x0000000000000704ull, 0x0000000000070400ull, 0x0000000000070401ull, 0x0000000007040100ull,
    0x0000000000070402ull, 0x0000000007040200ull, 0x0000000007040201ull, 0x0000000704020100ull,
    0x0000000000070403ull, 0x0000000007040300ull, 0x0000000007040301ull, 0x0000000704030100ull,
    0x0000000007040302ull, 0x0000000704030200ull, 0x0000000704030201ull, 0x0000070403020100ull,
    0x0000000000000705ull, 0x0000000000070500ull, 0x0000000000070501ull, 0x0000000007050100ull,
    0x0000000000070502ull, 0x0000000007050200ull, 0x0000000007050201ull, 0x0000000705020100ull,
    0x0000000000070503ull, 0x0000000007050300ull, 0x0000000007050301ull, 0x0000000705030100ull,
    0x0000000007050302ull, 0x0000000705030200ull, 0x0000000705030201ull, 0x0000070503020100ull,
    0x0000000000070504ull, 0x0000000007050400ull, 0x0000000007050401ull, 0x0000000705040100ull,
    0x0000000007050402ull, 0x0000000705040200ull, 0x0000000705040201ull, 0x0000070504020100ull,
    0x0000000007050403ull, 0x0000000705040300ull, 0x0000000705040301ull, 0x0000070504030100ull,
    0x0000000705040302ull, 0x0000070504030200ull, 0x0000070504030201ull, 0x0007050403020100ull,
    0x0000000000000706ull, 0x0000000000070600ull, 0x0000000000070601ull, 0x0000000007060100ull,
    0x0000000000070602ull, 0x0000000007060200ull, 0x0000000007060201ull, 0x0000000706020100ull,
    0x0000000000070603ull, 0x0000000007060300ull, 0x0000000007060301ull, 0x0000000706030100ull,
    0x0000000007060302ull, 0x0000000706030200ull, 0x0000000706030201ull, 0x0000070603020100ull,
    0x0000000000070604ull, 0x0000000007060400ull, 0x0000000007060401ull, 0x0000000706040100ull,
    0x0000000007060402ull, 0x0000000706040200ull, 0x0000000706040201ull, 0x0000070604020100ull,
    0x0000000007060403ull, 0x0000000706040300ull, 0x0000000706040301ull, 0x0000070604030100ull,
    0x0000000706040302ull, 0x0000070604030200ull, 0x0000070604030201ull, 0x0007060403020100ull,
    0x0000000000070605ull, 0x0000000007060500ull, 0x0000000007060501ull, 0x0000000706050100ull,
    0x0000000007060502ull, 0x0000000706050200ull, 0x0000000706050201ull, 0x0000070605020100ull,
    0x0000000007060503ull, 0x0000000706050300ull, 0x0000000706050301ull, 0x0000070605030100ull,
    0x0000000706050302ull, 0x0000070605030200ull, 0x0000070605030201ull, 0x0007060503020100ull,
    0x0000000007060504ull, 0x0000000706050400ull, 0x0000000706050401ull, 0x0000070605040100ull,
    0x0000000706050402ull, 0x0000070605040200ull, 0x0000070605040201ull, 0x0007060504020100ull,
    0x0000000706050403ull, 0x0000070605040300ull, 0x0000070605040301ull, 0x0007060504030100ull,
    0x0000070605040302ull, 0x0007060504030200ull, 0x0007060504030201ull, 0x0706050403020100ull,
};

static int fold_simd(void) {
    static atomic_int known = 0; /* 0: not asked yet, 1: no, 2: yes */
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (!v) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") ? 2 : 1;
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return v == 2;
}

typedef struct {
    uint32_t gap_units, gap_bytes, broken; /* scrub_fold.view's, after the last unit read */
} gap_t;

/* plain_avx2's byte classes: a byte's classes are PLAIN_LO[its low nibble] & PLAIN_HI[its
 * high nibble], a bit per set of (high, low) nibbles:
 *   bit 0: high 4 or 6, low 1-F (A-O, a-o)      bit 1: high 5 or 7, low 0-A (P-Z, p-z)
 *   bit 2: high 3, low 0-9 (digits)             bit 3: high 1 or 5, low B (ESC, `[`)
 *   bit 4: high 2, low 5-6 (`%`, `&`)           bit 5: high 5, low C (`\`)
 *   bit 6: high C-E, low 2-F                    bit 7: high D-F, low 0-4
 * Bits 6 and 7 together are 0xC2-0xF4, the bytes that may start a UTF-8 character (C2-CF,
 * D0-DF, E0-EF from bit 6 or 7, F0-F4 from bit 7). tests/test_scrub_fold.py puts every byte
 * value through this path where a wrong class would change the output, against the reference. */
enum { C_ALNUM = 0x07, C_SLOW = 0x38, C_LEAD = 0xC0 };
static const uint8_t PLAIN_LO[16] = {
    0x02 | 0x04 | 0x80,        0x01 | 0x02 | 0x04 | 0x80, 0x01 | 0x02 | 0x04 | 0x40 | 0x80,
    0x01 | 0x02 | 0x04 | 0x40 | 0x80, 0x01 | 0x02 | 0x04 | 0x40 | 0x80,
    0x01 | 0x02 | 0x04 | 0x10 | 0x40, 0x01 | 0x02 | 0x04 | 0x10 | 0x40,
    0x01 | 0x02 | 0x04 | 0x40, 0x01 | 0x02 | 0x04 | 0x40, 0x01 | 0x02 | 0x04 | 0x40,
    0x01 | 0x02 | 0x40,        0x01 | 0x08 | 0x40,        0x01 | 0x20 | 0x40,
    0x01 | 0x40,               0x01 | 0x40,               0x01 | 0x40,
};
static const uint8_t PLAIN_HI[16] = {
    0x00, 0x08, 0x10, 0x04, 0x01, 0x02 | 0x08 | 0x20, 0x01, 0x02,
    0x00, 0x00, 0x00, 0x00, 0x40, 0x40 | 0x80,        0x40 | 0x80, 0x80,
};

/* Appends the units of d[i:] to the view while whole blocks of 32 plain bytes (or the plain
 * start of a block) remain; returns where it stopped: at a byte that is not plain, or with
 * fewer than 32 bytes left. chars, rs and flags have room for *nc + 32 more entries. */
__attribute__((target("avx2"))) static size_t plain_avx2(const uint8_t *d, size_t n, size_t i,
                                                          uint8_t *chars, uint32_t *rs,
                                                          uint8_t *flags, size_t *nc, gap_t *g) {
    size_t k = *nc;
    const __m256i zero = _mm256_setzero_si256(), nib = _mm256_set1_epi8(0x0F);
    const __m256i tlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)PLAIN_LO));
    const __m256i thi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)PLAIN_HI));
    /* The gap in locals: through g, every store to flags (uint8_t, which may alias anything)
     * made the compiler read them again. */
    uint32_t gu = g->gap_units, gb = g->gap_bytes, br = g->broken;
    while (n - i >= 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(d + i));
        __m256i low = _mm256_or_si256(v, _mm256_set1_epi8(0x20));
        /* Each byte's classes from two 16-entry tables, one per nibble (see PLAIN_LO): fewer
         * operations and constants than a compare per range or byte, whose constants did not
         * fit the registers and were rebuilt in every block. */
        __m256i cls = _mm256_and_si256(
            _mm256_shuffle_epi8(tlo, _mm256_and_si256(v, nib)),
            _mm256_shuffle_epi8(thi, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib)));
        __m256i alnum = _mm256_cmpeq_epi8(_mm256_and_si256(cls, _mm256_set1_epi8(C_ALNUM)), zero);
        __m256i slow = _mm256_cmpeq_epi8(_mm256_and_si256(cls, _mm256_set1_epi8(C_SLOW)), zero);
        __m256i lead = _mm256_cmpeq_epi8(_mm256_and_si256(cls, _mm256_set1_epi8(C_LEAD)), zero);
        /* A lead byte not followed by a continuation byte (0x80-0xBF: -128..-65) is one
         * IGNORED byte whatever it leads (utf8() reads only that next byte): plain, unless that
         * byte is past the block. Random or binary data is mostly such bytes. */
        uint32_t cont = (uint32_t)_mm256_movemask_epi8(
            _mm256_cmpgt_epi8(_mm256_set1_epi8(-64), v));
        uint32_t s = ~(uint32_t)_mm256_movemask_epi8(slow) |
                     (~(uint32_t)_mm256_movemask_epi8(lead) & ((cont >> 1) | 0x80000000u));
        uint32_t m = ~(uint32_t)_mm256_movemask_epi8(alnum);
        uint32_t len = 32;
        if (s) {
            len = (uint32_t)__builtin_ctz(s);
            if (!len) break;
            m &= (1u << len) - 1;
        }
        if (!m) {
            gu += len;
            gb += len;
            br |= gu > MAX_GAP || gb > GAP_BYTES;
        } else {
            size_t k0 = k;
            _mm256_storeu_si256((__m256i *)(flags + k0), zero);
            /* The four 8-byte quarters written out, not looped: as a loop, the compiler kept the
             * two halves in a stack array and spent more instructions on the loop than on the
             * packing. A quarter's control is its indexes + 8 * q (< 32): the shuffle reads only
             * the low four bits and bit 7 of each, so the same bytes select within the half and,
             * widened and added to one broadcast of i, are the raw offsets. */
            const __m128i lo16 = _mm256_castsi256_si128(low);
            const __m128i hi16 = _mm256_extracti128_si256(low, 1);
            const __m256i base = _mm256_set1_epi32((int)i);
#define FOLD_QUARTER(q, src)                                                                     \
    do {                                                                                         \
        const uint32_t m8 = (m >> (8 * (q))) & 0xFF;                                             \
        const __m128i at = _mm_add_epi8(_mm_loadl_epi64((const __m128i *)&COMPRESS[m8]),         \
                                        _mm_set1_epi8(8 * (q)));                                 \
        _mm_storel_epi64((__m128i *)(chars + k),                                                 \
                         _mm_shuffle_epi8((src), at));                                           \
        _mm256_storeu_si256((__m256i *)(rs + k),                                                 \
                            _mm256_add_epi32(_mm256_cvtepu8_epi32(at), base));                   \
        k += (size_t)__builtin_popcount(m8);                                                     \
    } while (0)
            FOLD_QUARTER(0, lo16);
            FOLD_QUARTER(1, lo16);
            FOLD_QUARTER(2, hi16);
            FOLD_QUARTER(3, hi16);
#undef FOLD_QUARTER
            uint32_t first = (uint32_t)__builtin_ctz(m);
            if (br || gu + first > MAX_GAP || gb + first > GAP_BYTES)
                flags[k0] = F_BREAK;
            /* The block's other characters after more than MAX_GAP bytes that are not: bit p of
             * run is set when the MAX_GAP + 1 bits from p are all clear in m, so a character at
             * bit b follows such a gap when bit b - (MAX_GAP + 1) of run is. (Indentation.) */
            _Static_assert(MAX_GAP == 8, "run: MAX_GAP + 1 clear bits");
            uint32_t z = ~m, z2 = z & (z >> 1), z4 = z2 & (z2 >> 2), z8 = z4 & (z4 >> 4);
            uint32_t run = z8 & (z >> 8);
            for (uint32_t b = m & (run << (MAX_GAP + 1)) & (m - 1); b; b &= b - 1) {
                uint32_t bit = (uint32_t)__builtin_ctz(b);
                flags[k0 + (size_t)__builtin_popcount(m & ((1u << bit) - 1))] = F_BREAK;
            }
            uint32_t after = len - 1 - (31u - (uint32_t)__builtin_clz(m));
            gu = gb = after;
            br = after > MAX_GAP;
        }
        i += len;
        if (len < 32) break;
    }
    *nc = k;
    g->gap_units = gu;
    g->gap_bytes = gb;
    g->broken = br;
    return i;
}
#endif

/* -- the unit decoder (scrub_fold.next_unit and its helpers) ------------------------------- */

typedef struct {
    const uint8_t *d;
    size_t n;
    int short_;
} reader_t;

static inline int at(reader_t *r, size_t j) {
    if (j < r->n) return r->d[j];
    r->short_ = 1;
    return -1;
}

static inline int is_hex(int c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

static inline uint32_t hex_val(int c) {
    return (uint32_t)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
}

/* Up to hi hex digits at j: 1 and *value, *end; 0 if fewer than lo. */
static int hex_run(reader_t *r, size_t j, size_t lo, size_t hi, uint32_t *value, size_t *end) {
    size_t k = j;
    uint32_t v = 0;
    while (k - j < hi && is_hex(at(r, k))) {
        v = (v << 4) | hex_val(r->d[k]);
        k++;
    }
    if (k - j < lo) return 0;
    *value = v;
    *end = k;
    return 1;
}

static int percent(reader_t *r, size_t i, size_t *end, uint32_t *cp) {
    size_t j = i + 1;
    int k = 0;
    while (k < 4 && at(r, j) == '2' && at(r, j + 1) == '5') {
        j += 2;
        k++;
    }
    if (is_hex(at(r, j)) && is_hex(at(r, j + 1))) {
        *end = j + 2;
        *cp = hex_val(r->d[j]) << 4 | hex_val(r->d[j + 1]);
        return 1;
    }
    if (k) {
        *end = j;
        *cp = 0x25;
        return 1;
    }
    return 0;
}

static int match_at(reader_t *r, size_t j, const char *word, size_t len) {
    for (size_t m = 0; m < len; m++)
        if (at(r, j + m) != (uint8_t)word[m]) return 0;
    return 1;
}

static const struct {
    const char *name;
    size_t len;
    uint32_t cp;
} NAMED[] = {{"amp;", 4, 0x26}, {"lt;", 3, 0x3C},   {"gt;", 3, 0x3E},
             {"quot;", 5, 0x22}, {"apos;", 5, 0x27}, {"nbsp;", 5, 0x20}};

static int entity(reader_t *r, size_t i, size_t *end, uint32_t *cp) {
    size_t j = i + 1;
    int k = 0;
    while (k < 4 && match_at(r, j, "amp;", 4)) {
        j += 4;
        k++;
    }
    if (at(r, j) == '#') {
        int found = 0;
        uint32_t v = 0;
        size_t e = j;
        int c = at(r, j + 1);
        if (c == 'x' || c == 'X') {
            found = hex_run(r, j + 2, 1, 6, &v, &e);
        } else {
            size_t m = j + 1;
            while (m - j - 1 < 7) {
                int d = at(r, m);
                if (d < '0' || d > '9') break;
                v = v * 10 + (uint32_t)(d - '0');
                m++;
            }
            if (m > j + 1) {
                found = 1;
                e = m;
            }
        }
        if (found) {
            if (at(r, e) == ';') e++;
            *end = e;
            *cp = v;
            return 1;
        }
    } else {
        for (size_t m = 0; m < sizeof NAMED / sizeof NAMED[0]; m++) {
            if (match_at(r, j, NAMED[m].name, NAMED[m].len)) {
                *end = j + NAMED[m].len;
                *cp = NAMED[m].cp;
                return 1;
            }
        }
    }
    if (k) {
        *end = j;
        *cp = 0x26;
        return 1;
    }
    return 0;
}

static inline int is_octal(int c) { return c >= '0' && c <= '7'; }

static int escape(reader_t *r, size_t i, size_t *end, uint32_t *cp) {
    int c = at(r, i + 1);
    if (c == 'x') return hex_run(r, i + 2, 2, 2, cp, end);
    if (c == 'u') {
        if (at(r, i + 2) == '{') {
            if (!hex_run(r, i + 3, 1, 6, cp, end) || at(r, *end) != '}') return 0;
            *end += 1;
            return 1;
        }
        return hex_run(r, i + 2, 4, 4, cp, end);
    }
    if (c == 'U') return hex_run(r, i + 2, 8, 8, cp, end);
    if (is_octal(c)) {
        if (is_octal(at(r, i + 2)) && is_octal(at(r, i + 3))) {
            *end = i + 4;
            *cp = (uint32_t)((c - '0') * 64 + (r->d[i + 2] - '0') * 8 + (r->d[i + 3] - '0'));
            return 1;
        }
        return 0;
    }
    if (c == 'n' || c == 'r' || c == 't' || c == 'b' || c == 'f' || c == 'v') {
        *end = i + 2;
        *cp = 0; /* a control character: IGNORED */
        return 1;
    }
    return 0;
}

static size_t ansi(reader_t *r, size_t i) {
    int c = at(r, i + 1);
    if (c == '[') {
        size_t j = i + 2;
        int b;
        while (j - i < ANSI_CSI_MAX && (b = at(r, j)) >= 0x30 && b <= 0x3F) j++;
        while (j - i < ANSI_CSI_MAX && (b = at(r, j)) >= 0x20 && b <= 0x2F) j++;
        if (j - i < ANSI_CSI_MAX && (b = at(r, j)) >= 0x40 && b <= 0x7E) return j + 1;
        return i + 1;
    }
    if (c == ']') {
        size_t j = i + 2;
        while (j - i < ANSI_OSC_MAX) {
            int b = at(r, j);
            if (b < 0) break;
            if (b == 0x07) return j + 1;
            if (b == 0x1B) {
                if (j + 1 - i < ANSI_OSC_MAX && at(r, j + 1) == 0x5C) return j + 2;
                break;
            }
            j++;
        }
        return i + 1;
    }
    return i + 1;
}

/* The UTF-8 character at i: its end and code point, or K_IGNORED for one byte. */
static int utf8(reader_t *r, size_t i, size_t *end) {
    int b = r->d[i];
    int need, lo = 0x80, hi = 0xBF;
    uint32_t cp;
    if (b < 0x80) {
        *end = i + 1;
        return b;
    }
    if (b >= 0xC2 && b <= 0xDF) {
        need = 1;
        cp = (uint32_t)(b & 0x1F);
    } else if (b >= 0xE0 && b <= 0xEF) {
        need = 2;
        cp = (uint32_t)(b & 0x0F);
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 3;
        cp = (uint32_t)(b & 0x07);
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else {
        *end = i + 1;
        return K_IGNORED;
    }
    for (int k = 1; k <= need; k++) {
        int c = at(r, i + (size_t)k);
        if (c < lo || c > hi) {
            *end = i + 1;
            return K_IGNORED;
        }
        cp = (cp << 6) | (uint32_t)(c & 0x3F);
        lo = 0x80;
        hi = 0xBF;
    }
    *end = i + 1 + (size_t)need;
    return (int)cp;
}

static inline int is_name_char(int c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
           c == '.' || c == ':' || c == '@' || c == '/' || c == '+' || c == '-';
}

static inline int lower(int c) { return c >= 'A' && c <= 'Z' ? c | 0x20 : c; }

/* scrub_fold._marker: the end of a stage-1 marker at i (`[`) with one of the tables' names, or
 * 0. Reads the bytes the reference reads, in its order. */
static size_t marker(const fold_tables *t, reader_t *r, size_t i) {
    static const char open[] = "[REDACTED:";
    if (!match_at(r, i, open, sizeof open - 1)) return 0;
    size_t a = i + sizeof open - 1, j = a;
    while (j - a < MAX_NAME && is_name_char(at(r, j))) j++;
    if (j == a || at(r, j) != ']') return 0;
    for (size_t k = 0; k < t->nmarkers; k++) {
        if (t->marker_len[k] != j - a) continue;
        const uint8_t *name = t->markers + t->marker_off[k];
        size_t m = 0;
        while (m < j - a && lower(r->d[a + m]) == name[m]) m++;
        if (m == j - a) return j + 1;
    }
    return 0;
}

/* The unit at d[i]: its kind (a folded byte, K_IGNORED or K_BREAK) and end, or K_NEED_MORE.
 * Out of line: the scan's ASCII loop keeps its registers. */
#if defined(__GNUC__)
__attribute__((noinline))
#endif
static int next_unit(const fold_tables *t, const uint8_t *d, size_t n, size_t i, int eof,
                     size_t *end) {
    reader_t r = {d, n, 0};
    int b = d[i];
    int kind;
    size_t m;
    if (b == 0x1B) {
        *end = ansi(&r, i);
        kind = K_IGNORED;
    } else if (b == '[' && t->nmarkers && (m = marker(t, &r, i)) != 0) {
        *end = m;
        kind = K_BREAK;
    } else {
        int decoded = 0;
        uint32_t cp = 0;
        if (b == '%') {
            decoded = percent(&r, i, end, &cp);
            if (decoded && cp >= 0x80) cp = 0x110000; /* a decoded byte >= 0x80: IGNORED */
        } else if (b == '&') {
            decoded = entity(&r, i, end, &cp);
        } else if (b == '\\') {
            decoded = escape(&r, i, end, &cp);
        }
        if (!decoded) {
            int c = utf8(&r, i, end);
            kind = c == K_IGNORED ? K_IGNORED : fold_cp((uint32_t)c);
        } else {
            kind = fold_cp(cp);
        }
    }
    if (r.short_ && !eof) return K_NEED_MORE;
    return kind;
}

/* -- tables -------------------------------------------------------------------------------- */

void fold_tables_free(fold_tables *t) {
    if (!t) return;
    free(t->slots);
    free(t->bloom);
    free(t->grams);
    free(t->names);
    free(t->name_off);
    free(t->name_len);
    free(t->holds);
    free(t->markers);
    free(t->marker_off);
    free(t->marker_len);
    free(t);
}

size_t fold_tables_footprint(const fold_tables *t) { return t ? t->footprint : 0; }

static void window_key(const uint8_t *s, size_t len, uint64_t *lo, uint64_t *hi) {
    /* 6 bits per character, the first most significant: the low 64 bits in lo, the rest in
     * hi, the length in bits 32-39 of hi. */
    uint64_t l = 0, h = 0;
    for (size_t k = 0; k < len; k++) {
        h = ((h << 6) | (l >> 58)) & 0xFFFFFFFFull;
        l = (l << 6) | (uint64_t)code_of(s[k]);
    }
    *lo = l;
    *hi = h | ((uint64_t)len << 32);
}

/* The filter's gram at s: its GRAM (8) folded bytes as they are in the view, one load. */
static inline uint64_t gram_of(const uint8_t *s) {
    uint64_t g;
    memcpy(&g, s, sizeof g);
    return g;
}

/* The filter's hash of a gram: every output bit depends on all eight bytes (the word index
 * is taken from the top bits, the bits within the word from the bottom ones). */
static inline uint64_t probe_hash(uint64_t g) {
    uint64_t h = g * K1;
    h ^= h >> 29;
    h *= K2;
    return h ^ (h >> 32);
}

static inline uint64_t gram_hash(uint64_t g) {
    uint64_t h = (g + 0x2545F4914F6CDD1Dull) * K1;
    return h ^ (h >> 31);
}

/* Four bits in one word: one cache line per probe. With the filter's ~32 bits per gram (256
 * secrets) 2-5 probes in 10,000 pass on JSON and source code holding none of the secrets (with
 * three bits, up to 11); each costs the lookup of up to 9 windows per length. */
#define BIT1(n) (1ull << (n))
#define BIT4(n) BIT1(n), BIT1((n) + 1), BIT1((n) + 2), BIT1((n) + 3)
#define BIT16(n) BIT4(n), BIT4((n) + 4), BIT4((n) + 8), BIT4((n) + 12)
/* 1 << n from a table: a variable shift takes its count in cl on x86-64 without BMI2, and that
 * costs more instructions per bit than a load from these 512 bytes. */
static const uint64_t BIT[64] = {BIT16(0), BIT16(16), BIT16(32), BIT16(48)};
#undef BIT16
#undef BIT4
#undef BIT1
static inline uint64_t gram_bits(uint64_t h) {
    return BIT[h & 63] | BIT[(h >> 6) & 63] | BIT[(h >> 12) & 63] | BIT[(h >> 18) & 63];
}

static inline uint64_t hold_gram_of(const uint8_t *s) {
    uint64_t g = 0;
    for (int k = 0; k < HOLD_GRAM; k++) g = (g << 6) | (uint64_t)code_of(s[k]);
    return g;
}

/* Is the HOLD_GRAM-gram g, whose first slot is `slot`, one of a window's? Exact (the
 * reference's set). */
static int hold_gram_at(const fold_tables *t, uint64_t g, size_t slot) {
    for (;;) { /* ends: the set is at most half full */
        uint64_t e = t->holds[slot];
        if (e == 0) return 0;
        if (e == g) return 1;
        slot = (slot + 1) & t->holds_mask;
    }
}

int fold_tables_new(const char *pieces, size_t pieces_len, const int32_t *plen,
                    const int32_t *powner, size_t npieces, const char *names, size_t names_len,
                    const int32_t *name_len, size_t nnames, fold_tables **out) {
    *out = NULL;
    if (nnames == 0 || nnames >= MAX_OWNERS || npieces > (size_t)INT32_MAX) return FOLD_EINVAL;
    /* The windows: every W characters of a piece, or a piece of MIN_SHORT..W-1 whole. */
    size_t nwin = 0, total = 0;
    for (size_t i = 0; i < npieces; i++) {
        if (plen[i] < MIN_SHORT || (size_t)plen[i] > pieces_len - total || powner[i] < 0 ||
            (size_t)powner[i] >= nnames)
            return FOLD_EINVAL;
        total += (size_t)plen[i];
        nwin += plen[i] >= W ? (size_t)plen[i] - W + 1 : 1;
    }
    for (size_t k = 0; k < total; k++) {
        uint8_t c = (uint8_t)pieces[k];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z'))) return FOLD_EINVAL;
    }
    if (nwin > SIZE_MAX / 64) return FOLD_ETOOBIG;
    fold_tables *t = xcalloc(1, sizeof *t);
    if (!t) return FOLD_ENOMEM;
    int rc = FOLD_ENOMEM;
    t->names = xmalloc(names_len, 1);
    t->name_off = xmalloc(nnames, sizeof(size_t));
    t->name_len = xmalloc(nnames, sizeof(size_t));
    if (!t->names || !t->name_off || !t->name_len) goto fail;
    if (names_len) memcpy(t->names, names, names_len);
    size_t off = 0;
    for (size_t k = 0; k < nnames; k++) {
        if (name_len[k] <= 0 || name_len[k] > MAX_NAME || (size_t)name_len[k] > names_len - off) {
            rc = FOLD_EINVAL;
            goto fail;
        }
        t->name_off[k] = off;
        t->name_len[k] = (size_t)name_len[k];
        if (t->name_len[k] > t->max_name) t->max_name = t->name_len[k];
        off += (size_t)name_len[k];
    }
    size_t nslots = pow2_at_least(nwin * 2 + 16);
    t->mask = nslots - 1;
    t->slots = xmalloc(nslots, sizeof(went_t));
    size_t bloom_bits = pow2_at_least(nwin * 16 + 4096);
    t->bloom = xcalloc(bloom_bits / 64, sizeof(uint64_t));
    if (!t->slots || !t->bloom) goto fail;
    unsigned log2 = 0;
    while (((size_t)1 << log2) < bloom_bits) log2++;
    t->bloom_shift = 64 - log2;
    size_t hold_slots = pow2_at_least(total * 2 + 16);
    t->holds_mask = hold_slots - 1;
    t->holds = xcalloc(hold_slots, sizeof(uint64_t));
    if (!t->holds) goto fail;
    size_t gram_words = pow2_at_least(nwin / 2 + 64); /* about 32 bits per gram */
    t->grams = xcalloc(gram_words, sizeof(uint64_t));
    if (!t->grams) goto fail;
    log2 = 0;
    while (((size_t)1 << log2) < gram_words) log2++;
    t->grams_shift = 64 - log2;
    for (size_t k = 0; k < nslots; k++) t->slots[k].rest = EMPTY;
    int present[W + 1] = {0};
    off = 0;
    for (size_t i = 0; i < npieces; i++) {
        const uint8_t *piece = (const uint8_t *)pieces + off;
        size_t plength = (size_t)plen[i];
        off += plength;
        size_t len = plength >= W ? W : plength;
        present[len] = 1;
        for (size_t o = 0; o + GRAM <= plength; o++) {
            uint64_t h = probe_hash(gram_of(piece + o));
            t->grams[h >> t->grams_shift] |= gram_bits(h);
        }
        for (size_t o = 0; o + HOLD_GRAM <= plength; o++) {
            uint64_t g = hold_gram_of(piece + o);
            size_t slot = (size_t)gram_hash(g) & t->holds_mask;
            while (t->holds[slot] != 0 && t->holds[slot] != g) slot = (slot + 1) & t->holds_mask;
            t->holds[slot] = g;
        }
        for (size_t j = 0; j + len <= plength; j++) {
            uint64_t lo, hi;
            window_key(piece + j, len, &lo, &hi);
            uint64_t h = hash_of(lo, hi);
            t->bloom[(h >> t->bloom_shift) >> 6] |= 1ull << ((h >> t->bloom_shift) & 63);
            size_t slot = (size_t)h & t->mask;
            while (t->slots[slot].rest != EMPTY &&
                   !(t->slots[slot].lo == lo && (t->slots[slot].rest & 0xFFFFFFFFFFull) == hi))
                slot = (slot + 1) & t->mask; /* bounded: the table is at most half full */
            if (t->slots[slot].rest == EMPTY) { /* a duplicate keeps its first owner */
                t->slots[slot].lo = lo;
                t->slots[slot].rest = hi | ((uint64_t)powner[i] << 40);
            }
        }
    }
    for (int len = MIN_SHORT; len <= W; len++)
        if (present[len]) t->lengths[t->nlen++] = len;
    t->stride = t->nlen ? (size_t)(t->lengths[0] - GRAM + 1) : 1;
    for (uint32_t cp = 0; cp < 0x800; cp++) t->fold2[cp] = (int8_t)fold_cp(cp);
    t->nnames = nnames;
    t->footprint = sizeof *t + nslots * sizeof(went_t) + bloom_bits / 8 + gram_words * 8 +
                   hold_slots * 8 + names_len + nnames * 2 * sizeof(size_t);
    *out = t;
    return FOLD_OK;
fail:
    fold_tables_free(t);
    return rc;
}

int fold_tables_markers(fold_tables *t, const char *names, size_t names_len,
                        const int32_t *name_len, size_t n) {
    if (!t || t->markers || n > MAX_OWNERS) return FOLD_EINVAL;
    size_t off = 0;
    for (size_t k = 0; k < n; k++) {
        if (name_len[k] <= 0 || name_len[k] > MAX_NAME || (size_t)name_len[k] > names_len - off)
            return FOLD_EINVAL;
        for (size_t m = off; m < off + (size_t)name_len[k]; m++)
            if (!is_name_char((uint8_t)names[m])) return FOLD_EINVAL;
        off += (size_t)name_len[k];
    }
    uint8_t *blob = xmalloc(off, 1);
    size_t *offs = xmalloc(n, sizeof(size_t)), *lens = xmalloc(n, sizeof(size_t));
    if (!blob || !offs || !lens) {
        free(blob);
        free(offs);
        free(lens);
        return FOLD_ENOMEM;
    }
    off = 0;
    for (size_t k = 0; k < n; k++) {
        offs[k] = off;
        lens[k] = (size_t)name_len[k];
        for (size_t m = 0; m < lens[k]; m++) blob[off + m] = (uint8_t)lower((uint8_t)names[off + m]);
        off += lens[k];
    }
    t->markers = blob;
    t->marker_off = offs;
    t->marker_len = lens;
    t->nmarkers = n;
    t->footprint += off + n * 2 * sizeof(size_t);
    return FOLD_OK;
}

static inline int32_t lookup(const fold_tables *t, uint64_t lo, uint64_t hi) {
    uint64_t h = hash_of(lo, hi);
    uint64_t b = h >> t->bloom_shift;
    if (!((t->bloom[b >> 6] >> (b & 63)) & 1)) return -1;
    size_t slot = (size_t)h & t->mask;
    for (;;) { /* ends: the table always has empty slots */
        const went_t *e = &t->slots[slot];
        if (e->rest == EMPTY) return -1;
        if (e->lo == lo && (e->rest & 0xFFFFFFFFFFull) == hi) return (int32_t)(e->rest >> 40);
        slot = (slot + 1) & t->mask;
    }
}

/* -- streams and work areas ---------------------------------------------------------------- */

int fold_stream_new(const fold_tables *t, fold_stream **out) {
    *out = NULL;
    fold_stream *st = xcalloc(1, sizeof *st);
    if (!st) return FOLD_ENOMEM;
    st->t = t;
    atomic_init(&st->busy, 0);
    *out = st;
    return FOLD_OK;
}

void fold_stream_free(fold_stream *st) {
    if (!st) return;
    free(st->pend);
    free(st);
}

void fold_stream_reset(fold_stream *st) {
    if (atomic_exchange(&st->busy, 1)) return;
    st->pend_len = 0;
    st->flushed = 0;
    st->failed = 0;
    if (st->pend_cap > 4096) { /* a one-shot stream does not keep a large buffer */
        free(st->pend);
        st->pend = NULL;
        st->pend_cap = 0;
    }
    atomic_store(&st->busy, 0);
}

size_t fold_stream_pending(const fold_stream *st) { return st->pend_len; }

int fold_work_new(fold_work **out) {
    *out = xcalloc(1, sizeof **out);
    if (!*out) return FOLD_ENOMEM;
    atomic_init(&(*out)->busy, 0);
    return FOLD_OK;
}

void fold_work_free(fold_work *w) {
    if (!w) return;
    free(w->scratch);
    free(w->chars);
    free(w->rs);
    free(w->re);
    free(w->flags);
    free(w->spans);
    free(w->groups);
    free(w->out);
    free(w);
}

static int view_reserve(fold_work *w, size_t n) {
    if (n <= w->view_cap) return FOLD_OK;
    size_t cap = pow2_at_least(n);
    if (cap > SIZE_MAX / sizeof(uint32_t)) return FOLD_ETOOBIG;
    uint8_t *c = realloc(w->chars, cap);
    if (!c) return FOLD_ENOMEM;
    w->chars = c;
    uint8_t *f = realloc(w->flags, cap);
    if (!f) return FOLD_ENOMEM;
    w->flags = f;
    uint32_t **arrays[2] = {&w->rs, &w->re};
    for (int k = 0; k < 2; k++) {
        uint32_t *p = realloc(*arrays[k], cap * sizeof(uint32_t));
        if (!p) return FOLD_ENOMEM;
        *arrays[k] = p;
    }
    w->view_cap = cap;
    return FOLD_OK;
}

/* A BREAK before any of the folded characters [a, b)? */
static inline int break_in(const uint8_t *flags, size_t a, size_t b) {
    for (size_t j = a; j < b; j++)
        if (flags[j] & F_BREAK) return 1;
    return 0;
}

static inline size_t end_of(const uint32_t *rs, const uint32_t *re, const uint8_t *flags,
                            size_t k) {
    return (flags[k] & F_SLOW) ? re[k] : (size_t)rs[k] + 1;
}

static int cmp_span(const void *a, const void *b) {
    const span_t *x = a, *y = b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    if (x->idx != y->idx) return x->idx < y->idx ? -1 : 1;
    if (x->end != y->end) return x->end > y->end ? -1 : 1; /* longest first */
    return 0;
}

static int emit(fold_work *w, const uint8_t *p, size_t len) {
    int rc = grow((void **)&w->out, &w->out_cap, w->out_len + len, 1);
    if (rc) return rc;
    if (len) memcpy(w->out + w->out_len, p, len);
    w->out_len += len;
    return FOLD_OK;
}

static int emit_marker(fold_work *w, const fold_tables *t, int32_t idx) {
    static const uint8_t open[] = "[REDACTED:";
    int rc = emit(w, open, sizeof open - 1);
    if (!rc) rc = emit(w, t->names + t->name_off[idx], t->name_len[idx]);
    if (!rc) rc = emit(w, (const uint8_t *)"]", 1);
    return rc;
}

/* A decoded unit d[i:end] into the view: a folded character (kind >= 0) or an IGNORED one. */
static inline void put_unit(int kind, size_t i, size_t end, uint8_t *chars, uint32_t *rs,
                            uint32_t *re, uint8_t *flags, size_t *nc, uint32_t *broken,
                            uint32_t *gap_units, uint32_t *gap_bytes) {
    if (kind >= 0) {
        chars[*nc] = (uint8_t)kind;
        rs[*nc] = (uint32_t)i;
        re[*nc] = (uint32_t)end;
        flags[*nc] = (uint8_t)(F_SLOW | (*broken ? F_BREAK : 0));
        *broken = 0;
        *gap_units = *gap_bytes = 0;
        *nc += 1;
    } else {
        *gap_units += 1;
        *gap_bytes += (uint32_t)(end - i);
        if (*gap_units > MAX_GAP || *gap_bytes > GAP_BYTES) *broken = 1;
    }
}

/* scrub_fold.FoldStream._advance over d[0:n]: output appended to w->out, *consumed set to the
 * bytes that are final (the rest stays pending). `direct`: when nothing was output before and
 * the output is d[0:upto] unchanged, it is left in d (w->direct), not copied; d must then stay
 * as it is until the caller has read the output. */
static int advance(const fold_tables *t, fold_work *w, const uint8_t *d, size_t n, int eof,
                   int direct, size_t *consumed) {
    if (n >= UINT32_MAX) return FOLD_ETOOBIG;
    /* + 32: the block loop writes whole blocks past the last character it keeps */
    int rc = view_reserve(w, n + 33);
    if (rc) return rc;
    uint8_t *restrict chars = w->chars;
    uint32_t *restrict rs = w->rs;
    uint32_t *restrict re = w->re;
    uint8_t *restrict flags = w->flags;
    size_t nc = 0, nspans = 0, i = 0;
    uint32_t gap_units = 0, gap_bytes = 0;
    uint32_t broken = 1;
    /* Pass 1: the view (scrub_fold.view). A stretch of plain bytes (ASCII but `%`, `&`, `\\`,
     * ESC; the bytes >= 0x80 that cannot start a UTF-8 character) is one unit per byte, so the gap before a folded character there is the
     * distance to the previous one: the stretch is read by a loop that only writes each byte's
     * folded character and offset to the next slot (a folded one advances; no branch on the
     * text, whose letter/punctuation boundaries would each be a misprediction), then a second
     * loop over the characters it found sets their ends and runs. The decoder, for the rest,
     * is called out of line. With AVX2, plain_avx2 takes the stretch 32 bytes at a time and
     * this loop only its last bytes, or the one `[` the blocks stop at. */
#if defined(FOLD_AVX2)
    const int simd = fold_simd();
#else
    const int simd = 0;
#endif
    for (;;) {
#if defined(FOLD_AVX2)
        if (simd) {
            gap_t g = {gap_units, gap_bytes, broken};
            i = plain_avx2(d, n, i, chars, rs, flags, &nc, &g);
            gap_units = g.gap_units;
            gap_bytes = g.gap_bytes;
            broken = g.broken;
        }
#endif
        /* With the blocks, at a byte that is not plain (32 or more left): that byte alone. */
        const size_t lim = simd && n - i >= 32 ? i + 1 : n;
        size_t stretch = i;
        uint32_t k = (uint32_t)nc;
        while (i < lim) {
            uint32_t c = ASCII_CLASS[d[i]];
            if (c - A_SLOW <= A_BRACKET - A_SLOW) { /* rare: the decoder, or a plain `[` */
                /* A `[` that cannot open a marker is one IGNORED byte (what the decoder says
                 * after reading the byte after it; at the end of the input it may need more). */
                if (c == A_SLOW || (t->nmarkers && (i + 1 >= n || d[i + 1] == 'R'))) break;
                c = A_IGNORED;
            }
            chars[k] = (uint8_t)c;
            rs[k] = (uint32_t)i;
            k += c > A_BRACKET;
            i++;
        }
        if (k > nc) {
            /* The first character's gap continues the one before the stretch. */
            uint32_t before = rs[nc] - (uint32_t)stretch;
            flags[nc] = (broken || gap_units + before > MAX_GAP || gap_bytes + before > GAP_BYTES)
                            ? F_BREAK
                            : 0;
            for (uint32_t m = (uint32_t)nc + 1; m < k; m++) /* ignored bytes between (8 < 64) */
                flags[m] = rs[m] - rs[m - 1] - 1 > MAX_GAP ? F_BREAK : 0;
            uint32_t after = (uint32_t)i - (rs[k - 1] + 1);
            gap_units = gap_bytes = after;
            broken = after > MAX_GAP;
        } else {
            uint32_t len = (uint32_t)(i - stretch);
            gap_units += len;
            gap_bytes += len;
            broken |= gap_units > MAX_GAP || gap_bytes > GAP_BYTES;
        }
        nc = k;
        if (i >= n) break;
        if (i == lim) continue; /* a plain `[`: back to the blocks */
        size_t end;
        int kind;
        /* Whole, valid two- or three-byte UTF-8 characters (non-ASCII prose): what utf8()
         * decides, without the call, and one after the other (not back to the blocks, which
         * would stop at each); anything else (a character cut by the end, an invalid sequence,
         * an escape) is the decoder's. */
        const size_t run_from = i;
        while (i < n) {
            const uint32_t b0 = d[i];
            if (b0 - 0xC2 <= 0xDF - 0xC2 && n - i >= 2 && (uint8_t)(d[i + 1] - 0x80) < 0x40) {
                kind = t->fold2[(b0 & 0x1F) << 6 | (d[i + 1] & 0x3F)];
                end = i + 2;
            } else if (b0 - 0xE0 <= 0xEF - 0xE0 && n - i >= 3 &&
                       d[i + 1] >= (b0 == 0xE0 ? 0xA0 : 0x80) &&
                       d[i + 1] <= (b0 == 0xED ? 0x9F : 0xBF) && (uint8_t)(d[i + 2] - 0x80) < 0x40) {
                kind = fold_cp((b0 & 0x0F) << 12 | (uint32_t)(d[i + 1] & 0x3F) << 6 |
                               (d[i + 2] & 0x3F));
                end = i + 3;
            } else {
                break;
            }
            put_unit(kind, i, end, chars, rs, re, flags, &nc, &broken, &gap_units, &gap_bytes);
            i = end;
        }
        if (i != run_from) continue;
        kind = next_unit(t, d, n, i, eof, &end);
        if (kind == K_NEED_MORE) break;
        if (kind == K_BREAK)
            broken = 1;
        else
            put_unit(kind, i, end, chars, rs, re, flags, &nc, &broken, &gap_units, &gap_bytes);
        i = end;
    }
    /* Where the hold of a stream may begin: max(the start of the last run, nc - (W - 1)) (the
     * first character starts a run). The exact set of grams the cut reads from there is far
     * larger than a cache: its slots are fetched now, to arrive during pass 2. */
    size_t hold_from = nc;
    /* The grams at hold_from + q (q < nhold) and their first slots, kept for the cut: at most
     * W - HOLD_GRAM of them, each made and hashed once (a gram from the one before it). */
    uint64_t hold_g[W];
    size_t hold_slot[W];
    size_t nhold = 0;
    if (!eof && !broken) {
        size_t low = nc >= W ? nc - (W - 1) : 0;
        hold_from = low;
        for (size_t j = nc; j-- > low;) {
            if (flags[j] & F_BREAK) {
                hold_from = j;
                break;
            }
        }
        if (hold_from + HOLD_GRAM <= nc) {
            const uint64_t all = ((uint64_t)1 << (6 * HOLD_GRAM)) - 1;
            uint64_t g = hold_gram_of(chars + hold_from) >> 6;
            for (size_t j = hold_from; j + HOLD_GRAM <= nc; j++) {
                g = ((g << 6) | (uint64_t)code_of(chars[j + HOLD_GRAM - 1])) & all;
                size_t slot = (size_t)gram_hash(g) & t->holds_mask;
                hold_g[nhold] = g;
                hold_slot[nhold++] = slot;
                PREFETCH(&t->holds[slot]);
            }
        }
    }
    /* Pass 2: the windows, probed every `stride` positions (see the top of this file). The
     * filter is larger than a core's L2 with hundreds of secrets, so nearly every probe misses
     * the cache: the hashes of a batch of PROBE_BATCH probes are computed and their words
     * prefetched one batch ahead of the tests, which keeps that many misses in flight. A batch
     * is tested without a branch per probe (its passes collected in a mask: a pass is rare,
     * 2-5 in 10,000), and only the probes that pass are checked for a BREAK inside their gram
     * and go on to the windows, in order. */
    size_t next_p[W + 1] = {0};
    const size_t stride = t->stride;
    const uint64_t *grams = t->grams;
    const unsigned gshift = t->grams_shift;
    const size_t nprobe = nc >= GRAM ? (nc - GRAM) / stride + 1 : 0;
    _Static_assert(PROBE_BATCH <= 32, "a batch's passes fit a 32-bit mask");
    uint64_t hbuf[2][PROBE_BATCH];
    for (size_t j = 0; j < nprobe && j < PROBE_BATCH; j++) {
        hbuf[0][j] = probe_hash(gram_of(chars + j * stride));
        PREFETCH(&grams[hbuf[0][j] >> gshift]);
    }
    for (size_t b0 = 0, half = 0; b0 < nprobe; b0 += PROBE_BATCH, half ^= 1) {
        const uint64_t *cur = hbuf[half];
        uint64_t *next = hbuf[half ^ 1];
        const size_t bend = nprobe - b0 < PROBE_BATCH ? nprobe : b0 + PROBE_BATCH;
        const size_t nend = nprobe - bend < PROBE_BATCH ? nprobe : bend + PROBE_BATCH;
        for (size_t q = bend; q < nend; q++) { /* the next batch's words, fetched now */
            next[q - bend] = probe_hash(gram_of(chars + q * stride));
            PREFETCH(&grams[next[q - bend] >> gshift]);
        }
        uint32_t pass = 0;
        for (size_t q = 0; q < bend - b0; q++) {
            const uint64_t h = cur[q], bits = gram_bits(h);
            pass |= (uint32_t)((grams[h >> gshift] & bits) == bits) << q;
        }
        for (; pass; pass &= pass - 1) {
            const size_t k = (b0 + (size_t)__builtin_ctz(pass)) * stride;
            if (break_in_gram(flags + k)) continue; /* a BREAK inside the gram */
            for (int m = 0; m < t->nlen; m++) {
                size_t len = (size_t)t->lengths[m];
                size_t p = k > len - GRAM ? k - (len - GRAM) : 0;
                if (p < next_p[len]) p = next_p[len];
                for (; p <= k && p + len <= nc; p++) {
                    if (break_in(flags, p + 1, p + len)) continue;
                    uint64_t lo, khi;
                    window_key(chars + p, len, &lo, &khi);
                    int32_t idx = lookup(t, lo, khi);
                    if (idx < 0) continue;
                    rc = grow((void **)&w->spans, &w->spans_cap, nspans + 1, sizeof(span_t));
                    if (rc) return rc;
                    w->spans[nspans].start = (uint32_t)p;
                    w->spans[nspans].end = (uint32_t)(p + len);
                    w->spans[nspans].idx = idx;
                    nspans++;
                }
                next_p[len] = k + 1;
            }
        }
    }
    size_t parsed = i;
    int end_break = broken;
    span_t *spans = w->spans;
    if (t->nlen > 1 && nspans > 1) qsort(spans, nspans, sizeof(span_t), cmp_span);
    /* The groups (scrub_fold.groups). */
    size_t ng = 0;
    for (size_t k = 0; k < nspans; k++) {
        uint32_t start = spans[k].start, send = spans[k].end;
        if (ng && start < w->groups[ng - 1].end) {
            group_t *g = &w->groups[ng - 1];
            if (g->full || send <= g->end) continue;
            if (send - g->start > GROUP_CAP) {
                g->full = 1;
                continue;
            }
            g->end = send;
            continue;
        }
        rc = grow((void **)&w->groups, &w->groups_cap, ng + 1, sizeof(group_t));
        if (rc) return rc;
        w->groups[ng].start = start;
        w->groups[ng].end = send;
        w->groups[ng].idx = spans[k].idx;
        w->groups[ng].full = 0;
        ng++;
    }
    /* The cut (FoldStream._advance). */
    size_t cut, upto;
    if (eof || end_break) {
        cut = nc;
        upto = parsed;
    } else {
        cut = hold_from;
        /* Released up to the first that could begin a window (scrub_fold: the hold). */
        while (cut + HOLD_GRAM <= nc &&
               !hold_gram_at(t, hold_g[cut - hold_from], hold_slot[cut - hold_from]))
            cut++;
        for (size_t k = 0; k < ng; k++) {
            if (w->groups[k].end > cut) {
                if (w->groups[k].start < cut) cut = w->groups[k].start;
                break;
            }
        }
        upto = rs[cut];
    }
    if (eof) upto = n;
    /* Render: d[0:upto], each group that starts before the cut as its marker. Most calls have
     * none: their output is d[0:upto] itself (a copy of a whole feed saved). */
    if (direct && w->out_len == 0 &&
        (ng == 0 || w->groups[0].start >= cut || rs[w->groups[0].start] >= upto)) {
        w->direct = d;
        w->direct_len = upto;
        *consumed = upto;
        return FOLD_OK;
    }
    size_t pos = 0;
    for (size_t k = 0; k < ng && w->groups[k].start < cut; k++) {
        size_t a = rs[w->groups[k].start], b = end_of(rs, re, flags, w->groups[k].end - 1);
        if (a >= upto) break;
        rc = emit(w, d + pos, a - pos);
        if (!rc) rc = emit_marker(w, t, w->groups[k].idx);
        if (rc) return rc;
        pos = b;
    }
    if (upto > pos) {
        rc = emit(w, d + pos, upto - pos);
        if (rc) return rc;
    }
    *consumed = upto;
    return FOLD_OK;
}

/* Copies the bytes [off, off + take) of the concatenation a[0:na] + b to dst. */
static void gather(uint8_t *dst, const uint8_t *a, size_t na, const uint8_t *b, size_t off,
                   size_t take) {
    if (off < na) {
        size_t from_a = na - off < take ? na - off : take;
        memcpy(dst, a + off, from_a);
        dst += from_a;
        take -= from_a;
        off = na;
    }
    if (take) memcpy(dst, b + (off - na), take);
}

int fold_feed(fold_stream *st, fold_work *w, const char *in, size_t len, int eof, const char **out,
              size_t *out_len) {
    return fold_feed2(st, w, in, len, NULL, 0, eof, out, out_len);
}

int fold_feed2(fold_stream *st, fold_work *w, const char *in_a, size_t len_a, const char *in_b,
               size_t len_b, int eof, const char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    /* Acquire and release: a lock's ordering, and on x86 the releases are plain stores (a
     * sequentially consistent store is a locked exchange, which a 1 KiB feed notices). */
    if (atomic_exchange_explicit(&st->busy, 1, memory_order_acquire)) return FOLD_EBUSY;
    if (atomic_exchange_explicit(&w->busy, 1, memory_order_acquire)) {
        atomic_store_explicit(&st->busy, 0, memory_order_release);
        return FOLD_EBUSY;
    }
    int rc = FOLD_OK;
    if (st->failed) {
        rc = FOLD_EFAILED;
        goto done;
    }
    if (st->flushed) {
        rc = FOLD_EFLUSHED;
        goto done;
    }
    w->out_len = 0;
    w->direct = NULL;
    /* A large output buffer is not kept for small calls (one big response would otherwise pin
     * its size in every thread that scrubbed it). */
    if (len_b > SIZE_MAX - len_a) {
        rc = FOLD_ETOOBIG;
        goto done;
    }
    const size_t len = len_a + len_b;
    if (w->out_cap > ((size_t)1 << 20) && w->out_cap / 4 > len + st->pend_len) {
        free(w->out);
        w->out = NULL;
        w->out_cap = 0;
    }
    /* No arithmetic on a null pointer (cffi passes NULL for b""). */
    static const uint8_t empty[1] = {0};
    const uint8_t *a = in_a ? (const uint8_t *)in_a : empty;
    const uint8_t *b = in_b ? (const uint8_t *)in_b : empty;
    size_t off = 0;
    do {
        size_t take = len - off < PIECE ? len - off : PIECE;
        int last = off + take == len;
        const uint8_t *data;
        size_t n;
        if (st->pend_len == 0 && off + take <= len_a) {
            data = a + off;
            n = take;
        } else if (st->pend_len == 0 && off >= len_a) {
            data = b + (off - len_a);
            n = take;
        } else { /* the pending tail, or a piece of both parts: one contiguous copy */
            n = st->pend_len + take;
            rc = grow((void **)&w->scratch, &w->scratch_cap, n, 1);
            if (rc) break;
            memcpy(w->scratch, st->pend, st->pend_len);
            gather(w->scratch + st->pend_len, a, len_a, b, off, take);
            data = w->scratch;
        }
        size_t consumed = 0;
        /* Only the last piece's output may stay where it is: the next piece's overwrites
         * the scratch buffer. */
        rc = advance(st->t, w, data, n, eof && last, last, &consumed);
        if (rc) break;
        size_t keep = n - consumed;
        rc = grow((void **)&st->pend, &st->pend_cap, keep, 1);
        if (rc) break;
        if (keep) memmove(st->pend, data + consumed, keep);
        st->pend_len = keep;
        off += take;
    } while (off < len);
    if (rc) {
        st->failed = 1;
        goto done;
    }
    if (eof) st->flushed = 1;
    if (w->direct) {
        *out = (const char *)w->direct;
        *out_len = w->direct_len;
    } else {
        *out = (const char *)w->out;
        *out_len = w->out_len;
    }
done:
    atomic_store_explicit(&w->busy, 0, memory_order_release);
    atomic_store_explicit(&st->busy, 0, memory_order_release);
    return rc;
}
