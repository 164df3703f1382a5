"""What the scrubber looks for: known secret values in every encoding, and secret shapes.

Both engines (the Python reference in `scrub_reference.py` and the C one in `src/scrub.c`) take
the same compiled `Patterns`; this module is where the meaning of "a credential appears in this
text" is written down. Nothing here scans text.

Known values become *literals*:

- the raw value is a **window** literal: any run of `WINDOW` (8) bytes of it is a match, so a
  half-leaked key is caught (a value shorter than 8 bytes must appear whole);
- each encoding of it is a **whole** literal, matched only complete: base64 (standard and
  URL-safe, the value at each of the three alignments inside a longer base64 text, with and
  without its last partial character and padding), percent-encoding (reserved bytes only, `+`
  for space, every byte in upper and in lower hex), hex (lower, upper), JSON string escaping
  (minimal, ASCII-only, `\\/`, every character as `\\u00XX` in both cases) and the reversed value.
  An encoding shorter than `MIN_ENCODED` bytes is dropped: it would match ordinary text.

Shapes are small possessive patterns (no backtracking, so scanning stays linear) written as a
sequence of segments: a literal (optionally ASCII case-insensitive), a byte class repeated
`min..max` times (optionally stopping before a literal, optionally required to end with one of
some suffixes), or the body of a JSON string (backslash escapes included). A shape says which of
its segments are redacted and where the name in `[REDACTED:<name>]` comes from (its own name, or
a segment of the text: key/value forms keep the key's name). A shape may require that the byte
before it is not in a class (`not_after`), so `sk-` inside `task-...` is not a key. Segments from
`optional_from` on may be missing (a PEM block cut before its END line is still redacted).
"""

from __future__ import annotations

import base64
import enum
import json
import re
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

WINDOW = 8
MIN_ENCODED = 8
MAX_SECRET_LEN = 64 * 1024
# U+200B, U+200C, U+200D, U+2060, U+FEFF in UTF-8: invisible, so they are not allowed to hide a
# secret or a shape. Matching runs on the text with them removed (the "skeleton").
ZERO_WIDTH = (b"\xe2\x80\x8b", b"\xe2\x80\x8c", b"\xe2\x80\x8d", b"\xe2\x81\xa0", b"\xef\xbb\xbf")
# A run of consecutive zero-width characters keeps its first ZW_RUN_MAX; the rest are dropped
# from the output. Text needs no more (an emoji sequence has one joiner between two pictures),
# and without a cap a would-be secret padded with millions of them would have to be held whole:
# with it, a stream holds at most `Patterns.hold_bound_bytes`.
ZW_RUN_MAX = 2
_NAME_RE = re.compile(r"[A-Za-z0-9_.:@/+-]{1,64}\Z")


class PatternError(ValueError):
    """A secret or a shape the scrubber cannot take; the message names it (never the value)."""


@dataclass(frozen=True, slots=True)
class Literal:
    value: bytes
    name: str
    window: bool  # True: any WINDOW-byte run of value matches (the raw value, len >= WINDOW)


class SegmentKind(enum.IntEnum):
    LITERAL = 0
    CLASS = 1
    JSON_STRING = 2


def byte_class(spec: str) -> frozenset[int]:
    """`A-Za-z0-9_-`-style class (a trailing or leading '-' is literal; a leading '^' negates)."""
    negate = spec.startswith("^")
    body = spec[1:] if negate else spec
    members: set[int] = set()
    i = 0
    while i < len(body):
        if i + 2 < len(body) and body[i + 1] == "-":
            lo, hi = ord(body[i]), ord(body[i + 2])
            if lo > hi or hi > 255:
                raise PatternError(f"byte class {spec!r}: bad range {body[i : i + 3]!r}")
            members.update(range(lo, hi + 1))
            i += 3
        else:
            if ord(body[i]) > 255:
                raise PatternError(f"byte class {spec!r}: {body[i]!r} is not a byte")
            members.add(ord(body[i]))
            i += 1
    return frozenset(set(range(256)) - members) if negate else frozenset(members)


@dataclass(frozen=True, slots=True)
class Segment:
    kind: SegmentKind
    literal: bytes = b""  # LITERAL: the bytes
    fold_case: bool = False  # LITERAL: ASCII letters match either case
    members: frozenset[int] = frozenset()  # CLASS
    min: int = 0  # CLASS, JSON_STRING: repetitions (bytes; an escape pair counts 2)
    max: int = 0
    stop: bytes = b""  # CLASS: the run ends before this literal
    suffixes: tuple[bytes, ...] = ()  # CLASS: the run must end with one (ASCII case-insensitive)

    @property
    def max_len(self) -> int:
        return len(self.literal) if self.kind is SegmentKind.LITERAL else self.max


def lit(text: bytes, *, fold_case: bool = False) -> Segment:
    return Segment(SegmentKind.LITERAL, literal=text, fold_case=fold_case)


def cls(
    spec: str, lo: int, hi: int, *, stop: bytes = b"", suffixes: tuple[bytes, ...] = ()
) -> Segment:
    return Segment(
        SegmentKind.CLASS, members=byte_class(spec), min=lo, max=hi, stop=stop, suffixes=suffixes
    )


def json_string(lo: int, hi: int) -> Segment:
    return Segment(SegmentKind.JSON_STRING, min=lo, max=hi)


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    segments: tuple[Segment, ...]
    redact_from: int = 0  # segments [redact_from, redact_to) are replaced by the marker
    redact_to: int = -1  # -1: through the last segment
    name_from: int = -1  # -1: the marker says `name`; else the text of this segment
    not_after: frozenset[int] = frozenset()  # the byte before the match must not be one of these
    optional_from: int = -1  # segments from here on may be missing as a group (-1: none)
    max_len: int = field(init=False)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise PatternError(f"shape name {self.name!r}: use 1-64 of A-Za-z0-9_.:@/+-")
        segs = self.segments
        if not segs or segs[0].kind is not SegmentKind.LITERAL or len(segs[0].literal) < 3:
            # The prefilter keys on the first three bytes of every shape.
            raise PatternError(f"shape {self.name!r}: must open with a literal of >= 3 bytes")
        for seg in segs:
            if seg.kind is SegmentKind.LITERAL and not seg.literal:
                raise PatternError(f"shape {self.name!r}: empty literal")
            if seg.kind is not SegmentKind.LITERAL and not (0 <= seg.min <= seg.max <= 65536):
                raise PatternError(f"shape {self.name!r}: repetition {seg.min}..{seg.max}")
            if seg.kind is SegmentKind.CLASS and seg.max == 0:
                raise PatternError(f"shape {self.name!r}: class segment with max 0")
        redact_to = len(segs) if self.redact_to == -1 else self.redact_to
        if not 0 <= self.redact_from < redact_to <= len(segs):
            raise PatternError(f"shape {self.name!r}: redact range out of its segments")
        if self.name_from >= len(segs) or self.optional_from >= len(segs):
            raise PatternError(f"shape {self.name!r}: segment index out of range")
        if self.optional_from == 0:
            raise PatternError(f"shape {self.name!r}: the first segment cannot be optional")
        object.__setattr__(self, "redact_to", redact_to)
        object.__setattr__(self, "max_len", sum(seg.max_len for seg in segs))


TOKEN_CHARS = "A-Za-z0-9_-"  # noqa: S105 (a byte class, not a password)
_BOUNDARY = byte_class(TOKEN_CHARS)


def token_shape(name: str, prefix: bytes, body: str, lo: int, hi: int) -> Shape:
    """`prefix` then `lo..hi` bytes of `body`, not glued to a preceding token character.

    The form of most API keys; also what `[[scrub.shapes]]` in the configuration makes.
    """
    return Shape(name, (lit(prefix), cls(body, lo, hi)), not_after=_BOUNDARY)


def _json_pair(word: bytes) -> Shape:
    # "...<word>": "value" -- the key is kept, the value redacted and named after the key.
    return Shape(
        "json-" + word.decode(),
        (
            lit(word, fold_case=True),
            lit(b'"'),
            cls(" \t", 0, 8),
            lit(b":"),
            cls(" \t", 0, 8),
            lit(b'"'),
            json_string(1, 1024),
        ),
        redact_from=6,
        name_from=0,
    )


def _env_pair(word: bytes) -> Shape:
    # <PREFIX_>WORD=value or WORD="value": upper case only, so code (`password=password`) and
    # prose stay as written.
    return Shape(
        "env-" + word.decode().lower(),
        (lit(word), lit(b"="), cls("\"'", 0, 1), cls("^ \t\r\n\"'`;&|<>()\\", 1, 256)),
        redact_from=3,
        name_from=0,
    )


# Key words of key/value forms: a key *ending* with one of them holds a secret. A bare "token" is
# not one: LLM responses carry `"token": "Hello"` in their log-probabilities.
JSON_KEY_WORDS = (
    b"password",
    b"passwd",
    b"passphrase",
    b"secret",
    b"secret_key",
    b"api_key",
    b"apikey",
    b"api-key",
    b"access_key",
    b"private_key",
    b"access_token",
    b"refresh_token",
    b"auth_token",
    b"bearer_token",
)
ENV_KEY_WORDS = (
    b"PASSWORD",
    b"PASSWD",
    b"PASSPHRASE",
    b"SECRET",
    b"SECRET_KEY",
    b"API_KEY",
    b"APIKEY",
    b"ACCESS_KEY",
    b"PRIVATE_KEY",
    b"_TOKEN",
)

_PEM_LABEL = "A-Z0-9 "
_PEM_BODY = "A-Za-z0-9+/=\r\n\t :,.\\-"

DEFAULT_SHAPES: tuple[Shape, ...] = (
    # PEM and OpenSSH private keys (RSA, EC, DSA, PKCS#8, ENCRYPTED, OPENSSH; PGP blocks). The
    # body runs to the END line; a block cut short is redacted to where its body stops.
    Shape(
        "private-key",
        (
            lit(b"-----BEGIN "),
            cls(_PEM_LABEL, 11, 64, suffixes=(b"PRIVATE KEY", b"PRIVATE KEY BLOCK")),
            lit(b"-----"),
            cls(_PEM_BODY, 0, 16384, stop=b"-----END "),
            lit(b"-----END "),
            cls(_PEM_LABEL, 11, 64),
            lit(b"-----"),
        ),
        optional_from=4,
    ),
    token_shape("anthropic", b"sk-ant-", TOKEN_CHARS, 20, 256),
    token_shape("openai", b"sk-proj-", TOKEN_CHARS, 20, 256),
    token_shape("openai", b"sk-", TOKEN_CHARS, 20, 256),
    token_shape("google", b"AIzaSy", TOKEN_CHARS, 33, 33),
    *(token_shape("github", p, "A-Za-z0-9", 36, 255) for p in (b"ghp_", b"gho_", b"ghs_", b"ghr_")),
    token_shape("github", b"github_pat_", "A-Za-z0-9_", 22, 255),
    Shape(
        "slack",
        (lit(b"xox"), cls("bpar", 1, 1), lit(b"-"), cls("A-Za-z0-9-", 10, 255)),
        not_after=_BOUNDARY,
    ),
    *(token_shape("aws-access-key-id", p, "A-Z0-9", 16, 16) for p in (b"AKIA", b"ASIA")),
    # JWT: header.payload.signature, both JSON parts base64url of '{"' (eyJ).
    Shape(
        "jwt",
        (
            lit(b"eyJ"),
            cls(TOKEN_CHARS, 1, 4096),
            lit(b".eyJ"),
            cls(TOKEN_CHARS, 1, 4096),
            lit(b"."),
            cls(TOKEN_CHARS, 0, 4096),
        ),
        not_after=_BOUNDARY,
    ),
    *(_json_pair(w) for w in JSON_KEY_WORDS),
    *(_env_pair(w) for w in ENV_KEY_WORDS),
)


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise PatternError(f"secret name {name!r}: use 1-64 of A-Za-z0-9_.:@/+-")
    return name


def _base64_variants(value: bytes) -> list[bytes]:
    out: list[bytes] = []
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        for align in range(3):
            text = encode(b"\0" * align + value)
            bits_before, bits_end = 8 * align, 8 * (align + len(value))
            first = -(-bits_before // 6)  # the first character made only of the value's bits
            whole = bits_end // 6  # characters [first, whole) hold only the value's bits
            core = text[first:whole]
            out.append(core)
            if bits_end % 6:  # a last character mixing the value's bits with zero padding
                out.append(text[first : whole + 1])
                out.append(text[first:])  # ... and the '=' padding
    return out


def _percent_variants(value: bytes) -> list[bytes]:
    return [
        urllib.parse.quote(value, safe="").encode(),
        urllib.parse.quote_plus(value, safe="").encode(),
        "".join(f"%{b:02X}" for b in value).encode(),
        "".join(f"%{b:02x}" for b in value).encode(),
    ]


def _json_variants(value: bytes) -> list[bytes]:
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return []
    minimal = json.dumps(text, ensure_ascii=False)[1:-1].encode()
    units = text.encode("utf-16-be")
    code_units = [int.from_bytes(units[i : i + 2], "big") for i in range(0, len(units), 2)]
    return [
        minimal,
        json.dumps(text)[1:-1].encode(),
        minimal.replace(b"/", b"\\/"),
        "".join(f"\\u{u:04x}" for u in code_units).encode(),
        "".join(f"\\u{u:04X}" for u in code_units).encode(),
    ]


def encodings(value: bytes) -> list[bytes]:
    """The encoded forms of a secret value that are matched whole (deduplicated, in order)."""
    candidates = [
        *_base64_variants(value),
        *_percent_variants(value),
        value.hex().encode(),
        value.hex().upper().encode(),
        *_json_variants(value),
        value[::-1],
    ]
    seen = {value}
    out = []
    for enc in candidates:
        if len(enc) >= MIN_ENCODED and enc not in seen:
            seen.add(enc)
            out.append(enc)
    return out


@dataclass(frozen=True, slots=True)
class Patterns:
    """Everything both engines match, in priority order (earlier names a merged redaction)."""

    literals: tuple[Literal, ...]
    shapes: tuple[Shape, ...]
    max_literal_len: int
    max_shape_len: int

    @property
    def hold_bound(self) -> int:
        """The most skeleton bytes a stream ever holds back (a ZW char adds at most 2)."""
        return max(self.max_literal_len, self.max_shape_len, 1) - 1 + self.max_shape_len

    @property
    def hold_bound_bytes(self) -> int:
        """The most raw bytes a stream ever holds back: the skeleton bound, each skeleton byte
        with its run of zero-width characters before it, a run after the last one, and the start
        of a zero-width character that the next chunk may complete."""
        run = ZW_RUN_MAX * 3
        return self.hold_bound * (1 + run) + run + 2


def compile_patterns(
    secrets: Iterable[tuple[str, bytes]], shapes: Sequence[Shape] = DEFAULT_SHAPES
) -> Patterns:
    """Literals for every secret (raw first, then its encodings), in the order given."""
    literals: list[Literal] = []
    seen: set[tuple[bytes, bool]] = set()

    def add(value: bytes, name: str, window: bool) -> None:
        if (value, window) not in seen:
            seen.add((value, window))
            literals.append(Literal(value, name, window))

    pairs = list(secrets)
    for name, value in pairs:
        check_name(name)
        if not value:
            raise PatternError(f"secret {name!r} is empty")
        if len(value) > MAX_SECRET_LEN:
            raise PatternError(f"secret {name!r} is longer than {MAX_SECRET_LEN} bytes")
        add(value, name, len(value) >= WINDOW)
    # Raw values before encodings, so a raw value shared with another secret's encoding is named
    # by the secret that holds it raw.
    for name, value in pairs:
        for enc in encodings(value):
            add(enc, name, False)
    return Patterns(
        literals=tuple(literals),
        shapes=tuple(shapes),
        max_literal_len=max((len(lit.value) for lit in literals), default=0),
        max_shape_len=max((shape.max_len for shape in shapes), default=0),
    )
