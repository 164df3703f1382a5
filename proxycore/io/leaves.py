"""The leaf certificates a worker presents to a crew when it terminates the crew's TLS.

Theory of operation: a worker terminates a crew's CONNECT tunnel to a host only when it holds a
leaf for that host, signed by the crew's own CA (appliance/crew_ca.py), which only that crew
trusts. applianced mints the leaves and keeps the CA key; the worker receives certificate and
key (the proxy config's `[[crew.leaves]]` files, or the `CrewLeaves` control message) and builds
one server `ssl.SSLContext` per (crew, host) as they arrive, never per connection: a context is
what costs (parsing the key, OpenSSL's tables), a handshake only uses it.

`ssl` loads a certificate chain from a path only, and a control message's PEM must not touch a
disk, so it is written to an anonymous memory file (`memfd_create`) and loaded through
/proc/self/fd: the kernel lets a process open its own descriptors there even when it is not
dumpable and runs under another UID, which is the case after the privilege drop.

Every context: TLS 1.2 or later; ALPN offers "h2" and "http/1.1", honestly: what the terminated
tunnel speaks (an agent that selects h2 gets the proxy's HTTP/2 session, proxycore/io/http2.py;
one that selects http/1.1, or offers no ALPN, the HTTP/1.1 request loop); OpenSSL's default
server ciphers.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterable

from proxycore.config import MAX_LEAVES, LeafConfig
from proxycore.errors import ConfigError, PolicyDenied
from proxycore.protocol.policy import normalize_host

__all__ = ["MAX_LEAVES", "LeafError", "leaf_context", "load_leaves", "read_leaf_files"]

# The server picks by its own order when the client offers both: HTTP/2 first.
ALPN = ("h2", "http/1.1")


class LeafError(ValueError):
    """A leaf that cannot be used; the message names the host, never the key."""


def leaf_context(host: str, cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A server context presenting `cert_pem` (with its chain, if any) and `key_pem`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # TLS 1.2 renegotiation started by the client costs the server a handshake each time, and
    # nothing here needs it.
    context.options |= ssl.OP_NO_RENEGOTIATION
    context.set_alpn_protocols(list(ALPN))
    cert_fd = _memory_file("leaf-cert", cert_pem)
    key_fd = _memory_file("leaf-key", key_pem)
    try:
        # An empty password: an encrypted key fails at once instead of OpenSSL asking for a
        # passphrase on a terminal the worker does not have.
        context.load_cert_chain(f"/proc/self/fd/{cert_fd}", f"/proc/self/fd/{key_fd}", password=b"")
    except (ssl.SSLError, OSError) as exc:
        # ssl's messages name the failing step ("KEY_VALUES_MISMATCH", "PEM lib"), never the
        # key's bytes; the reason only, to be sure.
        reason = getattr(exc, "reason", None) or type(exc).__name__
        raise LeafError(f"leaf for {host}: certificate and key unusable ({reason})") from None
    finally:
        os.close(cert_fd)
        os.close(key_fd)
    return context


def _memory_file(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_leaves(
    leaves: Iterable[tuple[str, bytes, bytes]], *, source: str
) -> dict[str, ssl.SSLContext]:
    """(host, cert PEM, key PEM) -> a context per normalized host, all or nothing: LeafError
    naming `source` and the host for the first unusable one."""
    contexts: dict[str, ssl.SSLContext] = {}
    for raw_host, cert_pem, key_pem in leaves:
        try:
            host = normalize_host(raw_host)
        except PolicyDenied:
            raise LeafError(f"{source}: not a valid host: {raw_host!r}") from None
        if host in contexts:
            raise LeafError(f"{source}: a second leaf for {host}")
        if len(contexts) >= MAX_LEAVES:
            raise LeafError(f"{source}: over {MAX_LEAVES} leaves")
        try:
            contexts[host] = leaf_context(host, cert_pem, key_pem)
        except LeafError as exc:
            raise LeafError(f"{source}: {exc}") from None
    return contexts


def read_leaf_files(leaves: Iterable[LeafConfig], *, source: str) -> dict[str, ssl.SSLContext]:
    """The config's leaves (files read now, before the privilege drop); ConfigError naming the
    file or the host."""
    loaded: list[tuple[str, bytes, bytes]] = []
    for leaf in leaves:
        try:
            with open(leaf.cert_file, "rb") as cert, open(leaf.key_file, "rb") as key:
                loaded.append((leaf.host, cert.read(), key.read()))
        except OSError as exc:
            raise ConfigError(
                f"{source}: leaf for {leaf.host}: cannot read {exc.filename}: {exc.strerror}"
            ) from None
    try:
        return load_leaves(loaded, source=source)
    except LeafError as exc:
        raise ConfigError(str(exc)) from None
