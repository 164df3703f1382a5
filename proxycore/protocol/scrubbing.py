"""The scrubber in the data plane: which secrets, when it changes, and what it is applied to.

Theory of operation: the proxy holds the provider credentials it injects; those values (named
after their provider) plus the secret shapes of `native.scrub_patterns` and any configured in
`[[scrub.shapes]]` are compiled into one immutable `Scrubber`. `ScrubberHolder.current` is what a
response starts with; adding or rotating a credential builds a new one off to the side and swaps
the reference, so the proxy never restarts and a response never sees half an update (a response
already streaming finishes on the scrubber it started with).

What passes through it, in this module's helpers and in server.py:

- response field lines (`scrub_field_lines`), keeping their structure;
- response bodies, streamed (`Scrubber.stream`); a body whose length changes is re-framed;
- the events the data plane writes (`scrub_json_lines`), line by line, keeping each line JSON.

Counting redactions (applianced's `appliance_scrubber_redactions_total`): every redaction is a
marker `[REDACTED:<name>]` in the output, so a body's count is the markers that came out minus
those that went in (an upstream may quote a marker: it passes through unchanged). The engine
reports nothing itself and needs no change for this; `MarkerCount` follows markers that straddle
two chunks of a stream.

Compressed bodies: the proxy asks every upstream for `accept-encoding: identity`; a response
encoded anyway with gzip or deflate is decoded around the scrubber (codings.py), one with a
coding it cannot decode is refused (`unscrubbable_encoding`), rather than relay bytes it cannot
read. Event streams are scrubbed per text channel first (sse_scrub.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from native.scrub import Scrubber
from native.scrub_patterns import DEFAULT_SHAPES, PatternError, Shape, token_shape
from proxycore.config import ScrubShapeConfig
from proxycore.errors import ConfigError

IDENTITY = b"identity"
# What the scrubber writes in place of a secret, up to the name (native/scrub_reference.py
# `marker`); it cannot overlap itself, so `bytes.count` finds each once.
MARKER = b"[REDACTED:"
_CARRY = len(MARKER) - 1


def redactions(before: bytes, after: bytes) -> int:
    """Secrets redacted from `before` (one whole input) to give `after`."""
    return max(0, after.count(MARKER) - before.count(MARKER))


class MarkerCount:
    """Markers in a stream of chunks, one that straddles two chunks included."""

    __slots__ = ("_tail", "count")

    def __init__(self) -> None:
        self.count = 0
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        tail = self._tail
        if tail:
            # Shorter than a marker on each side: whatever matches here straddles the cut.
            self.count += (tail + chunk[:_CARRY]).count(MARKER)
        self.count += chunk.count(MARKER)
        self._tail = chunk[-_CARRY:] if len(chunk) >= _CARRY else (tail + chunk)[-_CARRY:]


def configured_shapes(shapes: Sequence[ScrubShapeConfig]) -> tuple[Shape, ...]:
    """The default shapes plus the operator's; an error names the `scrub.shapes[i]` key."""
    extra = []
    for index, shape in enumerate(shapes):
        try:
            extra.append(
                token_shape(
                    shape.name, shape.prefix.encode("utf-8"), shape.chars, shape.min, shape.max
                )
            )
        except (PatternError, ValueError) as exc:
            raise ConfigError(f"`scrub.shapes[{index}]`: {exc}") from None
    return DEFAULT_SHAPES + tuple(extra)


class ScrubberHolder:
    """The current scrubber, replaced whole when the secrets change."""

    __slots__ = ("current", "shapes")

    def __init__(self, secrets: Iterable[tuple[str, bytes]], shapes: Sequence[Shape]) -> None:
        self.shapes = tuple(shapes)
        self.current = Scrubber(secrets, self.shapes)

    def replace(self, secrets: Iterable[tuple[str, bytes]]) -> Scrubber:
        """Compile first, then swap: if compiling fails, the old scrubber stays in place."""
        scrubber = Scrubber(secrets, self.shapes)
        self.current = scrubber
        return scrubber


def scrub_field_lines(scrubber: Scrubber, fields: bytes) -> bytes:
    """Field lines (each led by CRLF) with secrets redacted, still one field per line.

    One pass over the block is the common case. When it redacts anything, the block is redone
    line by line: a redaction must not swallow a line break (a PEM block in a field value), and
    a field whose *name* holds a secret is dropped rather than relayed with a mangled name.
    """
    scrubbed = scrubber.scrub(fields)
    if scrubbed == fields:
        return fields
    out: list[bytes] = []
    for line in fields.split(b"\r\n"):
        if not line:
            out.append(line)  # the empty piece before the leading CRLF
            continue
        name, colon, value = line.partition(b":")
        if scrubber.scrub(name) != name:
            continue
        out.append(name + colon + scrubber.scrub(value))
    return b"\r\n".join(out)


_REDACTED_EVENT = b'{"event":"redacted","crew":"-","reason":"a secret inside this event"}'


def scrub_json_lines(scrubber: Scrubber, batch: bytes) -> bytes:
    """A batch of JSON lines with secrets redacted; a line the redaction would leave unreadable
    (a secret holding a quote or a backslash) is replaced whole rather than broken."""
    scrubbed = scrubber.scrub(batch)
    if scrubbed == batch:
        return batch
    lines = scrubbed.split(b"\n")
    for index, line in enumerate(lines):
        if line:
            try:
                msgspec.json.decode(line)
            except msgspec.DecodeError:
                lines[index] = _REDACTED_EVENT
    return b"\n".join(lines)


def unscrubbable_encoding(content_encodings: Iterable[bytes]) -> bytes | None:
    """The first coding (RFC 9110 8.4) of a body that the scrubber cannot read, or None."""
    for value in content_encodings:
        for coding in value.split(b","):
            coding = coding.strip().lower()
            if coding not in (b"", IDENTITY):
                return coding
    return None
