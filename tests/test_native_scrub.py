"""The C scrubber (native/src/scrub.c) outputs exactly what the Python reference outputs.

`native/scrub_reference.py` defines the output (`scrub_whole`) and the release timing
(`ReferenceStream`). Every comparison here goes through `fuzz_scrub_differential.check`: the C
engine's one-shot output and its streamed output equal `scrub_whole`, each `feed` releases what
the reference's releases and holds back as much, the held-back skeleton stays within
`Patterns.hold_bound`, and the stream refuses input after its flush. Both sets of loops are run
(AVX2 where the CPU has it, and the portable ones). The fuzz harnesses' seeds are replayed.
"""

from __future__ import annotations

import base64
import importlib.util
import random
import shutil
import threading
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from native import scrub_native
from native.scrub_patterns import (
    DEFAULT_SHAPES,
    MAX_SECRET_LEN,
    ZERO_WIDTH,
    Segment,
    Shape,
    cls,
    compile_patterns,
    crc32_base62,
    encodings,
    json_string,
    lit,
)
from native.scrub_reference import ReferenceStream, Tables, scrub_whole
from tests.conftest import needs

_FUZZ = Path(__file__).resolve().parent.parent / "fuzz"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _FUZZ / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness = _load("fuzz_scrub_differential")
sets_harness = _load("fuzz_scrub_secret_sets")
check = harness.check
Secrets = tuple[tuple[str, bytes], ...]

needs_native = pytest.mark.skipif(
    not scrub_native.AVAILABLE, reason=needs("the native build", "the C scrubber is not built")
)
BOTH = pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])

KEY = b"sk-ant-api03-Zx8Qw2Lm4Np6Rt1Vb3Yc5Hd7Jf9Kg0Ps2Uq4Wo6Ei8"
DB = b"correct-horse-battery-staple-1987"
SECRETS: Secrets = (("anthropic", KEY), ("db", DB), ("pin", b"4921"))


def test_the_extension_is_built() -> None:
    # `make install` (and so `make test`, CI) builds it wherever there is a C compiler; a silent
    # fallback would hide a broken build behind the (slow) reference.
    if shutil.which("gcc") or shutil.which("cc"):
        assert scrub_native.AVAILABLE


def streamed(tables: scrub_native.NativeTables, data: bytes, sizes: list[int]) -> bytes:
    stream = tables.stream()
    out = []
    pos = 0
    for size in sizes:
        out.append(stream.feed(data[pos : pos + size]))
        pos += size
    return b"".join(out) + stream.feed(data[pos:]) + stream.flush()


# Hypothesis: secret sets, text made of pieces likely to match, and chunkings.

ALPHABET = b"abcXYZ019 _-.=:\"'\\\n"
secret_values = st.one_of(
    st.binary(min_size=1, max_size=24),
    st.text(alphabet="abcdefgh0123-_+/ ", min_size=1, max_size=40).map(str.encode),
)
secret_sets = st.lists(
    st.tuples(st.sampled_from(["a", "b", "key.1"]), secret_values), max_size=4
).map(tuple)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Secrets, bytes, list[int]]:
    secrets = draw(secret_sets)
    pieces = list(harness.COMMON_PIECES) + [bytes([b]) for b in ALPHABET]
    for _, value in secrets:
        pieces += [value, value[: len(value) // 2 + 1], value[len(value) // 2 :]]
        pieces += encodings(value)[:12]
    parts = draw(st.lists(st.sampled_from(pieces), max_size=40))
    text = b"".join(parts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return secrets, text, sizes


@needs_native
@BOTH
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_native_equals_reference(simd: bool, case: tuple[Secrets, bytes, list[int]]) -> None:
    secrets, text, sizes = case
    check(secrets, text, sizes, simd)


@needs_native
@BOTH
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), seed=st.integers(0, 2**32))
def test_chunking_does_not_change_the_output(
    simd: bool, case: tuple[Secrets, bytes, list[int]], seed: int
) -> None:
    secrets, text, _ = case
    tables = harness.engines(secrets, simd)[2]
    whole = tables.scrub(text)
    assert whole == scrub_whole(Tables(compile_patterns(secrets)), text)
    rng = random.Random(seed)
    assert streamed(tables, text, [1] * len(text)) == whole
    sizes = []
    left = len(text)
    while left:
        sizes.append(min(left, rng.randint(1, 17)))
        left -= sizes[-1]
    assert streamed(tables, text, sizes) == whole


# Planted secrets: the raw value and every encoding, at every offset against the chunk edges.


@needs_native
@BOTH
@pytest.mark.parametrize("chunk", [1, 7, 8, 13, 64])
def test_planted_forms_at_every_offset(simd: bool, chunk: int) -> None:
    forms = [KEY, *encodings(KEY), DB[:8], b"4921"]
    for offset in range(chunk + 1):
        for form in forms:
            text = b"x" * offset + b" " + form + b" tail"
            sizes = [chunk] * (len(text) // chunk) + [len(text) % chunk]
            check(SECRETS, text, sizes, simd)


@needs_native
@BOTH
def test_planted_forms_are_redacted(simd: bool) -> None:
    tables = harness.engines(SECRETS, simd)[2]
    for form in [KEY, *encodings(KEY), *encodings(DB)]:
        out = tables.scrub(b"before " + form + b" after")
        assert form not in out and b"[REDACTED:" in out, form
    zw = ZERO_WIDTH[0]
    hidden = KEY[:10] + zw + KEY[10:30] + ZERO_WIDTH[4] + KEY[30:]
    assert tables.scrub(b"<" + hidden + b">") == b"<[REDACTED:anthropic]>"
    assert tables.scrub(b"kept" + zw + b"text") == b"kept" + zw + b"text"


@needs_native
@BOTH
def test_shapes_and_key_names(simd: bool) -> None:
    tables = harness.engines((), simd)[2]
    pem = (
        b"-----BEGIN RSA PRIVATE KEY-----\nMIIEow"
        + b"Zx9Qw3Rt7Yp2" * 4
        + b"\n-----END RSA PRIVATE KEY-----"
    )
    assert tables.scrub(b"a " + pem + b" b") == b"a [REDACTED:private-key] b"
    # A block with no room for a key in it is an example (43 base64 characters at least).
    example = pem.replace(b"Zx9Qw3Rt7Yp2" * 4, b"")
    assert tables.scrub(example) == example
    assert tables.scrub(b'{"Api_Key": "abc\\"d"}') == b'{"Api_Key": "[REDACTED:Api_Key]"}'
    assert tables.scrub(b"DB_PASSWORD='x y'") == b"DB_PASSWORD='[REDACTED:PASSWORD] y'"
    assert tables.scrub(b"task-" + b"a" * 30) == b"task-" + b"a" * 30
    body = b"Zx9Qw3Rt7Yp2Lm5Nb8Vc1Kd4Hs6Jf0"
    token = b"ghp_" + body + crc32_base62(body)
    assert tables.scrub(b"(" + token + b")") == b"([REDACTED:github])"


# Arbitrary shapes: every segment kind and option, not only the default shapes' combinations.

SHAPE_BYTES = "abAB01-_:=\"' \\."


@st.composite
def segments(draw: st.DrawFn, first: bool) -> Segment:
    kind = "lit" if first else draw(st.sampled_from(["lit", "cls", "json"]))
    if kind == "lit":
        text = draw(st.text(SHAPE_BYTES, min_size=3 if first else 1, max_size=5)).encode()
        return lit(text, fold_case=draw(st.booleans()))
    lo = draw(st.integers(0, 4))
    hi = draw(st.integers(max(lo, 1), 12))
    if kind == "json":
        return json_string(lo, hi)
    spec = draw(st.sampled_from(["a-b0-1", "A-Ba", "^ :", "0-1_-", "^\"'"]))
    stop = draw(st.sampled_from([b"", b"-", b"ab", b"::"]))
    suffixes = draw(st.sampled_from([(), (b"b",), (b"AB", b"1")]))
    return cls(spec, lo, hi, stop=stop, suffixes=suffixes)


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    count = draw(st.integers(1, 4))
    segs = tuple(draw(segments(first=k == 0)) for k in range(count))
    redact_from = draw(st.integers(0, count - 1))
    redact_to = draw(st.integers(redact_from + 1, count))
    name_from = draw(st.integers(-1, count - 1))
    optional_from = draw(st.sampled_from([-1, *range(1, count)]))
    not_after = draw(st.sampled_from([frozenset(), frozenset(b"ab0-")]))
    return Shape(
        draw(st.sampled_from(["s1", "s-2"])),
        segs,
        redact_from=redact_from,
        redact_to=redact_to,
        name_from=name_from,
        optional_from=optional_from,
        not_after=not_after,
    )


@needs_native
@BOTH
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_arbitrary_shapes(simd: bool, data: st.DataObject) -> None:
    shape_set = data.draw(st.lists(shapes(), min_size=1, max_size=4))
    patterns = compile_patterns([("k", b"ab01ab01")], shape_set)
    pieces = [seg.literal for shape in shape_set for seg in shape.segments if seg.literal]
    pieces += [bytes([b]) for b in SHAPE_BYTES.encode()] + [ZERO_WIDTH[0], b"\xe2"]
    text = b"".join(data.draw(st.lists(st.sampled_from(pieces), max_size=60)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    reference = Tables(patterns)
    native = scrub_native.NativeTables(patterns, simd=simd)
    want = scrub_whole(reference, text)
    assert native.scrub(text) == want
    stream, ref = native.stream(), ReferenceStream(reference)
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        assert stream.feed(text[a:b]) == ref.feed(text[a:b])
        assert stream.pending == ref.pending
    assert stream.flush() == ref.flush()


# Secret sets.

SETS: dict[str, Secrets] = {
    "empty": (),
    "duplicate value": (("a", b"hunter2hunter2"), ("b", b"hunter2hunter2")),
    "duplicate name": (("a", b"first-secret-1"), ("a", b"second-secret-2")),
    "overlapping": (("a", b"abcdefghijklmnop"), ("b", b"ijklmnopqrstuvwx")),
    "prefixes": (("a", b"prefix"), ("b", b"prefix-longer"), ("c", b"prefix-longer-still")),
    "one byte": (("a", b"x"), ("b", b"\xe2")),
    "around the window": (("a", b"1234567"), ("b", b"12345678"), ("c", b"123456789")),
    "binary": (("a", b"\x00\xff\xe2\x80\x8b\xef\xbb\xbf\x01"), ("b", b"\xe2\x80")),
}


@needs_native
@BOTH
@pytest.mark.parametrize("name", SETS)
def test_secret_sets(simd: bool, name: str) -> None:
    secrets = SETS[name]
    rng = random.Random(name)
    pieces = list(harness.secret_pieces(secrets)) + list(harness.COMMON_PIECES) + [b" ", b"x"]
    for _ in range(30):
        text = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        sizes = harness.chunk_sizes(rng.randint(0, 3), len(text), rng.getrandbits(32))
        check(secrets, text, sizes, simd)


@needs_native
@BOTH
def test_a_64_kib_secret(simd: bool) -> None:
    value = bytes(random.Random(1).getrandbits(8) for _ in range(MAX_SECRET_LEN))
    secrets: Secrets = (("big", value), ("small", b"tiny"))
    text = b"a " + value[1000:1009] + b" b " + value + b" c " + base64.b64encode(value)[:100]
    check(secrets, text, harness.chunk_sizes(2, len(text), 5), simd)
    check(secrets, text, [len(text)], simd)


# Big inputs, several threads, memory.


def _big_text(size: int) -> bytes:
    rng = random.Random(3)
    words = [b"the", b"scrubber", b"print(x)", b"password", b"api", b"-----", b"sk-", b"\n"]
    out = bytearray()
    while len(out) < size:
        out += rng.choice(words) + b" "
        if rng.random() < 0.002:
            out += rng.choice([KEY, *encodings(KEY), b"AKIA" + b"ABCDEFGH12345678", DB]) + b" "
    return bytes(out[:size])


@needs_native
@BOTH
def test_a_mebibyte(simd: bool) -> None:
    text = _big_text(1 << 20)
    want = scrub_whole(harness.engines(SECRETS, simd)[1], text)
    tables = harness.engines(SECRETS, simd)[2]
    assert tables.scrub(text) == want
    assert streamed(tables, text, [len(text)]) == want
    assert streamed(tables, text, [65537] * 16) == want
    assert streamed(tables, text, [1000] * 1048) == want


@needs_native
@BOTH
def test_large_chunks_with_zero_width_characters_and_held_tails(simd: bool) -> None:
    # Large feeds return the unchanged tail of the input without copying it in C; here the
    # pending tail, zero-width characters and redactions fall on every side of that tail.
    rng = random.Random(7)
    zw = list(ZERO_WIDTH)
    pieces = [b"word ", b"sk-ant-", KEY[:30], KEY, DB, b"\n", *zw, b"\xe2\x80", b"PASSWORD="]
    text = b"".join(rng.choice(pieces) for _ in range(20_000))
    want = scrub_whole(harness.engines(SECRETS, simd)[1], text)
    tables = harness.engines(SECRETS, simd)[2]
    assert tables.scrub(text) == want
    for size in (8191, 8192, 20_000, 65_536, 100_003):
        assert streamed(tables, text, [size] * (len(text) // size)) == want


@needs_native
def test_threads_share_the_tables() -> None:
    tables = harness.engines(SECRETS, True)[2]
    text = _big_text(200_000)
    want = scrub_whole(harness.engines(SECRETS, True)[1], text)
    results: dict[int, bytes] = {}

    def run(k: int) -> None:
        sizes = harness.chunk_sizes(2 + k % 2, len(text), k)
        results[k] = streamed(tables, text, sizes) + tables.scrub(text)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {k: want + want for k in range(6)}


@needs_native
def test_memory_per_stream_with_4096_secrets() -> None:
    rng = random.Random(4)
    alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    secrets = [
        (f"k{i}", bytes(rng.choice(alphabet) for _ in range(rng.randint(40, 100))))
        for i in range(4096)
    ]
    tables = scrub_native.NativeTables(compile_patterns(secrets, DEFAULT_SHAPES))
    text = _big_text(300_000)
    pem = b"-----BEGIN RSA PRIVATE KEY-----\n" + b"QUJD" * 4000
    for chunk in (100, 4096, 16384, 1 << 20):
        stream = tables.stream()
        for pos in range(0, len(text), chunk):
            stream.feed(text[pos : pos + chunk])
            assert stream.footprint < 64 * 1024
        assert stream.feed(b"\n" + secrets[7][1][:30]).endswith(b"\n[REDACTED:k7]")  # half
        assert 0 < stream.pending < 8 and stream.footprint < 64 * 1024
        stream.feed(pem)  # an open private key: held whole
        assert stream.pending > 16_000 and stream.footprint < 64 * 1024
        assert b"[REDACTED:private-key]" in stream.flush()


@needs_native
@BOTH
def test_runs_of_zero_width_characters_are_capped_and_held_with_what_they_follow(
    simd: bool,
) -> None:
    # A run keeps its first two zero-width characters (the rest are dropped), so a would-be
    # secret padded with them is held within Patterns.hold_bound_bytes.
    tables = harness.engines((), simd)[2]
    stream = tables.stream()
    assert stream.feed(b"ok sk-ant-") == b"ok "
    assert stream.feed(ZERO_WIDTH[0] * 1000) == b""
    assert stream.pending == len(b"sk-ant-") + 6
    assert stream.feed(b"\xe2") == b""  # may start a zero-width character: carried
    assert stream.pending == len(b"sk-ant-") + 7
    assert stream.feed(b"\x80\x8b no") == b"sk-ant-" + ZERO_WIDTH[0] * 2 + b" no"
    # Chunk boundaries anywhere in and around long runs and cut characters.
    text = b"x sk-ant-" + ZERO_WIDTH[1] * 50_000 + b"abc" * 40_000 + b" " + KEY + b" y"
    text += (ZERO_WIDTH[4] * 3 + b"\xe2\x80" + ZERO_WIDTH[3] * 4 + "\u2014".encode()) * 500
    want = scrub_whole(harness.engines((), simd)[1], text)
    assert ZERO_WIDTH[1] * 3 not in want and len(want) < len(text) - 100_000
    assert tables.scrub(text) == want
    for sizes in ([9, 150_000, 100_000], [9, 1000, 300_000], [1] * 2000 + [len(text)]):
        assert streamed(tables, text, sizes) == want
    rng = random.Random(5)
    assert streamed(tables, text, [rng.randint(1, 7) for _ in range(len(text) // 3)]) == want
    # Padded with a million: held within the bound, not a million.
    stream = tables.stream()
    stream.feed(b"sk-ant-api03-" + ZERO_WIDTH[2] * 1_000_000)
    patterns = harness.engines((), simd)[0]
    assert stream.pending <= patterns.hold_bound_bytes and stream.footprint < 64 * 1024


# The stream's contract.


@needs_native
def test_feed_after_flush_raises() -> None:
    stream = harness.engines(SECRETS, True)[2].stream()
    assert stream.feed(b"abc") + stream.flush() == b"abc"
    with pytest.raises(ValueError, match="feed after flush"):
        stream.feed(b"x")
    with pytest.raises(scrub_native.ScrubStateError, match="flush twice"):
        stream.flush()
    assert issubclass(scrub_native.ScrubStateError, scrub_native.ScrubEngineError)


@needs_native
def test_pending_and_release_timing() -> None:
    stream = harness.engines(SECRETS, True)[2].stream()
    assert stream.feed(b"data: hello\n\n") == b"data: hello\n\n"
    assert stream.pending == 0
    assert stream.feed(b"x " + KEY[:20]) == b"x "
    assert stream.pending == 20
    assert stream.feed(KEY[20:] + b"\n") == b"[REDACTED:anthropic]\n"
    assert stream.flush() == b""


@needs_native
def test_inconsistent_tables_are_refused() -> None:
    ffi, lib = scrub_native.ffi, scrub_native.lib
    out = ffi.new("scrub_tables **")
    lits = ffi.new("int32_t[]", [0, 100, 0, 1])  # a literal beyond the blob
    names = ffi.new("int32_t[]", [0, 1])
    code = lib.scrub_tables_new(
        b"ab", 2, names, 1, lits, 1, ffi.NULL, 0, ffi.NULL, 0, ffi.NULL, 0, 0, out
    )
    assert code == lib.SCRUB_EINVAL and out[0] == ffi.NULL


@needs_native
def test_bytearray_and_memoryview_input() -> None:
    tables = harness.engines(SECRETS, True)[2]
    text = b"a " + KEY + b" b"
    assert tables.scrub(bytearray(text)) == tables.scrub(memoryview(text)) == tables.scrub(text)


# The fuzz harnesses: their seeds, and that they catch a disagreement.


@needs_native
@pytest.mark.parametrize("seed", harness.SEEDS)
def test_differential_fuzz_seeds(seed: bytes) -> None:
    harness.TestOneInput(seed)


@needs_native
@pytest.mark.parametrize("seed", sets_harness.SEEDS)
def test_secret_set_fuzz_seeds(seed: bytes) -> None:
    sets_harness.TestOneInput(seed)


@needs_native
def test_harness_catches_a_disagreement(monkeypatch: pytest.MonkeyPatch) -> None:
    real = scrub_native.NativeStream.feed

    def lying(self: scrub_native.NativeStream, chunk: bytes) -> bytes:
        return real(self, chunk).replace(b"REDACTED", b"redacted")

    monkeypatch.setattr(scrub_native.NativeStream, "feed", lying)
    with pytest.raises(harness.Mismatch):
        check(SECRETS, b"x " + KEY + b" y", [5, 100], True)
