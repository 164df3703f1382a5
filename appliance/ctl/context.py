"""What a command talks to: the admin socket (and the config that may name it), and the
errors a command raises for main.py to turn into an exit code."""

from __future__ import annotations

import argparse
import os
from typing import Any

from . import exits
from .http import DEFAULT_ADMIN_SOCKET

DEFAULT_CONFIG = "/etc/agent-appliance/appliance.toml"


class CtlError(Exception):
    """A failure the command reports (one line) with an exit code of exits.py."""

    def __init__(self, message: str, code: int = exits.FAILURE, kind: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.kind = kind


class UsageError(CtlError):
    def __init__(self, message: str) -> None:
        super().__init__(message, exits.USAGE, "usage")


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
    """--socket, else $APPLIANCECTL_SOCKET, else the config's admin_socket, else the default."""
    if getattr(args, "socket", None):
        return str(args.socket)
    env = os.environ.get("APPLIANCECTL_SOCKET")
    if env:
        return env
    if config_path(args) is not None:
        try:
            return str(daemon_config(args).daemon.admin_socket)
        except CtlError:
            pass  # the default below is as good an answer; `up` reports the config's error
    return DEFAULT_ADMIN_SOCKET


def client(args: argparse.Namespace, timeout: float | None = 600.0) -> Any:
    """The typed admin client (client.py) on the command's socket."""
    from .client import AdminClient

    return AdminClient(socket_path(args), timeout=timeout)
