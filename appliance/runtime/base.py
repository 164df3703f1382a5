"""The contract between the control plane and a runtime provider (Docker, or no isolation).

Theory of operation
-------------------
A crew is a *pod*: one infra container that holds the crew's network namespace (started with
network "none", so the engine gives it only loopback) and the agent container(s) that join it.
The control plane drives the steps in this order, so that no agent process ever runs before its
network rules exist:

    provider.create_infra(spec)      -> Pod (infra container running, netns reachable by pid)
    netns.CrewNetworks.attach(crew, pod.netns_path)   (rules first, then the veth: netns/)
    provider.start_agent(spec, pod)  -> agent container joined to the infra's namespace
    provider.exec(crew, argv, ...)   -> streamed output, exit code
    provider.remove_crew(crew)       -> every container of the crew gone (volumes kept unless asked)

Everything a provider creates carries the labels below, among them the appliance's instance id
(`LABEL_INSTANCE`), so that `owned()` finds it after a crash (reconciliation at every start of
applianced) and finds nothing of another appliance on the same engine: `owned()` and
`remove_crew()` select by the instance id, never by name. Containers made before instance ids
lack that label (labels cannot be added to a container); the daemon hands their ids, read from
its own state, to `adopt()`. Providers are synchronous and blocking (the
Docker API answers in milliseconds to a second); the trio daemon calls them with
`trio.to_thread.run_sync`. `exec` is the exception: output is streamed, so it is an async
generator, cancellable (cancellation kills the process).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from proxycore.protocol.credentials import Provider
from proxycore.protocol.placeholders import placeholder

LABEL_APPLIANCE = "io.agent-appliance.owner"  # value: "applianced"
LABEL_CREW = "io.agent-appliance.crew"  # value: crew name
LABEL_ROLE = "io.agent-appliance.role"  # value: a ContainerRole
LABEL_INSTANCE = "io.agent-appliance.instance"  # value: the appliance's instance id
LABELS_OWNER_VALUE = "applianced"

AGENT_UID = 1001
DEFAULT_MEMORY_BYTES = 512 * 1024 * 1024
DEFAULT_CPUS = 1.0
PIDS_LIMIT = 200
TMP_SIZE = "500m"

# The agent CLIs refuse to start without a key of their own (Claude Code: "Not logged in"), so
# each variable holds its provider's placeholder for the crew, which is no credential: the proxy
# removes whatever credential an agent sends and injects the operator's, on an exact
# provider-host match only, and refuses a request that carries a placeholder anywhere else
# (proxycore/protocol/placeholders.py). `agent_keys` is the one place the values are made.
AGENT_KEY_VARIABLES = {
    "ANTHROPIC_API_KEY": Provider.ANTHROPIC,
    "OPENAI_API_KEY": Provider.OPENAI,
    "GEMINI_API_KEY": Provider.GOOGLE,
}


def agent_keys(crew: str) -> dict[str, str]:
    """What crew `crew`'s agent environment holds where the SDKs expect their keys."""
    return {name: placeholder(provider, crew) for name, provider in AGENT_KEY_VARIABLES.items()}


KNOWN_RUNTIMES = ("runc", "runsc", "kata-runtime", "sysbox-runc", "crun")


class ContainerRole(enum.StrEnum):
    INFRA = "infra"
    AGENT = "agent"


class CrewSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a crew's containers look like. Validated by the control plane before any step."""

    name: str  # checked by netns.addressing.check_crew_id rules (length, characters)
    image: str  # the agent image (images/), e.g. "agent-appliance/agent:<hash>"
    infra_image: str  # the infra image (images/)
    runtime: str = (
        "runc"  # one of KNOWN_RUNTIMES and present in the engine, else RuntimeUnavailable
    )
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    cpus: float = DEFAULT_CPUS
    net_raw: bool = False  # NET_RAW only when the operator asks for it for this crew
    env: dict[str, str] = {}  # proxy variables, provider base URLs; never a credential
    # host paths the operator configured, and applianced's read-only trust files (the crew CA):
    # (host path, container path, read_only)
    mounts: tuple[tuple[str, str, bool], ...] = ()


class Pod(msgspec.Struct, frozen=True):
    crew: str
    infra_id: str
    infra_pid: int
    runtime: str

    @property
    def netns_path(self) -> str:
        return f"/proc/{self.infra_pid}/ns/net"


class OwnedContainer(msgspec.Struct, frozen=True):
    crew: str
    role: ContainerRole
    container_id: str
    running: bool


class ExecOutput(msgspec.Struct, frozen=True):
    stream: str  # "stdout" or "stderr"
    line: bytes  # one line, with its newline (the last one may lack it)


class ExecExited(msgspec.Struct, frozen=True):
    exit_code: int  # -1 on timeout (the process was killed)
    timed_out: bool = False


class AttachedExec(Protocol):
    """A running exec's input side (`docker exec -i -t`): the client's bytes, the end of its
    input, a signal for the command's process group, its TTY's window size."""

    async def write(self, data: bytes) -> None: ...
    async def close_stdin(self) -> None: ...
    async def signal(self, signum: int) -> None: ...
    async def resize(self, rows: int, columns: int) -> None: ...


class ExecAttached(msgspec.Struct, frozen=True):
    """The first event of an attached exec (`exec(..., attach=True)`): its input side."""

    handle: AttachedExec


class RuntimeProvider(Protocol):
    name: str  # "docker" or "subprocess"
    isolated: bool  # False only for the subprocess provider ("no isolation")

    def runtimes(self) -> tuple[str, ...]: ...  # the runtimes the engine really has
    def create_infra(self, spec: CrewSpec) -> Pod: ...
    def start_agent(self, spec: CrewSpec, pod: Pod) -> str: ...  # the agent container id
    def exec(
        self,
        crew: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[ExecAttached | ExecOutput | ExecExited]: ...
    def remove_crew(self, crew: str, *, volumes: bool = False) -> None: ...  # idempotent
    def bind_instance(self, instance: str) -> None: ...  # once, before anything is made
    def owned(self) -> list[OwnedContainer]: ...  # this instance's only
    # Containers recorded in the daemon's state that carry no instance label (made before
    # instance ids) are this instance's too; `legacy_crews` keep their volumes' former names.
    def adopt(self, container_ids: set[str], legacy_crews: set[str]) -> None: ...
