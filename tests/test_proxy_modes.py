"""The proxy's three modes end to end, with real clients (curl, httpx, the official SDKs)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from appliance.demo_upstream import FakeServer
from proxycore.protocol.events import (
    CredentialInjected,
    RequestAllowed,
    RequestDenied,
    TunnelClosed,
    TunnelOpened,
)
from tests.conftest import AGENT_DUMMY_KEY, REAL_KEYS, RunningProxy


def appliancectl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *args], capture_output=True, text=True, timeout=30
    )


def curl(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "--noproxy", "", "--max-time", str(timeout), *args],
        capture_output=True,
        text=True,
        timeout=timeout + 5,
    )


# -- reverse proxy -------------------------------------------------------------------------------


def test_anthropic_sdk_through_reverse_route_gets_real_key(
    proxy: RunningProxy, provider: FakeServer
) -> None:
    import anthropic

    client = anthropic.Anthropic(
        api_key=AGENT_DUMMY_KEY, base_url=f"{proxy.url}/anthropic", max_retries=0
    )
    message = client.messages.create(
        model="claude-fake", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].text == "Hello from the fake provider."
    seen = provider.last()
    assert seen.path == "/v1/messages"
    assert seen.header("host") == f"api.anthropic.test:{provider.port}"
    assert seen.all("x-api-key") == [REAL_KEYS["anthropic"]]
    # The SDK names its own API version; the proxy adds 2023-06-01 only when none is sent.
    assert seen.all("anthropic-version") == [client.default_headers["anthropic-version"]]
    assert AGENT_DUMMY_KEY not in json.dumps(seen.headers)
    kinds = [type(e) for e in proxy.events()]
    assert RequestAllowed in kinds and CredentialInjected in kinds


def test_anthropic_sdk_streaming(proxy: RunningProxy, provider: FakeServer) -> None:
    import anthropic

    client = anthropic.Anthropic(
        api_key=AGENT_DUMMY_KEY, base_url=f"{proxy.url}/anthropic", max_retries=0
    )
    with client.messages.stream(
        model="claude-fake", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        text = "".join(stream.text_stream)
    assert text == "Hello from the fake provider."
    assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]


def test_openai_sdk_through_reverse_route(proxy: RunningProxy, provider: FakeServer) -> None:
    import openai

    client = openai.OpenAI(api_key=AGENT_DUMMY_KEY, base_url=f"{proxy.url}/openai", max_retries=0)
    completion = client.chat.completions.create(
        model="gpt-fake", messages=[{"role": "user", "content": "hi"}]
    )
    assert completion.choices[0].message.content == "Hello from fake OpenAI."
    seen = provider.last()
    # The base URL's path (/v1) is the prefix of the route.
    assert seen.path == "/v1/chat/completions"
    assert seen.all("authorization") == [f"Bearer {REAL_KEYS['openai']}"]
    assert AGENT_DUMMY_KEY not in json.dumps(seen.headers)


def test_google_key_goes_in_query_and_agent_key_is_dropped(
    proxy: RunningProxy, provider: FakeServer
) -> None:
    result = curl(
        "-X",
        "POST",
        "-H",
        "content-type: application/json",
        "-H",
        f"x-goog-api-key: {AGENT_DUMMY_KEY}",
        "-d",
        "{}",
        f"{proxy.url}/google/v1beta/models/gemini-fake:generateContent"
        f"?key={AGENT_DUMMY_KEY}&alt=json",
    )
    assert result.returncode == 0, result.stderr
    assert "fake Gemini" in result.stdout
    seen = provider.last()
    assert seen.path == (
        f"/v1beta/models/gemini-fake:generateContent?alt=json&key={REAL_KEYS['google']}"
    )
    assert AGENT_DUMMY_KEY not in seen.path + json.dumps(seen.headers)


def test_every_agent_credential_header_is_removed(
    proxy: RunningProxy, provider: FakeServer
) -> None:
    result = curl(
        "-H",
        f"authorization: Bearer {AGENT_DUMMY_KEY}",
        "-H",
        f"x-api-key: {AGENT_DUMMY_KEY}",
        "-H",
        f"api-key: {AGENT_DUMMY_KEY}",
        "-H",
        f"proxy-authorization: Basic {AGENT_DUMMY_KEY}",
        "-H",
        f"cookie: session={AGENT_DUMMY_KEY}",
        f"{proxy.url}/anthropic/v1/models",
    )
    assert result.returncode == 0, result.stderr
    seen = provider.last()
    assert AGENT_DUMMY_KEY not in json.dumps(seen.headers)
    assert seen.all("x-api-key") == [REAL_KEYS["anthropic"]]
    assert seen.all("authorization") == []


def test_sse_is_relayed_as_it_arrives(proxy: RunningProxy) -> None:
    # The fake sends 5 events 0.3 s apart; a buffering proxy would deliver them all at the end.
    arrivals: list[float] = []
    start = time.monotonic()
    with (
        httpx.Client(proxy=proxy.url, timeout=20) as client,
        client.stream("GET", f"http://plain.test:{_plain_port()}/sse?n=5&delay=0.3") as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) == 5
    assert arrivals[0] < 1.0, arrivals
    assert arrivals[-1] - arrivals[0] > 0.9, arrivals


_PLAIN: dict[str, int] = {}


@pytest.fixture(autouse=True)
def _remember_plain(plain_host: FakeServer) -> None:
    _PLAIN["port"] = plain_host.port


def _plain_port() -> int:
    return _PLAIN["port"]


# -- forward proxy -------------------------------------------------------------------------------


def test_forward_proxy_keep_alive_and_upstream_reuse(
    proxy: RunningProxy, plain_host: FakeServer
) -> None:
    url = f"http://plain.test:{plain_host.port}/echo"
    connections_before = plain_host.connections
    with httpx.Client(proxy=proxy.url, timeout=10) as client:
        for _ in range(5):
            response = client.get(url)
            assert response.status_code == 200
            assert response.json()["host"] == f"plain.test:{plain_host.port}"
    assert len(plain_host.received) == 5
    # Five requests, one upstream connection: the proxy pooled and reused it.
    assert plain_host.connections - connections_before == 1
    # One upstream connection served all five (the fake counts requests per connection via
    # its handler; httpx reused the client side).
    allowed = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
    assert len(allowed) == 5
    assert all(e.route == "forward" and e.host == "plain.test" for e in allowed)


def test_forward_to_provider_host_is_upgraded_to_tls_and_injected(
    proxy: RunningProxy, provider: FakeServer
) -> None:
    result = curl(
        "-x",
        proxy.url,
        "-H",
        f"x-api-key: {AGENT_DUMMY_KEY}",
        "http://api.anthropic.test/v1/models",
    )
    assert result.returncode == 0, result.stderr
    seen = provider.last()
    assert seen.all("x-api-key") == [REAL_KEYS["anthropic"]]
    assert seen.all("anthropic-version") == ["2023-06-01"]


def test_forward_denied_host_gets_readable_refusal(proxy: RunningProxy) -> None:
    result = curl("-x", proxy.url, "-w", "\n%{http_code}", "http://other.test/")
    body, status = result.stdout.rsplit("\n", 1)
    assert status == "403"
    refusal = json.loads(body)
    assert refusal == {
        "error": "egress_denied",
        "host": "other.test",
        "rule": "not_in_allowlist",
        "mode": "restricted",
        "crew": "test",
        "message": "other.test is not on the allowlist of crew test",
    }
    denied = [e for e in proxy.events() if isinstance(e, RequestDenied)]
    assert denied and denied[-1].host == "other.test" and denied[-1].status == 403


def test_redirect_to_other_host_never_carries_the_credential(
    make_proxy, provider: FakeServer, plain_host: FakeServer
) -> None:
    proxy = make_proxy(mode="free")
    target = f"http://other.test:{plain_host.port}/landing"
    plain_host.clear()
    # Only the redirect's target goes through the proxy as a forward request; the first request
    # is a reverse-route request to the proxy itself.
    mounts = {"http://other.test": httpx.HTTPTransport(proxy=proxy.url)}
    with httpx.Client(mounts=mounts, timeout=10, follow_redirects=True) as client:
        response = client.get(f"{proxy.url}/anthropic/redirect", params={"to": target})
    assert response.status_code == 200
    assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]
    landed = plain_host.last()
    assert landed.path == "/landing"
    everything = json.dumps(landed.headers)
    assert REAL_KEYS["anthropic"] not in everything


# -- CONNECT -------------------------------------------------------------------------------------


def test_connect_tunnel_to_provider_is_opaque(
    proxy: RunningProxy, provider: FakeServer, ca_file: str
) -> None:
    # curl speaks TLS through the tunnel itself; the proxy must not inject anything.
    result = curl(
        "-p",
        "-x",
        proxy.url,
        "--cacert",
        ca_file,
        "--resolve",
        f"api.anthropic.test:{provider.port}:127.0.0.1",
        "-H",
        f"x-api-key: {AGENT_DUMMY_KEY}",
        f"https://api.anthropic.test:{provider.port}/v1/models",
    )
    assert result.returncode == 0, result.stderr
    assert provider.last().all("x-api-key") == [AGENT_DUMMY_KEY]
    events = proxy.events()
    opened = [e for e in events if isinstance(e, TunnelOpened)]
    closed = [e for e in events if isinstance(e, TunnelClosed)]
    assert opened and opened[-1].host == "api.anthropic.test"
    assert closed and closed[-1].bytes_up > 100 and closed[-1].bytes_down > 100
    assert not [e for e in events if isinstance(e, CredentialInjected)]


def test_connect_denied_host(proxy: RunningProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n")
        data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 403 ")
    assert b'"rule":"not_in_allowlist"' in data


def test_connect_half_close_and_byte_counts(make_proxy, tmp_path) -> None:
    # An echo server that replies only after the client has shut down its write half.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    import threading

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            conn.sendall(b"got %d bytes" % len(data))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    proxy = make_proxy(allow=["plain.test"])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(
            b"CONNECT plain.test:%d HTTP/1.1\r\nHost: plain.test\r\n\r\n" % port + b"x" * 1000
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 200")
        sock.sendall(b"y" * 100_000)
        sock.shutdown(socket.SHUT_WR)
        reply = _read_all(sock)
    assert reply == b"got 101000 bytes"
    thread.join(5)
    listener.close()
    closed = [e for e in proxy.events() if isinstance(e, TunnelClosed)]
    assert closed[-1].bytes_up == 101000 and closed[-1].bytes_down == len(reply)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


# -- local API and run-time allowlist ------------------------------------------------------------


def test_health_answers_locally(proxy: RunningProxy) -> None:
    response = httpx.get(f"{proxy.url}/_appliance/health")
    assert response.json() == {"ok": True, "crew": "test", "mode": "restricted"}


def test_allowlist_entry_added_at_run_time(proxy: RunningProxy, plain_host: FakeServer) -> None:
    url = f"http://other.test:{plain_host.port}/x"
    with httpx.Client(proxy=proxy.url, timeout=10) as client:
        assert client.get(url).status_code == 403
        result = appliancectl(
            "--json", "proxy-allow", "--socket", str(proxy.control_socket), "test", "other.test"
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["changed"] is True
        assert client.get(url).status_code == 200
    bad = appliancectl("proxy-allow", "--socket", str(proxy.control_socket), "nosuchcrew", "x.test")
    assert bad.returncode == 1 and "unknown crew 'nosuchcrew'" in bad.stderr


def test_control_socket_answers_a_line_it_cannot_read_and_goes_on(proxy: RunningProxy) -> None:
    assert proxy.control_socket is not None
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(proxy.control_socket))
        sock.sendall(b'{"type": "no_such_message"}\n{"type": "allow_host", "crew": "test"')
        sock.sendall(b', "host": "third.test"}\n')
        answers = b""
        while answers.count(b"\n") < 2:
            answers += sock.recv(4096)
    refused, allowed = (json.loads(line) for line in answers.splitlines())
    assert refused["ok"] is False and refused["error"].startswith("bad message")
    assert allowed["ok"] is True


def test_default_allow_is_configuration_and_a_removed_host_is_refused(
    make_proxy, plain_host: FakeServer, provider: FakeServer
) -> None:
    """`[policy] default_allow` (docs/proxy.md): a host on the shipped list is allowed to every
    restricted crew; removed from the list, a real proxy refuses it; the provider hosts stay."""
    # api.cursor.sh is on the shipped list; the split-horizon table sends it to the plain test
    # host on loopback, so nothing leaves the machine.
    url = f"http://api.cursor.sh:{plain_host.port}/x"
    shipped = make_proxy(resolve_names=["api.cursor.sh"])
    trimmed = make_proxy(
        resolve_names=["api.cursor.sh"], extra="[policy]\ndefault_allow = ['api.anthropic.com']\n"
    )
    empty = make_proxy(resolve_names=["api.cursor.sh"], extra="[policy]\ndefault_allow = []\n")
    with httpx.Client(proxy=shipped.url, timeout=10) as client:
        assert client.get(url).status_code == 200
    for proxy in (trimmed, empty):
        with httpx.Client(proxy=proxy.url, timeout=10) as client:
            refused = client.get(url)
        assert refused.status_code == 403
        assert refused.json()["rule"] == "not_in_allowlist"
        assert refused.json()["host"] == "api.cursor.sh"
        denied = [e for e in proxy.events() if isinstance(e, RequestDenied)]
        assert [(e.host, e.rule) for e in denied] == [("api.cursor.sh", "not_in_allowlist")]
        # The configured provider's host is every crew's, whatever default_allow says.
        answer = httpx.post(
            f"{proxy.url}/anthropic/v1/messages",
            headers={"x-api-key": AGENT_DUMMY_KEY},
            json={"model": "m", "max_tokens": 1, "messages": []},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]


def test_mode_none_refuses_every_route(make_proxy) -> None:
    proxy = make_proxy(mode="none")
    response = httpx.post(f"{proxy.url}/anthropic/v1/messages", json={})
    assert response.status_code == 403
    assert response.json()["rule"] == "mode_none"


def test_workers_share_the_port_and_the_run_time_allowlist(
    make_proxy, plain_host: FakeServer
) -> None:
    proxy = make_proxy(workers=2, with_control=True)
    # Both workers bound the port (SO_REUSEPORT) before any request is sent.
    proxy.wait_for_stderr({"proxy worker 0: listening", "proxy worker 1: listening"})
    url = f"http://other.test:{plain_host.port}/x"
    allow = appliancectl(
        "--json", "proxy-allow", "--socket", str(proxy.control_socket), "test", "other.test"
    )
    assert allow.returncode == 0, allow.stderr
    # New connections are spread over both workers by the kernel; every one must see the entry.
    statuses = []
    for _ in range(20):
        with httpx.Client(proxy=proxy.url, timeout=10) as client:
            statuses.append(client.get(url).status_code)
    assert statuses == [200] * 20


BYPASSES = [
    "plain.test.",  # trailing dot
    "test",  # parent
    "x.plain.test",  # child
    "plain.test.evil.test",
    "evil.test@plain.test",
    "plain.test%00",
    "plain.tes",
    "lain.test",
    "[::1]",
    "127.0.0.1",
]


@pytest.mark.parametrize("host", BYPASSES)
def test_allowlist_bypass_attempts_are_refused(
    proxy: RunningProxy, plain_host: FakeServer, host: str
) -> None:
    plain_host.clear()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(
            b"GET http://%s/ HTTP/1.1\r\nHost: plain.test\r\nConnection: close\r\n\r\n"
            % host.encode()
        )
        data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 403 "), data[:200]
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["rule"] in ("not_in_allowlist", "malformed_host"), body
    assert not plain_host.received


def test_mixed_case_host_is_the_same_host(proxy: RunningProxy, plain_host: FakeServer) -> None:
    # Lowercasing is part of exact matching (host names are case-insensitive, RFC 4343).
    result = curl("-x", proxy.url, f"http://PLAIN.Test:{plain_host.port}/echo")
    assert json.loads(result.stdout)["path"] == "/echo"


def test_whitespace_in_host_is_refused(proxy: RunningProxy) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"GET http://plain.test\t/ HTTP/1.1\r\nHost: x\r\n\r\n")
        data = _read_all(sock)
    assert data.startswith(b"HTTP/1.1 400 ") or data.startswith(b"HTTP/1.1 403 ")


def test_connect_idle_tunnel_is_closed(make_proxy, plain_host: FakeServer) -> None:
    proxy = make_proxy(allow=["plain.test"], extra="[limits]\ntunnel_idle_timeout = 1.0\n")
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"CONNECT plain.test:%d HTTP/1.1\r\nHost: x\r\n\r\n" % plain_host.port)
        started = time.monotonic()
        data = _read_all(sock)  # nothing sent through: the tunnel goes idle and is closed
        elapsed = time.monotonic() - started
    assert data.startswith(b"HTTP/1.1 200")
    assert 0.9 < elapsed < 5
    closed = [e for e in proxy.events() if isinstance(e, TunnelClosed)]
    assert closed and closed[-1].reason == "idle_timeout"


def test_provider_with_untrusted_certificate_gets_no_key(make_proxy, tmp_path) -> None:
    import ssl

    import trustme

    from appliance.demo_upstream import start_fake

    rogue_ca = trustme.CA()  # not the CA the proxy trusts
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    rogue_ca.issue_cert("api.anthropic.test").configure_cert(context)
    rogue = start_fake(tls_context=context)
    try:
        proxy = make_proxy(extra="")
        text = proxy.config_path.read_text().replace(
            f"https://api.anthropic.test:{_provider_port(proxy)}",
            f"https://api.anthropic.test:{rogue.port}",
        )
        proxy.stop()
        proxy.config_path.write_text(text)
        from tests.conftest import start_proxy

        proxy2 = start_proxy(
            proxy.config_path, host="127.0.0.1", port=proxy.port, events=proxy.events_path
        )
        try:
            response = httpx.post(f"{proxy2.url}/anthropic/v1/messages", json={}, timeout=10)
        finally:
            proxy2.stop()
        assert response.status_code == 502
        assert "TLS" in response.json()["message"]
        assert rogue.received == []  # the TLS handshake failed: no request, no key
    finally:
        rogue.close()


def _provider_port(proxy: RunningProxy) -> int:
    import re

    match = re.search(r"https://api\.anthropic\.test:(\d+)", proxy.config_path.read_text())
    assert match
    return int(match.group(1))
