"""The admin API's typed bodies (msgspec Structs), shared by applianced and appliancectl.

Requests are decoded with `forbid_unknown_fields`, so a misspelled field is an error that names
it. Every error answer is `ErrorBody` with the HTTP status of the error (see errors.py). `run`
is upgraded to a session of frames (framing.py) whose EXIT frame carries a `RunExit` and whose
ERROR frame a `RunError`. The journal's and the network report's answers have their own types
here (`JournalEntry`, `NetReport`...), field for field those of appliance/journal and netns/
(tests/test_daemon_client.py holds them equal), so that a client need not import either.
"""

from __future__ import annotations

from typing import Annotated

import msgspec


class CrewRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Methods and paths a crew may use on one host: field for field the proxy's `RuleConfig`
    (proxycore/config.py, docs/proxy.md "Method and path rules"; tests/test_crew_rules.py holds
    them equal), here so that a client need not import the proxy."""

    host: str
    methods: tuple[str, ...] = ()  # exact, case-sensitive; with `preset` they add up
    preset: str | None = None  # "read-only": GET, HEAD, OPTIONS; neither: any method
    paths: tuple[str, ...] = ()  # "/exact", "*" in a segment, "**" a whole segment; none: any


class CreateCrew(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    mode: str = "restricted"
    allow: tuple[str, ...] = ()
    runtime: str | None = None  # None: [crews] default_runtime
    memory_bytes: int | None = None
    cpus: float | None = None
    # Destination ranges only this crew may reach past the SSRF guard, the appliance's own
    # addresses included (docs/proxy.md "Destinations").
    ssrf_allow: tuple[str, ...] = ()
    # Method and path rules for some of its hosts (they narrow what `allow` opens, never widen).
    rules: tuple[CrewRule, ...] = ()
    # Address rules, "allow:tcp:10.9.0.0/24:5432" (docs/netns.md "Address rules"): enforced by
    # the kernel for the crew's own packets and by the proxy after resolution; deny wins.
    net: tuple[str, ...] = ()


class AllowHost(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str


class SetNet(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A crew's address rules, all of them (none: no rule)."""

    net: tuple[str, ...] = ()


class RunCommand(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    argv: tuple[str, ...]
    timeout: float | None = None
    stdin: bool = False  # STDIN frames reach the command's stdin (else it has none)
    tty: bool = False  # the command runs on a TTY (stdout and stderr are then one stream)
    rows: int | None = None  # the TTY's first window size
    columns: int | None = None


class ContainerInfo(msgspec.Struct, frozen=True):
    role: str
    container_id: str
    running: bool


class AllowEntry(msgspec.Struct, frozen=True):
    """One host of a crew's effective allowlist and where it comes from: `crew` (its own
    allow), `default` ([proxy.policy] default_allow), `provider` (a provider's base URL)."""

    host: str
    sources: tuple[str, ...]


class CrewInfo(msgspec.Struct, frozen=True):
    name: str
    phase: str
    mode: str
    allow: tuple[str, ...]
    runtime: str
    memory_bytes: int
    cpus: float
    created: float
    gateway: str | None = None
    address: str | None = None
    infra_id: str | None = None
    agent_id: str | None = None
    error: str | None = None
    containers: tuple[ContainerInfo, ...] = ()
    # What the proxy allows this crew in restricted mode, as it holds it (docs/proxy.md); empty
    # in modes free (any host) and none (no host).
    effective_allow: tuple[AllowEntry, ...] = ()
    ssrf_allow: tuple[str, ...] = ()
    rules: tuple[CrewRule, ...] = ()  # as the proxy holds them (hosts normalized)
    net: tuple[str, ...] = ()  # address rules, in their one spelling


class CrewList(msgspec.Struct, frozen=True):
    crews: tuple[CrewInfo, ...]


class AllowResult(msgspec.Struct, frozen=True):
    crew: str
    host: str
    changed: bool


class ApprovalDecision(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/approvals/{crew}/allow` and `/deny` (docs/cli.md "approvals")."""

    host: str
    # allow only: for `duration` seconds (None: [approvals] once), not permanently.
    once: bool = False
    duration: float | None = None
    # Who answers, as the operator's client says (journaled beside the admin peer the daemon
    # sees: a user name is the client's word, the peer the kernel's or the TLS handshake's).
    by: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class ApprovalRequest(msgspec.Struct, frozen=True):
    """A pending request: a host `crew` was refused as not on its allowlist."""

    seq: int  # increases with every request filed: `since` of the long poll
    crew: str
    host: str
    port: int  # the port of the last refusal
    first_seen: float
    last_seen: float
    count: int  # refusals since it was filed
    expires: float  # last_seen + the window


class ApprovalEntry(msgspec.Struct, frozen=True):
    """A temporary grant or a denial in force."""

    crew: str
    host: str
    until: float


class ApprovalList(msgspec.Struct, frozen=True):
    requests: tuple[ApprovalRequest, ...]
    seq: int  # the newest request's seq so far: the next long poll's `since`
    window: float
    grants: tuple[ApprovalEntry, ...] = ()
    denied: tuple[ApprovalEntry, ...] = ()


class ApprovalResult(msgspec.Struct, frozen=True):
    crew: str
    host: str
    decision: str  # "allowed", "allowed_once" or "denied"
    until: float | None = None  # allowed_once, denied: when it ends
    changed: bool = True  # allowed: whether the running allowlist changed
    was_pending: bool = False


class NetResult(msgspec.Struct, frozen=True):
    crew: str
    net: tuple[str, ...]  # as applied: each rule in its one spelling
    changed: bool


class Removed(msgspec.Struct, frozen=True):
    crew: str
    removed: bool = True


class WorkerStatus(msgspec.Struct, frozen=True):
    """One proxy worker as its supervisor sees it (appliance/daemon/supervisor.py)."""

    index: int
    pid: int | None  # None while it is down (waiting out its backoff) or starting
    uid: int | None  # its effective UID as the kernel reports it (/proc/PID/status)
    started: float | None  # wall-clock time this life started
    restarts: int  # exits since applianced started, each followed by a restart
    last_exit: str | None = None  # why it last exited ("killed by SIGSEGV", ...)
    last_exit_time: float | None = None
    last_stderr: str | None = None  # its last line on stderr before that exit (scrubbed)
    restart_at: float | None = None  # a restart is pending: when (wall clock)
    backoff: float | None = None  # ... and the backoff chosen, in seconds


class Status(msgspec.Struct, frozen=True):
    pid: int
    state_dir: str
    admin_socket: str
    provider: str
    isolated: bool
    runtimes: tuple[str, ...]
    proxy_pid: int | None
    proxy_alive: bool
    proxy_restarts: int
    proxy_port: int
    crews: int
    crews_ready: int
    started: float
    reconcile: tuple[str, ...]  # what the reconciliation at start changed
    pool_size: int = 0  # [crews] infra_pool: pre-plumbed infra namespaces kept ready
    pool_ready: int = 0  # how many are ready now (a crew create takes one)
    proxy_pids: tuple[int, ...] = ()  # every running proxy worker (proxy_pid is the first)
    proxy_uid: int | None = None  # the UID the workers drop to (None: they keep applianced's)
    proxy_workers: tuple[WorkerStatus, ...] = ()  # per worker: pid, uid, restarts, last exit
    health: tuple[PartHealth, ...] = ()  # every part, judged (appliance/daemon/health.py)
    instance: str = ""  # the instance id (docs/daemon.md, "Instances")


class PartHealth(msgspec.Struct, frozen=True):
    """One part of the appliance as `status` judges it: `appliancectl status` exits 9 (degraded)
    when any is not ok."""

    name: str  # "proxy", "engine", "journal"
    ok: bool
    detail: str


class RunExit(msgspec.Struct, frozen=True):
    exit_code: int
    timed_out: bool = False


class RunError(msgspec.Struct, frozen=True):
    """The exec failed after the upgrade: what the request would have been answered."""

    status: int
    error: str
    message: str


class AddCredential(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The value travels only in this body (base64 in JSON), never in a URL or an argument."""

    name: str
    provider: str
    value: bytes
    level: str = "L3"
    kind: str | None = None  # None: from the provider (api_key, oauth_token, secret)


class RotateCredential(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    value: bytes
    level: str | None = None  # None: unchanged


class GrantCredential(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    crew: str
    agent: str | None = None  # None: every agent of the crew (and the proxy injects it)


class RevokeCredential(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    crew: str | None = None  # None: every grant, and the credential is marked revoked
    agent: str | None = None


class CredentialGrant(msgspec.Struct, frozen=True):
    crew: str
    agent: str | None
    granted: float


class CredentialRefusedGrant(msgspec.Struct, frozen=True):
    """A grant row that does not verify (appliance/credstore): never used, shown so the
    operator can revoke it (or grant it again if it is genuine)."""

    crew: str
    agent: str | None
    reason: str


class CredentialInfo(msgspec.Struct, frozen=True):
    """Never a value."""

    name: str
    provider: str
    kind: str
    level: str
    version: int
    created: float
    rotated: float
    revoked: float | None
    grants: tuple[CredentialGrant, ...]
    refused: tuple[CredentialRefusedGrant, ...] = ()
    tampered: bool = False  # the credential's own record does not authenticate


class CredentialList(msgspec.Struct, frozen=True):
    credentials: tuple[CredentialInfo, ...]


class ErrorBody(msgspec.Struct, frozen=True):
    error: str
    message: str


# -- the journal's answers (appliance/journal/store.py's Row, Problem, VerifyReport) ------------


class JournalEntry(msgspec.Struct, frozen=True):
    seq: int
    ts: float
    type: str
    workspace: str
    crew: str | None
    agent: str | None
    mission: str | None
    trace_id: str | None
    summary: str
    payload: str
    prev_hash: str
    hash: str


class JournalEntries(msgspec.Struct, frozen=True):
    entries: tuple[JournalEntry, ...]


class JournalProblem(msgspec.Struct, frozen=True):
    seq: int
    kind: str
    detail: str


class JournalCheckpoint(msgspec.Struct, frozen=True):
    """The signed checkpoint that accounts for the entries retention removed."""

    seq: int
    ts: float
    removed_from_seq: int
    removed_through_seq: int
    removed_entries: int
    removed_oldest_ts: float
    removed_newest_ts: float
    reason: str
    key: str


class JournalVerify(msgspec.Struct, frozen=True):
    ok: bool
    entries: int
    head_seq: int
    head_hash: str
    anchor_seq: int | None
    problem: JournalProblem | None = None
    first_seq: int = 1
    checkpoint: JournalCheckpoint | None = None
    checkpoints: int = 0
    keys: tuple[str, ...] = ()
    anchor_from: str | None = None
    keys_from_file: bool = False


class JournalPrune(msgspec.Struct, frozen=True):
    """POST /v1/journal/prune (retention.PruneRequest): a limit here replaces the configured."""

    keep_days: float | None = None
    keep_bytes: int | None = None
    dry_run: bool = False


class JournalPruned(msgspec.Struct, frozen=True):
    """retention.PruneReport, the fields appliancectl shows."""

    removed: int
    through_seq: int
    first_seq: int
    checkpoint_seq: int | None
    reason: str
    bytes_before: int
    bytes_after: int
    seconds: float
    steps: int
    longest_pause: float
    rebuilt: bool = False
    dry_run: bool = False


class JournalBackup(msgspec.Struct, frozen=True):
    """backup.BackupReport."""

    path: str
    entries: int
    first_seq: int
    head_seq: int
    head_hash: str
    taken: float
    bytes: int
    seconds: float
    key: str


# -- the network report (netns: manager.NetworkReport, CrewStatus, RuleCounter; kernel.LinkInfo,
# InnerView) ------------------------------------------------------------------------------------


class NetLink(msgspec.Struct, frozen=True):
    ifname: str
    index: int
    kind: str | None
    up: bool
    addresses: tuple[str, ...] = ()
    alias: str | None = None


class NetInnerView(msgspec.Struct, frozen=True):
    present: bool
    up: bool = False
    addresses: tuple[str, ...] = ()
    default_gateway: str | None = None
    ipv6_disabled: bool = True


class NetCounter(msgspec.Struct, frozen=True):
    role: str
    comment: str
    packets: int
    bytes: int


class NetCrew(msgspec.Struct, frozen=True):
    crew: str
    phase: str
    ifname: str
    subnet: str
    gateway: str
    address: str
    netns: str | None
    namespace_alive: bool
    in_map: bool
    host_end: NetLink | None
    crew_end: NetInnerView | None
    rules: tuple[NetCounter, ...]
    accepted_packets: int
    accepted_bytes: int
    dropped_packets: int
    dropped_bytes: int
    net: tuple[str, ...] = ()  # its address rules (netns CrewStatus.net)


class NetReport(msgspec.Struct, frozen=True):
    table: str
    table_present: bool
    base_differences: tuple[str, ...]
    crews: tuple[NetCrew, ...]
    counters: tuple[NetCounter, ...]
    orphan_links: tuple[str, ...]
    orphan_chains: tuple[str, ...]


encoder = msgspec.json.Encoder()
