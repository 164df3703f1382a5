"""Trailer fields (RFC 9110 6.5): which ones the proxy relays, and how it writes them.

Theory of operation: trailers travel in an HTTP/2 HEADERS frame with END_STREAM, or in the
trailer section of an HTTP/1.1 chunked body. Inside the proxy a message is always HTTP/1.1
(proxycore/io/http2.py and proxycore/io/upstream_h2.py turn HTTP/2 streams into HTTP/1.1
exchanges), so trailers are carried as a chunked trailer section, read back by the strict body
reader (proxycore/protocol/http1/body.py: field-line grammar, header limits, no framing field).

What is relayed (`relayable`): a field whose name is a lowercase token and whose value has no
control character (RFC 9113 8.2.1; never a pseudo-header, RFC 9113 8.1), and that RFC 9110
6.5.1 lets a trailer carry: never framing (Content-Length, Transfer-Encoding), routing (Host),
connection-specific or hop-by-hop fields (RFC 9113 8.2.2). Request trailers never carry a
credential header either (proxycore/protocol/credentials.py strips those from the head: a
trailer must not put back what was taken out). Response trailers go through the scrubber like
response fields (`scrubbed_section`).

HTTP/1.1 agents get trailers only when they sent `TE: trailers` (RFC 9110 10.1.4); otherwise
they are dropped, as RFC 9110 6.5.1 allows a recipient to.
"""

from __future__ import annotations

from native.scrub import Scrubber
from proxycore.protocol.credentials import CREDENTIAL_HEADERS
from proxycore.protocol.http1 import HOP_BY_HOP, RequestHead
from proxycore.protocol.http1.grammar import comma_tokens
from proxycore.protocol.http2.fields import well_formed
from proxycore.protocol.scrubbing import scrub_field_lines

__all__ = ["accepts_trailers", "relayable", "scrubbed_section", "section"]

_NEVER = HOP_BY_HOP | {b"content-length", b"host", b"http2-settings"}
_NEVER_IN_REQUESTS = _NEVER | CREDENTIAL_HEADERS


def relayable(
    fields: tuple[tuple[bytes, bytes], ...] | list[tuple[bytes, bytes]], *, request: bool
) -> list[tuple[bytes, bytes]]:
    """The fields of a trailer section that may travel on (see the module docstring)."""
    never = _NEVER_IN_REQUESTS if request else _NEVER
    return [
        (name, value) for name, value in fields if well_formed(name, value) and name not in never
    ]


def section(fields: list[tuple[bytes, bytes]]) -> bytes:
    """The last chunk of a chunked body with these fields as its trailer section
    (RFC 9112 7.1.2); fields already `relayable`."""
    return b"0\r\n" + b"".join(b"%s: %s\r\n" % (name, value) for name, value in fields) + b"\r\n"


def scrubbed_section(fields: list[tuple[bytes, bytes]], scrubber: Scrubber) -> bytes:
    """As `section`, the fields through the scrubber (a field whose name holds a secret is
    dropped, as in a response head)."""
    lines = b"".join(b"\r\n%s: %s" % (name, value) for name, value in fields)
    lines = scrub_field_lines(scrubber, lines)
    return b"0" + lines + b"\r\n\r\n"


def accepts_trailers(head: RequestHead) -> bool:
    """Whether the agent said it takes trailers (`TE: trailers`, RFC 9110 10.1.4)."""
    return any(name == b"te" and b"trailers" in comma_tokens(value) for name, value in head.headers)
