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

Two stages. Stage 1 is that engine: raw values, their exact encodings and the shapes; its markers
name secrets as they always did. Stage 2, the fold matcher (`scrub_fold.py`, C in
`src/fold.c`), runs over stage 1's output and catches the known values in forms an agent can
trivially decode (case, separators, invisible characters, NFKC, entities, escapes, repeated
percent-encoding, ANSI sequences, UTF-16, base64/base32/hex windows, ROT13, reversed). It is
built only when a secret passes its gate (`scrub_fold.qualifies`); with none, a stream is stage 1
alone. A composed stream feeds stage 1 then stage 2, and holds what both hold: when both
stages are the C ones, that is one C call per feed (`scrub_native.NativeStream` with fold tables,
`src/composed.c`), else `ComposedStream` below, which defines what that call does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal, Protocol

from native.scrub_fold import FoldTables, qualifies
from native.scrub_patterns import (
    DEFAULT_SHAPES,
    PatternError,
    Patterns,
    SegmentKind,
    Shape,
    compile_patterns,
)
from native.scrub_reference import ReferenceStream, Tables, scrub_whole

try:
    from native import scrub_native  # type: ignore[attr-defined,unused-ignore]

    NATIVE_AVAILABLE: bool = scrub_native.AVAILABLE
except ImportError:  # the wrapper itself is missing (a partial install): the reference serves
    NATIVE_AVAILABLE = False
try:
    from native import scrub_fold_native

    FOLD_NATIVE_AVAILABLE: bool = scrub_fold_native.AVAILABLE
except ImportError:
    FOLD_NATIVE_AVAILABLE = False

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
    if NATIVE_AVAILABLE and FOLD_NATIVE_AVAILABLE:
        return None
    return (
        "scrubber: the C engine is not built (no C compiler at install time?); the Python "
        "reference scrubs instead, at a fraction of the speed"
    )


class ComposedStream:
    """Stage 1 then stage 2: what stage 1 releases is fed to stage 2 at once."""

    __slots__ = ("first", "second")

    def __init__(self, first: ScrubStream, second: ScrubStream) -> None:
        self.first = first
        self.second = second

    @property
    def pending(self) -> int:
        return self.first.pending + self.second.pending

    def feed(self, chunk: bytes) -> bytes:
        released = self.first.feed(chunk)
        # Nothing new for stage 2: feeding it nothing would release nothing (its cut depends
        # only on what it holds), at the cost of decoding that again.
        return self.second.feed(released) if released else b""

    def flush(self) -> bytes:
        out = self.second.feed(self.first.flush())
        return out + self.second.flush()


def _as_bytes(value: bytes | str) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def _marker_names(patterns: Patterns) -> list[str]:
    """The names stage 1 writes in its markers, which stage 2 takes for a BREAK (with the
    secrets' own): a shape's name, or for a shape named from its text the literal that segment
    matches (any case). Never a name copied from other text: that could carry a secret's
    decodable form past stage 2."""
    out = []
    for shape in patterns.shapes:
        if shape.name_from < 0:
            out.append(shape.name)
        else:
            seg = shape.segments[shape.name_from]
            if seg.kind is SegmentKind.LITERAL:
                out.append(seg.literal.decode("ascii", "replace"))
    return out


class Scrubber:
    """Compiled patterns for a set of named secrets plus shapes; immutable, thread-safe."""

    __slots__ = ("_fold", "_native", "_tables", "engine", "fold_engine", "names", "patterns")

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
        self._fold: FoldTables | scrub_fold_native.NativeFoldTables | None = None
        self.fold_engine = "none"
        if any(qualifies(value) for _, value in pairs):
            markers = _marker_names(self.patterns)
            if engine != "reference" and FOLD_NATIVE_AVAILABLE:
                self._fold = scrub_fold_native.NativeFoldTables(pairs, markers)
                self.fold_engine = "native"
            else:
                self._fold = FoldTables(pairs, markers)
                self.fold_engine = "reference"

    @property
    def hold_bound_bytes(self) -> int:
        """The most input bytes a stream of this scrubber holds back (both stages)."""
        bound = self.patterns.hold_bound_bytes
        return bound + self._fold.hold_bound_bytes if self._fold is not None else bound

    def _first_stream(self) -> ScrubStream:
        if self._native is not None:
            native_stream: ScrubStream = self._native.stream()
            return native_stream
        assert self._tables is not None
        return ReferenceStream(self._tables)

    def stream(self) -> ScrubStream:
        if self._native is not None and not isinstance(self._fold, FoldTables):
            return self._native.stream(self._fold)  # both stages (or stage 1 alone) in one call
        first = self._first_stream()
        if self._fold is None:
            return first
        return ComposedStream(first, self._fold.stream())

    def scrub(self, data: bytes) -> bytes:
        scrubbed: bytes
        if self._native is not None:
            scrubbed = self._native.scrub(data)
        else:
            assert self._tables is not None
            scrubbed = scrub_whole(self._tables, data)
        if self._fold is not None:
            scrubbed = self._fold.scrub(scrubbed)
        return scrubbed

    def scrub_text(self, text: str) -> str:
        """For log lines and journal strings: any text in, never an error out."""
        raw = text.encode("utf-8", "surrogateescape")
        return self.scrub(raw).decode("utf-8", "surrogateescape")

    def __repr__(self) -> str:  # names only: a Scrubber holds secrets
        return (
            f"Scrubber(engine={self.engine!r}, fold={self.fold_engine!r}, "
            f"secrets={len(self.names)} named)"
        )
