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


class CredentialsSet(
    msgspec.Struct, frozen=True, tag="credentials_set", forbid_unknown_fields=True
):
    """Every crew's provider credentials from the credential store: crew -> provider -> value.

    The whole map each time (a crew or a provider missing from it has none from the store), so
    applying it is one swap and a lost message is repaired by the next. It travels only over the
    parent's socketpair (never a file, argv or the environment). The reply never echoes a value.
    A crew's credential from here takes precedence over the provider's configured one
    (`credential_env`/`credential_file`) for that crew's requests.
    """

    crews: dict[str, dict[str, str]]


class CrewAdd(msgspec.Struct, frozen=True, tag="crew_add", forbid_unknown_fields=True):
    """Serve a new crew from now on (applianced, when a crew is created or restored).

    With `listener` true, the message travels with one listening TCP socket (SCM_RIGHTS, in the
    same `sendmsg` as the line), bound by the privileged side on the crew's gateway: the proxy
    accepts on it and never binds anything itself. Without it, the crew's gateway must already
    be served by a listener the proxy has (`listen.addresses`).
    """

    name: str
    gateway: str
    mode: str | None = None
    allow: tuple[str, ...] = ()
    listener: bool = False


class CrewRemove(msgspec.Struct, frozen=True, tag="crew_remove", forbid_unknown_fields=True):
    """Stop serving a crew: its listener is closed and its open connections are ended."""

    name: str


class AuditPaused(msgspec.Struct, frozen=True, tag="audit_paused", forbid_unknown_fields=True):
    """The control plane's journal cannot keep up (`paused` true) or has caught up (false).

    While paused, every crew request is refused with 503 `audit_unavailable` before any policy
    decision or upstream connection: a crew's traffic is refused rather than left unaudited.
    """

    paused: bool


ControlMessage = (
    AllowHost | Ping | ReloadCredentials | CredentialsSet | CrewAdd | CrewRemove | AuditPaused
)


class ControlReply(msgspec.Struct, frozen=True, omit_defaults=True):
    ok: bool
    changed: bool = False
    error: str | None = None


message_decoder = msgspec.json.Decoder(ControlMessage)
reply_decoder = msgspec.json.Decoder(ControlReply)
encoder = msgspec.json.Encoder()
