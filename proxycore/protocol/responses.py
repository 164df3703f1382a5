"""What to relay to the agent of an upstream's response, decided without I/O.

Theory of operation: once the upstream's response head has arrived, `plan_response` decides how
its body travels to the agent and builds the head the agent will see, everything scrubbed (the
status line's reason, the field names and values: an upstream that echoes a credential anywhere
must not hand it back). Three body modes:

    NONE    no body (HEAD, 1xx, 204, 304): the upstream's fields are kept as they are
    WHOLE   a Content-Length body up to `WHOLE_BODY`: read whole, scrubbed in one call, sent
            with the length of what remains after scrubbing
    STREAM  anything else: streamed through a scrubber stream, re-framed as chunked for an
            HTTP/1.1 agent, delimited by the close for an HTTP/1.0 agent

A content-encoded body (the proxy asks for identity; some upstreams compress anyway) is decoded,
scrubbed and encoded again (proxycore/protocol/codings.py): `coding` says which, and such a
body always streams (its length changes); a coding that cannot be decoded (br, stacked codings,
an unknown one) is refused with 502 rather than relayed.
"""

from __future__ import annotations

import enum
import re

import msgspec

from native.scrub import Scrubber
from proxycore.protocol import http1
from proxycore.protocol.codings import declared_coding
from proxycore.protocol.plans import Forward, Refuse
from proxycore.protocol.scrubbing import scrub_field_lines

__all__ = ["WHOLE_BODY", "BodyMode", "ResponsePlan", "plan_response"]

# Response bodies up to this size are read whole before relaying, so they keep a Content-Length
# after scrubbing; larger ones (and chunked, and SSE) stream through the scrubber.
WHOLE_BODY = 64 * 1024

_CONTENT_ENCODING_RE = re.compile(rb"(?i)\r\ncontent-encoding[ \t]*:")
# A response whose body is re-framed drops the upstream's length (and never relays its framing).
# Responses keep fields whose name holds "_" (docs/proxy.md: the rule is for requests).
_DROP_LENGTH = http1.compile_drop(http1.HOP_BY_HOP | {b"content-length"}, keep_underscores=True)


class BodyMode(enum.Enum):
    NONE = "none"
    WHOLE = "whole"
    STREAM = "stream"


class ResponsePlan(msgspec.Struct, frozen=True):
    status: int
    mode: BodyMode
    # STREAM to an HTTP/1.1 agent: re-framed as chunked (else the close ends the body).
    rechunk: bool
    keep_client: bool
    # The upstream connection can carry another request once this body is read to its end.
    reusable: bool
    # "HTTP/1.1 200 OK" and the field lines (each led by CRLF), scrubbed; no framing field.
    start: bytes
    # The Content-Encoding to decode and encode again around the scrubber (b"gzip",
    # b"deflate"), None for identity (codings.py still checks such a body's first bytes).
    coding: bytes | None = None

    def head(self, content_length: int | None = None) -> bytearray:
        """The head for the agent; WHOLE passes the length of the scrubbed body."""
        out = bytearray(self.start)
        if content_length is not None:
            out += b"\r\ncontent-length: %d" % content_length
        if self.rechunk:
            out += b"\r\ntransfer-encoding: chunked"
        if not self.keep_client:
            out += b"\r\nconnection: close"
        out += b"\r\n\r\n"
        return out


def plan_response(
    forward: Forward,
    request: http1.RequestHead,
    response: http1.ResponseHead,
    scrubber: Scrubber,
    *,
    whole_limit: int = WHOLE_BODY,
) -> ResponsePlan | Refuse:
    """`whole_limit`: the largest body to read whole (0 when the crew's buffer budget has
    no room: the body streams instead)."""
    kind = response.body_kind
    keep_client = forward.keep_alive
    coding = None
    if kind is not http1.BodyKind.NONE and _CONTENT_ENCODING_RE.search(response.raw):
        coding, cannot = declared_coding(
            [value for name, value in response.headers if name == b"content-encoding"]
        )
        if cannot is not None:
            return forward.request.refused(
                502,
                "upstream_failed",
                f"{forward.host} answered with content-encoding {cannot} although the proxy "
                "asked for identity; the proxy decodes only gzip and deflate, so the response "
                "cannot be checked for credentials and is not relayed",
                rule="unscrubbable_encoding",
                close=not keep_client,
            )
    if kind is http1.BodyKind.NONE:
        mode, drop = BodyMode.NONE, http1.RESPONSE_DROP
    elif (
        kind is http1.BodyKind.LENGTH and response.content_length <= whole_limit and coding is None
    ):
        mode, drop = BodyMode.WHOLE, _DROP_LENGTH
    else:
        mode, drop = BodyMode.STREAM, _DROP_LENGTH
    rechunk = False
    if mode is BodyMode.STREAM:
        if request.http_version == b"1.1":
            rechunk = True
        else:
            keep_client = False  # an HTTP/1.0 agent learns the end from the close
    fields = http1.relay_fields(response, drop)
    if fields is None:
        # The general path: a Connection field nominates others (strip_hop_by_hop reads it).
        lines = bytearray()
        for name, value in http1.strip_hop_by_hop(response.headers, keep_underscores=True):
            if drop is _DROP_LENGTH and name == b"content-length":
                continue
            lines += b"\r\n%s: %s" % (name, value)
        fields = bytes(lines)
    # The status line and the fields in one scrubber call (the common case: nothing to redact);
    # when anything is redacted they are done again apart, so that a field whose name holds a
    # secret is dropped rather than relayed with a mangled name.
    start = b"HTTP/1.1 %d %s" % (response.status, response.reason)
    head = start + fields
    scrubbed = scrubber.scrub(head)
    if scrubbed != head:
        scrubbed = scrubber.scrub(start) + scrub_field_lines(scrubber, fields)
    return ResponsePlan(
        status=response.status,
        mode=mode,
        rechunk=rechunk,
        keep_client=keep_client,
        reusable=response.keep_alive and kind is not http1.BodyKind.UNTIL_CLOSE,
        start=scrubbed,
        coding=coding,
    )
