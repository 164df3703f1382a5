"""Differential fuzzing of the C fold engine (native/src/fold.c) against the Python reference.

Run:  python fuzz/fuzz_scrub_fold_differential.py -runs=2000000 -max_len=4096 /tmp/corpus-fold
(atheris is imported only under __main__; tests import `check`, `TestOneInput` and `SEEDS`.)

Invariant, for a fixed secret set (a key, a random token, a secret with a non-ASCII character,
so short windows exist, and a periodic one, so groups fill): the C engine's one-shot output is
`scrub_fold.fold_whole`; its stream, the input cut into chunks chosen by the input itself,
releases on every feed what `FoldStream.feed` releases and holds back as much (feed by feed when
there are at most PER_FEED chunks), never more than `hold_bound_bytes`; the concatenation equals
the one-shot output; a stream refuses input after its flush.

Input layout: byte 0 chooses the chunking (one chunk, one byte at a time, chunks of 1-64 or
1-1024 bytes from a PRNG seeded with the input). Every further byte below 0x80 is itself;
0x80-0xFF picks one of `PIECES` (the secrets and their derived forms whole and cut, decoder
openers cut at every length, escapes, entities, ANSI sequences, invalid UTF-8). The text is cut
at MAX_TEXT bytes.
"""

from __future__ import annotations

import base64
import codecs
import random
import sys
import zlib
from functools import lru_cache
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import atheris

    # Only the scrubber's own modules are instrumented: instrumenting every module loaded
    # (atheris.instrument_all) takes some 20 s before the first input.
    with atheris.instrument_imports(include=["native"]):
        import native.scrub_fold
        import native.scrub_fold_native  # noqa: F401

from native import scrub_fold_native
from native.scrub_fold import FoldStream, FoldTables, fold_whole

SECRETS: tuple[tuple[str, bytes], ...] = (
    ("anthropic", b"sk-ant-api03-Zx9Kq2Lm8Np4Rs6Tu0Vw3Yb5Cd7Ef1Gh"),
    ("token", b"q7RmT2vXk9LpW4sZ8nB3cF6h"),
    ("accent", "Zx8Qw2Lm4Np6R\u00e9-Vb3Yc5Hd7Jf9Kg0P".encode()),
    ("periodic", b"0123456789abcdefGHIJ" * 2),
)


def _forms(value: bytes) -> list[bytes]:
    text = value.decode("utf-8", "replace")
    return [
        value,
        value.upper(),
        value[::-1],
        codecs.encode(text, "rot13").encode(),
        value.hex().encode(),
        base64.b64encode(b"x" + value),
        base64.b32encode(value),
        " ".join(text).encode(),
        "".join(f"&#{ord(c)};" for c in text).encode(),
        "".join(f"%25{ord(c):02X}" for c in text if ord(c) < 128).encode(),
        "".join(f"\\u{ord(c):04x}" for c in text).encode(),
        text.encode("utf-16-le"),
        "\u00ad".join(text).encode(),
        "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text).encode(),
    ]


def _pieces() -> tuple[bytes, ...]:
    out: list[bytes] = []
    for _, value in SECRETS:
        for form in _forms(value):
            half = len(form) // 2
            out += [form, form[:half], form[half:], form[3:20]]
    openers = (
        b"%252525",
        b"&amp;amp;#x1d400;",
        b"&#12345678;",
        b"&nbsp;",
        b"\\u{1d7ce}",
        b"\\U0001d41a",
        b"\\163",
        b"\\x4",
        b"\x1b[1;31m",
        b"\x1b]8;;http://a/\x1b\\",
        b"\x1b]0;title\x07",
        b"\xf0\x9d\x90\x80",
        b"\xef\xbc\xa1",
        "\u015b\u0301\U0001f511\u4e2d".encode(),
        b"[REDACTED:anthropic]",
        b"[REDACTED:Token]",
        b"[REDACTED:" + b"a" * 64 + b"]",
    )
    for opener in openers:
        out += [opener[:k] for k in range(1, len(opener) + 1)]
    out += [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\n\n", b" " * 9, b"\\n", b"[REDACTED:x]"]
    return tuple(out)


PIECES = _pieces()
MAX_TEXT = 4096
PER_FEED = 64


def build_text(body: bytes) -> bytes:
    out = bytearray()
    for b in body:
        out += bytes([b]) if b < 0x80 else PIECES[(b - 0x80) % len(PIECES)]
    return bytes(out[:MAX_TEXT])


def chunk_sizes(mode: int, size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    if mode == 0 or size == 0:
        return [size]
    if mode == 1 and size <= 128:
        return [1] * size
    top = 64 if mode in (1, 2) else 1024
    sizes = []
    left = size
    while left:
        n = min(left, rng.choice((1, 2, 3, rng.randint(1, top))))
        sizes.append(n)
        left -= n
    return sizes


class Mismatch(AssertionError):
    """The C engine's output or timing differs from the reference's."""


@lru_cache(maxsize=8)
def engines(
    secrets: tuple[tuple[str, bytes], ...],
) -> tuple[FoldTables, scrub_fold_native.NativeFoldTables]:
    return FoldTables(secrets), scrub_fold_native.NativeFoldTables(secrets)


def check(secrets: tuple[tuple[str, bytes], ...], text: bytes, sizes: list[int]) -> None:
    ref, native = engines(secrets)
    want = fold_whole(ref, text)
    got = native.scrub(text)
    if got != want:
        raise Mismatch(f"one-shot: {text!r}: {got!r} != {want!r}")
    mine = native.stream()
    # The reference stream decodes its pending bytes again on every feed: it is followed feed
    # by feed when the chunks are few (otherwise only the concatenated output is compared).
    theirs = FoldStream(ref) if len(sizes) <= PER_FEED else None
    out = []
    pos = 0
    for size in sizes:
        chunk = text[pos : pos + size]
        pos += size
        a = mine.feed(chunk)
        b = theirs.feed(chunk) if theirs else a
        if a != b or (theirs and mine.pending != theirs.pending):
            raise Mismatch(
                f"feed at {pos}: {text!r} {sizes!r}: released {a!r} holding {mine.pending}, "
                f"the reference {b!r} holding {theirs and theirs.pending}"
            )
        if mine.pending > ref.hold_bound_bytes:
            raise Mismatch(f"holds {mine.pending} bytes, over the bound: {text!r}")
        out.append(a)
    a = mine.flush()
    out.append(a)
    if (theirs and theirs.flush() != a) or b"".join(out) != want:
        raise Mismatch(f"stream: {text!r} {sizes!r}: {b''.join(out)!r} != {want!r}")
    try:
        mine.feed(b"x")
    except ValueError:
        pass
    else:
        raise Mismatch("feed after flush was accepted")


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    text = build_text(data[1:])
    check(SECRETS, text, chunk_sizes(data[0] & 3, len(text), zlib.crc32(data)))


SEEDS: tuple[bytes, ...] = (
    b"\x00hello world",
    b"\x01" + bytes(range(0x80, 0x100)),
    b"\x02" + bytes(range(0xFF, 0x7F, -1)),
    b"\x03 key: \x80 and \x84 end \x8c",
    *(
        bytes([m]) + bytes(range(i, min(i + 48, 256)))
        for m in range(4)
        for i in range(0x80, 0x100, 48)
    ),
)


def main() -> None:
    import atheris

    if not scrub_fold_native.AVAILABLE:
        sys.exit("native fold engine not built: run `python -m native.build` first")
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
