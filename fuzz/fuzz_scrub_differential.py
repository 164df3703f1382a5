"""Differential fuzzing of the C scrubber (native/src/scrub.c) against the Python reference.

Run:  python fuzz/fuzz_scrub_differential.py -runs=2000000 -max_len=4096 /tmp/corpus-scrub
(atheris is imported only under __main__; tests import `TestOneInput` and `SEEDS` without it.)

Invariant, for a fixed small secret set plus the default shapes, on text built from the fuzz
input: the C engine's one-shot output and its streamed output (the input cut into chunks chosen
by the input itself) are byte for byte `scrub_reference.scrub_whole`; every `feed` releases what
`ReferenceStream.feed` releases and holds back as much (so the C never releases a byte the
reference still holds); the held-back skeleton never exceeds `Patterns.hold_bound`, the held
bytes `Patterns.hold_bound_bytes` (zero-width characters capped to runs of two); a stream
refuses input after its flush. (Feed by feed when the text is short or the chunks few: the
reference stream rescans its pending text on every feed.)

Input layout: byte 0 chooses the engine's loops (bit 0: AVX2 where the CPU has it, or the
portable ones) and the chunking (bits 1-2: one chunk, one byte at a time, chunks of 1-64 bytes,
chunks of 1-1024 bytes; the sizes come from a PRNG seeded with the input). Every further byte
below 0x80 is itself; 0x80-0xBF picks one of `COMMON_PIECES` (shape openers and bodies,
zero-width characters whole and cut, quotes, line breaks, checksummed and placeholder bodies
for the shape validators); 0xC0-0xFF with the byte after it
picks one of `PIECES` (the secrets whole and cut, their encodings whole and cut). The text is
cut at MAX_TEXT bytes.
"""

from __future__ import annotations

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
        import native.scrub_native
        import native.scrub_patterns
        import native.scrub_reference  # noqa: F401

from native import scrub_native
from native.scrub_patterns import (
    ZERO_WIDTH,
    Patterns,
    compile_patterns,
    crc32_base62,
    encodings,
)
from native.scrub_reference import ReferenceStream, Tables, scrub_whole, split

SECRETS: tuple[tuple[str, bytes], ...] = (
    ("anthropic", b"sk-ant-api03-Zx9Kq2Lm8Np4Rs6Tu0Vw3Yb5Cd7Ef1Gh"),
    ("db", b"correct horse/battery+staple"),
    ("pin", b"4921"),
    ("zw", b"ke\xe2\x80\x8by-\xffvalue\x00!"),
)


def _secret_pieces(value: bytes) -> list[bytes]:
    half = len(value) // 2
    return [value, value[:half], value[half:], value[:7], value[-7:], value[1:9]]


_CRC = crc32_base62(b"Zx9Qw3Rt7Yp2Lm5Nb8Vc1Kd4Hs6Jf0")
SHAPE_PIECES: tuple[bytes, ...] = (
    b"sk-ant-",
    b"sk-proj-",
    b"sk-",
    b"AIzaSy",
    b"ghp_",
    b"github_pat_",
    b"xoxb-",
    b"AKIA",
    b"ASIA",
    b"eyJ",
    b".eyJ",
    b"-----BEGIN ",
    b"RSA PRIVATE KEY",
    b"OPENSSH PRIVATE KEY",
    b"-----",
    b"-----END ",
    b'"password": "',
    b'"API_KEY":"',
    b"PASSWORD=",
    b"DB_PASSWORD='",
    b"GH_TOKEN=",
    b"SECRET_KEY=",
    b"\\n",
    b'\\"',
    b"task-",
    b"A1b2C3d4E5f6G7h8I9j0",
    b"0123456789ABCDEF",
    b"abcdefghijklmnopqrstuvwxyz",
    b"\r\n",
    b"\n\n",
    b"data: ",
    # The validators of the provider shapes: a GitHub token with its CRC-32 tail (whole and
    # cut), placeholder words, runs and templates, and openers of shapes that use them.
    b"ghp_Zx9Qw3Rt7Yp2Lm5Nb8Vc1Kd4Hs6Jf0",
    b"Zx9Qw3Rt7Yp2Lm5Nb8Vc1Kd4Hs6Jf0",
    _CRC,
    b"npm_",
    b"sk_live_",
    b"glpat-",
    b"xoxp-41684372915-",
    b"8Q~",
    b"hf_",
    b"EXAMPLE",
    b"xxxx",
    b"${API_KEY}",
    b"<your-key>",
    b"aaaaaa",
    b"API_KEY=",
    # A published example key (never redacted by a shape) and a third of a small PEM key body
    # (the private-key shape wants 43 base64 characters between BEGIN and END).
    b"AIzaSyAnLA7NfeLquW1tJFpx_eQCxoX-oo6YyIs",
    b"MC4CAQAwBQYDK2VwBCIEI",
)
BYTE_PIECES: tuple[bytes, ...] = (
    *ZERO_WIDTH,
    b"\xe2",
    b"\xe2\x80",
    b"\xe2\x81",
    b"\xef",
    b"\xef\xbb",
    b"\x80",
    b"\x8b",
    b"\xbb",
    b"\xff",
    "\u2014".encode(),
)


COMMON_PIECES = (*SHAPE_PIECES, *BYTE_PIECES)


def secret_pieces(secrets: tuple[tuple[str, bytes], ...]) -> tuple[bytes, ...]:
    """Each secret whole and cut, each of its encodings whole and cut."""
    pieces: list[bytes] = []
    for _, value in secrets:
        pieces += _secret_pieces(value)
        for enc in encodings(value):
            pieces += [enc, enc[: len(enc) // 2], enc[len(enc) // 2 :]]
    return tuple(pieces)


PIECES = secret_pieces(SECRETS)


def build_text(body: bytes, pieces: tuple[bytes, ...]) -> bytes:
    """Bytes below 0x80 stand for themselves; 0x80-0xBF pick a common piece (shapes, zero-width
    characters); 0xC0-0xFF and the next byte pick one of `pieces`."""
    out = bytearray()
    i = 0
    while i < len(body):
        b = body[i]
        i += 1
        if b < 0x80:
            out.append(b)
        elif b < 0xC0 or not pieces:
            out += COMMON_PIECES[(b - 0x80) % len(COMMON_PIECES)]
        else:
            index = (b - 0xC0) * 256 + (body[i] if i < len(body) else 0)
            i += 1
            out += pieces[index % len(pieces)]
    return bytes(out)


def chunk_sizes(mode: int, size: int, seed: int) -> list[int]:
    """Chunk lengths summing to size: one chunk, bytewise, or PRNG-chosen pieces."""
    rng = random.Random(seed)
    if mode == 0 or size == 0:
        return [size]
    if mode == 1 and size <= 256:
        return [1] * size
    top = 64 if mode in (1, 2) else 1024
    sizes = []
    left = size
    while left:
        n = min(left, rng.choice((1, 1, 2, 3, rng.randint(1, top))))
        sizes.append(n)
        left -= n
    return sizes


MAX_TEXT = 4096  # the reference is Python: longer texts only slow the search down
PER_FEED = 64


class Mismatch(AssertionError):
    """The C engine's output differs from the reference's."""


@lru_cache(maxsize=16)
def engines(
    secrets: tuple[tuple[str, bytes], ...], simd: bool
) -> tuple[Patterns, Tables, scrub_native.NativeTables]:
    """Compiled patterns, reference tables and C tables for a secret set (cached: fuzz inputs
    mostly keep their secret set)."""
    patterns = compile_patterns(secrets)
    return patterns, Tables(patterns), scrub_native.NativeTables(patterns, simd=simd)


def check(
    secrets: tuple[tuple[str, bytes], ...], text: bytes, sizes: list[int], simd: bool
) -> None:
    patterns, tables, native = engines(secrets, simd)
    want = scrub_whole(tables, text)
    got = native.scrub(text)
    if got != want:
        raise Mismatch(f"one-shot: {secrets!r} {text!r}: {got!r} != {want!r}")
    stream = native.stream()
    # The reference stream rescans its pending text on every feed: it is followed feed by feed
    # for short texts or few chunks (otherwise only the concatenated output is compared).
    per_feed = len(sizes) <= PER_FEED or len(text) <= 512
    ref = ReferenceStream(tables) if per_feed else None
    out = []
    pos = 0
    for size in sizes:
        chunk = text[pos : pos + size]
        pos += size
        mine = stream.feed(chunk)
        theirs = ref.feed(chunk) if ref else mine
        if mine != theirs or (ref and stream.pending != ref.pending):
            raise Mismatch(
                f"feed at {pos}: {secrets!r} {text!r} {sizes!r}: released {mine!r} holding "
                f"{stream.pending}, the reference {theirs!r} holding {ref and ref.pending}"
            )
        if stream.pending > patterns.hold_bound_bytes or (
            ref and len(split(ref.held, False).skeleton) > patterns.hold_bound
        ):
            raise Mismatch(f"holds {stream.pending} bytes, over the hold bounds: {text!r}")
        out.append(mine)
    out.append(stream.flush())
    if (ref and ref.flush() != out[-1]) or b"".join(out) != want:
        raise Mismatch(f"stream: {secrets!r} {text!r} {sizes!r}: {b''.join(out)!r} != {want!r}")
    try:
        stream.feed(b"x")
    except ValueError:
        pass
    else:
        raise Mismatch("feed after flush was accepted")


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    mode = data[0]
    text = build_text(data[1:], PIECES)[:MAX_TEXT]
    sizes = chunk_sizes((mode >> 1) & 3, len(text), zlib.crc32(data))
    check(SECRETS, text, sizes, simd=bool(mode & 1))


SEEDS: tuple[bytes, ...] = (
    b"\x00hello world",
    b"\x01" + bytes(range(0x80, 0xC0)),
    b"\x02key: \xc0\x00 and \xc0\x06 end \xc0\x09",
    b"\x03\x86\x86 \x87\x87 \xa0\xa5",
    b"\x05" + b"x" * 40 + b"\x80",
    b"\x06" + bytes(range(0x80, 0x100)),
    b"\x07" + bytes(range(0xFF, 0x7F, -1)),
    *(b"\x04 " + bytes([0xC0 + i // 256, i % 256]) + b" " for i in range(0, 300, 7)),
    *(bytes([m]) + bytes(range(i, i + 40)) for m in (0, 3, 4, 7) for i in range(0, 200, 40)),
)


def main() -> None:
    import atheris

    if not scrub_native.AVAILABLE:
        sys.exit("native scrubber not built: run `python -m native.build` first")
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
