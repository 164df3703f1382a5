"""applianced: the control plane's trio main.

Theory of operation
-------------------
    lock the state directory (flock: one daemon per state)
    open the credential store (its key from ENCRYPTION_KEY or the key file; a wrong key stops here)
    open the state (SQLite) and the crews' networks (netns, its own state file under net/)
    open the journal (journal.db, docs/journal.md) and follow the proxy's event file into it
    start the proxy child (supervised; restarted and re-fed its crews if it dies)
    reconcile (docs/daemon.md): the world is made to match the state rows
    open the admin socket (only now: no request sees a half-reconciled state)
    ... serve until SIGTERM/SIGINT ...
    stop_crews_on_exit: tear the crews down (rows kept as "stopped"); else leave them running
    close the admin socket, stop the proxy (its channel closes), release the lock

Crews keep running while applianced is down (their containers belong to the engine), but their
proxy does not: the proxy exits when applianced's end of its channel closes, so a crew without a
daemon reaches nothing (fail closed), and the next start serves it again.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

import trio

from appliance.credstore import CredentialStore, load_key
from appliance.journal import Journal
from appliance.journal.recorder import JournalRecorder
from appliance.keeper.channel import KeeperChannel, new_token
from appliance.keeper.service import KeeperService
from appliance.runtime.base import RuntimeProvider
from netns import CrewNetworks
from proxycore import control
from proxycore.privileges import forbid_core_dumps

from . import messages
from .api import AdminServer
from .config import ApplianceConfig
from .credentials import CredentialsApi
from .crews import CrewManager, StepHook, kill_hook_from_env
from .errors import ConfigInvalid, DaemonError, Unavailable
from .instance import derive_instance_id, lock_instance, unlock_instance
from .proxy import ProxyPool
from .state import CrewPhase, StateStore

log = logging.getLogger("applianced")

LOCK_FILE = "applianced.lock"
JOURNAL_FILE = "journal.db"
# applianced's keeper (appliance/keeper/channel.py): only the proxy workers may connect. It is
# not in the state directory, which the workers (UID [proxy] uid) cannot enter: see keeper_dir.
KEEPER_SOCKET = "keeper.sock"
KEEPER_RECENT_ENTRIES = 20


def load_provider(config: ApplianceConfig) -> RuntimeProvider:
    """`docker`, or `module:factory` called with the config (tests, development)."""
    spec = config.daemon.provider
    if spec == "docker":
        from appliance.runtime.docker import DockerProvider

        return DockerProvider.connect()
    module_name, sep, attribute = spec.partition(":")
    if not sep:
        raise ConfigInvalid(f"`daemon.provider`: {spec!r} is not 'docker' or 'module:factory'")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigInvalid(f"`daemon.provider`: cannot load {spec!r}: {exc}") from None
    made: RuntimeProvider = factory(config)
    return made


def resolve_images(config: ApplianceConfig) -> tuple[str, str]:
    """(agent, infra) image tags: configured, or built/found by images.build for Docker."""
    agent, infra = config.images.agent, config.images.infra
    if agent and infra:
        return agent, infra
    if config.daemon.provider != "docker":
        return agent or "none", infra or "none"
    from images.build import ensure_images

    # Built once per recipe and cached (images/); a no-op when the tagged images exist.
    tags = ensure_images()
    return agent or tags.agent, infra or tags.infra


class Daemon:
    def __init__(
        self,
        config: ApplianceConfig,
        provider: RuntimeProvider,
        *,
        on_step: StepHook | None = None,
    ) -> None:
        self.config = config
        self.provider = provider
        self.on_step = on_step
        self.state_dir = Path(config.daemon.state_dir)
        self.started = time.time()
        self.reconcile_changes: tuple[str, ...] = ()
        self._lock_fd: int | None = None
        self._instance_fd: int | None = None
        self.instance = ""
        self.networks: CrewNetworks
        self.crews: CrewManager
        self.proxy: ProxyPool
        self.journal: Journal
        self.recorder: JournalRecorder
        self.credentials_api: CredentialsApi

    def _lock_state(self) -> None:
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)  # the state names every crew's policy: root only
        fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise Unavailable(f"another applianced holds {self.state_dir}") from None
        self._lock_fd = fd

    def _keeper_peer_allowed(self, pid: int, uid: int, gid: int) -> bool:
        if pid not in self.proxy.pids:
            return False
        ids = self.proxy.drop_to
        return ids is None or (uid, gid) == ids

    async def _audit_paused(self, paused: bool) -> None:
        await self.proxy.set_audit_paused(paused)

    async def status(self) -> messages.Status:
        rows = self.crews.store.crews()
        return messages.Status(
            pid=os.getpid(),
            state_dir=str(self.state_dir),
            admin_socket=self.config.daemon.admin_socket,
            provider=self.provider.name,
            isolated=self.provider.isolated,
            runtimes=await self.crews.runtimes(),
            proxy_pid=self.proxy.pid,
            proxy_alive=await self.proxy.ping(),
            proxy_restarts=self.proxy.restarts,
            proxy_port=self.config.daemon.proxy_port,
            crews=len(rows),
            crews_ready=sum(1 for r in rows if r.phase is CrewPhase.READY),
            started=self.started,
            reconcile=self.reconcile_changes,
            instance=self.instance,
            pool_size=self.config.crews.infra_pool,
            pool_ready=self.crews.pool_ready(),
            proxy_pids=self.proxy.pids,
            proxy_uid=self.proxy.drop_to[0] if self.proxy.drop_to else None,
            proxy_workers=self.proxy.worker_status(),
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._lock_state()
        credentials = open_credentials(self.config)
        try:
            store = StateStore(self.state_dir)
        except BaseException:
            credentials.close()
            raise
        try:
            # Before anything is touched: everything this daemon makes, lists or removes
            # carries its instance id (instance.py).
            instance = store.instance_id(
                self.config.daemon.instance, derive_instance_id(self.state_dir)
            )
            self.instance = instance
            self._instance_fd = lock_instance(self.config.daemon.run_dir, instance, self.state_dir)
            store.record_instance_id(instance)
            self.provider.bind_instance(instance)
            self.provider.adopt(*store.adoptable())
            networks = CrewNetworks(
                self.config.net_config(), self.state_dir / "net", instance=instance
            )
        except BaseException:
            if self._instance_fd is not None:
                unlock_instance(self._instance_fd, self.config.daemon.run_dir, instance)
                self._instance_fd = None
            store.close()
            credentials.close()
            raise
        journal = Journal(self.state_dir / JOURNAL_FILE)
        recorder = JournalRecorder(journal, on_backpressure=self._audit_paused)
        try:
            self.networks = networks
            self.journal = journal
            self.recorder = recorder
            section = self.config.proxy
            self.proxy = ProxyPool(
                self.config.proxy_config(),
                self.state_dir,
                self.config.daemon.proxy_port,
                workers=self.config.proxy_workers,
                # Only root can drop to another UID; applianced runs as root on an appliance.
                drop_to=(section.uid, section.gid) if os.geteuid() == 0 else None,
                events_reader=recorder.ingest_proxy_channel,
                on_exit=recorder.proxy_worker_exited,
            )
            self.credentials_api = CredentialsApi(credentials, self.proxy)
            self.proxy.credentials_source = self.credentials_api.source
            # What the workers write on stderr is scrubbed as the journal is.
            self.credentials_api.scrubbed += [journal, self.proxy]
            # (on this thread: the store's SQLite connection belongs to it; a few ms)
            self.credentials_api.refresh_scrubbers()
            images = await trio.to_thread.run_sync(resolve_images, self.config)
            self.crews = CrewManager(
                self.config,
                self.provider,
                networks,
                store,
                self.proxy,
                images,
                on_step=self.on_step,
            )
            self.crews.journal = recorder
            keeper = KeeperChannel(
                KeeperService(
                    credentials,
                    self.config.keeper,
                    recorder,
                    self.provider,
                    recent_activity=lambda crew: tuple(
                        row.summary for row in journal.tail(KEEPER_RECENT_ENTRIES, crew=crew)
                    ),
                ),
                keeper_dir(self.config) / KEEPER_SOCKET,
                new_token(),  # fresh at every start; only the proxy workers learn it
                # SO_PEERCRED: a running proxy worker, under the workers' UID, and nobody else
                # (not another process of that UID, not another root process).
                self._keeper_peer_allowed,
            )
            self.proxy.keeper_channel = control.KeeperChannelSet(
                path=str(keeper.path), token=keeper.token
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(keeper.serve, self.proxy.drop_to)
                await nursery.start(recorder.watch_backpressure)
                await nursery.start(self.proxy.run)
                self.reconcile_changes = tuple(await self.crews.reconcile())
                # Filled in the background: a create before a slot is ready builds its own.
                pool_scope = trio.CancelScope()

                async def keep_pool() -> None:
                    with pool_scope:
                        await self.crews.keep_pool()

                nursery.start_soon(keep_pool)
                await nursery.start(AdminServer(self).serve, self.config.daemon.admin_socket)
                print(
                    f"applianced: ready (pid {os.getpid()}, admin socket "
                    f"{self.config.daemon.admin_socket}, provider {self.provider.name}, "
                    f"instance {self.instance})",
                    file=sys.stderr,
                    flush=True,
                )
                task_status.started()
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.warning("signal %d: shutting down", signum)
                        break
                # The pool first: a fill in progress is finished or undone, never left half.
                pool_scope.cancel()
                if self.config.daemon.stop_crews_on_exit:
                    await self.crews.stop_all()
                nursery.cancel_scope.cancel()
        finally:
            networks.close()
            journal.close()  # writes what is queued first
            store.close()
            credentials.close()
            if self._instance_fd is not None:
                unlock_instance(self._instance_fd, self.config.daemon.run_dir, self.instance)
            if self._lock_fd is not None:
                os.close(self._lock_fd)


def keeper_dir(config: ApplianceConfig) -> Path:
    """`<daemon.run_dir>/<16 hex of the state directory's path>`: one per applianced (tests run
    several), outside the 0700 state directory so that the proxy workers can reach the keeper
    socket in it; made 0750 root:<workers' gid> by KeeperChannel.serve."""
    digest = hashlib.sha256(os.fsencode(os.path.abspath(config.daemon.state_dir))).hexdigest()
    return Path(config.daemon.run_dir) / digest[:16]


def open_credentials(config: ApplianceConfig) -> CredentialStore:
    """The credential store at its configured (or default) path, with its key."""
    section = config.credentials
    state_dir = Path(config.daemon.state_dir)
    key_file = Path(section.key_file or state_dir / "credentials.key")
    key, _source = load_key(section.key_env or None, key_file)
    return CredentialStore(Path(section.db or state_dir / "credentials.db"), key)


def run_daemon(config: ApplianceConfig) -> int:
    """The foreground daemon; returns the process exit code."""
    # applianced holds the store's key and, while pushing them, credential values.
    forbid_core_dumps()
    # appliancectl's main configured WARNING for the admin commands; the daemon logs at INFO
    # (crew and credential changes: names only, never a value).
    logging.basicConfig(
        level=logging.INFO, format="%(name)s: %(levelname)s: %(message)s", force=True
    )
    try:
        provider = load_provider(config)
        daemon = Daemon(config, provider, on_step=kill_hook_from_env())
        trio.run(daemon.run)
    except DaemonError as exc:
        print(f"applianced: {exc}", file=sys.stderr, flush=True)
        return 1
    except Exception as exc:  # netns pool conflicts, state errors: say it, exit non-zero
        if type(exc).__module__.startswith(("netns", "appliance", "images")):
            print(f"applianced: {exc}", file=sys.stderr, flush=True)
            return 1
        raise
    return 0
