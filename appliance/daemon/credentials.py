"""The admin API's credential endpoints and the push of crews' provider keys to the proxy.

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
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from appliance.credstore import CredentialStore, CredStoreError, SecretValue
from native.scrub import Scrubber

from . import messages
from .errors import DaemonError, Unavailable

if TYPE_CHECKING:
    from .proxy import ProxyPool

log = logging.getLogger("applianced.credentials")


class CredentialError(DaemonError):
    """A credential store error as the admin API answers it (status and code carried over)."""

    def __init__(self, error: CredStoreError) -> None:
        self.status = error.status
        self.code = error.code
        super().__init__(str(error))


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
    for info in store.list():
        value = store.value(info.name)
        try:
            secrets.append((info.name, value.reveal()))
        finally:
            value.wipe()
    return Scrubber(secrets)


class CredentialsApi:
    def __init__(self, store: CredentialStore, proxy: ProxyPool) -> None:
        self.store = store
        self.proxy = proxy
        # Where the store's values must be scrubbed too (the journal): given a fresh scrubber
        # at start and after every change.
        self.scrubbed: list[Any] = []

    def source(self) -> dict[str, dict[str, str]]:
        return proxy_map(self.store)

    def refresh_scrubbers(self) -> None:
        scrubber = stored_scrubber(self.store)
        for holder in self.scrubbed:
            holder.scrubber = scrubber  # one attribute store: readers see the old or the new

    async def push(self, name: str) -> None:
        self.refresh_scrubbers()
        try:
            await self.proxy.set_credentials(self.source())
        except Unavailable as exc:
            raise Unavailable(
                f"credential {name!r}: saved in the store, but the running proxy did not take "
                f"the change ({exc}); it gets it when it restarts"
            ) from None

    async def handle(self, method: str, parts: list[str], body: bytes) -> tuple[int, Any]:
        try:
            return await self._handle(method, parts, body)
        except CredStoreError as exc:
            raise CredentialError(exc) from None

    async def _handle(self, method: str, parts: list[str], body: bytes) -> tuple[int, Any]:
        from .api import _decode, _MethodNotAllowed, _NotFound

        store = self.store
        if len(parts) == 1:
            if method == "GET":
                listing = tuple(info_message(i) for i in store.list())
                return 200, messages.CredentialList(listing)
            if method != "POST":
                raise _MethodNotAllowed(f"{method} not allowed on /v1/credentials")
            add = _decode(body, messages.AddCredential)
            with SecretValue(add.value) as value:
                info = store.add(add.name, add.provider, value, level=add.level, kind=add.kind)
            self.refresh_scrubbers()  # granted or not, the journal must not show it
            log.info(
                "credential %s added (provider %s, level %s)", info.name, info.provider, info.level
            )
            return 201, info_message(info)
        if len(parts) != 3:
            raise _NotFound("no such endpoint: /v1/" + "/".join(parts))
        name, action = parts[1], parts[2]
        if method != "POST":
            raise _MethodNotAllowed(f"{method} not allowed on /v1/credentials/{name}/{action}")
        if action == "grant":
            grant = _decode(body, messages.GrantCredential)
            info = store.grant(name, grant.crew, grant.agent)
            log.info("credential %s granted to crew %s", name, grant.crew)
        elif action == "revoke":
            revoke = _decode(body, messages.RevokeCredential)
            info = store.revoke(name, revoke.crew, revoke.agent)
            log.info("credential %s revoked (%s)", name, revoke.crew or "every crew")
        elif action == "rotate":
            rotate = _decode(body, messages.RotateCredential)
            with SecretValue(rotate.value) as value:
                info = store.rotate(name, value, level=rotate.level)
            log.info("credential %s rotated to version %d", name, info.version)
        else:
            raise _NotFound(f"no such endpoint: /v1/credentials/{name}/{action}")
        await self.push(name)
        return 200, info_message(info)


__all__ = ["CredentialsApi", "proxy_map"]
