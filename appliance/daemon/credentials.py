"""The admin API's credential endpoints (routed in api.py's table) and the push of crews'
provider keys to the proxy.

    GET    /v1/credentials                 CredentialList (never a value)
    POST   /v1/credentials                 AddCredential -> 201 CredentialInfo
    POST   /v1/credentials/{name}/grant    GrantCredential -> CredentialInfo
    POST   /v1/credentials/{name}/revoke   RevokeCredential -> CredentialInfo
    POST   /v1/credentials/{name}/rotate   RotateCredential -> CredentialInfo

Theory of operation: the store (appliance/credstore) is the source of truth. After every change
that can alter what the proxy injects (grant, revoke, rotate), applianced decrypts every crew-wide
grant of a provider credential and sends the whole map to the proxy (`credentials_set` over the
socketpair) before it answers, so when `appliancectl cred rotate` returns, the next request
upstream carries the new key. The proxy child asks for the map again after every restart
(ProxyPool.credentials_source). The decrypted values are wiped as soon as the message is encoded;
applianced holds no plaintext between pushes.

A change whose push fails
-------------------------
The store is committed first and `credential.changed` journaled at once: the change happened,
whatever the proxy does next. The push then has PUSH_TIMEOUT seconds, per worker. A worker that
does not answer in time (stopped, wedged) has an unknown state, and after a revoke or a rotate
it may still inject the old value: the pool kills it (ProxyPool.set_credentials), and its
successor reads the whole map from the store before it serves any crew (ProxyPool._restore); a
request that timed out also leaves its control channel out of step, which only a new channel
cures. If a worker refuses the map or none answers, every worker is killed (kill_all). Then
`credential.push_failed` is journaled (the error, the pids killed): an auditor sees the window
between the change and the kill. The operator's command fails with
502 `not_in_effect` (appliancectl exit 7): stored, journaled, not confirmed by the running proxy.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from appliance.credstore import CredentialInfo, CredentialStore, CredStoreError, SecretValue
from appliance.journal.recorder import JournalRecorder
from native.scrub import Scrubber

from . import messages
from .errors import DaemonError, Unavailable

if TYPE_CHECKING:
    from .proxy import ProxyPool

log = logging.getLogger("applianced.credentials")

# How long a push may take before the proxy is declared not to have taken it. A healthy proxy
# answers in milliseconds; this also covers a push that lands while a worker restarts after a
# first crash (0.5 s backoff, then its start-up). A worker further into its backoff
# (appliance/daemon/supervisor.py) reads the whole map from the store when it starts.
PUSH_TIMEOUT = 5.0


class CredentialError(DaemonError):
    """A credential store error as the admin API answers it (status and code carried over)."""

    def __init__(self, error: CredStoreError) -> None:
        self.status = error.status
        self.code = error.code
        super().__init__(str(error))


class ChangeNotInEffect(DaemonError):
    """The change is in the store and the journal, but the running proxy did not confirm it;
    it was killed so that it cannot keep serving the previous map (see the module's theory)."""

    status = 502
    code = "not_in_effect"


def info_message(info: Any) -> messages.CredentialInfo:
    return msgspec.convert(msgspec.to_builtins(info), messages.CredentialInfo)


def proxy_map(store: CredentialStore) -> dict[str, dict[str, str]]:
    """crew -> provider -> value for the proxy; the SecretValues are wiped before returning."""
    decrypted = store.proxy_credentials()
    try:
        return {
            crew: {provider: value.reveal().decode("ascii") for provider, value in by.items()}
            for crew, by in decrypted.items()
        }
    finally:
        for by in decrypted.values():
            for value in by.values():
                value.wipe()


def stored_scrubber(store: CredentialStore) -> Scrubber:
    """A scrubber that knows every value in the store (and the default shapes): for what
    applianced writes itself, the journal first (a command line an operator typed a key into)."""
    secrets: list[tuple[str, bytes]] = []
    for name, value in store.values_to_scrub():
        try:
            secrets.append((name, value.reveal()))
        finally:
            value.wipe()
    return Scrubber(secrets)


def report_refusals(infos: list[CredentialInfo]) -> int:
    """Log every credential and grant the store refuses (names only); how many."""
    count = 0
    for info in infos:
        if info.tampered:
            count += 1
            log.error(
                "credential %s does not authenticate: refused for every crew until rotated",
                info.name,
            )
        for bad in info.refused:
            count += 1
            who = bad.crew + (f"/{bad.agent}" if bad.agent else "")
            log.error(
                "credential %s: grant to %s refused (%s); `appliancectl cred ls` lists it",
                info.name,
                who,
                bad.reason,
            )
    return count


class CredentialsApi:
    def __init__(self, store: CredentialStore, proxy: ProxyPool) -> None:
        self.store = store
        self.proxy = proxy
        self.push_timeout = PUSH_TIMEOUT
        # Where the store's values must be scrubbed too (the journal): given a fresh scrubber
        # at start and after every change.
        self.scrubbed: list[Any] = []

    def source(self) -> dict[str, dict[str, str]]:
        return proxy_map(self.store)

    def refresh_scrubbers(self) -> None:
        """At start and after every change: new scrubbers, and the store's refusals logged."""
        scrubber = stored_scrubber(self.store)
        for holder in self.scrubbed:
            holder.scrubber = scrubber  # one attribute store: readers see the old or the new
        report_refusals(self.store.list())

    async def push(
        self,
        info: CredentialInfo,
        action: str,
        recorder: JournalRecorder,
        *,
        crew: str | None = None,
        agent: str | None = None,
    ) -> None:
        """The whole map to the running proxy; ChangeNotInEffect (after killing the proxy and
        journaling why) if it does not confirm within `push_timeout`."""
        self.refresh_scrubbers()
        error: str | None = None
        killed: tuple[int, ...] = ()
        try:
            # Per worker: one that does not answer within push_timeout is killed by the pool.
            killed = await self.proxy.set_credentials(self.source(), timeout=self.push_timeout)
            if killed:
                error = f"proxy worker(s) did not answer within {self.push_timeout:g} s"
        except Unavailable as exc:
            # Refused, or nobody answered: no worker is trusted with the previous map.
            error = str(exc)
            killed = self.proxy.kill_all("a credential push failed")
        if error is None:
            return
        await recorder.credential_push_failed(
            info.name, action, error, proxy_killed=killed, crew=crew, agent=agent
        )
        if killed:
            after = (
                f"applianced killed the proxy worker(s) that did not confirm (pid "
                f"{', '.join(map(str, killed))}) so that they cannot keep using the previous "
                "credentials; their successors read them from the store before they serve any "
                "crew"
            )
        else:
            after = "no proxy is running; the next one reads the store before it serves any crew"
        log.error(
            "credential %s %s: the proxy did not confirm (%s); %s", info.name, action, error, after
        )
        raise ChangeNotInEffect(
            f"credential {info.name!r} {action} in the store (and journaled), but the running "
            f"proxy did not confirm it ({error}): {after}"
        )

    # -- the endpoints (routed by api.py); every change is journaled on `recorder` ---------

    def listing(self) -> messages.CredentialList:
        try:
            return messages.CredentialList(tuple(info_message(i) for i in self.store.list()))
        except CredStoreError as exc:
            raise CredentialError(exc) from None

    async def add(
        self, add: messages.AddCredential, recorder: JournalRecorder
    ) -> messages.CredentialInfo:
        try:
            with SecretValue(add.value) as value:
                info = self.store.add(add.name, add.provider, value, level=add.level, kind=add.kind)
        except CredStoreError as exc:
            raise CredentialError(exc) from None
        self.refresh_scrubbers()  # granted or not, the journal must not show it
        log.info(
            "credential %s added (provider %s, level %s)", info.name, info.provider, info.level
        )
        await self._journal(recorder, info, "added")
        return info_message(info)

    async def grant(
        self, name: str, grant: messages.GrantCredential, recorder: JournalRecorder
    ) -> messages.CredentialInfo:
        try:
            info = self.store.grant(name, grant.crew, grant.agent)
        except CredStoreError as exc:
            raise CredentialError(exc) from None
        log.info("credential %s granted to crew %s", name, grant.crew)
        return await self._changed(info, "granted", recorder, grant.crew, grant.agent)

    async def revoke(
        self, name: str, revoke: messages.RevokeCredential, recorder: JournalRecorder
    ) -> messages.CredentialInfo:
        try:
            info = self.store.revoke(name, revoke.crew, revoke.agent)
        except CredStoreError as exc:
            raise CredentialError(exc) from None
        log.info("credential %s revoked (%s)", name, revoke.crew or "every crew")
        return await self._changed(info, "revoked", recorder, revoke.crew, revoke.agent)

    async def rotate(
        self, name: str, rotate: messages.RotateCredential, recorder: JournalRecorder
    ) -> messages.CredentialInfo:
        try:
            with SecretValue(rotate.value) as value:
                info = self.store.rotate(name, value, level=rotate.level)
        except CredStoreError as exc:
            raise CredentialError(exc) from None
        log.info("credential %s rotated to version %d", name, info.version)
        return await self._changed(info, "rotated", recorder, None, None)

    async def _changed(
        self,
        info: CredentialInfo,
        done: str,
        recorder: JournalRecorder,
        crew: str | None,
        agent: str | None,
    ) -> messages.CredentialInfo:
        # Journaled before the push: whatever the proxy does, the store did change.
        await self._journal(recorder, info, done, crew=crew, agent=agent)
        try:
            await self.push(info, done, recorder, crew=crew, agent=agent)
        except CredStoreError as exc:
            raise CredentialError(exc) from None
        if self.proxy.leaves_source is not None:
            # A grant or revoke can add or remove a provider host from a crew's terminated
            # hosts (appliance/daemon/crew_tls.py): the sets that changed are sent. Their
            # failure is logged, not the command's: the credentials are in effect, and a
            # restarted worker is sent the current sets anyway.
            try:
                await self.proxy.push_leaves()
            except Unavailable as exc:
                log.error("credential %s %s: re-sending the crews' leaves: %s", info.name, done,
                          exc)  # fmt: skip
        return info_message(info)

    @staticmethod
    async def _journal(
        recorder: JournalRecorder,
        info: CredentialInfo,
        action: str,
        *,
        crew: str | None = None,
        agent: str | None = None,
    ) -> None:
        await recorder.credential_changed(
            info.name, action, provider=info.provider, level=info.level, version=info.version,
            crew=crew, agent=agent,
        )  # fmt: skip


__all__ = ["ChangeNotInEffect", "CredentialsApi", "proxy_map"]
