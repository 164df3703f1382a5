"""Terminated CONNECT tunnels (docs/proxy.md "TLS termination"): a crew that holds a leaf for a
host gets its tunnel to that host terminated, and every request inside runs through the same
exchange as a forward request to https://host:port (injection, rules, placeholders, scrubbing),
upstream over verified TLS. Real clients (curl, httpx, the anthropic SDK) on loopback; the crew
trusts its own CA (appliance/crew_ca.py), the fake provider's certificate comes from the test CA.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
from pathlib import Path

import anthropic
import httpx
import httpx2
import pytest

from appliance.crew_ca import CrewCA
from appliance.demo_upstream import FakeServer
from proxycore import control
from proxycore.protocol import http1
from proxycore.protocol.credentials import Credential, Provider, Routes, route_for
from proxycore.protocol.events import (
    CredentialInjected,
    RequestAllowed,
    RequestDenied,
    TunnelClosed,
    TunnelOpened,
)
from proxycore.protocol.exchange import RULE_TUNNEL_HOST, plan_request
from proxycore.protocol.l7 import RULE_REQUIRES_TERMINATION, HostRule, L7Rules
from proxycore.protocol.plans import Forward, OpenTunnel, Refuse, TerminateTunnel
from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode
from tests.conftest import AGENT_DUMMY_KEY, REAL_KEYS, RunningProxy, leaf_toml

HOST = "api.anthropic.test"
KEY = REAL_KEYS["anthropic"]

# -- the exchange, sans I/O -------------------------------------------------------------------


def _head(data: bytes) -> http1.RequestHead:
    parsed = http1.parse_request_head(data)
    assert parsed is not None
    return parsed[0]


def _routes() -> Routes:
    route = route_for("https://api.anthropic.com", Provider.ANTHROPIC, Credential(KEY))
    return Routes({b"anthropic": route}, {route.host: route}, {})


def _crew(rules: L7Rules | None = None) -> CrewPolicy:
    allow = Allowlist(["api.anthropic.com", "git.test", "other.test"])
    return CrewPolicy("alpha", NetworkMode.RESTRICTED, allow, rules or L7Rules())


def _plan(data: bytes, crew: CrewPolicy | None = None, **kw: object) -> object:
    return plan_request(
        _head(data),
        crew or _crew(),
        _routes(),
        audit_blocked=False,
        max_body=1000,
        **kw,  # type: ignore[arg-type]
    )


RULED = L7Rules([HostRule.make("git.test", methods=("GET",), paths=("/repos/**",))])


def test_connect_to_a_host_with_a_leaf_is_terminated_rules_or_not() -> None:
    connect = b"CONNECT git.test:443 HTTP/1.1\r\nHost: git.test:443\r\n\r\n"
    assert isinstance(_plan(connect), OpenTunnel)
    refused = _plan(connect, _crew(RULED))
    assert isinstance(refused, Refuse) and refused.event.rule == RULE_REQUIRES_TERMINATION
    for crew in (_crew(), _crew(RULED)):
        got = _plan(connect, crew, leaves={"git.test"})
        assert isinstance(got, TerminateTunnel)
        assert (got.host, got.port, got.request.route) == ("git.test", 443, "tunnel")
    # A leaf opens nothing the name policy refuses.
    denied = _plan(b"CONNECT nope.test:443 HTTP/1.1\r\nHost: x\r\n\r\n", leaves={"nope.test"})
    assert isinstance(denied, Refuse) and denied.event.rule == "not_in_allowlist"


def test_requests_inside_are_forward_requests_over_tls_held_to_the_rules() -> None:
    inside = {"crew": _crew(RULED), "tunnel": ("git.test", 8443)}
    got = _plan(b"GET /repos/a?x=1 HTTP/1.1\r\nHost: git.test:8443\r\n\r\n", **inside)
    assert isinstance(got, Forward)
    assert (got.host, got.port, got.tls, got.request.route) == ("git.test", 8443, True, "forward")
    assert got.upstream_head(None).startswith(b"GET /repos/a?x=1 HTTP/1.1\r\nhost: git.test:8443")
    for request, rule in (
        (b"POST /repos/a HTTP/1.1\r\nHost: git.test\r\nContent-Length: 0\r\n\r\n", "l7_method"),
        (b"GET /admin HTTP/1.1\r\nHost: git.test\r\n\r\n", "l7_path"),
        (b"GET /repos/%2e%2e/admin HTTP/1.1\r\nHost: git.test\r\n\r\n", "l7_path_not_canonical"),
    ):
        refused = _plan(request, **inside)
        assert isinstance(refused, Refuse) and refused.status == 403, request
        assert refused.event.rule == rule


def test_inside_a_tunnel_another_host_or_target_form_is_refused() -> None:
    inside = {"tunnel": ("git.test", 443)}
    fronted = _plan(b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n", **inside)
    assert isinstance(fronted, Refuse) and fronted.status == 403 and fronted.close
    assert fronted.event.rule == RULE_TUNNEL_HOST
    for request in (
        b"GET https://other.test/ HTTP/1.1\r\nHost: git.test\r\n\r\n",
        b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\nHost: git.test\r\n\r\n",
    ):
        refused = _plan(request, **inside)
        assert isinstance(refused, Refuse) and refused.status == 400, request
    # HTTP/1.0 without Host: the tunnel's authority.
    assert isinstance(_plan(b"GET / HTTP/1.0\r\n\r\n", **inside), Forward)


def test_a_provider_host_inside_gets_the_key_and_a_misdirected_placeholder_is_refused() -> None:
    got = _plan(
        b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\nx-api-key: dummy\r\n"
        b"Content-Length: 2\r\n\r\n",
        tunnel=("api.anthropic.com", 443),
    )
    assert isinstance(got, Forward) and got.provider is Provider.ANTHROPIC and got.tls
    assert KEY.encode() in got.head and b"dummy" not in got.head
    misdirected = _plan(
        b"GET / HTTP/1.1\r\nHost: git.test\r\nx-api-key: appliance-placeholder-anthropic-a\r\n\r\n",
        tunnel=("git.test", 443),
    )
    assert isinstance(misdirected, Refuse) and misdirected.event.rule == "placeholder_misdirected"


# -- real clients through the proxy -----------------------------------------------------------


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "--noproxy", "", "--max-time", "20", *args],
        capture_output=True,
        text=True,
        timeout=25,
    )


def _trusting(ca_file: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_file)


def _tunnels(proxy: RunningProxy) -> tuple[list[TunnelOpened], list[TunnelClosed]]:
    events = proxy.events()
    return (
        [e for e in events if isinstance(e, TunnelOpened)],
        [e for e in events if isinstance(e, TunnelClosed)],
    )


def test_curl_through_a_terminated_tunnel_gets_the_key_injected(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    result = curl(
        "-x",
        terminating.url,
        "--cacert",
        crew_ca_file,
        "-H",
        f"x-api-key: {AGENT_DUMMY_KEY}",
        "-H",
        "content-type: application/json",
        "-d",
        '{"model": "claude-fake", "max_tokens": 5, "messages": []}',
        f"https://{HOST}:{provider.port}/v1/messages",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["type"] == "message"
    assert provider.last().all("x-api-key") == [KEY]
    events = terminating.events()
    assert [e for e in events if isinstance(e, CredentialInjected)]
    allowed = [e for e in events if isinstance(e, RequestAllowed)]
    assert [(e.route, e.method, e.status) for e in allowed] == [
        ("tunnel", "CONNECT", 200),
        ("forward", "POST", 200),
    ]
    opened, closed = _tunnels(terminating)
    assert opened[-1].host == HOST and closed[-1].host == HOST
    assert closed[-1].reason == "closed" and closed[-1].bytes_up > 100


def test_httpx_and_the_anthropic_sdk_through_a_terminated_tunnel(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    with httpx.Client(proxy=terminating.url, verify=_trusting(crew_ca_file), timeout=20) as client:
        for _ in range(3):  # one tunnel, kept alive
            response = client.get(
                f"https://{HOST}:{provider.port}/v1/models",
                headers={"x-api-key": AGENT_DUMMY_KEY},
            )
            assert response.status_code == 200
            assert provider.last().all("x-api-key") == [KEY]
        sdk = anthropic.Anthropic(
            api_key=AGENT_DUMMY_KEY,
            base_url=f"https://{HOST}:{provider.port}",
            http_client=httpx2.Client(
                proxy=terminating.url, verify=_trusting(crew_ca_file), timeout=20
            ),
            max_retries=0,
        )
        message = sdk.messages.create(
            model="claude-fake", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
        assert message.content[0].text == "Hello from the fake provider."  # type: ignore[union-attr]
        streamed = sdk.messages.create(
            model="claude-fake",
            max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
        )
        assert [event.type for event in streamed][-1] == "message_stop"
    assert provider.last().all("x-api-key") == [KEY]
    assert AGENT_DUMMY_KEY not in json.dumps([r.headers for r in provider.received])


def test_a_response_echoing_the_key_is_scrubbed_inside_the_tunnel(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    with httpx.Client(proxy=terminating.url, verify=_trusting(crew_ca_file), timeout=20) as client:
        for leak in ("error", "sse", "header"):
            response = client.post(
                f"https://{HOST}:{provider.port}/v1/messages",
                headers={"x-api-key": AGENT_DUMMY_KEY, "x-fake-leak": leak},
                json={},
            )
            seen = response.text + json.dumps(dict(response.headers))
            assert KEY not in seen and KEY[:20] not in seen, leak
            assert "[REDACTED:anthropic]" in seen, leak


def test_a_rule_refusal_inside_the_tunnel_is_a_403_json(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    with httpx.Client(proxy=terminating.url, verify=_trusting(crew_ca_file), timeout=20) as client:
        response = client.delete(f"https://{HOST}:{provider.port}/v1/models")
        assert response.status_code == 403
        body = response.json()
        assert body["error"] == "egress_denied" and body["rule"] == "l7_method"
        response = client.get(f"https://{HOST}:{provider.port}/v1/files")
        assert response.status_code == 403 and response.json()["rule"] == "l7_path"
    assert not [r for r in provider.received if r.method == "DELETE" or r.path == "/v1/files"]
    denied = [e for e in terminating.events() if isinstance(e, RequestDenied)]
    assert [(e.route, e.host, e.rule) for e in denied] == [
        ("forward", HOST, "l7_method"),
        ("forward", HOST, "l7_path"),
    ]


def test_domain_fronting_inside_the_tunnel_is_refused(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    with socket.create_connection(("127.0.0.1", terminating.port), timeout=10) as sock:
        sock.sendall(b"CONNECT %s:%d HTTP/1.1\r\nHost: x\r\n\r\n" % (HOST.encode(), provider.port))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        context = ssl.create_default_context(cafile=crew_ca_file)
        with context.wrap_socket(sock, server_hostname=HOST) as tls:
            assert tls.selected_alpn_protocol() is None  # nothing offered: none chosen
            tls.sendall(b"GET /v1/models HTTP/1.1\r\nHost: api.openai.test\r\n\r\n")
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
    assert data.startswith(b"HTTP/1.1 403 ")
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["rule"] == RULE_TUNNEL_HOST
    assert not provider.received


def test_alpn_offers_h2_and_http1(
    terminating: RunningProxy, provider: FakeServer, crew_ca_file: str
) -> None:
    # HTTP/2 inside the tunnel: tests/test_proxy_terminate_h2.py.
    with socket.create_connection(("127.0.0.1", terminating.port), timeout=10) as sock:
        sock.sendall(b"CONNECT %s:%d HTTP/1.1\r\nHost: x\r\n\r\n" % (HOST.encode(), provider.port))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        context = ssl.create_default_context(cafile=crew_ca_file)
        context.set_alpn_protocols(["h2", "http/1.1"])
        with context.wrap_socket(sock, server_hostname=HOST) as tls:
            assert tls.selected_alpn_protocol() == "h2"
            assert tls.version() in ("TLSv1.2", "TLSv1.3")


def test_a_host_without_a_leaf_still_gets_an_opaque_tunnel(
    terminating: RunningProxy, provider: FakeServer, ca_file: str
) -> None:
    # api.openai.test: a provider host, but no leaf: the agent's TLS goes through untouched,
    # the fake's own certificate and all, and nothing is injected.
    result = curl(
        "-x",
        terminating.url,
        "--cacert",
        ca_file,
        "-H",
        f"authorization: Bearer {AGENT_DUMMY_KEY}",
        f"https://api.openai.test:{provider.port}/v1/models",
    )
    assert result.returncode == 0, result.stderr
    assert provider.last().all("authorization") == [f"Bearer {AGENT_DUMMY_KEY}"]
    opened, closed = _tunnels(terminating)
    assert opened[-1].host == "api.openai.test" and opened[-1].address == "127.0.0.1"
    assert closed[-1].bytes_up > 100 and closed[-1].bytes_down > 100


def test_a_client_pinning_the_real_certificate_fails_and_the_journal_names_the_host(
    terminating: RunningProxy, provider: FakeServer, ca_file: str
) -> None:
    result = curl(
        "-x", terminating.url, "--cacert", ca_file, f"https://{HOST}:{provider.port}/v1/models"
    )
    assert result.returncode == 60, result  # curl: peer certificate cannot be authenticated
    assert not provider.received
    _, closed = _tunnels(terminating)
    assert closed[-1].host == HOST and closed[-1].reason == "agent_rejected_certificate"
    assert "Traceback" not in terminating.stop()


def test_plain_http_or_silence_in_the_tunnel_ends_it_with_a_reason(
    make_proxy, provider: FakeServer, crew_ca: CrewCA, tmp_path: Path
) -> None:
    proxy = make_proxy(extra=leaf_toml(crew_ca, tmp_path, HOST) + "[limits]\nhead_timeout = 1\n")
    connect = b"CONNECT %s:%d HTTP/1.1\r\nHost: x\r\n\r\n" % (HOST.encode(), provider.port)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(connect + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        while sock.recv(65536):
            pass
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(connect)  # and then no ClientHello
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert sock.recv(65536) == b""  # cut by the head timeout
    _, closed = _tunnels(proxy)
    reasons = [e.reason for e in closed]
    assert reasons[0].startswith("agent_tls_failed: ") and reasons[1] == "head timeout", reasons
    assert "Traceback" not in proxy.stop()


def _control(path: Path, message: control.ControlMessage) -> control.ControlReply:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(control.encoder.encode(message) + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            assert chunk
            data += chunk
    return control.reply_decoder.decode(data)


def test_leaves_pushed_by_control_message(
    make_proxy, provider: FakeServer, crew_ca: CrewCA, crew_ca_file: str
) -> None:
    proxy = make_proxy(with_control=True)
    assert proxy.control_socket is not None
    url = f"https://{HOST}:{provider.port}/v1/models"
    # No leaf yet: opaque, so a client trusting the crew CA only fails.
    assert curl("-x", proxy.url, "--cacert", crew_ca_file, url).returncode == 60
    leaf = crew_ca.mint(HOST)
    pem = control.LeafPem(host=HOST, cert_pem=leaf.cert_pem.decode(), key_pem=leaf.key_pem.decode())
    assert KEY not in repr(pem) and "PRIVATE" not in repr(pem)
    reply = _control(proxy.control_socket, control.CrewLeaves(crew="test", leaves=(pem,)))
    assert reply.ok and reply.changed, reply
    provider.clear()
    result = curl("-x", proxy.url, "--cacert", crew_ca_file, url)
    assert result.returncode == 0, result.stderr
    assert provider.last().all("x-api-key") == [KEY]
    # All or nothing: a key that is not the certificate's changes nothing, and the error names
    # the host, never the key.
    other = crew_ca.mint(HOST)
    bad = control.LeafPem(host=HOST, cert_pem=pem.cert_pem, key_pem=other.key_pem.decode())
    reply = _control(proxy.control_socket, control.CrewLeaves(crew="test", leaves=(bad,)))
    assert not reply.ok and HOST in (reply.error or "") and "PRIVATE" not in (reply.error or "")
    assert curl("-x", proxy.url, "--cacert", crew_ca_file, url).returncode == 0
    unknown = _control(proxy.control_socket, control.CrewLeaves(crew="nobody"))
    assert not unknown.ok
    # The empty set: opaque again.
    assert _control(proxy.control_socket, control.CrewLeaves(crew="test")).ok
    assert curl("-x", proxy.url, "--cacert", crew_ca_file, url).returncode == 60


def test_a_client_hello_pipelined_behind_the_connect_and_bulk_bytes_both_ways(
    make_proxy, provider: FakeServer, crew_ca: CrewCA, tmp_path: Path
) -> None:
    proxy = make_proxy(extra=leaf_toml(crew_ca, tmp_path, HOST))
    provider.clear()
    context = ssl.create_default_context(cadata=crew_ca.cert_pem.decode())
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=HOST)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    body = bytes(range(256)) * 8192  # 2 MiB up
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=20) as sock:
        # The ClientHello in the same segment as the CONNECT: the proxy must not lose it.
        connect = b"CONNECT %s:%d HTTP/1.1\r\nHost: x\r\n\r\n" % (HOST.encode(), provider.port)
        sock.sendall(connect + outgoing.read())
        received = b""
        while b"\r\n\r\n" not in received:
            received += sock.recv(65536)
        head, rest = received.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ")
        incoming.write(rest)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(65536))
        tls.write(
            b"POST /v1/upload HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n\r\n"
            % (HOST.encode(), len(body))
            + body
            + b"GET /size?n=3000000 HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n"
            % HOST.encode()
        )
        sock.sendall(outgoing.read())
        plain = b""
        while chunk := sock.recv(65536):
            incoming.write(chunk)
            while True:
                try:
                    plain += tls.read(65536)
                except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                    break
            if outgoing.pending:
                sock.sendall(outgoing.read())
    assert plain.startswith(b"HTTP/1.1 ") and plain.count(b"HTTP/1.1 200 ") == 2, plain[:300]
    second = plain[plain.index(b"HTTP/1.1 200 ", 10) :]
    assert _dechunked(second.split(b"\r\n\r\n", 1)[1]) == b"x" * 3_000_000
    upload = [r for r in provider.received if r.method == "POST"]
    assert upload and upload[-1].body == body


def _dechunked(data: bytes) -> bytes:
    body = b""
    while True:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line.split(b";")[0], 16)
        if not size:
            return body
        body, data = body + data[:size], data[size + 2 :]
