/* headscan: see headscan.h. Every loop is bounded by the head length; nothing is allocated. */
#include "headscan.h"

#include <string.h>

/* tchar (RFC 9110 5.6.2). */
static const uint8_t TCHAR[256] = {
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 0,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0,
    0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 1, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
};

/* field-value and reason-phrase bytes: HTAB, SP, VCHAR, obs-text (RFC 9110 5.5, RFC 9112 4). */
static inline int value_char(uint8_t c) { return c == '\t' || (c >= 0x20 && c != 0x7f); }

/* request-target bytes: visible ASCII. */
static inline int target_char(uint8_t c) { return c >= 0x21 && c <= 0x7e; }

static inline uint8_t lower(uint8_t c) { return (c >= 'A' && c <= 'Z') ? (uint8_t)(c + 32) : c; }

/* Case-insensitive compare of buf[0:n] with a lowercase literal. */
static int ieq(const uint8_t *buf, size_t n, const char *lit) {
    size_t m = strlen(lit);
    if (n != m) return 0;
    for (size_t i = 0; i < n; i++) {
        if (lower(buf[i]) != (uint8_t)lit[i]) return 0;
    }
    return 1;
}

static const struct {
    const char *name;
    uint32_t bit;
} KNOWN[] = {
    {"connection", APX_F_CONNECTION},
    {"keep-alive", APX_F_KEEP_ALIVE},
    {"proxy-authenticate", APX_F_PROXY_AUTHENTICATE},
    {"proxy-authorization", APX_F_PROXY_AUTHORIZATION},
    {"proxy-connection", APX_F_PROXY_CONNECTION},
    {"te", APX_F_TE},
    {"trailer", APX_F_TRAILER},
    {"trailers", APX_F_TRAILERS},
    {"transfer-encoding", APX_F_TRANSFER_ENCODING},
    {"upgrade", APX_F_UPGRADE},
    {"host", APX_F_HOST},
    {"content-length", APX_F_CONTENT_LENGTH},
    {"expect", APX_F_EXPECT},
    /* Replaced by the proxy so that response bodies arrive as the scrubber can read them. */
    {"accept-encoding", APX_F_ACCEPT_ENCODING},
    {"content-encoding", APX_F_CONTENT_ENCODING},
};
#define HOP_BY_HOP_MASK 0x3ffu /* the first ten: proxycore.protocol.http1.HOP_BY_HOP */

static uint32_t classify(const uint8_t *name, size_t n) {
    /* The shortest known name is 2 bytes, the longest 19. */
    if (n < 2 || n > 19) return 0;
    for (size_t i = 0; i < sizeof KNOWN / sizeof KNOWN[0]; i++) {
        if (ieq(name, n, KNOWN[i].name)) return KNOWN[i].bit;
    }
    return 0;
}

/* Each comma-separated member of value[0:n], OWS stripped, empties skipped (RFC 9110 5.6.1). */
typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} token_iter;

static int next_token(token_iter *it, const uint8_t **tok, size_t *tok_len) {
    while (it->p < it->end) {
        const uint8_t *start = it->p;
        const uint8_t *comma = memchr(start, ',', (size_t)(it->end - start));
        const uint8_t *stop = comma ? comma : it->end;
        it->p = comma ? comma + 1 : it->end;
        while (start < stop && (*start == ' ' || *start == '\t')) start++;
        while (stop > start && (stop[-1] == ' ' || stop[-1] == '\t')) stop--;
        if (stop > start) {
            *tok = start;
            *tok_len = (size_t)(stop - start);
            return 1;
        }
    }
    return 0;
}

/* First CRLF CRLF lying wholly inside buf[0:n], or NULL. */
static const uint8_t *find_head_end(const uint8_t *buf, size_t n) {
    if (n < 4) return NULL;
    const uint8_t *p = buf;
    const uint8_t *last = buf + n - 4;
    while (p <= last) {
        p = memchr(p, '\r', (size_t)(last - p) + 1);
        if (!p) return NULL;
        if (p[1] == '\n' && p[2] == '\r' && p[3] == '\n') return p;
        p++;
    }
    return NULL;
}

/* The scan proper; the public entry point below flattens its result. */
typedef struct {
    size_t token_end;
    size_t target_end;
    size_t start_len;
    int64_t content_length;
    uint32_t host_count;
    int status;
    uint8_t minor;
    uint8_t chunked;
    uint8_t close;
    uint8_t expect_continue;
    uint8_t nominates;
} facts;

static int scan(const uint8_t *buf, size_t len, int is_request, size_t max_line, size_t max_count,
                size_t max_bytes, facts *out, size_t *head_len) {
    memset(out, 0, sizeof *out);
    out->content_length = -1;
    const uint8_t *end = find_head_end(buf, len < max_bytes ? len : max_bytes);
    if (!end) return APX_DEFER; /* incomplete (or over the size limit): the reference judges */
    size_t idx = (size_t)(end - buf);
    /* From here on buf[idx .. idx + 3] is CR LF CR LF: every scan below stops at idx at the
     * latest, because CR is neither a tchar, nor a target byte, nor a value byte. */
    size_t p = 0;
    if (is_request) {
        while (TCHAR[buf[p]]) p++;
        if (p == 0 || buf[p] != ' ') return APX_DEFER;
        out->token_end = p++;
        size_t target_start = p;
        while (target_char(buf[p])) p++;
        if (p == target_start || buf[p] != ' ') return APX_DEFER;
        out->target_end = p++;
        if (idx - p < 8 || memcmp(buf + p, "HTTP/1.", 7) != 0) return APX_DEFER;
        if (buf[p + 7] != '0' && buf[p + 7] != '1') return APX_DEFER;
        out->minor = (uint8_t)(buf[p + 7] - '0');
        p += 8;
    } else {
        if (idx < 12 || memcmp(buf, "HTTP/1.", 7) != 0) return APX_DEFER;
        if (buf[7] != '0' && buf[7] != '1') return APX_DEFER;
        out->minor = (uint8_t)(buf[7] - '0');
        if (buf[8] != ' ') return APX_DEFER;
        int status = 0;
        for (p = 9; p < 12; p++) {
            if (buf[p] < '0' || buf[p] > '9') return APX_DEFER;
            status = status * 10 + (buf[p] - '0');
        }
        if (status < 100 || status > 599) return APX_DEFER;
        out->status = status;
        if (buf[p] == ' ') {
            p++;
            while (value_char(buf[p])) p++;
        }
    }
    if (buf[p] != '\r' || buf[p + 1] != '\n') return APX_DEFER;
    if (p > max_line) return APX_DEFER;
    out->start_len = p;
    p += 2;

    size_t count = 0;
    while (p < idx + 2) {
        size_t name_start = p;
        while (TCHAR[buf[p]]) p++;
        if (p == name_start || buf[p] != ':') return APX_DEFER;
        size_t name_len = p - name_start;
        p++;
        size_t value_start = p;
        while (value_char(buf[p])) p++;
        if (buf[p] != '\r' || buf[p + 1] != '\n') return APX_DEFER;
        size_t value_end = p;
        p += 2;
        if (++count > max_count) return APX_DEFER;

        uint32_t bit = classify(buf + name_start, name_len);
        if (!(bit & (APX_F_HOST | APX_F_CONNECTION | APX_F_CONTENT_LENGTH |
                     APX_F_TRANSFER_ENCODING | APX_F_EXPECT))) {
            continue;
        }
        /* The value without surrounding OWS (RFC 9112 5). */
        while (value_start < value_end && (buf[value_start] == ' ' || buf[value_start] == '\t'))
            value_start++;
        while (value_end > value_start && (buf[value_end - 1] == ' ' || buf[value_end - 1] == '\t'))
            value_end--;
        const uint8_t *value = buf + value_start;
        size_t value_len = value_end - value_start;
        token_iter it = {value, value + value_len};
        const uint8_t *tok;
        size_t tok_len;
        switch (bit) {
        case APX_F_HOST:
            out->host_count++;
            break;
        case APX_F_CONNECTION:
            while (next_token(&it, &tok, &tok_len)) {
                if (ieq(tok, tok_len, "close")) {
                    out->close = 1;
                } else if (!ieq(tok, tok_len, "keep-alive") &&
                           !(classify(tok, tok_len) & HOP_BY_HOP_MASK)) {
                    out->nominates = 1;
                }
            }
            break;
        case APX_F_CONTENT_LENGTH: {
            /* One field, 1 to 19 digits, below 2**63 (RFC 9110 8.6, RFC 9112 6.3). */
            if (out->content_length >= 0 || value_len == 0 || value_len > 19) return APX_DEFER;
            uint64_t n = 0;
            for (size_t i = 0; i < value_len; i++) {
                if (value[i] < '0' || value[i] > '9') return APX_DEFER;
                n = n * 10 + (uint64_t)(value[i] - '0'); /* < 10**19 < 2**64: no overflow */
            }
            if (n > (uint64_t)INT64_MAX) return APX_DEFER;
            out->content_length = (int64_t)n;
            break;
        }
        case APX_F_TRANSFER_ENCODING:
            if (out->chunked || !ieq(value, value_len, "chunked")) return APX_DEFER;
            out->chunked = 1;
            break;
        case APX_F_EXPECT:
            while (next_token(&it, &tok, &tok_len)) {
                if (ieq(tok, tok_len, "100-continue")) out->expect_continue = 1;
            }
            break;
        default:
            break;
        }
    }
    if (out->chunked && (out->minor == 0 || out->content_length >= 0)) return APX_DEFER;
    if (is_request && out->host_count != 1 && (out->host_count > 1 || out->minor == 1))
        return APX_DEFER;
    *head_len = idx;
    return APX_ACCEPT;
}

int apx_scan_head(const char *buf, size_t len, int is_request, size_t max_line, size_t max_count,
                  size_t max_bytes, int64_t out[APX_OUT_SIZE]) {
    facts f;
    size_t head_len = 0;
    if (scan((const uint8_t *)buf, len, is_request, max_line, max_count, max_bytes, &f,
             &head_len) != APX_ACCEPT)
        return APX_DEFER;
    out[APX_OUT_HEAD_LEN] = (int64_t)head_len;
    out[APX_OUT_START_LEN] = (int64_t)f.start_len;
    out[APX_OUT_TOKEN_END] = (int64_t)f.token_end;
    out[APX_OUT_TARGET_END] = (int64_t)f.target_end;
    out[APX_OUT_CONTENT_LENGTH] = f.content_length;
    out[APX_OUT_STATUS] = f.status;
    out[APX_OUT_MINOR] = f.minor;
    out[APX_OUT_FLAGS] = (f.chunked ? APX_FLAG_CHUNKED : 0) | (f.close ? APX_FLAG_CLOSE : 0) |
                         (f.expect_continue ? APX_FLAG_EXPECT_CONTINUE : 0) |
                         (f.nominates ? APX_FLAG_NOMINATES : 0);
    return APX_ACCEPT;
}

long apx_relay_fields(const char *cbuf, size_t start_len, size_t head_len, uint32_t drop_mask,
                      char *out, size_t cap) {
    const uint8_t *buf = (const uint8_t *)cbuf;
    if (head_len < start_len || cap < head_len - start_len) return -1;
    size_t written = 0;
    size_t p = start_len; /* at the CRLF before the first field line */
    while (p < head_len) {
        size_t line_start = p; /* the CRLF that leads this line */
        size_t name_start = p + 2;
        const uint8_t *colon = memchr(buf + name_start, ':', head_len - name_start);
        if (!colon) return -1; /* not an accepted head */
        const uint8_t *eol = memchr(colon, '\r', head_len + 2 - (size_t)(colon - buf));
        size_t line_end = eol ? (size_t)(eol - buf) : head_len;
        size_t name_len = (size_t)(colon - buf) - name_start;
        int drop = (classify(buf + name_start, name_len) & drop_mask) != 0;
        if (!drop && (drop_mask & APX_DROP_UNDERSCORE))
            drop = memchr(buf + name_start, '_', name_len) != NULL;
        if (!drop) {
            memcpy(out + written, buf + line_start, line_end - line_start);
            written += line_end - line_start;
        }
        p = line_end;
    }
    return (long)written;
}
