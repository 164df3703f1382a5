"""The scrubber's meaning, on the Python reference (native/scrub_reference.py).

What the issue asks of it, one requirement per test: known values in every encoding, zero-width
characters, the shapes, key names kept, no 8-byte run of a secret left, the merge rules, and the
streaming contract (chunking never changes the output, bounded hold-back, SSE events released by
the feed that completes them). The C engine is held to this in test_native_scrub.py.
"""

from __future__ import annotations

import base64
import json
import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from native.scrub import Scrubber
from native.scrub_patterns import (
    DEFAULT_SHAPES,
    MIN_ENCODED,
    PatternError,
    Shape,
    cls,
    compile_patterns,
    crc32_base62,
    encodings,
    lit,
    token_shape,
)
from native.scrub_reference import (
    ReferenceStream,
    Tables,
    ZeroWidthCap,
    cap_zero_width,
    scrub_whole,
)
from proxycore.protocol.scrubbing import scrub_field_lines, scrub_json_lines, unscrubbable_encoding

KEY = b"sk-ant-api03-Zx8Qw2Lm4Np6Rt1Vb3Yc5Hd7Jf9Kg0Ps2Uq4Wo6Ei8"
DB = b"correct-horse-battery-staple-1987"
SECRETS = [("anthropic", KEY), ("db", DB)]
TABLES = Tables(compile_patterns(SECRETS))
ZW = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff"]


def scrub(data: bytes) -> bytes:
    return scrub_whole(TABLES, data)


def runs_of(secret: bytes, text: bytes, run: int = 8) -> list[bytes]:
    return [
        secret[i : i + run] for i in range(len(secret) - run + 1) if secret[i : i + run] in text
    ]


def streamed(data: bytes, cuts: list[int], tables: Tables = TABLES) -> bytes:
    stream = ReferenceStream(tables)
    out = b""
    last = 0
    for cut in sorted(set(cuts)):
        out += stream.feed(data[last:cut])
        last = cut
    return out + stream.feed(data[last:]) + stream.flush()


# -- known values ---------------------------------------------------------------------------------


def test_raw_secret_and_any_8_byte_run_of_it() -> None:
    assert scrub(b"key=" + KEY + b";") == b"key=[REDACTED:anthropic];"
    for start in range(len(DB) - 8 + 1):
        piece = DB[start : start + 8]
        out = scrub(b"<" + piece + b">")
        assert out == b"<[REDACTED:db]>", piece
    assert scrub(b"<" + DB[:7] + b">") == b"<" + DB[:7] + b">"  # 7 bytes is not a leak


@pytest.mark.parametrize(
    "encode",
    [
        lambda v: base64.b64encode(v),
        lambda v: base64.b64encode(b"a" + v),
        lambda v: base64.b64encode(b"ab" + v + b"c"),
        lambda v: base64.urlsafe_b64encode(v).rstrip(b"="),
        lambda v: base64.urlsafe_b64encode(b"\xff" + v),
        lambda v: urllib.parse.quote(v + b"/+ ", safe="").encode(),
        lambda v: "".join(f"%{b:02x}" for b in v).encode(),
        lambda v: v.hex().encode(),
        lambda v: v.hex().upper().encode(),
        lambda v: "".join(f"\\u{b:04x}" for b in v).encode(),
        lambda v: "".join(f"\\u{b:04X}" for b in v).encode(),
        lambda v: v[::-1],
    ],
)
def test_encoded_forms(encode) -> None:  # type: ignore[no-untyped-def]
    for value, name in ((KEY, b"anthropic"), (DB, b"db")):
        text = b"before " + encode(value) + b" after"
        out = scrub(text)
        assert b"[REDACTED:" + name + b"]" in out, (encode(value), out)
        assert runs_of(value, out) == []


def test_encodings_are_whole_and_none_is_too_short() -> None:
    forms = encodings(b"s3cr3t-value-123")
    assert all(len(form) >= MIN_ENCODED for form in forms)
    assert len(forms) == len(set(forms))
    # An encoded form is matched whole only: a piece of a hex form is left alone.
    assert scrub(b"<" + DB.hex().encode()[:20] + b">") == b"<" + DB.hex().encode()[:20] + b">"


def test_json_escaped_secret_with_quote_and_slash() -> None:
    secret = b'pa"ss/word\\with-specials'
    tables = Tables(compile_patterns([("odd", secret)]))
    escaped = json.dumps(secret.decode())[1:-1].encode()
    assert scrub_whole(tables, b'{"v": "' + escaped + b'"}') == b'{"v": "[REDACTED:odd]"}'


@pytest.mark.parametrize("zw", ZW)
def test_zero_width_characters_do_not_hide_a_secret(zw: str) -> None:
    mark = zw.encode()
    hidden = mark.join(KEY[i : i + 3] for i in range(0, len(KEY), 3))
    assert scrub(b"x " + hidden + b" y") == b"x [REDACTED:anthropic] y"
    shape = b"ghp_" + mark + GH_TOKEN[4:24] + mark + GH_TOKEN[24:]
    assert scrub(b"t " + shape + b" u") == b"t [REDACTED:github] u"
    # Outside a secret they are kept as they were.
    assert scrub(b"a" + mark + b"b " + mark) == b"a" + mark + b"b " + mark


# -- shapes ---------------------------------------------------------------------------------------

# A token body of 36 random-looking characters, and a GitHub token with its CRC-32 tail.
RANDOM_BODY = b"Zx9Qw3Rt7Yp2Lm5Nb8Vc1Kd4Hs6Jf0Ga2UeTo"
GH_TOKEN = b"ghp_" + RANDOM_BODY[:30] + crc32_base62(RANDOM_BODY[:30])

PEM = (
    b"-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA75ZQ+abc/def==\n"
    b"Proc-Type: 4,ENCRYPTED\n-----END RSA PRIVATE KEY-----"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (PEM + b"\nafter", b"[REDACTED:private-key]\nafter"),
        (PEM.replace(b"\n", b"\\n"), b"[REDACTED:private-key]"),  # inside a JSON string
        (b"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1r", b"[REDACTED:private-key]"),
        (b"-----BEGIN PUBLIC KEY-----\nMIIB", b"-----BEGIN PUBLIC KEY-----\nMIIB"),
        (b"k sk-ant-api03-" + RANDOM_BODY + b" x", b"k [REDACTED:anthropic] x"),
        (b"sk-proj-" + RANDOM_BODY, b"[REDACTED:openai]"),
        (b"(sk-" + RANDOM_BODY + b")", b"([REDACTED:openai])"),
        (b"task-" + RANDOM_BODY, b"task-" + RANDOM_BODY),  # not glued to a word
        (b"AIzaSyD" + RANDOM_BODY[:32], b"[REDACTED:google]"),
        (b"ghs_" + GH_TOKEN[4:], b"[REDACTED:github]"),
        (b"ghs_" + GH_TOKEN[4:-1] + b"x", b"ghs_" + GH_TOKEN[4:-1] + b"x"),  # bad checksum
        (b"ghp_" + b"x" * 36, b"ghp_" + b"x" * 36),  # placeholder
        (b"github_pat_11A" + RANDOM_BODY, b"[REDACTED:github]"),
        (b"xoxb-730194652817-2364535789652-GkwFDQoHqzXDVs", b"[REDACTED:slack]"),
        (b"xoxb-12345-abcd234", b"xoxb-12345-abcd234"),  # too short to be one
        (b"id AKIA2OGYBAH6TQWXJ5NZ.", b"id [REDACTED:aws-access-key-id]."),
        (b"id AKIAIOSFODNN7EXAMPLE.", b"id AKIAIOSFODNN7EXAMPLE."),  # the documentation's
        (b"API_KEY=${API_KEY:-}", b"API_KEY=${API_KEY:-}"),  # a template
        (b'{"api_key": "<your-api-key>"}', b'{"api_key": "<your-api-key>"}'),
        (
            b"Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9",
            b"Bearer [REDACTED:jwt]",
        ),
        (
            b'{"password": "p\\"w d", "user": "x"}',
            b'{"password": "[REDACTED:password]", "user": "x"}',
        ),
        (b'{"DB_Password":"x"}', b'{"DB_Password":"[REDACTED:Password]"}'),
        (b'{"client_secret" : "abc"}', b'{"client_secret" : "[REDACTED:secret]"}'),
        (b'{"token": "Hello"}', b'{"token": "Hello"}'),  # log-probabilities, not a secret
        (b"export DB_PASSWORD=s3cr3t; x", b"export DB_PASSWORD=[REDACTED:PASSWORD]; x"),
        (b'GITHUB_TOKEN="abc123"', b'GITHUB_TOKEN="[REDACTED:_TOKEN]"'),
        (b"password=password", b"password=password"),  # code keeps its lower-case names
        (b"def f(password: str):", b"def f(password: str):"),
    ],
)
def test_shapes(text: bytes, expected: bytes) -> None:
    assert scrub(text) == expected


def test_known_secret_is_named_by_its_credential_not_its_shape() -> None:
    assert scrub(b"[" + KEY + b"]") == b"[[REDACTED:anthropic]]"


def test_overlapping_matches_merge_and_touching_ones_do_not() -> None:
    tables = Tables(compile_patterns([("a", b"0123456789ab"), ("b", b"89abcdefghij")]))
    assert scrub_whole(tables, b"<0123456789abcdefghij>") == b"<[REDACTED:a]>"
    tables = Tables(compile_patterns([("a", b"0123456789ab"), ("b", b"cdefghijklmn")]))
    assert scrub_whole(tables, b"<0123456789abcdefghijklmn>") == b"<[REDACTED:a][REDACTED:b]>"
    # A key's shape runs on over token characters glued to it: one redaction.
    assert scrub(KEY + DB) == b"[REDACTED:anthropic]"


def test_configured_shape_and_bad_shapes_are_refused_with_their_name() -> None:
    stripe = token_shape("stripe", b"sk_live_", "A-Za-z0-9", 16, 64)
    tables = Tables(compile_patterns([], (*DEFAULT_SHAPES, stripe)))
    assert scrub_whole(tables, b"sk_live_" + b"a" * 20) == b"[REDACTED:stripe]"
    with pytest.raises(PatternError, match="'bad name'"):
        token_shape("bad name", b"abc", "a-z", 1, 2)
    with pytest.raises(PatternError, match="literal of >= 3 bytes"):
        Shape("short", (lit(b"ab"), cls("a-z", 1, 2)))
    with pytest.raises(PatternError, match="secret 'x' is empty"):
        compile_patterns([("x", b"")])


# -- streaming ------------------------------------------------------------------------------------

_PIECES = [
    KEY,
    KEY[5:20],
    DB,
    base64.b64encode(DB),
    DB.hex().encode(),
    PEM,
    b"ghp_" + b"Q" * 36,
    b'{"password": "x"}',
    b"sk-",
    b"-----BEGIN ",
    "\u200b".encode(),
    "\u200b".encode()[:2],
    b"data: {}\n\n",
    b" ",
    b"\\",
    b'"',
]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(_PIECES) | st.binary(max_size=12), max_size=10),
    st.lists(st.integers(0, 400), max_size=12),
)
def test_chunking_never_changes_the_output(parts: list[bytes], cuts: list[int]) -> None:
    data = b"".join(parts)
    whole = scrub(data)
    assert streamed(data, [c for c in cuts if c <= len(data)]) == whole
    for secret in (KEY, DB):
        assert runs_of(secret, whole) == []


def test_runs_of_zero_width_characters_keep_their_first_two() -> None:
    zw = [c.encode() for c in ZW]
    assert cap_zero_width(b"a" + zw[0] * 5 + b"b" + zw[1] + zw[4] + zw[3] + b"c") == (
        b"a" + zw[0] * 2 + b"b" + zw[1] + zw[4] + b"c"
    )
    # a byte that only starts one (a cut character, another 3-byte character) ends the run
    assert (
        cap_zero_width(zw[0] * 3 + b"\xe2\x80" + zw[2] * 3) == zw[0] * 2 + b"\xe2\x80" + zw[2] * 2
    )
    assert cap_zero_width("—".encode() + zw[3] * 3) == "—".encode() + zw[3] * 2
    # however the input is cut: the run and a cut character are carried over
    text = b"x" + zw[0] + zw[4] * 4 + b"\xe2" + zw[1] * 3 + b"\xef\xbb" + b"y"
    want = cap_zero_width(text)
    for cut in range(len(text) + 1):
        cap = ZeroWidthCap()
        assert cap.feed(text[:cut]) + cap.feed(text[cut:]) + cap.flush() == want
    cap = ZeroWidthCap()
    assert b"".join(cap.feed(text[i : i + 1]) for i in range(len(text))) + cap.flush() == want


def test_padding_a_secret_with_zero_width_characters_neither_hides_it_nor_grows_the_stream() -> (
    None
):
    zw = ZW[0].encode()
    padded = zw.join(KEY[i : i + 1] for i in range(len(KEY)))
    stream = ReferenceStream(TABLES)
    # a thousand zero-width characters before every byte of a would-be secret: two are kept
    out = stream.feed(b"ok " + KEY[:20].replace(b"", zw * 1000)[: -len(zw) * 1000])
    assert (out, stream.pending) == (b"ok ", 20 * (1 + 2 * len(zw)))
    out += stream.feed(b"x" + zw * 100_000 + padded + b" done") + stream.flush()
    # (the two before the group stay where they were, those inside go with it)
    assert out == b"ok " + zw * 2 + b"[REDACTED:anthropic] done"


def test_one_byte_at_a_time_and_pending_is_bounded() -> None:
    data = b"x" * 50 + KEY + b" " + PEM + b" " + base64.b64encode(DB) + b" end"
    stream = ReferenceStream(TABLES)
    out = b""
    bound = TABLES.patterns.hold_bound
    for i in range(len(data)):
        out += stream.feed(data[i : i + 1])
        assert stream.pending <= bound <= TABLES.patterns.hold_bound_bytes
        # Never a prefix of a secret that a later byte completes: 8 bytes of KEY never appear.
        assert runs_of(KEY, out) == []
    assert out + stream.flush() == scrub(data)


def test_sse_event_is_released_by_the_feed_that_completes_it() -> None:
    stream = ReferenceStream(TABLES)
    event = b'event: delta\ndata: {"text": "hello sk-ant-"}\n\n'
    assert stream.feed(event) == event
    # A secret cut by the event boundary is held, and only it.
    out = stream.feed(b"data: " + KEY[:20])
    assert out == b"data: "
    assert stream.feed(KEY[20:] + b"\n\n") == b"[REDACTED:anthropic]\n\n"


def test_feed_after_flush_is_an_error() -> None:
    stream = ReferenceStream(TABLES)
    stream.flush()
    with pytest.raises(ValueError, match="feed after flush"):
        stream.feed(b"x")


# -- the facade and the proxy's helpers -----------------------------------------------------------


def test_facade_rotation_builds_a_new_scrubber() -> None:
    old = Scrubber([("k", b"Old0Value1Before")], engine="reference")
    new = Scrubber([("k", b"New2Value3Rotated")], engine="reference")
    text = b"Old0Value1Before New2Value3Rotated"
    assert old.scrub(text) == b"[REDACTED:k] New2Value3Rotated"
    assert new.scrub(text) == b"Old0Value1Before [REDACTED:k]"
    assert "Old0" not in repr(old)
    assert old.scrub_text("é Old0Value1Before") == "é [REDACTED:k]"


def test_field_lines_keep_one_field_per_line() -> None:
    scrubber = Scrubber(SECRETS, engine="reference")
    fields = b"\r\nx-a: " + KEY + b"\r\nx-pem: -----BEGIN RSA PRIVATE KEY-----\r\nx-b: 1"
    out = scrub_field_lines(scrubber, fields)
    assert out.split(b"\r\n") == [
        b"",
        b"x-a: [REDACTED:anthropic]",
        b"x-pem: [REDACTED:private-key]",
        b"x-b: 1",
    ]


def test_json_lines_stay_json() -> None:
    scrubber = Scrubber([("q", b'quote"inside-secret')], engine="reference")
    lines = [json.dumps({"m": 'say quote"inside-secret'}).encode(), b'{"m": "fine"}']
    out = scrub_json_lines(scrubber, b"\n".join(lines) + b"\n")
    for line in out.splitlines():
        assert json.loads(line)
    assert b"inside-secret" not in out


def test_unscrubbable_encodings() -> None:
    assert unscrubbable_encoding([]) is None
    assert unscrubbable_encoding([b"identity"]) is None
    assert unscrubbable_encoding([b"Identity, gzip"]) == b"gzip"
    assert unscrubbable_encoding([b"br"]) == b"br"
