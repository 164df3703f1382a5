"""The scrubber's second stage: known values in any form an agent can trivially decode.

This is the reference (plain Python, written to be read): it *defines* stage 2's output. The C
engine (`src/fold.c`, wrapper `scrub_fold_native.py`) must produce the same bytes for every
input, secret set and chunking (tests/test_scrub_fold.py, fuzz/fuzz_scrub_fold_differential.py).
`native.scrub.Scrubber` runs it over the output of stage 1 (the exact-value and shape engine),
only for secrets that pass the gate.

Theory of operation
-------------------
1. **Units.** The raw bytes are decoded left to right into units, each covering a raw span
   `[rs, re)` and standing for a code point or IGNORED:
   - ANSI (ECMA-48): ESC `[` then parameter bytes 0x30-0x3F, intermediate bytes 0x20-0x2F and
     one final byte 0x40-0x7E, at most `ANSI_CSI_MAX` bytes in all; ESC `]` up to BEL or
     ESC `\\` (an OSC string), at most `ANSI_OSC_MAX` bytes; any other ESC alone: IGNORED.
   - Percent (RFC 3986 2.1), repeatedly: `%` then up to four `25` then two hex digits is the
     byte of the last two (`%41`, `%2541`, `%252541` are all `A`); a byte >= 0x80 is IGNORED
     (no UTF-8 is rebuilt from percent-escapes). `%2525` is `%`.
   - Character references (HTML, XML): `&` then up to four `amp;` (an escaped `&`) then
     `#` 1-7 decimal digits or `#x` 1-6 hex digits, optional `;` -> that code point; or a name
     `amp lt gt quot apos nbsp` and `;` -> its character.
   - Escapes (C, JavaScript, JSON, Python): `\\x` 2 hex, `\\u` 4 hex, `\\u{` 1-6 hex `}`,
     `\\U` 8 hex, `\\` 3 octal digits -> that code point (a surrogate is IGNORED);
     `\\n \\r \\t \\b \\f \\v` -> IGNORED (JSON text with a line break between characters).
   - A stage-1 marker: `[REDACTED:` + a name + `]`, the name one of the tables' `markers` (the
     names stage 1 writes, compared in ASCII lower case) -> BREAK. It is released at once and
     never in part, and hides nothing: inside a secret's characters it only cuts them into
     parts (as any inserted letter would), each still matched if it is 16+ characters long; a
     marker with another name is read as text (a name copied from the text by an agent could
     otherwise carry a secret's form past this stage).
   - Otherwise one UTF-8 character (a well-formed sequence, RFC 3629) -> its code point; a byte
     that does not start one is IGNORED (one byte).
   A unit whose decision needs bytes past the end of the input (not at the end of the stream)
   is *unfinished*: decoding stops before it.
2. **Fold.** Each code point maps through the generated table (`scrub_fold_table`, built from
   `unicodedata` by `build_fold_table.py`; the C engine reads the same rows): ASCII letters and
   digits, every code point whose NFKC form is one (fullwidth, mathematical alphanumerics,
   circled digits, superscripts...) and every letter that is one with diacritics (NFKD less its
   combining marks: `e` for `\u00e9`) become a *folded character*, letters lowered. Everything
   else is IGNORED: NUL, controls, format characters and combining marks, white space,
   punctuation, symbols, other scripts, bytes that are not UTF-8 -- so no character inserted
   between the characters of a secret hides it. Decoding is one level: what a unit decodes to
   is not decoded again (except the repeated `%25` and `&amp;`).
3. **View.** The folded characters, each with its unit's raw span, and BREAKs between them: a
   BREAK unit, or a gap of more than `MAX_GAP` IGNORED units or more than `GAP_BYTES` raw bytes
   between two folded characters. This bounds how far apart the characters of one secret may
   be, and what a stream holds back.
4. **Forms and windows.** For each secret that passes the gate (its folded raw value has at
   least `MIN_FOLDED` characters and `MIN_ENTROPY` bits of Shannon entropy per character; a
   weaker one is still caught raw and in its exact encodings by stage 1): the folded value, its
   reverse, its ROT13 and the ROT13 of its reverse, its hex, its base64 at the three byte
   alignments and its base32 at the five (only the characters made of the value's own bits, as
   `scrub_patterns` does; base64url and MIME line breaks fold to the same). UTF-16 needs no
   form (its NULs are IGNORED). Every run of `W` folded characters of a form is a window; a
   piece between BREAKs of a form shorter than `W` is matched whole if it has at least
   `MIN_SHORT` characters. First secret in configuration order owns a window both hold.
5. **Matches and groups.** At each view position where `W` (or a short piece's length)
   consecutive folded characters with no BREAK between them are a window: a match. Matches,
   sorted by (start, secret, longest first), merge while they overlap (touching ones stay
   apart) into groups of at most `GROUP_CAP` folded characters: a match that would make a group
   longer is dropped (the next group begins at the first match after the full one; for a
   non-periodic secret a group never fills). A group's raw span runs from its first unit's `rs`
   to its last unit's `re` (IGNORED units inside go with it) and becomes `[REDACTED:<name>]`,
   named by its first match.

Streaming: a stream keeps the pending raw bytes (from a unit boundary, so decoding resumes
exactly) and decodes them again on each feed. Everything before the first folded character
that may still change is final and released. That is, among the last `W - 1` folded characters
after the last BREAK, the first that could begin a window: the `GRAM` (6) characters from it
are a 6-gram of some window (`FoldTables.grams`), or fewer than `GRAM` follow it; or the start
of a group reaching past it; or (when the view ends in a BREAK) the end of what was decoded.
This is conservative: a match not yet complete begins with a prefix of a window, whose first
6 characters (if it has 6) are in `grams`, so it starts at or after the cut, and a group
ending before the cut cannot grow. Ordinary text thus waits by at most 5 folded characters
(and the IGNORED units after them). A BREAK before the pending text changes nothing after it,
so no other state is carried. The bound (`FoldTables.hold_bound_bytes`):
`GROUP_CAP + W - 1` folded characters, each with its unit and the gap after it, plus an
unfinished unit.
"""

from __future__ import annotations

import base64
import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from native.scrub_fold_table import ROWS

W = 16
MIN_SHORT = 12
MIN_FOLDED = 16
MIN_ENTROPY = 3.0
MAX_GAP = 8
GAP_BYTES = 64
GROUP_CAP = 1024
ANSI_CSI_MAX = 32
ANSI_OSC_MAX = 256
# The longest unit that stands for a folded character: `&` + 4 x `amp;` + `#x` + 6 hex + `;`.
MAX_CHAR_UNIT = 26
# The longest a unit may need to read before it is decided (an OSC string and one more byte; a
# stage-1 marker needs at most `[REDACTED:` + 64 + 1 bytes, fewer).
MAX_LOOKAHEAD = ANSI_OSC_MAX + 1

# The most raw bytes a stream ever holds: `GROUP_CAP + W - 1` folded characters, each with its
# unit and the gap after it, and an unfinished unit after the last gap.
HOLD_BOUND_BYTES = (GROUP_CAP + W - 1) * (MAX_CHAR_UNIT + GAP_BYTES) + MAX_LOOKAHEAD

IGNORED = -1
BREAK = -2
NEED_MORE = -3
# A stage-1 marker: `[REDACTED:` + a name (1-64 of the secret-name alphabet) + `]`.
MARKER_OPEN = b"[REDACTED:"
MAX_NAME = 64
# A window's 6-grams: the hold of a stream starts at the first of its last characters that could
# begin a window (`GRAM` or more characters that are a gram of one, or fewer than `GRAM` left).
GRAM = 6

_STARTS = [row[0] for row in ROWS]
_NAMED = {b"amp;": 0x26, b"lt;": 0x3C, b"gt;": 0x3E, b"quot;": 0x22, b"apos;": 0x27, b"nbsp;": 0x20}
_SIMPLE_ESCAPES = frozenset(b"nrtbfv")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")
_OCTAL = frozenset(b"01234567")
_ALNUM = frozenset(b"0123456789abcdefghijklmnopqrstuvwxyz")
_NAME_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:@/+-")


def marker(name: bytes) -> bytes:
    return b"[REDACTED:" + name + b"]"


def fold_code_point(cp: int) -> int:
    """The folded character (a byte of 0-9a-z), or IGNORED."""
    k = bisect.bisect_right(_STARTS, cp) - 1
    if k < 0:
        return IGNORED
    first, last, value, step = ROWS[k]
    if cp > last:
        return IGNORED
    return value + (cp - first) * step


class _Reader:
    """Bytes of the input; a read past the end marks the unit as needing more."""

    __slots__ = ("data", "n", "short")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.n = len(data)
        self.short = False

    def at(self, j: int) -> int:
        if j < self.n:
            return self.data[j]
        self.short = True
        return -1


def _hex_run(r: _Reader, j: int, lo: int, hi: int) -> tuple[int, int]:
    """Up to hi hex digits at j: (value, end), or (-1, j) if fewer than lo."""
    k = j
    while k - j < hi and r.at(k) in _HEX:
        k += 1
    if k - j < lo:
        return -1, j
    return int(r.data[j:k], 16), k


def _percent(r: _Reader, i: int) -> tuple[int, int] | None:
    j = i + 1
    k = 0
    while k < 4 and r.at(j) == 0x32 and r.at(j + 1) == 0x35:
        j += 2
        k += 1
    if r.at(j) in _HEX and r.at(j + 1) in _HEX:
        return j + 2, int(r.data[j : j + 2], 16)
    if k:
        return j, 0x25  # the last `25` is the escaped byte itself: `%25` is `%`
    return None


def _entity(r: _Reader, i: int) -> tuple[int, int] | None:
    j = i + 1
    k = 0
    while k < 4 and all(r.at(j + m) == c for m, c in enumerate(b"amp;")):
        j += 4
        k += 1
    cp = -1
    end = j
    if r.at(j) == 0x23:  # '#'
        if r.at(j + 1) in (0x78, 0x58):  # 'x' 'X'
            cp, end = _hex_run(r, j + 2, 1, 6)
        else:
            m = j + 1
            while m - j - 1 < 7 and r.at(m) in _DIGITS:
                m += 1
            if m > j + 1:
                cp, end = int(r.data[j + 1 : m]), m
        if cp >= 0:
            if r.at(end) == 0x3B:  # ';'
                end += 1
            return end, cp
    else:
        for name, value in _NAMED.items():
            if all(r.at(j + m) == c for m, c in enumerate(name)):
                return j + len(name), value
    if k:
        return j, 0x26  # the last `amp;` is the escaped `&` itself
    return None


def _escape(r: _Reader, i: int) -> tuple[int, int] | None:
    c = r.at(i + 1)
    if c == 0x78:  # \xHH
        cp, end = _hex_run(r, i + 2, 2, 2)
    elif c == 0x75:  # \uHHHH or \u{H...}
        if r.at(i + 2) == 0x7B:
            cp, end = _hex_run(r, i + 3, 1, 6)
            if cp < 0 or r.at(end) != 0x7D:
                return None
            end += 1
        else:
            cp, end = _hex_run(r, i + 2, 4, 4)
    elif c == 0x55:  # \UHHHHHHHH
        cp, end = _hex_run(r, i + 2, 8, 8)
    elif c in _OCTAL:
        if r.at(i + 2) in _OCTAL and r.at(i + 3) in _OCTAL:
            return i + 4, int(r.data[i + 1 : i + 4], 8)
        return None
    elif c in _SIMPLE_ESCAPES:
        return i + 2, 0  # a control character: IGNORED
    else:
        return None
    if cp < 0:
        return None
    return end, cp


def _ansi(r: _Reader, i: int) -> int:
    """End of an ANSI escape sequence at i (ESC); ESC alone is one byte."""
    c = r.at(i + 1)
    if c == 0x5B:  # CSI
        j = i + 2
        while j - i < ANSI_CSI_MAX and 0x30 <= r.at(j) <= 0x3F:
            j += 1
        while j - i < ANSI_CSI_MAX and 0x20 <= r.at(j) <= 0x2F:
            j += 1
        if j - i < ANSI_CSI_MAX and 0x40 <= r.at(j) <= 0x7E:
            return j + 1
        return i + 1
    if c == 0x5D:  # OSC, ended by BEL or ST (ESC \)
        j = i + 2
        while j - i < ANSI_OSC_MAX:
            b = r.at(j)
            if b < 0:
                break
            if b == 0x07:
                return j + 1
            if b == 0x1B:
                if j + 1 - i < ANSI_OSC_MAX and r.at(j + 1) == 0x5C:
                    return j + 2
                break
            j += 1
        return i + 1
    return i + 1


def _utf8(r: _Reader, i: int) -> tuple[int, int]:
    """(end, code point) of the UTF-8 character at i, or (i + 1, IGNORED)."""
    b = r.data[i]
    if b < 0x80:
        return i + 1, b
    if 0xC2 <= b <= 0xDF:
        need, cp, lo, hi = 1, b & 0x1F, 0x80, 0xBF
    elif 0xE0 <= b <= 0xEF:
        need, cp = 2, b & 0x0F
        lo, hi = (0xA0, 0xBF) if b == 0xE0 else (0x80, 0x9F) if b == 0xED else (0x80, 0xBF)
    elif 0xF0 <= b <= 0xF4:
        need, cp = 3, b & 0x07
        lo, hi = (0x90, 0xBF) if b == 0xF0 else (0x80, 0x8F) if b == 0xF4 else (0x80, 0xBF)
    else:
        return i + 1, IGNORED
    for k in range(1, need + 1):
        c = r.at(i + k)
        if not lo <= c <= hi:
            return i + 1, IGNORED
        cp = (cp << 6) | (c & 0x3F)
        lo, hi = 0x80, 0xBF
    return i + 1 + need, cp


def _marker(r: _Reader, i: int, markers: frozenset[bytes]) -> int:
    """End of a stage-1 marker at i (`[`) whose name is one of markers (lower case), or -1."""
    if not all(r.at(i + m) == c for m, c in enumerate(MARKER_OPEN)):
        return -1
    a = j = i + len(MARKER_OPEN)
    while j - a < MAX_NAME and r.at(j) in _NAME_CHARS:
        j += 1
    if j == a or r.at(j) != 0x5D:  # ']'
        return -1
    return j + 1 if r.data[a:j].lower() in markers else -1


def next_unit(
    data: bytes, i: int, eof: bool, markers: frozenset[bytes] = frozenset()
) -> tuple[int, int]:
    """(end, kind) of the unit at data[i]: kind is a folded byte, IGNORED or BREAK; or
    (i, NEED_MORE) when deciding it needs bytes past the end and this is not the end."""
    r = _Reader(data)
    b = data[i]
    end, kind = i + 1, IGNORED
    if b == 0x1B:
        end, kind = _ansi(r, i), IGNORED
    elif b == 0x5B and markers and (m := _marker(r, i, markers)) >= 0:
        end, kind = m, BREAK
    else:
        decoded: tuple[int, int] | None = None
        if b == 0x25:
            decoded = _percent(r, i)
            if decoded is not None and decoded[1] >= 0x80:
                decoded = (decoded[0], 0x110000)  # a decoded byte >= 0x80: IGNORED
        elif b == 0x26:
            decoded = _entity(r, i)
        elif b == 0x5C:
            decoded = _escape(r, i)
        if decoded is None:
            end, cp = _utf8(r, i)
            kind = cp if cp == IGNORED else fold_code_point(cp)
        else:
            end, kind = decoded[0], fold_code_point(decoded[1])
    if r.short and not eof:
        return i, NEED_MORE
    return end, kind


@dataclass(slots=True)
class View:
    chars: bytearray  # the folded characters
    rs: list[int]  # rs[k], re[k]: the raw span of folded character k's unit
    re: list[int]
    run_start: list[int]  # the first folded character after the last BREAK before k
    end_break: bool  # a BREAK after the last folded character
    parsed: int  # raw bytes decoded (the rest is an unfinished unit)


def view(data: bytes, eof: bool, markers: frozenset[bytes] = frozenset()) -> View:
    v = View(bytearray(), [], [], [], False, 0)
    i, n = 0, len(data)
    gap_units = gap_bytes = 0
    broken = True  # a BREAK since the last folded character (the start counts as one)
    while i < n:
        end, kind = next_unit(data, i, eof, markers)
        if kind == NEED_MORE:
            break
        if kind == BREAK:
            broken = True
        elif kind >= 0:
            k = len(v.chars)
            v.chars.append(kind)
            v.rs.append(i)
            v.re.append(end)
            v.run_start.append(k if broken else v.run_start[k - 1])
            broken = False
            gap_units = gap_bytes = 0
        else:
            gap_units += 1
            gap_bytes += end - i
            if gap_units > MAX_GAP or gap_bytes > GAP_BYTES:
                broken = True
        i = end
    v.end_break = broken
    v.parsed = i
    return v


def folded_pieces(data: bytes) -> list[bytes]:
    """The folded characters of data, cut at its BREAKs."""
    v = view(data, eof=True)
    pieces: list[bytes] = []
    for k, c in enumerate(v.chars):
        if not pieces or v.run_start[k] == k:
            pieces.append(b"")
        pieces[-1] += bytes([c])
    return pieces


def entropy(text: bytes) -> float:
    """Shannon entropy in bits per character."""
    if not text:
        return 0.0
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values())


def qualifies(value: bytes) -> bool:
    folded = b"".join(folded_pieces(value))
    return len(folded) >= MIN_FOLDED and entropy(folded) >= MIN_ENTROPY


_ROT13 = bytes.maketrans(b"abcdefghijklmnopqrstuvwxyz", b"nopqrstuvwxyzabcdefghijklm")


def _bit_cores(
    value: bytes, encode: Callable[[bytes], bytes], group_bits: int, alignments: int
) -> list[bytes]:
    """The characters of encode(padding + value) made only of the value's bits, per alignment,
    folded (base64's `+` and `/` are separators)."""
    out = []
    for align in range(alignments):
        text = encode(b"\0" * align + value)
        first = -(-8 * align // group_bits)
        whole = 8 * (align + len(value)) // group_bits
        out.append(bytes(c for c in text[first:whole].lower() if c in _ALNUM))
    return out


def forms(value: bytes) -> list[list[bytes]]:
    """Each derived form of a secret as its folded pieces (see the module docstring)."""
    raw = folded_pieces(value)
    return [
        raw,
        [p[::-1] for p in reversed(raw)],
        [p.translate(_ROT13) for p in raw],
        [p[::-1].translate(_ROT13) for p in reversed(raw)],
        [value.hex().encode()],
        *([core] for core in _bit_cores(value, base64.b64encode, 6, 3)),
        *([core] for core in _bit_cores(value, base64.b32encode, 5, 5)),
    ]


def qualified_pieces(
    secrets: Iterable[tuple[str, bytes]],
) -> tuple[list[bytes], Iterator[tuple[int, bytes]]]:
    """The names of the secrets that pass the gate, and (index into them, piece) for every
    piece of at least `MIN_SHORT` characters of each one's forms, in order."""
    kept = [(name.encode(), value) for name, value in secrets if qualifies(value)]

    def pieces() -> Iterator[tuple[int, bytes]]:
        for index, (_, value) in enumerate(kept):
            for form in forms(value):
                for piece in form:
                    if len(piece) >= MIN_SHORT:
                        yield index, piece

    return [name for name, _ in kept], pieces()


def marker_set(secrets: Iterable[tuple[str, bytes]], names: Iterable[str]) -> frozenset[bytes]:
    """The marker names stage 2 takes for a BREAK, lower case: every secret's and `names`
    (those stage 1 writes), if they are of the name alphabet."""
    out = set()
    for name in [n for n, _ in secrets] + list(names):
        raw = name.encode()
        if 1 <= len(raw) <= MAX_NAME and all(c in _NAME_CHARS for c in raw):
            out.add(raw.lower())
    return frozenset(out)


class FoldTables:
    """Stage 2's windows for a set of secrets: built once, read-only, shared by all streams.
    `marker_names`: names of stage-1 markers besides the secrets' own (its shapes')."""

    def __init__(
        self, secrets: Iterable[tuple[str, bytes]], marker_names: Iterable[str] = ()
    ) -> None:
        secrets = list(secrets)
        self.markers = marker_set(secrets, marker_names)
        self.names, pieces = qualified_pieces(secrets)
        # length -> window -> index into names (the first secret holding it)
        self.windows: dict[int, dict[bytes, int]] = {}
        self.grams: set[bytes] = set()  # every GRAM characters of every window
        for index, piece in pieces:
            self.grams.update(piece[j : j + GRAM] for j in range(len(piece) - GRAM + 1))
            if len(piece) >= W:
                table = self.windows.setdefault(W, {})
                for j in range(len(piece) - W + 1):
                    table.setdefault(piece[j : j + W], index)
            else:
                self.windows.setdefault(len(piece), {}).setdefault(piece, index)
        self.lengths = sorted(self.windows)

    def __bool__(self) -> bool:
        return bool(self.names)

    def scrub(self, data: bytes) -> bytes:
        return fold_whole(self, data)

    def stream(self) -> FoldStream:
        return FoldStream(self)

    @property
    def hold_bound_bytes(self) -> int:
        return HOLD_BOUND_BYTES


@dataclass(slots=True)
class Group:
    start: int  # folded character positions [start, end)
    end: int
    index: int  # the secret that names it
    full: bool = False


def groups(tables: FoldTables, v: View) -> list[Group]:
    chars, run_start = v.chars, v.run_start
    n = len(chars)
    spans: list[tuple[int, int, int]] = []  # (start, secret, -end)
    for p in range(n):
        for length in tables.lengths:
            q = p + length
            if q > n or run_start[q - 1] > p:
                continue
            index = tables.windows[length].get(bytes(chars[p:q]))
            if index is not None:
                spans.append((p, index, -q))
    spans.sort()
    out: list[Group] = []
    for start, index, neg_end in spans:
        end = -neg_end
        if out and start < out[-1].end:
            g = out[-1]
            if g.full or end <= g.end:
                continue
            if end - g.start > GROUP_CAP:
                g.full = True  # dropped; the next group starts after this one
                continue
            g.end = end
            continue
        out.append(Group(start, end, index))
    return out


def render(tables: FoldTables, data: bytes, v: View, found: list[Group], upto: int) -> bytes:
    """data[:upto] with each group that starts before it replaced by its marker."""
    out = bytearray()
    pos = 0
    for g in found:
        a, b = v.rs[g.start], v.re[g.end - 1]
        if a >= upto:
            break
        out += data[pos:a]
        out += marker(tables.names[g.index])
        pos = b
    out += data[pos:upto]
    return bytes(out)


def fold_whole(tables: FoldTables, data: bytes) -> bytes:
    """Stage 2 over a complete input: the definition every stream must agree with."""
    v = view(data, True, tables.markers)
    return render(tables, data, v, groups(tables, v), len(data))


class FoldStream:
    """One stream's state over shared `FoldTables`: feed chunks, then flush once."""

    __slots__ = ("_flushed", "_raw", "_tables")

    def __init__(self, tables: FoldTables) -> None:
        self._tables = tables
        self._raw = b""  # pending input, from a unit boundary
        self._flushed = False

    @property
    def pending(self) -> int:
        return len(self._raw)

    def feed(self, chunk: bytes) -> bytes:
        if self._flushed:
            raise ValueError("feed after flush")
        self._raw += chunk
        return self._advance(eof=False)

    def flush(self) -> bytes:
        if self._flushed:
            raise ValueError("flush twice")
        self._flushed = True
        return self._advance(eof=True)

    def _advance(self, eof: bool) -> bytes:
        data = self._raw
        tables = self._tables
        v = view(data, eof, tables.markers)
        found = groups(tables, v)
        n = len(v.chars)
        if eof or v.end_break:
            cut, upto = n, v.parsed
        else:
            # The first of the last W - 1 characters of the last run that could begin a window.
            cut = max(v.run_start[n - 1], n - (W - 1))
            while cut < n - (GRAM - 1) and bytes(v.chars[cut : cut + GRAM]) not in tables.grams:
                cut += 1
            for g in found:
                if g.end > cut:
                    cut = min(cut, g.start)
                    break
            upto = v.rs[cut]
        if eof:
            upto = len(data)
        out = render(self._tables, data, v, [g for g in found if g.start < cut], upto)
        self._raw = data[upto:]
        return out
