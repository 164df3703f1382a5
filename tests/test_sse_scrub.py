"""The SSE layer (proxycore/protocol/sse_scrub.py) and the Content-Encoding recoder
(proxycore/protocol/codings.py), sans-IO: a key spelled out across deltas never comes back in
the text an SDK assembles, the stream stays well-formed, and nothing else changes."""

from __future__ import annotations

import gzip
import itertools
import json
import random
import re
import zlib
from collections.abc import Callable
from typing import Any

import brotli
import pytest

from native.scrub import Scrubber
from proxycore.errors import HttpProtocolError
from proxycore.protocol.codings import CodingError, Recoder, declared_coding, sniffable
from proxycore.protocol.sse_channels import segment_map
from proxycore.protocol.sse_scrub import SseScrubber, is_event_stream

KEY = "sk-ant-api03-REALKEY-appliance-only-0123456789abcdef"
SCRUBBER = Scrubber([("anthropic", KEY)])
MARK = "[REDACTED:anthropic]"

# -- building streams in the providers' formats ----------------------------------------------------

Event = tuple[str | None, Any]


def anthropic(pieces: list[str], field: str = "text") -> list[Event]:
    kind = {"text": "text_delta", "partial_json": "input_json_delta", "thinking": "thinking_delta"}
    block = {"type": "text", "text": ""} if field == "text" else {"type": "tool_use", "input": {}}
    events: list[Event] = [
        ("message_start", {"type": "message_start", "message": {"id": "m", "content": []}}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        ),
    ]
    for piece in pieces:
        delta = {"type": kind[field], field: piece}
        events.append(("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": delta}))  # fmt: skip
        events.append(("ping", {"type": "ping"}))
    events.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def chat(pieces: list[str], field: str = "content") -> list[Event]:
    events: list[Event] = []
    for piece in pieces:
        if field == "arguments":
            delta: dict[str, Any] = {
                "tool_calls": [{"index": 0, "id": "t", "function": {"arguments": piece}}]
            }
        elif field == "function_call":  # legacy, still accumulated by the SDK's helper
            delta = {"function_call": {"arguments": piece}}
        elif field == "audio":
            delta = {"audio": {"id": "a", "transcript": piece}}
        else:
            delta = {field: piece}
        events.append((None, {"id": "c", "choices": [{"index": 0, "delta": delta}]}))
    events.append(
        (None, {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    )
    events.append((None, "[DONE]"))
    return events


def responses(pieces: list[str], field: str = "response.output_text.delta") -> list[Event]:
    item = {"item_id": "i", "output_index": 0, "content_index": 0}
    events: list[Event] = [(field, {"type": field, **item, "delta": p}) for p in pieces]
    events.append(("response.completed", {"type": "response.completed"}))
    return events


FORMATS: dict[str, Callable[[list[str]], list[Event]]] = {
    "anthropic-text": anthropic,
    "anthropic-json": lambda p: anthropic(p, "partial_json"),
    "anthropic-thinking": lambda p: anthropic(p, "thinking"),
    "chat-content": chat,
    "chat-reasoning": lambda p: chat(p, "reasoning_content"),
    "chat-tool-arguments": lambda p: chat(p, "arguments"),
    "chat-function-call": lambda p: chat(p, "function_call"),
    "chat-audio-transcript": lambda p: chat(p, "audio"),
    "responses-text": responses,
    "responses-arguments": lambda p: responses(p, "response.function_call_arguments.delta"),
}


def encode(events: list[Event], eol: str = "\n") -> bytes:
    out = ""
    for name, data in events:
        payload = data if isinstance(data, str) else json.dumps(data)
        out += (f"event: {name}{eol}" if name else "") + f"data: {payload}{eol}{eol}"
    return out.encode()


def texts(obj: Any) -> list[str]:
    """The delta texts of one event, whatever its format (what an SDK appends)."""
    if not isinstance(obj, dict):
        return []
    if obj.get("type") == "content_block_delta":
        delta = obj["delta"]
        return [delta[f] for f in ("text", "partial_json", "thinking") if f in delta]
    if str(obj.get("type", "")).endswith(".delta"):
        return [obj["delta"]]
    found = []
    for choice in obj.get("choices", []):
        delta = choice.get("delta", {})
        found += [delta[f] for f in ("content", "reasoning_content") if f in delta]
        for call in delta.get("tool_calls", []):
            found.append(call["function"]["arguments"])
        if "function_call" in delta:
            found.append(delta["function_call"]["arguments"])
        if "audio" in delta:
            found.append(delta["audio"]["transcript"])
    return found


def parse(stream: bytes) -> list[tuple[bytes, Any]]:
    """(raw event, its data as JSON or text) per event; strict about the framing."""
    events = []
    for raw in re.findall(rb"(?s).*?(?>\r\n|\r|\n)(?>\r\n|\r|\n)", stream):
        data = b"\n".join(
            line[6:] if line.startswith(b"data: ") else line[5:]
            for line in re.split(rb"\r\n|\r|\n", raw)
            if line.startswith(b"data:")
        )
        text = data.decode()
        events.append((raw, text if text == "[DONE]" else json.loads(text)))
    assert b"".join(raw for raw, _ in events) == stream  # nothing between or after events
    return events


def run(body: bytes, chunks: list[int] | None = None) -> bytes:
    layer = SseScrubber(SCRUBBER)
    out = b""
    at = 0
    for size in chunks or [len(body)]:
        out += layer.feed(body[at : at + size])
        at += size
    out += layer.feed(body[at:]) + layer.flush()
    return out


def split(text: str, sizes: list[int]) -> list[str]:
    pieces, at = [], 0
    for size in itertools.cycle(sizes):
        if at >= len(text):
            return pieces
        pieces.append(text[at : at + size])
        at += size
    raise AssertionError


def key_runs(text: str) -> list[str]:
    return [KEY[i : i + 8] for i in range(len(KEY) - 7) if KEY[i : i + 8] in text]


def without_texts(obj: Any) -> Any:
    """The event with its delta texts blanked (to compare every other field)."""
    if not isinstance(obj, dict):
        return obj
    copy = json.loads(json.dumps(obj))
    if copy.get("type") == "content_block_delta":
        for f in ("text", "partial_json", "thinking"):
            if f in copy["delta"]:
                copy["delta"][f] = ""
    elif str(copy.get("type", "")).endswith(".delta"):
        copy["delta"] = ""
    for choice in copy.get("choices", []):
        delta = choice.get("delta", {})
        for f in ("content", "reasoning_content"):
            if f in delta:
                delta[f] = ""
        for call in delta.get("tool_calls", []):
            call["function"]["arguments"] = ""
        if "function_call" in delta:
            delta["function_call"]["arguments"] = ""
        if "audio" in delta:
            delta["audio"]["transcript"] = ""
    return copy


def check(body_in: bytes, body_out: bytes, expected_text: str) -> None:
    before, after = parse(body_in), parse(body_out)
    assert len(before) == len(after)
    assembled = ""
    for (raw_in, obj_in), (raw_out, obj_out) in zip(before, after, strict=True):
        assert without_texts(obj_in) == without_texts(obj_out)  # every other field kept
        if texts(obj_in) == texts(obj_out):
            assert raw_in == raw_out  # not rewritten: byte for byte
        assembled += "".join(texts(obj_out))
    assert key_runs(assembled) == []
    assert assembled == expected_text


# -- a key spelled out across deltas ---------------------------------------------------------------

CASES = [
    (fmt, sizes, eol)
    for fmt in FORMATS
    for sizes in ([1], [2], [3], [5], [7], [1, 7, 3], [4, 1, 6, 2])
    for eol in ("\n", "\r\n")
]


@pytest.mark.parametrize(("fmt", "sizes", "eol"), CASES)
def test_a_key_split_across_deltas_is_redacted_in_what_the_sdk_assembles(
    fmt: str, sizes: list[int], eol: str
) -> None:
    text = f"Your key: {KEY}, and again {KEY}."
    body = encode(FORMATS[fmt](split(text, sizes)), eol)
    out = run(body)
    check(body, out, f"Your key: {MARK}, and again {MARK}.")
    # The SSE rule still holds: the byte scrubber found nothing more to do.
    assert out.count(MARK.encode()) == 2


def test_the_output_does_not_depend_on_how_the_stream_was_chunked() -> None:
    body = encode(anthropic(split(f"a {KEY} b", [9])), "\r\n")
    whole = run(body)
    for cut in range(1, len(body)):  # every two-piece split
        assert run(body, [cut]) == whole, cut
    rng = random.Random(18)
    for _ in range(20):
        sizes = [rng.randint(1, 40) for _ in range(len(body) // 10)]
        assert run(body, sizes) == whole
    assert run(body, [1] * len(body)) == whole  # byte by byte


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_events_not_holding_a_secret_come_out_byte_for_byte_and_at_once(eol: str) -> None:
    # Near-misses: the key's prefix, shapes cut short, a key with its 8-byte runs broken.
    near = [
        "sk-ant-",
        "sk-ant-xyz-short",
        "task-ant-bcd03",
        # The key's first 14 bytes, spaced: under the 16 letters and digits the fold matcher
        # needs (the whole key spaced out is caught: the next test).
        " ".join(KEY[i : i + 7] for i in range(0, 14, 7)),
        "ghp_" + "x" * 10,
        "REDACTED:anthropic",
    ]
    assert not any(key_runs(text) for text in near)
    for text in near:
        body = encode(anthropic(split(text + " done", [2])), eol)
        assert run(body) == body, text
    # A complete event leaves with the feed that completed it.
    # A complete event leaves with the feed that completed it once its text cannot begin a
    # key: the letters and digits at its end are followed by more than the fold matcher's gap
    # of 8 separators (a text ending in a letter waits for the next delta of its channel).
    layer = SseScrubber(SCRUBBER)
    first = encode(anthropic(["hi." + " " * 9])[2:3], eol)
    assert layer.feed(first) == first
    layer = SseScrubber(SCRUBBER)
    waits = encode(anthropic(["hi."])[2:3], eol)
    assert layer.feed(waits) == b""
    assert layer.flush() == waits


def test_a_key_spaced_out_across_deltas_is_caught_by_the_fold_matcher() -> None:
    spaced = " ".join(KEY[i : i + 7] for i in range(0, len(KEY), 7))
    assert not key_runs(spaced)  # no 8-byte run of the key: only stage 2 can see it
    body = encode(anthropic(split(f"look: {spaced} done", [2])))
    out = run(body)
    assembled = "".join("".join(texts(obj)) for _, obj in parse(out))
    assert MARK in assembled and "EALKEY" not in assembled


def test_an_event_whose_text_may_begin_a_key_waits_and_only_it() -> None:
    layer = SseScrubber(SCRUBBER)
    # "Hello" then more than 8 separators: nothing in it can begin a key.
    hello = "Hello" + " " * 9
    events = anthropic([hello, "sk-ant-api03-REA", "LKEY-appliance-only-0123456789abcdef ok."])
    raw = [encode([event]) for event in events]
    assert layer.feed(b"".join(raw[:4])) == b"".join(raw[:4])  # up to the ping after "Hello"
    assert layer.feed(raw[4]) == b""  # "sk-ant-api03-REA" may be a key: held
    assert layer.feed(raw[5]) == b""  # the ping behind it waits too (order is kept)
    out = layer.feed(raw[6])
    got = [obj for _, obj in parse(out)]
    assert got[0]["delta"]["text"] == MARK
    assert got[1] == {"type": "ping"}
    # " ok." ends in letters that could begin a key: it waits for its channel's next text or
    # its end (content_block_stop), then goes out as it was.
    assert len(got) == 2
    rest = layer.feed(b"".join(raw[7:]))
    later = [obj for _, obj in parse(rest)]
    assert later[0]["delta"]["text"] == " ok." and rest.endswith(b"".join(raw[7:]))


def test_text_blocks_are_one_channel_and_thinking_another() -> None:
    # The SDK's get_final_text joins the text blocks: a key split across two is one text.
    def delta(index: int, kind: str, text: str) -> Event:
        field = {"text_delta": "text", "thinking_delta": "thinking"}[kind]
        return ("content_block_delta", {"type": "content_block_delta", "index": index,
                                        "delta": {"type": kind, field: text}})  # fmt: skip

    stop: Event = ("content_block_stop", {"type": "content_block_stop", "index": 0})
    end: Event = ("message_stop", {"type": "message_stop"})
    body = encode([delta(0, "text_delta", KEY[:20]), stop, delta(1, "text_delta", KEY[20:]), end])
    text = "".join(t for _, obj in parse(run(body)) for t in texts(obj))
    assert text == MARK
    # Thinking and text are apart: half a key in each is not one key (and not redacted,
    # unless a half holds an 8-byte run of it on its own: these do not).
    body = encode(
        [delta(0, "thinking_delta", KEY[:6]), stop, delta(1, "text_delta", KEY[6:12]), end]
    )
    assert run(body) == body


def test_initial_texts_the_sdks_start_from_are_part_of_the_channel() -> None:
    # Anthropic's message_start content and content_block_start text, a Responses part's text:
    # the SDKs append the deltas to them.
    start = {"type": "message_start", "message": {"content": [{"type": "text", "text": KEY[:5]}]}}
    block = {"type": "content_block_start", "index": 1,
             "content_block": {"type": "text", "text": KEY[5:10]}}  # fmt: skip
    events: list[Event] = [("message_start", start), ("content_block_start", block)]
    for name, obj in anthropic(split(KEY[10:], [4]))[2:]:
        events.append((name, {**obj, "index": 1} if "index" in obj else obj))
    out = parse(run(encode(events)))
    text = out[0][1]["message"]["content"][0]["text"] + out[1][1]["content_block"]["text"]
    text += "".join(t for _, obj in out for t in texts(obj))
    assert text == MARK
    part = {"type": "response.content_part.added", "output_index": 0, "content_index": 0,
            "part": {"type": "output_text", "text": KEY[:6]}}  # fmt: skip
    out = parse(
        run(encode([("response.content_part.added", part), *responses(split(KEY[6:], [5]))]))
    )
    text = out[0][1]["part"]["text"] + "".join(t for _, obj in out for t in texts(obj))
    assert text == MARK


def test_a_rewritten_event_stays_strict_json() -> None:
    # Numbers JSON cannot hold after a round trip (NaN, 1e400) and other fields are kept valid.
    body = encode(anthropic(split(KEY, [6])))
    body = body.replace(b'"index": 0,', b'"index": 0, "x": NaN, "y": 1e400, "z": [1, {"a": null}],')
    rewritten = 0
    for raw, _ in parse(run(body)):
        if b"REDACTED" in raw:
            data = raw.split(b"data: ", 1)[1].strip()
            obj = json.loads(data, parse_constant=lambda c: pytest.fail(f"{c} in rewritten JSON"))
            assert obj["z"] == [1, {"a": None}] and obj["x"] is None
            rewritten += 1
    assert rewritten == 1


def test_a_long_event_between_two_halves_of_a_key() -> None:
    long_delta = anthropic(["x" * 300_000])[2:3]
    events = anthropic([KEY[:20]])[:3] + long_delta + anthropic(split(KEY[20:], [3]))[2:]
    body = encode(events)
    out = run(body, [4096] * (len(body) // 4096))
    assert key_runs("".join(t for _, obj in parse(out) for t in texts(obj))) == []


def test_openai_choices_and_tool_calls_are_separate_channels() -> None:
    pieces = split(KEY, [4])
    events: list[Event] = []
    for piece in pieces:
        events.append((None, {"choices": [
            {"index": 0, "delta": {"content": piece}},
            {"index": 1, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": piece}},
                {"index": 1, "function": {"arguments": "{}"}},
            ]}},
        ]}))  # fmt: skip
    events.append((None, "[DONE]"))
    body = encode(events)
    out = parse(run(body))
    content = "".join(obj["choices"][0]["delta"]["content"] for _, obj in out[:-1])
    args = "".join(obj["choices"][1]["delta"]["tool_calls"][0]["function"]["arguments"]
                   for _, obj in out[:-1])  # fmt: skip
    assert content == args == MARK


# -- hostile input ---------------------------------------------------------------------------------


def test_an_endless_event_is_relayed_unparsed_and_never_held_whole() -> None:
    layer = SseScrubber(SCRUBBER, max_event=4096)
    out = layer.feed(b"data: ")
    for _ in range(1000):
        out += layer.feed(b"x" * 1000)
        assert layer.pending < 8192
    out += layer.feed(b"\n\ndata: {}\n\n") + layer.flush()
    assert out == b"data: " + b"x" * 1_000_000 + b"\n\ndata: {}\n\n"


def test_held_events_over_the_bound_cut_the_stream() -> None:
    layer = SseScrubber(SCRUBBER, max_held=10_000)
    start = encode(anthropic(["sk-ant-api03-"])[:3])
    layer.feed(start)  # held: "sk-ant-api03-" may go on
    with pytest.raises(HttpProtocolError, match="held over 10000 bytes"):
        for _ in range(1000):
            layer.feed(encode([("ping", {"type": "ping"})]))


def _delta(fmt: str, text: str) -> Event:
    return {"anthropic": anthropic, "chat": chat, "responses": responses}[fmt]([text])[
        {"anthropic": 2, "chat": 0, "responses": 0}[fmt]
    ]


@pytest.mark.parametrize(
    ("fmt", "end"),
    [
        ("anthropic", ("message_stop", {"type": "message_stop"})),
        ("anthropic", (None, "[DONE]")),
        ("chat", (None, "[DONE]")),
        ("chat", (None, {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})),
        ("responses", ("response.completed", {"type": "response.completed"})),
    ],
)
def test_text_after_the_end_of_its_channel_cuts_the_stream(fmt: str, end: Event) -> None:
    # The channel is flushed at its end: a key split around it would pass in two pieces.
    layer = SseScrubber(SCRUBBER)
    layer.feed(encode([_delta(fmt, KEY[:5]), end]))
    layer.feed(encode([_delta(fmt, "")]))  # an empty text after the end is harmless
    with pytest.raises(HttpProtocolError, match="after the end of its channel"):
        layer.feed(encode([_delta(fmt, KEY[5:])]))


def test_an_event_the_body_ends_without_its_blank_line_is_read_too() -> None:
    # WHATWG clients drop it; a lenient one that dispatches it still must not see the key.
    body = encode(anthropic(split(KEY[:-6], [5]))[:-2]) + encode(anthropic([KEY[-6:]])[2:3])
    body = body.removesuffix(b"\n\n")
    out = run(body)
    assert not out.endswith(b"\n") and b'"text":""}}' in out  # the last event, rewritten
    text = "".join(t for _, obj in parse(out + b"\n\n") for t in texts(obj))
    assert text == MARK


def test_what_an_sdk_would_not_join_is_kept_out_or_refused() -> None:
    # A delta of a type the SDK ignores is no part of the text (it would break the text the
    # SDK does join: "Zx9K" + "junk" + "q2Lm" hides "Zx9Kq2Lm").
    other = ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "other_delta", "text": "junk"}})  # fmt: skip
    events = [*anthropic(["k ", KEY[13:17]])[:-4], other, *anthropic([KEY[17:21], "."])[2:]]
    text = "".join(t for _, obj in parse(run(encode(events))) for t in texts(obj))
    assert key_runs(text.replace("junk", "")) == []

    # Blocks interleaved (0, 1, 0), Responses items interleaved, a choice index that is not
    # an integer: no one concatenation matches every reading, refused.
    def delta(index: int, text: str) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": index,
                                        "delta": {"type": "text_delta", "text": text}})  # fmt: skip

    with pytest.raises(HttpProtocolError, match="interleave"):
        run(encode([delta(0, "a"), delta(1, "b"), delta(0, "c")]))
    item = {"type": "response.output_text.delta", "content_index": 0}
    with pytest.raises(HttpProtocolError, match="interleave"):
        run(encode([(None, {**item, "output_index": i, "delta": "x"}) for i in (0, 1, 0)]))
    for index in ("0", 0.0, True, None, [0]):
        with pytest.raises(HttpProtocolError, match="not an integer"):
            run(encode([(None, {"choices": [{"index": index, "delta": {"content": "x"}}]})]))
    # Without text, such a choice is nobody's business.
    body = encode([(None, {"choices": [{"index": [0], "delta": {}}]})])
    assert run(body) == body


def test_too_many_channels_cut_the_stream() -> None:
    # A new choice index per event: each would keep a scrubber stream open until [DONE].
    layer = SseScrubber(SCRUBBER)
    with pytest.raises(HttpProtocolError, match="more than 1024 text channels"):
        for index in range(1100):
            layer.feed(encode([(None, {"choices": [{"index": index, "delta": {"content": "."}}]})]))


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"type":"content_block_delta","index":0,"delta":' * 50_000,
        b'{"type":"content_block_delta","index":[1],"delta":{"type":"text_delta","text":5}}',
        b'{"choices":[7,{"delta":[]},{"delta":{"tool_calls":[1,{"function":3}]}}]}',
        b'{"type":"response.output_text.delta","delta":null,"output_index":{"a":1}}',
        b"\xff\xfe not utf-8 {",
    ],
)
def test_hostile_json_is_relayed_as_it_came(data: bytes) -> None:
    body = b"data: " + data + b"\n\n"
    assert run(body, [7, 100, 3]) == body


def test_invalid_utf8_in_a_text_cuts_the_stream_and_lone_surrogates_pass() -> None:
    # Invalid UTF-8 in a delta: a client that replaces it and one that skips the event join
    # different texts (a key around it would pass one of them): refused.
    body = encode(anthropic(split(KEY, [5])))
    bad = body.replace(b'"text": "' + KEY[5:10].encode(), b'"text": "\xff' + KEY[5:10].encode())
    with pytest.raises(HttpProtocolError, match="not valid UTF-8"):
        run(bad)
    assert run(b'data: {"x": "\xff"}\n\n') == b'data: {"x": "\xff"}\n\n'  # no text
    # A lone surrogate escape: re-serialized escaped, still valid JSON.
    body = encode(anthropic(["\ud800 ", *split(KEY, [3])]))
    text = "".join(t for _, obj in parse(run(body)) for t in texts(obj))
    assert text == "\ud800 " + MARK


def test_an_event_split_inside_a_utf8_character() -> None:
    text = f"é€😀 {KEY} ü"
    body = encode(anthropic(split(text, [2, 1])), "\r\n")
    expected = run(body)
    for cut in range(1, len(body)):
        if body[cut] >= 0x80:  # inside or at the start of a multi-byte character
            assert run(body, [cut]) == expected
    check(body, expected, f"é€😀 {MARK} ü")


def test_segment_map_is_monotone_and_covers_the_output() -> None:
    # Whatever the release looks like, event ends map in order onto the output and the end
    # of the input onto the end of the output: the events' texts join to the output exactly.
    rng = random.Random(7)
    for _ in range(500):
        seg_in = bytes(rng.choice(b"ab\xc3\xa9[]") for _ in range(rng.randint(0, 30)))
        a = rng.randint(0, len(seg_in))
        b = rng.randint(a, len(seg_in))
        seg_out = seg_in[:a] + b"[REDACTED:x]" * rng.randint(0, 2) + seg_in[b:]
        position = segment_map(seg_in, seg_out)
        ends = [position(x) for x in range(len(seg_in) + 1)]
        assert ends == sorted(ends) and ends[0] >= 0 and ends[-1] == len(seg_out)


def test_content_types() -> None:
    assert is_event_stream(b"text/event-stream; charset=utf-8")
    assert is_event_stream(b"Text/Event-Stream")
    assert not is_event_stream(b"text/plain") and not is_event_stream(None)


# -- Content-Encoding ------------------------------------------------------------------------------


def _raw_deflate(data: bytes) -> bytes:
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    return raw.compress(data) + raw.flush()


def _raw_inflate(data: bytes) -> bytes:
    return zlib.decompress(data, -15)


CODECS = {
    (b"gzip", "gzip"): (gzip.compress, gzip.decompress),
    (b"deflate", "zlib"): (zlib.compress, zlib.decompress),
    (b"deflate", "raw"): (_raw_deflate, _raw_inflate),
    (None, "gzip"): (gzip.compress, gzip.decompress),
    (None, "zlib"): (zlib.compress, zlib.decompress),
}


@pytest.mark.parametrize(("coding", "form"), list(CODECS))
@pytest.mark.parametrize("chunk", [1, 3, 64, 1 << 20])
def test_recoder_round_trip(coding: bytes | None, form: str, chunk: int) -> None:
    compress, decompress = CODECS[(coding, form)]
    body = (f"line {KEY} end\n" * 40).encode()
    packed = compress(body)
    recoder = Recoder(coding, SCRUBBER.stream())
    outs = [recoder.feed(packed[i : i + chunk]) for i in range(0, len(packed), chunk)]
    outs.append(recoder.flush())
    assert recoder.coding == form.encode()
    assert decompress(b"".join(outs)) == b"line [REDACTED:anthropic] end\n" * 40
    # Streaming keeps streaming: before the flush, what came out decodes to all a scrubber
    # stream fed the same bytes released (all but the last word: stage 2 holds the last few
    # letters, which could begin a secret).
    before_flush = b"".join(outs[:-1])
    partial = zlib.decompressobj({"gzip": 31, "zlib": 15, "raw": -15}[form])
    released = SCRUBBER.stream().feed(body)
    assert released.startswith(b"line [REDACTED:anthropic] end\n" * 39 + b"line [REDACTED")
    assert partial.decompress(before_flush) == released


def test_recoder_sse_through_gzip_and_multiple_members() -> None:
    body = encode(anthropic(split(f"k {KEY}", [3])))
    half = len(body) // 2
    packed = gzip.compress(body[:half]) + gzip.compress(body[half:])  # two gzip members
    recoder = Recoder(b"gzip", SseScrubber(SCRUBBER))
    out = gzip.decompress(recoder.feed(packed) + recoder.flush())
    check(body, out, f"k {MARK}")


def test_gzip_members_split_anywhere_and_trailing_bytes() -> None:
    # RFC 1952 2.2: members one after the other, the boundary anywhere between reads; bytes
    # after the last member that are no member are not relayed (nor an error).
    first, second = f"a {KEY[:20]}".encode(), f"{KEY[20:]} b".encode()
    packed = gzip.compress(first) + gzip.compress(second) + b"\x1f\x00 trailing"
    for size in (1, 2, 3, 5, 11, len(packed)):
        recoder = Recoder(b"gzip", SCRUBBER.stream())
        out = b"".join(recoder.feed(packed[i : i + size]) for i in range(0, len(packed), size))
        assert gzip.decompress(out + recoder.flush()) == b"a [REDACTED:anthropic] b", size


def test_text_that_looks_like_zlib_is_read_as_text() -> None:
    long = b"x^2 + y^2 = z^2 holds for the sides of a right triangle; " * 20 + KEY.encode()
    for text in (b"x^2 + y^2 = z^2, and " + KEY.encode(), b"x^", b"x\x9c", long):
        for size in (1, 3, 7, len(text)):  # a first read of 3 bytes must not decide it
            recoder = Recoder(None, SCRUBBER.stream())
            out = b"".join(recoder.feed(text[i : i + size]) for i in range(0, len(text), size))
            out += recoder.flush()
            assert out == SCRUBBER.scrub(text) and recoder.coding == b"plain", (text, size)


def test_plain_bodies_pass_as_they_are() -> None:
    for body in (b"", b"a", b"ab", b"hello " + KEY.encode()):
        recoder = Recoder(None, SCRUBBER.stream())
        out = b"".join(recoder.feed(body[i : i + 1]) for i in range(len(body))) + recoder.flush()
        assert out == SCRUBBER.scrub(body)


@pytest.mark.parametrize("coding", [b"gzip", None])
def test_a_bomb_is_cut_before_it_fills_memory(coding: bytes | None) -> None:
    packed = gzip.compress(b"\0" * (64 << 20))  # 64 MiB in about 64 KiB
    recoder = Recoder(coding, SCRUBBER.stream())
    with pytest.raises(CodingError, match="inflates more than 200 times"):
        for i in range(0, len(packed), 4096):
            assert len(recoder.feed(packed[i : i + 4096])) < 1 << 20
    small = Recoder(b"gzip", SCRUBBER.stream(), max_decoded=1000)
    with pytest.raises(CodingError, match="more than 1000 bytes"):
        small.feed(gzip.compress(b"a" * 2000))


def test_garbage_declared_as_gzip_is_an_error() -> None:
    with pytest.raises(CodingError, match="does not decode"):
        Recoder(b"gzip", SCRUBBER.stream()).feed(b"this is not gzip at all")


def test_declared_codings() -> None:
    assert declared_coding([b"gzip"]) == (b"gzip", None)
    assert declared_coding([b"X-Gzip"]) == (b"gzip", None)
    assert declared_coding([b"identity, deflate"]) == (b"deflate", None)
    assert declared_coding([b"identity"]) == (None, None)
    assert declared_coding([b"br"]) == (b"br", None)
    assert declared_coding([b"zstd"]) == (None, "zstd")
    assert declared_coding([b"gzip", b"gzip"]) == (None, "gzip, gzip")
    assert not sniffable(b"application/gzip") and not sniffable(b"application/octet-stream")
    assert sniffable(b"application/json") and sniffable(None)


def test_brotli_round_trip_streams_and_bounds() -> None:
    body = (f"line {KEY} end\n" * 2000).encode()
    packed = brotli.compress(body)

    def decoded(data: bytes) -> bytes:
        # All a client's decoder can give for these bytes so far (drained: brotli's decoder
        # hands its output out in pieces).
        decoder = brotli.Decompressor()
        out = piece = decoder.process(data)
        while piece:
            piece = decoder.process(b"")
            out += piece
        return out

    for chunk in (1, 7, 100, 65536):
        recoder = Recoder(b"br", SCRUBBER.stream())
        outs = [recoder.feed(packed[i : i + chunk]) for i in range(0, len(packed), chunk)]
        outs.append(recoder.flush())
        assert brotli.decompress(b"".join(outs)) == b"line [REDACTED:anthropic] end\n" * 2000
        # Streaming keeps streaming: before the flush, all but the scrubber's hold came out.
        assert decoded(b"".join(outs[:-1])) == SCRUBBER.stream().feed(body), chunk
    # A bomb: 300 MiB of zeros in a few hundred bytes, refused long before it is decoded.
    bomb = brotli.compress(b"\0" * (300 << 20), quality=5)
    recoder = Recoder(b"br", SCRUBBER.stream())
    with pytest.raises(CodingError, match="decompression bomb"):
        for i in range(0, len(bomb), 4096):
            recoder.feed(bomb[i : i + 4096])
    with pytest.raises(CodingError, match="br body does not decode"):
        Recoder(b"br", SCRUBBER.stream()).feed(b"not brotli at all, " * 4)
