"""`CrewNetworks`: attach, detach, reconcile and inspect the networks of the crews.

Theory of operation
-------------------
Attaching a crew to its namespace is a sequence of steps, each of which either completes or is
undone, in reverse order, before the error is raised (`CrewNetworkError` names the crew and the
step):

    open namespace             the file, checked to be a network namespace not the host's
    allocate subnet            lowest free /30 not used by the host (kept if the crew had one)
    record intent              state file: crew -> subnet, phase CREATING, namespace identity
    install rules              one nftables transaction: the crew's sets (its address rules),
                               chain and map element
    disable IPv6 in namespace  all and default: every interface, present and future
    remove leftover link       a link of the crew's name from an earlier, interrupted setup
    create veth                host end in the host namespace, crew end born in the crew's
    configure host end         IPv6 and forwarding off, gateway address, up
    configure crew end         IPv6 off, crew address, up, lo up, default route via gateway
    commit                     phase READY

`on_step(crew, step)` is called after each step completes (tracing, benchmarks, and the tests
that kill the process between two steps); it must not raise.

The rules come before the link: from the moment the host end exists, its packets meet the
crew's chain, which accepts only TCP from the crew's address to its own gateway's proxy ports.
And should a link with the appliance's prefix ever exist without a chain, the table's catch-all
rule drops its traffic (see `nft.py`). So a crash between any two steps leaves nothing that
grants access; the phase in the state file tells the next `reconcile` to undo it. And the
gateway (the crew's identity at the proxy) is reachable from the crew's interface only: the
table refuses the whole pool to every other interface, the host's own `lo` included, from the
first batch on.

Detaching runs the other way (phase DETACHING, delete the veth, which cuts the crew off at once,
then the rules, then phase DETACHED). It is not rolled back on failure (re-creating a network
being torn down helps nobody); the phase stays DETACHING and `reconcile` finishes the work.

`reconcile` runs at every start of the appliance: it checks the pool against the host, compares
links, addresses and the table with the state file, removes what no crew owns, restores what a
live crew is missing (rules first, then plumbing) and returns what it changed.

Instances (`instance=`): the table and the interfaces carry the instance id (`naming` in
addressing.py), so that everything `reconcile` lists and removes is this appliance's own: links
of its own prefix, chains of its own table. Before it changes anything, `reconcile` checks that
no other table on the host claims interfaces of its prefix (its tag could collide with another
instance's) and that its table is not another appliance's with the same id (the owner token in
the dispatch rule's comment); either refuses the start (`InstanceConflictError`). With or
without an instance id, it refuses a pool that another appliance's table claims (the pool in the
comment of its `foreign` rule: its crews' pool, refused to all but them), or that the host uses
(`PoolConflictError`). State from before instance ids (or from other names) is renamed: the
crews' old links are deleted (each crew is cut off), the old table is deleted (or, if crews of
another appliance still use it, only this appliance's chains are removed from it), then the new
table and links are made as for any crew whose link is missing. Without `instance`, the names
are the configuration's as they are.

All methods are synchronous and blocking (netlink and nftables calls take milliseconds); a trio
caller runs them with `trio.to_thread.run_sync`. One lock serializes them.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn

import msgspec

from .addressing import (
    CrewPlan,
    Naming,
    capture_chain_name,
    check_crew_id,
    check_instance_id,
    first_free_index,
    interface_name,
    naming,
    parse_pool,
    plan_for,
    pool_conflicts,
)
from .config import NetConfig, validate_config
from .errors import (
    CrewNetworkError,
    KernelError,
    NetnsError,
    PoolConflictError,
)
from .instances import check_claims, check_pool_claims, rename
from .kernel import (
    HostNetwork,
    InnerView,
    LinkInfo,
    Namespace,
    current_identity,
    ensure_inner,
    harden_namespace,
    inspect_inner,
)
from .netrules import ACTIONS, NetRule, elements, parse_rules
from .nft import (
    CAPTURE_CHAIN_PREFIX,
    CAPTURE_MAP,
    CREW_CHAIN_PREFIX,
    MAP,
    SET_PREFIXES,
    SET_TYPE,
    Json,
    Layout,
    LibNftables,
    NftBackend,
    NftCli,
    TableState,
    base_differences,
    default_backend,
    read_table,
    set_name,
)
from .state import CrewRecord, NetnsIdentity, NetState, Phase, StateStore

StepCallback = Callable[[str, str], None]

log = logging.getLogger("netns")


class CrewNetwork(msgspec.Struct, frozen=True):
    """A crew attached to its namespace: what the proxy and the crew's processes need to know."""

    crew: str
    ifname: str
    inner_ifname: str
    subnet: str
    gateway: str
    address: str
    netns: NetnsIdentity


class Change(msgspec.Struct, frozen=True):
    """One thing `reconcile` changed (or failed to change)."""

    action: str
    detail: str
    crew: str | None = None


class ReconcileReport(msgspec.Struct, frozen=True):
    changes: tuple[Change, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def actions(self) -> list[str]:
        return [change.action for change in self.changes]


class RuleCounter(msgspec.Struct, frozen=True):
    role: str
    comment: str
    packets: int
    bytes: int


class CrewStatus(msgspec.Struct, frozen=True):
    crew: str
    phase: str
    ifname: str
    subnet: str
    gateway: str
    address: str
    netns: str | None
    namespace_alive: bool
    in_map: bool
    host_end: LinkInfo | None
    crew_end: InnerView | None
    rules: tuple[RuleCounter, ...]
    accepted_packets: int
    accepted_bytes: int
    dropped_packets: int
    dropped_bytes: int
    # Its address rules as recorded (netrules.py), which the kernel's sets hold.
    net: tuple[str, ...] = ()


class NetworkReport(msgspec.Struct, frozen=True):
    table: str
    table_present: bool
    # Non-empty when the table's base differs from what the appliance writes.
    base_differences: tuple[str, ...]
    crews: tuple[CrewStatus, ...]
    counters: tuple[RuleCounter, ...]
    orphan_links: tuple[str, ...]
    orphan_chains: tuple[str, ...]


def netns_of_pid(pid: int) -> str:
    """The namespace file of a process, e.g. a crew's infra container."""
    return f"/proc/{pid}/ns/net"


class _Steps:
    """Runs named steps for one crew; on failure undoes the completed ones in reverse order."""

    def __init__(self, crew: str, on_step: StepCallback | None) -> None:
        self.crew = crew
        self.on_step = on_step
        self.undo: list[tuple[str, Callable[[], object]]] = []

    def run(
        self, name: str, work: Callable[[], object], undo: Callable[[], object] | None = None
    ) -> None:
        try:
            work()
        except BaseException as exc:
            self.fail(name, exc)
        if undo is not None:
            self.undo.append((name, undo))
        if self.on_step is not None:
            self.on_step(self.crew, name)

    def fail(self, name: str, exc: BaseException) -> NoReturn:
        errors: list[str] = []
        for done, undo in reversed(self.undo):
            try:
                undo()
            except Exception as undo_exc:
                errors.append(f"undo {done!r}: {undo_exc}")
        if not isinstance(exc, Exception):
            raise exc  # KeyboardInterrupt and the like: rolled back, then propagated as is
        raise CrewNetworkError(self.crew, name, exc, rollback_errors=tuple(errors)) from exc


class CrewNetworks:
    """The crews' networks on this host. One instance per appliance; holds the state lock."""

    def __init__(
        self,
        config: NetConfig,
        state_dir: str | os.PathLike[str],
        *,
        nft: NftBackend | None = None,
        on_step: StepCallback | None = None,
        instance: str | None = None,
    ) -> None:
        self.config = validate_config(config)
        self.pool = parse_pool(config.pool)
        if instance is not None:
            check_instance_id(instance)
        self.instance = instance
        # The names of this appliance's table and interfaces (the configured ones, marked
        # with the instance id); `prefix` is what every interface name of it starts with.
        self.naming = naming(config.table, config.ifname_prefix, instance)
        self.prefix = self.naming.ifname_prefix
        self.on_step = on_step
        self._lock = threading.RLock()
        self._store = StateStore(state_dir)
        try:
            fresh = not self._store.path.exists()
            self._state = self._store.load(config.pool)
            if fresh:
                # Nothing was ever made under other names.
                self._state = msgspec.structs.replace(self._state, naming=self.naming)
            # Whose table it is: kept in the state file, so a moved state directory keeps it;
            # first made from the directory's path, so one that was emptied and started again
            # in the same place takes its own table back (docs/netns.md, "Instances").
            self.owner = (
                self._state.owner
                or hashlib.sha256(os.fsencode(os.path.realpath(state_dir))).hexdigest()[:8]
            )
            self.layout = Layout(
                table=self.naming.table,
                priority=config.priority,
                ifname_prefix=self.prefix,
                proxy_ports=tuple(config.proxy_ports),
                pool=str(self.pool),
                log_drops=config.log_drops,
                log_rate_per_minute=config.log_rate_per_minute,
                capture_ports=tuple(config.capture_ports),
                dns=config.dns,
                claim=f"instance={instance} owner={self.owner}" if instance else "",
            )
            # A backend made here is closed here; one passed in belongs to the caller.
            self._owned_nft: LibNftables | NftCli | None = None
            if nft is None:
                self._owned_nft = default_backend()
                nft = self._owned_nft
            self._nft: NftBackend = nft
            self._host = HostNetwork()
        except BaseException:
            self._store.close()
            raise

    # --- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._host.close()
            if self._owned_nft is not None:
                self._owned_nft.close()
            self._store.close()

    def __enter__(self) -> CrewNetworks:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- queries -------------------------------------------------------------------------------

    def records(self) -> tuple[CrewRecord, ...]:
        with self._lock:
            return self._state.crews

    def plan(self, crew: str) -> CrewPlan | None:
        with self._lock:
            record = self._state.by_crew().get(crew)
            return None if record is None else self._plan(record)

    def _plan(self, record: CrewRecord) -> CrewPlan:
        return plan_for(self.pool, self.prefix, record.crew, record.index)

    def _rules(self, record: CrewRecord) -> tuple[NetRule, ...]:
        return parse_rules(record.net, self.pool)

    def net_rules(self, crew: str) -> tuple[str, ...]:
        """The crew's address rules as recorded (their one spelling)."""
        with self._lock:
            record = self._state.by_crew().get(crew)
            return () if record is None else record.net

    def _old_naming(self) -> Naming | None:
        """The names the state's objects were made under, if they are not the current ones
        (state from before instance ids, or a changed table or prefix): `reconcile` renames."""
        recorded = self._state.naming or Naming(self.config.table, self.config.ifname_prefix)
        current = self.naming
        if (recorded.table, recorded.ifname_prefix) == (current.table, current.ifname_prefix):
            return None
        return recorded

    def check_pool(self, also_ours: tuple[str, ...] = ()) -> None:
        """Raise PoolConflictError if the host uses any part of the pool (this appliance's own
        links aside: those of its prefix, and `also_ours`, its links under former names)."""
        with self._lock, self._host.session():
            uses = self._host.host_uses(self.prefix, also_ours)
        conflicts = pool_conflicts(self.pool, uses)
        if conflicts:
            raise PoolConflictError(str(self.pool), conflicts)

    # --- state ---------------------------------------------------------------------------------

    def _save(self, state: NetState) -> None:
        self._store.save(state)
        self._state = state

    def _allocate(self, crew: str) -> int:
        ifname = interface_name(self.prefix, crew)
        for record in self._state.crews:
            if record.crew != crew and interface_name(self.prefix, record.crew) == ifname:
                raise NetnsError(
                    f"crew {crew!r}: interface name {ifname} collides with crew {record.crew!r}"
                )
        return first_free_index(
            self.pool, (r.index for r in self._state.crews), self._host.subnet_in_use
        )

    # --- attach / detach -----------------------------------------------------------------------

    def attach(
        self, crew: str, netns: str | os.PathLike[str], net: tuple[str, ...] | None = None
    ) -> CrewNetwork:
        """Give a crew its network inside the namespace at `netns`; rules first, fail closed.

        `net`: the crew's address rules (netrules.py), None to keep those recorded (if any).
        Idempotent for a crew already attached to the same namespace (missing pieces are
        restored). Raises CrewNetworkError naming the failed step, after rolling back.
        """
        check_crew_id(crew)
        if net is not None:
            try:
                parse_rules(net, self.pool)
            except NetnsError as exc:
                raise CrewNetworkError(crew, "check rules", exc, rolled_back=False) from exc
        path = os.fspath(netns)
        with self._lock, self._host.session():
            if self._state.crews and self._old_naming() is not None:
                raise CrewNetworkError(
                    crew,
                    "check names",
                    NetnsError("the crews' networks carry former names: reconcile first"),
                    rolled_back=False,
                )
            previous = self._state.by_crew().get(crew)
            steps = _Steps(crew, self.on_step)
            namespace: list[Namespace] = []
            steps.run("open namespace", lambda: namespace.append(Namespace(path)))
            ns = namespace[0]
            try:
                if previous is not None and previous.phase is Phase.READY:
                    if previous.netns is None or not _same(previous.netns, ns.identity):
                        steps.fail(
                            "check namespace",
                            NetnsError(
                                f"already attached to {_path(previous.netns)}; detach it first"
                            ),
                        )
                    if net is not None and net != previous.net:
                        previous = msgspec.structs.replace(previous, net=net)
                        record = previous
                        steps.run(
                            "record rules", lambda: self._save(self._state.with_record(record))
                        )
                    return self._restore(ns, previous, steps)
                return self._create(ns, previous, steps, net)
            finally:
                ns.close()

    def _create(
        self,
        ns: Namespace,
        previous: CrewRecord | None,
        steps: _Steps,
        net: tuple[str, ...] | None = None,
    ) -> CrewNetwork:
        crew = steps.crew
        if net is None:
            net = previous.net if previous is not None else ()
        index: list[int] = []
        steps.run(
            "allocate subnet",
            lambda: index.append(previous.index if previous is not None else self._allocate(crew)),
        )
        record = CrewRecord(
            crew=crew, index=index[0], phase=Phase.CREATING, netns=ns.identity, net=net
        )
        plan = self._plan(record)
        rules = self._rules(record)
        before = self._state

        def undo_record() -> None:
            if previous is None:
                self._save(before.without(crew))
            else:
                self._save(
                    before.with_record(
                        msgspec.structs.replace(previous, phase=Phase.DETACHED, netns=None)
                    )
                )

        steps.run("record intent", lambda: self._save(self._state.with_record(record)), undo_record)
        steps.run(
            "install rules",
            lambda: self._nft.run(self.layout.install_crew(plan, rules)),
            lambda: self._nft.run(self.layout.remove_crew(plan.ifname)),
        )
        steps.run("disable IPv6 in namespace", lambda: harden_namespace(ns))
        # A link of this name can only be a leftover of this crew (the name is a hash of its
        # id): it is covered by the rules just installed, and is replaced.
        steps.run("remove leftover link", lambda: self._host.delete_link(plan.ifname))
        steps.run(
            "create veth",
            lambda: self._host.create_veth(plan, self.config.inner_ifname, ns),
            lambda: self._host.delete_link(plan.ifname),
        )
        # A link just created has no address: no need to read them back.
        steps.run(
            "configure host end",
            lambda: self._host.ensure_host_end(plan, (), forward=_forwards(rules)),
        )
        steps.run("configure crew end", lambda: ensure_inner(ns, plan, self.config.inner_ifname))
        ready = msgspec.structs.replace(record, phase=Phase.READY)
        steps.run("commit", lambda: self._save(self._state.with_record(ready)))
        return self._network(plan, ns.identity)

    def _restore(self, ns: Namespace, record: CrewRecord, steps: _Steps) -> CrewNetwork:
        """Bring an attached crew back to its plan; no rollback beyond what each step does."""
        plan = self._plan(record)
        rules = self._rules(record)
        steps.run("install rules", lambda: self._nft.run(self.layout.install_crew(plan, rules)))
        self._ensure_plumbing(ns, plan, self._host.link(plan.ifname), [], _forwards(rules))
        return self._network(plan, ns.identity)

    def _ensure_plumbing(
        self,
        ns: Namespace,
        plan: CrewPlan,
        link: LinkInfo | None,
        changes: list[str],
        forward: bool = False,
    ) -> None:
        """Make a live crew's veth, addresses and routes match its plan; `changes` says what
        was done. Raises CrewNetworkError naming the step (nothing to roll back: every step
        only moves the crew towards its plan)."""
        inner = self.config.inner_ifname
        step = "check veth"
        try:
            if link is not None and link.kind != "veth":
                step = "remove foreign link"
                self._host.delete_link(plan.ifname)
                changes.append(f"removed {link.kind or 'unknown'} link {plan.ifname}")
                link = None
            for attempt in (1, 2):
                if link is None:
                    step = "disable IPv6 in namespace"
                    changes += harden_namespace(ns)
                    step = "create veth"
                    self._host.create_veth(plan, inner, ns)
                    changes.append(f"created veth {plan.ifname} <-> {inner}")
                step = "configure host end"
                changes += self._host.ensure_host_end(
                    plan, link.addresses if link else (), forward=forward
                )
                step = "configure crew end"
                try:
                    changes += ensure_inner(ns, plan, inner)
                    return
                except KernelError as exc:
                    if exc.errno != errno.ENODEV or attempt == 2:
                        raise
                # The host end exists but its peer is not in this namespace (moved, or the
                # link is a leftover of an earlier namespace): replace the pair.
                step = "replace veth"
                self._host.delete_link(plan.ifname)
                changes.append(f"removed veth {plan.ifname} whose peer was elsewhere")
                link = None
        except NetnsError as exc:
            raise CrewNetworkError(plan.crew, step, exc, rolled_back=False) from exc

    def _network(self, plan: CrewPlan, identity: NetnsIdentity) -> CrewNetwork:
        return CrewNetwork(
            crew=plan.crew,
            ifname=plan.ifname,
            inner_ifname=self.config.inner_ifname,
            subnet=plan.subnet,
            gateway=plan.gateway,
            address=plan.address,
            netns=identity,
        )

    def set_net_rules(self, crew: str, net: tuple[str, ...]) -> list[Json]:
        """Replace a crew's address rules: recorded, then its two sets replaced in one nftables
        transaction (no chain rebuilt, no other crew touched) and its host end's forwarding set
        to match. Returns the batch it ran (empty for a crew not attached now: its rules apply
        when it is). Raises CrewNetworkError; on a kernel failure the former rules are recorded
        again and the kernel keeps them (the batch is atomic)."""
        check_crew_id(crew)
        with self._lock:
            record = self._state.by_crew().get(crew)
            if record is None:
                raise CrewNetworkError(
                    crew, "check rules", NetnsError("no such crew"), rolled_back=False
                )
            updated = msgspec.structs.replace(record, net=net)
            step = "check rules"
            try:
                rules = self._rules(updated)
                step = "record rules"
                self._save(self._state.with_record(updated))
            except NetnsError as exc:
                raise CrewNetworkError(crew, step, exc, rolled_back=False) from exc
            if record.phase is not Phase.READY:
                return []
            plan = self._plan(updated)
            batch = self.layout.set_rules(plan, rules)
            step = "replace sets"
            try:
                # Forwarding on before the sets fill, off after they empty: in between, the
                # table alone decides, as it always does.
                if _forwards(rules):
                    self._host.set_forwarding(plan.ifname, True)
                self._nft.run(batch)
                if not _forwards(rules):
                    step = "set forwarding"
                    self._host.set_forwarding(plan.ifname, False)
            except NetnsError as exc:
                try:
                    self._save(self._state.with_record(record))
                except NetnsError:
                    pass  # the new rules stay recorded: reconcile applies them
                raise CrewNetworkError(crew, step, exc, rolled_back=True) from exc
            self._step(crew, step)
            return batch

    def detach(self, crew: str) -> None:
        """Remove a crew's veth and rules; its subnet stays reserved for it. Idempotent."""
        check_crew_id(crew)
        with self._lock, self._host.session():
            record = self._state.by_crew().get(crew)
            if record is None:
                # Not ours to remember, but make sure nothing is left under its name.
                self._teardown_kernel(crew, interface_name(self.prefix, crew))
                return
            self._detach(record)

    def release(self, crew: str) -> None:
        """Detach a crew and give its subnet back to the pool."""
        check_crew_id(crew)
        with self._lock, self._host.session():
            record = self._state.by_crew().get(crew)
            if record is not None:
                self._detach(record)
                try:
                    self._save(self._state.without(crew))
                except NetnsError as exc:
                    raise CrewNetworkError(crew, "forget subnet", exc, rolled_back=False) from exc
            else:
                self.detach(crew)

    def _detach(self, record: CrewRecord) -> None:
        plan = self._plan(record)
        step = "record intent"
        try:
            if record.phase is not Phase.DETACHED:
                self._save(
                    self._state.with_record(msgspec.structs.replace(record, phase=Phase.DETACHING))
                )
            step = "delete veth"
            self._host.delete_link(plan.ifname)
            self._step(record.crew, step)
            step = "remove rules"
            self._nft.run(self.layout.remove_crew(plan.ifname))
            self._step(record.crew, step)
            step = "commit"
            detached = msgspec.structs.replace(record, phase=Phase.DETACHED, netns=None)
            self._save(self._state.with_record(detached))
        except NetnsError as exc:
            # Left in DETACHING (or as it was): reconcile finishes the teardown.
            raise CrewNetworkError(record.crew, step, exc, rolled_back=False) from exc

    def _step(self, crew: str, name: str) -> None:
        if self.on_step is not None:
            self.on_step(crew, name)

    def _teardown_kernel(self, crew: str, ifname: str) -> None:
        step = "delete veth"
        try:
            self._host.delete_link(ifname)
            step = "remove rules"
            self._nft.run(self.layout.remove_crew(ifname))
        except NetnsError as exc:
            raise CrewNetworkError(crew, step, exc, rolled_back=False) from exc

    # --- reconcile -----------------------------------------------------------------------------

    def reconcile(self) -> ReconcileReport:
        """Make the kernel match the state file; report every change. Run at every start."""
        with self._lock, self._host.session():
            old = self._old_naming()
            old_links = (
                tuple(interface_name(old.ifname_prefix, r.crew) for r in self._state.crews)
                if old is not None
                else ()
            )
            # The claims first: an appliance configured alike has its crews in this pool too,
            # and that it is another appliance is the better reason to give.
            old_table = check_claims(
                self._nft, self.layout, self.naming, self.owner, old, old_links
            )
            check_pool_claims(self._nft, self.layout, old)
            self.check_pool(old_links)
            changes: list[Change] = []
            if old is not None:
                changes += [
                    Change(*change)
                    for change in rename(
                        self._nft,
                        self._host,
                        self.layout,
                        self.naming,
                        old,
                        old_links,
                        [record.crew for record in self._state.crews],
                        old_table,
                    )
                ]
            state = msgspec.structs.replace(self._state, naming=self.naming, owner=self.owner)
            kept: dict[str, tuple[CrewRecord, Namespace]] = {}
            try:
                # 1. Decide for every recorded crew: keep (namespace alive) or take down.
                for record in state.crews:
                    namespace, reason = self._open_if_alive(record)
                    if namespace is not None:
                        kept[record.crew] = (record, namespace)
                    elif record.phase is not Phase.DETACHED:
                        detached = msgspec.structs.replace(record, phase=Phase.DETACHED, netns=None)
                        state = state.with_record(detached)
                        changes.append(Change("took down", reason, record.crew))
                plans = {crew: self._plan(record) for crew, (record, _) in kept.items()}
                rules: dict[str, tuple[NetRule, ...]] = {}
                for crew, (record, _) in kept.items():
                    try:
                        rules[crew] = self._rules(record)
                    except NetnsError as exc:
                        # A state file edited by hand: the crew keeps its network, without
                        # the rules (fail closed: it reaches its proxy port only).
                        rules[crew] = ()
                        changes.append(Change("ignored address rules", str(exc), crew))
                wanted = {plan.ifname for plan in plans.values()}

                # 2. Links nobody keeps: orphans, half-created, detaching, dead namespaces.
                links = self._host.links_with_prefix(self.prefix)
                self._log_ignored_links()
                for ifname in sorted(links):
                    if ifname not in wanted and self._host.delete_link(ifname):
                        changes.append(Change("deleted link", ifname, self._owner(state, ifname)))

                # 3. The table, in one transaction: rules before any link is restored.
                changes += self._reconcile_table(list(plans.values()), state, rules)

                # 4. Plumbing of the crews kept, each on its own: one failure takes that crew
                # down (fail closed) and does not stop the others.
                for crew, (record, namespace) in kept.items():
                    plan = plans[crew]
                    done: list[str] = []
                    try:
                        self._ensure_plumbing(
                            namespace,
                            plan,
                            links.get(plan.ifname),
                            done,
                            _forwards(rules.get(crew, ())),
                        )
                    except NetnsError as exc:
                        changes.append(Change("failed to restore", str(exc), crew))
                        try:
                            self._teardown_kernel(crew, plan.ifname)
                        except NetnsError as teardown:
                            changes.append(Change("failed to take down", str(teardown), crew))
                        state = state.with_record(
                            msgspec.structs.replace(record, phase=Phase.DETACHED, netns=None)
                        )
                        continue
                    changes += [Change("restored", detail, crew) for detail in done]
            finally:
                for _, namespace in kept.values():
                    namespace.close()
            if state != self._state:
                self._save(state)
            return ReconcileReport(tuple(changes))

    def _log_ignored_links(self) -> None:
        """Debug: links that look like an appliance's (the configured prefix) but are not this
        one's; reconcile never touches them."""
        if not log.isEnabledFor(logging.DEBUG) or self.prefix == self.config.ifname_prefix:
            return
        for ifname in sorted(self._host.links_with_prefix(self.config.ifname_prefix)):
            if not ifname.startswith(self.prefix):
                log.debug("reconcile: ignored link %s (not instance %s's)", ifname, self.instance)

    @staticmethod
    def _open_if_alive(record: CrewRecord) -> tuple[Namespace | None, str]:
        """The crew's namespace if the crew should keep its network, else why not."""
        if record.phase is Phase.DETACHED:
            return None, "detached"
        if record.phase is Phase.CREATING:
            return None, "setup was interrupted: undone"
        if record.phase is Phase.DETACHING:
            return None, "teardown was interrupted: finished"
        if record.netns is None:
            return None, "no namespace recorded"
        try:
            namespace = Namespace(record.netns.path)
        except NetnsError as exc:
            return None, f"namespace is gone: {exc}"
        if not _same(record.netns, namespace.identity):
            namespace.close()
            return None, f"namespace {record.netns.path} is gone (the path names another one)"
        return namespace, ""

    def _reconcile_table(
        self, plans: list[CrewPlan], state: NetState, rules: dict[str, tuple[NetRule, ...]]
    ) -> list[Change]:
        table = read_table(self._nft, self.layout)
        if table is None:
            self._nft.run(self.layout.rebuild(plans, rules))
            return [Change("created table", f"inet {self.naming.table} with {len(plans)} crews")]
        differences = base_differences(self.layout, table)
        elements = table.maps.get(MAP, ("", "", {}))[2]
        captures = table.maps.get(CAPTURE_MAP, ("", "", {}))[2]
        wrong_targets = [
            key for key, target in elements.items() if target != f"jump {CREW_CHAIN_PREFIX}{key}"
        ] + [
            key for key, target in captures.items() if target != f"jump {CAPTURE_CHAIN_PREFIX}{key}"
        ]
        if differences or wrong_targets:
            self._nft.run(self.layout.rebuild(plans, rules))
            detail = "; ".join(
                differences + [f"map element {key} misdirected" for key in wrong_targets]
            )
            return [Change("rebuilt table", detail)]
        changes: list[Change] = []
        wanted = {plan.ifname: plan for plan in plans}
        present = {
            name[len(CREW_CHAIN_PREFIX) :]
            for name in table.chains
            if name.startswith(CREW_CHAIN_PREFIX)
        }
        present |= {name.split("_", 1)[1] for name in table.sets if name.startswith(SET_PREFIXES)}
        present |= {
            name[len(CAPTURE_CHAIN_PREFIX) :]
            for name in table.chains
            if name.startswith(CAPTURE_CHAIN_PREFIX)
        }
        remove = sorted((present | set(elements) | set(captures)) - set(wanted))
        install = [plan for plan in plans if self._crew_differs(table, plan, elements, captures)]
        refill = [
            plan
            for plan in plans
            if plan not in install and self._sets_differ(table, plan, rules.get(plan.crew, ()))
        ]
        if not remove and not install and not refill:
            return changes
        self._nft.run(self.layout.repair(install, remove, rules, refill))
        changes += [
            Change("removed rules", f"chain {CREW_CHAIN_PREFIX}{i}", self._owner(state, i))
            for i in remove
        ]
        changes += [Change("restored rules", f"chain {plan.chain}", plan.crew) for plan in install]
        changes += [
            Change("restored address rules", f"sets of {plan.ifname}", plan.crew) for plan in refill
        ]
        return changes

    @staticmethod
    def _sets_differ(table: TableState, plan: CrewPlan, rules: tuple[NetRule, ...]) -> bool:
        for action in ACTIONS:
            found = table.sets.get(set_name(action, plan.ifname))
            if found is None:
                return True
            shape, boxes = found
            if shape != (*SET_TYPE, "flag:interval"):
                return True
            if tuple(sorted(boxes, key=_box_key)) != elements(rules, action):
                return True
        return False

    def _owner(self, state: NetState, ifname: str) -> str | None:
        for record in state.crews:
            if interface_name(self.prefix, record.crew) == ifname:
                return record.crew
        return None

    def _crew_differs(
        self,
        table: TableState,
        plan: CrewPlan,
        elements: dict[str, str],
        captures: dict[str, str],
    ) -> bool:
        chain = table.chains.get(plan.chain)
        capture = table.chains.get(capture_chain_name(plan.ifname))
        if chain is None or capture is None:
            return True
        if plan.ifname not in elements or plan.ifname not in captures:
            return True
        want = [rule.comment for rule in self.layout.crew_rules(plan)]
        if [rule.comment for rule in chain.rules] != want:
            return True
        wanted_capture = [rule.comment for rule in self.layout.capture_rules(plan)]
        return [rule.comment for rule in capture.rules] != wanted_capture

    # --- inspection ----------------------------------------------------------------------------

    def show(self) -> NetworkReport:
        """Per crew: addresses, rules and their counters, read from the kernel now."""
        with self._lock, self._host.session():
            table = read_table(self._nft, self.layout)
            links = self._host.links_with_prefix(self.prefix)
            elements = table.maps.get(MAP, ("", "", {}))[2] if table else {}
            crews: list[CrewStatus] = []
            known_links: set[str] = set()
            known_chains: set[str] = set()
            for record in self._state.crews:
                plan = self._plan(record)
                known_links.add(plan.ifname)
                known_chains.add(plan.chain)
                crews.append(self._status(record, plan, table, elements, links.get(plan.ifname)))
            chains = table.chains if table else {}
            counters = tuple(
                RuleCounter(name, "named counter", packets, nbytes)
                for name, (packets, nbytes) in (table.counters.items() if table else ())
            )
            return NetworkReport(
                table=f"inet {self.naming.table}",
                table_present=table is not None,
                base_differences=tuple(base_differences(self.layout, table)) if table else (),
                crews=tuple(crews),
                counters=counters,
                orphan_links=tuple(sorted(set(links) - known_links)),
                orphan_chains=tuple(
                    sorted(
                        name
                        for name in chains
                        if name.startswith(CREW_CHAIN_PREFIX) and name not in known_chains
                    )
                ),
            )

    def _status(
        self,
        record: CrewRecord,
        plan: CrewPlan,
        table: TableState | None,
        elements: dict[str, str],
        host_end: LinkInfo | None,
    ) -> CrewStatus:
        alive = False
        crew_end: InnerView | None = None
        if record.netns is not None:
            identity = current_identity(record.netns.path)
            alive = identity is not None and _same(record.netns, identity)
            if alive:
                try:
                    with Namespace(record.netns.path) as ns:
                        crew_end = inspect_inner(ns, self.config.inner_ifname)
                except NetnsError:
                    alive = False
        chain = table.chains.get(plan.chain) if table else None
        rules = tuple(
            RuleCounter(rule.comment.split(" ", 1)[0], rule.comment, rule.packets, rule.bytes)
            for rule in (chain.rules if chain else ())
        )
        # A forwarded packet is counted twice (the chain judges it in prerouting and forward).
        accepted = [r for r in rules if r.role in ("allow", "net-allow")]
        dropped = [r for r in rules if r.role in ("drop", "to-pool", "net-deny")]
        return CrewStatus(
            crew=record.crew,
            phase=record.phase.value,
            ifname=plan.ifname,
            subnet=plan.subnet,
            gateway=plan.gateway,
            address=plan.address,
            netns=record.netns.path if record.netns else None,
            namespace_alive=alive,
            in_map=plan.ifname in elements,
            host_end=host_end,
            crew_end=crew_end,
            rules=rules,
            accepted_packets=sum(r.packets for r in accepted),
            accepted_bytes=sum(r.bytes for r in accepted),
            dropped_packets=sum(r.packets for r in dropped),
            dropped_bytes=sum(r.bytes for r in dropped),
            net=record.net,
        )

    def delete_table(self) -> None:
        """Remove the whole table (uninstall, tests). Crews lose every rule: detach them first."""
        with self._lock:
            self._nft.run(self.layout.delete_table())


def _forwards(rules: tuple[NetRule, ...]) -> bool:
    return any(rule.action == "allow" for rule in rules)


def _box_key(box: object) -> tuple[object, ...]:
    # None (an element the appliance never writes) sorts first and never equals a Box.
    return (0,) if box is None else (1, box)


def _same(a: NetnsIdentity, b: NetnsIdentity) -> bool:
    return (a.dev, a.ino) == (b.dev, b.ino)


def _path(identity: NetnsIdentity | None) -> str:
    return identity.path if identity is not None else "no namespace"
