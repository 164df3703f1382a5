"""Contexts: named applianced endpoints, as docker and kubectl have them (docs/hosts.md).

The store is one JSON file per user, `$XDG_CONFIG_HOME/agent-appliance/contexts.json`
(`~/.config/...` when XDG_CONFIG_HOME is unset or not absolute: the XDG Base Directory
Specification), written 0600 in a 0700 directory by `appliancectl context add/use/remove`:

    {
      "current": "host-a",
      "contexts": {
        "host-a": {"type": "tls", "address": "10.0.0.5:7443", "ca_file": "/abs/ca.pem",
                   "cert_file": "/abs/admin.pem", "key_file": "/abs/admin.key",
                   "server_name": "host-a.example.org", "description": "rack 1"},
        "host-b": {"type": "ssh", "destination": "root@host-b.example.org",
                   "socket": "/run/agent-appliance/admin.sock", "port": 22,
                   "identity_file": "/abs/id_ed25519", "ssh_options": ["ConnectTimeout=10"]},
        "lab":    {"type": "unix", "socket": "/run/lab/admin.sock"}
      }
    }

Nothing secret is in it: paths to the files that hold keys, never keys. It is refused (exit 2)
when it is not ours or group/world-writable: it decides where commands go and which key signs
in, as ssh refuses such a config (ssh_config(5), "FILES").

Which context a command uses: `--context NAME` (or `--socket`/`--config`: the local socket),
else $APPLIANCE_CONTEXT (or $APPLIANCECTL_SOCKET), else the file's `current`, else the local
default socket (`default`, the context that always exists and cannot be stored).
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import exits
from .errors import CtlError, UsageError

DEFAULT = "default"
ENV = "APPLIANCE_CONTEXT"
FILE_NAME = "contexts.json"
TYPES = ("tls", "ssh", "unix")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")

# Per type: key -> (required, python type). Anything else is an unknown key, named.
_KEYS: dict[str, dict[str, tuple[bool, type]]] = {
    "tls": {
        "address": (True, str),
        "ca_file": (True, str),
        "cert_file": (True, str),
        "key_file": (True, str),
        "server_name": (False, str),
    },
    "ssh": {
        "destination": (True, str),
        "socket": (False, str),
        "port": (False, int),
        "identity_file": (False, str),
        "ssh_options": (False, list),
    },
    "unix": {"socket": (True, str)},
}
_PATH_KEYS = ("ca_file", "cert_file", "key_file", "identity_file", "socket")


class ContextsError(CtlError):
    """A context that cannot be used: the message names the file, the context and the key."""

    def __init__(self, message: str, code: int = exits.USAGE) -> None:
        super().__init__(message, code, "context")


def store_path(env: dict[str, str] | None = None) -> Path:
    environ = os.environ if env is None else env
    base = environ.get("XDG_CONFIG_HOME", "")
    if not base or not os.path.isabs(base):  # the spec: a relative path is to be ignored
        base = os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "agent-appliance" / FILE_NAME


@dataclass
class Store:
    path: Path
    current: str
    contexts: dict[str, dict[str, Any]]

    def get(self, name: str) -> dict[str, Any]:
        context = self.contexts.get(name)
        if context is None:
            known = ", ".join([DEFAULT, *sorted(self.contexts)])
            raise ContextsError(
                f"no context {name!r} in {self.path} (known: {known})", exits.NOT_FOUND
            )
        return context

    def save(self) -> None:
        directory = self.path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        document = {"current": self.current, "contexts": self.contexts}
        text = json.dumps(document, indent=2, sort_keys=True) + "\n"
        # A new file (born 0600: mkstemp) renamed over the old one: never a half-written store.
        fd, temporary = tempfile.mkstemp(prefix=".contexts-", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def load(path: Path | None = None) -> Store:
    """The store (an empty one when the file does not exist); ContextsError names what is
    wrong in it."""
    path = store_path() if path is None else path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return Store(path, "", {})
    except OSError as exc:
        raise ContextsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if info.st_uid != os.geteuid():
            raise ContextsError(f"{path}: owned by uid {info.st_uid}, not by you: refused")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ContextsError(
                f"{path}: writable by others (mode {stat.S_IMODE(info.st_mode):04o}): refused; "
                f"chmod 600 {path}"
            )
        raw = file.read()
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ContextsError(f"{path}: not a JSON document: {exc}") from None
    if not isinstance(document, dict):
        raise ContextsError(f"{path}: must be a JSON object")
    unknown = set(document) - {"current", "contexts"}
    if unknown:
        raise ContextsError(f"{path}: unknown key `{sorted(unknown)[0]}`")
    current = document.get("current", "")
    if not isinstance(current, str):
        raise ContextsError(f"{path}: `current` must be a string")
    contexts = document.get("contexts", {})
    if not isinstance(contexts, dict):
        raise ContextsError(f"{path}: `contexts` must be an object")
    for name, context in contexts.items():
        check(name, context, where=f"{path}: `contexts.{name}")
    if current and current != DEFAULT and current not in contexts:
        raise ContextsError(f"{path}: `current` names {current!r}, which is not in `contexts`")
    return Store(path, "" if current == DEFAULT else current, dict(contexts))


def check_name(name: str, *, where: str) -> None:
    if not NAME.fullmatch(name):
        raise ContextsError(
            f"{where}: {name!r} is not a context name (1-63 letters, digits, '_', '.', '-', "
            "starting with a letter or digit)"
        )


def check(name: str, context: Any, *, where: str) -> None:
    """One stored context; `where` is "FILE: `contexts.NAME" (closed with the key)."""
    check_name(name, where=f"{where}`")
    if name == DEFAULT:
        raise ContextsError(f"{where}`: {DEFAULT!r} is the local socket and cannot be stored")
    if not isinstance(context, dict):
        raise ContextsError(f"{where}`: must be an object")
    kind = context.get("type")
    if kind not in TYPES:
        raise ContextsError(f"{where}.type`: must be one of {', '.join(TYPES)}, not {kind!r}")
    keys = _KEYS[kind]
    value: Any
    for key, value in context.items():
        if key in ("type", "description"):
            if not isinstance(value, str):
                raise ContextsError(f"{where}.{key}`: must be a string")
            continue
        if key not in keys:
            raise ContextsError(f"{where}.{key}`: unknown key for a {kind} context")
        expected: Any = keys[key][1]
        if not isinstance(value, expected) or isinstance(value, bool):
            raise ContextsError(f"{where}.{key}`: must be a {expected.__name__}")
        if key in _PATH_KEYS and not os.path.isabs(value):
            raise ContextsError(f"{where}.{key}`: must be an absolute path, not {value!r}")
        if key == "port" and not 1 <= value <= 65535:
            raise ContextsError(f"{where}.port`: must be from 1 to 65535")
        if key == "ssh_options" and not all(
            isinstance(o, str) and "=" in o and not o.startswith("-") for o in value
        ):
            raise ContextsError(f"{where}.ssh_options`: each must be a string KEY=VALUE")
        if key == "destination" and (not value or value.startswith("-")):
            raise ContextsError(f"{where}.destination`: must be [USER@]HOST, not {value!r}")
    for key, (required, _) in keys.items():
        if required and key not in context:
            raise ContextsError(f"{where}.{key}`: missing (a {kind} context needs it)")
    if kind == "tls":
        from .transport import split_address

        try:
            split_address(context["address"])
        except ValueError as exc:
            raise ContextsError(f"{where}.address`: {exc}") from None


def selected(args: Any) -> tuple[str, str]:
    """(context name, why it was chosen), in the documented order (docs/hosts.md): the flags
    (--context; or --socket/--config, which name the local socket), the environment
    ($APPLIANCE_CONTEXT; or $APPLIANCECTL_SOCKET), the store's `current`, the local default.
    Two choices at one level are refused rather than one silently winning."""
    flag = getattr(args, "context", None)
    local_flags = [f for f in ("socket", "config") if getattr(args, f, None)]
    if flag is not None:
        if local_flags:
            raise UsageError(
                f"argument --context: not with --{local_flags[0]} (both choose the endpoint)"
            )
        return flag, "--context"
    if local_flags:
        return DEFAULT, f"--{local_flags[0]}"
    env = os.environ.get(ENV)
    if env:
        if os.environ.get("APPLIANCECTL_SOCKET"):
            raise UsageError(
                f"${ENV} and $APPLIANCECTL_SOCKET are both set (both choose the "
                "endpoint): unset one"
            )
        return env, f"${ENV}"
    if os.environ.get("APPLIANCECTL_SOCKET"):
        return DEFAULT, "$APPLIANCECTL_SOCKET"
    store = load()
    if store.current:
        return store.current, f"current in {store.path}"
    return DEFAULT, "no context chosen"


def endpoint_text(context: dict[str, Any]) -> str:
    """What a context points at, for `context list` and messages."""
    kind = context["type"]
    if kind == "tls":
        return f"tls://{context['address']}"
    if kind == "ssh":
        from .http import DEFAULT_ADMIN_SOCKET

        port = f":{context['port']}" if "port" in context else ""
        return f"ssh://{context['destination']}{port}{context.get('socket', DEFAULT_ADMIN_SOCKET)}"
    return f"unix://{context['socket']}"


# -- `appliancectl context ...` -------------------------------------------------------------------


def _row(name: str, context: dict[str, Any], current: str) -> dict[str, Any]:
    return {
        "name": name,
        "current": name == (current or DEFAULT),
        "type": context["type"],
        "endpoint": endpoint_text(context),
        "description": context.get("description", ""),
    }


def _default_row(current: str) -> dict[str, Any]:
    from .http import DEFAULT_ADMIN_SOCKET

    return {
        "name": DEFAULT,
        "current": not current,
        "type": "unix",
        "endpoint": "unix://" + DEFAULT_ADMIN_SOCKET,
        "description": "this host (--socket, --config, $APPLIANCECTL_SOCKET, the config's)",
    }


def cmd_list(args: Any, out: Any) -> int:
    store = load()
    rows = [_default_row(store.current)] + [
        _row(name, store.contexts[name], store.current) for name in sorted(store.contexts)
    ]

    def human(wide: bool) -> str:
        table = [("NAME", "TYPE", "ENDPOINT", "DESCRIPTION")] + [
            (r["name"] + (" *" if r["current"] else ""), r["type"], r["endpoint"], r["description"])
            for r in rows
        ]
        widths = [max(len(line[i]) for line in table) for i in range(3)]
        return "\n".join(
            (
                "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False))
                + "  "
                + line[3]
            ).rstrip()
            for line in table
        )

    out.emit(
        {"ok": True, "file": str(store.path), "contexts": rows}, human, [r["name"] for r in rows]
    )
    return exits.OK


def cmd_show(args: Any, out: Any) -> int:
    store = load()
    if args.name:
        name, why = args.name, "named"
    else:
        name, why = selected(args)
    check_name(name, where="argument NAME")
    row = (
        _default_row(store.current)
        if name == DEFAULT
        else _row(name, store.get(name), store.current)
    )
    stored = {} if name == DEFAULT else dict(store.get(name))
    data = {"ok": True, **row, "chosen_by": why, "file": str(store.path), "settings": stored}
    text = "\n".join(
        [
            f"name: {name}",
            f"chosen by: {why}",
            f"type: {row['type']}",
            f"endpoint: {row['endpoint']}",
        ]
        + [f"{k}: {v}" for k, v in sorted(stored.items()) if k not in ("type",)]
    )
    out.emit(data, text, [name])
    return exits.OK


def cmd_use(args: Any, out: Any) -> int:
    store = load()
    check_name(args.name, where="argument NAME")
    if args.name != DEFAULT:
        store.get(args.name)
    store.current = "" if args.name == DEFAULT else args.name
    store.save()
    out.emit(
        {"ok": True, "current": args.name, "file": str(store.path)},
        f"current context: {args.name}",
        [args.name],
    )
    return exits.OK


def _absolute(value: str | None, argument: str) -> str | None:
    if value is None:
        return None
    path = os.path.abspath(value)
    if not os.path.isfile(path):
        raise ContextsError(f"argument {argument}: {value}: no such file")
    return path


def cmd_add(args: Any, out: Any) -> int:
    store = load()
    name = args.name
    check_name(name, where="argument NAME")
    if name == DEFAULT:
        raise ContextsError(f"argument NAME: {DEFAULT!r} is the local socket and cannot be stored")
    if name in store.contexts and not args.force:
        raise ContextsError(
            f"context {name!r} exists in {store.path} (--force replaces it)", exits.CONFLICT
        )
    chosen = [
        flag
        for flag, value in (("--tls", args.tls), ("--ssh", args.ssh), ("--unix", args.unix))
        if value
    ]
    if len(chosen) != 1:
        raise ContextsError(
            "context add: give exactly one of --tls ADDRESS, --ssh DESTINATION, --unix PATH"
        )
    context: dict[str, Any] = {}
    if args.tls:
        missing = [f for f in ("ca_file", "cert_file", "key_file") if getattr(args, f) is None]
        if missing:
            raise ContextsError(
                f"argument --{missing[0].replace('_', '-')}: a TLS context needs it"
            )
        context = {
            "type": "tls",
            "address": args.tls,
            "ca_file": _absolute(args.ca_file, "--ca-file"),
            "cert_file": _absolute(args.cert_file, "--cert-file"),
            "key_file": _absolute(args.key_file, "--key-file"),
        }
        if args.server_name:
            context["server_name"] = args.server_name
    elif args.ssh:
        context = {"type": "ssh", "destination": args.ssh}
        if args.remote_socket:
            context["socket"] = args.remote_socket
        if args.ssh_port is not None:
            context["port"] = args.ssh_port
        if args.identity_file:
            context["identity_file"] = _absolute(args.identity_file, "--identity-file")
        if args.ssh_option:
            context["ssh_options"] = list(args.ssh_option)
    else:
        context = {"type": "unix", "socket": os.path.abspath(args.unix)}
    if args.description:
        context["description"] = args.description
    check(name, context, where=f"context `{name}")
    store.contexts[name] = context
    store.save()
    out.emit(
        {"ok": True, **_row(name, context, store.current), "file": str(store.path)},
        f"context {name} added ({endpoint_text(context)}) in {store.path}",
        [name],
    )
    return exits.OK


def cmd_remove(args: Any, out: Any) -> int:
    store = load()
    store.get(args.name)
    if args.name == store.current:
        if not args.force:
            raise ContextsError(
                f"context {args.name!r} is the current one "
                "(`context use default` first, or --force)",
                exits.CONFLICT,
            )
        store.current = ""
    del store.contexts[args.name]
    store.save()
    out.emit(
        {"ok": True, "removed": args.name, "file": str(store.path)},
        f"context {args.name} removed",
        [args.name],
    )
    return exits.OK


def add_parsers(commands: Any, leaf: Any) -> None:
    parser = commands.add_parser(
        "context",
        help="named applianced endpoints: this host, others over SSH or TLS (docs/hosts.md)",
    )
    sub = parser.add_subparsers(dest="context_command", required=True, metavar="COMMAND")
    leaf(
        sub.add_parser("list", aliases=["ls"], help="the contexts; * marks the current one")
    ).set_defaults(func=cmd_list)
    show = leaf(sub.add_parser("show", help="a context (default: the one in effect, and why)"))
    show.add_argument("name", nargs="?")
    show.set_defaults(func=cmd_show)
    use = leaf(sub.add_parser("use", help="make NAME the current context (`default`: this host)"))
    use.add_argument("name")
    use.set_defaults(func=cmd_use)
    add = leaf(sub.add_parser("add", help="store a context: --tls, --ssh or --unix"))
    add.add_argument("name")
    add.add_argument("--description", default="")
    add.add_argument("--force", action="store_true", help="replace a context of that name")
    add.add_argument("--tls", metavar="HOST:PORT", help="the daemon's [admin_tls] listen address")
    add.add_argument("--ca-file", help="--tls: the CA that signed the daemon's certificate (PEM)")
    add.add_argument("--cert-file", help="--tls: our client certificate (PEM)")
    add.add_argument("--key-file", help="--tls: its private key (PEM)")
    add.add_argument(
        "--server-name", help="--tls: the name the daemon's certificate must carry (default: HOST)"
    )
    add.add_argument("--ssh", metavar="[USER@]HOST", help="the host, reached with ssh(1)")
    add.add_argument("--ssh-port", type=int, help="--ssh: the port (default: ssh's own)")
    add.add_argument("--identity-file", help="--ssh: the private key (default: ssh's own)")
    add.add_argument(
        "--ssh-option",
        action="append",
        metavar="KEY=VALUE",
        help="--ssh: an ssh -o option (repeatable)",
    )
    add.add_argument(
        "--remote-socket",
        help="--ssh: the admin socket there (default /run/agent-appliance/admin.sock)",
    )
    add.add_argument(
        "--unix", metavar="PATH", help="a local admin socket (another instance on this host)"
    )
    add.set_defaults(func=cmd_add)
    remove = leaf(sub.add_parser("remove", aliases=["rm"], help="forget a context"))
    remove.add_argument("name")
    remove.add_argument(
        "--force", action="store_true", help="even the current one (then default is)"
    )
    remove.set_defaults(func=cmd_remove)
