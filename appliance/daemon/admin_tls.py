"""The admin API's TLS listener (`[admin_tls]`, off by default): mutual TLS over TCP, so that
`appliancectl --context` reaches this applianced from another machine (docs/hosts.md).

TLS 1.3 only (RFC 8446): no version or cipher negotiation to get wrong, and the client's
certificate travels encrypted. The client must present a certificate that `client_ca_file`
signed (ssl.CERT_REQUIRED); that certificate is the only credential, so the CA should be one
made for this purpose, not a public or company-wide one. Each connection's certificate subject
is logged with its address.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

from .config import AdminTlsSection

log = logging.getLogger("applianced.api")

HANDSHAKE_TIMEOUT = 10.0


class TlsSetupError(Exception):
    """A file of [admin_tls] that cannot be used; `key` names the config key."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key
        self.reason = reason


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc)
    if isinstance(exc, OSError):
        return str(exc.strerror or exc)
    return str(exc)


def server_context(section: AdminTlsSection) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_cert_chain(section.cert_file, section.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsSetupError(
            "admin_tls.cert_file",
            f"cannot use {section.cert_file} with {section.key_file}: {_why(exc)}",
        ) from None
    try:
        context.load_verify_locations(cafile=section.client_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise TlsSetupError(
            "admin_tls.client_ca_file", f"cannot use {section.client_ca_file}: {_why(exc)}"
        ) from None
    return context


def peer_subject(certificate: Any) -> str:
    """Who a client certificate names, for the log: its subject's common and organization
    names and its subjectAltName entries (ssl's decoded form, SSLSocket.getpeercert())."""
    if not certificate:
        return "?"
    parts = [
        f"{name}={value}"
        for rdn in certificate.get("subject", ())
        for name, value in rdn
        if name in ("commonName", "organizationName")
    ]
    parts += [f"{kind}:{value}" for kind, value in certificate.get("subjectAltName", ())]
    return ", ".join(parts) or "?"
