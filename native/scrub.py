"""The streaming scrubber: what the rest of the appliance uses.

    scrubber = Scrubber([("anthropic", key_bytes)])   # compile once (immutable, shareable)
    stream = scrubber.stream()                        # one small state per response / process
    out = stream.feed(chunk) ... + stream.flush()
    scrubber.scrub(data) / scrubber.scrub_text(text)  # whole inputs (logs, journal payloads)

A `Scrubber` is immutable after construction, so one instance is shared by every task and thread;
each stream holds only its own pending bytes. To add or rotate a credential, build a new
`Scrubber` and swap the reference (`proxycore.protocol.scrubbing.ScrubberHolder` does this for the
proxy): streams already running finish on the one they started with.

The engine is the C one (`src/scrub.c`) when it is built, else the Python reference
(`scrub_reference.py`), which defines the output; `ENGINE` says which, and `native_missing_notice`
is the one line to print at start when the C engine is missing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

from native.scrub_patterns import DEFAULT_SHAPES, PatternError, Patterns, Shape, compile_patterns
from native.scrub_reference import ReferenceStream, Tables, scrub_whole

try:
    from native import scrub_native  # type: ignore[attr-defined,unused-ignore]

    NATIVE_AVAILABLE: bool = scrub_native.AVAILABLE
except ImportError:  # the wrapper itself is missing (a partial install): the reference serves
    NATIVE_AVAILABLE = False

ENGINE = "native" if NATIVE_AVAILABLE else "reference"

__all__ = ["ENGINE", "PatternError", "ScrubStream", "Scrubber", "native_missing_notice"]


class ScrubStream(Protocol):
    @property
    def pending(self) -> int:
        """Input bytes held back, waiting to know whether they start a secret."""

    def feed(self, chunk: bytes) -> bytes:
        """Scrubbed output that is final now (possibly empty)."""

    def flush(self) -> bytes:
        """The rest, at the end of the stream; the stream takes no more input after it."""


def native_missing_notice() -> str | None:
    if NATIVE_AVAILABLE:
        return None
    return (
        "scrubber: the C engine is not built (no C compiler at install time?); the Python "
        "reference scrubs instead, at a fraction of the speed"
    )


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


class Scrubber:
    """Compiled patterns for a set of named secrets plus shapes; immutable, thread-safe."""

    __slots__ = ("_native", "_tables", "engine", "names", "patterns")

    def __init__(
        self,
        secrets: Iterable[tuple[str, bytes | str]] = (),
        shapes: Sequence[Shape] = DEFAULT_SHAPES,
        *,
        engine: Literal["auto", "native", "reference"] = "auto",
    ) -> None:
        pairs = [(name, _as_bytes(value)) for name, value in secrets]
        self.patterns: Patterns = compile_patterns(pairs, shapes)
        self.names = tuple(sorted({name for name, _ in pairs}))
        if engine == "native" and not NATIVE_AVAILABLE:
            raise RuntimeError("scrubber: the C engine was asked for but is not built")
        self.engine = "native" if engine != "reference" and NATIVE_AVAILABLE else "reference"
        self._tables = Tables(self.patterns) if self.engine == "reference" else None
        self._native = scrub_native.NativeTables(self.patterns) if self.engine == "native" else None

    def stream(self) -> ScrubStream:
        if self._native is not None:
            native_stream: ScrubStream = self._native.stream()
            return native_stream
        assert self._tables is not None
        return ReferenceStream(self._tables)

    def scrub(self, data: bytes) -> bytes:
        if self._native is not None:
            scrubbed: bytes = self._native.scrub(data)
            return scrubbed
        assert self._tables is not None
        return scrub_whole(self._tables, data)

    def scrub_text(self, text: str) -> str:
        """For log lines and journal strings: any text in, never an error out."""
        raw = text.encode("utf-8", "surrogateescape")
        return self.scrub(raw).decode("utf-8", "surrogateescape")

    def __repr__(self) -> str:  # names only: a Scrubber holds secrets
        return f"Scrubber(engine={self.engine!r}, secrets={len(self.names)} named)"
