"""What a command talks to: its context (a local admin socket, and the config that may name
it; or a remote applianced: contexts.py, transport.py), and the errors a command raises for
main.py to turn into an exit code."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .errors import CtlError, UsageError
from .http import DEFAULT_ADMIN_SOCKET

__all__ = ["CtlError", "UsageError", "client", "endpoint", "selected", "socket_path"]

DEFAULT_CONFIG = "/etc/agent-appliance/appliance.toml"


def config_path(args: argparse.Namespace) -> str | None:
    path = getattr(args, "config", None)
    if path is None and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    return path


def daemon_config(args: argparse.Namespace) -> Any:
    """applianced's configuration (appliance/daemon/config.py); a bad one is a usage error."""
    from appliance.daemon.config import load_config

    try:
        return load_config(config_path(args))
    except Exception as exc:  # ConfigInvalid, OSError, a file that is not UTF-8 or TOML
        raise UsageError(str(exc) or type(exc).__name__) from None


def socket_path(args: argparse.Namespace) -> str:
    """The local admin socket: --socket, else $APPLIANCECTL_SOCKET, else the config's
    admin_socket, else the default."""
    if getattr(args, "socket", None):
        return str(args.socket)
    env = os.environ.get("APPLIANCECTL_SOCKET")
    if env:
        return env
    return _configured_socket(args)


def _configured_socket(args: argparse.Namespace) -> str:
    if config_path(args) is not None:
        try:
            return str(daemon_config(args).daemon.admin_socket)
        except CtlError:
            pass  # the default below is as good an answer; `up` reports the config's error
    return DEFAULT_ADMIN_SOCKET


def selected(args: argparse.Namespace) -> tuple[str, str]:
    """(context name, why it was chosen): contexts.selected."""
    from . import contexts

    return contexts.selected(args)


def endpoint(args: argparse.Namespace) -> Any:
    """Where the command's admin requests go (http.request's `path`): a local socket path, a
    socket forwarded over SSH, or a TLS endpoint; resolved once per command line."""
    cached = getattr(args, "_endpoint", None)
    if cached is not None:
        return cached
    from . import contexts

    name, _ = selected(args)
    if name != contexts.DEFAULT:
        args._context_name = name  # main.py names it in an "unreachable" message
    if name == contexts.DEFAULT:
        found: Any = socket_path(args)
    else:
        found = open_context(contexts.load(), name)
    args._endpoint = found
    return found


def open_context(store: Any, name: str) -> Any:
    """A stored context made usable: a TlsEndpoint, an SSH tunnel's local socket, a path."""
    from . import contexts, transport

    contexts.check_name(name, where="context")
    context = store.get(name)
    where = f"{store.path}: `contexts.{name}"
    kind = context["type"]
    if kind == "unix":
        return str(context["socket"])
    if kind == "tls":
        for key in ("ca_file", "cert_file", "key_file"):
            if not os.path.isfile(context[key]):
                raise transport.ContextError(f"{where}.{key}`: {context[key]}: no such file")
        return transport.TlsEndpoint(
            context["address"],
            context["ca_file"],
            context["cert_file"],
            context["key_file"],
            context.get("server_name"),
            where=f"{where}`",
        )
    identity = context.get("identity_file")
    if identity is not None and not os.path.isfile(identity):
        raise transport.ContextError(f"{where}.identity_file`: {identity}: no such file")
    tunnel = transport.SshTunnel(
        context["destination"],
        context.get("socket", DEFAULT_ADMIN_SOCKET),
        port=context.get("port"),
        identity_file=identity,
        options=tuple(context.get("ssh_options", ())),
        where=f"{where}`",
    )
    return tunnel.open()


def client(args: argparse.Namespace, timeout: float | None = 600.0) -> Any:
    """The typed admin client (client.py) on the command's endpoint (its context)."""
    from .client import AdminClient

    return AdminClient(endpoint(args), timeout=timeout)
