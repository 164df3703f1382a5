/* headscan: the accept path of proxycore.protocol.http1's head parser, in C.
 *
 * The Python parser (proxycore/protocol/http1.py) is the reference. apx_scan_head either accepts
 * a head exactly as the reference would, filling in the facts the reference computes, or returns
 * APX_DEFER, and the reference decides (incomplete heads, refusals, anything unusual). So this
 * code never has to reproduce an error message, only the common case, and the differential tests
 * (tests/test_native_headscan.py, fuzz/fuzz_native_headscan.py) hold it to one invariant: when it
 * accepts, the reference accepts with the same reading.
 */
#ifndef APX_HEADSCAN_H
#define APX_HEADSCAN_H

#include <stddef.h>
#include <stdint.h>

#define APX_ACCEPT 1
#define APX_DEFER 0

/* Field names the scanner knows, as bits of a drop mask for apx_relay_fields. */
#define APX_F_CONNECTION (1u << 0)
#define APX_F_KEEP_ALIVE (1u << 1)
#define APX_F_PROXY_AUTHENTICATE (1u << 2)
#define APX_F_PROXY_AUTHORIZATION (1u << 3)
#define APX_F_PROXY_CONNECTION (1u << 4)
#define APX_F_TE (1u << 5)
#define APX_F_TRAILER (1u << 6)
#define APX_F_TRAILERS (1u << 7)
#define APX_F_TRANSFER_ENCODING (1u << 8)
#define APX_F_UPGRADE (1u << 9)
#define APX_F_HOST (1u << 10)
#define APX_F_CONTENT_LENGTH (1u << 11)
#define APX_F_EXPECT (1u << 12)
#define APX_F_ACCEPT_ENCODING (1u << 13)
#define APX_F_CONTENT_ENCODING (1u << 14)
/* Not a name: drop every field whose name holds an underscore. A back end that maps "_" to "-"
 * (CGI-style environments) would read "Transfer_Encoding" as a second framing field; nginx
 * (underscores_in_headers off) and Envoy (headers_with_underscores_action) drop or refuse them. */
#define APX_DROP_UNDERSCORE (1u << 31)

/* What apx_scan_head writes to out[] for an accepted head. One flat array rather than a struct:
 * the Python side reads it back with a single ffi.unpack. */
enum {
    APX_OUT_HEAD_LEN,       /* offset of the CRLF CRLF that ends the head (bytes used: + 4) */
    APX_OUT_START_LEN,      /* length of the start line, without its CRLF */
    APX_OUT_TOKEN_END,      /* request: end of the method (the target starts one byte later) */
    APX_OUT_TARGET_END,     /* request: end of the target */
    APX_OUT_CONTENT_LENGTH, /* -1 when absent */
    APX_OUT_STATUS,         /* response: the status code */
    APX_OUT_MINOR,          /* HTTP/1.<minor>: 0 or 1 */
    APX_OUT_FLAGS,          /* APX_FLAG_* */
    APX_OUT_SIZE
};

#define APX_FLAG_CHUNKED 1         /* Transfer-Encoding: chunked */
#define APX_FLAG_CLOSE 2           /* a Connection field says close */
#define APX_FLAG_EXPECT_CONTINUE 4 /* Expect: 100-continue */
#define APX_FLAG_NOMINATES 8       /* Connection names a field beyond close/keep-alive/hop-by-hop */

int apx_scan_head(const char *buf, size_t len, int is_request, size_t max_line, size_t max_count,
                  size_t max_bytes, int64_t out[APX_OUT_SIZE]);

/* Copy the field lines of an accepted head, each with its leading CRLF, minus those whose name
 * is in drop_mask (and, with APX_DROP_UNDERSCORE, those whose name holds "_"), to out (which must hold head_len - start_len bytes). Returns the length
 * written, or -1 if cap is too small or the bytes are not an accepted head. */
long apx_relay_fields(const char *buf, size_t start_len, size_t head_len, uint32_t drop_mask,
                      char *out, size_t cap);

#endif
