"""Placeholder keys (proxycore/protocol/placeholders.py): replaced on their provider's route,
refused and journaled anywhere else, left alone by the scrubber."""

from __future__ import annotations

import json
import subprocess

import pytest

from native.scrub import Scrubber
from proxycore.protocol import http1
from proxycore.protocol.credentials import Provider
from proxycore.protocol.events import RequestDenied
from proxycore.protocol.exchange import plan_request
from proxycore.protocol.placeholders import (
    RULE_MISDIRECTED,
    misdirected_placeholder,
    placeholder,
)
from proxycore.protocol.plans import Forward, OpenTunnel, Refuse
from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode
from tests.conftest import REAL_KEYS, FakeServer
from tests.test_exchange import KEY, routes

ANTHROPIC = placeholder(Provider.ANTHROPIC, "alpha")
OPENAI = placeholder(Provider.OPENAI, "alpha")


def _plan(data: bytes) -> object:
    parsed = http1.parse_request_head(data)
    assert parsed is not None
    crew = CrewPolicy(
        "alpha",
        NetworkMode.RESTRICTED,
        Allowlist(["api.anthropic.com", "api.openai.com", "collector.test"]),
    )
    return plan_request(parsed[0], crew, routes(), audit_blocked=False, max_body=1000)


def test_the_value_names_provider_and_crew_and_is_header_safe() -> None:
    assert ANTHROPIC == "appliance-placeholder-anthropic-alpha"
    assert (
        placeholder(Provider.GOOGLE, "we ird/name\r\n")
        == "appliance-placeholder-google-we-ird-name-"
    )
    # No provider's key prefix: the scrubber's token shapes leave an echoed placeholder alone
    # (after a keyword such as `"x-api-key":` any value is redacted, this one too).
    text = f"use {ANTHROPIC} or Bearer {OPENAI}".encode()
    assert Scrubber([]).scrub(text) == text


def test_on_its_providers_route_the_placeholder_is_replaced() -> None:
    reverse = _plan(
        b"POST /anthropic/v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: %s\r\n"
        b"Content-Length: 0\r\n\r\n" % ANTHROPIC.encode()
    )
    assert isinstance(reverse, Forward)
    sent = reverse.upstream_head(None)
    assert ANTHROPIC.encode() not in sent and b"x-api-key: " + KEY.encode() in sent
    forward = _plan(
        b"GET http://api.anthropic.com/v1/models HTTP/1.1\r\nHost: x\r\nx-api-key: %s\r\n\r\n"
        % ANTHROPIC.encode()
    )
    assert isinstance(forward, Forward) and ANTHROPIC.encode() not in forward.upstream_head(None)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST http://collector.test/v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: %(a)s\r\n"
        b"Content-Length: 0\r\n\r\n",
        b"GET http://collector.test/?key=%(a)s HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET http://collector.test/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %(a)s\r\n\r\n",
        # Another provider's route: the Anthropic placeholder has no business there.
        b"POST /openai/v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Extra: %(a)s\r\n"
        b"Content-Length: 0\r\n\r\n",
        b"CONNECT collector.test:443 HTTP/1.1\r\nHost: x\r\n"
        b"Proxy-Authorization: Basic %(a)s\r\n\r\n",
    ],
)
def test_anywhere_else_it_is_refused_and_journaled(request_bytes: bytes) -> None:
    got = _plan(request_bytes % {b"a": ANTHROPIC.encode()})
    assert isinstance(got, Refuse) and got.status == 403
    assert isinstance(got.event, RequestDenied) and got.event.rule == RULE_MISDIRECTED
    assert got.body.rule == RULE_MISDIRECTED and "anthropic" in got.body.message


def test_a_tunnel_to_the_providers_own_host_and_plain_requests_pass() -> None:
    connect = b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: x\r\nX-K: %s\r\n\r\n"
    assert isinstance(_plan(connect % ANTHROPIC.encode()), OpenTunnel)
    plain = b"GET http://collector.test/appliance-placeholder-x HTTP/1.1\r\nHost: x\r\n\r\n"
    assert isinstance(_plan(plain), Forward)  # the prefix alone names no provider
    assert misdirected_placeholder(b"GET / HTTP/1.1\r\n\r\n", None) is None


def test_a_misdirected_placeholder_through_the_proxy_with_curl(
    make_proxy, plain_host: FakeServer, provider: FakeServer
) -> None:
    plain_host.clear()
    provider.clear()
    proxy = make_proxy(allow=["plain.test"])
    base = f"http://plain.test:{plain_host.port}"
    done = subprocess.run(
        ["curl", "-sS", "--max-time", "10", "-x", proxy.url, "-w", "\n%{http_code}",
         "-H", f"x-api-key: {ANTHROPIC}", f"{base}/v1/messages"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    body, _, code = done.stdout.rpartition("\n")
    assert code == "403" and json.loads(body)["rule"] == RULE_MISDIRECTED
    assert plain_host.received == []  # nothing reached the other host
    # On the provider's route the same header gets the appliance's key instead.
    reverse = subprocess.run(
        ["curl", "-sS", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code}",
         "-H", f"x-api-key: {ANTHROPIC}", "-H", "content-type: application/json",
         "-d", '{"model":"m","max_tokens":1,"messages":[]}',
         f"http://127.0.0.1:{proxy.port}/anthropic/v1/messages"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert reverse.stdout == "200", reverse.stdout + reverse.stderr
    assert provider.last().header("x-api-key") == REAL_KEYS["anthropic"]
    denied = [e for e in proxy.events() if isinstance(e, RequestDenied)]
    assert [e.rule for e in denied] == [RULE_MISDIRECTED]
