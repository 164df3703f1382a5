"""The keeper in applianced: validate again, decide, journal, then deliver or execute.

Theory of operation
-------------------
The proxy worker forwards `POST /keeper/request` and `POST /keeper/execute` here with the crew
taken from the gateway the agent's connection arrived on (never from the body). applianced does
not trust the worker's checks (defence in depth, as the source documents say), so `handle`:

1. decodes the body (`KeeperBody`, unknown fields refused) and re-runs proxycore.protocol.keeper's
rules:
   intent (empty/whitespace refused), and for execute the command check, the argv split and
   the encoder rule (proxycore/protocol/keeper_encoders.py, with the secret files only
   applianced knows: the store, its key file, the providers' credential files);
2. looks the credential up *for this crew and agent*: an ungranted, revoked or unknown
   credential gets the same answer (a crew learns nothing of others' credentials);
3. decides: the L1 fast path (request only), else the gatekeeper model with the crew's recent
   journal entries; every failure of the model is DENY (appliance/keeper/gatekeeper.py);
4. journals `keeper.decision` (acknowledged on disk before the agent hears the answer);
5. on ALLOW: `request` returns the value; `execute` runs the argv through the runtime provider's
   exec in the crew's agent container with the value only in that command's environment (as
   `env_name(credential)`), passes stdout and stderr through the crew's scrubber (every value
   of the store, this one certainly, the shapes; one stream per pipe) and withholds a pipe that
   is not text (appliance/keeper/output.py), journals `command.executed`, and returns the
   output. The proxy worker scrubs the answer again with the keys only it holds.

Nothing here caches a decision; each call is decided afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
import trio

from appliance.credstore import CredentialStore, CredStoreError
from appliance.journal import entries as E
from appliance.journal.recorder import JournalRecorder
from appliance.keeper.gatekeeper import (
    Decision,
    GatekeeperConfig,
    KeeperQuery,
    Verdict,
)
from appliance.keeper.ollama import ask_gatekeeper
from appliance.keeper.output import OutputGuard
from appliance.runtime.base import ExecExited, ExecOutput, RuntimeProvider
from native.scrub import Scrubber
from native.scrub_patterns import DEFAULT_SHAPES, Shape
from proxycore.protocol.keeper import (
    KEEPER_BODY_BYTES,
    Action,
    KeeperBody,
    KeeperRefused,
    Level,
    check_intent,
    credential_named,
    decode_keeper_body,
    env_name,
    fast_path_allows,
    parse_command,
)
from proxycore.protocol.keeper_encoders import SecretSources, check_secret_encoding

log = logging.getLogger("applianced.keeper")

MAX_BODY_BYTES = KEEPER_BODY_BYTES
EXEC_TIMEOUT_SECONDS = 120.0
MAX_OUTPUT_BYTES = 1 << 20
RECENT_ACTIVITY = 20


class Answer(msgspec.Struct, frozen=True, omit_defaults=True):
    decision: str  # "allow" | "deny"
    reason: str
    value: str | None = None  # request, allowed
    exit_code: int | None = None  # execute, allowed
    timed_out: bool = False
    stdout: str | None = None
    stderr: str | None = None
    truncated: bool = False
    # Pipes whose output was not text and was replaced by a refusal (appliance/keeper/output.py).
    withheld: tuple[str, ...] = ()
    error: str | None = None  # a refusal before any decision: its rule


class RecentActivity(Protocol):
    def __call__(self, crew: str) -> tuple[str, ...]: ...


class KeeperService:
    def __init__(
        self,
        store: CredentialStore,
        gatekeeper: GatekeeperConfig,
        recorder: JournalRecorder,
        provider: RuntimeProvider | None,
        recent_activity: RecentActivity | None = None,
        ask: Callable[[GatekeeperConfig, KeeperQuery], Any] = ask_gatekeeper,
        *,
        secret_paths: Sequence[str] = (),
        shapes: Sequence[Shape] = DEFAULT_SHAPES,
    ) -> None:
        self.store = store
        # Files that hold a secret besides the well-known ones (the store, its key file, the
        # providers' credential files): an execute that reads one through an encoder is refused.
        self.secret_paths = tuple(secret_paths)
        self.shapes = tuple(shapes)
        self.gatekeeper = gatekeeper
        self.recorder = recorder
        self.provider = provider
        self.recent_activity = recent_activity
        self._ask = ask

    async def handle(self, action: Action, crew: str, body: bytes) -> tuple[int, Answer]:
        """(HTTP status, answer) for one keeper call of `crew` (from the gateway)."""
        try:
            request = self._decode(body)
            intent = check_intent(request.intent)
            argv = None
            if action is Action.EXECUTE:
                argv = parse_command(request.command)
                check_secret_encoding(argv, self._sources(request.credential))
            elif request.command is not None:
                raise KeeperRefused("a request takes no command", rule="unexpected_command")
        except KeeperRefused as exc:
            # A refusal is a decision too: journaled, naming what the body named (if anything).
            named = credential_named(body)
            await self.recorder.record(
                E.KeeperDecision(
                    crew=crew,
                    action=action.value,
                    credential=named,
                    decision=Decision.DENY.value,
                    reason=f"{exc} (refused: {exc.rule})",
                )
            )
            return 400, Answer("deny", str(exc), error=exc.rule)
        level = self._level(request.credential, crew, request.agent)
        if level is None:
            verdict = Verdict(Decision.DENY, "no such credential for this crew", "", "grant")
        elif fast_path_allows(action, level, intent):
            verdict = Verdict(Decision.ALLOW, "L1 fast path", "low", "fast_path")
        else:
            verdict = await self._ask(
                self.gatekeeper,
                KeeperQuery(
                    action=action.value,
                    credential=request.credential,
                    level=level.value,
                    intent=intent,
                    crew=crew,
                    agent=request.agent,
                    argv=argv,
                    recent_activity=await self._recent(crew),
                ),
            )
        await self.recorder.record(
            E.KeeperDecision(
                crew=crew,
                agent=request.agent,
                action=action.value,
                credential=request.credential,
                decision=verdict.decision.value,
                reason=f"{verdict.reason} ({verdict.source})",
                level=level.value if level is not None else "",
            )
        )
        if not verdict.allowed:
            status = 404 if verdict.source == "grant" else 403
            return status, Answer("deny", verdict.reason)
        try:
            secret = self.store.value_for(request.credential, crew, request.agent)
        except CredStoreError:
            # Revoked between the decision and now: the decision no longer applies.
            return 404, Answer("deny", "no such credential for this crew")
        try:
            value = secret.reveal().decode("utf-8", "replace")
        finally:
            secret.wipe()
        if argv is None:
            return 200, Answer("allow", verdict.reason, value=value)
        return await self._execute(crew, request, argv, value, verdict)

    def _sources(self, credential: str) -> SecretSources:
        return SecretSources((env_name(credential),), self.secret_paths)

    async def _output_scrubber(self, credential: str, value: str) -> Scrubber:
        """The crew's scrubber for an execute's output: every value in the store (the crew may
        see none of them through an execute: `request` is how a value is delivered), this
        value certainly (read just now, whatever the store's state), and the shapes. The store
        is read here (its SQLite connection is this thread's); the compiling, tens of ms for
        hundreds of values, in a worker thread."""
        secrets: dict[tuple[str, bytes], None] = {(credential, value.encode("utf-8")): None}
        for name, stored in self.store.values_to_scrub():
            try:
                secrets[(name, stored.reveal())] = None
            finally:
                stored.wipe()
        return await trio.to_thread.run_sync(Scrubber, list(secrets), self.shapes)

    def _decode(self, body: bytes) -> KeeperBody:
        return decode_keeper_body(body)

    def _level(self, name: str, crew: str, agent: str | None) -> Level | None:
        try:
            if not self.store.is_granted(name, crew, agent):
                return None
            return Level(self.store.info(name).level)
        except (CredStoreError, ValueError):
            return None

    async def _recent(self, crew: str) -> tuple[str, ...]:
        if self.recent_activity is None:
            return ()
        try:
            return await trio.to_thread.run_sync(self.recent_activity, crew)
        except Exception as exc:  # the model then judges the request alone
            log.warning("keeper: no recent activity for crew %s: %s", crew, exc)
            return ()

    async def _execute(
        self, crew: str, request: KeeperBody, argv: tuple[str, ...], value: str, verdict: Verdict
    ) -> tuple[int, Answer]:
        if self.provider is None:
            return 503, Answer("deny", "no runtime provider to execute in")
        try:
            scrubber = await self._output_scrubber(request.credential, value)
        except Exception as exc:  # nothing runs whose output could not be scrubbed
            log.error("keeper: no scrubber for an execute of crew %s: %s", crew, type(exc).__name__)
            return 503, Answer("deny", "the keeper cannot scrub output now; nothing was run")
        # One scrubber stream per pipe, so a value split across writes is still caught, and a
        # pipe that is not text is withheld (appliance/keeper/output.py).
        guards = {
            pipe: OutputGuard(pipe, scrubber.stream(), MAX_OUTPUT_BYTES)
            for pipe in ("stdout", "stderr")
        }
        exited = ExecExited(exit_code=-1, timed_out=False)
        async for item in self.provider.exec(
            crew,
            list(argv),
            env={env_name(request.credential): value},
            timeout=EXEC_TIMEOUT_SECONDS,
        ):
            if isinstance(item, ExecOutput):
                guards[item.stream].feed(item.line)
            elif isinstance(item, ExecExited):  # never ExecAttached: not asked for
                exited = item
        text = {pipe: guard.finish() for pipe, guard in guards.items()}
        withheld = tuple(pipe for pipe, guard in guards.items() if guard.withheld is not None)
        for pipe in withheld:
            log.warning(
                "keeper: %s of an execute of crew %s withheld: %s",
                pipe,
                crew,
                guards[pipe].withheld,
            )
        await self.recorder.record(
            E.CommandExecuted(
                crew=crew,
                agent=request.agent,
                argv=argv,
                exit_code=None if exited.timed_out else exited.exit_code,
                credential=request.credential,
            )
        )
        return 200, Answer(
            "allow",
            verdict.reason,
            exit_code=exited.exit_code,
            timed_out=exited.timed_out,
            stdout=text["stdout"],
            stderr=text["stderr"],
            truncated=any(guard.truncated for guard in guards.values()),
            withheld=withheld,
        )
