"""The proxy as applianced's supervised child.

Theory of operation
-------------------
applianced starts `python -m appliance.cli proxy --config <state>/proxy.json --control-fd N`
with one end of a socketpair. The generated config has no crews and no listeners: for each crew,
applianced (root) binds a listening socket on the crew's gateway and sends `crew_add` with the
socket attached (SCM_RIGHTS); the proxy only ever accepts on sockets it was given, so it needs no
privilege to bind (the path to running it as an unprivileged UID, issue 6).

applianced keeps its own copy of every crew's listening socket. If the proxy dies, connections
wait in the socket's backlog while the supervisor starts a new proxy and sends every crew again,
with the same sockets; nothing is re-bound, so no other process can take a gateway's port in
between. If applianced dies, the proxy sees its channel close and exits (fail closed: no proxy
serves a policy nobody can change); the next applianced starts a fresh one.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import trio

from proxycore import control
from proxycore.config import ProxyConfig
from proxycore.control_server import ChannelClient

from .errors import Unavailable

log = logging.getLogger("applianced.proxy")

RESTART_DELAY = 1.0


class CrewEntry(msgspec.Struct, frozen=True):
    name: str
    gateway: str
    mode: str
    allow: tuple[str, ...]


class ProxyChild:
    def __init__(self, config: ProxyConfig, state_dir: Path, port: int) -> None:
        self.config_path = state_dir / "proxy.json"
        self.config = config
        self.port = port
        self.client: ChannelClient | None = None
        self.process: trio.Process | None = None
        self.crews: dict[str, CrewEntry] = {}
        self.listeners: dict[str, socket.socket] = {}
        self._ready = trio.Event()
        self.restarts = 0
        self.audit_paused = False  # the journal is behind: crews are refused (docs/journal.md)
        # The crews' provider credentials, asked for afresh at every (re)start of the proxy
        # (appliance/daemon/credentials.py): applianced keeps no plaintext between pushes.
        self.credentials_source: Callable[[], dict[str, dict[str, str]]] | None = None
        # Where applianced's keeper listens, and its token (appliance/keeper/channel.py):
        # sent at every (re)start, so a restarted proxy forwards keeper calls again.
        self.keeper_channel: control.KeeperChannelSet | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def _write_config(self) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.config))
        os.replace(tmp, self.config_path)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the proxy and keep it running; restore every crew after a restart."""
        self._write_config()
        started = False
        while True:
            ours, theirs = socket.socketpair()
            try:
                process = await trio.lowlevel.open_process(
                    [
                        sys.executable,
                        "-m",
                        "appliance.cli",
                        "proxy",
                        "--config",
                        str(self.config_path),
                        "--control-fd",
                        str(theirs.fileno()),
                    ],
                    pass_fds=(theirs.fileno(),),
                    stdin=open(os.devnull, "rb"),  # noqa: SIM115 (handed to the child)
                )
            finally:
                theirs.close()
            self.process = process
            client = ChannelClient(trio.socket.from_stdlib_socket(ours))
            try:
                with trio.fail_after(15):
                    reply = await client.request(control.Ping())
                if not reply.ok:
                    raise Unavailable(f"the proxy refused a ping: {reply.error}")
                if self.audit_paused:
                    await client.request(control.AuditPaused(paused=True))
                for entry in list(self.crews.values()):
                    await self._send_add(client, entry)
                if self.credentials_source is not None:
                    reply = await client.request(
                        control.CredentialsSet(crews=self.credentials_source())
                    )
                    if not reply.ok:
                        # Fail closed: a proxy without the crews' keys must not serve them.
                        raise OSError(f"the proxy refused the credentials: {reply.error}")
                if self.keeper_channel is not None:
                    reply = await client.request(self.keeper_channel)
                    if not reply.ok:
                        raise OSError(f"the proxy refused the keeper channel: {reply.error}")
            except (trio.TooSlowError, trio.BrokenResourceError, OSError) as exc:
                log.error("proxy did not come up: %s", exc)
                process.kill()
            else:
                self.client = client
                self._ready.set()
                if not started:
                    started = True
                    task_status.started()
            try:
                code = await process.wait()
            finally:
                self.client = None
                self._ready = trio.Event()
                # Closing the channel is the proxy's signal to stop; then it gets 5 s.
                ours.close()
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(5):
                        await process.wait()
                    if process.returncode is None:
                        process.kill()
                        await process.wait()
            log.error("proxy exited with %s; restarting in %.0f s", code, RESTART_DELAY)
            self.restarts += 1
            await trio.sleep(RESTART_DELAY)

    async def _request(
        self, message: control.ControlMessage, listener: socket.socket | None = None
    ) -> control.ControlReply:
        with trio.move_on_after(15):
            await self._ready.wait()
        client = self.client
        if client is None:
            raise Unavailable("the proxy is not running")
        try:
            with trio.fail_after(15):
                return await client.request(message, listener=listener)
        except (trio.TooSlowError, trio.BrokenResourceError, OSError) as exc:
            raise Unavailable(f"the proxy did not answer: {exc}") from None

    async def _send_add(self, client: ChannelClient, entry: CrewEntry) -> None:
        message = control.CrewAdd(
            name=entry.name,
            gateway=entry.gateway,
            mode=entry.mode,
            allow=entry.allow,
            listener=True,
        )
        reply = await client.request(message, listener=self.listeners[entry.name])
        if not reply.ok:
            log.error("proxy refused crew %s on restore: %s", entry.name, reply.error)

    def bind(self, gateway: str) -> socket.socket:
        """A listening socket on the crew's gateway (root binds; the proxy only accepts)."""
        family = socket.AF_INET6 if ":" in gateway else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((gateway, self.port))
            sock.listen(self.config.listen.backlog)
        except OSError as exc:
            sock.close()
            raise Unavailable(f"cannot listen on {gateway}:{self.port}: {exc.strerror}") from None
        return sock

    async def add_crew(self, entry: CrewEntry) -> None:
        listener = self.bind(entry.gateway)
        self.listeners[entry.name] = listener
        self.crews[entry.name] = entry
        try:
            reply = await self._request(
                control.CrewAdd(
                    name=entry.name,
                    gateway=entry.gateway,
                    mode=entry.mode,
                    allow=entry.allow,
                    listener=True,
                ),
                listener,
            )
            if not reply.ok:
                raise Unavailable(f"the proxy refused crew {entry.name!r}: {reply.error}")
        except BaseException:
            await self.remove_crew(entry.name)
            raise

    async def remove_crew(self, name: str) -> None:
        """Idempotent. The proxy ends the crew's connections; our copy of the socket closes."""
        self.crews.pop(name, None)
        listener = self.listeners.pop(name, None)
        try:
            if self.client is not None:
                reply = await self._request(control.CrewRemove(name=name))
                if not reply.ok:
                    raise Unavailable(f"the proxy refused to remove crew {name!r}: {reply.error}")
        finally:
            if listener is not None:
                listener.close()

    async def allow(self, name: str, host: str) -> bool:
        entry = self.crews.get(name)
        if entry is not None and host not in entry.allow:
            self.crews[name] = msgspec.structs.replace(entry, allow=(*entry.allow, host))
        reply = await self._request(control.AllowHost(crew=name, host=host))
        if not reply.ok:
            raise Unavailable(f"the proxy refused {host!r} for crew {name!r}: {reply.error}")
        return reply.changed

    async def set_audit_paused(self, paused: bool) -> None:
        """Refuse (or serve again) every crew's traffic while the journal cannot record it."""
        self.audit_paused = paused
        reply = await self._request(control.AuditPaused(paused=paused))
        if not reply.ok:
            raise Unavailable(f"the proxy refused audit_paused={paused}: {reply.error}")

    async def set_credentials(self, crews: dict[str, dict[str, str]]) -> None:
        """Replace every crew's store credentials in the running proxy (the whole map)."""
        reply = await self._request(control.CredentialsSet(crews=crews))
        if not reply.ok:
            raise Unavailable(f"the proxy refused the credentials: {reply.error}")

    async def ping(self) -> bool:
        try:
            return (await self._request(control.Ping())).ok
        except Unavailable:
            return False
