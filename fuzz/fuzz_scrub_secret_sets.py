"""Differential fuzzing of the C scrubber against the Python reference, over secret sets.

Run:  python fuzz/fuzz_scrub_secret_sets.py -runs=1000000 -max_len=4096 /tmp/corpus-secrets
(atheris is imported only under __main__; tests import `TestOneInput` and `SEEDS` without it.)

The same invariant as fuzz_scrub_differential.py (one-shot and streamed output equal the
reference's, feed by feed, the held-back skeleton within `Patterns.hold_bound`), but the fuzz
input also chooses the secret set, with the default shapes: no secret at all, duplicates (the
same value under two names, the same name twice), values that overlap or are prefixes of each
other, 1-byte values, values around the 8-byte window, up to 64 KiB.

Input layout: byte 0 as in fuzz_scrub_differential.py (loops, chunking); byte 1: the number of
secrets (low 3 bits); then per secret two bytes, `kind` and `size`: kind bits 0-1 say where the
value comes from (fresh bytes of the input, cycled to the size; a prefix of the previous value;
the previous value's tail followed by fresh bytes; the previous value again), bit 2 reuses the
previous name, bit 7 with size 0xFF asks for 64 KiB (size 0xFF alone: 4 KiB); other sizes index
`SIZES`. The rest is the text (fuzz_scrub_differential.build_text over the pieces of these
secrets and the common pieces).
"""

from __future__ import annotations

import sys
import zlib
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

from fuzz.fuzz_scrub_differential import (
    MAX_TEXT,
    build_text,
    check,
    chunk_sizes,
    secret_pieces,
)
from native import scrub_native
from native.scrub_patterns import MAX_SECRET_LEN

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 16, 17, 20, 24, 33, 40, 50, 64, 100, 255)


def read_secrets(data: bytes) -> tuple[tuple[tuple[str, bytes], ...], bytes]:
    """The secret set the input describes, and the rest of the input (the text)."""
    count = data[0] & 7 if data else 0
    pos = 1
    secrets: list[tuple[str, bytes]] = []
    for i in range(count):
        kind = data[pos] if pos < len(data) else 0
        code = data[pos + 1] if pos + 1 < len(data) else 0
        pos += 2
        size = SIZES[code % len(SIZES)]
        if code == 0xFF:
            size = MAX_SECRET_LEN if kind & 0x80 else 4096
        previous = secrets[-1][1] if secrets else b"\x00"
        source = kind & 3
        if source == 1:
            value = previous[: max(1, min(size, len(previous) - 1))]
        elif source == 3:
            value = previous
        else:
            fresh = data[pos : pos + min(size, 64)] or b"\x00"
            pos += len(fresh)
            if source == 2:
                fresh = previous[len(previous) // 2 :] + fresh
            value = (fresh * (size // len(fresh) + 1))[:size]
        name = secrets[-1][0] if kind & 4 and secrets else f"s{i}"
        secrets.append((name, value))
    return tuple(secrets), data[pos:]


def TestOneInput(data: bytes) -> None:
    if len(data) < 2:
        return
    mode = data[0]
    secrets, body = read_secrets(data[1:])
    text = build_text(body, secret_pieces(secrets))[:MAX_TEXT]
    sizes = chunk_sizes((mode >> 1) & 3, len(text), zlib.crc32(data))
    check(secrets, text, sizes, simd=bool(mode & 1))


def seed(mode: int, specs: list[tuple[int, int, bytes]], text: bytes) -> bytes:
    """An input: the mode byte, secrets as (kind, size or 0xFF, fresh bytes), then the text."""
    out = bytearray([mode, len(specs)])
    for kind, size, fresh in specs:
        out += bytes([kind, size if size == 0xFF else SIZES.index(size)]) + fresh
    return bytes(out + text)


SEEDS: tuple[bytes, ...] = (
    seed(0, [], b"hello sk-ant-api03-abcdefghijklmnopqrstuvwxyz"),  # no secrets
    seed(1, [(0, 1, b"a")], b" banana"),  # a 1-byte secret
    seed(3, [(0, 6, b"hunter"), (3, 6, b"")], b"x hunter hunter"),  # the same value twice
    seed(5, [(0, 12, b"secretvalue1"), (1, 7, b"")], b" secretvalue1 secr"),  # a prefix of it
    seed(7, [(0, 16, b"abcdefghijklmnop"), (2, 12, b"qrstuvwxyz01")], b" \xc0\x00 \xc0\x10"),
    seed(2, [(0, 8, b"abcdefgh"), (4, 8, b"abcdefgh")], b" abcdefgh"),  # one name, twice
    seed(6, [(0, 0xFF, b"0123456789abcdef")], b" \xc0\x00 \xc0\x02 0123456789"),  # 4 KiB
    seed(0, [(0x80, 0xFF, b"xyz")], b" \xc0\x00 xyzxyzxyz"),  # 64 KiB
    *(
        seed(m, [(0, 20, bytes(range(i, i + 20))), (2, 9, bytes(range(i + 3, i + 12)))], b" \xc0")
        for m in (0, 3, 5)
        for i in range(0, 200, 50)
    ),
)


def main() -> None:
    import atheris

    if not scrub_native.AVAILABLE:
        sys.exit("native scrubber not built: run `python -m native.build` first")
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
