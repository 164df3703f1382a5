"""Fuzzing the SSE layer (proxycore/protocol/sse_scrub.py) against what an SDK would assemble.

Run:  python fuzz/fuzz_sse_scrub.py -runs=200000 -max_len=4096 /tmp/corpus-sse
(atheris is imported only under __main__; tests may import `TestOneInput` and `SEEDS`.)

Input layout: byte 0 chooses the chunking (one chunk, one byte at a time, or chunks of 1-64
bytes from a PRNG seeded with the input); the rest (up to 2 KiB) is the event stream as the
upstream sent it
(the seeds are Anthropic and OpenAI streams spelling a key out a few bytes per delta, in LF,
CRLF and CR framing).

Invariants: only `HttpProtocolError` escapes (a stream over a bound); the output does not depend
on the chunking; every event the layer rewrote is valid JSON on one `data:` line; and the texts
an SDK assembles from the output (WHATWG framing; Anthropic `text_delta` texts joined across
blocks and per block, OpenAI chat `delta.content` per choice, Responses
`response.output_text.delta` across items and per item) hold no 8-byte run of the key.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import atheris

    # Only the layer is instrumented (all of the proxy's modules would take 20 s to start).
    with atheris.instrument_imports(include=["proxycore.protocol.sse_scrub"]):
        import proxycore.protocol.sse_scrub  # noqa: F401

from native.scrub import Scrubber
from proxycore.errors import HttpProtocolError
from proxycore.protocol.sse_scrub import SseScrubber

KEY = "sk-ant-api03-Zx9Kq2Lm8Np4Rs6Tu0Vw3Yb5Cd7Ef1Gh"
SCRUBBER = Scrubber([("anthropic", KEY)])
RUNS = [KEY[i : i + 8] for i in range(len(KEY) - 7)]
_LINE = re.compile(rb"\r\n|\r|\n")
MAX_BODY = 2048  # the CI smoke's budget: the layer runs twice per input, once byte by byte


def _spell(text: str) -> list[str]:
    pieces, at, size = [], 0, 1
    while at < len(text):
        pieces.append(text[at : at + size])
        at += size
        size = size % 7 + 1
    return pieces


def _seed(kind: str, eol: str) -> bytes:
    pieces = _spell(f"k {KEY}.")
    out = []
    for piece in pieces:
        if kind == "anthropic":
            data = {"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": piece}}  # fmt: skip
            out.append(f"event: content_block_delta{eol}data: {json.dumps(data)}{eol}{eol}")
        elif kind == "chat":
            data = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            out.append(f"data: {json.dumps(data)}{eol}{eol}")
        else:
            data = {"type": "response.output_text.delta", "delta": piece}
            out.append(f"data: {json.dumps(data)}{eol}{eol}")
    out.append(f"data: [DONE]{eol}{eol}")
    return "".join(out).encode()


SEEDS = [
    bytes([mode]) + _seed(kind, eol)
    for mode, kind, eol in [
        (0, "anthropic", "\n"),
        (1, "anthropic", "\r\n"),
        (2, "chat", "\n"),
        (2, "responses", "\r"),
        (0, "chat", "\r\n"),
    ]
]


def _run(body: bytes, sizes: list[int] | None) -> bytes:
    layer = SseScrubber(SCRUBBER)
    out = bytearray()
    at = 0
    for size in sizes or []:
        out += layer.feed(body[at : at + size])
        at += size
    out += layer.feed(body[at:])
    out += layer.flush()
    return bytes(out)


def _assembled(stream: bytes) -> list[str]:
    """The texts an SDK builds from the stream (events it cannot decode are skipped)."""
    texts: dict[object, str] = {}
    data: list[bytes] = []
    # The body's end dispatches what is pending, as a lenient client might (WHATWG drops it).
    for line in [*_LINE.split(stream), b""]:
        if not line:
            if data:
                _assemble(b"\n".join(data), texts)
            data = []
            continue
        name, _, value = line.partition(b":")
        if name.startswith(b"\xef\xbb\xbf"):
            name = name[3:]
        if name == b"data":
            data.append(value[1:] if value.startswith(b" ") else value)
    return list(texts.values())


def _assemble(data: bytes, texts: dict[object, str]) -> None:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return
    if not isinstance(obj, dict):
        return
    delta = obj.get("delta")
    # Each text as the SDK keeps it (per block, per item) and as it joins them (all blocks,
    # all items: get_final_text, output_text).
    if obj.get("type") == "content_block_delta" and isinstance(delta, dict):
        if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
            for key in ("a", ("a", repr(obj.get("index")))):
                texts[key] = texts.get(key, "") + delta["text"]
    elif obj.get("type") == "response.output_text.delta" and isinstance(delta, str):
        for key in ("r", ("r", repr(obj.get("output_index")), repr(obj.get("content_index")))):
            texts[key] = texts.get(key, "") + delta
    choices = obj.get("choices")
    for position, choice in enumerate(choices if isinstance(choices, list) else ()):
        if isinstance(choice, dict) and isinstance(choice.get("delta"), dict):
            content = choice["delta"].get("content")
            index = choice.get("index", position)
            if isinstance(content, str) and isinstance(index, int):
                texts[("c", index)] = texts.get(("c", index), "") + content


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % 3, data[1:MAX_BODY]
    try:
        whole = _run(body, None)
    except HttpProtocolError:
        return
    if mode == 1:
        sizes = [1] * len(body)
    else:
        rng = random.Random(data)
        sizes = [rng.randint(1, 64) for _ in range(len(body) // 16 + 1)]
    assert _run(body, sizes) == whole, "the output depends on the chunking"
    for text in _assembled(whole):
        leaked = [run for run in RUNS if run in text]
        assert not leaked, f"an SDK would assemble {leaked[0]!r}"
    # A data line the layer wrote (in the output, neither in the input nor in what the byte
    # scrubber alone makes of it: that one can break JSON the upstream sent) is valid JSON.
    before = set(_LINE.split(body)) | set(_LINE.split(SCRUBBER.scrub(body)))
    for line in _LINE.split(whole):
        if line.startswith(b"data: {") and line not in before:
            json.loads(line[6:])


if __name__ == "__main__":
    from seeded import fuzz

    fuzz("sse-scrub", SEEDS, TestOneInput, instrument_all=False)
