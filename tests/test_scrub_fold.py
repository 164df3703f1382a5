"""Stage 2 of the scrubber, the fold matcher: known values in any trivially decodable form.

`native/scrub_fold.py` defines the output; the C engine (`native/src/fold.c`) is held to it
byte for byte. Generated: every transform x chunking (whole, one byte at a time, random splits)
x position (start, middle, end of a longer text; windows cut out of a longer base64 / base32 /
hex text) x engine, each checking that exactly the raw bytes that carried the secret became one
marker and the text around it is intact. Near-misses that must stay as they are. Streams
released, feed by feed, what the reference releases, and never hold more than the bound.
"""

from __future__ import annotations

import base64
import codecs
import random
import re
import unicodedata
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from native import scrub_fold
from native.scrub import Scrubber
from native.scrub_fold import GROUP_CAP, FoldStream, FoldTables, W, fold_code_point, fold_whole
from native.scrub_fold_table import ROWS, UNICODE_VERSION

try:
    from native import scrub_fold_native

    NATIVE = scrub_fold_native.AVAILABLE
except ImportError:
    scrub_fold_native = None  # type: ignore[assignment]
    NATIVE = False

ROOT = Path(__file__).resolve().parent.parent
RNG = random.Random(20261126)
BASE62 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
KEY = b"sk-ant-api03-Zx8Qw2Lm4Np6Rt1Vb3Yc5Hd7Jf9Kg0Ps2Uq4Wo6Ei8"
TOKEN = "".join(RNG.choice(BASE62) for _ in range(40)).encode()
SECRETS = (("anthropic", KEY), ("token", TOKEN))
MARK = {KEY: b"[REDACTED:anthropic]", TOKEN: b"[REDACTED:token]"}

Tokens = list[tuple[bytes, bool]]  # (bytes, carries the secret)


def engine_params() -> list[Any]:
    skip = pytest.mark.skipif(not NATIVE, reason="the C fold engine is not built")
    return ["reference", pytest.param("native", marks=skip)]


ENGINES = pytest.mark.parametrize("engine", engine_params())


def tables(engine: str, secrets: tuple[tuple[str, bytes], ...] = SECRETS) -> Any:
    if engine == "native":
        assert scrub_fold_native is not None
        return scrub_fold_native.NativeFoldTables(secrets)
    return FoldTables(secrets)


# -- transforms: each gives the text as tokens, flagged where they carry the secret -------------


def per_char(
    value: bytes,
    enc: Callable[[str], str | bytes],
    sep: bytes = b"",
    lead: bytes = b"",
    trail: bytes = b"",
) -> Tokens:
    """Each character encoded by enc, sep between them (inside the carrier), lead and trail
    around (outside it)."""
    out: Tokens = [(lead, False)]
    text = value.decode()
    for k, ch in enumerate(text):
        piece = enc(ch)
        out.append((piece.encode() if isinstance(piece, str) else piece, True))
        if k + 1 < len(text):
            out.append((sep, True))
    out.append((trail, False))
    return out


def shifted(ch: str, upper: int, lower: int, digit: int | None) -> str:
    if "A" <= ch <= "Z":
        return chr(upper + ord(ch) - 65)
    if "a" <= ch <= "z":
        return chr(lower + ord(ch) - 97)
    if digit is not None and "0" <= ch <= "9":
        return chr(digit + ord(ch) - 48)
    return ch


def fullwidth(ch: str) -> str:
    return chr(ord(ch) + 0xFEE0) if "!" <= ch <= "~" else ch


def accented(ch: str) -> str:
    """ch with an acute accent where one composes with it (s -> \u015b)."""
    composed = unicodedata.normalize("NFC", ch + "\u0301")
    return composed if len(composed) == 1 else ch


def mixed(ch: str) -> str:
    """Each character in another of the decoded forms (an agent varying its disguise)."""
    forms = (
        f"&#{ord(ch)};",
        f"%25{ord(ch):02X}",
        f"\\u{ord(ch):04x}",
        fullwidth(ch),
        f"\x1b[1m{ch}",
        f"&#x{ord(ch):x}",
        ch.upper() + "\u200b",
    )
    return forms[ord(ch) % len(forms)]


def circled(ch: str) -> str:
    if ch == "0":
        return "\u24ea"
    if "1" <= ch <= "9":
        return chr(0x2460 + ord(ch) - 49)
    return shifted(ch, 0x24B6, 0x24D0, None)


CF = (
    "\u00ad\u200b\u200c\u200d\u200e\u200f\u2060\u2061\u2062\u2063\u2064\ufeff\u180e"
    "\u202a\u202e\u2066\u206f\u034f\ufe0f"
)


def cf_mix(value: bytes) -> Tokens:
    text = value.decode()
    out: Tokens = []
    for k, ch in enumerate(text):
        out.append((ch.encode(), True))
        if k + 1 < len(text):
            out.append(((CF[k % len(CF)] + CF[(3 * k + 1) % len(CF)]).encode(), True))
    return out


def tags(value: bytes) -> Tokens:
    # Each character followed by its Unicode tag twin (U+E0000 + code): invisible.
    text = value.decode()
    out: Tokens = []
    for k, ch in enumerate(text):
        out.append((ch.encode(), True))
        out.append((chr(0xE0000 + ord(ch)).encode(), k + 1 < len(text)))
    return out


def mixed_case(value: bytes) -> Tokens:
    rng = random.Random(value)
    text = "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in value.decode())
    return [(text.encode(), True)]


def bit_window(
    value: bytes, encode: Callable[[bytes], bytes], bits: int, align: int, wrap: int = 0
) -> Tokens:
    """value inside a longer encoded text at a byte alignment: only the characters made of the
    value's bits carry it (wrap: a line break every `wrap` characters, MIME-style)."""
    rng = random.Random(align * 7 + bits)
    pre = rng.randbytes(align + 3 * 5 * 2)
    post = rng.randbytes(11)
    text = encode(pre + value + post)
    first = -(-8 * len(pre) // bits)
    whole = 8 * (len(pre) + len(value)) // bits
    # cut out of the middle: a few characters of the text are dropped at both ends
    out: Tokens = []
    for k in range(3, len(text) - 2):
        out.append((text[k : k + 1], first <= k < whole))
        if wrap and k % wrap == wrap - 1:
            out.append((b"\r\n", first <= k < whole - 1))
    return out


def hex_window(value: bytes, fmt: Callable[[bytes], list[bytes]], sep: bytes, every: int) -> Tokens:
    """Hex of value inside hex of other bytes, sep after every `every` digits."""
    pre, post = b"\x00\x13\xfe", b"\x7f\x80"
    digits = fmt(pre + value + post)
    lo, hi = 2 * len(pre), 2 * (len(pre) + len(value))
    out: Tokens = []
    for k, d in enumerate(digits):
        out.append((d, lo <= k < hi))
        if (k + 1) % every == 0:
            out.append((sep, lo <= k < hi - 1))
    return out


def lower_hex(data: bytes) -> list[bytes]:
    return [bytes([c]) for c in data.hex().encode()]


def upper_hex(data: bytes) -> list[bytes]:
    return [bytes([c]) for c in data.hex().upper().encode()]


TRANSFORMS: dict[str, Callable[[bytes], Tokens]] = {
    "raw": lambda v: [(v, True)],
    "upper": lambda v: [(v.upper(), True)],
    "swapcase": lambda v: [(v.swapcase(), True)],
    "mixed-case": mixed_case,
    "space-between": lambda v: per_char(v, str, b" "),
    "dash-between": lambda v: per_char(v, str, b" - "),
    "eight-separators": lambda v: per_char(
        bytes(c for c in v if chr(c).isalnum()), str, b". ,;\t:\r\n"
    ),
    "json-newline-between": lambda v: per_char(v, str, b"\\n"),
    "soft-hyphens": lambda v: per_char(v, str, "\u00ad".encode()),
    "format-characters": cf_mix,
    "tag-characters": tags,
    "fullwidth": lambda v: per_char(v, fullwidth),
    "math-bold": lambda v: per_char(v, lambda c: shifted(c, 0x1D400, 0x1D41A, 0x1D7CE)),
    "math-monospace": lambda v: per_char(v, lambda c: shifted(c, 0x1D670, 0x1D68A, 0x1D7F6)),
    "circled": lambda v: per_char(v, circled),
    "entity-decimal": lambda v: per_char(v, lambda c: f"&#{ord(c)};"),
    "entity-hex": lambda v: per_char(v, lambda c: f"&#x{ord(c):X};"),
    "entity-no-semicolon": lambda v: per_char(v, lambda c: f"&#{ord(c)}"),
    "entity-double": lambda v: per_char(v, lambda c: f"&amp;#x{ord(c):x};"),
    "percent": lambda v: per_char(v, lambda c: f"%{ord(c):02X}"),
    "percent-double": lambda v: per_char(v, lambda c: f"%25{ord(c):02x}"),
    "percent-quadruple": lambda v: per_char(v, lambda c: f"%25252525{ord(c):02X}"),
    "escape-x": lambda v: per_char(v, lambda c: f"\\x{ord(c):02x}"),
    "escape-u": lambda v: per_char(v, lambda c: f"\\u{ord(c):04X}"),
    "escape-u-braces": lambda v: per_char(v, lambda c: f"\\u{{{ord(c):x}}}"),
    "escape-U": lambda v: per_char(v, lambda c: f"\\U{ord(c):08x}"),
    "escape-octal": lambda v: per_char(v, lambda c: f"\\{ord(c):03o}"),
    "emoji-between": lambda v: per_char(v, str, "\U0001f511".encode()),
    "cjk-and-arrows-between": lambda v: per_char(v, str, "\u4e2d\u2192".encode()),
    "invalid-utf8-between": lambda v: per_char(v, str, b"\xff\xc3"),
    "combining-marks": lambda v: per_char(v, str, "\u0301\u0323".encode(), trail="\u0301".encode()),
    "diacritics": lambda v: per_char(v, accented),
    "ansi-sgr": lambda v: per_char(v, str, b"\x1b[1;31m\x1b[0m"),
    "mixed-per-character": lambda v: per_char(v, mixed, "\u00b7".encode()),
    "ansi-osc-link": lambda v: per_char(v, str, b"\x1b]8;;http://a.b/\x1b\\"),
    "utf16-le": lambda v: per_char(v, lambda c: c.encode("utf-16-le")[:1], b"\0", trail=b"\0"),
    "utf16-be": lambda v: per_char(v, lambda c: c.encode("utf-16-be")[1:], b"\0", lead=b"\0"),
    "utf16-le-bom": lambda v: [(b"\xff\xfe", False), *TRANSFORMS["utf16-le"](v)],
    **{
        f"base64-align{a}": partial(bit_window, encode=base64.b64encode, bits=6, align=a)
        for a in range(3)
    },
    **{
        f"base64url-align{a}": partial(bit_window, encode=base64.urlsafe_b64encode, bits=6, align=a)
        for a in range(3)
    },
    "base64-mime": partial(bit_window, encode=base64.b64encode, bits=6, align=1, wrap=19),
    **{
        f"base32-align{a}": partial(bit_window, encode=base64.b32encode, bits=5, align=a)
        for a in range(5)
    },
    "hex-lower": lambda v: hex_window(v, lower_hex, b"", 1 << 30),
    "hex-upper": lambda v: hex_window(v, upper_hex, b"", 1 << 30),
    "hex-xxd-groups": lambda v: hex_window(v, lower_hex, b" ", 4),
    "hex-spaced-bytes": lambda v: hex_window(v, upper_hex, b" ", 2),
    "hex-xxd-plain-lines": lambda v: hex_window(v, lower_hex, b"\n", 60),
    "rot13": lambda v: [(codecs.encode(v.decode(), "rot13").encode(), True)],
    "reversed": lambda v: [(v[::-1], True)],
    "reversed-upper-spaced": lambda v: per_char(v[::-1].upper(), str, b" "),
}

POSITIONS = {
    "start": (b"", b" is the key.\n"),
    "middle": (b"Here it is, as asked: ", b" -- keep it safe.\n"),
    "end": (b"The key: ", b""),
}


def expected(tokens: Tokens, mark: bytes) -> tuple[bytes, bytes]:
    """(the text, what stage 2 must make of it): the carrier tokens, from the first to the last,
    and whatever lies between them, become one marker."""
    text = b"".join(t for t, _ in tokens)
    flags = [carries for t, carries in tokens if t]
    pieces = [t for t, _ in tokens if t]
    first = flags.index(True)
    last = len(flags) - 1 - flags[::-1].index(True)
    return text, b"".join(pieces[:first]) + mark + b"".join(pieces[last + 1 :])


def chunkings(size: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    sizes = []
    left = size
    while left:
        n = min(left, rng.choice((1, 2, 3, 5, 8, 13, rng.randint(1, 64))))
        sizes.append(n)
        left -= n
    return {"whole": [size], "bytewise": [1] * size, "random": sizes}


def streamed(t: Any, data: bytes, sizes: list[int], bound: int | None = None) -> bytes:
    stream = t.stream()
    out = []
    pos = 0
    for size in sizes:
        out.append(stream.feed(data[pos : pos + size]))
        pos += size
        if bound is not None:
            assert stream.pending <= bound
    out.append(stream.flush())
    return b"".join(out)


@ENGINES
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_every_transform_is_redacted_exactly(engine: str, transform: str) -> None:
    t = tables(engine)
    for secret in (KEY, TOKEN):
        tokens = TRANSFORMS[transform](secret)
        for where, (before, after) in POSITIONS.items():
            text, want = expected([(before, False), *tokens, (after, False)], MARK[secret])
            assert t.scrub(text) == want, (transform, where, text)
            for how, sizes in chunkings(len(text), len(text)).items():
                got = streamed(t, text, sizes, t.hold_bound_bytes)
                assert got == want, (transform, where, how)


@ENGINES
def test_a_full_xxd_dump_keeps_no_window_of_the_key(engine: str) -> None:
    # xxd's offset and ASCII columns cut the hex between lines; every window within a line goes
    # (the ASCII column is stage 1's: its raw 8-byte runs).
    data = b"\x00" * 5 + KEY + b"\x01" * 7
    lines = []
    for off in range(0, len(data), 16):
        row = data[off : off + 16]
        groups = " ".join(row[k : k + 2].hex() for k in range(0, len(row), 2))
        ascii_ = "".join(chr(c) if 32 <= c < 127 else "." for c in row)
        lines.append(f"{off:08x}: {groups:<39}  {ascii_}\n")
    out = tables(engine).scrub("".join(lines).encode())
    assert out.count(b"[REDACTED:anthropic]") >= 4
    digits = re.sub(rb"[^0-9a-f]", b"", re.sub(rb"\[REDACTED:\w+\]", b"|", out))
    assert all(KEY.hex().encode()[k : k + W] not in digits for k in range(0, 2 * len(KEY) - W))


# -- near-misses ----------------------------------------------------------------------------------


def random_key(rng: random.Random, n: int = 40) -> bytes:
    return "".join(rng.choice(BASE62) for _ in range(n)).encode()


NEAR_MISSES: dict[str, bytes] = {
    "another-key-same-shape": random_key(random.Random(5)),
    "another-key-base64": base64.b64encode(random_key(random.Random(6))),
    "another-key-hex": random_key(random.Random(7)).hex().encode(),
    "15-folded-chars-of-the-token": TOKEN[:15],
    "15-folded-chars-spaced": b" ".join(bytes([c]) for c in TOKEN[10:25]),
    "two-halves-far-apart": TOKEN[:14] + b"\n" * 9 + TOKEN[14:28],
    "nine-separators-between": b"         ".join(bytes([c]) for c in TOKEN),
    "a-foreign-letter-inside": TOKEN[:15] + "\u00e9".encode() + TOKEN[15:30],
    "prose": (
        b"The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        b"Sphinx of black quartz, judge my vow! How vexingly quick daft zebras jump.\n"
    )
    * 4,
    "hex-of-other-data": random.Random(8).randbytes(200).hex().encode(),
    "base64-of-other-data": base64.b64encode(random.Random(9).randbytes(300)),
    "uuid": b"123e4567-e89b-12d3-a456-426614174000 550e8400-e29b-41d4-a716-446655440000",
    "git-sha": b"commit 4d4b2da8e3c1f0b7a9d2e6f5c4b3a29180716253 (HEAD -> main)",
    "code": (ROOT / "native" / "scrub.py").read_bytes(),
}


@ENGINES
@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_are_left_alone(engine: str, name: str) -> None:
    t = tables(engine)
    text = NEAR_MISSES[name]
    assert t.scrub(text) == text
    assert streamed(t, text, chunkings(len(text), 3)["random"]) == text


def test_keys_sharing_a_prefix_share_its_encoded_windows() -> None:
    # Documented: 16 hex digits are 8 bytes, so the hex of another `sk-ant-api03-` key is
    # redacted (under our key's name) where it spells the 8-byte prefix both keys share.
    other = b"sk-ant-api03-" + random_key(random.Random(10), 43)
    out = tables("reference").scrub(other.hex().encode())
    assert out == b"[REDACTED:anthropic]" + other.hex()[26:].encode()


# -- the gate, the table, the bound -------------------------------------------------------------


def test_only_long_high_entropy_secrets_enter_stage_2() -> None:
    assert not FoldTables([("short", b"Zx8Qw2Lm4Np6R"), ("flat", b"abababababababababab")])
    assert not scrub_fold.qualifies(b"x-x-x-x-x-x-x-x-x-x-x-x-x-x-x-x-x-x")
    assert scrub_fold.qualifies(TOKEN)
    t = FoldTables([("low", b"aaaaaaaaaaaaaaaaaaaa"), ("token", TOKEN)])
    assert t.names == [b"token"]
    # With no qualifying secret the scrubber is stage 1 alone.
    assert Scrubber([("pin", b"4921")]).fold_engine == "none"


def test_fold_table_spot_checks() -> None:
    cases = {
        "A": ord("a"),
        "z": ord("z"),
        "7": ord("7"),
        "\uff21": ord("a"),  # fullwidth A
        "\U0001d400": ord("a"),  # mathematical bold A
        "\u2460": ord("1"),  # circled one
        "\u00b2": ord("2"),  # superscript two
        "\u017f": ord("s"),  # long s
        "-": scrub_fold.IGNORED,
        " ": scrub_fold.IGNORED,
        "\u00a0": scrub_fold.IGNORED,
        "\u00ad": scrub_fold.IGNORED,
        "\u200b": scrub_fold.IGNORED,
        "\u202e": scrub_fold.IGNORED,
        "\ufeff": scrub_fold.IGNORED,
        "\ufe0f": scrub_fold.IGNORED,
        "\U000e0041": scrub_fold.IGNORED,
        "\x00": scrub_fold.IGNORED,
        "\x85": scrub_fold.IGNORED,
        "\u00e9": ord("e"),  # NFKD less its combining marks
        "\u0137": ord("k"),
        "\u0301": scrub_fold.IGNORED,  # a combining mark
        "\u2014": scrub_fold.IGNORED,
        "\u2469": scrub_fold.IGNORED,  # circled ten is two characters
        "\U0001f600": scrub_fold.IGNORED,
        "\u4e2d": scrub_fold.IGNORED,
        "\u00f8": scrub_fold.IGNORED,  # no decomposition: not an o
    }
    for ch, want in cases.items():
        assert fold_code_point(ord(ch)) == want, hex(ord(ch))
    assert fold_code_point(0xD800) == scrub_fold.IGNORED
    assert fold_code_point(0x110000) == scrub_fold.IGNORED


def test_the_c_table_holds_the_python_rows() -> None:
    header = (ROOT / "native" / "src" / "fold_table.h").read_text()
    rows = [
        tuple(int(x, 0) for x in m.groups())
        for m in re.finditer(r"\{(0x[0-9a-f]+), (0x[0-9a-f]+), (\d+), (\d+)\}", header)
    ]
    assert rows == list(ROWS)
    assert f'"{UNICODE_VERSION}"' in header


@ENGINES
def test_a_periodic_flood_is_cut_into_capped_groups_and_never_held_whole(engine: str) -> None:
    # A periodic secret makes every position of a periodic text a match: groups are capped,
    # the stream releases as it goes, and nothing of the period survives.
    period = b"0123456789abcdefGHIJ"
    t = tables(engine, (("periodic", period * 3),))
    text = b"<" + period * 400 + b">"
    out = t.scrub(text)
    assert out.startswith(b"<[REDACTED:periodic]") and out.endswith(b"]>")
    assert out.count(b"[REDACTED:periodic]") == -(-len(period) * 400 // GROUP_CAP)
    assert streamed(t, text, [7] * (len(text) // 7) + [len(text) % 7], t.hold_bound_bytes) == out


def test_unfinished_units_are_held_then_decided() -> None:
    t = tables("reference")
    for tail in (
        b"%25",
        b"%4",
        b"&amp;",
        b"&#x4",
        b"&#65",
        b"\\u00",
        b"\\u{4",
        b"\x1b[3",
        b"\xe2\x80",
    ):
        stream = FoldStream(t)
        # (nine spaces are a BREAK: nothing before them can still be part of a match)
        assert stream.feed(b"prose" + b" " * 9 + tail) == b"prose" + b" " * 9
        assert stream.pending == len(tail)
        assert stream.flush() == tail


# -- streams equal the whole-input definition ---------------------------------------------------

PIECES = (
    KEY,
    KEY[:20],
    KEY[20:],
    TOKEN,
    TOKEN.upper(),
    b" ".join(bytes([c]) for c in TOKEN[:24]),
    base64.b64encode(b"x" + TOKEN)[:30],
    base64.b64encode(b"x" + TOKEN)[30:],
    TOKEN.hex().encode()[:40],
    TOKEN.hex().encode()[40:],
    b"%25",
    b"%",
    b"2541",
    b"&amp;",
    b"&#x",
    b"&#1",
    b";",
    b"\\u00",
    b"\\u{",
    b"}",
    b"\\",
    b"\x1b[",
    b"\x1b]8;;",
    b"\x07",
    b"\x1b\\",
    b"\xe2\x80",
    b"\x8b",
    b"\xef\xbc\xa1",
    b"\x00",
    b"\n\n",
    b"         ",
    b"hello ",
    b"[REDACTED:x]",
    b"[REDACTED:anthropic]",
    b"[REDACTED:",
    b"Token]",
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(PIECES), max_size=12),
    st.lists(st.integers(1, 40), min_size=1, max_size=30),
)
def test_chunking_never_changes_the_output(pieces: list[bytes], cuts: list[int]) -> None:
    t = tables("reference")
    text = b"".join(pieces)
    want = fold_whole(t, text)
    sizes = []
    left = len(text)
    for c in cuts * (len(text) // max(sum(cuts), 1) + 1):
        if not left:
            break
        sizes.append(min(c, left))
        left -= sizes[-1]
    if left:
        sizes.append(left)
    assert streamed(t, text, sizes, t.hold_bound_bytes) == want


# -- the composed scrubber ------------------------------------------------------------------------


def test_the_scrubber_runs_stage_1_then_stage_2() -> None:
    scrubber = Scrubber(SECRETS, engine="reference")
    assert scrubber.fold_engine in ("reference", "native")
    # Stage 1 names raw values exactly as before; stage 2 catches what stage 1 cannot read.
    spaced = b" ".join(bytes([c]) for c in TOKEN)
    text = b"a " + KEY + b" b " + spaced + b" c " + base64.b32encode(KEY) + b" d"
    out = scrubber.scrub(text)
    assert out.startswith(b"a [REDACTED:anthropic] b [REDACTED:token] c ")
    assert KEY not in out and spaced not in out and out.endswith(b"] d")
    stream = scrubber.stream()
    parts = []
    for k in range(0, len(text), 3):
        parts.append(stream.feed(text[k : k + 3]))
        assert stream.pending <= scrubber.hold_bound_bytes
    assert b"".join(parts) + stream.flush() == out
    assert scrubber.scrub_text(text.decode()) == out.decode()


# -- the C engine equals the reference ----------------------------------------------------------


def _load_harness() -> Any:
    import importlib.util

    path = ROOT / "fuzz" / "fuzz_scrub_fold_differential.py"
    spec = importlib.util.spec_from_file_location("fuzz_scrub_fold_differential", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


needs_native = pytest.mark.skipif(not NATIVE, reason="the C fold engine is not built")


@needs_native
def test_the_fuzz_seeds_hold() -> None:
    harness = _load_harness()
    for seed in harness.SEEDS:
        harness.TestOneInput(seed)


@needs_native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=160), st.integers(0, 3))
def test_c_equals_the_reference_feed_by_feed(body: bytes, mode: int) -> None:
    harness = _load_harness_cached()
    harness.TestOneInput(bytes([mode]) + body)


_HARNESS: list[Any] = []


def _load_harness_cached() -> Any:
    if not _HARNESS:
        _HARNESS.append(_load_harness())
    return _HARNESS[0]


@needs_native
def test_c_refuses_inconsistent_windows_and_misuse() -> None:
    assert scrub_fold_native is not None
    lib, ffi = scrub_fold_native.lib, scrub_fold_native.ffi
    out = ffi.new("fold_tables **")
    ints = ffi.new("int32_t[]", [16])
    owner = ffi.new("int32_t[]", [0])
    name = ffi.new("int32_t[]", [1])
    # An upper-case letter is not a folded character; a window longer than the blob; an owner
    # out of range; no name.
    assert lib.fold_tables_new(b"A" * 16, 16, ints, owner, 1, b"n", 1, name, 1, out) == -2
    assert lib.fold_tables_new(b"a" * 15, 15, ints, owner, 1, b"n", 1, name, 1, out) == -2
    bad = ffi.new("int32_t[]", [1])
    assert lib.fold_tables_new(b"a" * 16, 16, ints, bad, 1, b"n", 1, name, 1, out) == -2
    assert lib.fold_tables_new(b"a" * 16, 16, ints, owner, 1, b"", 0, name, 0, out) == -2
    t = tables("native")
    stream = t.stream()
    stream.feed(b"abc")
    stream.flush()
    with pytest.raises(ValueError):
        stream.flush()
    with pytest.raises(ValueError):
        stream.feed(b"x")


@needs_native
def test_large_inputs_cross_the_c_pieces() -> None:
    # The C engine works in 64 KiB pieces: secrets across piece boundaries, in one call.
    t, ref = tables("native"), tables("reference")
    filler = b"lorem ipsum dolor sit amet, " * 2400
    forms = [KEY, TOKEN.upper(), b" ".join(bytes([c]) for c in TOKEN), base64.b32encode(KEY)]
    text = b"".join(filler[: 65536 - 20 + k * 7] + form for k, form in enumerate(forms)) + filler
    want = fold_whole(ref, text)
    assert want.count(b"[REDACTED:") == len(forms)
    assert t.scrub(text) == want
    third = len(text) // 3
    assert streamed(t, text, [third, third, len(text) - 2 * third]) == want


@needs_native
def test_every_byte_value_takes_the_same_path_in_c_as_in_the_reference() -> None:
    # The C engine classifies bytes 32 at a time (letter, digit, a byte that needs the decoder,
    # one that may start a UTF-8 character) from two nibble tables. Each of the 256 values, at
    # every alignment in a block, goes inside the key followed by what would make it a unit of
    # its own (an escape or entity of the key's next letter, an ANSI sequence, a marker, UTF-8
    # continuation bytes, the rest of a character that folds to that letter): a byte taken for
    # plain when it is not, or the reverse, changes whether the key is found.
    t, ref = tables("native"), tables("reference")
    c = KEY[20]
    follows = [
        b"%02x" % c,
        b"2525%02x" % c,
        b"#%d;" % c,
        b"#x%x;" % c,
        b"amp;#%d;" % c,
        b"x%02x" % c,
        b"u%04x" % c,
        b"[0m" + bytes([c]),
        b"REDACTED:token]" + bytes([c]),
        b"\xa9" + bytes([c]),
        b"\x8b\x80" + bytes([c]),
        bytes([c]),
    ]
    # The key's letter as a three- and a four-byte character that fold to it (fullwidth,
    # mathematical bold), without their first byte: the value that is that byte completes it.
    assert ord("a") <= c <= ord("z")
    for wide in (chr(0xFF41 + c - ord("a")), chr(0x1D41A + c - ord("a"))):
        assert unicodedata.normalize("NFKC", wide) == chr(c)
        follows.append(wide.encode()[1:])
    for value in range(256):
        for at in range(0, 32, 5):
            body = b"".join(KEY[:20] + bytes([value]) + f + KEY[21:] + b" " for f in follows)
            text = b"x" * at + body + bytes([value]) * 40
            assert t.scrub(text) == fold_whole(ref, text), (value, at)


@ENGINES
def test_the_most_a_stream_holds_without_a_match(engine: str) -> None:
    # The hold an attacker can force: characters that could begin a window (a secret's own, at
    # most W - 1 of them, or any 5), each behind the longest gap that is not a BREAK (8 units,
    # 64 bytes), and an unfinished unit.
    t = tables(engine)
    gap = b"\x1b[38;5;196m" * 5 + b"\x1b[m" * 3  # 8 units, 64 bytes
    assert len(gap) == scrub_fold.GAP_BYTES
    bound = (W - 1) * (scrub_fold.MAX_CHAR_UNIT + scrub_fold.GAP_BYTES) + scrub_fold.MAX_LOOKAHEAD

    def spelled(c: int) -> bytes:  # the longest unit that is a letter: 26 bytes
        return b"&amp;amp;amp;amp;#x%06x;" % c

    for letters, held in ((b"A" * 40, 5), (TOKEN[: W - 1], W - 1)):
        stream = t.stream()
        most = 0
        for c in letters:
            stream.feed(spelled(c) + gap)
            most = max(most, stream.pending)
        assert most == held * (scrub_fold.MAX_CHAR_UNIT + len(gap))
        stream.feed(b"\x1b]" + b"x" * 200)  # an OSC string that may still end
        assert most < stream.pending <= bound
        stream.flush()


def test_both_engines_of_the_composed_scrubber_agree() -> None:
    text = b"x " + b"-".join(bytes([c]) for c in KEY) + b" " + base64.b64encode(b"ab" + TOKEN)
    reference = Scrubber(SECRETS, engine="reference")
    assert reference.fold_engine == "reference"
    assert Scrubber(SECRETS).scrub(text) == reference.scrub(text)
    assert b"[REDACTED:anthropic]" in reference.scrub(text)


def _spell(text: bytes, enc: Callable[[str], str], sep: str = "") -> bytes:
    return sep.join(enc(c) for c in text.decode()).encode()


COMPOSED_DISGUISES: dict[str, Callable[[bytes], bytes]] = {
    "reversed-fullwidth": lambda v: _spell(v[::-1], fullwidth),
    "rot13-entities-spaced": lambda v: _spell(
        codecs.encode(v.decode(), "rot13").encode(), lambda c: f"&#{ord(c)};", " "
    ),
    "base64-window-in-utf16be": lambda v: (
        base64.b64encode(b"\x07" + v + b"\x01").decode().encode("utf-16-be")
    ),
    "hex-as-json-escapes": lambda v: _spell(v.hex().upper().encode(), lambda c: f"\\u{ord(c):04x}"),
    "base32-double-percent": lambda v: _spell(base64.b32encode(v), lambda c: f"%25{ord(c):02X}"),
    "ansi-between-reversed-rot13": lambda v: _spell(
        codecs.encode(v[::-1].decode(), "rot13").encode(), str, "\x1b[2m"
    ),
    "mime-base64url-upper": lambda v: (
        base64.encodebytes(base64.urlsafe_b64encode(b"")[:0] + v).upper().replace(b"\n", b"\r\n")
    ),
}


@ENGINES
@pytest.mark.parametrize("name", sorted(COMPOSED_DISGUISES))
def test_disguises_composed_leave_no_window(engine: str, name: str) -> None:
    # An agent stacking disguises: after one pass, a second finds nothing left (no 16
    # characters of any form survive in the fold view of the output).
    t = tables(engine)
    for secret in (KEY, TOKEN):
        text = b"see: " + COMPOSED_DISGUISES[name](secret) + b" :end"
        out = t.scrub(text)
        assert out.startswith(b"see: ") and out.endswith(b" :end"), out
        assert MARK[secret] in out, (name, out)
        assert t.scrub(out) == out


# -- what a stream holds: only what could begin a window ------------------------------------------

PROSE = (
    b"The quick brown fox jumps over the lazy dog. Streaming text must not lag behind: "
    b"a model's answer is read as it is written, word by word.\n\nSecond paragraph, with "
    b"numbers 12345 and 2026-11-26, punctuation (like this); and a list:\n- one\n- two\n"
)
SSE_EVENT = (
    b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
    b'"delta": {"type": "text_delta", "text": "Hello world, how are you"}}\n\n'
)


@ENGINES
@pytest.mark.parametrize("text", [PROSE, SSE_EVENT * 3], ids=["prose", "sse"])
def test_text_that_cannot_begin_a_window_is_released_but_the_last_five_letters(
    engine: str, text: bytes
) -> None:
    t = tables(engine)
    rng = random.Random(len(text))
    for sizes in ([len(text)], [1] * len(text), [rng.randint(1, 30) for _ in range(len(text))]):
        stream = t.stream()
        out = b""
        fed = 0
        for size in sizes:
            if fed >= len(text):
                break
            out += stream.feed(text[fed : fed + size])
            fed = min(fed + size, len(text))
            held = text[len(out) : fed]
            assert text[: len(out)] == out and stream.pending == len(held)
            assert len(b"".join(scrub_fold.folded_pieces(held))) <= 5
        assert out + stream.flush() == text


@ENGINES
def test_a_window_prefix_is_held_whole_and_anything_else_is_not(engine: str) -> None:
    t = tables(engine)
    stream = t.stream()
    # The first W - 1 characters of the token could begin a window: all held.
    assert stream.feed(b"see " + TOKEN[: W - 1]) == b"see "
    assert stream.feed(b"!") == b""
    gap = b" " * (scrub_fold.MAX_GAP + 1)  # a BREAK: the group cannot grow
    assert stream.feed(TOKEN[W - 1 :] + gap + b"done") == MARK[TOKEN] + gap
    assert stream.flush() == b"done"
    # The same letters sorted (not a window) are released but the last five.
    stream = t.stream()
    text = b"see " + bytes(sorted(TOKEN[: W - 1]))
    assert stream.feed(text) == text[:-5]


@ENGINES
def test_a_stage_1_marker_is_a_break_released_at_once(engine: str) -> None:
    t = tables(engine)
    stream = t.stream()
    text = b"key " + MARK[KEY] + b" and " + MARK[TOKEN].upper()  # any case of a known name
    assert stream.feed(text) == text and stream.pending == 0
    # Cut anywhere, a marker is one unit: never released in part, and with what it ends.
    for cut in range(1, len(MARK[KEY])):
        stream = t.stream()
        assert stream.feed(b"a " + MARK[KEY][:cut]) == b""
        assert stream.feed(MARK[KEY][cut:]) == b"a " + MARK[KEY]
    # An unfinished marker waits, within the bound's unfinished unit; then it is text.
    longest = b"[REDACTED:" + b"a" * scrub_fold.MAX_NAME
    assert len(longest) + 1 <= scrub_fold.MAX_LOOKAHEAD
    stream = t.stream()
    assert stream.feed(b" " * 9 + longest) == b" " * 9 and stream.pending == len(longest)
    released = stream.feed(b"]")  # not a known name: letters, all but the last five released
    assert released == longest[:-5] and released + stream.flush() == longest + b"]"
    # A known name splitting a key only cuts it into parts, each still caught (16+ characters).
    half = len(KEY) // 2
    split = KEY[:half] + MARK[TOKEN] + KEY[half:]
    assert streamed(t, split, [7] * len(split)) == MARK[KEY] + MARK[TOKEN] + MARK[KEY]


@ENGINES
def test_a_marker_with_another_name_hides_nothing(engine: str) -> None:
    # A hostile agent's own "marker", named with the secret's ROT13: not a stage-1 name, so it
    # is read as text and the secret's form in it is caught.
    t = tables(engine)
    rot = codecs.encode(TOKEN.decode(), "rot13").encode()
    for name in (rot, rot[::-1], TOKEN.hex().encode()[:64]):
        out = streamed(t, b"[REDACTED:" + name + b"] ok", [5] * 20)
        assert out == b"[REDACTED:" + MARK[TOKEN] + b"] ok"


MARKED = (KEY, TOKEN, b" x ", b"sk-ant-", b"\n\n", b"[REDACTED:", b"word ", b"]")


@pytest.mark.parametrize("engine", ["reference", "auto"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(MARKED), min_size=1, max_size=10),
    st.lists(st.integers(1, 24), min_size=1, max_size=20),
)
def test_the_composed_stream_never_splits_a_stage_1_marker(
    engine: Any, pieces: list[bytes], cuts: list[int]
) -> None:
    scrubber = Scrubber(SECRETS, engine=engine)
    text = b"".join(pieces)
    stream = scrubber.stream()
    releases = []
    pos = 0
    k = 0
    while pos < len(text):
        size = cuts[k % len(cuts)]
        releases.append(stream.feed(text[pos : pos + size]))
        pos += size
        k += 1
    releases.append(stream.flush())
    whole = b"".join(releases)
    assert whole == scrubber.scrub(text)
    for mark in MARK.values():
        assert b"\0".join(releases).count(mark) == whole.count(mark)
