"""The scrubber's reference implementation: plain Python, written to be read.

This module *defines* what the scrubber outputs; the C engine (`src/scrub.c`) must produce the
same bytes for every input, secret set and chunking, which the differential tests and
`fuzz/fuzz_scrub_differential.py` check. It also serves when the C engine is not built.

Theory of operation
-------------------
0. A run of zero-width characters (`scrub_patterns.ZERO_WIDTH`) keeps its first `ZW_RUN_MAX`
   (`ZeroWidthCap`); this is what bounds what a stream holds back (`Patterns.hold_bound_bytes`).
1. Zero-width characters are taken out of the text; what remains is
   the *skeleton*, and all matching happens on it. Each skeleton byte remembers the zero-width
   characters just before it, so text outside redactions comes out exactly as it came in.
2. Matches on the skeleton, each a span `[start, end)` with a name and a priority (the pattern's
   index: literals in `Patterns.literals` order, then shapes):
   - a window literal: at every position whose next 8 bytes are a run of that secret;
   - a whole literal: at every position where it occurs complete;
   - a shape: each shape on its own, left to right, not overlapping itself (like `finditer`),
     possessively (no backtracking), only where the byte before is not in `not_after` (the end
     of the text waits for the byte after a match when `not_before` is set); its span
     is the redacted part of the match. A complete match that the byte after it (`not_before`)
     or its body's validators (`Shape.body_ok`: checksum, entropy, placeholder; and
     `PUBLISHED_EXAMPLES` for the token placeholder filter) reject redacts nothing, but the
     shape goes on after it, as after a match (gitleaks filters its regex's non-overlapping
     matches the same way): were it tried again at each byte inside, a text of prefixes in one
     long run would cost the shape's length per byte. The validators read only
     the match, so this does not depend on chunking either.
3. Spans are sorted by (start, priority, longest first) and merged while they overlap (touching
   spans stay apart). Each merged group becomes `[REDACTED:<name of its first span>]` (so a
   known secret is named by its credential rather than by the shape it also has); the
   zero-width characters inside a group go with it, those before it stay.

Streaming keeps a pending buffer and rescans it on every `feed`. Output is released up to the
first position where something could still match: a literal whose beginning is the end of the
buffer, a shape attempt that ran off the end. A shape match whose redaction starts after that
point is held from its own start (key/value forms), so the next rescan sees it again. The
pending skeleton is therefore never longer than the longest pattern (see
`Patterns.hold_bound`), and a stream that ends in text that cannot start a secret -- a complete
SSE event ends in a blank line -- is released whole by the `feed` that completed it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from native.scrub_patterns import (
    PUBLISHED_EXAMPLES,
    WINDOW,
    ZERO_WIDTH,
    ZW_RUN_MAX,
    Patterns,
    Placeholder,
    Segment,
    SegmentKind,
    Shape,
)

NEED_MORE = -2  # a segment or shape ran off the end of the text (not at the end of the stream)
NO_MATCH = -1
_ZW_FIRST = frozenset(zw[0] for zw in ZERO_WIDTH)


def marker(name: bytes) -> bytes:
    return b"[REDACTED:" + name + b"]"


# The starts of a zero-width character that the next chunk may complete (no zero-width character
# ends in a byte that starts one, so these never overlap a complete one).
_ZW_PARTIAL = frozenset({b"\xe2", b"\xef", b"\xe2\x80", b"\xe2\x81", b"\xef\xbb"})


class ZeroWidthCap:
    """Step 0 as a stream: runs of zero-width characters cut to their first `ZW_RUN_MAX`.

    The text is read left to right, a zero-width character taken whole wherever its three bytes
    are (as `split` does). The output does not depend on how the input was chunked: the length of
    the run so far is carried over, and so is the start of a zero-width character cut by the end
    of a chunk (at most two bytes)."""

    __slots__ = ("_carry", "_run")

    def __init__(self) -> None:
        self._run = 0  # zero-width characters just output, since the last other byte
        self._carry = b""

    @property
    def carried(self) -> int:
        return len(self._carry)

    def feed(self, chunk: bytes) -> bytes:
        return self._cap(self._carry + chunk, eof=False)

    def flush(self) -> bytes:
        return self._cap(self._carry, eof=True)

    def _cap(self, data: bytes, eof: bool) -> bytes:
        self._carry = b""
        if not eof:
            for tail in (2, 1):
                if len(data) >= tail and data[-tail:] in _ZW_PARTIAL:
                    data, self._carry = data[:-tail], data[-tail:]
                    break
        out = bytearray()
        i, n = 0, len(data)
        while i < n:
            if data[i] in _ZW_FIRST and data[i : i + 3] in ZERO_WIDTH:
                if self._run < ZW_RUN_MAX:
                    out += data[i : i + 3]
                    self._run += 1
                i += 3
                continue
            out.append(data[i])
            self._run = 0
            i += 1
        return bytes(out)


def cap_zero_width(data: bytes) -> bytes:
    cap = ZeroWidthCap()
    return cap.feed(data) + cap.flush()


@dataclass(slots=True)
class Split:
    """Raw bytes taken apart into the skeleton and the zero-width characters around it."""

    skeleton: bytes
    before: list[bytes]  # before[k]: the zero-width characters just before skeleton byte k
    starts: list[int]  # starts[k]: offset in the raw bytes of before[k] (where byte k's run starts)
    trailing: bytes  # zero-width characters after the last skeleton byte
    trailing_start: int  # offset of `trailing` (= end of the last skeleton byte)
    held: bytes  # the start of a zero-width character cut by the end of the chunk


def split(raw: bytes, eof: bool) -> Split:
    skeleton = bytearray()
    before: list[bytes] = []
    starts: list[int] = []
    run = bytearray()
    run_start = 0
    i = 0
    n = len(raw)
    while i < n:
        b = raw[i]
        if b in _ZW_FIRST:
            three = raw[i : i + 3]
            if three in ZERO_WIDTH:
                if not run:
                    run_start = i
                run += three
                i += 3
                continue
            if not eof and len(three) < 3 and any(zw.startswith(three) for zw in ZERO_WIDTH):
                break  # may be a zero-width character that the next chunk completes
        if not run:
            run_start = i
        before.append(bytes(run))
        starts.append(run_start)
        run.clear()
        skeleton.append(b)
        i += 1
    return Split(
        bytes(skeleton),
        before,
        starts,
        bytes(run),
        run_start if run else i,
        raw[i:] if i < n else b"",
    )


def match_segment(seg: Segment, s: bytes, i: int, eof: bool) -> int:
    """End of `seg` matched at s[i:], NO_MATCH, or NEED_MORE."""
    n = len(s)
    if seg.kind is SegmentKind.LITERAL:
        want = seg.literal
        got = s[i : i + len(want)]
        if seg.fold_case:
            want, got = want.lower(), got.lower()
        if got == want:
            return i + len(want)
        if not eof and len(got) < len(want) and want.startswith(got):
            return NEED_MORE
        return NO_MATCH
    j = i
    if seg.kind is SegmentKind.CLASS:
        stop = seg.stop
        while j - i < seg.max:
            if j == n:
                if eof:
                    break
                return NEED_MORE
            if stop:
                ahead = s[j : j + len(stop)]
                if ahead == stop:
                    break
                if not eof and len(ahead) < len(stop) and stop.startswith(ahead):
                    return NEED_MORE
            if s[j] not in seg.members:
                break
            j += 1
        if j - i < seg.min:
            return NO_MATCH
        if seg.suffixes:
            text = s[i:j].lower()
            if not any(text.endswith(suffix.lower()) for suffix in seg.suffixes):
                return NO_MATCH
        return j
    # JSON_STRING: bytes up to an unescaped '"'; a backslash takes the next byte with it.
    while j - i < seg.max:
        if j == n:
            if eof:
                break
            return NEED_MORE
        b = s[j]
        if b == 0x22:
            break
        if b == 0x5C:
            if j - i + 2 > seg.max:
                break
            if j + 1 == n:
                if eof:
                    break
                return NEED_MORE
            j += 2
        else:
            j += 1
    return NO_MATCH if j - i < seg.min else j


@dataclass(slots=True)
class ShapeMatch:
    start: int
    end: int  # end of the whole match (the shape does not match again before it)
    redact_start: int
    redact_end: int
    name: bytes


def match_shape(shape: Shape, s: bytes, p: int, eof: bool) -> ShapeMatch | int:
    """The shape matched at s[p:] (the caller checked `not_after`), NO_MATCH or NEED_MORE."""
    i = p
    bounds: list[tuple[int, int]] = []
    for k, seg in enumerate(shape.segments):
        end = match_segment(seg, s, i, eof)
        if end == NEED_MORE:
            return NEED_MORE
        if end == NO_MATCH:
            if shape.optional_from != -1 and k >= shape.optional_from:
                del bounds[shape.optional_from :]
                i = bounds[-1][1]
                break
            return NO_MATCH
        bounds.append((i, end))
        i = end
    rejected = False
    if shape.not_before:
        if i == len(s):
            if not eof:
                return NEED_MORE
        elif s[i] in shape.not_before:
            rejected = True
    last = min(shape.redact_to, len(bounds)) - 1
    if shape.redact_from < len(bounds) and last >= shape.redact_from:
        r0, r1 = bounds[shape.redact_from][0], bounds[last][1]
    else:
        r0 = r1 = i
    if not rejected and shape.validated:
        # The body: the redacted segments, less the opening literal (a prefix is not random).
        first = max(shape.redact_from, 1)
        b0 = bounds[first][0] if first <= last else r1
        rejected = not shape.body_ok(s[b0:r1]) or (
            # what it would redact is a credential its publisher gives out as an example
            shape.placeholder_filter is Placeholder.TOKEN and s[r0:r1] in PUBLISHED_EXAMPLES
        )
    if rejected:
        # Redacts nothing, but like a match it is not overlapped by the shape's next one: each
        # byte inside it would otherwise start another scan of up to the shape's length.
        return ShapeMatch(p, i, i, i, b"")
    if 0 <= shape.name_from < len(bounds):
        a, b = bounds[shape.name_from]
        name = s[a:b]
    else:
        name = shape.name.encode()
    return ShapeMatch(p, i, r0, r1, name)


class Tables:
    """Lookup tables over a `Patterns`, built once and shared (read-only) by all streams."""

    def __init__(self, patterns: Patterns) -> None:
        self.patterns = patterns
        self.window: dict[bytes, int] = {}  # 8-byte run of a raw secret -> first literal holding it
        self.anchored: dict[bytes, list[int]] = {}  # first 8 bytes of a whole literal -> literals
        self.short: dict[int, dict[bytes, int]] = {}  # length -> whole literal < 8 bytes -> index
        self.tails: set[bytes] = set()  # proper prefixes (< 8 bytes) of anything above
        for index, literal in enumerate(patterns.literals):
            value = literal.value
            if literal.window:
                for j in range(len(value) - WINDOW + 1):
                    run = value[j : j + WINDOW]
                    self.window.setdefault(run, index)
                    self.tails.update(run[:k] for k in range(1, WINDOW))
            elif len(value) >= WINDOW:
                self.anchored.setdefault(value[:WINDOW], []).append(index)
                self.tails.update(value[:k] for k in range(1, WINDOW))
            else:
                self.short.setdefault(len(value), {}).setdefault(value, index)
                self.tails.update(value[:k] for k in range(1, len(value)))
        # Shapes by the case-folded first three bytes of their opening literal.
        self.by_prefix: dict[bytes, list[int]] = {}
        for k, shape in enumerate(patterns.shapes):
            self.by_prefix.setdefault(shape.segments[0].literal[:3].lower(), []).append(k)
        self.shape_base = len(patterns.literals)


@dataclass(slots=True)
class Span:
    start: int
    end: int
    priority: int
    name: bytes


@dataclass(slots=True)
class Scan:
    spans: list[Span]
    live: list[int]  # positions where a match may still begin (more text needed)
    shape_matches: list[tuple[int, ShapeMatch]]  # (shape index, match) in position order


def scan(
    tables: Tables, s: bytes, eof: bool, prev: int, next_allowed: list[int], base: int = 0
) -> Scan:
    """Every match in skeleton s (positions are base + index); prev: the byte before s or -1."""
    patterns = tables.patterns
    literals = patterns.literals
    n = len(s)
    spans: list[Span] = []
    live: list[int] = []
    for p in range(n):
        run = s[p : p + WINDOW]
        if len(run) == WINDOW:
            index = tables.window.get(run)
            if index is not None:
                spans.append(
                    Span(base + p, base + p + WINDOW, index, literals[index].name.encode())
                )
            for index in tables.anchored.get(run, ()):
                value = literals[index].value
                if s.startswith(value, p):
                    spans.append(
                        Span(base + p, base + p + len(value), index, literals[index].name.encode())
                    )
                elif not eof and n - p < len(value) and value.startswith(s[p:]):
                    live.append(base + p)
        elif not eof and run in tables.tails:
            live.append(base + p)
        for length, table in tables.short.items():
            if p + length <= n:
                index_or_none = table.get(s[p : p + length])
                if index_or_none is not None:
                    spans.append(
                        Span(
                            base + p,
                            base + p + length,
                            index_or_none,
                            literals[index_or_none].name.encode(),
                        )
                    )
    # Shapes: one pass; each shape keeps its own next position (it does not overlap itself) and
    # stops at its first attempt that runs off the end of the text.
    shape_matches: list[tuple[int, ShapeMatch]] = []
    shapes = patterns.shapes
    next_at = [max(allowed - base, 0) for allowed in next_allowed]
    stopped = [False] * len(shapes)
    for p in range(n):
        candidates = tables.by_prefix.get(s[p : p + 3].lower(), ())
        if not candidates and not eof and n - p < 3:
            tail = s[p:].lower()
            candidates = [
                k for k, sh in enumerate(shapes) if sh.segments[0].literal.lower().startswith(tail)
            ]
        for k in candidates:
            if stopped[k] or p < next_at[k]:
                continue
            shape = shapes[k]
            before = s[p - 1] if p > 0 else prev
            if before in shape.not_after:
                continue
            result = match_shape(shape, s, p, eof)
            if isinstance(result, ShapeMatch):
                shape_matches.append((k, result))
                if result.redact_end > result.redact_start:
                    spans.append(
                        Span(
                            base + result.redact_start,
                            base + result.redact_end,
                            tables.shape_base + k,
                            result.name,
                        )
                    )
                next_at[k] = result.end
            elif result == NEED_MORE:
                live.append(base + p)
                stopped[k] = True
    return Scan(spans, live, shape_matches)


def render(
    split_: Split, spans: Iterable[Span], upto: int, base: int, open_end: int
) -> tuple[bytes, int]:
    """Output for skeleton bytes [base, base + upto) and the end of the group left open."""
    out = bytearray()
    groups: list[tuple[int, int, bytes]] = []  # (start, end, name), merged
    lead_end = open_end  # the group a previous call opened, extended by what overlaps it
    for span in sorted(spans, key=lambda sp: (sp.start, sp.priority, -sp.end)):
        if span.start >= base + upto:
            break
        if groups and span.start < groups[-1][1]:
            start, end, name = groups[-1]
            groups[-1] = (start, max(end, span.end), name)
        elif not groups and span.start < lead_end:
            lead_end = max(lead_end, span.end)
        else:
            groups.append((span.start, span.end, span.name))
    g = 0
    for k in range(upto):
        pos = base + k
        if pos < lead_end:
            continue  # inside the group a previous call opened (its marker is out already)
        while g < len(groups) and pos >= groups[g][1]:
            g += 1
        if g < len(groups) and groups[g][0] <= pos:
            if pos == groups[g][0]:
                out += split_.before[k] + marker(groups[g][2])
            continue
        out += split_.before[k]
        out.append(split_.skeleton[k])
    cur_end = groups[-1][1] if groups else lead_end
    return bytes(out), cur_end


def scrub_whole(tables: Tables, data: bytes) -> bytes:
    """The scrubbed form of a complete input: the definition every stream must agree with."""
    parts = split(cap_zero_width(data), eof=True)
    found = scan(tables, parts.skeleton, True, -1, [0] * len(tables.patterns.shapes))
    out, _ = render(parts, found.spans, len(parts.skeleton), 0, 0)
    return out + parts.trailing


class ReferenceStream:
    """One stream's state over shared `Tables`: feed chunks, then flush once."""

    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self._cap = ZeroWidthCap()
        self._raw = b""  # pending input (after the cap), not yet released
        self._base = 0  # skeleton position of the first pending skeleton byte
        self._prev = -1  # the skeleton byte before it
        self._open_end = 0  # end of a redaction group that began in released output
        self._next_allowed = [0] * len(tables.patterns.shapes)
        self._flushed = False

    @property
    def pending(self) -> int:
        return len(self._raw) + self._cap.carried

    @property
    def held(self) -> bytes:
        """The pending text after the zero-width cap (for tests: its skeleton is bounded)."""
        return self._raw

    def feed(self, chunk: bytes) -> bytes:
        if self._flushed:
            raise ValueError("feed after flush")
        self._raw += self._cap.feed(chunk)
        return self._advance(eof=False)

    def flush(self) -> bytes:
        if self._flushed:
            raise ValueError("flush twice")
        self._raw += self._cap.flush()
        out = self._advance(eof=True)
        self._flushed = True
        return out

    def _advance(self, eof: bool) -> bytes:
        parts = split(self._raw, eof)
        s = parts.skeleton
        n = len(s)
        base = self._base
        found = scan(self._tables, s, eof, self._prev, self._next_allowed, base)
        upto = n if not found.live else min(found.live) - base
        # A finished key/value match that began before the cut but redacts after it: cut at its
        # start, so the next rescan finds it again.
        moved = True
        while moved:
            moved = False
            for _, m in found.shape_matches:
                if m.start < upto <= m.redact_start and m.redact_end > m.redact_start:
                    upto = m.start
                    moved = True
        out, group_end = render(parts, found.spans, upto, base, self._open_end)
        for k, m in found.shape_matches:
            if m.start < upto:
                self._next_allowed[k] = max(self._next_allowed[k], base + m.end)
        if upto:
            self._prev = s[upto - 1]
        self._open_end = group_end if group_end > base + upto else 0
        self._base = base + upto
        if eof:
            self._raw = b""
            return out + parts.trailing + parts.held
        cut = parts.starts[upto] if upto < n else parts.trailing_start
        self._raw = self._raw[cut:]
        return out
