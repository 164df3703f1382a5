"""applianced: the control plane's trio main.

Theory of operation
-------------------
    lock the state directory (flock: one daemon per state)
    check the configuration against this host (preflight.py: credential files, runtime, images,
    port, admin socket); a problem stops here with exit 2, before anything is touched
    open the credential store (its key from ENCRYPTION_KEY or the key file; a wrong key stops here)
    open the state (SQLite) and the crews' networks (netns, its own state file under net/)
    open the journal (journal.db, docs/journal.md) and follow the proxy's event file into it
    start the proxy child (supervised; restarted and re-fed its crews if it dies)
    reconcile (docs/daemon.md): the world is made to match the state rows
    open the admin socket (only now: no request sees a half-reconciled state)
    tell the service manager READY=1 (notify.py; STATUS= at each step above, and whenever a
    proxy worker is down; WATCHDOG=1 while the trio loop runs)
    ... serve until SIGTERM/SIGINT (STOPPING=1) ...
    stop_crews_on_exit: tear the crews down (rows kept as "stopped"); else leave them running
    close the admin socket, stop the proxy (its channel closes), release the lock

Crews keep running while applianced is down (their containers belong to the engine), but their
proxy does not: the proxy exits when applianced's end of its channel closes, so a crew without a
daemon reaches nothing (fail closed), and the next start serves it again.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import trio

from appliance._version import __version__
from appliance.credstore import CredentialStore, load_key
from appliance.journal import Journal
from appliance.journal.recorder import JournalRecorder
from appliance.journal.service import JournalLifecycle, open_lifecycle
from appliance.keeper.channel import KeeperChannel, new_token
from appliance.keeper.service import KeeperService
from appliance.logs import setup as setup_logging
from appliance.runtime.base import RuntimeProvider
from netns import CrewNetworks
from proxycore import control
from proxycore.privileges import forbid_core_dumps
from proxycore.protocol.scrubbing import configured_shapes

from . import messages
from .admin_server import AdminServer
from .approvals import Approvals
from .config import ApplianceConfig, config_file, load_config, metrics_address
from .credentials import CredentialsApi
from .crew_tls import CrewTLS
from .crews import CrewManager, StepHook, kill_hook_from_env
from .errors import ConfigInvalid, DaemonError, Unavailable
from .images import build_images_step, resolve_images_notifying
from .instance import derive_instance_id, lock_instance, unlock_instance
from .metrics import DaemonMetrics, Traffic
from .metrics import serve_tcp as serve_metrics
from .notify import Notifier
from .preflight import EXIT_CONFIG_INVALID, EXIT_CONFIG_OK, Preflight, run_preflight
from .proxy import ProxyPool
from .state import CrewPhase, StateStore
from .supervisor import WorkerExit

log = logging.getLogger("applianced")

LOCK_FILE = "applianced.lock"
JOURNAL_FILE = "journal.db"
# applianced's keeper (appliance/keeper/channel.py): only the proxy workers may connect. It is
# not in the state directory, which the workers (UID [proxy] uid) cannot enter: see keeper_dir.
KEEPER_SOCKET = "keeper.sock"
KEEPER_RECENT_ENTRIES = 20
# How often the STATUS= line is brought up to date with the proxy workers' state once serving.
STATUS_INTERVAL = 1.0


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


class Daemon:
    def __init__(
        self,
        config: ApplianceConfig,
        provider: RuntimeProvider,
        *,
        on_step: StepHook | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.provider = provider
        self.on_step = on_step
        self.notifier = notifier or Notifier({})
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
        self.journal_lifecycle: JournalLifecycle
        self.credentials_api: CredentialsApi
        self.approvals: Approvals
        self.metrics: DaemonMetrics

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

    def _serving_status(self) -> str:
        workers = self.proxy.worker_status()
        down = [w for w in workers if w.pid is None]
        crews = len(self.crews.store.crews())
        if not down:
            return (
                f"serving: {crews} crews, {len(workers)} proxy workers, admin socket "
                f"{self.config.daemon.admin_socket}"
            )
        parts = []
        for worker in down:
            why = f"exited: {worker.last_exit}" if worker.last_exit else "starting"
            if worker.backoff is not None:
                why += f", restart in {worker.backoff:.1f} s"
            parts.append(f"proxy worker {worker.index} down ({why})")
        return (
            f"degraded: {'; '.join(parts)}; {len(workers) - len(down)} of {len(workers)} "
            f"proxy workers serving, {crews} crews"
        )

    def _worker_exited(self, gone: WorkerExit) -> None:
        """Journaled, and the service manager's STATUS= says so at once (a worker that comes
        back within STATUS_INTERVAL would otherwise never show)."""
        self.recorder.proxy_worker_exited(gone)
        if self.notifier.enabled and hasattr(self, "crews"):
            self.notifier.status(self._serving_status())

    async def _keep_status(self) -> None:
        while True:
            self.notifier.status(self._serving_status())
            await trio.sleep(STATUS_INTERVAL)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.notifier.status("starting: the state directory, the credential store, the journal")
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
        # Counted as the journal ingests (appliance/daemon/metrics.py); crew labels are bounded
        # by the crews the proxy serves.
        self.metrics = DaemonMetrics(self, Traffic(crews=lambda: self.proxy.crews))
        recorder = JournalRecorder(
            journal, on_backpressure=self._audit_paused, observer=self.metrics.traffic
        )
        try:
            # Retention, signed exports and backups (docs/journal.md); the key is created 0600
            # at first start.
            section_j = self.config.journal
            self.journal_lifecycle = open_lifecycle(
                journal,
                self.state_dir,
                key_file=section_j.key_file,
                trusted_keys=section_j.trusted_keys,
                keep_days=section_j.keep_days,
                keep_bytes=section_j.keep_bytes,
                prune_interval=section_j.prune_interval,
            )
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
                on_exit=self._worker_exited,
                dns=self.config.net_config().dns,
            )
            self.credentials_api = CredentialsApi(credentials, self.proxy)
            self.proxy.credentials_source = self.credentials_api.source
            # What the workers write on stderr is scrubbed as the journal is.
            self.credentials_api.scrubbed += [journal, self.proxy]
            # (on this thread: the store's SQLite connection belongs to it; a few ms)
            self.credentials_api.refresh_scrubbers()
            # The crews' CAs (keys in the credential store) and the leaves the workers get.
            crew_tls = CrewTLS(credentials, self.state_dir, self.proxy.config)
            self.proxy.leaves_source = crew_tls.source
            images = await resolve_images_notifying(self.config, self.notifier)
            self.crews = CrewManager(
                self.config,
                self.provider,
                networks,
                store,
                self.proxy,
                images,
                on_step=self.on_step,
                tls=crew_tls,
            )
            self.crews.journal = recorder
            # Run-time approvals (approvals.py): the grants and denials stored go to every
            # worker with its crews, so they are loaded before the crews are reconciled.
            self.approvals = Approvals(
                self.config.approvals, store, self.proxy, recorder, self.crews
            )
            self.approvals.load()
            self.proxy.approvals_source = self.approvals.source
            if self.config.approvals.enabled:
                recorder.on_refused = self.approvals.on_refused
            keeper = KeeperChannel(
                KeeperService(
                    credentials,
                    self.config.keeper,
                    recorder,
                    self.provider,
                    recent_activity=lambda crew: tuple(
                        row.summary for row in journal.tail(KEEPER_RECENT_ENTRIES, crew=crew)
                    ),
                    secret_paths=keeper_secret_paths(self.config),
                    shapes=configured_shapes(self.config.proxy.scrub.shapes),
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
                await nursery.start(self.journal_lifecycle.keep_pruned)
                await nursery.start(self.approvals.keep_swept)
                self.notifier.status(f"starting: {len(self.proxy.workers)} proxy workers")
                await nursery.start(self.proxy.run)
                self.notifier.status("starting: reconciling the crews with the state")
                self.reconcile_changes = tuple(await self.crews.reconcile())
                nursery.start_soon(crew_tls.keep_renewed, self.proxy)
                # Filled in the background: a create before a slot is ready builds its own.
                pool_scope = trio.CancelScope()

                async def keep_pool() -> None:
                    with pool_scope:
                        await self.crews.keep_pool()

                nursery.start_soon(keep_pool)
                admin = AdminServer(self)
                await nursery.start(admin.serve, self.config.daemon.admin_socket)
                if self.config.admin_tls.listen:
                    host, port = metrics_address(self.config.admin_tls.listen)
                    await nursery.start(admin.serve_tls, host, port)
                if self.config.metrics.listen:
                    host, port = metrics_address(self.config.metrics.listen)
                    await nursery.start(serve_metrics, self.metrics, host, port)
                await nursery.start(self.notifier.keep_watchdog)
                self.notifier.ready(self._serving_status())
                nursery.start_soon(self._keep_status)
                log.info(
                    "ready (pid %d, admin socket %s, provider %s, instance %s)",
                    os.getpid(),
                    self.config.daemon.admin_socket,
                    self.provider.name,
                    self.instance,
                )
                task_status.started()
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.warning("signal %d: shutting down", signum)
                        self.notifier.stopping(f"stopping ({signal.Signals(signum).name})")
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


def keeper_secret_paths(config: ApplianceConfig) -> tuple[str, ...]:
    """Files that hold a secret, for the keeper's encoder rule (docs/keeper.md): the store,
    its key file, the journal's signing key, the providers' credential files."""
    state_dir = Path(config.daemon.state_dir)
    section = config.credentials
    paths = [
        section.db or str(state_dir / "credentials.db"),
        section.key_file or str(state_dir / "credentials.key"),
        config.journal.key_file or "",
    ]
    providers = config.proxy.providers
    for name in msgspec.structs.fields(providers):
        paths.append(getattr(providers, name.name).credential_file or "")
    return tuple(path for path in paths if path)


def open_credentials(config: ApplianceConfig) -> CredentialStore:
    """The credential store at its configured (or default) path, with its key."""
    section = config.credentials
    state_dir = Path(config.daemon.state_dir)
    key_file = Path(section.key_file or state_dir / "credentials.key")
    key, _source = load_key(section.key_env or None, key_file)
    return CredentialStore(Path(section.db or state_dir / "credentials.db"), key)


def run_daemon(config: ApplianceConfig, *, source: str = "<config>") -> int:
    """The foreground daemon; returns the process exit code (0; 1 a failure at start or while
    running; 2 a configuration this host cannot run, preflight.py)."""
    # applianced holds the store's key and, while pushing them, credential values.
    forbid_core_dumps()
    # One line per record, text or JSON, from [daemon] log_level (INFO by default: crew and
    # credential changes, names only, never a value); appliance/logs.py.
    setup_logging(config.daemon.log_format, config.daemon.log_level)
    notifier = Notifier()
    try:
        notifier.status("starting: the engine and the configuration")
        try:
            provider = load_provider(config)
        except ConfigInvalid:
            raise
        except Exception as exc:
            # An engine that does not answer may come back (exit 1, the unit retries); a
            # missing credential file will not: say so now rather than after the engine.
            report = run_preflight(config, source, provider=None, engine_error=str(exc))
            problems = [p for p in report.problems if p.key != "daemon.provider"]
            for problem in problems:
                print(f"applianced: {problem}", file=sys.stderr, flush=True)
            if problems:
                notifier.status(f"configuration: {problems[0]}")
                return EXIT_CONFIG_INVALID
            raise
        report = run_preflight(config, source, provider=provider, starting=True)
        if not report.ok:
            for problem in report.problems:
                print(f"applianced: {problem}", file=sys.stderr, flush=True)
            notifier.status(f"configuration: {report.problems[0]}")
            return EXIT_CONFIG_INVALID
        daemon = Daemon(config, provider, on_step=kill_hook_from_env(), notifier=notifier)
        trio.run(daemon.run)
    except DaemonError as exc:
        print(f"applianced: {exc}", file=sys.stderr, flush=True)
        notifier.status(f"failed: {exc}")
        return EXIT_CONFIG_INVALID if isinstance(exc, ConfigInvalid) else 1
    except Exception as exc:  # netns pool conflicts, state errors: say it, exit non-zero
        if type(exc).__module__.startswith(("netns", "appliance", "images")):
            print(f"applianced: {exc}", file=sys.stderr, flush=True)
            notifier.status(f"failed: {exc}")
            return 1
        raise
    finally:
        notifier.close()
    return 0


def check_configuration(config: ApplianceConfig, source: str) -> Preflight:
    """What `applianced --check` and `appliancectl config check` report: the file has been
    parsed and checked (config.py); now the host (preflight.py), with the engine if it answers."""
    provider: RuntimeProvider | None = None
    engine_error: str | None = None
    try:
        provider = load_provider(config)
    except Exception as exc:  # EngineUnavailable lists every address tried; a factory's error
        engine_error = str(exc) or type(exc).__name__
    return run_preflight(config, source, provider=provider, engine_error=engine_error)


def print_check(report: Preflight, *, as_json: bool, prog: str) -> int:
    """Problems on stderr, one per line; the summary (or the JSON report) on stdout."""
    for problem in report.problems:
        print(f"{prog}: {problem}", file=sys.stderr, flush=True)
    if as_json:
        print(msgspec.json.encode(report).decode(), flush=True)
    else:
        for note in report.notes:
            print(f"note: {note}", flush=True)
        if report.ok:
            print(f"{report.file}: ok (checked {', '.join(('values', *report.checked))})")
    return EXIT_CONFIG_OK if report.ok else EXIT_CONFIG_INVALID


def check_file(path: str | None, *, as_json: bool, prog: str) -> int:
    """Read, parse and check a configuration file (the default one if `path` is None)."""
    file = config_file(path)
    source = file or "<defaults>"
    try:
        config = load_config(file)
    except ConfigInvalid as exc:
        problem = str(exc)
        print(f"{prog}: {problem}", file=sys.stderr, flush=True)
        if as_json:
            print(msgspec.json.encode({"file": source, "ok": False, "error": problem}).decode())
        return EXIT_CONFIG_INVALID
    return print_check(check_configuration(config, source), as_json=as_json, prog=prog)


def build_parser() -> argparse.ArgumentParser:
    """applianced's command line (also read by the test that checks the docs' commands)."""
    parser = argparse.ArgumentParser(
        prog="applianced",
        description="the appliance's control plane, in the foreground (docs/daemon.md)",
        epilog="exit status: 0 stopped cleanly (or --check: valid), 1 failed, 2 a configuration "
        "this host cannot run (each problem on stderr: file, key, reason)",
    )
    parser.add_argument("--version", action="version", version=f"applianced {__version__}")
    parser.add_argument(
        "--config", help="the configuration file (default /etc/agent-appliance/appliance.toml)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the configuration and this host against it, then exit (0 valid, 2 not)",
    )
    parser.add_argument("--json", action="store_true", help="with --check: the report as JSON")
    parser.add_argument(
        "--build-images",
        action="store_true",
        help="find or build the agent and infra images, then exit (the unit's ExecStartPre: "
        "the build needs more privilege than the daemon, docs/systemd.md)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`applianced [--config FILE] [--check [--json]]`: the control plane in the foreground (what
    a service manager runs), or only the checks it makes at start."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    if args.check:
        return check_file(args.config, as_json=args.json, prog="applianced")
    file = config_file(args.config)
    try:
        config = load_config(file)
    except ConfigInvalid as exc:
        print(f"applianced: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_INVALID
    if os.geteuid() != 0:
        print("applianced: needs root (netlink, nftables, the engine)", file=sys.stderr)
        return 1
    if args.build_images:
        return build_images_step(config)
    return run_daemon(config, source=file or "<defaults>")


if __name__ == "__main__":
    sys.exit(main())
