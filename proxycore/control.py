"""Typed messages from the control plane to the data plane.

The privileged side (applianced, or the `appliancectl proxy` supervisor) sends these to a proxy
over a Unix socket or a socketpair, one JSON object per line; the proxy answers each with a
`ControlReply`. They are defined here, on the data-plane side, so the unprivileged proxy never
imports the control plane (see docs/architecture.md).
"""

from __future__ import annotations

import msgspec


class AllowHost(msgspec.Struct, frozen=True, tag="allow_host", forbid_unknown_fields=True):
    """Add an exact host to a crew's allowlist at run time."""

    crew: str
    host: str


class Ping(msgspec.Struct, frozen=True, tag="ping", forbid_unknown_fields=True):
    pass


class ReloadCredentials(
    msgspec.Struct, frozen=True, tag="reload_credentials", forbid_unknown_fields=True
):
    """Read the provider credentials again (rotated or added) and recompile the scrubber."""


ControlMessage = AllowHost | Ping | ReloadCredentials


class ControlReply(msgspec.Struct, frozen=True, omit_defaults=True):
    ok: bool
    changed: bool = False
    error: str | None = None


message_decoder = msgspec.json.Decoder(ControlMessage)
reply_decoder = msgspec.json.Decoder(ControlReply)
encoder = msgspec.json.Encoder()
