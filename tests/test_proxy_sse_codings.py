"""Streamed text and compressed bodies through the running proxy: no key comes back readable.

Real proxy process, the fake provider (appliance/demo_upstream.py) spelling the key it was
sent 1 to 7 bytes per text delta, real SDKs (anthropic, openai) assembling the deltas; the echo
host compressing what it is asked to. The SSE layer's own semantics: test_sse_scrub.py.
"""

from __future__ import annotations

import gzip
import json
import urllib.parse
import zlib
from collections.abc import Iterator

import httpx
import pytest

from appliance.demo_upstream import FakeServer
from tests.conftest import (
    AGENT_DUMMY_KEY,
    REAL_KEYS,
    RunningProxy,
    free_port,
    start_proxy,
    write_proxy_config,
)
from tests.test_proxy_scrubbing import echo_url, leaked_runs

KEY = REAL_KEYS["anthropic"]
SPELL = {"x-fake-leak": "spell"}


@pytest.fixture(scope="module")
def proxy(
    tmp_path_factory: pytest.TempPathFactory,
    provider: FakeServer,
    plain_host: FakeServer,
    ca_file: str,
) -> Iterator[RunningProxy]:
    """One proxy for the module (the CI budget): none of these tests changes its state."""
    port = free_port()
    config, events, control = write_proxy_config(
        tmp_path_factory.mktemp("proxy"),
        port=port,
        provider_port=provider.port,
        ca_file=ca_file,
        allow=["plain.test"],
    )
    running = start_proxy(config, host="127.0.0.1", port=port, events=events, control=control)
    yield running
    running.stop()


@pytest.mark.parametrize(
    ("eol", "framing"),
    [("lf", "chunked"), ("crlf", "chunked"), ("cr", "chunked"), ("lf", "length")],
)
def test_anthropic_sdk_assembles_the_marker_not_the_key(
    proxy: RunningProxy, eol: str, framing: str
) -> None:
    import anthropic

    # "length": a body under 64 KiB with a Content-Length, read whole (the same layer runs).
    client = anthropic.Anthropic(
        api_key=AGENT_DUMMY_KEY,
        base_url=f"{proxy.url}/anthropic",
        max_retries=0,
        default_headers={**SPELL, "x-fake-eol": eol, "x-fake-framing": framing},
    )
    with client.messages.stream(
        model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_text()
    assert final == "".join(pieces) == "The key is [REDACTED:anthropic]. Done."
    assert len(pieces) > 10  # still a stream of deltas, not one block
    assert leaked_runs(final.encode(), KEY) == []


def test_openai_sdk_assembles_the_marker_not_the_key(proxy: RunningProxy) -> None:
    import openai

    client = openai.OpenAI(
        api_key=AGENT_DUMMY_KEY,
        base_url=f"{proxy.url}/openai",
        max_retries=0,
        default_headers={"x-fake-leak": "spell-openai"},
    )
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "The key is [REDACTED:openai]. Done."


@pytest.mark.parametrize("http2", [False, True])
def test_responses_deltas_over_http1_and_http2_agents(proxy: RunningProxy, http2: bool) -> None:
    with httpx.Client(http1=not http2, http2=http2, timeout=20) as client:
        response = client.post(
            f"{proxy.url}/openai/v1/responses",
            headers={"x-fake-leak": "spell-responses", "authorization": "Bearer x"},
            json={"model": "m", "input": "x", "stream": True},
        )
    assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    text = ""
    for line in response.content.split(b"\n"):
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta":
                text += event["delta"]
    assert text == "The key is [REDACTED:openai]. Done."
    assert leaked_runs(response.content, REAL_KEYS["openai"]) == []


# -- compressed bodies -----------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "deflate-raw", "br"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_compressed_bodies_are_decoded_scrubbed_and_encoded_again(
    proxy: RunningProxy, plain_host: FakeServer, encoding: str, framing: str
) -> None:
    url = echo_url(plain_host.port, f"k={KEY} end", encoding=encoding, framing=framing)
    with httpx.Client(proxy=proxy.url, timeout=20) as client:
        response = client.get(url)
    assert response.status_code == 200
    assert response.headers["content-encoding"] == encoding.removesuffix("-raw")
    raw = response.read()  # httpx decoded it: the proxy re-encoded it validly
    assert raw == b"k=[REDACTED:anthropic] end"


@pytest.mark.parametrize("encoding", ["gzip-as-identity", "zlib-as-identity"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_compressed_bytes_labelled_identity_are_scrubbed_decoded(
    proxy: RunningProxy, plain_host: FakeServer, encoding: str, framing: str
) -> None:
    url = echo_url(plain_host.port, f"k={KEY} end", encoding=encoding, framing=framing)
    with httpx.Client(proxy=proxy.url, timeout=20) as client:
        response = client.get(url)
    assert response.status_code == 200
    body = response.content  # relayed re-encoded, with the label it came with
    decoded = gzip.decompress(body) if encoding.startswith("gzip") else zlib.decompress(body)
    assert decoded == b"k=[REDACTED:anthropic] end"
    assert leaked_runs(decoded, KEY) == []


def test_a_coding_the_proxy_cannot_decode_is_refused_readably(
    proxy: RunningProxy, plain_host: FakeServer
) -> None:
    url = echo_url(plain_host.port, f"k={KEY}", encoding="zstd")
    with httpx.Client(proxy=proxy.url, timeout=20) as client:
        response = client.get(url)
    assert response.status_code == 502
    refusal = response.json()
    assert refusal["rule"] == "unscrubbable_encoding"
    assert "content-encoding zstd" in refusal["message"]


def test_a_decompression_bomb_is_refused_and_the_proxy_carries_on(
    proxy: RunningProxy, plain_host: FakeServer
) -> None:
    # 64 MiB of zeros in about 64 KiB of gzip: the proxy stops past 8 MiB at 200x.
    query = urllib.parse.urlencode(
        {"text": "", "fill": "\0" * 1024, "repeat": "65536", "encoding": "gzip"}
    )
    url = f"http://plain.test:{plain_host.port}/reflect?{query}"
    got = 0
    with (
        httpx.Client(proxy=proxy.url, timeout=30) as client,
        client.stream("GET", url) as response,
    ):
        if response.status_code == 502:
            assert "inflates more than 200 times" in response.read().decode()
        else:  # the first read held too little to tell: cut after the head went out
            with pytest.raises(httpx.HTTPError):
                for chunk in response.iter_bytes():
                    got += len(chunk)
    assert got < 16 * 1024 * 1024
    with httpx.Client(proxy=proxy.url, timeout=20) as client:
        assert client.get(echo_url(plain_host.port, "still here")).text == "still here"
