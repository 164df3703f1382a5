"""Placeholder credentials: what a crew holds instead of a key, and where it may go (sans-IO).

Theory of operation
-------------------
The agent CLIs and SDKs refuse to start without a key of their own, so each crew's environment
holds a *placeholder* per provider (`ANTHROPIC_API_KEY=appliance-placeholder-anthropic-<crew>`),
never a credential. The proxy never forwards a placeholder as a key: on a request bound to the
provider's own host (the reverse route, or a forward request to the exact provider host) it
removes every credential field the agent sent and injects the appliance's credential
(`proxycore.protocol.credentials`), so the placeholder is replaced there.

Anywhere else a placeholder means the agent's client sends what it takes for its provider key to
another host: a base URL pointed elsewhere (`ANTHROPIC_BASE_URL=https://collector.example`), a
tool that copies keys around. The request is refused (403, rule `placeholder_misdirected`) and
journaled, naming the provider whose placeholder it was, before anything is dialled. A real key
would be a leak; a placeholder is not one, so this is a tripwire that makes the misdirection
visible, not a secrecy boundary (the real credential never enters the crew).

The value names its provider and its crew, so a refusal says whose it was. It is not secret: a
crew that knows another crew's name can spell that crew's placeholder, which gets it nothing
but the same refusal. It avoids every provider's key prefix (`sk-ant-`, `sk-`, `AIza`), so the
scrubber's key shapes leave it alone when an upstream echoes it.

What is looked at: the request head (its target and every field), where clients put keys. A
placeholder in a request body, or inside an opaque CONNECT tunnel, is not seen.
"""

from __future__ import annotations

import re

from proxycore.protocol.credentials import Provider

__all__ = ["PLACEHOLDER_PREFIX", "RULE_MISDIRECTED", "misdirected_placeholder", "placeholder"]

RULE_MISDIRECTED = "placeholder_misdirected"
PLACEHOLDER_PREFIX = b"appliance-placeholder-"
# Crew names are [a-z0-9-] (applianced) but a config file's may be any string: the value keeps
# only characters that are safe in a header and a URL.
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_FOUND = re.compile(rb"appliance-placeholder-(anthropic|openai|google)-")


def placeholder(provider: Provider, crew: str) -> str:
    """The placeholder crew `crew` holds for `provider`'s key."""
    return f"{PLACEHOLDER_PREFIX.decode()}{provider.value}-{_UNSAFE.sub('-', crew)[:64]}"


def misdirected_placeholder(raw_head: bytes, destination: Provider | None) -> Provider | None:
    """The provider of a placeholder the head carries to a destination that is not that
    provider's route (`destination` None: not a provider host at all); None if there is none."""
    if PLACEHOLDER_PREFIX not in raw_head:  # one memmem: the common case costs nothing more
        return None
    for match in _FOUND.finditer(raw_head):
        provider = Provider(match.group(1).decode("ascii"))
        if provider is not destination:
            return provider
    return None
