"""The shape set against published token formats, and the shape validators in both engines.

- The corpus (tests/data/secret_shapes, made by its generate.py from gitleaks' and trufflehog's
  published formats and gitleaks' own examples): at least 95 % of the bare tokens redacted, at
  most 2 % of the negatives (placeholders, must-not-detect examples, identifiers, ids, hashes)
  touched; on failure the counts per provider are printed.
- The validators (checksum, entropy gate, placeholder filter, `not_before`): their facts, and
  the C engine byte for byte equal to the reference on generated shapes that use them, one-shot
  and streamed in arbitrary chunks.
- Attacks: a rejected shape never lets a known value through, adversarial text stays linear.
"""

from __future__ import annotations

import base64
import json
import random
import re
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from native import scrub_native
from native.scrub import Scrubber
from native.scrub_patterns import (
    BASE62,
    DEFAULT_SHAPES,
    PEM_MIN_BASE64,
    PUBLISHED_EXAMPLES,
    Check,
    Placeholder,
    Shape,
    byte_class,
    cls,
    compile_patterns,
    crc32_base62,
    entropy_ok,
    is_placeholder,
    is_template_value,
    lit,
)
from native.scrub_reference import ReferenceStream, Tables, scrub_whole
from tests.conftest import needs

DATA = Path(__file__).resolve().parent / "data" / "secret_shapes"
MARKER = re.compile(rb"\[REDACTED:[^\]]*\]")
needs_native = pytest.mark.skipif(
    not scrub_native.AVAILABLE, reason=needs("the native build", "the C scrubber is not built")
)
SCRUBBER = Scrubber([], DEFAULT_SHAPES)


def _rows(name: str) -> list[dict[str, str]]:
    lines = (DATA / name).read_text().splitlines()
    return [json.loads(line) for line in lines if line and not line.startswith("#")]


def redacted_as_token(token: bytes) -> bool:
    """The token alone comes out with a marker and none of the last 40 % of it: a format whose
    first part is kept on purpose (a Slack webhook's host and path, the 3 characters before an
    Azure secret's `Q~`) still counts, a token cut short does not."""
    out = SCRUBBER.scrub(token)
    tail = token[len(token) * 6 // 10 :]
    kept = any(tail[i : i + 8] in out for i in range(max(1, len(tail) - 7)))
    return MARKER.search(out) is not None and not kept


def test_corpus_positives_are_redacted() -> None:
    rows = _rows("positives.jsonl")
    per: dict[str, list[int]] = {}
    missed = []
    for row in rows:
        ok = redacted_as_token(row["token"].encode())
        counts = per.setdefault(row["provider"], [0, 0])
        counts[0] += ok
        counts[1] += 1
        if not ok:
            missed.append((row["rule"], row["source"], row["token"][:48]))
    hit = sum(c[0] for c in per.values())
    table = "\n".join(f"{p:24} {c[0]:4}/{c[1]:<4}" for p, c in sorted(per.items()))
    assert len(rows) >= 1000 and len(per) >= 80, table
    assert hit >= 0.95 * len(rows), f"{hit}/{len(rows)} redacted\n{table}\nmissed: {missed}"
    # Each provider's own tokens, not only the total: a shape that lost its provider shows.
    weak = {p: c for p, c in per.items() if c[0] < 0.75 * c[1]}
    assert not weak, f"{weak}\n{table}\nmissed: {missed}"


def test_corpus_negatives_are_left_alone() -> None:
    rows = _rows("negatives.jsonl")
    per: Counter[str] = Counter()
    bad: Counter[str] = Counter()
    touched = []
    for row in rows:
        text = row["text"].encode()
        per[row["kind"]] += 1
        if SCRUBBER.scrub(text) != text:
            bad[row["kind"]] += 1
            touched.append(row["text"][:60])
    table = {kind: f"{bad[kind]}/{n}" for kind, n in per.items()}
    assert sum(bad.values()) <= 0.02 * len(rows), f"{table}\n{touched}"
    # Placeholders an agent writes into code, hashes, ids and identifiers: none at all.
    for kind in ("placeholder", "uuid", "sha1", "sha256", "base64", "identifier"):
        assert bad[kind] == 0, f"{kind}: {table}\n{touched}"
    # gitleaks' must-not-detect examples: what is left (3 of 380) is two `..._TOKEN=<value>`
    # assignments (a value of the right form after a secret's name) and a JWT after `Basic`.
    assert bad["gitleaks-fp"] <= 0.01 * per["gitleaks-fp"], f"{table}\n{touched}"
    assert sum(bad.values()) <= 0.002 * len(rows), f"{table}\n{touched}"


@needs_native
def test_corpus_engines_agree() -> None:
    text = b"\n".join(
        [row["token"].encode() for row in _rows("positives.jsonl")[::3]]
        + [row["text"].encode() for row in _rows("negatives.jsonl") if row["kind"] != "identifier"]
    )
    patterns = compile_patterns([], DEFAULT_SHAPES)
    assert scrub_native.NativeTables(patterns).scrub(text) == scrub_whole(Tables(patterns), text)


# -- validator facts ------------------------------------------------------------------------------


def test_crc32_base62_matches_an_independent_implementation() -> None:
    # The tail of GitHub and npm tokens: CRC-32 of the body, base62 0-9A-Za-z, zero-padded to 6.
    # Vector from another scanner's test suite (31 zeros -> 4WZ4EQ, decoded with pybase62).
    assert crc32_base62(b"0" * 31) == b"4WZ4EQ"
    assert BASE62 == b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    rng = random.Random(7)
    for _ in range(50):
        body = bytes(rng.choice(BASE62) for _ in range(30))
        tail = crc32_base62(body)
        assert sum(BASE62.index(c) * 62**k for k, c in enumerate(reversed(tail))) == zlib.crc32(
            body
        )


def _github(body: bytes, prefix: bytes = b"ghp_") -> bytes:
    return prefix + body + crc32_base62(body)


@pytest.mark.parametrize("prefix", [b"ghp_", b"gho_", b"ghu_", b"ghs_", b"ghr_", b"npm_"])
def test_checksummed_tokens(prefix: bytes) -> None:
    rng = random.Random(prefix)
    for _ in range(20):
        body = bytes(rng.choice(BASE62) for _ in range(30))
        token = _github(body, prefix)
        assert MARKER.fullmatch(SCRUBBER.scrub(token)), token
        # One character changed anywhere: the checksum no longer holds.
        k = rng.randrange(len(prefix), len(token))
        other = bytes([BASE62[(BASE62.index(token[k]) + 1) % 62]])
        forged = token[:k] + other + token[k + 1 :]
        assert SCRUBBER.scrub(forged) == forged


@pytest.mark.parametrize(
    ("body", "placeholder"),
    [
        (b"AKIAIOSFODNN7EXAMPLE", True),
        (b"xxxxXXXXxxxx", True),
        (b"your_key_here", True),
        (b"${API_KEY:-default}", True),
        (b"{{ .Values.token }}", True),
        (b"%(password)s", True),
        (b"<your-token>", True),
        (b"{SumoAccessKey}", True),
        (b"$GITHUB_TOKEN", True),
        (b"aaaaaa", True),
        (b"abcdef", True),
        (b"987654", True),
        (b"Zx9Qw3Rt7Yp2Lm5Nb8Vc", False),
        (b"eXaMpLe9Qw3Rt7Yp2Lm5", False),  # mixed case: not the word, as in a random body
        (b"$ecretP4ss", False),  # a password with a dollar is not a variable
        (b"abcde1", False),
    ],
)
def test_placeholder_filter(body: bytes, placeholder: bool) -> None:
    assert is_placeholder(body) is placeholder


def test_value_filter_keeps_passwords_with_words_and_sequences() -> None:
    for value in (b"MyExamplePass", b"yourname1990", b"abc123456", b"fake-but-real"):
        assert not is_template_value(value)
    for value in (b"********", b"${DB_PASSWORD}", b"<password>", b"hf_xxxxxxxxxx", b"$PW"):
        assert is_template_value(value)


def test_entropy_gate_is_exact_in_integers() -> None:
    # 8 distinct bytes, equally often: collision entropy exactly 3 bits (a tie, in integers).
    body = b"abcdefgh" * 4
    k3 = round(2.0**3 * 65536)
    assert entropy_ok(k3, body)
    assert not entropy_ok(k3 + 1, body)
    assert not entropy_ok(round(2.0**1.5 * 65536), b"abababababab")


# -- both engines on shapes with validators -------------------------------------------------------

PIECES = (
    b"tok_",
    b"Zx9Qw3Rt7Yp2Lm5Nb8Vc1Kd4Hs6Jf0",
    crc32_base62(b"Zx9Qw3Rt7Yp2Lm5Nb8Vc1Kd4Hs6Jf0"),
    crc32_base62(b"ab"),
    b"ab",
    b"EXAMPLE",
    b"Example",
    b"xxxx",
    b"${",
    b"{",
    b"}",
    b"<",
    b">",
    b"$",
    b"aaaaaa",
    b"abcdef",
    b"Q",
    b"7",
    b"_",
    b"-",
    b" ",
    b"\n",
    b"\xe2\x80\x8b",
    b"KEY=",
    b"-----",
    b"-----END ",
    b"MC4CAQAwBQYDK2VwBCIEI",
    b"AIzaSyAnLA7NfeLquW1tJFpx_eQCxoX-oo6YyIs",
)


@st.composite
def validated_shapes(draw: st.DrawFn) -> Shape:
    spec = draw(
        st.sampled_from(["A-Za-z0-9", "A-Za-z0-9_$<>{}-", "a-f0-9", "^ \n", "A-Za-z0-9+/_ -"])
    )
    lo = draw(st.integers(0, 8))
    hi = draw(st.integers(max(lo, 1), 48))
    opener = draw(st.sampled_from([b"tok_", b"KEY=", b"AIza"]))
    segs = [lit(opener), cls(spec, lo, hi)]
    if draw(st.booleans()):
        segs += [lit(b"-"), cls("A-Za-z0-9", 1, 8)]
    return Shape(
        draw(st.sampled_from(["v1", "v2"])),
        tuple(segs),
        redact_from=draw(st.integers(0, 1)),
        optional_from=draw(st.sampled_from([-1, 2])) if len(segs) > 2 else -1,
        not_after=draw(st.sampled_from([frozenset(), byte_class("A-Za-z0-9_-")])),
        not_before=draw(st.sampled_from([frozenset(), byte_class("A-Za-z0-9_+/-")])),
        check=draw(st.sampled_from(list(Check))),
        min_entropy=draw(st.sampled_from([0.0, 1.0, 2.5, 8.0])),
        placeholder_filter=draw(st.sampled_from(list(Placeholder))),
    )


@needs_native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_validators_native_equals_reference(data: st.DataObject) -> None:
    shapes = data.draw(st.lists(validated_shapes(), min_size=1, max_size=3))
    patterns = compile_patterns([("k", b"Zx9Qw3Rt")], shapes)
    text = b"".join(data.draw(st.lists(st.sampled_from(PIECES), max_size=40)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=5)))
    reference = Tables(patterns)
    want = scrub_whole(reference, text)
    for simd in (True, False):
        native = scrub_native.NativeTables(patterns, simd=simd)
        assert native.scrub(text) == want
        stream, ref = native.stream(), ReferenceStream(reference)
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            assert stream.feed(text[a:b]) == ref.feed(text[a:b])
            assert stream.pending == ref.pending
        assert stream.flush() == ref.flush()


@needs_native
def test_default_shapes_streamed_byte_by_byte_equal_one_shot() -> None:
    rows = _rows("positives.jsonl")[::40]
    text = b" | ".join(row["token"].encode() for row in rows) + b" AKIAIOSFODNN7EXAMPLE"
    patterns = compile_patterns([], DEFAULT_SHAPES)
    native = scrub_native.NativeTables(patterns)
    stream = native.stream()
    out = b"".join(stream.feed(text[i : i + 1]) for i in range(len(text))) + stream.flush()
    assert out == native.scrub(text) == scrub_whole(Tables(patterns), text)
    assert b"AKIAIOSFODNN7EXAMPLE" in out and out.count(b"[REDACTED:") == len(rows)


# -- attacks --------------------------------------------------------------------------------------


def test_a_rejected_shape_never_releases_a_known_value() -> None:
    # A held credential shaped like a placeholder (or glued to one) is still a known value: the
    # literals do not go through the validators.
    key = b"ghp_" + b"x" * 36
    scrubber = Scrubber([("gh", key)], DEFAULT_SHAPES)
    for text in (key, key + b"EXAMPLE", b"ghp_" + key[4:20] + b"EXAMPLE" + key[20:]):
        assert b"xxxxxxxx" not in scrubber.scrub(text), text


@needs_native
def test_validators_cost_stays_linear_on_hostile_text() -> None:
    # A rejected match is not tried again from each byte inside it: prefixes that the byte before
    # does not stop (`=`), in one long run of the body's class, each rejected (by the byte after
    # the longest body, or by its validators), cost the shape's length per prefix otherwise (100
    # times the time: 0.1 s per MiB here, against 0.005 s).
    rng = random.Random(3)
    token = _github(bytes(rng.choice(BASE62) for _ in range(30)))
    hostile = [
        b"=sl." + b"xY3" * 4,  # Dropbox: up to 1,400 bytes, then a class byte after it
        b"=bedrock-api-key-" + b"Ab1" * 2,  # up to 2,048
        b"=ABSK" + b"aaaaaaa+",  # placeholder (a run) in every 300-byte body
        b"ghp_" + b"a" * 35 + b" ",  # every checksum attempt fails
        b"sk-ant-" + b"Ab1" * 85 + b"xxxx ",  # placeholder found at the far end of a long body
        b"AIza" * 16,
        b"xoxb-1-" + b"0" * 25 + b" ",
        b"8Q~" + b"a~" * 20,
        token + b"X",  # glued: rejected by not_before
    ]
    for piece in hostile:
        text = piece * ((1 << 20) // len(piece))
        start = time.process_time()
        out = SCRUBBER.scrub(text)
        elapsed = time.process_time() - start
        assert elapsed < 0.04, (piece[:20], elapsed)
        assert len(out) <= len(text) + 64


def test_provider_tokens_inside_code_and_json() -> None:
    rng = random.Random(11)
    token = _github(bytes(rng.choice(BASE62) for _ in range(30)))
    stripe = b"sk_live_" + bytes(rng.choice(BASE62) for _ in range(24))
    text = (
        b'headers = {"Authorization": "Bearer ' + token + b'"}\n'
        b"stripe.api_key = '" + stripe + b"'\n"
        b"curl -H 'x-api-key: " + token + b"' https://api.example.test\n"
    )
    out = SCRUBBER.scrub(text)
    assert token not in out and stripe not in out
    assert out.count(b"[REDACTED:github]") == 2 and b"[REDACTED:stripe]" in out


def test_gcp_service_account_key_file() -> None:
    pem = (
        "-----BEGIN PRIVATE KEY-----\n"
        + "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcw" * 40
        + "\n-----END PRIVATE KEY-----\n"
    )
    key_file = {
        "type": "service_account",
        "project_id": "demo-123",
        "private_key": pem,
        "client_email": "x@demo-123.iam.gserviceaccount.com",
    }
    out = SCRUBBER.scrub(json.dumps(key_file, indent=2).encode())
    assert b"MIIEvQ" not in out and b'"private_key": "[REDACTED:' in out
    assert json.loads(out)["client_email"] == key_file["client_email"]  # still valid JSON


# -- published examples, example PEM blocks, Slack stand-ins --------------------------------------

FIREBASE_EXAMPLE = b"AIzaSyAnLA7NfeLquW1tJFpx_eQCxoX-oo6YyIs"


def _both_engines(patterns_secrets: list[tuple[str, bytes]], text: bytes) -> bytes:
    """The one-shot output, checked equal in both engines, streamed byte by byte and cut at
    every position in two."""
    patterns = compile_patterns(patterns_secrets, DEFAULT_SHAPES)
    reference = Tables(patterns)
    want = scrub_whole(reference, text)
    engines: list[Callable[[], ReferenceStream | scrub_native.NativeStream]] = [
        lambda: ReferenceStream(reference)
    ]
    if scrub_native.AVAILABLE:
        native = scrub_native.NativeTables(patterns)
        assert native.scrub(text) == want
        engines.append(native.stream)
    for make in engines:
        stream = make()
        out = b"".join(stream.feed(text[i : i + 1]) for i in range(len(text))) + stream.flush()
        assert out == want
        for cut in range(0, len(text) + 1, 7):
            stream = make()
            assert stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.flush() == want
    return want


def test_published_examples_are_left_alone_but_a_held_one_is_redacted() -> None:
    for value in PUBLISHED_EXAMPLES:
        text = b'firebase.initializeApp({apiKey: "' + value + b'"})'
        assert _both_engines([], text) == text
        # Held by the appliance: a known value, redacted whatever it is, in every form.
        held = _both_engines([("firebase", value)], text)
        assert value not in held and b"[REDACTED:firebase]" in held
    # A key one character away from an example is an ordinary key.
    other = FIREBASE_EXAMPLE[:-1] + b"t"
    assert _both_engines([], other) == b"[REDACTED:google]"
    # ... and an example glued into a longer run is not the example.
    assert _both_engines([], FIREBASE_EXAMPLE + b"x") == FIREBASE_EXAMPLE + b"x"


def _ed25519_pem(seed: int, *, width: int = 64) -> bytes:
    # PKCS#8 for Ed25519: a fixed 16-byte header and the 32-byte seed; 64 base64 characters,
    # the smallest private key block there is.
    der = bytes.fromhex("302e020100300506032b657004220420") + random.Random(seed).randbytes(32)
    body = base64.b64encode(der)
    lines = b"\n".join(body[i : i + width] for i in range(0, len(body), width))
    return b"-----BEGIN PRIVATE KEY-----\n" + lines + b"\n-----END PRIVATE KEY-----\n"


def test_pem_blocks_need_a_body_that_can_be_a_key() -> None:
    assert PEM_MIN_BASE64 == 43  # 32 bytes of key in base64
    for text in (
        b"-----BEGIN PRIVATE KEY-----\nanything\n-----END PRIVATE KEY-----",
        b"-----BEGIN OPENSSH PRIVATE KEY----------END OPENSSH PRIVATE KEY-----",
        b"-----BEGIN RSA PRIVATE KEY-----\n...\n-----END RSA PRIVATE KEY-----\n",
        b'"-----BEGIN EC PRIVATE KEY-----\\nMHcCAQEE...\\n-----END EC PRIVATE KEY-----\\n"',
        b"-----BEGIN PRIVATE KEY-----\n" + b"A" * 42 + b"\n-----END PRIVATE KEY-----",
    ):
        assert _both_engines([], text) == text, text
    assert _both_engines(
        [], b"-----BEGIN PRIVATE KEY-----\n" + b"A" * 43 + b"\n-----END PRIVATE KEY-----"
    ) == (b"[REDACTED:private-key]")
    for seed in range(5):
        key = _ed25519_pem(seed)
        for text in (key, b"key = '''" + key + b"'''\n", json.dumps(key.decode()).encode()):
            out = _both_engines([], text)
            assert b"MC4CAQAwBQYDK2VwBCIEI" not in out and b"[REDACTED:private-key]" in out
        # Cut before its END line (the stream ends inside it): what is there is redacted, even
        # a few characters of it.
        for cut in (30, 40, 60, len(key) - 20):
            out = _both_engines([], key[:cut])
            assert out == b"[REDACTED:private-key]", (cut, out)


def test_slack_stand_ins_are_left_alone() -> None:
    for text in (
        b'"token3": "xoxp-1234-1234-1234-4ddbc191d40ee098cbaae6f3523ada2d"',
        b'"token4": "xoxp-572370529330-573807301142-572331691188-####################"',
        b"xoxe.xoxp-1-SlackAppConfigurationAccessTokenHere",
    ):
        assert _both_engines([], text) == text, text
    rng = random.Random(5)

    def alnum(n: int) -> bytes:
        return bytes(rng.choice(BASE62) for _ in range(n))

    for token in (
        b"xoxb-50014434-" + alnum(24),  # a legacy bot token, 8-digit workspace id
        b"xoxp-41684372915-1320496754-45609968301-" + alnum(32),
        b"xoxs-3206092076-3204538285-3743137121-836b042620",
        b"xoxe-1-" + alnum(146),
        b"xoxe.xoxb-1-" + alnum(165),
        b"xoxa-2-" + alnum(40),
    ):
        out = _both_engines([], b'"' + token + b'"')
        assert out.count(b"[REDACTED:slack]") == 1 and token[-12:] not in out, token
