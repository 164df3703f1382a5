"""The crew manager: create, remove, allow, run, and reconcile at start.

Theory of operation
-------------------
Creating a crew is a sequence of named steps; each registers its undo *before* it runs (every
undo is idempotent and safe on a half-done step), so a failure anywhere undoes everything in
reverse and the error names the step:

    validate          name, duplicates, mode, allow hosts, runtime, memory, cpus: before anything
    record intent     state row, phase "creating"            undo: delete the row
    create infra      provider.create_infra -> Pod            undo: provider.remove_crew
    attach network    netns: rules, then veth, addresses      undo: networks.release
    crew CA           the crew's CA (made if it has none) and undo: forget a CA made here
                      its trust files (crew_tls.py)
    add to proxy      bind gateway:port, proxy crew_add and   undo: proxy crew_remove, close
                      crew_leaves
    start agent       provider.start_agent (proxy env, the    (undone by provider.remove_crew)
                      crew's trust)
    commit            phase "ready"

The agent starts last: its network rules and its proxy exist before any agent process does.
`on_step(crew, step)` is called after each step (the tests SIGKILL the daemon there).

Removing runs the other way (phase "removing", proxy, containers, network, row) and is never
rolled back: a failure leaves the phase "removing", and `crew rm` again, or the next start,
finishes it.

Reconciliation at every start (before the admin socket opens), with the rules in docs/daemon.md:
netns reconcile first (rules and links), then every state row against the containers the
provider owns: "creating" is rolled back, "removing" finished, containers and networks without a
row removed; a "ready" crew whose containers all run is served again (proxy crew_add); a "ready"
crew with a container gone, or a "stopped" one, is re-created from its row (same name, same
subnet, so the same gateway); if that fails it is torn down and marked "failed".

The infra pool (`[crews] infra_pool`, default 2): `keep_pool` keeps that many *slots*, each an
infra container created and its network attached (rules, then veth) under a slot id
`<prefix>pool_<hex>` (an underscore: never a crew name; the container's immutable labels and the
netns state carry the slot id), with no agent and no proxy listener. `create` takes the oldest
ready slot if there is one: the crew's row (with `slot` set) is inserted and the pool row deleted
in one transaction, then the crew is added to the proxy and its agent started in the slot's
namespace; the steps "create infra" and "attach network" are skipped. A crew's `key` (its slot
id, else its name) is what its infra container and network are known by, for the rest of its
life (re-created under it at reconcile, so it keeps its gateway). A slot handed to a crew is
never handed to another: rollback and `crew rm` destroy it with the crew. Free slots are
reconciled at start (kept only if exactly their infra runs and their network is ready, else
destroyed) and destroyed by `stop_all`. A fill interrupted by a crash stays "filling" in the
state and is destroyed at the next start; cancelled, it is undone at once (shielded).

All provider and netns calls block (milliseconds to a second) and run in threads; one lock
serializes the operations that change crews, so two `create`s of one name cannot race.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import re
import secrets
import signal
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import trio

from appliance.journal.entries import CrewFailed, CrewNetChanged, CrewRemoved
from appliance.journal.recorder import JournalRecorder, crew_created
from appliance.runtime.base import (
    ContainerRole,
    CrewSpec,
    ExecExited,
    ExecOutput,
    OwnedContainer,
    Pod,
    RuntimeProvider,
    agent_keys,
)
from netns import CrewNetworks, NetnsError, netns_of_pid
from netns.addressing import check_crew_id
from netns.manager import NetworkReport
from proxycore.config import RuleConfig, allowlist_sources, host_rule
from proxycore.errors import PolicyDenied
from proxycore.protocol.l7 import MAX_RULES, RuleError
from proxycore.protocol.netrules import MAX_NET_RULES, parse_net_rule
from proxycore.protocol.policy import Allowlist, NetworkMode, normalize_host, parse_mode
from proxycore.protocol.ssrf import AddressGuard

from . import messages
from .config import ApplianceConfig
from .crew_tls import CrewTLS
from .errors import CrewBusy, CrewExists, CrewNotFound, DaemonError, InvalidRequest, StepFailed
from .proxy import CrewEntry, ProxyPool
from .state import CrewPhase, CrewRow, PoolSlot, SlotPhase, StateStore

log = logging.getLogger("applianced.crews")

StepHook = Callable[[str, str], None]
# The intersection of what netns (interface names), the proxy (crew names) and the container
# engine (container names) accept.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")
MODES = tuple(mode.value for mode in NetworkMode)
# Tests: "STEP" or "CREW:STEP" -> SIGKILL the daemon right after that step.
KILL_ENV = "APPLIANCED_TEST_KILL_AFTER_STEP"
# Where a crew's own resolv.conf is mounted in its agent container (ProxyPool.resolv_conf).
RESOLV_CONF = "/etc/resolv.conf"


def kill_hook_from_env() -> StepHook | None:
    target = os.environ.get(KILL_ENV)
    if not target:
        return None

    def hook(crew: str, step: str) -> None:
        if target in (step, f"{crew}:{step}"):
            log.warning("%s=%s: killing myself after %s of %s", KILL_ENV, target, step, crew)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def agent_environment(config: ApplianceConfig, crew: str, gateway: str) -> dict[str, str]:
    """What crew `crew`'s agent process sees: the proxy, the provider base URLs and the crew's
    placeholder keys; never a credential."""
    base = f"http://{gateway}:{config.daemon.proxy_port}"
    openai = config.proxy.providers.openai.base_url or ""
    # The OpenAI SDKs expect the base URL to include /v1; the proxy's /openai route maps onto
    # the configured base URL, which may or may not include it.
    openai_suffix = "" if openai.rstrip("/").endswith("/v1") else "/v1"
    return {
        "HTTP_PROXY": base,
        "HTTPS_PROXY": base,
        "http_proxy": base,
        "https_proxy": base,
        # The gateway too: the base URLs below point at the proxy itself, and a client that
        # honours HTTP_PROXY (httpx, curl) must not send them to the proxy as forward requests.
        "NO_PROXY": f"localhost,127.0.0.1,{gateway}",
        "no_proxy": f"localhost,127.0.0.1,{gateway}",
        "ANTHROPIC_BASE_URL": f"{base}/anthropic",
        "OPENAI_BASE_URL": f"{base}/openai{openai_suffix}",
        "GOOGLE_GEMINI_BASE_URL": f"{base}/google",
        # placeholders so the agent CLIs start (runtime/base.py says why they are no credential)
        **agent_keys(crew),
        # Telemetry, error reports and update checks would be refused by a restricted policy
        # anyway; this keeps Claude Code from trying (and the refusals out of the events).
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "HOME": "/home/agent",
    }


class _Steps:
    def __init__(self, crew: str, on_step: StepHook | None) -> None:
        self.crew = crew
        self.on_step = on_step
        self.undo: list[tuple[str, Callable[[], Awaitable[object]]]] = []

    async def run(
        self,
        name: str,
        work: Callable[[], Awaitable[object]],
        undo: Callable[[], Awaitable[object]] | None = None,
    ) -> Any:
        if undo is not None:
            self.undo.append((name, undo))
        try:
            result = await work()
        except BaseException as exc:
            await self.rollback(name, exc)
            raise AssertionError("unreachable") from None
        if self.on_step is not None:
            self.on_step(self.crew, name)
        return result

    async def rollback(self, name: str, exc: BaseException) -> None:
        errors: list[str] = []
        with trio.CancelScope(shield=True):
            for done, undo in reversed(self.undo):
                try:
                    await undo()
                except Exception as undo_exc:
                    errors.append(f"undo {done!r}: {undo_exc}")
        if not isinstance(exc, Exception):
            raise exc
        raise StepFailed(self.crew, name, exc, tuple(errors)) from exc


class CrewManager:
    def __init__(
        self,
        config: ApplianceConfig,
        provider: RuntimeProvider,
        networks: CrewNetworks,
        store: StateStore,
        proxy: ProxyPool,
        images: tuple[str, str],
        *,
        on_step: StepHook | None = None,
        tls: CrewTLS | None = None,
    ) -> None:
        self.config = config
        # The crews' CAs (None: crews get none, their tunnels stay opaque; unit tests).
        self.tls = tls
        self.provider = provider
        self.networks = networks
        self.store = store
        self.proxy = proxy
        self.agent_image, self.infra_image = images
        self.on_step = on_step
        self.lock = trio.Lock()
        self.journal = JournalRecorder()  # applianced sets the real one (appliance/journal)
        self._runtimes: tuple[str, ...] | None = None
        # The pool: one fill at a time (held across a fill and by whoever destroys free
        # slots), and an event set when a slot is taken (keep_pool refills).
        self._pool_lock = trio.Lock()
        self._pool_wanted = trio.Event()

    # -- helpers ----------------------------------------------------------------------------

    async def runtimes(self) -> tuple[str, ...]:
        if self._runtimes is None:
            self._runtimes = tuple(await trio.to_thread.run_sync(self.provider.runtimes))
        return self._runtimes

    def _spec(
        self,
        row: CrewRow,
        env: dict[str, str] | None = None,
        mounts: tuple[tuple[str, str, bool], ...] = (),
    ) -> CrewSpec:
        return CrewSpec(
            name=row.name,
            image=self.agent_image,
            infra_image=self.infra_image,
            runtime=row.runtime,
            memory_bytes=row.memory_bytes,
            cpus=row.cpus,
            env=env or {},
            mounts=mounts,
        )

    def _row(self, name: str) -> CrewRow:
        row = self.store.get(name)
        if row is None:
            raise CrewNotFound(name)
        return row

    # -- validation -------------------------------------------------------------------------

    async def validate(self, request: messages.CreateCrew) -> CrewRow:
        """Everything checked before anything is created; errors name the argument."""
        name = request.name
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequest(
                f"argument name: {name!r} must be 1-63 letters, digits or '-', "
                "starting with a letter or digit"
            )
        prefix = self.config.crews.name_prefix
        if not name.startswith(prefix):
            raise InvalidRequest(f"argument name: {name!r} must start with {prefix!r} here")
        try:
            check_crew_id(name)
        except NetnsError as exc:
            raise InvalidRequest(f"argument name: {exc}") from None
        if self.store.get(name) is not None:
            raise CrewExists(name)
        if request.mode not in MODES:
            raise InvalidRequest(
                f"argument mode: {request.mode!r} is not one of {', '.join(MODES)}"
            )
        allow: list[str] = []
        for host in request.allow:
            try:
                normalized = normalize_host(host)
                Allowlist([normalized])
            except (PolicyDenied, ValueError):
                raise InvalidRequest(f"argument allow: not a valid host name: {host!r}") from None
            if normalized not in allow:
                allow.append(normalized)
        try:
            AddressGuard(request.ssrf_allow)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"argument ssrf_allow: {exc}") from None
        rules = self._rules(request.rules)
        net = self._net(request.net)
        crews = self.config.crews
        runtime = request.runtime or crews.default_runtime
        available = await self.runtimes()
        if runtime not in available:
            raise InvalidRequest(
                f"argument runtime: {runtime!r} is not available here "
                f"(available: {', '.join(available) or 'none'})"
            )
        memory = (
            crews.default_memory_bytes if request.memory_bytes is None else request.memory_bytes
        )
        if not crews.min_memory_bytes <= memory <= crews.max_memory_bytes:
            raise InvalidRequest(
                f"argument memory: {memory} bytes is outside {crews.min_memory_bytes}.."
                f"{crews.max_memory_bytes}"
            )
        cpus = crews.default_cpus if request.cpus is None else request.cpus
        if not crews.min_cpus <= cpus <= self.config.max_cpus:
            raise InvalidRequest(
                f"argument cpus: {cpus} is outside {crews.min_cpus}..{self.config.max_cpus}"
            )
        now = time.time()
        return CrewRow(
            name=name,
            mode=request.mode,
            allow=tuple(allow),
            runtime=runtime,
            memory_bytes=memory,
            cpus=cpus,
            phase=CrewPhase.CREATING,
            created=now,
            updated=now,
            ssrf_allow=tuple(dict.fromkeys(request.ssrf_allow)),
            rules=rules,
            net=net,
        )

    @staticmethod
    def _rules(requested: tuple[messages.CrewRule, ...]) -> tuple[RuleConfig, ...]:
        """The request's method and path rules, checked by the proxy's own validation (the
        workers check them again at crew_add: a rule they would refuse is refused here, before
        anything is created), with their hosts normalized as the proxy compares them."""
        if len(requested) > MAX_RULES:
            raise InvalidRequest(f"argument rule: over {MAX_RULES} rules")
        rules: list[RuleConfig] = []
        for index, rule in enumerate(requested):
            config = RuleConfig(
                host=rule.host, methods=rule.methods, preset=rule.preset, paths=rule.paths
            )
            try:
                checked = host_rule(config)
            except RuleError as exc:
                raise InvalidRequest(f"argument rule[{index}]: {exc}") from None
            rules.append(msgspec.structs.replace(config, host=checked.host))
        return tuple(rules)

    def _net(self, requested: tuple[str, ...]) -> tuple[str, ...]:
        """The request's address rules in their one spelling, each once: checked by the
        proxy's parser, and against the crews' pool, which no allow rule may reach into (a
        crew would reach another crew, or speak as it to the proxy)."""
        if len(requested) > MAX_NET_RULES:
            raise InvalidRequest(f"argument net: over {MAX_NET_RULES} rules")
        specs: dict[str, None] = {}
        pool = ipaddress.IPv4Network(self.config.net.pool)
        for index, text in enumerate(requested):
            try:
                rule = parse_net_rule(text)
            except ValueError as exc:
                raise InvalidRequest(f"argument net[{index}]: {exc}") from None
            if rule.action == "allow" and rule.network.overlaps(pool):
                raise InvalidRequest(
                    f"argument net[{index}]: {text!r} reaches into the crews' pool {pool}"
                )
            specs[rule.spec] = None
        return tuple(specs)

    # -- create / remove --------------------------------------------------------------------

    async def create(self, request: messages.CreateCrew) -> CrewRow:
        async with self.lock:
            row = await self.validate(request)
            steps = _Steps(row.name, self.on_step)
            slot = self._free_slot()
            if slot is not None:
                # Its infra and network exist already; the row says so from the start, so a
                # rollback (or the next start, if this one crashes) destroys the slot with it.
                row = msgspec.structs.replace(
                    row, slot=slot.slot, infra_id=slot.infra_id, gateway=slot.gateway
                )

            taken = False

            async def record() -> None:
                nonlocal taken
                try:
                    if slot is None:
                        self.store.insert(row)
                    else:
                        self.store.take_slot(row, slot)
                        taken = True
                except sqlite3.IntegrityError:
                    raise CrewExists(row.name) from None
                if slot is not None:
                    self._pool_wanted.set()

            async def forget() -> None:
                if taken:
                    assert slot is not None
                    # Never returned to the pool: the crew's proxy and perhaps its agent were
                    # there; a slot handed out is destroyed with the crew.
                    await self._destroy_slot(slot.slot)
                self.store.delete(row.name)

            await steps.run("record intent", record, forget)
            async with self.journal.crew_change(row.name, crew_created(row)):
                await self._bring_up(row, steps, slot)
            return self._row(row.name)

    async def _bring_up(self, row: CrewRow, steps: _Steps, slot: PoolSlot | None = None) -> None:
        """Containers, network, proxy, agent, then phase ready; each step undone on failure.

        With a pool slot, its infra and network are the crew's already (the first two steps are
        skipped). A crew that once took a slot is re-created (reconcile) under the slot's id,
        so it keeps its subnet and gateway like any other."""
        name, key = row.name, row.key
        spec = msgspec.structs.replace(self._spec(row), name=key)

        async def remove_containers() -> None:
            await trio.to_thread.run_sync(self.provider.remove_crew, name)
            if key != name:
                await trio.to_thread.run_sync(self.provider.remove_crew, key)

        if slot is not None:
            assert slot.infra_id is not None and slot.infra_pid is not None and slot.gateway
            pod = Pod(crew=key, infra_id=slot.infra_id, infra_pid=slot.infra_pid, runtime="")
            gateway = slot.gateway
            steps.undo.append(("start agent", remove_containers))
            if row.net:
                # The slot's network was made without rules: they are the crew's, from now on.
                # Undone with the slot (destroyed on a rollback: `create`).
                async def address_rules() -> None:
                    await trio.to_thread.run_sync(self.networks.set_net_rules, key, row.net)

                await steps.run("address rules", address_rules)
        else:

            async def create_infra() -> Pod:
                made = await trio.to_thread.run_sync(self.provider.create_infra, spec)
                self.store.update(name, infra_id=made.infra_id)
                return made

            pod = await steps.run("create infra", create_infra, remove_containers)

            async def attach() -> str:
                network = await trio.to_thread.run_sync(
                    self.networks.attach, key, netns_of_pid(pod.infra_pid), row.net
                )
                self.store.update(name, gateway=network.gateway)
                return network.gateway

            async def release() -> None:
                await trio.to_thread.run_sync(self.networks.release, key)

            gateway = await steps.run("attach network", attach, release)
        env = agent_environment(self.config, name, gateway)
        mounts: tuple[tuple[str, str, bool], ...] = ()
        tls = self.tls
        if tls is not None:
            made = False

            async def install_ca() -> None:
                nonlocal made, env, mounts
                trust, made = tls.ensure(name)
                isolated = self.provider.isolated
                env = {**env, **trust.environment(isolated=isolated)}
                # Without isolation there is no container to mount into: the variables name
                # the host's files (crew_tls.py).
                mounts = trust.mounts() if isolated else ()

            async def forget_ca() -> None:
                if made:  # a crew re-created at start keeps the CA its row had
                    tls.forget(name)

            await steps.run("crew CA", install_ca, forget_ca)
        entry = CrewEntry(
            name=name,
            gateway=gateway,
            mode=row.mode,
            allow=row.allow,
            ssrf_allow=row.ssrf_allow,
            rules=row.rules,
            net=row.net,
        )

        async def add_to_proxy() -> None:
            await self.proxy.add_crew(entry)

        async def remove_from_proxy() -> None:
            await self.proxy.remove_crew(name)

        await steps.run("add to proxy", add_to_proxy, remove_from_proxy)
        if self.provider.isolated:
            # The crew resolves through its own DNS on its gateway (docs/proxy.md "DNS"), if the
            # proxy serves it one; without isolation there is no container to mount into.
            resolv_conf = await trio.to_thread.run_sync(self.proxy.resolv_conf, name)
            if resolv_conf is not None:
                mounts = (*mounts, (str(resolv_conf), RESOLV_CONF, True))
        agent_spec = self._spec(row, env, mounts)
        # The infra's label names the slot (labels are immutable); the pod is the crew's.
        agent_pod = msgspec.structs.replace(pod, crew=name, runtime=row.runtime)

        async def start_agent() -> None:
            agent_id = await trio.to_thread.run_sync(
                self.provider.start_agent, agent_spec, agent_pod
            )
            self.store.update(name, agent_id=agent_id)

        await steps.run("start agent", start_agent)

        async def commit() -> None:
            self.store.update(name, phase=CrewPhase.READY, error=None)

        await steps.run("commit", commit)

    async def _tear_down(self, row: CrewRow, *, keep_subnet: bool) -> None:
        """Proxy, containers, network; each attempted even if an earlier one failed."""
        name, key = row.name, row.key
        errors: list[str] = []

        async def from_proxy() -> None:
            await self.proxy.remove_crew(name)

        async def containers() -> None:
            # The crew's volumes (HOME, tools) go with it only when the crew itself goes.
            await trio.to_thread.run_sync(
                functools.partial(self.provider.remove_crew, name, volumes=not keep_subnet)
            )
            if key != name:  # the infra of a pool slot carries the slot's label
                await trio.to_thread.run_sync(self.provider.remove_crew, key)

        async def network() -> None:
            forget = self.networks.detach if keep_subnet else self.networks.release
            await trio.to_thread.run_sync(forget, key)

        steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("remove from proxy", from_proxy),
            ("remove containers", containers),
            ("detach network", network),
        ]
        for step, work in steps:
            try:
                await work()
            except Exception as exc:
                errors.append(f"{step}: {exc}")
                continue
            if self.on_step is not None:
                self.on_step(name, step)
        if errors:
            raise DaemonError(f"crew {name!r}: teardown incomplete: " + "; ".join(errors))

    async def remove(self, name: str) -> None:
        async with self.lock:
            row = self._row(name)
            self.store.update(name, phase=CrewPhase.REMOVING)
            if self.on_step is not None:
                self.on_step(name, "record removal")
            with trio.CancelScope(shield=True):
                await self._tear_down(row, keep_subnet=False)
                self.store.delete(name)
                self._forget_ca(name)
                await self.journal.record(CrewRemoved(crew=name))

    async def allow(self, name: str, host: str) -> bool:
        async with self.lock:
            row = self._row(name)
            try:
                normalized = normalize_host(host)
                Allowlist([normalized])
            except (PolicyDenied, ValueError):
                raise InvalidRequest(f"argument host: not a valid host name: {host!r}") from None
            if row.phase is not CrewPhase.READY:
                raise CrewBusy(f"crew {name!r} is {row.phase.value}, not ready")
            # The state first: a crash after it is restored at the next start; the proxy's
            # answer says whether the running policy changed.
            if normalized not in row.allow:
                self.store.update(name, allow=(*row.allow, normalized))
            changed = await self.proxy.allow(name, normalized)
            await self.journal.allowlist_changed(name, normalized, changed)
            return changed

    async def set_net(self, name: str, net: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
        """Replace a crew's address rules: the row (the intent: a crash after it is repaired at
        the next start), the kernel's sets (one batch), the proxy, the journal. Returns the
        rules as applied and whether they changed."""
        async with self.lock:
            row = self._row(name)
            normalized = self._net(net)
            if row.phase is not CrewPhase.READY:
                raise CrewBusy(f"crew {name!r} is {row.phase.value}, not ready")
            if normalized == row.net:
                return normalized, False
            self.store.update(name, net=normalized)
            try:
                await trio.to_thread.run_sync(self.networks.set_net_rules, row.key, normalized)
            except NetnsError as exc:
                # The kernel kept the former rules (one atomic batch): so does everything else.
                self.store.update(name, net=row.net)
                raise DaemonError(f"crew {name!r}: address rules not applied: {exc}") from None
            await self.proxy.set_net(name, normalized)
            await self.journal.record(CrewNetChanged(crew=name, net=normalized))
            return normalized, True

    def _forget_ca(self, name: str) -> None:
        if self.tls is not None:
            self.tls.forget(name)

    # -- run --------------------------------------------------------------------------------

    async def run(
        self, name: str, argv: tuple[str, ...], timeout: float | None, **attach: Any
    ) -> AsyncIterator[ExecOutput | ExecExited]:
        row = self._row(name)
        if row.phase is not CrewPhase.READY:
            raise CrewBusy(f"crew {name!r} is {row.phase.value}, not ready")
        if not argv:
            raise InvalidRequest("argument argv: needs a command")
        if timeout is not None and timeout <= 0:
            raise InvalidRequest("argument timeout: must be > 0")
        # attach: stdin, tty, size for a provider with an attached exec (run_session.py)
        stream = self.provider.exec(name, list(argv), timeout=timeout, **attach)
        return self.journal.run(name, argv, timeout, stream)

    # -- inspection -------------------------------------------------------------------------

    async def info(
        self, row: CrewRow, owned: list[OwnedContainer] | None = None
    ) -> messages.CrewInfo:
        if owned is None:
            owned = await trio.to_thread.run_sync(self.provider.owned)
        plan = self.networks.plan(row.key)
        return messages.CrewInfo(
            name=row.name,
            phase=row.phase.value,
            mode=row.mode,
            allow=row.allow,
            ssrf_allow=row.ssrf_allow,
            rules=tuple(messages.CrewRule(**msgspec.structs.asdict(rule)) for rule in row.rules),
            net=row.net,
            runtime=row.runtime,
            memory_bytes=row.memory_bytes,
            cpus=row.cpus,
            created=row.created,
            gateway=plan.gateway if plan else row.gateway,
            address=plan.address if plan else None,
            infra_id=row.infra_id,
            agent_id=row.agent_id,
            error=row.error,
            containers=tuple(
                messages.ContainerInfo(c.role.value, c.container_id, c.running)
                for c in owned
                if c.crew in (row.name, row.key)
            ),
            effective_allow=self.effective_allow(row),
        )

    def effective_allow(self, row: CrewRow) -> tuple[messages.AllowEntry, ...]:
        """The allowlist the proxy workers hold for this crew (their config, the row's allow),
        or () if its mode does not consult one."""
        if parse_mode(row.mode)[0] is not NetworkMode.RESTRICTED:
            return ()
        return tuple(
            messages.AllowEntry(host, sources)
            for host, sources in allowlist_sources(self.proxy.config, row.allow)
        )

    async def net_report(self) -> NetworkReport:
        """netns's report with each crew under its own name (a crew that took a pool slot has
        its network keyed by the slot's id), the crews first, then the free pool slots."""
        report = await trio.to_thread.run_sync(self.networks.show)
        names = {row.key: row.name for row in self.store.crews()}
        entries = [
            msgspec.structs.replace(entry, crew=names.get(entry.crew, entry.crew))
            for entry in report.crews
        ]
        entries.sort(key=lambda entry: entry.crew not in names.values())
        return msgspec.structs.replace(report, crews=tuple(entries))

    async def list_crews(self) -> list[messages.CrewInfo]:
        owned = await trio.to_thread.run_sync(self.provider.owned)
        return [await self.info(row, owned) for row in self.store.crews()]

    async def show(self, name: str) -> messages.CrewInfo:
        return await self.info(self._row(name))

    # -- reconcile and shutdown -------------------------------------------------------------

    async def reconcile(self) -> list[str]:
        """Make the world match the state rows; returns what changed (docs/daemon.md rules)."""
        changes: list[str] = []
        async with self.lock:
            report = await trio.to_thread.run_sync(self.networks.reconcile)
            changes += [
                f"network: {c.action} {c.detail}" + (f" ({c.crew})" if c.crew else "")
                for c in report.changes
            ]
            prefix = self.config.crews.name_prefix
            owned = [
                c
                for c in await trio.to_thread.run_sync(self.provider.owned)
                if c.crew.startswith(prefix)
            ]
            rows = {row.name: row for row in self.store.crews()}
            slots = {slot.slot: slot for slot in self.store.pool()}
            # Container labels and network records name a crew, or the pool slot a crew took
            # (its key), or a free pool slot.
            known = set(rows) | {row.key for row in rows.values()} | set(slots)
            by_crew: dict[str, list[OwnedContainer]] = {}
            for container in owned:
                by_crew.setdefault(container.crew, []).append(container)

            for crew in sorted(set(by_crew) - known):
                await trio.to_thread.run_sync(self.provider.remove_crew, crew)
                changes.append(f"{crew}: removed containers with no crew row")
            for record in self.networks.records():
                if record.crew not in known:
                    await trio.to_thread.run_sync(self.networks.release, record.crew)
                    changes.append(f"{record.crew}: released network with no crew row")
            for crew in self.tls.known() if self.tls is not None else ():
                if crew not in rows:  # a crash between a row's delete and its CA's
                    self._forget_ca(crew)
                    changes.append(f"{crew}: removed a crew CA with no crew row")

            for slot in slots.values():
                try:
                    changes += await self._reconcile_slot(slot, by_crew.get(slot.slot, []))
                except Exception as exc:
                    log.exception("reconcile pool slot %s", slot.slot)
                    changes.append(f"pool slot {slot.slot}: reconcile failed: {exc}")

            for name, row in rows.items():
                containers = by_crew.get(name, [])
                if row.key != name:
                    containers = containers + by_crew.get(row.key, [])
                try:
                    changes += await self._reconcile_row(row, containers)
                except Exception as exc:
                    log.exception("reconcile %s", name)
                    changes.append(f"{name}: reconcile failed: {exc}")
            changes += await self._kill_stray_sandboxes()
        for change in changes:
            log.warning("reconcile: %s", change)
        return changes

    async def _kill_stray_sandboxes(self) -> list[str]:
        # A failed runsc start can leave its sandbox, gofer and shim running with no container
        # (docs/runtime.md); the provider finds them by container id in /proc.
        kill = getattr(self.provider, "kill_stray_runsc_processes", None)
        if kill is None:
            return []
        killed = await trio.to_thread.run_sync(kill)
        return [
            f"killed stray runsc process {p.pid} of gone container {p.container_id[:12]}"
            for p in killed
        ]

    async def _reconcile_row(self, row: CrewRow, containers: list[OwnedContainer]) -> list[str]:
        name = row.name
        if row.phase in (CrewPhase.CREATING, CrewPhase.REMOVING):
            await self._tear_down(row, keep_subnet=False)
            self.store.delete(name)
            self._forget_ca(name)
            what = (
                "rolled back an interrupted create"
                if row.phase is CrewPhase.CREATING
                else ("finished an interrupted removal")
            )
            return [f"{name}: {what}"]
        if row.phase is CrewPhase.FAILED:
            if containers:
                await self._tear_down(row, keep_subnet=True)
                return [f"{name}: failed crew: removed its leftover containers"]
            return []
        roles = {c.role for c in containers if c.running}
        record = {r.crew: r for r in self.networks.records()}.get(row.key)
        healthy = (
            row.phase is CrewPhase.READY
            and roles >= {ContainerRole.INFRA, ContainerRole.AGENT}
            and record is not None
            and record.phase.value == "ready"
        )
        if healthy and self.networks.net_rules(row.key) != row.net:
            # The row is the intent: a crash between the row and the network's state file (or
            # a state file of an older version, which has no rules) is repaired here; failing
            # that, the crew is re-created below.
            try:
                await trio.to_thread.run_sync(self.networks.set_net_rules, row.key, row.net)
            except NetnsError as exc:
                log.warning("crew %s: address rules not applied: %s", name, exc)
                healthy = False
        if healthy:
            plan = self.networks.plan(row.key)
            assert plan is not None
            await self.proxy.add_crew(
                CrewEntry(
                    name=name,
                    gateway=plan.gateway,
                    mode=row.mode,
                    allow=row.allow,
                    ssrf_allow=row.ssrf_allow,
                    rules=row.rules,
                    net=row.net,
                )
            )
            return []
        why = "was stopped" if row.phase is CrewPhase.STOPPED else "lost a container or its network"
        await self._tear_down(row, keep_subnet=True)
        # "stopped" while it is re-created: a crash now makes the next start try again, where
        # "creating" would roll the crew back (delete it).
        self.store.update(name, phase=CrewPhase.STOPPED)
        try:
            await self._bring_up(row, _Steps(name, self.on_step))
        except StepFailed as exc:
            self.store.update(name, phase=CrewPhase.FAILED, error=str(exc))
            await self.journal.record(CrewFailed(crew=name, error=str(exc)))
            return [f"{name}: {why}; re-creating it failed, marked failed: {exc}"]
        return [f"{name}: {why}; re-created"]

    async def stop_all(self) -> None:
        """stop_crews_on_exit: tear every crew down, keep the rows as "stopped"."""
        async with self.lock:
            for row in self.store.crews():
                if row.phase is CrewPhase.READY:
                    try:
                        await self._tear_down(row, keep_subnet=True)
                    except DaemonError as exc:
                        log.error("stopping %s: %s", row.name, exc)
                    self.store.update(row.name, phase=CrewPhase.STOPPED)
            # Nothing keeps running: the free slots go too (refilled at the next start).
            async with self._pool_lock:
                for slot in self.store.pool():
                    try:
                        await self._destroy_slot(slot.slot)
                    except Exception as exc:
                        log.error("destroying pool slot %s: %s", slot.slot, exc)

    # -- the infra pool ---------------------------------------------------------------------

    def pool_ready(self) -> int:
        return sum(1 for slot in self.store.pool() if slot.phase is SlotPhase.READY)

    def _free_slot(self) -> PoolSlot | None:
        """The oldest ready slot. Called with the lock held, and trio runs one task at a time:
        no other create can take the same slot (and take_slot checks it in SQL as well)."""
        for slot in self.store.pool():
            if slot.phase is SlotPhase.READY:
                return slot
        return None

    async def _destroy_slot(self, slot: str) -> None:
        """Containers, network, row: each attempted; the first error raised after all ran."""
        errors: list[str] = []
        for what, work in (
            ("remove containers", functools.partial(self.provider.remove_crew, slot)),
            ("release network", functools.partial(self.networks.release, slot)),
        ):
            try:
                await trio.to_thread.run_sync(work)
            except Exception as exc:
                errors.append(f"{what}: {exc}")
        if errors:
            raise DaemonError(f"pool slot {slot}: " + "; ".join(errors))
        self.store.pool_delete(slot)

    async def _fill_slot(self) -> str:
        """One new slot: row ("filling"), infra container, network (rules, then veth), row
        ("ready"). On any failure, or cancellation, everything is undone (shielded)."""
        slot = f"{self.config.crews.name_prefix}pool_{secrets.token_hex(4)}"
        # Underscore: never a crew name (crews are letters, digits and '-'), always a netns id.
        spec = CrewSpec(
            name=slot,
            image=self.agent_image,
            infra_image=self.infra_image,
            runtime=self.config.crews.default_runtime,
        )
        self.store.pool_insert(slot)
        try:
            pod = await trio.to_thread.run_sync(self.provider.create_infra, spec)
            network = await trio.to_thread.run_sync(
                self.networks.attach, slot, netns_of_pid(pod.infra_pid)
            )
            self.store.pool_ready(slot, pod.infra_id, pod.infra_pid, network.gateway)
        except BaseException:
            with trio.CancelScope(shield=True):
                try:
                    await self._destroy_slot(slot)
                except Exception:
                    # The row stays "filling": the next start destroys what is left.
                    log.exception("undoing pool slot %s", slot)
            raise
        return slot

    async def keep_pool(self) -> None:
        """Keep `[crews] infra_pool` slots (filling or ready); runs until cancelled."""
        size = self.config.crews.infra_pool
        backoff = 1.0
        while size:
            self._pool_wanted = trio.Event()
            while len(self.store.pool()) < size:
                try:
                    async with self._pool_lock:
                        slot = await self._fill_slot()
                except Exception as exc:
                    log.error(
                        "infra pool: filling a slot failed (retry in %.0f s): %s", backoff, exc
                    )
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, 60.0)
                    continue
                backoff = 1.0
                log.info("infra pool: slot %s ready", slot)
            await self._pool_wanted.wait()

    async def _reconcile_slot(self, slot: PoolSlot, containers: list[OwnedContainer]) -> list[str]:
        """A free slot is kept only if it is exactly what a fill leaves: its infra running
        (the same container), no other container, and its network ready."""
        record = {r.crew: r for r in self.networks.records()}.get(slot.slot)
        intact = (
            slot.phase is SlotPhase.READY
            and len(containers) == 1
            and containers[0].role is ContainerRole.INFRA
            and containers[0].running
            and containers[0].container_id == slot.infra_id
            and record is not None
            and record.phase.value == "ready"
        )
        if intact:
            return []
        await self._destroy_slot(slot.slot)
        why = (
            "interrupted fill"
            if slot.phase is SlotPhase.FILLING
            else "lost its container or network"
        )
        return [f"pool slot {slot.slot}: {why}: destroyed"]
