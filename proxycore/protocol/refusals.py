"""Answers the proxy writes itself: refusals the agent can read, and the local API's replies.

A refusal is never a hang and never a silent close: a status code and a short JSON body naming
the host, the rule that refused it and the crew's mode, so an agent (or the human reading its
transcript) knows what happened and what to ask the operator for.
"""

from __future__ import annotations

import msgspec

REASONS = {
    200: b"OK",
    400: b"Bad Request",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    417: b"Expectation Failed",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}


class Refusal(msgspec.Struct, frozen=True, omit_defaults=True):
    error: str
    message: str
    host: str | None = None
    rule: str | None = None
    mode: str | None = None
    crew: str | None = None
    # Run-time approvals (docs/proxy.md "Approvals"), on a `not_in_allowlist` refusal only:
    # "pending" (a request waits for the operator) or "denied" (the operator refused the host),
    # for how many more seconds, and the command that answers a pending request.
    approval: str | None = None
    approval_expires_in: int | None = None
    approval_command: str | None = None


_encoder = msgspec.json.Encoder()


def json_response(status: int, body: bytes, *, close: bool) -> bytes:
    headers = [
        b"HTTP/1.1 %d %s" % (status, REASONS.get(status, b"Error")),
        b"content-type: application/json",
        b"content-length: %d" % len(body),
        b"cache-control: no-store",
        # Lets a client or a test tell the proxy's own answer from an upstream's.
        b"x-appliance-proxy: refusal" if status >= 400 else b"x-appliance-proxy: local",
    ]
    if close:
        headers.append(b"connection: close")
    return b"\r\n".join(headers) + b"\r\n\r\n" + body


def refusal(status: int, refusal: Refusal, *, close: bool) -> bytes:
    return json_response(status, _encoder.encode(refusal) + b"\n", close=close)


def local_json(obj: object) -> bytes:
    return json_response(200, _encoder.encode(obj) + b"\n", close=False)
