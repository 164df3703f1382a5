"""The proxy as applianced's supervised, unprivileged workers.

Theory of operation
-------------------
applianced starts N workers (`[proxy] workers`, default one per CPU), each

    python -m proxycore.worker --config <state>/proxy.json --control-fd C --events-fd E \
        --drop-to 1002:1002 --worker-index I

with two socketpairs: the control channel (typed messages from proxycore/control.py, one reply
each) and the events channel (the worker's decisions as JSON lines, which applianced journals:
`JournalRecorder.ingest_proxy_channel`). The worker imports the data plane only; as root it
reads its config, builds its runtime and loads every module it may ever need, then drops to
UID:GID with every capability set empty and no_new_privs (proxycore/privileges.py), checks
that, and refuses any further import (proxycore/worker.py, proxycore/preload.py) before it
serves anything; a worker whose drop falls short exits with status 1. It never binds: for each
crew, applianced (root) binds one listening socket on the crew's gateway and sends it with
`crew_add` to every worker (SCM_RIGHTS); the workers accept on the same socket, so the kernel
hands each new connection to one of them, and a worker that dies leaves the others serving.
Likewise, with `dns` on, a UDP and a TCP socket on the crew's gateway, port 53, on which the
workers serve the crew's DNS responder (if the port is taken, the crew gets no DNS from us).

Every change of policy or credentials is broadcast to every worker under `self.lock`, and a
worker that (re)starts is sent the whole current state under the same lock, so a worker never
misses a change made while it was starting. A worker that does not apply a broadcast (no reply in
time, a broken channel) is killed: it restarts with the whole state, never with a stale one
(fail closed). A refusal that every worker gives alike (a bad host, say) is the caller's error.

applianced keeps its own copy of every crew's listening socket. If a worker dies, connections wait
in the backlog or go to the other workers while it restarts; nothing is re-bound, so no other
process can take a gateway's port in between. A worker that exits is restarted after an
exponential backoff, and its exit (status or signal, applianced's own reason if it killed it,
its last lines on stderr) is logged, journaled (`on_exit`) and shown by `appliancectl status`:
appliance/daemon/supervisor.py. If applianced dies, every worker sees its channel
close and exits (fail closed: no proxy serves a policy nobody can change); the next applianced
starts fresh ones.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import msgspec
import trio

from appliance.logs import WorkerLog, worker_level
from appliance.selfexec import self_command
from native.scrub import Scrubber
from proxycore import control
from proxycore.config import ProxyConfig, RuleConfig
from proxycore.io.control_server import ChannelClient

from .errors import Unavailable
from .messages import WorkerStatus
from .supervisor import (
    RestartPolicy,
    StderrTail,
    WorkerExit,
    describe_exit,
    effective_uid,
    exit_status,
    read_stderr,
)

log = logging.getLogger("applianced.proxy")

# How long the events of a worker that has exited may still take to be read (its last batch).
EVENTS_GRACE = 5.0
# How long its last lines on stderr may take to arrive after it exited (they are in the pipe).
STDERR_GRACE = 1.0
# A worker that answers with one of these is out of step with the others (or hostile): killed.
_CHANNEL_ERRORS = (trio.TooSlowError, trio.BrokenResourceError, OSError, msgspec.DecodeError)
REQUEST_TIMEOUT = 15.0
# A crew's DNS (docs/proxy.md "DNS"): the port on its gateway, and the TCP backlog (DNS over
# TCP is the rare fallback for a truncated answer, and ours are never truncated).
DNS_PORT = 53
DNS_BACKLOG = 16
# What applianced does with a worker's events channel (the journal's ingest); returns at EOF.
EventsReader = Callable[[trio.SocketStream, int], Awaitable[None]]
DEFAULT_RESTART_POLICY = RestartPolicy()
# Told of every exit of a worker (applianced journals it); must not block.
ExitHook = Callable[[WorkerExit], None]
# A crew's whole set of leaves (appliance/daemon/crew_tls.py), minting what is missing or due
# within the timedelta; None: the crew has no CA (its tunnels stay opaque).
LeavesSource = Callable[["CrewEntry", datetime.timedelta], control.CrewLeaves | None]


class CrewEntry(msgspec.Struct, frozen=True):
    name: str
    gateway: str
    mode: str
    allow: tuple[str, ...]
    ssrf_allow: tuple[str, ...] = ()
    rules: tuple[RuleConfig, ...] = ()
    net: tuple[str, ...] = ()


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.process: trio.Process | None = None
        self.client: ChannelClient | None = None
        self.started = 0.0  # wall-clock time of the current life's start
        self.killed_for: str | None = None  # applianced killed this life, for this reason
        self.restarts = 0  # exits so far (each one is followed by a restart)
        self.short_lives = 0  # exits in a row after less than RestartPolicy.stable
        self.last_exit: WorkerExit | None = None
        self.restart_at: float | None = None  # wall-clock time of the pending restart

    def kill(self, why: str) -> int | None:
        process = self.process
        if process is None or process.returncode is not None:
            return None
        log.error(
            "proxy worker %d (pid %d): %s; killing it",
            self.index,
            process.pid,
            why,
            extra={"worker": self.index, "worker_pid": process.pid},
        )
        if self.killed_for is None:
            self.killed_for = why
        process.kill()
        return process.pid

    def status(self, scrub: Callable[[str], str]) -> WorkerStatus:
        process = self.process
        # Running once it serves: restored over its channel, which it reads only after dropping
        # its privileges, so a worker still starting (as root) is reported as down, not as uid 0.
        running = (
            process is not None
            and process.returncode is None
            and self.restart_at is None
            and self.client is not None
        )
        last = self.last_exit
        last_exit = scrub(last.reason) if last else None
        last_exit_time = last.ts if last else None
        if (
            process is not None
            and process.returncode is not None
            and (last is None or last.pid != process.pid)
        ):
            # Exited, and its exit not yet counted (its last events and stderr are still being
            # read, for a few seconds at most): say why already, not "starting".
            code, signal_name = exit_status(process.returncode)
            last_exit = scrub(describe_exit(code, signal_name, self.killed_for))
            last_exit_time = time.time()
        return WorkerStatus(
            index=self.index,
            pid=process.pid if running and process is not None else None,
            uid=effective_uid(process.pid) if running and process is not None else None,
            started=self.started if running else None,
            restarts=self.restarts,
            last_exit=last_exit,
            last_exit_time=last_exit_time,
            last_stderr=last.stderr_tail[-1] if last and last.stderr_tail else None,
            restart_at=self.restart_at,
            backoff=last.restart_in if last and self.restart_at is not None else None,
        )


class ProxyPool:
    def __init__(
        self,
        config: ProxyConfig,
        state_dir: Path,
        port: int,
        *,
        workers: int = 1,
        drop_to: tuple[int, int] | None = None,
        events_reader: EventsReader | None = None,
        restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY,
        on_exit: ExitHook | None = None,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        dns: bool = False,
    ) -> None:
        self.config_path = state_dir / "proxy.json"
        self.dns_dir = state_dir / "crew-dns"
        self.config = config
        self.port = port
        self.drop_to = drop_to
        self.events_reader = events_reader
        # The interpreter that runs `-m proxycore.worker` (None: ours; in the artifact, its own
        # executable with the `proxy-worker` subcommand, appliance/entry.py), and its
        # environment (None: ours). `command` replaces the whole command line before the
        # worker's options (a test runs the artifact's `proxy-worker` under this pool).
        self.python = python
        self.command = None if command is None else list(command)
        self.env = env
        self.workers = [_Worker(index) for index in range(workers)]
        self.crews: dict[str, CrewEntry] = {}
        self.listeners: dict[str, socket.socket] = {}
        # Each crew's DNS sockets (UDP, TCP) on its gateway, port 53, when `dns` is on and the
        # port was free: sent with its crew_add like its listener (docs/proxy.md "DNS").
        self.dns = dns
        self.dns_sockets: dict[str, tuple[socket.socket, socket.socket]] = {}
        # Held by every change of the workers' state and by a worker's restore (see above).
        self.lock = trio.Lock()
        self.restarts = 0  # every worker's exits, summed
        self.restart_policy = restart_policy
        self.on_exit = on_exit
        self._random = random.Random()
        # Every line a worker writes on stderr, and every exit reason, passes through this
        # before it is logged, kept or shown; applianced replaces it with the journal's (every
        # stored credential) at start and after every credential change.
        self.scrubber = Scrubber()
        self.audit_paused = False  # the journal is behind: crews are refused (docs/journal.md)
        # The crews' provider credentials, asked for afresh at every (re)start of a worker
        # (appliance/daemon/credentials.py): applianced keeps no plaintext between pushes.
        self.credentials_source: Callable[[], dict[str, dict[str, str]]] | None = None
        # Where applianced's keeper listens, and its token (appliance/keeper/channel.py):
        # sent at every (re)start, so a restarted worker forwards keeper calls again.
        self.keeper_channel: control.KeeperChannelSet | None = None
        # The crews' leaves, minted by applianced (crew_tls.py): sent after every crew_add,
        # to every worker and to a restarted one; `leaves_sent` is what every worker holds.
        self.leaves_source: LeavesSource | None = None
        self.leaves_sent: dict[str, tuple[tuple[str, str], ...]] = {}
        # A crew's run-time grants and denials (approvals.py), sent after its crew_add to every
        # worker and to a restarted one; None from it: the crew has none.
        self.approvals_source: Callable[[str], control.CrewApprovals | None] | None = None

    @property
    def pids(self) -> tuple[int, ...]:
        """The running workers' pids (the keeper channel admits these and nothing else)."""
        return tuple(
            w.process.pid
            for w in self.workers
            if w.process is not None and w.process.returncode is None
        )

    @property
    def pid(self) -> int | None:
        pids = self.pids
        return pids[0] if pids else None

    def _write_config(self) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.config))
        os.replace(tmp, self.config_path)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker and keep each running; started once all have come up once."""
        self._write_config()
        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                nursery.start_soon(self._supervise, worker)
            while not all(w.client is not None for w in self.workers):
                await trio.sleep(0.02)
            task_status.started()

    def _argv(self, worker: _Worker, control_fd: int, events_fd: int) -> list[str]:
        argv = [
            *(self.command or self_command("proxycore.worker", python=self.python)),
            "--config",
            str(self.config_path),
            "--control-fd",
            str(control_fd),
            "--events-fd",
            str(events_fd),
            "--worker-index",
            str(worker.index),
            # JSON on the stderr pipe: applianced logs each record again in its own format.
            "--log-format",
            "json",
            "--log-level",
            worker_level(),
        ]
        if self.drop_to is not None:
            argv += ["--drop-to", f"{self.drop_to[0]}:{self.drop_to[1]}"]
        return argv

    async def _supervise(self, worker: _Worker) -> None:
        while True:
            control_ours, control_theirs = socket.socketpair()
            events_ours, events_theirs = socket.socketpair()
            try:
                process = await trio.lowlevel.open_process(
                    self._argv(worker, control_theirs.fileno(), events_theirs.fileno()),
                    pass_fds=(control_theirs.fileno(), events_theirs.fileno()),
                    stdin=open(os.devnull, "rb"),  # noqa: SIM115 (handed to the child)
                    stderr=subprocess.PIPE,
                    env=self.env,
                )
            except BaseException:
                for sock in (control_ours, events_ours):
                    sock.close()
                raise
            finally:
                control_theirs.close()
                events_theirs.close()
            worker.process, worker.killed_for = process, None
            worker.started, born = time.time(), trio.current_time()
            events = trio.SocketStream(trio.socket.from_stdlib_socket(events_ours))
            tail = StderrTail(
                self._scrub, records=WorkerLog(worker.index, process.pid, self._scrub)
            )
            # The readers run until EOF, i.e. until the worker has exited and its last batch is
            # read, shielded from our cancellation (shutdown) so that a stopping worker's last
            # decisions still reach the journal; EVENTS_GRACE after the worker is gone, at most.
            reader_scope = trio.CancelScope(shield=True)
            stderr_scope = trio.CancelScope(shield=True)
            async with trio.open_nursery() as life:
                life.start_soon(self._read_events, reader_scope, events, worker.index)
                life.start_soon(read_stderr, stderr_scope, process, tail)
                try:
                    await self._live(worker, process, control_ours)
                finally:
                    reader_scope.deadline = trio.current_time() + EVENTS_GRACE
                    stderr_scope.deadline = trio.current_time() + STDERR_GRACE
            gone = self._exited(worker, process, trio.current_time() - born, tail)
            worker.restart_at = time.time() + gone.restart_in
            try:
                await trio.sleep(gone.restart_in)
            finally:
                worker.restart_at = None

    def _scrub(self, text: str) -> str:
        return self.scrubber.scrub_text(text)

    def _exited(
        self, worker: _Worker, process: trio.Process, uptime: float, stderr: StderrTail
    ) -> WorkerExit:
        """Count the exit, choose the backoff, and say why: logged, and to `on_exit`."""
        assert process.returncode is not None
        policy = self.restart_policy
        if uptime >= policy.stable:
            worker.short_lives = 0  # it had been serving: this crash starts a new count
        worker.short_lives += 1
        worker.restarts += 1
        self.restarts += 1
        code, signal_name = exit_status(process.returncode)
        gone = WorkerExit(
            worker=worker.index,
            pid=process.pid,
            ts=time.time(),
            uptime=round(uptime, 3),
            exit_code=code,
            signal=signal_name,
            killed_by=None if worker.killed_for is None else self._scrub(worker.killed_for),
            stderr_tail=stderr.tail(),
            restarts=worker.restarts,
            restart_in=round(policy.delay(worker.short_lives, self._random), 3),
        )
        worker.last_exit = gone
        tail = gone.stderr_tail
        last_words = f"; its last line on stderr: {tail[-1]}" if tail else ""
        log.error(
            "proxy worker %d (pid %d) %s after %.1f s; restart %d in %.1f s%s",
            worker.index,
            process.pid,
            gone.reason,
            uptime,
            worker.restarts,
            gone.restart_in,
            last_words,
            extra={"worker": worker.index, "worker_pid": process.pid},
        )
        if self.on_exit is not None:
            try:
                self.on_exit(gone)
            except Exception:  # the journal's trouble must not stop the restart
                log.exception("could not record the exit of proxy worker %d", worker.index)
        return gone

    def worker_status(self) -> tuple[WorkerStatus, ...]:
        return tuple(worker.status(self._scrub) for worker in self.workers)

    async def _read_events(
        self, scope: trio.CancelScope, events: trio.SocketStream, index: int
    ) -> None:
        with scope:
            if self.events_reader is not None:
                await self.events_reader(events, index)
            else:
                await events.aclose()

    async def _live(self, worker: _Worker, process: trio.Process, channel: socket.socket) -> None:
        """One life of one worker: give it the whole state, then wait for it to exit."""
        client = ChannelClient(trio.socket.from_stdlib_socket(channel))
        try:
            async with self.lock:
                with trio.fail_after(REQUEST_TIMEOUT):
                    await self._restore(client)
                worker.client = client
        except _CHANNEL_ERRORS as exc:
            worker.kill(f"did not come up: {str(exc) or type(exc).__name__}")
        try:
            await process.wait()
        finally:
            worker.client = None
            # Closing the channel is the worker's signal to stop; then it gets 5 s.
            channel.close()
            with trio.CancelScope(shield=True):
                with trio.move_on_after(5):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()

    async def _restore(self, client: ChannelClient) -> None:
        reply = await client.request(control.Ping())
        if not reply.ok:
            raise OSError(f"the worker refused a ping: {reply.error}")
        if self.audit_paused:
            await client.request(control.AuditPaused(paused=True))
        for entry in list(self.crews.values()):
            dns = self.dns_sockets.get(entry.name, ())
            reply = await client.request(
                _crew_add(entry, dns=bool(dns)), listener=self.listeners[entry.name], fds=dns
            )
            if not reply.ok:
                log.error("proxy refused crew %s on restore: %s", entry.name, reply.error)
                continue
            # The set the other workers hold (minted again only if it is gone from the cache).
            leaves = self._leaves(entry)
            if leaves is not None:
                reply = await client.request(leaves)
                if not reply.ok:
                    # Its ruled hosts are refused and its provider tunnels stay opaque then:
                    # nothing is let through that the rules would hold.
                    log.error("proxy refused crew %s's leaves on restore: %s", entry.name,
                              reply.error)  # fmt: skip
            approvals = self._approvals(entry.name)
            if approvals is not None:
                reply = await client.request(approvals)
                if not reply.ok:
                    # A grant could be missing (refused: fail closed), a denial too; a grant
                    # ended by a denial must not come back: the worker does not serve.
                    raise OSError(f"the worker refused crew {entry.name}'s approvals: "
                                  f"{reply.error}")  # fmt: skip
        if self.credentials_source is not None:
            reply = await client.request(control.CredentialsSet(crews=self.credentials_source()))
            if not reply.ok:
                # Fail closed: a worker without the crews' keys must not serve them.
                raise OSError(f"the worker refused the credentials: {reply.error}")
        if self.keeper_channel is not None:
            reply = await client.request(self.keeper_channel)
            if not reply.ok:
                raise OSError(f"the worker refused the keeper channel: {reply.error}")

    async def _broadcast(
        self,
        message: control.ControlMessage,
        listener: socket.socket | None = None,
        *,
        fds: Sequence[socket.socket] = (),
        timeout: float = REQUEST_TIMEOUT,
        killed: list[int] | None = None,
    ) -> control.ControlReply:
        """Send to every running worker (the caller holds self.lock); the first refusal, or ok
        (`changed` if any worker changed something). A worker that does not answer within
        `timeout` is killed (its pid appended to `killed`): it restarts with the whole state."""
        with trio.move_on_after(timeout):
            while not any(w.client is not None for w in self.workers):
                await trio.sleep(0.05)
        targets = [w for w in self.workers if w.client is not None]
        if not targets:
            raise Unavailable("the proxy is not running")
        replies: list[control.ControlReply] = []

        async def one(worker: _Worker, client: ChannelClient) -> None:
            try:
                with trio.fail_after(timeout):
                    replies.append(await client.request(message, listener=listener, fds=fds))
            except _CHANNEL_ERRORS as exc:
                # Its state may now differ from the others' (and a late answer would be read
                # as the answer to the next request): it restarts with the whole state.
                pid = worker.kill(f"did not apply {type(message).__struct_config__.tag}: {exc}")
                if pid is not None and killed is not None:
                    killed.append(pid)

        async with trio.open_nursery() as nursery:
            for worker in targets:
                assert worker.client is not None
                nursery.start_soon(one, worker, worker.client)
        if not replies:
            raise Unavailable("no proxy worker answered")
        for reply in replies:
            if not reply.ok:
                return reply
        return control.ControlReply(ok=True, changed=any(r.changed for r in replies))

    def kill_all(self, why: str) -> tuple[int, ...]:
        """SIGKILL every running worker (each restarts with the whole state); their pids. The
        workers are applianced's own unreaped children, so a pid here is never a recycled one."""
        return tuple(pid for w in self.workers if (pid := w.kill(why)) is not None)

    async def _request(
        self, message: control.ControlMessage, listener: socket.socket | None = None
    ) -> control.ControlReply:
        async with self.lock:
            return await self._broadcast(message, listener)

    def bind(self, gateway: str) -> socket.socket:
        """A listening socket on the crew's gateway (root binds; the workers only accept)."""
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

    def bind_dns(self, gateway: str) -> tuple[socket.socket, socket.socket]:
        """A UDP socket and a listening TCP socket on the crew's gateway, port 53 (root binds;
        the workers serve the crew's DNS responder on them). Unavailable if the port is taken:
        the crew's nftables rules let it reach its gateway's port 53, where another DNS server
        bound to every address of the host would answer it, recursing for it (a way out for
        anything a query can carry), so the crew is not served at all (fail closed)."""
        family = socket.AF_INET6 if ":" in gateway else socket.AF_INET
        udp = socket.socket(family, socket.SOCK_DGRAM)
        tcp = socket.socket(family, socket.SOCK_STREAM)
        try:
            udp.bind((gateway, DNS_PORT))
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tcp.bind((gateway, DNS_PORT))
            tcp.listen(DNS_BACKLOG)
        except OSError as exc:
            udp.close()
            tcp.close()
            raise Unavailable(
                f"cannot serve the crew's DNS on {gateway}:{DNS_PORT} ({exc.strerror or exc}): "
                "another DNS server listens on this host's addresses; bind it to its own "
                "addresses only, or set [net] dns = false (crews then have no DNS, and port 53 "
                "stays dropped)"
            ) from None
        return udp, tcp

    def resolv_conf(self, name: str) -> Path | None:
        """The crew's resolv.conf, naming its own DNS on its gateway, written now; None if the
        crew has no DNS from us (off, or the port was taken: its container keeps the engine's).
        The crew's container gets it read-only at /etc/resolv.conf (crews.py)."""
        entry = self.crews.get(name)
        if entry is None or name not in self.dns_sockets:
            return None
        directory = self.dns_dir / name
        directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        path = directory / "resolv.conf"
        # Readable by the crew's unprivileged user in its container; written whole (a crew
        # re-created on a new gateway gets a new file, never half of one).
        partial = directory / "resolv.conf.tmp"
        partial.write_text(resolv_conf_text(entry.gateway))
        partial.chmod(0o644)
        partial.replace(path)
        return path

    def forget_resolv_conf(self, name: str) -> None:
        for leftover in ("resolv.conf", "resolv.conf.tmp"):
            (self.dns_dir / name / leftover).unlink(missing_ok=True)
        try:
            (self.dns_dir / name).rmdir()
        except OSError:
            pass

    async def add_crew(self, entry: CrewEntry) -> None:
        listener = self.bind(entry.gateway)
        try:
            dns = self.bind_dns(entry.gateway) if self.dns else None
        except BaseException:
            listener.close()
            raise
        try:
            async with self.lock:
                self.listeners[entry.name] = listener
                if dns is not None:
                    self.dns_sockets[entry.name] = dns
                self.crews[entry.name] = entry
                reply = await self._broadcast(
                    _crew_add(entry, dns=dns is not None), listener, fds=dns or ()
                )
                if reply.ok:
                    leaves = self._leaves(entry, strict=True)
                    if leaves is not None:
                        reply = await self._broadcast(leaves)
                        if reply.ok:
                            self.leaves_sent[entry.name] = _fingerprint(leaves)
                    approvals = self._approvals(entry.name)
                    if reply.ok and approvals is not None:
                        reply = await self._broadcast(approvals)
            if not reply.ok:
                raise Unavailable(f"the proxy refused crew {entry.name!r}: {reply.error}")
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.remove_crew(entry.name)
            raise

    async def remove_crew(self, name: str) -> None:
        """Idempotent. The workers end the crew's connections; our copy of the socket closes."""
        async with self.lock:
            self.crews.pop(name, None)
            self.leaves_sent.pop(name, None)
            listener = self.listeners.pop(name, None)
            dns = self.dns_sockets.pop(name, ())
            self.forget_resolv_conf(name)
            try:
                if any(w.client is not None for w in self.workers):
                    reply = await self._broadcast(control.CrewRemove(name=name))
                    if not reply.ok:
                        raise Unavailable(
                            f"the proxy refused to remove crew {name!r}: {reply.error}"
                        )
            finally:
                if listener is not None:
                    listener.close()
                for sock in dns:
                    sock.close()

    async def allow(self, name: str, host: str) -> bool:
        async with self.lock:
            entry = self.crews.get(name)
            if entry is not None and host not in entry.allow:
                self.crews[name] = msgspec.structs.replace(entry, allow=(*entry.allow, host))
            reply = await self._broadcast(control.AllowHost(crew=name, host=host))
        if not reply.ok:
            raise Unavailable(f"the proxy refused {host!r} for crew {name!r}: {reply.error}")
        return reply.changed

    def _approvals(self, name: str) -> control.CrewApprovals | None:
        return None if self.approvals_source is None else self.approvals_source(name)

    async def push_approvals(self, name: str) -> None:
        """The crew's whole set of grants and denials, read from `approvals_source` under the
        lock (so two answers in a row reach the workers in the order of their sets, never an
        older set last), to every worker. A worker that does not apply it is killed (it
        restarts with the set from the source): a grant a denial has ended must not live on
        in one worker. Unavailable if any refused."""
        async with self.lock:
            if name not in self.crews:
                return  # not served: the set goes with its crew_add
            message = self._approvals(name) or control.CrewApprovals(crew=name)
            reply = await self._broadcast(message)
            if not reply.ok:
                self.kill_all(f"did not apply crew_approvals: {reply.error}")
        if not reply.ok:
            raise Unavailable(f"the proxy refused crew {name}'s approvals: {reply.error}")

    async def set_net(self, name: str, net: tuple[str, ...]) -> bool:
        """A crew's address rules replaced in every worker (and for workers started later)."""
        async with self.lock:
            entry = self.crews.get(name)
            if entry is not None:
                self.crews[name] = msgspec.structs.replace(entry, net=net)
            reply = await self._broadcast(control.CrewNet(crew=name, net=net))
        if not reply.ok:
            raise Unavailable(f"the proxy refused the rules for crew {name!r}: {reply.error}")
        return reply.changed

    async def set_audit_paused(self, paused: bool) -> None:
        """Refuse (or serve again) every crew's traffic while the journal cannot record it."""
        async with self.lock:
            self.audit_paused = paused
            reply = await self._broadcast(control.AuditPaused(paused=paused))
        if not reply.ok:
            raise Unavailable(f"the proxy refused audit_paused={paused}: {reply.error}")

    async def set_credentials(
        self, crews: dict[str, dict[str, str]], *, timeout: float = REQUEST_TIMEOUT
    ) -> tuple[int, ...]:
        """Replace every crew's store credentials in every worker (the whole map). Returns the
        pids of the workers killed because they did not confirm within `timeout` (each restarts
        and reads the map from the store); Unavailable if a worker refused or none answered."""
        killed: list[int] = []
        async with self.lock:
            reply = await self._broadcast(
                control.CredentialsSet(crews=crews), timeout=timeout, killed=killed
            )
        if not reply.ok:
            raise Unavailable(f"the proxy refused the credentials: {reply.error}")
        return tuple(killed)

    def _leaves(
        self,
        entry: CrewEntry,
        early: datetime.timedelta = datetime.timedelta(0),
        *,
        strict: bool = False,
    ) -> control.CrewLeaves | None:
        """The crew's leaves from the source; an error there (a CA that does not authenticate)
        raised if `strict` (a create fails), else logged and the crew left without (a worker's
        restore and the renewal must go on for the other crews)."""
        if self.leaves_source is None:
            return None
        try:
            return self.leaves_source(entry, early)
        except Exception as exc:
            if strict:
                raise
            log.error("crew %s: no leaves: %s", entry.name, exc)
            return None

    async def push_leaves(self, early: datetime.timedelta = datetime.timedelta(0)) -> int:
        """Every crew's set, sent where it changed (renewed leaves, a grant that adds or removes
        a provider host); how many crews were sent one. A refusal is logged, and that crew's
        set sent again next time."""
        sent = 0
        async with self.lock:
            for entry in list(self.crews.values()):
                leaves = self._leaves(entry, early)
                if leaves is None:
                    continue
                fingerprint = _fingerprint(leaves)
                if self.leaves_sent.get(entry.name) == fingerprint:
                    continue
                self.leaves_sent.pop(entry.name, None)
                reply = await self._broadcast(leaves)
                if not reply.ok:
                    log.error("proxy refused crew %s's leaves: %s", entry.name, reply.error)
                    continue
                self.leaves_sent[entry.name] = fingerprint
                sent += 1
        return sent

    async def ping(self) -> bool:
        try:
            return (await self._request(control.Ping())).ok
        except Unavailable:
            return False


def resolv_conf_text(gateway: str) -> str:
    """A crew's resolv.conf: its own DNS only. ndots:1 so that a bare name is asked as is
    first; a short timeout and two attempts, since the answer comes from the same host."""
    return f"nameserver {gateway}\noptions ndots:1 timeout:2 attempts:2\n"


def _crew_add(entry: CrewEntry, *, dns: bool = False) -> control.CrewAdd:
    return control.CrewAdd(
        name=entry.name,
        gateway=entry.gateway,
        mode=entry.mode,
        allow=entry.allow,
        listener=True,
        ssrf_allow=entry.ssrf_allow,
        rules=entry.rules,
        net=entry.net,
        dns=dns,
    )


def _fingerprint(leaves: control.CrewLeaves) -> tuple[tuple[str, str], ...]:
    return tuple((leaf.host, leaf.cert_pem) for leaf in leaves.leaves)
