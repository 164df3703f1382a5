"""The whole scrubber in one C call per feed (`native/src/composed.c`, `NativeStream` with fold
tables) against `native.scrub.ComposedStream`, which defines it: stage 1 then stage 2 as two
streams, what the first releases fed to the second. Same bytes at the same feeds, the same
pending counts, flush, errors, the hold bound; then the C-only matters: stage 1 alone through
the same call, any bytes-like input, one stream from two threads, work areas per thread.
"""

from __future__ import annotations

import base64
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from native.scrub import ComposedStream, Scrubber
from native.scrub_fold import FoldStream, FoldTables
from native.scrub_reference import ReferenceStream
from tests.conftest import needs

try:
    from native import scrub_fold_native, scrub_native

    NATIVE = scrub_native.AVAILABLE and scrub_fold_native.AVAILABLE
except ImportError:
    NATIVE = False

pytestmark = pytest.mark.skipif(
    not NATIVE, reason=needs("the native build", "the C scrubber is not built")
)

KEY = b"sk-ant-api03-Zx8Qw2Lm4Np6Rt1Vb3Yc5Hd7Jf9Kg0Ps2Uq4Wo6Ei8"
TOKEN = b"Qm7vT2xK9pLr4Wd8Ns1Hc6Jy3Fb5Gz0Ea2Uo"
SECRETS = (("anthropic", KEY), ("token", TOKEN), ("pin", b"4921"))
# Pieces of input: the secrets raw, cut, in forms only stage 2 reads, stage-1 markers (whole,
# cut, named or not), escapes and units the decoders hold, zero-width characters, plain text.
PIECES = (
    KEY,
    KEY[:20],
    KEY[20:],
    TOKEN,
    TOKEN.upper(),
    TOKEN[::-1],
    b" ".join(bytes([c]) for c in TOKEN[:24]),
    base64.b64encode(b"x" + TOKEN)[:30],
    base64.b64encode(b"x" + TOKEN)[30:],
    TOKEN.hex().encode()[:40],
    TOKEN.hex().encode()[40:],
    b"ghp_" + b"A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8",
    b"4921",
    b"%25",
    b"%",
    b"&amp;",
    b"&#x",
    b";",
    b"\\u00",
    b"\x1b[",
    b"\x07",
    b"\xe2\x80",
    b"\x8b",
    b"\xef\xbc\xa1",
    b"\n\n",
    b"data: ",
    b"hello world ",
    b"[REDACTED:x]",
    b"[REDACTED:anthropic]",
    b"[REDACTED:",
    b"anthropic]",
    b"[REDACTED:token",
)


def scrubbers(secrets: Any = SECRETS) -> tuple[Scrubber, Scrubber]:
    native = Scrubber(secrets)
    assert native.engine == "native" and native.fold_engine == "native"
    return native, Scrubber(secrets, engine="reference")


def two_calls(native: Scrubber) -> ComposedStream:
    """The same scrubber's stages as two streams, composed in Python."""
    assert native._native is not None and native._fold is not None
    return ComposedStream(native._native.stream(), native._fold.stream())


def reference(ref: Scrubber) -> Any:
    assert ref._tables is not None
    first = ReferenceStream(ref._tables)
    return first if ref._fold is None else ComposedStream(first, ref._fold.stream())


def sizes_from(total: int, cuts: list[int]) -> list[int]:
    sizes, left = [], total
    while left:
        for c in cuts:
            if not left:
                break
            sizes.append(min(c, left))
            left -= sizes[-1]
    return sizes


def run_all(streams: list[Any], text: bytes, sizes: list[int], bound: int) -> bytes:
    """Feed every stream the same chunks: each feed's output and pending count must agree."""
    outs = []
    pos = 0
    for size in sizes:
        chunk = text[pos : pos + size]
        pos += size
        got = [s.feed(chunk) for s in streams]
        assert all(g == got[0] for g in got), (chunk, got)
        pending = [s.pending for s in streams]
        assert all(p == pending[0] for p in pending), pending
        assert pending[0] <= bound
        outs.append(got[0])
    got = [s.flush() for s in streams]
    assert all(g == got[0] for g in got), got
    outs.append(got[0])
    return b"".join(outs)


NATIVE_PAIR: list[tuple[Scrubber, Scrubber]] = []


def pair() -> tuple[Scrubber, Scrubber]:
    if not NATIVE_PAIR:
        NATIVE_PAIR.append(scrubbers())
    return NATIVE_PAIR[0]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.sampled_from(PIECES), max_size=14),
    st.lists(st.integers(0, 48), min_size=1, max_size=20).filter(any),
)
def test_one_call_equals_the_two_stages_feed_by_feed(pieces: list[bytes], cuts: list[int]) -> None:
    native, ref = pair()
    text = b"".join(pieces)
    one = native.stream()
    assert isinstance(one, scrub_native.NativeStream)
    streams = [one, two_calls(native), reference(ref)]
    out = run_all(streams, text, sizes_from(len(text), cuts), native.hold_bound_bytes)
    assert out == native.scrub(text) == ref.scrub(text)
    for s in streams:  # after the end: the same errors
        with pytest.raises(ValueError):
            s.feed(b"x")
        with pytest.raises(ValueError):
            s.flush()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", min_size=8),
        min_size=1,
        max_size=3,
    ),
    st.binary(max_size=200),
    st.lists(st.integers(1, 64), min_size=1, max_size=8),
    st.data(),
)
def test_random_secrets_and_inputs(
    values: list[str], noise: bytes, cuts: list[int], data: st.DataObject
) -> None:
    secrets = [(f"s{k}", v.encode()) for k, v in enumerate(values)]
    native, ref = Scrubber(secrets), Scrubber(secrets, engine="reference")
    forms = [v.encode() for v in values] + [v.upper().encode() for v in values]
    forms += [b"[REDACTED:s0]", b"[REDACTED:", b"\xe2\x80\x8b"]
    parts = data.draw(st.lists(st.sampled_from(forms) | st.just(noise), max_size=6))
    text = b" ".join(parts)
    streams = [native.stream()]
    if native._fold is not None:
        streams.append(two_calls(native))
    streams.append(reference(ref))
    out = run_all(streams, text, sizes_from(len(text), cuts), native.hold_bound_bytes)
    assert out == ref.scrub(text)


def test_a_marker_cut_at_every_offset() -> None:
    native, ref = pair()
    text = b"a " + KEY + b" b [REDACTED:anthropic] " + TOKEN.upper() + b" [REDACTED:token] c"
    want = ref.scrub(text)
    for cut in range(len(text) + 1):
        streams = [native.stream(), two_calls(native), reference(ref)]
        assert run_all(streams, text, [cut, len(text) - cut], native.hold_bound_bytes) == want


def test_the_most_a_stream_holds() -> None:
    # A would-be secret padded with zero-width characters (stage 1 holds it) then the start of
    # a folded form (stage 2 holds that): pending stays within both bounds together.
    native, _ = pair()
    stream = native.stream()
    most = 0
    for piece in (b"x sk-ant-", b"\xe2\x80\x8b" * 5000, b"\xe2", b" " + TOKEN[:15]) * 3:
        stream.feed(piece)
        most = max(most, stream.pending)
        assert stream.pending <= native.hold_bound_bytes
    assert most > 0
    stream.flush()
    assert stream.pending == 0


def test_flush_and_errors_match() -> None:
    native, _ = pair()
    for make in (native.stream, lambda: two_calls(native)):
        s = make()
        assert s.feed(b"") == b""
        s.feed(b"abc " + KEY[:10])
        out = s.flush()
        assert out.endswith(KEY[:10]) or b"[REDACTED" in out
        with pytest.raises(ValueError, match="feed after flush"):
            s.feed(b"x")
        with pytest.raises(ValueError, match="flush twice"):
            s.flush()


def test_stage_1_alone_through_the_same_call() -> None:
    # No secret qualifies for stage 2: the stream is stage 1 alone, its output made contiguous,
    # its input handed back unchanged when nothing changed, long unchanged ends joined.
    secrets = (("pin", b"4921"),)
    native, ref = Scrubber(secrets), Scrubber(secrets, engine="reference")
    assert native._fold is None and isinstance(native.stream(), scrub_native.NativeStream)
    plain = b"nothing to see here\n" * 10_000
    stream = native.stream()
    assert stream.feed(plain) is plain
    text = b"x 4921 y " + plain + b" 49" + plain[:100_000] + b"21 z"
    for sizes in ([len(text)], [3, 200_001, len(text)], [70_000] * 5):
        streams = [native.stream(), reference(ref)]
        run_all(streams, text, sizes_from(len(text), sizes), native.hold_bound_bytes)
    assert native.scrub(text) == ref.scrub(text)


@pytest.mark.parametrize("stages", [1, 2])
def test_long_unchanged_input_after_a_held_tail(stages: int) -> None:
    # Stage 1 returns its held tail then a long unchanged end of the input as a range of the
    # input (not copied): joined for stage 2 or for the caller, at every length around the
    # engine's thresholds (8 KiB, 64 KiB).
    secrets = SECRETS if stages == 2 else (("pin", b"4921"),)
    native, ref = Scrubber(secrets), Scrubber(secrets, engine="reference")
    assert (native._fold is not None) == (stages == 2)
    held = b"x " + KEY[:12] if stages == 2 else b"x 49"
    for size in (8191, 8192, 8193, 65535, 65536, 65537, 70_000, 140_000):
        plain = bytes(b"lorem ipsum dolor sit amet; "[k % 28] for k in range(size))
        text = held + plain + held + plain[: size // 2] + b"21 " + TOKEN.upper() + b" y"
        chunks = [len(held), size, len(held), len(text) - 2 * len(held) - size]
        streams = [native.stream(), reference(ref)]
        if stages == 2:
            streams.insert(1, two_calls(native))
        assert run_all(streams, text, chunks, native.hold_bound_bytes) == ref.scrub(text)


def test_stage_2_reads_the_two_parts_of_a_release_as_one() -> None:
    # Stage 1's release (its held tail, then the rest of the input as a range of it) goes to
    # stage 2 as two parts, never joined: a secret across their boundary, or across the 64 KiB
    # pieces stage 2 cuts a long input into, with and without a tail stage 2 holds.
    native, ref = scrubbers()
    held = b"x " + KEY[:12]  # stage 1 holds it (a prefix of a key it knows)
    rest = b"\xe2\x80\x8b" + KEY[12:]  # the key to stage 2 only (a zero-width space in it)
    for prefix in (b"", b"a " + TOKEN.upper()[:20]):  # stage 2 holds it
        for size in range(65536 - len(held) - len(rest) - 40, 65536 - 20, 9):
            plain = bytes(b"lorem ipsum dolor sit amet; "[k % 28] for k in range(size))
            text = prefix + held + rest + plain + TOKEN.upper() + b" y"
            chunks = [len(prefix) + len(held), len(text) - len(prefix) - len(held)]
            streams = [native.stream(), two_calls(native), reference(ref)]
            out = run_all(streams, text, chunks, native.hold_bound_bytes)
            assert out == ref.scrub(text)
            assert KEY[12:] not in out and TOKEN.upper() not in out


def test_any_bytes_like_input() -> None:
    native, _ = pair()
    text = b"a " + KEY + b" " + TOKEN.upper() + b" b " * 30_000
    want = native.scrub(text)
    for kind in (bytes, bytearray, memoryview, lambda b: memoryview(bytearray(b))):
        s = native.stream()
        out = s.feed(kind(text[:1000])) + s.feed(kind(text[1000:])) + s.flush()
        assert out == want
        s = native._native.stream() if native._native is not None else None
        assert s is not None
        assert s.feed(kind(text)) + s.flush() == native._native.scrub(kind(text))  # type: ignore[union-attr]


def test_stage_2_errors_are_fold_errors() -> None:
    ffi = scrub_native.ffi
    r = ffi.new("composed_result *", {"len": -1, "rc": -6, "stage": 2})
    with pytest.raises(scrub_fold_native.FoldEngineError):
        scrub_native._other(r, b"", 0)
    r = ffi.new("composed_result *", {"len": -1, "rc": -6, "stage": 1})
    with pytest.raises(scrub_native.ScrubEngineError):
        scrub_native._other(r, b"", 0)


def test_threads_each_have_their_work_areas() -> None:
    # Many threads, each its own streams, at once: each thread's result record and output are
    # its own (a mix-up would show as wrong bytes). Threads that end free their work areas (the
    # sanitizer run checks the memory).
    native, ref = pair()
    text = (b"a " + KEY + b" b " + TOKEN.upper() + b" c [REDACTED:token] ") * 200
    want = ref.scrub(text)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for round_ in range(5):
                size = 1 + (seed * 7 + round_ * 13) % 97
                s = native.stream()
                out = [s.feed(text[k : k + size]) for k in range(0, len(text), size)]
                assert b"".join(out) + s.flush() == want
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_one_stream_from_two_threads_refuses_rather_than_interleaves() -> None:
    # A stream is not for two threads at once; used so anyway, a call either runs whole or is
    # refused (ScrubEngineError, "in use by another thread"), never a mix of the two calls.
    native, _ = pair()
    stream = native.stream()
    chunk = b"x " * 50_000
    outcomes: list[str] = []

    def feed() -> None:
        for _ in range(20):
            try:
                stream.feed(chunk)
                outcomes.append("ok")
            except scrub_native.ScrubEngineError as exc:
                assert exc.code == -4
                outcomes.append("busy")

    threads = [threading.Thread(target=feed) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 40 and "ok" in outcomes
    stream.flush()


def test_the_reference_paths_remain() -> None:
    # A reference stage anywhere: the two-stream ComposedStream, as before.
    ref = Scrubber(SECRETS, engine="reference")
    assert isinstance(ref.stream(), ComposedStream)
    assert isinstance(ref._fold, FoldTables)
    s = ref.stream()
    assert isinstance(s, ComposedStream) and isinstance(s.first, ReferenceStream)
    assert isinstance(s.second, FoldStream)
