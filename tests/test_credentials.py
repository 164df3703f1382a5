"""Credential injection rules, table-driven (the end-to-end checks are in test_proxy_modes)."""

from __future__ import annotations

import pytest

from proxycore.protocol.credentials import (
    Credential,
    Provider,
    rewrite_for_provider,
    route_for,
)

AGENT = [
    (b"authorization", b"Bearer agent"),
    (b"x-api-key", b"agent"),
    (b"api-key", b"agent"),
    (b"x-goog-api-key", b"agent"),
    (b"proxy-authorization", b"Basic agent"),
    (b"cookie", b"s=agent"),
    (b"content-type", b"application/json"),
]


def rewrite(provider: Provider, key: str | None, target: bytes = b"/v1/x"):
    route = route_for("https://h.test", provider, Credential(key) if key else None)
    return rewrite_for_provider(route, target, AGENT)


def test_anthropic_api_key() -> None:
    target, headers, injected = rewrite(Provider.ANTHROPIC, "sk-ant-api03-k")
    assert injected and target == b"/v1/x"
    assert headers == [
        (b"content-type", b"application/json"),
        (b"x-api-key", b"sk-ant-api03-k"),
        (b"anthropic-version", b"2023-06-01"),
    ]


def test_anthropic_oauth_token_is_a_bearer() -> None:
    _, headers, _ = rewrite(Provider.ANTHROPIC, "sk-ant-oat01-token")
    assert (b"authorization", b"Bearer sk-ant-oat01-token") in headers
    assert not [h for h in headers if h[0] == b"x-api-key"]


def test_openai_bearer() -> None:
    _, headers, _ = rewrite(Provider.OPENAI, "sk-proj-k")
    assert [v for n, v in headers if n == b"authorization"] == [b"Bearer sk-proj-k"]
    assert all(v != b"agent" and b"agent" not in v for _, v in headers)


@pytest.mark.parametrize(
    "query", [b"key=agent", b"k%65y=agent", b"KEY=x&key=agent&key=again", b"alt=json&key=agent"]
)
def test_google_key_replaces_every_agent_key(query: bytes) -> None:
    target, headers, injected = rewrite(Provider.GOOGLE, "AIzaSyK", b"/v1/m:gen?" + query)
    params = target.split(b"?", 1)[1].split(b"&")
    assert b"key=AIzaSyK" in params
    assert not [p for p in params if p.endswith(b"=agent") or p.endswith(b"=again")]
    assert injected and not [h for h in headers if h[0] == b"x-goog-api-key"]


def test_no_credential_still_strips_agent_credentials() -> None:
    _, headers, injected = rewrite(Provider.OPENAI, None)
    assert not injected
    assert headers == [(b"content-type", b"application/json")]


@pytest.mark.parametrize("bad", ["", "a\r\nx-evil: 1", "k\x00", "ключ"])
def test_credential_refuses_header_injection_and_hides_value(bad: str) -> None:
    with pytest.raises(ValueError) as caught:
        Credential(bad)
    assert bad not in str(caught.value) or bad == ""


def test_credential_repr_is_redacted() -> None:
    credential = Credential("sk-ant-api03-secret")
    assert "secret" not in repr(credential) and "secret" not in str(credential)
    assert "secret" not in repr(route_for("https://h.test", Provider.ANTHROPIC, credential))
