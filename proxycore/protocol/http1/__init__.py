"""Strict sans-IO HTTP/1.1 head parser, body decoder and serializer (the proxy's hot path).

Theory of operation
-------------------
A message head is parsed from the caller's receive buffer in one call, statelessly:
``parse_request_head(buf)`` returns ``None`` while the head is incomplete, the parsed head and the
number of bytes it used once ``buf`` holds the blank line that ends it, or raises
`HttpProtocolError`. The body that follows is decoded by a `BodyReader`, a small state machine
fed with whatever bytes arrive; bytes beyond the end of the message are kept as leftover for the
next (pipelined) message.

Strictness is the point. This parser sits in front of other HTTP implementations (the upstream
server, the agent's client), and request smuggling happens when two parsers read the same bytes
differently. So every input this module is unsure about is *refused*, never repaired and never
handed to a second parser: bare LF or CR, obs-fold, duplicate or conflicting framing headers,
transfer codings other than a single ``chunked``. What RFC 9112 asks a recipient to accept and
is safe to accept is accepted within bounds, and never forwarded: empty lines before a request
line (2.2, skipped), chunk extensions (7.1.1, parsed by their grammar, ignored), trailer fields
(7.1.2, parsed as field lines, dropped). The differential fuzzer
(``fuzz/fuzz_http1_differential.py``) holds the parser to one invariant against h11 as an
oracle: for every input we either refuse, or read exactly what h11 reads (h11 refuses leading
empty lines; the oracle reads the bytes after them). docs/proxy.md lists where we are stricter
than RFC 9112, and why.

Speed comes from doing the common case in C: the scanner in native/src/headscan.c reads a
common head in one pass; the Python reference that defines the behaviour does one ``bytes.find``
for the end of the head and one precompiled regex ``fullmatch`` that validates the whole head at
once. Only when that fast check fails does `diagnose.walk_head` go through the head line by line
to find the first offending byte and say what is wrong with it (the slow path runs only on
refusals).

Refusals do not depend on how the input was segmented. An incomplete head is judged only at
points that every segmentation reaches with the same bytes (the first byte, the end of the start
line, the start-line limit, an "LF LF", the head-size limit), and at each of them `walk_head`
reports the error that comes first in stream order; so the same bytes get the same verdict and
the same status_hint, whether they arrived at once or one by one. The price: an error inside the
field section of a head still arriving (a bare CR, a bad name) is reported when the head ends or
hits its size limit, not at the offending byte. ``fuzz/fuzz_http1_chunking.py`` checks all this.
All scans of an incomplete head are bounded finds, so a peer trickling bytes cannot make the
parser spend quadratic Python time.

A `BodyReader` decodes one body: Content-Length (count down), chunked (a state machine over the
chunk line, the data, the CRLF after data, the trailer section) or until-close; it returns
decoded bytes as soon as they arrive and refuses bad framing at a point that does not depend on
the segmentation either (see `body`).

Status hints: request-side refusals carry the status to answer the client with (400, 414 for a
long request line, 431 for too many or too large header fields, 501 for an unknown transfer
coding, 505 for an unsupported HTTP version). Response-side refusals (a broken upstream) carry 502
throughout, the status the proxy answers its own client with.

Layout: `grammar` (limits, the grammar as regexes, hop-by-hop names), `heads` (the parsed head
types), `parse` (C scanner first, Python reference for the rest), `diagnose` (the slow path that
names the first error), `body` (`BodyReader`), `serialize` (heads, chunks, `strip_hop_by_hop`)
and `relay` (the fast path that forwards field lines as bytes). This module re-exports the API.
"""

from __future__ import annotations

from proxycore.protocol.http1.body import BodyReader
from proxycore.protocol.http1.grammar import DEFAULT_LIMITS, HOP_BY_HOP, BodyKind, Limits
from proxycore.protocol.http1.heads import RequestHead, ResponseHead
from proxycore.protocol.http1.parse import (
    parse_request_head,
    parse_response_head,
    reference_parse_request_head,
    reference_parse_response_head,
)
from proxycore.protocol.http1.relay import (
    RESPONSE_DROP,
    DropSet,
    compile_drop,
    reference_relay_fields,
    relay_fields,
)
from proxycore.protocol.http1.serialize import (
    LAST_CHUNK,
    encode_chunk,
    serialize_request_head,
    serialize_response_head,
    strip_hop_by_hop,
)

__all__ = [
    "DEFAULT_LIMITS",
    "HOP_BY_HOP",
    "LAST_CHUNK",
    "RESPONSE_DROP",
    "BodyKind",
    "BodyReader",
    "DropSet",
    "Limits",
    "RequestHead",
    "ResponseHead",
    "compile_drop",
    "encode_chunk",
    "parse_request_head",
    "parse_response_head",
    "reference_parse_request_head",
    "reference_parse_response_head",
    "reference_relay_fields",
    "relay_fields",
    "serialize_request_head",
    "serialize_response_head",
    "strip_hop_by_hop",
]
