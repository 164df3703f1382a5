"""The transports of a context (docs/hosts.md): mutual TLS to an applianced's TLS admin
listener, and OpenSSH forwarding a remote admin socket to a local one.

Both end in what http.request already speaks: an `http.Endpoint` whose connect() returns a
connected socket (TLS), or a local Unix socket path (SSH), so the admin client, `run`'s
session and `events -f` are the same code on every host.

Failures are `ContextError` (a usage problem: a file or key of the context, exit 2) or
`http.Unreachable` (the endpoint did not answer or refused us, exit 5); never a traceback.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from typing import Any

from . import exits, http
from .errors import CtlError


class ContextError(CtlError):
    def __init__(self, message: str) -> None:
        super().__init__(message, exits.USAGE, "context")


def split_address(text: str) -> tuple[str, int]:
    """("host", 9443) from "host:9443", ("::1", 9443) from "[::1]:9443"; ValueError else."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT (a port from 1 to 65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def client_tls_context(ca_file: str, cert_file: str, key_file: str, *, where: str) -> Any:
    """TLS 1.3 only (RFC 8446), the daemon's certificate checked against `ca_file` and its
    name, ours presented from cert_file/key_file. A file that cannot be used is a ContextError
    naming `where` (the context file and key)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED, check_hostname
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        context.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ContextError(f"{where}.ca_file: cannot use {ca_file}: {_why(exc)}") from None
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ContextError(
            f"{where}.cert_file/key_file: cannot use {cert_file} with {key_file}: {_why(exc)}"
        ) from None
    return context


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


class TlsEndpoint(http.Endpoint):
    """An applianced's `[admin_tls]` listener: TCP, then a TLS 1.3 handshake with our client
    certificate. The daemon checks ours against its client CA; we check its certificate against
    `ca_file` and `server_name` (default: the address's host)."""

    def __init__(
        self,
        address: str,
        ca_file: str,
        cert_file: str,
        key_file: str,
        server_name: str | None = None,
        *,
        where: str,
    ) -> None:
        try:
            self.host, self.port = split_address(address)
        except ValueError as exc:
            raise ContextError(f"{where}.address: {exc}") from None
        self.server_name = server_name or self.host
        self.context = client_tls_context(ca_file, cert_file, key_file, where=where)
        self.label = f"tls://{address}"

    def connect(self, timeout: float | None) -> Any:
        # The connect and the handshake within CONNECT_TIMEOUT (a host that is down or
        # filtered must not hold a command for the request's own, longer, timeout), then the
        # request's timeout (None: `events -f`, which waits as long as it must).
        first = CONNECT_TIMEOUT if timeout is None else min(timeout, CONNECT_TIMEOUT)
        try:
            raw = socket.create_connection((self.host, self.port), timeout=first)
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
            raise http.Unreachable(f"applianced is not answering on {self.label}: {why}") from None
        try:
            tls = self.context.wrap_socket(raw, server_hostname=self.server_name)
            tls.settimeout(timeout)
            return tls
        except ssl.SSLCertVerificationError as exc:
            raw.close()
            raise http.Unreachable(
                f"{self.label}: the daemon's certificate does not verify: "
                f"{exc.verify_message or exc.reason}"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            raise http.Unreachable(f"{self.label}: TLS handshake failed: {_why(exc)}") from None


# -- SSH ----------------------------------------------------------------------------------------

# Why OpenSSH's Unix-socket forwarding (`-L LOCAL.sock:REMOTE.sock`, OpenSSH >= 6.7, ssh(1)):
# the remote end needs nothing but sshd (no socat, no shell command), our client keeps speaking
# to a Unix socket exactly as on the host itself (run sessions, event streams), and every
# connection is a channel of one authenticated SSH connection. Options placed first win
# (ssh_config(5): "the first obtained value will be used"), so a user's ssh_config or -o
# cannot undo these:
FORCED_SSH_OPTIONS = (
    # Our own connection, never a ControlMaster's: a master (ControlMaster auto with
    # ControlPersist) would own the forward and keep the local socket after we exit, may have
    # logged in as someone else, and ExitOnForwardFailure would not apply to it.
    "ControlMaster=no",
    "ControlPath=none",
    # No prompt can hang a command: keys or an agent only; an unknown host key fails.
    "BatchMode=yes",
    # Exit at once (and say why) if the forward cannot be set up, rather than run without it.
    "ExitOnForwardFailure=yes",
    # The local socket: a fresh path in our 0700 directory, born 0600 (a stale one replaced).
    "StreamLocalBindUnlink=yes",
    "StreamLocalBindMask=0177",
    # The remote host learns nothing of ours: no agent, no X11, no local command.
    "ForwardAgent=no",
    "ForwardX11=no",
    "PermitLocalCommand=no",
    "RequestTTY=no",
    # A dead peer is noticed (45 s) instead of a command hanging forever.
    "ServerAliveInterval=15",
    "ServerAliveCountMax=3",
)
SSH_READY_TIMEOUT = 30.0
CONNECT_TIMEOUT = 15.0


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when appliancectl dies, however it dies
    (prctl(2) PR_SET_PDEATHSIG), so no tunnel outlives its command; and a session of its own,
    so that Ctrl-C meant for a `run` reaches the crew, not the tunnel."""
    os.setsid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ForwardedSocket(http.Endpoint):
    """The tunnel's local socket, named in messages by what it reaches (ssh://HOST/PATH), not
    by its temporary path."""

    # The local end accepts whatever the far end does: a closed or reset connection is sshd
    # failing to reach the socket there, or refusing to forward it.
    hint = (
        " (sshd there could not connect to the admin socket: is the path right, applianced "
        "running, and may this login forward a Unix socket? docs/hosts.md)"
    )

    def __init__(self, path: str, label: str) -> None:
        self.path = path
        self.label = label

    def connect(self, timeout: float | None) -> Any:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            why = exc.strerror or str(exc) or type(exc).__name__
            raise http.Unreachable(f"applianced is not answering on {self.label}: {why}") from None
        return sock


class SshTunnel:
    """`ssh -N -L <tmp>/admin.sock:<remote socket> DEST` for the life of this appliancectl; its
    local path is the endpoint. The remote login must be allowed to connect to the admin socket
    (root, or applianced's own user: SO_PEERCRED there sees sshd's process for that login)."""

    def __init__(
        self,
        destination: str,
        remote_socket: str,
        *,
        port: int | None = None,
        identity_file: str | None = None,
        options: tuple[str, ...] = (),
        ssh_command: str = "ssh",
        where: str,
    ) -> None:
        self.destination = destination
        self.remote_socket = remote_socket
        self.port = port
        self.identity_file = identity_file
        self.options = options
        self.ssh_command = ssh_command
        self.where = where
        self.process: subprocess.Popen[bytes] | None = None
        self.directory: str | None = None

    def argv(self, local: str) -> list[str]:
        argv = [self.ssh_command, "-N", "-T"]
        for option in FORCED_SSH_OPTIONS:
            argv += ["-o", option]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file:
            argv += ["-i", self.identity_file, "-o", "IdentitiesOnly=yes"]
        for option in self.options:
            argv += ["-o", option]
        return [*argv, "-L", f"{local}:{self.remote_socket}", "--", self.destination]

    def open(self) -> ForwardedSocket:
        """Start the tunnel; its local socket once it accepts. `Unreachable` with ssh's own
        words when ssh exits first (refused, host key, authentication, forward refused)."""
        if shutil.which(self.ssh_command) is None:
            raise ContextError(
                f"{self.where}: {self.ssh_command!r} not found (install openssh-client)"
            )
        self.directory = tempfile.mkdtemp(prefix="appliancectl-ssh-")  # 0700
        local = os.path.join(self.directory, "admin.sock")
        errors = open(os.path.join(self.directory, "ssh.stderr"), "w+b")  # noqa: SIM115
        atexit.register(self.close)
        self.process = subprocess.Popen(
            self.argv(local),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            preexec_fn=_die_with_parent,  # before any thread of ours: fork-safe
        )
        label = f"ssh://{self.destination}{self.remote_socket}"
        deadline = time.monotonic() + SSH_READY_TIMEOUT
        while True:
            if self.process.poll() is not None:
                errors.seek(0)
                said = errors.read().decode("utf-8", "replace").strip().splitlines()
                errors.close()
                self.close()
                why = " | ".join(said[-3:]) or f"ssh exited with {self.process.returncode}"
                raise http.Unreachable(f"{label}: ssh failed: {why}")
            if os.path.exists(local):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(local)
                    break
                except OSError:
                    pass
                finally:
                    probe.close()
            if time.monotonic() > deadline:
                errors.close()
                self.close()
                raise http.Unreachable(
                    f"{label}: ssh did not forward within {SSH_READY_TIMEOUT:g} s"
                )
            time.sleep(0.02)
        errors.close()
        return ForwardedSocket(local, label)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
