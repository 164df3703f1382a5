"""The journal's typed entries: one frozen msgspec Struct per entry type, a tagged union.

Every entry is scoped by (workspace, crew, agent, mission, trace_id); a run's entries share the
run id as trace_id, so a run is the aggregate of the entries with that trace id. The tag (the
`type` field of the JSON) is the entry type's dotted name. `summary()` is the one line shown by
`journal tail` and indexed for search together with the payload.
"""

from __future__ import annotations

import shlex
import time

import msgspec


class Entry(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    ts: float = msgspec.field(default_factory=time.time)
    workspace: str = "default"
    crew: str | None = None
    agent: str | None = None
    mission: str | None = None
    trace_id: str | None = None

    def summary(self) -> str:
        return str(type(self).__struct_config__.tag)


# -- runs (`appliancectl run`) ---------------------------------------------------------------


class RunStarted(Entry, frozen=True, tag="run.started"):
    argv: tuple[str, ...]
    timeout: float | None = None

    def summary(self) -> str:
        return f"run started: {shlex.join(self.argv)}"


class RunCompleted(Entry, frozen=True, tag="run.completed"):
    exit_code: int
    duration: float

    def summary(self) -> str:
        return f"run completed: exit {self.exit_code} in {self.duration:.3f} s"


class RunFailed(Entry, frozen=True, tag="run.failed"):
    error: str
    duration: float

    def summary(self) -> str:
        return f"run failed: {self.error}"


class RunCancelled(Entry, frozen=True, tag="run.cancelled"):
    duration: float

    def summary(self) -> str:
        return f"run cancelled after {self.duration:.3f} s"


class RunTimeout(Entry, frozen=True, tag="run.timeout"):
    timeout: float | None
    duration: float

    def summary(self) -> str:
        return f"run timed out after {self.duration:.3f} s"


# -- the proxy's decisions (from proxycore.protocol.events) ----------------------------------------


class WebSocketCounts(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a WebSocket session relayed (the proxy's `WebSocketSession`): frames (control
    frames included) and messages each way, whose Close (or failure) began the end and its
    code. Its payload bytes are the request's `bytes_up` and `bytes_down`."""

    frames_up: int = 0
    frames_down: int = 0
    messages_up: int = 0
    messages_down: int = 0
    closed_by: str = ""  # "agent" | "upstream" | "proxy"
    close_code: int = 0

    def summary(self, bytes_up: int, bytes_down: int) -> str:
        closed = f", closed by {self.closed_by} ({self.close_code})" if self.closed_by else ""
        return (
            f"websocket {bytes_up} B up / {bytes_down} B down, messages {self.messages_up} up / "
            f"{self.messages_down} down, frames {self.frames_up} up / {self.frames_down} down"
            f"{closed}"
        )


class AllowedRequest(msgspec.Struct, frozen=True, array_like=True):
    """One request in a `proxy.allow` entry, as a JSON array in this field order."""

    ts: float
    route: str  # forward | reverse | tunnel
    method: str
    host: str
    port: int
    address: str  # the address dialled
    rule: str
    # Appended later (older entries decode with these defaults): the answer, the bytes of the
    # bodies, how long it took, and "complete" or why the response was cut short.
    status: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    duration: float = 0.0
    ended: str = "complete"
    # Appended after those (older entries decode with None): a WebSocket session's counts,
    # null for any other request.
    websocket: WebSocketCounts | None = None


class DeniedRequest(msgspec.Struct, frozen=True, array_like=True):
    """One request in a `proxy.deny` entry, as a JSON array in this field order."""

    ts: float
    route: str
    method: str
    host: str
    port: int
    rule: str
    status: int


class RefusedRequest(msgspec.Struct, frozen=True, array_like=True):
    """One request in a `proxy.refuse` entry: the proxy answered with its own error (bad
    input, a limit, a failed upstream). `route` "connection": refused before any request."""

    ts: float
    route: str
    method: str
    host: str
    port: int
    rule: str
    status: int
    message: str = ""


class ErroredRequest(msgspec.Struct, frozen=True, array_like=True):
    """One request in a `proxy.error` entry: a failure the proxy did not plan for ended it;
    `status` is what the agent was told (0: nothing)."""

    ts: float
    route: str
    method: str
    host: str
    port: int
    cause: str
    status: int

    @property
    def rule(self) -> str:
        return self.cause


def _requests_summary(
    verb: str,
    requests: tuple[AllowedRequest, ...]
    | tuple[DeniedRequest, ...]
    | tuple[RefusedRequest, ...]
    | tuple[ErroredRequest, ...],
) -> str:
    if len(requests) == 1:
        (one,) = requests
        tail = f" -> {one.status}" if one.status else ""
        if isinstance(one, AllowedRequest) and one.websocket is not None:
            tail += ", " + one.websocket.summary(one.bytes_up, one.bytes_down)
            if one.ended != "complete":
                tail += f", ended: {one.ended}"  # a session's end is not a cut answer
        elif isinstance(one, AllowedRequest) and one.ended != "complete":
            tail += f", cut short: {one.ended}"
        return f"{verb} {one.method} {one.host}:{one.port} ({one.route}, rule {one.rule}){tail}"
    counts: dict[str, int] = {}
    for request in requests:
        key = f"{request.method} {request.host}:{request.port} ({request.rule})"
        counts[key] = counts.get(key, 0) + 1
    top = sorted(counts.items(), key=lambda item: -item[1])
    listed = ", ".join(f"{key} x{count}" for key, count in top[:3])
    more = f", {len(top) - 3} more" if len(top) > 3 else ""
    return f"{verb} {len(requests)} requests: {listed}{more}"


class ProxyAllow(Entry, frozen=True, tag="proxy.allow"):
    """Requests a proxy worker allowed for one crew, from one batch of its events: one entry
    per batch and crew, not per request (docs/journal.md, "One entry per batch"), each request
    with its own time. A journal's cost per request is then a share of one insert."""

    mode: str
    requests: tuple[AllowedRequest, ...]

    def summary(self) -> str:
        return _requests_summary("allow", self.requests)


class ProxyDeny(Entry, frozen=True, tag="proxy.deny"):
    """Requests a proxy worker refused for one crew, from one batch of its events (as
    `proxy.allow`)."""

    mode: str
    requests: tuple[DeniedRequest, ...]

    def summary(self) -> str:
        return _requests_summary("deny", self.requests)


class ProxyRefuse(Entry, frozen=True, tag="proxy.refuse"):
    """Requests a proxy worker answered with its own error for one crew, from one batch of its
    events (as `proxy.allow`)."""

    mode: str
    requests: tuple[RefusedRequest, ...]

    def summary(self) -> str:
        return _requests_summary("refuse", self.requests)


class ProxyError(Entry, frozen=True, tag="proxy.error"):
    """Requests a failure ended for one crew, from one batch of a worker's events."""

    requests: tuple[ErroredRequest, ...]

    def summary(self) -> str:
        return _requests_summary("error", self.requests)


class RefusedQuery(msgspec.Struct, frozen=True, array_like=True):
    """One refusal in a `dns.refused` entry, as a JSON array in this field order: the name and
    type the crew asked, why, what it was answered ("DROP": nothing), and how many queries."""

    ts: float
    name: str
    qtype: str
    rule: str
    rcode: str
    count: int = 1


class DnsRefused(Entry, frozen=True, tag="dns.refused"):
    """Queries a crew's DNS responder refused or failed, from one batch of a worker's events
    (one entry per batch and crew, as `proxy.deny`)."""

    queries: tuple[RefusedQuery, ...]

    def summary(self) -> str:
        if len(self.queries) == 1:
            (one,) = self.queries
            times = f" x{one.count}" if one.count > 1 else ""
            return f"dns refused {one.qtype} {one.name} ({one.rule}) -> {one.rcode}{times}"
        counts: dict[str, int] = {}
        for query in self.queries:
            key = f"{query.qtype} {query.name} ({query.rule})"
            counts[key] = counts.get(key, 0) + query.count
        top = sorted(counts.items(), key=lambda item: -item[1])
        listed = ", ".join(f"{key} x{count}" for key, count in top[:3])
        more = f", {len(top) - 3} more" if len(top) > 3 else ""
        return f"dns refused {sum(counts.values())} queries: {listed}{more}"


class CredentialInjected(Entry, frozen=True, tag="credential.injected"):
    provider: str
    host: str

    def summary(self) -> str:
        return f"credential of {self.provider} injected for {self.host}"


class TunnelOpened(Entry, frozen=True, tag="tunnel.opened"):
    tunnel_id: int
    host: str
    port: int
    address: str

    def summary(self) -> str:
        return f"tunnel {self.tunnel_id} opened to {self.host}:{self.port} ({self.address})"


class TunnelClosed(Entry, frozen=True, tag="tunnel.closed"):
    tunnel_id: int
    host: str
    port: int
    bytes_up: int
    bytes_down: int
    duration: float
    reason: str

    def summary(self) -> str:
        return (
            f"tunnel {self.tunnel_id} to {self.host}:{self.port} closed ({self.reason}): "
            f"{self.bytes_up} up, {self.bytes_down} down in {self.duration:.3f} s"
        )


class ProxyNotice(Entry, frozen=True, tag="proxy.notice"):
    """A policy warning, or events the proxy had to drop (its count is never lost)."""

    message: str
    dropped: int = 0

    def summary(self) -> str:
        return f"proxy: {self.message}"


class ProxyWorkerExited(Entry, frozen=True, tag="proxy.worker_exited"):
    """A proxy worker exited and applianced restarts it after `restart_in` seconds
    (appliance/daemon/supervisor.py). Not scoped to a crew: a worker serves every crew."""

    worker: int
    pid: int
    reason: str
    exit_code: int | None
    signal: str | None
    killed_by: str | None  # applianced killed it itself, for this reason
    uptime: float
    restarts: int
    restart_in: float
    stderr_tail: tuple[str, ...] = ()  # its last lines on stderr (scrubbed again on write)

    def summary(self) -> str:
        return (
            f"proxy worker {self.worker} (pid {self.pid}) {self.reason} after "
            f"{self.uptime:.1f} s; restart {self.restarts} in {self.restart_in:.1f} s"
        )


# -- control plane -----------------------------------------------------------------------------


class CommandExecuted(Entry, frozen=True, tag="command.executed"):
    argv: tuple[str, ...]
    exit_code: int | None
    credential: str | None = None  # the credential's name, never its value

    def summary(self) -> str:
        return f"command executed: {shlex.join(self.argv)} -> {self.exit_code}"


class KeeperDecision(Entry, frozen=True, tag="keeper.decision"):
    action: str  # "request" | "execute"
    credential: str
    decision: str  # "allow" | "deny"
    reason: str
    level: str = ""

    def summary(self) -> str:
        return f"keeper {self.decision} {self.action} of {self.credential}: {self.reason}"


class AllowlistChanged(Entry, frozen=True, tag="allowlist.changed"):
    host: str
    added: bool = True
    source: str = "admin"

    def summary(self) -> str:
        return f"allowlist: {'added' if self.added else 'removed'} {self.host} ({self.source})"


class ApprovalRequested(Entry, frozen=True, tag="approval.requested"):
    """A restricted crew was refused a host not on its allowlist, and a pending approval
    request was filed (once per crew and host while it stays pending, never per refusal)."""

    host: str
    port: int
    expires: float

    def summary(self) -> str:
        return f"approval requested: {self.host}:{self.port}"


class ApprovalAllowed(Entry, frozen=True, tag="approval.allowed"):
    """The operator allowed a host: permanently (the crew's allowlist, as `crew allow`) or
    `once` until `until`. `by`: the client's word for who; `peer`: the admin connection's."""

    host: str
    once: bool = False
    until: float | None = None
    was_pending: bool = False
    by: str | None = None
    peer: str | None = None

    def summary(self) -> str:
        how = "permanently"
        if self.once and self.until is not None:
            how = "until " + time.strftime("%H:%M:%S UTC", time.gmtime(self.until))
        return f"approval: {self.host} allowed {how}" + (f" by {self.by}" if self.by else "")


class ApprovalDenied(Entry, frozen=True, tag="approval.denied"):
    """The operator denied a host: refused without a new request until `until`."""

    host: str
    until: float
    was_pending: bool = False
    by: str | None = None
    peer: str | None = None

    def summary(self) -> str:
        return f"approval: {self.host} denied" + (f" by {self.by}" if self.by else "")


class CredentialChanged(Entry, frozen=True, tag="credential.changed"):
    """The store changed (written once the change is committed, before the proxy is told: a
    failed push cannot hide it). A grant or revoke for one crew carries it in the `crew` and
    `agent` scope; `credential.push_failed` follows if the running proxy did not confirm."""

    name: str
    action: str  # added | rotated | revoked | granted
    provider: str | None = None
    level: str | None = None
    version: int | None = None

    def summary(self) -> str:
        target = f" (crew {self.crew}" + (f", agent {self.agent})" if self.agent else ")")
        return f"credential {self.name} {self.action}" + (target if self.crew else "")


class CredentialPushFailed(Entry, frozen=True, tag="credential.push_failed"):
    """A change stored (its credential.changed precedes this) that the running proxy did not
    confirm: from the change until `proxy_killed` took effect, those proxy workers may still
    have used the previous map. applianced kills every worker that does not confirm
    (`proxy_killed`: their pids; empty if none was running); each restarts and reads the whole
    map from the store before it serves a crew."""

    name: str
    action: str
    error: str
    proxy_killed: tuple[int, ...] = ()

    def summary(self) -> str:
        pids = ", ".join(map(str, self.proxy_killed))
        after = (
            f"proxy worker(s) {pids} killed, restart from the store"
            if self.proxy_killed
            else "no proxy running; it starts from the store"
        )
        return f"credential {self.name} {self.action} not confirmed by the proxy: {after}"


class CrewCreated(Entry, frozen=True, tag="crew.created"):
    mode: str
    allow: tuple[str, ...]
    runtime: str
    # Its address rules, "allow:tcp:10.9.0.0/24:5432" (docs/netns.md "Address rules"); absent
    # from the entries of an older applianced, which read as none.
    net: tuple[str, ...] = ()

    def summary(self) -> str:
        net = f", net {', '.join(self.net)}" if self.net else ""
        allow = ", ".join(self.allow) or "-"
        return f"crew created ({self.mode}, {self.runtime}, allow {allow}{net})"


class CrewNetChanged(Entry, frozen=True, tag="crew.net_changed"):
    """A crew's address rules replaced at run time (`crew net`): the whole new list."""

    net: tuple[str, ...]

    def summary(self) -> str:
        return f"address rules: {', '.join(self.net) or 'none'}"


class CrewRemoved(Entry, frozen=True, tag="crew.removed"):
    def summary(self) -> str:
        return "crew removed"


class CrewFailed(Entry, frozen=True, tag="crew.failed"):
    error: str

    def summary(self) -> str:
        return f"crew failed: {self.error}"


class Checkpoint(Entry, frozen=True, tag="journal.checkpoint"):
    """Written by the journal itself where retention cut off its oldest entries
    (appliance/journal/retention.py): what was removed, and the chain's head when it was cut,
    signed with applianced's journal key (Ed25519, appliance/journal/signing.py). A verifier
    holding the public key accepts a journal that starts after seq 1 only if such a
    checkpoint accounts for the missing entries (docs/journal.md, "Retention")."""

    removed_from_seq: int
    removed_through_seq: int
    removed_through_hash: str  # the hash of the last entry removed: the next entry links to it
    removed_entries: int
    removed_oldest_ts: float
    removed_newest_ts: float
    reason: str
    head_seq: int  # this entry's seq - 1 ...
    head_hash: str  # ... and its prev_hash: the signature covers the chain up to here
    key: str  # the Ed25519 public key, 64 hex digits
    signature: str = ""  # Ed25519 over signing.checkpoint_message(): this entry, signature ""

    def summary(self) -> str:
        def day(ts: float) -> str:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))

        return (
            f"checkpoint: entries {self.removed_from_seq}..{self.removed_through_seq} removed "
            f"({self.removed_entries}, {day(self.removed_oldest_ts)} to "
            f"{day(self.removed_newest_ts)} UTC; {self.reason})"
        )


class Redacted(Entry, frozen=True, tag="journal.redacted"):
    """Stands in for an entry whose redaction left unreadable JSON (a secret with a quote)."""

    original_type: str

    def summary(self) -> str:
        return f"{self.original_type}: redacted (a secret inside this entry)"


AnyEntry = (
    RunStarted
    | RunCompleted
    | RunFailed
    | RunCancelled
    | RunTimeout
    | ProxyAllow
    | ProxyDeny
    | ProxyRefuse
    | ProxyError
    | DnsRefused
    | CredentialInjected
    | TunnelOpened
    | TunnelClosed
    | ProxyNotice
    | ProxyWorkerExited
    | CommandExecuted
    | KeeperDecision
    | AllowlistChanged
    | ApprovalRequested
    | ApprovalAllowed
    | ApprovalDenied
    | CredentialChanged
    | CredentialPushFailed
    | CrewCreated
    | CrewNetChanged
    | CrewRemoved
    | CrewFailed
    | Checkpoint
    | Redacted
)

ENTRY_TYPES: dict[str, type[Entry]] = {
    str(t.__struct_config__.tag): t
    for t in (
        RunStarted,
        RunCompleted,
        RunFailed,
        RunCancelled,
        RunTimeout,
        ProxyAllow,
        ProxyDeny,
        DnsRefused,
        CredentialInjected,
        TunnelOpened,
        TunnelClosed,
        ProxyNotice,
        ProxyWorkerExited,
        CommandExecuted,
        KeeperDecision,
        AllowlistChanged,
        ApprovalRequested,
        ApprovalAllowed,
        ApprovalDenied,
        CredentialChanged,
        CredentialPushFailed,
        CrewCreated,
        CrewNetChanged,
        CrewRemoved,
        CrewFailed,
        Checkpoint,
        Redacted,
    )
}

# Canonical encoding: struct fields in declaration order, the tag first; deterministic, so the
# hash of an entry is a function of its content.
encoder = msgspec.json.Encoder(order="deterministic")
decoder: msgspec.json.Decoder[AnyEntry] = msgspec.json.Decoder(AnyEntry)


def encode(entry: Entry) -> bytes:
    return encoder.encode(entry)


def decode(data: bytes | str) -> AnyEntry:
    return decoder.decode(data)
