"""The admin API's typed bodies (msgspec Structs), shared by applianced and appliancectl.

Requests are decoded with `forbid_unknown_fields`, so a misspelled field is an error that names
it. Every error answer is `ErrorBody` with the HTTP status of the error (see errors.py). `run`
answers with chunked JSON lines: `RunOutput` per line of output, then one `RunExit`.
"""

from __future__ import annotations

import msgspec


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


class AllowHost(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str


class RunCommand(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    argv: tuple[str, ...]
    timeout: float | None = None


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


class CrewList(msgspec.Struct, frozen=True):
    crews: tuple[CrewInfo, ...]


class AllowResult(msgspec.Struct, frozen=True):
    crew: str
    host: str
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
    instance: str = ""  # the instance id (docs/daemon.md, "Instances")


class RunOutput(msgspec.Struct, frozen=True):
    stream: str
    line: str


class RunExit(msgspec.Struct, frozen=True):
    exit_code: int
    timed_out: bool = False


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


RunEvent = RunOutput | RunExit
encoder = msgspec.json.Encoder()
