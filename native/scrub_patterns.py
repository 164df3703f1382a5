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
before it is not in a class (`not_after`), so `sk-` inside `task-...` is not a key, and that the
byte after it is not in a class (`not_before`; the end of the text is fine), so the first 34
letters of `hf_requiredCharacteristicTypes...` are not a token. Segments from
`optional_from` on may be missing (a PEM block cut before its END line is still redacted).

A shape may also carry post-match validators, run on its *body* (the redacted text minus the
opening literal when that is redacted: `sk_live_` is not part of what is checked) once the match
is complete; a match one of them rejects redacts nothing (the shape goes on after it, as after a
match; other shapes and literals are not affected):

- `check=Check.CRC32_BASE62`: the last 6 characters are the base62 (`0-9A-Za-z`, most significant
  first, zero-padded) CRC-32 (ISO-HDLC, as zlib) of the characters before them: GitHub's
  `ghp_`/`gho_`/`ghu_`/`ghs_`/`ghr_` tokens and npm's `npm_` tokens (30 random + 6 checksum);
- `check=Check.PEM_KEY`: a complete PEM/OpenSSH block's text between its BEGIN and END lines
  holds at least `PEM_MIN_BASE64` base64 characters, room for a key (`pem_key_ok`);
- `min_entropy=e`: the body's collision (Renyi order-2) entropy, in bits per character, is at
  least `e`: n**2 >= 2**e * sum(count**2) over its byte counts, computed in integers
  (`Shape.entropy_k`) so both engines agree exactly, where Shannon entropy would need floating
  point; it is never more than the Shannon entropy, so it is the stricter gate;
- `placeholder_filter=True` (`Placeholder.TOKEN`): the body is not a placeholder
  (`is_placeholder`): a word of
  `PLACEHOLDER_WORDS` anywhere (lower, upper or capitalized: `EXAMPLE`, `xxxx`, `Your`), a run of
  `PLACEHOLDER_RUN` equal bytes or of `PLACEHOLDER_RUN` bytes each one above (or below) the one
  before (`abcdef`, `123456`), a template (`${`, `$(`, `{{`, `%(` or `%{` anywhere; `<...>` or
  `{...}` whole) or a variable reference (`$` then only `A-Z0-9_`). `Placeholder.VALUE`, for
  key/value forms whose value a person chose (a password may well hold a word or `123456`):
  only the templates, the variable reference and the runs of equal bytes (`is_template_value`).
  With `Placeholder.TOKEN`, a match whose redacted text is one of `PUBLISHED_EXAMPLES` (keys a
  provider publishes as examples) is rejected too.
"""

from __future__ import annotations

import base64
import enum
import json
import re
import urllib.parse
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

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


class Check(enum.IntEnum):
    """A check of its structure a shape's body must pass (see the module docstring)."""

    NONE = 0
    CRC32_BASE62 = 1
    PEM_KEY = 2


BASE62 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# Placeholders that code and documentation put where a credential goes (gitleaks' must-not-detect
# examples are mostly these). Lowercase; matched anywhere in the body as written, in upper case
# or capitalized.
# The C engine (src/scrub.c, PLACEHOLDER_WORDS) holds the same list.
PLACEHOLDER_WORDS = (
    b"example",
    b"sample",
    b"dummy",
    b"placeholder",
    b"your",
    b"changeme",
    b"redacted",
    b"xxxx",
    b"fake",
)
# Each word lowercase, upper case or capitalized (`example`, `EXAMPLE`, `Example`): a random
# body has a mixed-case run of these letters far more often than one of the three forms.
_PLACEHOLDER_FORMS = tuple(
    form for word in PLACEHOLDER_WORDS for form in (word, word.upper(), word.capitalize())
)
_TEMPLATE_MARKS = (b"${", b"$(", b"{{", b"%(", b"%{")  # shell, Jinja/Go/Helm, printf templates
_ENV_NAME = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
PLACEHOLDER_RUN = 6  # equal or consecutive bytes: a real random body almost never has 6
_ENTROPY_ONE = 1 << 16  # Shape.entropy_k is 2**min_entropy in 16.16 fixed point
MAX_VALIDATED_LEN = 65536  # a validated body is at most this long (the integers fit 64 bits)


def crc32_base62(data: bytes) -> bytes:
    """The 6-character base62 CRC-32 that GitHub and npm tokens end with."""
    value = zlib.crc32(data)
    out = bytearray()
    for _ in range(6):
        value, digit = divmod(value, 62)
        out.append(BASE62[digit])
    return bytes(reversed(out))


# The base64 characters a complete PEM/OpenSSH block's body must hold to be a key: 43 is the
# base64 of 32 bytes, the smallest secret a private key format carries (an Ed25519 or X25519
# seed, a P-256 scalar); the smallest real block (Ed25519 in PKCS#8) has 64. Below it the block
# is an example (`...PRIVATE KEY-----\nanything\n-----END...`, or empty). A block cut before its
# END line is not judged: what follows may be the key, so it stays redacted.
PEM_MIN_BASE64 = 43
_B64_ALPHABET = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")


def pem_key_ok(body: bytes) -> bool:
    """The body of a `private-key` match (label, `-----`, the block's text, then the END line if
    the block is complete) could hold a key: a block cut short, or one whose text between its
    BEGIN and END lines holds at least `PEM_MIN_BASE64` base64 characters (headers and the
    letters of `\\n` escapes count too: they only err towards redacting)."""
    start = body.find(b"-----")  # the label has no '-': this is the BEGIN line's end
    if start < 0:
        return True
    start += 5
    end = body.find(b"-----END ", start)  # the text stops before the first one
    if end < 0:
        return True
    return sum(1 for b in body[start:end] if b in _B64_ALPHABET) >= PEM_MIN_BASE64


def checksum_ok(check: Check, body: bytes) -> bool:
    if check is Check.CRC32_BASE62:
        return len(body) > 6 and crc32_base62(body[:-6]) == body[-6:]
    if check is Check.PEM_KEY:
        return pem_key_ok(body)
    return True


# Credentials that their publisher gives out as examples, by value: a shape never redacts one
# (it is public by its publisher's word, like `AKIAIOSFODNN7EXAMPLE`, but with nothing in it to
# say so). Each is the exact text the shape would redact; the table applies to shapes with the
# token placeholder filter. A credential the appliance holds is a known value and is redacted
# whatever it is. The C engine (src/scrub.c, PUBLISHED_EXAMPLES) holds the same list.
PUBLISHED_EXAMPLES = frozenset(
    {
        # Google API keys published in Firebase's SDK sources and tests
        # (github.com/firebase/firebase-android-sdk; gitleaks allowlists them by value).
        b"AIzaSyabcdefghijklmnopqrstuvwxyz1234567",
        b"AIzaSyAnLA7NfeLquW1tJFpx_eQCxoX-oo6YyIs",
        b"AIzaSyCkEhVjf3pduRDt6d1yKOMitrUEke8agEM",
        b"AIzaSyDMAScliyLx7F0NPDEJi1QmyCgHIAODrlU",
        b"AIzaSyD3asb-2pEZVqMkmL6M9N6nHZRR_znhrh0",
        b"AIzayDNSXIbFmlXbIE6mCzDLQAqITYefhixbX4A",
        b"AIzaSyAdOS2zB6NCsk1pCdZ4-P6GBdi_UUPwX7c",
        b"AIzaSyASWm6HmTMdYWpgMnjRBjxcQ9CKctWmLd4",
        b"AIzaSyANUvH9H9BsUccjsu2pCmEkOPjjaXeDQgY",
        b"AIzaSyA5_iVawFQ8ABuTZNUdcwERLJv_a_p4wtM",
        b"AIzaSyA4UrcGxgwQFTfaI3no3t7Lt1sjmdnP5sQ",
        b"AIzaSyDSb51JiIcB6OJpwwMicseKRhhrOq1cS7g",
        b"AIzaSyBF2RrAIm4a0mO64EShQfqfd2AFnzAvvuU",
        b"AIzaSyBcE-OOIbhjyR83gm4r2MFCu4MJmprNXsw",
        b"AIzaSyB8qGxt4ec15vitgn44duC5ucxaOi4FmqE",
        b"AIzaSyA8vmApnrHNFE0bApF4hoZ11srVL_n0nvY",
    }
)


def entropy_ok(k: int, body: bytes) -> bool:
    """Collision entropy of body >= log2(k / 2**16) bits per byte, in integers."""
    n = len(body)
    squares = sum(c * c for c in (body.count(bytes([b])) for b in set(body)))
    return n * n * _ENTROPY_ONE >= k * squares


class Placeholder(enum.IntEnum):
    """What `placeholder_filter` refuses (True is TOKEN)."""

    NONE = 0
    TOKEN = 1  # `is_placeholder`: words, runs, templates (a random token has none of them)
    VALUE = 2  # `is_template_value`: a value a person chose (a password) may hold words and runs


def is_template_value(body: bytes) -> bool:
    """A key/value form's value that only stands for one: a template (`${...}`, `{{...}}`,
    `$(...)`, `%(...)s`), `<...>` or `{...}` whole, `$NAME`, or a run of `PLACEHOLDER_RUN` equal
    bytes (`********`, `hf_xxxxxxxxxx`)."""
    if any(mark in body for mark in _TEMPLATE_MARKS):
        return True
    if len(body) >= 2 and (body[0], body[-1]) in ((0x3C, 0x3E), (0x7B, 0x7D)):  # <key>, {Key}
        return True
    if len(body) >= 2 and body[0] == 0x24 and all(b in _ENV_NAME for b in body[1:]):  # $API_KEY
        return True
    run = 1
    for i in range(1, len(body)):
        run = run + 1 if body[i] == body[i - 1] else 1
        if run >= PLACEHOLDER_RUN:
            return True
    return False


def is_placeholder(body: bytes) -> bool:
    if any(form in body for form in _PLACEHOLDER_FORMS):
        return True
    if any(mark in body for mark in _TEMPLATE_MARKS):
        return True
    if len(body) >= 2 and (body[0], body[-1]) in ((0x3C, 0x3E), (0x7B, 0x7D)):  # <key>, {Key}
        return True
    if len(body) >= 2 and body[0] == 0x24 and all(b in _ENV_NAME for b in body[1:]):  # $API_KEY
        return True
    same = up = down = 1
    for i in range(1, len(body)):
        d = body[i] - body[i - 1]
        same = same + 1 if d == 0 else 1
        up = up + 1 if d == 1 else 1
        down = down + 1 if d == -1 else 1
        if max(same, up, down) >= PLACEHOLDER_RUN:
            return True
    return False


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    segments: tuple[Segment, ...]
    redact_from: int = 0  # segments [redact_from, redact_to) are replaced by the marker
    redact_to: int = -1  # -1: through the last segment
    name_from: int = -1  # -1: the marker says `name`; else the text of this segment
    not_after: frozenset[int] = frozenset()  # the byte before the match must not be one of these
    not_before: frozenset[int] = frozenset()  # ... nor the byte after it (the end of the text is)
    optional_from: int = -1  # segments from here on may be missing as a group (-1: none)
    check: Check = Check.NONE  # post-match validators of the body (module docstring)
    min_entropy: float = 0.0
    placeholder_filter: Placeholder | bool = Placeholder.NONE
    max_len: int = field(init=False)
    entropy_k: int = field(init=False)  # 0: no entropy gate; else 2**min_entropy * 2**16

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
        object.__setattr__(self, "placeholder_filter", Placeholder(int(self.placeholder_filter)))
        if not 0.0 <= self.min_entropy <= 8.0:
            raise PatternError(f"shape {self.name!r}: min_entropy {self.min_entropy} not in 0..8")
        object.__setattr__(self, "redact_to", redact_to)
        object.__setattr__(self, "max_len", sum(seg.max_len for seg in segs))
        object.__setattr__(
            self,
            "entropy_k",
            round(2.0**self.min_entropy * _ENTROPY_ONE) if self.min_entropy else 0,
        )
        if self.validated and self.max_len > MAX_VALIDATED_LEN:
            raise PatternError(f"shape {self.name!r}: a validated shape is at most 65536 bytes")

    @property
    def validated(self) -> bool:
        return bool(self.check or self.entropy_k or self.placeholder_filter)

    def body_ok(self, body: bytes) -> bool:
        """The validators on the body of a complete match (True when there are none)."""
        if self.placeholder_filter is Placeholder.TOKEN and is_placeholder(body):
            return False
        if self.placeholder_filter is Placeholder.VALUE and is_template_value(body):
            return False
        if self.entropy_k and not entropy_ok(self.entropy_k, body):
            return False
        return checksum_ok(self.check, body)


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
        placeholder_filter=Placeholder.VALUE,
    )


def _env_pair(word: bytes) -> Shape:
    # <PREFIX_>WORD=value or WORD="value": upper case only, so code (`password=password`) and
    # prose stay as written.
    return Shape(
        "env-" + word.decode().lower(),
        (lit(word), lit(b"="), cls("\"'", 0, 1), cls("^ \t\r\n\"'`;&|<>()\\", 1, 256)),
        redact_from=3,
        name_from=0,
        placeholder_filter=Placeholder.VALUE,
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

_B62 = "A-Za-z0-9"
_HEX = "a-f0-9"
_HEXU = "A-Fa-f0-9"
_B64 = "A-Za-z0-9+/="
_B64URL = "A-Za-z0-9_=-"


# A provider token stands alone: not glued to a token character or inside a base64 run or a
# dotted name before it (`video_box.ico-...`, `...+EZAK...`), and not running on into token
# characters after it (a body longer than the format's is a different string).
_TOKEN_NOT_AFTER = byte_class("A-Za-z0-9_+/.-")
_TOKEN_NOT_BEFORE = byte_class("A-Za-z0-9_+/-")
# A run that must end with a letter or a digit (suffixes are ASCII case-insensitive).
_ENDS_ALNUM = tuple(bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyz0123456789")


def _gate(body: str, lo: int) -> float:
    """The entropy gate for a random body of at least `lo` bytes from class `body`: 60-85 % of the
    collision entropy that one random body in 10,000 falls below (measured on 20,000 seeded
    samples per alphabet and length), so a real token is in effect never refused by it."""
    size = len(byte_class(body))
    if lo < 12:
        return 0.0
    if size <= 16:
        return 1.5 if lo < 32 else 2.0
    return 2.0 if lo < 24 else 2.5 if lo < 40 else 3.0


def _tok(
    name: str,
    prefix: bytes,
    body: str,
    lo: int,
    hi: int,
    *,
    check: Check = Check.NONE,
    placeholders: bool = True,
) -> Shape:
    """A prefix-anchored token: `prefix` then `lo..hi` bytes of `body`, not glued to a token
    byte before it, with the placeholder filter and an entropy gate on the body."""
    return Shape(
        name,
        (lit(prefix), cls(body, lo, hi)),
        not_after=_TOKEN_NOT_AFTER,
        not_before=_TOKEN_NOT_BEFORE,
        check=check,
        min_entropy=_gate(body, lo),
        placeholder_filter=placeholders,
    )


def _toks(
    name: str, prefixes: Iterable[bytes], body: str, lo: int, hi: int, **kw: Any
) -> list[Shape]:
    return [_tok(name, p, body, lo, hi, **kw) for p in prefixes]


# Prefix-anchored token formats, from the published formats of gitleaks' rules (MIT) and
# trufflehog's detectors (facts only: prefixes, lengths, alphabets). Bodies run possessively
# to their maximum, so a longer run than the format's is still redacted whole; a format with a
# fixed length takes a small margin above it (tokens get longer, rarely shorter).
_PROVIDER_SHAPES: tuple[Shape, ...] = (
    # AI providers
    *_toks("anthropic", (b"sk-ant-",), TOKEN_CHARS, 20, 256),
    *_toks("openai", (b"sk-proj-", b"sk-"), TOKEN_CHARS, 20, 256),
    _tok("groq", b"gsk_", _B62, 48, 64),
    _tok("replicate", b"r8_", _B62, 36, 48),
    _tok("xai", b"xai-", _B62, 60, 100),
    _tok("perplexity", b"pplx-", _B62, 40, 64),
    _tok("huggingface", b"hf_", "A-Za-z", 30, 40),
    _tok("huggingface", b"api_org_", "A-Za-z", 30, 40),
    _tok("pinecone", b"pcsk_", "A-Za-z0-9_", 50, 100),
    _tok("langsmith", b"lsv2_", "a-z0-9_", 40, 64),
    *_toks("aws-bedrock", (b"ABSK",), _B64, 100, 300),
    _tok("aws-bedrock", b"bedrock-api-key-", "A-Za-z0-9+/=_-", 40, 2048),
    # Source hosting, CI, registries
    *_toks(
        "github",
        (b"ghp_", b"gho_", b"ghu_", b"ghs_", b"ghr_"),
        _B62,
        36,
        36,
        check=Check.CRC32_BASE62,
    ),
    _tok("github", b"github_pat_", "A-Za-z0-9_", 22, 255),
    *_toks(
        "gitlab",
        (
            b"glpat-",
            b"glcbt-",
            b"gldt-",
            b"glffct-",
            b"glft-",
            b"glimt-",
            b"glagent-",
            b"gloas-",
            b"glrt-",
            b"glsoat-",
            b"glptt-",
            b"GR1348941",
        ),
        "A-Za-z0-9_.-",
        20,
        320,
    ),
    _tok("npm", b"npm_", _B62, 36, 36, check=Check.CRC32_BASE62),
    _tok("pypi", b"pypi-AgEIcHlwaS5vcmc", _B64URL, 50, 1000),
    _tok("rubygems", b"rubygems_", _HEX, 48, 48),
    _tok("clojars", b"CLOJARS_", "a-z0-9", 60, 60),
    _tok("docker", b"dckr_pat_", TOKEN_CHARS, 27, 64),
    _tok("artifactory", b"AKCp", _B62, 69, 80),
    _tok("artifactory", b"cmVmd", _B62, 59, 70),
    _tok("buildkite", b"bkua_", _HEX, 40, 40),
    _tok("circleci", b"CCIPAT_", "A-Za-z0-9_", 40, 80),
    # sgp_ + 40 hex, sgp_local_ + 40 hex, or sgp_ + 16 hex + _ + 40 hex
    _tok("sourcegraph", b"sgp_", _HEXU, 40, 40),
    _tok("sourcegraph", b"sgp_local_", _HEXU, 40, 40),
    Shape(
        "sourcegraph",
        (lit(b"sgp_"), cls(_HEXU, 16, 16), lit(b"_"), cls(_HEXU, 40, 40)),
        not_after=_TOKEN_NOT_AFTER,
        not_before=_TOKEN_NOT_BEFORE,
        min_entropy=2.0,
        placeholder_filter=True,
    ),
    # Airtable personal access tokens: pat + 14 alphanumerics + . + 64 hex.
    Shape(
        "airtable",
        (lit(b"pat"), cls(_B62, 14, 14), lit(b"."), cls(_HEX, 64, 64)),
        not_after=_TOKEN_NOT_AFTER,
        not_before=_TOKEN_NOT_BEFORE,
        min_entropy=2.5,
        placeholder_filter=True,
    ),
    *_toks("sonarqube", (b"squ_", b"sqp_", b"sqa_"), _HEX, 40, 40),
    _tok("snyk", b"snyk_", "A-Za-z0-9_.-", 40, 128),
    _tok("readme", b"rdme_", "a-z0-9", 70, 70),
    _tok("postman", b"PMAK-", "a-fA-F0-9-", 59, 59),
    _tok("octopus-deploy", b"API-", "A-Z0-9", 26, 32),
    _tok("infracost", b"ico-", _B62, 32, 32),
    _tok("prefect", b"pnu_", _B62, 36, 36),
    _tok("pulumi", b"pul-", _HEX, 40, 40),
    # 14 characters, `.atlasv1.`, the secret: the part before the literal stays.
    Shape(
        "terraform",
        (lit(b".atlasv1."), cls(_B64URL, 60, 70)),
        min_entropy=3.0,
        placeholder_filter=True,
    ),
    # Cloud and hosting
    *_toks("aws-access-key-id", (b"AKIA", b"ASIA", b"ABIA", b"ACCA"), "A-Z0-9", 16, 16),
    _tok("aws-access-key-id", b"A3T", "A-Z0-9", 17, 17),
    _tok("google", b"AIza", TOKEN_CHARS, 35, 35),
    _tok("google-oauth", b"GOCSPX-", TOKEN_CHARS, 28, 32),
    _tok("google-oauth", b"ya29.", TOKEN_CHARS, 30, 2048),
    Shape(
        "azure-storage-key",
        (lit(b"AccountKey="), cls(_B64, 86, 88)),
        redact_from=1,
        min_entropy=3.0,
        placeholder_filter=True,
    ),
    # An Azure AD client secret is 3 characters, a digit, `Q~` and 31-34 more: the opening
    # literal is the digit and `Q~`, so the first 3 characters stay (the rest is redacted).
    *(
        Shape(
            "azure-ad-client-secret",
            (lit(b"%dQ~" % d), cls("A-Za-z0-9_~.-", 31, 34)),
            not_before=_TOKEN_NOT_BEFORE,
            min_entropy=2.5,
            placeholder_filter=True,
        )
        for d in range(10)
    ),
    *_toks("digitalocean", (b"dop_v1_", b"doo_v1_", b"dor_v1_"), _HEX, 64, 64),
    *_toks(
        "doppler",
        (b"dp.pt.", b"dp.st.", b"dp.ct.", b"dp.sa.", b"dp.scim.", b"dp.audit."),
        _B62,
        40,
        64,
    ),
    *_toks("fly", (b"fo1_",), TOKEN_CHARS, 43, 43),
    *_toks("fly", (b"fm1a_", b"fm1r_", b"fm2_"), _B64, 100, 4096),
    _tok("heroku", b"HRKU-AA", TOKEN_CHARS, 58, 58),
    _tok("netlify", b"nfp_", _B62, 36, 40),
    _tok("render", b"rnd_", _B62, 32, 32),
    _tok("deno", b"ddp_", _B62, 36, 36),
    _tok("vercel", b"vcp_", _B62, 24, 64),
    _tok("supabase", b"sbp_", _HEX, 40, 40),
    _tok("supabase", b"sb_secret_", TOKEN_CHARS, 20, 64),
    _tok("neon", b"napi_", "a-z0-9", 64, 64),
    *_toks(
        "planetscale", (b"pscale_tkn_", b"pscale_oauth_", b"pscale_pw_"), "A-Za-z0-9_=.-", 32, 64
    ),
    _tok("databricks", b"dapi", _HEX, 32, 34),
    _tok("dynatrace", b"dt0c01.", "A-Za-z0-9.", 89, 89),
    *_toks("hashicorp-vault", (b"hvs.",), TOKEN_CHARS, 90, 120),
    *_toks("hashicorp-vault", (b"hvb.",), TOKEN_CHARS, 138, 300),
    _tok("cloudflare-origin-ca", b"v1.0-", "a-f0-9-", 171, 171),
    _tok("alibaba", b"LTAI", _B62, 20, 24),
    _tok("scalingo", b"tk-us-", TOKEN_CHARS, 48, 48),
    _tok("tailscale", b"tskey-", "A-Za-z0-9-", 20, 128),
    _tok("openshift", b"sha256~", TOKEN_CHARS, 43, 43),
    _tok("clickhouse", b"4b1d", _B62, 38, 38),
    _tok("grafana", b"glc_", _B64, 32, 400),
    _tok("grafana", b"glsa_", "A-Za-z0-9_", 41, 41),
    _tok("grafana", b"eyJrIjoi", _B64, 70, 400),
    _tok("sentry", b"sntryu_", _HEX, 64, 64),
    _tok("sentry", b"sntrys_eyJpYXQiO", "A-Za-z0-9+/=_", 60, 600),
    *_toks("new-relic", (b"NRAK-", b"NRII-", b"NRJS-"), "A-Za-z0-9-", 19, 40),
    # Payments and commerce
    *_toks(
        "stripe",
        (b"sk_live_", b"sk_test_", b"sk_prod_", b"rk_live_", b"rk_test_", b"rk_prod_"),
        _B62,
        10,
        255,
    ),
    _tok("stripe", b"whsec_", _B62, 32, 64),
    *_toks("square", (b"sq0atp-", b"sq0csp-", b"EAAA"), TOKEN_CHARS, 22, 64),
    *_toks("shopify", (b"shpat_", b"shpca_", b"shppa_", b"shpss_"), _HEXU, 32, 32),
    *_toks("shippo", (b"shippo_live_", b"shippo_test_"), _HEXU, 40, 40),
    *_toks("duffel", (b"duffel_test_", b"duffel_live_"), "A-Za-z0-9_=-", 43, 43),
    *_toks("easypost", (b"EZAK", b"EZTK"), _B62, 54, 54),
    *_toks("flutterwave", (b"FLWSECK", b"FLWPUBK"), "A-Za-z0-9_-", 12, 64),
    *_toks("razorpay", (b"rzp_live_", b"rzp_test_"), _B62, 14, 32),
    *_toks(
        "plaid",
        (b"access-production-", b"access-development-", b"access-sandbox-"),
        "a-f0-9-",
        36,
        36,
    ),
    _tok("braintree", b"access_token$production$", "a-z0-9$", 40, 80),
    # Messaging, mail, collaboration
    # xox[bpareos]-, then a number, then the rest. The number is a workspace id of 8-14 digits
    # (`xoxb-263594206564-...`; `xoxp-1234-1234-...` is an illustration) followed by the other
    # ids and the secret, which ends the token (`xoxp-<ids>-####` has none); or a version digit
    # (`xoxe-1-`, `xoxe.xoxp-1-`, `xoxa-2-`) followed by at least 40 characters (the config
    # tokens have 146-166, a legacy workspace token 40 or more; `xoxp-1-` and a few words is a
    # stand-in).
    *(
        Shape(
            "slack",
            (
                lit(b"xox"),
                cls("bpareos", 1, 1),
                lit(b"-"),
                cls("0-9", lo, hi),
                lit(b"-"),
                cls("A-Za-z0-9-", rest, 255, suffixes=_ENDS_ALNUM),
            ),
            not_after=_BOUNDARY,
            not_before=_TOKEN_NOT_BEFORE,
            min_entropy=2.0,
            placeholder_filter=True,
        )
        for lo, hi, rest in ((8, 14, 20), (1, 1, 40))
    ),
    _tok("slack", b"xapp-", "A-Za-z0-9-", 20, 255),
    Shape(
        "slack-webhook",
        (lit(b"hooks.slack.com/"), cls("a-z", 8, 9), lit(b"/"), cls("A-Za-z0-9+/", 43, 80)),
        redact_from=3,
        min_entropy=2.5,
        placeholder_filter=True,
    ),
    _tok("sendgrid", b"SG.", "A-Za-z0-9_=.-", 66, 66),
    _tok("sendinblue", b"xkeysib-", "a-zA-Z0-9-", 81, 81),
    # Twilio API key SIDs: SK + 32 lowercase hex; the opening literal takes the first hex digit.
    *_toks("twilio", (b"SK" + bytes([c]) for c in b"0123456789abcdef"), _HEX, 31, 31),
    _tok("notion", b"ntn_", _B62, 46, 46),
    _tok("linear", b"lin_api_", _B62, 40, 40),
    _tok("figma", b"figd_", TOKEN_CHARS, 40, 48),
    _tok("atlassian", b"ATATT3", "A-Za-z0-9_=-", 180, 200),
    _tok("bitbucket", b"ATBB", _B62, 32, 40),
    _tok("contentful", b"CFPAT-", TOKEN_CHARS, 43, 43),
    _tok("typeform", b"tfp_", "A-Za-z0-9_=.-", 59, 59),
    _tok("frameio", b"fio-u-", "A-Za-z0-9_=-", 64, 64),
    _tok("adobe", b"p8e-", _B62, 32, 32),
    _tok("adafruit", b"aio_", _B62, 28, 28),
    _tok("mapbox", b"sk.eyJ", "A-Za-z0-9_.-", 40, 512),
    *_toks("facebook", (b"EAAM", b"EAAC"), _B62, 100, 512),
    _tok("dropbox", b"sl.", "A-Za-z0-9_=.-", 130, 1400),
    *_toks("settlemint", (b"sm_aat_", b"sm_pat_", b"sm_sat_"), _B62, 16, 16),
    _tok("intra42", b"s-s4t2ud-", _HEX, 64, 64),
    _tok("intra42", b"s-s4t2af-", _HEX, 64, 64),
    _tok("yandex", b"AQVN", TOKEN_CHARS, 35, 38),
    Shape(
        "twitter-bearer",
        (lit(b"AAAAAAAAAAAAAAAAAAAAA"), cls("A-Za-z0-9%", 80, 120)),
        not_after=_BOUNDARY,
        min_entropy=2.5,
    ),
    # Key files
    _tok("age-secret-key", b"AGE-SECRET-KEY-1", "QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L", 58, 58),
    Shape(
        "1password",
        (lit(b"A3-"), cls("A-Z0-9", 6, 6), lit(b"-"), cls("A-Z0-9-", 29, 30)),
        not_after=_BOUNDARY,
        min_entropy=2.0,
        placeholder_filter=True,
    ),
    _tok("1password", b"ops_eyJ", _B64, 250, 8192),
)

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
        check=Check.PEM_KEY,
    ),
    *_PROVIDER_SHAPES,
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
