"""Credential injection by provider host.

Theory of operation: a provider is recognised only by an exact match of the upstream host with
the host of its configured base URL (`api.anthropic.com` by default); no suffix, no pattern. For a
request bound to a provider, `rewrite_for_provider` first removes every header through which the
agent could present (or smuggle) a credential of its own, then adds the appliance's credential in
the provider's scheme:

| provider            | scheme                                                        |
|---------------------|---------------------------------------------------------------|
| Anthropic API key   | `x-api-key: KEY` and `anthropic-version: 2023-06-01` if absent |
| Anthropic OAuth     | `authorization: Bearer TOKEN` (recognised by `sk-ant-oat`)      |
| OpenAI              | `authorization: Bearer KEY`                                    |
| Google              | `key=KEY` query parameter (any `key` the agent sent is dropped) |

The caller guarantees the upstream connection is TLS with a verified certificate for that very
host; injection never happens on a tunnel (opaque) or on a plain-text upstream. The proxy does not
follow redirects, so a credential can never be carried to another host by one: the agent's client
follows the redirect as a new request, which gets injection only if it again matches exactly.

`Credential` keeps its value out of `repr` and `str` so it cannot reach a log by accident.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from proxycore.errors import ConfigError


class Provider(enum.Enum):
    ANTHROPIC = "anthropic"
    OPENAI = "openai"
    GOOGLE = "google"


ANTHROPIC_VERSION = b"2023-06-01"
ANTHROPIC_OAUTH_PREFIX = "sk-ant-oat"

# Headers through which an agent could present a credential to a provider. All are removed before
# ours is added, so the upstream sees exactly one credential: the appliance's.
CREDENTIAL_HEADERS = frozenset(
    {
        b"authorization",
        b"proxy-authorization",
        b"x-api-key",
        b"api-key",
        b"x-goog-api-key",
        b"cookie",
    }
)


class Credential:
    """A secret value whose repr never shows it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not value or any(c in value for c in "\r\n\0") or not value.isascii():
            # Naming the problem, never the value.
            raise ValueError("credential is empty or holds characters not allowed in a header")
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Credential(<redacted>)"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class ProviderRoute:
    provider: Provider
    host: str  # normalized host of the base URL: the exact-match key
    port: int
    path_prefix: str  # base URL path without trailing slash ("" for the root)
    credential: Credential | None


def load_credential(name: str, env: str | None, file: str | None) -> Credential | None:
    """Read a provider credential from the environment or a file; errors name the key only."""
    value: str | None = None
    if env:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"`providers.{name}.credential_env`: variable {env} is not set")
    elif file:
        try:
            value = Path(file).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"`providers.{name}.credential_file`: cannot read {file}: {exc.strerror}"
            ) from None
    if value is None:
        return None
    try:
        return Credential(value.strip())
    except ValueError as exc:
        raise ConfigError(f"`providers.{name}`: {exc}") from None


def route_for(base_url: str, provider: Provider, credential: Credential | None) -> ProviderRoute:
    parsed = urllib.parse.urlsplit(base_url)
    assert parsed.hostname is not None  # checked by config.validate
    return ProviderRoute(
        provider=provider,
        host=parsed.hostname.lower(),
        port=parsed.port or 443,
        path_prefix=parsed.path.rstrip("/"),
        credential=credential,
    )


def rewrite_for_provider(
    route: ProviderRoute, target: bytes, headers: Iterable[tuple[bytes, bytes]]
) -> tuple[bytes, list[tuple[bytes, bytes]], bool]:
    """Strip agent credentials and inject ours. Returns (target, headers, injected)."""
    out = [(name, value) for name, value in headers if name not in CREDENTIAL_HEADERS]
    credential = route.credential
    if route.provider is Provider.GOOGLE:
        target = _replace_query_key(target, credential.reveal() if credential else None)
    if credential is None:
        return target, out, False
    secret = credential.reveal().encode("ascii")
    if route.provider is Provider.ANTHROPIC:
        if credential.reveal().startswith(ANTHROPIC_OAUTH_PREFIX):
            out.append((b"authorization", b"Bearer " + secret))
        else:
            out.append((b"x-api-key", secret))
        if not any(name == b"anthropic-version" for name, _ in out):
            out.append((b"anthropic-version", ANTHROPIC_VERSION))
    elif route.provider is Provider.OPENAI:
        out.append((b"authorization", b"Bearer " + secret))
    return target, out, True


def _replace_query_key(target: bytes, key: str | None) -> bytes:
    """Drop every `key` parameter the agent sent and append ours (if we hold one)."""
    path, sep, query = target.partition(b"?")
    # Compare decoded names: `k%65y=...` is the same parameter to the upstream.
    kept = [
        p
        for p in (query.split(b"&") if sep else [])
        if p and urllib.parse.unquote_to_bytes(p.split(b"=", 1)[0]) != b"key"
    ]
    if key is not None:
        kept.append(b"key=" + urllib.parse.quote(key, safe="").encode("ascii"))
    return path + (b"?" + b"&".join(kept) if kept else b"")


@dataclass(frozen=True, slots=True)
class Routes:
    """The provider routes (by path segment and by exact host) and the store's credentials."""

    by_name: Mapping[bytes, ProviderRoute]
    by_host: Mapping[str, ProviderRoute]
    # crew name -> provider -> credential (applianced's store); precedes the route's own.
    crew_credentials: Mapping[str, Mapping[Provider, Credential]]

    def for_crew(self, route: ProviderRoute, crew: str) -> ProviderRoute:
        credential = self.crew_credentials.get(crew, {}).get(route.provider)
        if credential is None:
            return route
        return dataclasses.replace(route, credential=credential)
