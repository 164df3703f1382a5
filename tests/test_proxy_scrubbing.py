"""The scrubber in the running proxy: nothing relayed back to a crew carries a credential.

Real proxy process, real upstreams on loopback (`appliance/demo_upstream.py`: a TLS provider that
echoes the key it was sent, a plain host that echoes what it is asked to), real clients (httpx,
curl, the anthropic SDK). The scrubber's own semantics are tested in test_scrub_reference.py and
test_native_scrub.py; here: that every path out of the proxy goes through it.
"""

from __future__ import annotations

import base64
import itertools
import json
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest

from appliance.demo_upstream import FakeServer
from native.scrub_patterns import crc32_base62
from tests.conftest import (
    AGENT_DUMMY_KEY,
    REAL_KEYS,
    RunningProxy,
    free_port,
    start_proxy,
    wait_for_path,
    write_proxy_config,
)

KEY = REAL_KEYS["anthropic"]


def leaked_runs(text: bytes, secret: str, run: int = 8) -> list[bytes]:
    """Every run of `run` bytes of the secret found in text (the acceptance rule)."""
    raw = secret.encode()
    return [raw[i : i + run] for i in range(len(raw) - run + 1) if raw[i : i + run] in text]


def echo_url(port: int, text: str, **params: str) -> str:
    query = urllib.parse.urlencode({"text": text, **params})
    return f"http://plain.test:{port}/reflect?{query}"


@pytest.fixture
def plain(plain_host: FakeServer) -> FakeServer:
    return plain_host


# -- provider routes: the key echoed back by the provider -----------------------------------------


@pytest.mark.parametrize("how", ["error", "header", "sse"])
def test_provider_echoing_the_key_is_scrubbed(proxy: RunningProxy, how: str) -> None:
    with httpx.Client(timeout=20) as client:
        response = client.post(
            f"{proxy.url}/anthropic/v1/messages",
            headers={"x-api-key": AGENT_DUMMY_KEY, "x-fake-leak": how},
            json={"model": "m", "max_tokens": 1, "messages": []},
        )
    seen = response.content + json.dumps(dict(response.headers)).encode()
    assert leaked_runs(seen, KEY) == []
    assert b"[REDACTED:anthropic]" in seen
    if how == "error":
        assert response.status_code == 401
        # The body was rewritten: its Content-Length must be the new one (httpx checks it too).
        assert int(response.headers["content-length"]) == len(response.content)
        assert json.loads(response.content)["error"]["message"] == (
            "invalid x-api-key: [REDACTED:anthropic]"
        )
    if how == "sse":
        # The stream still arrives as events; the half keys in two events are both gone.
        assert response.content.count(b"event: ") == 3
        assert b"bad key [REDACTED:anthropic]" in response.content


def test_sdk_error_message_carries_no_key(proxy: RunningProxy) -> None:
    import anthropic

    client = anthropic.Anthropic(
        api_key=AGENT_DUMMY_KEY,
        base_url=f"{proxy.url}/anthropic",
        max_retries=0,
        default_headers={"x-fake-leak": "error"},
    )
    with pytest.raises(anthropic.AuthenticationError) as caught:
        client.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert leaked_runs(str(caught.value).encode(), KEY) == []
    assert "[REDACTED:anthropic]" in str(caught.value)


def test_upstream_is_asked_for_identity_encoding(
    proxy: RunningProxy, provider: FakeServer, plain: FakeServer
) -> None:
    with httpx.Client(proxy=proxy.url, timeout=20) as client:
        client.get(f"http://plain.test:{plain.port}/x", headers={"accept-encoding": "gzip, br"})
        assert plain.last().all("accept-encoding") == ["identity"]
    with httpx.Client(timeout=20) as client:
        client.post(
            f"{proxy.url}/anthropic/v1/messages",
            headers={"accept-encoding": "gzip"},
            json={"model": "m", "max_tokens": 1, "messages": []},
        )
    assert provider.last().all("accept-encoding") == ["identity"]


# -- forward route: an upstream that echoes what it is given ---------------------------------------


def _forms(secret: str) -> dict[str, str]:
    raw = secret.encode()
    zero_width = "\u200b".join(secret[i : i + 5] for i in range(0, len(secret), 5))
    return {
        "raw": secret,
        "half": secret[10:30],
        "base64": base64.b64encode(b"x" + raw).decode(),
        "base64url": base64.urlsafe_b64encode(b"xy" + raw).decode().rstrip("="),
        "hex": raw.hex().upper(),
        "percent": "".join(f"%{b:02x}" for b in raw),
        "json-u": "".join(f"\\u{b:04x}" for b in raw),
        "reversed": secret[::-1],
        "zero-width": zero_width,
    }


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_every_encoding_is_scrubbed_in_every_framing(
    proxy: RunningProxy, plain: FakeServer, framing: str
) -> None:
    forms = _forms(KEY)
    text = "".join(f"<{name}:{value}>\n" for name, value in forms.items())
    url = echo_url(plain.port, text, framing=framing, pieces="7", delay="0.01")
    with httpx.Client(proxy=proxy.url, timeout=20) as client:
        body = client.get(url).content
    assert leaked_runs(body, KEY) == []
    for name, value in forms.items():
        assert value.encode() not in body, name
        assert f"<{name}:".encode() in body  # the text around each secret is untouched
    assert body.count(b"[REDACTED:anthropic]") == len(forms), body


def test_shapes_and_response_fields_are_scrubbed(proxy: RunningProxy, plain: FakeServer) -> None:
    pem = (
        "-----BEGIN OPENSSH PRIVATE KEY-----\n"
        "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
        "-----END OPENSSH PRIVATE KEY-----"
    )
    body = "A1b2C3d4E5" * 3  # a GitHub token ends with the CRC-32 of its body (base62)
    github = "ghp_" + body + crc32_base62(body.encode()).decode()
    text = f'key:\n{pem}\ntoken {github} and {{"password": "hunter2hunter2"}}'
    url = echo_url(plain.port, text, framing="chunked", pieces="13", header="1")
    with httpx.Client(proxy=proxy.url, timeout=20) as client:
        response = client.get(url.replace("&header=1", "") + "&header=0")
        echoed = client.get(echo_url(plain.port, github, header="1"))
    body = response.content
    assert b"PRIVATE KEY" not in body and github.encode() not in body
    assert b"hunter2hunter2" not in body
    assert body == (
        b'key:\n[REDACTED:private-key]\ntoken [REDACTED:github] and {"password": '
        b'"[REDACTED:password]"}'
    )
    assert echoed.headers["x-echo"] == "[REDACTED:github]"


def test_http10_client_gets_a_close_delimited_scrubbed_body(
    proxy: RunningProxy, plain: FakeServer
) -> None:
    url = echo_url(plain.port, f"k={KEY}", framing="chunked", pieces="3")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"GET {url} HTTP/1.0\r\nhost: plain.test\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"content-length" not in head.lower()
    assert body == b"k=[REDACTED:anthropic]"


def dechunk(body: bytes) -> bytes:
    """A chunked body's data (strict: a malformed one fails the test)."""
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert body == b"\r\n"
            return out
        out += body[:size]
        assert body[size : size + 2] == b"\r\n"
        body = body[size + 2 :]


def test_endless_zero_width_characters_inside_a_key_are_capped_not_held(
    proxy: RunningProxy, plain: FakeServer
) -> None:
    # "sk-ant-" then 1.5 MB of U+200B: the key may go on, so the stream releases nothing of it,
    # but a run of zero-width characters keeps only its first two, so it holds a few bytes,
    # not the 1.5 MB, and the response completes.
    query = urllib.parse.urlencode(
        {
            "text": "sk-ant-",
            "fill": "\u200b",
            "repeat": "500000",
            "framing": "chunked",
            "pieces": "50",
        }
    )
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=20) as sock:
        target = f"http://plain.test:{plain.port}/reflect?{query}"
        sock.sendall(
            f"GET {target} HTTP/1.1\r\nhost: plain.test\r\nconnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body.endswith(b"0\r\n\r\n")
    assert dechunk(body) == "sk-ant-\u200b\u200b".encode()


def test_sse_events_are_not_held_back(proxy: RunningProxy, plain: FakeServer) -> None:
    # Events 0.3 s apart: each must arrive with the read that completed it, not with the next.
    arrivals: list[float] = []
    start = time.monotonic()
    with (
        httpx.Client(proxy=proxy.url, timeout=20) as client,
        client.stream("GET", f"http://plain.test:{plain.port}/sse?n=4&delay=0.3") as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data:"):
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) == 4
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert all(0.15 < gap < 0.6 for gap in gaps), arrivals


# -- rotation without a restart -------------------------------------------------------------------


def test_rotated_credential_is_injected_and_scrubbed_without_restart(
    tmp_path: Path, provider: FakeServer, ca_file: str
) -> None:
    key_file = tmp_path / "anthropic.key"
    old_key = "sk-ant-api03-OLDKEY-rotation-test-000000000000"
    new_key = "sk-ant-api03-NEWKEY-rotation-test-111111111111"
    key_file.write_text(old_key)
    port = free_port()
    config, events, control = write_proxy_config(
        tmp_path, port=port, provider_port=provider.port, ca_file=ca_file, with_control=True
    )
    text = config.read_text().replace(
        'credential_env = "TEST_ANTHROPIC_KEY"', f'credential_file = "{key_file}"', 1
    )
    config.write_text(text)
    running = start_proxy(config, host="127.0.0.1", port=port, events=events, control=control)
    try:
        assert control is not None
        wait_for_path(control)

        def leak() -> bytes:
            with httpx.Client(timeout=20) as client:
                return client.post(
                    f"{running.url}/anthropic/v1/messages",
                    headers={"x-fake-leak": "error"},
                    json={"model": "m", "max_tokens": 1, "messages": []},
                ).content

        assert b"[REDACTED:anthropic]" in leak() and old_key.encode() not in leak()
        key_file.write_text(new_key)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "appliance.cli",
                "--json",
                "proxy-reload-credentials",
                "--socket",
                str(control),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"ok": True, "changed": True}
        body = leak()
        assert provider.last().all("x-api-key") == [new_key]
        assert leaked_runs(body, new_key) == [] and b"[REDACTED:anthropic]" in body
        # A bad credential file: the reload is refused and the proxy keeps the working one.
        key_file.write_text("")
        bad = subprocess.run(
            [
                sys.executable,
                "-m",
                "appliance.cli",
                "proxy-reload-credentials",
                "--socket",
                str(control),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert bad.returncode == 1 and "providers.anthropic" in bad.stderr
        assert new_key not in bad.stderr
        leak()
        assert provider.last().all("x-api-key") == [new_key]
    finally:
        running.stop()


def test_appliancectl_scrub_filters_a_stream(tmp_path: Path) -> None:
    secret_file = tmp_path / "k"
    secret_file.write_text(KEY + "\n")
    # The secret arrives in two writes with a pause between: the filter holds the first half.
    writer = (
        f"import sys, time; w = sys.stdout.buffer; w.write(b'log: {KEY[:20]}'); w.flush(); "
        f"time.sleep(0.3); w.write(b'{KEY[20:]} done\\n'); w.flush()"
    )
    producer = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance.cli",
            "scrub",
            "--secret-file",
            f"anthropic={secret_file}",
        ],
        stdin=producer.stdout,
        capture_output=True,
        timeout=30,
    )
    producer.wait(timeout=10)
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"log: [REDACTED:anthropic] done\n"
    bad = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "scrub", "--secret-file", "nofile"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "expected NAME=PATH" in bad.stderr
