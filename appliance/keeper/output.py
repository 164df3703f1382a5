"""What an execute's output becomes for the crew: scrubbed text, or a readable refusal (sans-IO).

Theory of operation
-------------------
Each pipe of an execute (stdout, stderr) is one `OutputGuard`. Its bytes go through one stream
of the crew's scrubber (every value of the credential store, the executed credential's value,
the shapes: `native.scrub.Scrubber`, the facade the proxy's responses go through), so a value
split across writes is caught as it would be in one piece; what the scrubber releases is kept
up to `limit` bytes (the rest is dropped and the answer says `truncated`).

The scrubber matches bytes and the encodings it knows; a compressed or encrypted rendering of a
value holds none of its bytes, so no scrubber can vouch for output that is not text. So the
guard also checks, on the raw bytes as they come, that the pipe is text:

- valid UTF-8 (RFC 3629: no stray continuation byte, no overlong form, no surrogate, nothing
  truncated at the end), read incrementally, so a character split across two writes is fine;
- no C0 control character but tab, LF, VT, FF, CR, backspace, bell and escape (what terminal
  output uses; a NUL or a \\x01 says binary);
- none of the magic numbers made of such bytes that open a compressed stream (bzip2's
  `BZh<level>1AY&SY`; gzip, xz, zstd, lz4, zip, 7z and zlib start with bytes that are not
  UTF-8 or are controls, so the two rules above already catch them).

The first byte that fails withholds the whole pipe: none of it is returned, not even the text
before (the value may sit in the binary part), and the crew reads `withheld_text(...)` in its
place, naming the pipe, the reason and the byte count. The command still ran (its exit code is
returned, the execution journaled): refusing to return output is not undoing it.
"""

from __future__ import annotations

import codecs
import re

from native.scrub import ScrubStream

# C0 controls that mean binary; tab, LF, VT, FF, CR, BS, BEL and ESC are terminal output.
_BINARY_CONTROLS = re.compile(rb"[\x00-\x06\x0e-\x1a\x1c-\x1f]")
# Magic numbers made only of text bytes (the others fail the UTF-8 or control rule first).
_TEXT_MAGICS = re.compile(rb"BZh[1-9]1AY&SY")
_MAGIC_CARRY = 9  # len(b"BZh91AY&SY") - 1: a magic split across two writes is still seen


def withheld_text(pipe: str, size: int, reason: str) -> str:
    """What the crew reads instead of a pipe that is not text."""
    return (
        f"[keeper: {pipe} withheld: its {size} bytes are not text ({reason}), and output "
        "that is not text cannot be checked for secrets; print text, or write binary output "
        "to a file]"
    )


class OutputGuard:
    """One pipe of an execute: checked to be text, scrubbed, bounded."""

    __slots__ = (
        "_decoder",
        "_kept",
        "_scrub",
        "_tail",
        "limit",
        "pipe",
        "size",
        "truncated",
        "withheld",
    )

    def __init__(self, pipe: str, stream: ScrubStream, limit: int) -> None:
        self.pipe = pipe
        self.limit = limit
        self.size = 0  # raw bytes read from the pipe
        self.truncated = False
        self._scrub: ScrubStream | None = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._kept = bytearray()
        self._tail = b""
        self.withheld: str | None = None

    def _check(self, chunk: bytes, final: bool) -> str | None:
        """Why this chunk makes the pipe binary, or None. Of several reasons in one chunk, the
        first byte's: the refusal reads the same however the pipe was written."""
        base = self.size - len(chunk)  # the chunk's first byte, counted from the pipe's start
        found: list[tuple[int, str]] = []
        pending = len(self._decoder.getstate()[0])  # the start of a character cut by a write
        try:
            self._decoder.decode(chunk, final)
        except UnicodeDecodeError as exc:
            found.append((base - pending + exc.start, f"not UTF-8: {exc.reason}"))
        control = _BINARY_CONTROLS.search(chunk)
        if control is not None:
            byte = chunk[control.start()]
            found.append((base + control.start(), f"the control byte 0x{byte:02x}"))
        magic = _TEXT_MAGICS.search(self._tail + chunk)
        if magic is not None:
            found.append((base - len(self._tail) + magic.start(), "a bzip2 stream"))
        self._tail = (self._tail + chunk)[-_MAGIC_CARRY:]
        if not found:
            return None
        at, reason = min(found)
        return f"{reason} at byte {at}"

    def feed(self, chunk: bytes) -> None:
        if self.withheld is not None or not chunk:
            self.size += len(chunk)
            return
        self.size += len(chunk)
        reason = self._check(chunk, final=False)
        if reason is not None:
            self._withhold(reason)
            return
        assert self._scrub is not None
        self._keep(self._scrub.feed(chunk))

    def _keep(self, scrubbed: bytes) -> None:
        room = self.limit - len(self._kept)
        if len(scrubbed) > room:
            self.truncated = True
        self._kept += scrubbed[: max(room, 0)]

    def _withhold(self, reason: str) -> None:
        self.withheld = reason
        self._kept = bytearray()
        self._scrub = None  # what it holds back is never released

    def finish(self) -> str:
        """The pipe's text for the answer (scrubbed, or the refusal)."""
        if self.withheld is None:
            reason = self._check(b"", final=True)
            if reason is not None:
                self._withhold(reason)
            else:
                assert self._scrub is not None
                self._keep(self._scrub.flush())
        if self.withheld is not None:
            return withheld_text(self.pipe, self.size, self.withheld)
        # Valid UTF-8 came in; a cut at the limit may end inside a character.
        return self._kept.decode("utf-8", "replace")
