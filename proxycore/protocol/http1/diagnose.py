"""The slow path of the head parser: find the first offending byte and say what is wrong.

The fast path (`parse`) validates a whole head with one regex; only when that fails, or while a
head is still arriving, does `walk_head` go through it line by line. It is the single source of
truth for refusals, so that a refusal and its status hint do not depend on how the input was
segmented (see the package docstring).
"""

from __future__ import annotations

from typing import NoReturn

from proxycore.protocol.http1.grammar import (
    FIELD_LINE_PREFIX_RE,
    FIELD_LINE_RE,
    REQUEST_LINE_PREFIX_RE,
    REQUEST_LINE_RE,
    STATUS_LINE_PREFIX_RE,
    STATUS_LINE_RE,
    TCHARS,
    Limits,
    refuse,
)

__all__ = [
    "REQUEST_SIDE",
    "RESPONSE_SIDE",
    "Side",
    "check_incomplete",
    "check_start_line",
    "describe_bad_line",
    "refuse_at",
    "walk_head",
]


class Side:
    """Per-direction constants for the shared head walker (requests vs responses)."""

    __slots__ = (
        "bad_status",
        "first_bytes",
        "head_too_large",
        "is_request",
        "line_prefix_re",
        "line_too_long",
        "what",
    )

    def __init__(self, *, is_request: bool) -> None:
        self.is_request = is_request
        self.what = "request" if is_request else "status"
        # A request line starts with a method (a token), a status line with "HTTP/".
        self.first_bytes = TCHARS if is_request else frozenset(b"H")
        self.line_prefix_re = REQUEST_LINE_PREFIX_RE if is_request else STATUS_LINE_PREFIX_RE
        # A refused response means a broken upstream: the proxy answers its client 502.
        self.bad_status = 400 if is_request else 502
        self.line_too_long = 414 if is_request else 502
        self.head_too_large = 431 if is_request else 502


REQUEST_SIDE = Side(is_request=True)
RESPONSE_SIDE = Side(is_request=False)


def describe_bad_line(line: bytes, *, field: bool) -> str:
    """Say what is wrong with a start line or field line that failed its grammar (slow path)."""
    if b"\n" in line:
        return "bare LF in message head (RFC 9112 2.2: lines end with CRLF)"
    stripped = line[:-1] if line.endswith(b"\r") else line
    if b"\r" in stripped:
        return "bare CR in message head (RFC 9112 2.2)"
    if b"\x00" in line:
        return "NUL byte in message head"
    if field:
        if line[:1] in (b" ", b"\t"):
            return "obs-fold (line folding) is not accepted (RFC 9112 5.2)"
        name, colon, _ = line.partition(b":")
        if not colon:
            return "field line without a colon"
        if name[-1:] in (b" ", b"\t"):
            return "whitespace between field name and colon (RFC 9112 5.1)"
        if not name or any(c not in TCHARS for c in name):
            return "field name is not a token (RFC 9110 5.1)"
        return "invalid character in field value (RFC 9110 5.5)"
    return "malformed start line (RFC 9112 3 and 4)"


def check_start_line(line: bytes, side: Side) -> None:
    """Validate a complete start line (without its CRLF); raise on anything but the grammar."""
    if side.is_request:
        m = REQUEST_LINE_RE.fullmatch(line)
        if m is None:
            raise refuse(
                f"invalid request line: {describe_bad_line(line, field=False)}", side.bad_status
            )
        version = m.group(3)
    else:
        m = STATUS_LINE_RE.fullmatch(line)
        if m is None:
            raise refuse(
                f"invalid status line: {describe_bad_line(line, field=False)}", side.bad_status
            )
        version = m.group(1)
        status = int(m.group(2))
        # RFC 9110 section 15: valid status codes are 100 to 599.
        if not 100 <= status <= 599:
            raise refuse(f"status code {status} out of range", side.bad_status)
    if version not in (b"1.0", b"1.1"):
        # RFC 9110 15.6.6: 505 HTTP Version Not Supported. HTTP/1.2+ or 0.9 is refused outright.
        raise refuse(
            f"unsupported HTTP version {version.decode('ascii')}",
            505 if side.is_request else side.bad_status,
        )


def walk_head(buf: bytes | bytearray, end: int, limits: Limits, side: Side) -> None:
    """Go through buf[:end] line by line, in stream order, and raise the first error found.

    `end` is either the end of a complete head's last field line (just before the final CRLF)
    or the end of the bytes available so far; then the last line may be incomplete and is held
    to be a valid prefix. Used as the single source of truth for refusals, so that a refusal and
    its status hint are the same whatever the segmentation of the input (see module docstring).
    Returns normally if no error is found in buf[:end].
    """
    max_line = limits.max_request_line
    line_window = min(end, max_line + 2)
    eol = buf.find(b"\r\n", 0, line_window)
    if eol < 0:
        partial = bytes(buf[:line_window])
        if side.line_prefix_re.fullmatch(partial) is None:
            raise refuse(
                f"invalid {side.what} line: {describe_bad_line(partial, field=False)}",
                side.bad_status,
            )
        if line_window >= max_line + 2:
            raise refuse(f"{side.what} line longer than {max_line} bytes", side.line_too_long)
        return
    check_start_line(bytes(buf[:eol]), side)
    pos = eol + 2
    count = 0
    while pos < end:
        nl = buf.find(b"\r\n", pos, end)
        if nl < 0:
            partial = bytes(buf[pos:end])
            if FIELD_LINE_PREFIX_RE.fullmatch(partial) is None:
                raise refuse(
                    f"invalid field line: {describe_bad_line(partial, field=True)}",
                    side.bad_status,
                )
            return
        line = bytes(buf[pos:nl])
        if FIELD_LINE_RE.fullmatch(line) is None:
            raise refuse(
                f"invalid field line: {describe_bad_line(line, field=True)}", side.bad_status
            )
        count += 1
        if count > limits.max_header_count:
            raise refuse(f"more than {limits.max_header_count} header fields", side.head_too_large)
        pos = nl + 2


def refuse_at(
    buf: bytes | bytearray, end: int, limits: Limits, side: Side, message: str, status: int
) -> NoReturn:
    """Raise the first error in buf[:end] (via `walk_head`), or else `message`."""
    walk_head(buf, end, limits, side)
    raise refuse(message, status)


def check_incomplete(buf: bytes | bytearray, limits: Limits, side: Side) -> None:
    """Refuse an incomplete head now if it can already be refused; else return (need more).

    Checks, each at a point that does not depend on how the bytes were segmented (module
    docstring): a bad first byte (a TLS ClientHello on a plaintext port is refused at once, as
    h11 does), a bare LF or a bad start line once its line end arrives, a start line over its
    limit, an "LF LF" (an LF-only client gets a 400 now rather than a timeout), and a head over
    its size limit. All scans are bounded finds at memchr speed, so a peer trickling one byte at
    a time cannot make this quadratic in Python code.
    """
    n = len(buf)
    if n == 0:
        return
    if buf[0] not in side.first_bytes:
        # A message never starts with LF, SP or a control (a request's leading empty lines,
        # RFC 9112 2.2, are skipped before we get here; a response never has any).
        refuse_at(buf, 1, limits, side, f"invalid {side.what} line", side.bad_status)
    max_line = limits.max_request_line
    lf = buf.find(b"\n", 0, min(n, max_line + 2))
    if lf >= 0:
        if lf == 0 or buf[lf - 1] != 0x0D:
            refuse_at(buf, lf + 1, limits, side, "bare LF in start line", side.bad_status)
        check_start_line(bytes(buf[: lf - 1]), side)
    elif n >= max_line + 2:
        # 414 unless a syntax error comes first.
        refuse_at(
            buf,
            max_line + 2,
            limits,
            side,
            f"{side.what} line longer than {max_line} bytes",
            side.line_too_long,
        )
    window = min(n, limits.max_header_bytes)
    lflf = buf.find(b"\n\n", 0, window)
    if lflf >= 0:
        refuse_at(buf, lflf + 2, limits, side, "bare LF in message head", side.bad_status)
    if n >= limits.max_header_bytes:
        # No head end within the limit: refuse with whichever error comes first in the stream
        # (a syntax error inside the window, too many fields, or else the size itself).
        refuse_at(
            buf,
            window,
            limits,
            side,
            f"message head larger than {limits.max_header_bytes} bytes",
            side.head_too_large,
        )
