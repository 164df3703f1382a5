"""Each crew's CA, its trust files, and the leaves applianced mints and pushes to the proxy.

Theory of operation
-------------------
A crew gets its CA (appliance/crew_ca.py) when its agent is first brought up (`ensure`): the key
sealed in the credential store's `crew_cas` table (appliance/credstore/store.py says why a table
of its own), the certificate beside it and in two files under `<state_dir>/crew-tls/<crew>/`:

    crew-ca.pem     the crew CA alone                     -> /etc/agent-appliance/crew-ca.pem
    bundle.pem      the host's system bundle + the CA     -> /etc/ssl/certs/ca-certificates.crt

both 0644 (the agent's UID reads them) in root's 0700 state directory (nobody else reaches them),
bind-mounted read-only into the agent container, with SSL_CERT_FILE, REQUESTS_CA_BUNDLE and
CURL_CA_BUNDLE naming the bundle and NODE_EXTRA_CA_CERTS the CA (Node adds it to its own store).
Without isolation (the subprocess provider: no container, no mounts) the same variables name the
files where they are on the host; nothing replaces the host's own system bundle there.

The CA key never leaves applianced: not into a file, the crew, a log (CrewCA and Leaf keep it out
of their repr) or a worker. What a worker gets is `crew_leaves`: one leaf per host where the
plaintext is needed, namely

    - every host of the crew's method and path rules (else its tunnels are refused), and
    - every provider host the crew has a credential for: a crew-wide grant in the store, or the
      provider's configured key (`credential_env`/`credential_file`), which serves every crew,

minted from a LeafCache per crew (7-day leaves). ProxyPool sends the set after every `crew_add`
(create, re-add at start, a restarted worker's restore); `keep_renewed` re-mints, every
RENEW_INTERVAL, the leaves that would pass half their lifetime within RENEW_EARLY and re-sends a
crew's set when it changed; a credential grant, revoke or rotate re-sends the sets that changed
(`ProxyPool.push_leaves`). The work per round is bounded: MAX_LEAVES hosts per crew at most.

A crew from before crew CAs (no CA in the store) is served as before, its tunnels opaque: giving
it a CA its running agent does not trust would break its provider tunnels. It gets one when its
agent is next brought up (a re-create at start, or `crew rm` and `crew create`).

Rotation: there is no command; recreate the crew (docs/daemon.md, "Crew CAs").
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import trio

from appliance.credstore import PROXY_PROVIDERS, CredentialStore, SecretValue
from appliance.crew_ca import LEAF_LIFETIME, CrewCA, LeafCache, new_ca
from proxycore import control
from proxycore.config import DEFAULT_BASE_URLS, MAX_LEAVES, ProviderConfig, ProxyConfig

from .errors import Unavailable
from .proxy import CrewEntry, ProxyPool

log = logging.getLogger("applianced.crew_tls")

SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# Where the crew sees its trust (the bundle replaces the image's system bundle).
CONTAINER_BUNDLE = str(SYSTEM_BUNDLE)
CONTAINER_CA = "/etc/agent-appliance/crew-ca.pem"
BUNDLE_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
CA_VARIABLE = "NODE_EXTRA_CA_CERTS"
# keep_renewed's round; a leaf is re-minted when it would pass half its lifetime within
# RENEW_EARLY (two rounds: a round late still renews it before the half).
RENEW_INTERVAL = datetime.timedelta(hours=1)
RENEW_EARLY = 2 * RENEW_INTERVAL
# A CA closer than this to its end is replaced when the crew is (re)created: its trust is
# written afresh then, and a CA past its end can sign no leaf.
CA_RENEW_BEFORE = datetime.timedelta(days=30)
assert RENEW_EARLY < LEAF_LIFETIME / 2


@dataclass(frozen=True, slots=True)
class CrewTrust:
    """A crew's trust files on the host."""

    bundle: Path
    ca: Path

    def mounts(self) -> tuple[tuple[str, str, bool], ...]:
        return ((str(self.bundle), CONTAINER_BUNDLE, True), (str(self.ca), CONTAINER_CA, True))

    def environment(self, *, isolated: bool) -> dict[str, str]:
        """The variables, naming the mounted paths (a container) or the host's (no isolation)."""
        bundle, ca = (
            (CONTAINER_BUNDLE, CONTAINER_CA) if isolated else (str(self.bundle), str(self.ca))
        )
        return {**dict.fromkeys(BUNDLE_VARIABLES, bundle), CA_VARIABLE: ca}


class CrewTLS:
    """The crews' CAs and leaf caches (applianced's trio thread only)."""

    def __init__(
        self,
        store: CredentialStore,
        state_dir: Path,
        proxy_config: ProxyConfig,
        *,
        system_bundle: Path = SYSTEM_BUNDLE,
    ) -> None:
        self.store = store
        self.dir = state_dir / "crew-tls"
        self.proxy_config = proxy_config
        self.system_bundle = system_bundle
        self._caches: dict[str, LeafCache] = {}

    # -- the CA and the trust files ---------------------------------------------------------

    def trust(self, crew: str) -> CrewTrust:
        where = self.dir / crew
        return CrewTrust(bundle=where / "bundle.pem", ca=where / "crew-ca.pem")

    def ensure(self, crew: str) -> tuple[CrewTrust, bool]:
        """The crew's CA (made now if it has none) and its trust files written afresh; whether
        the CA was made by this call (its undo removes it then, and only then)."""
        ca = self._ca(crew)
        if ca is not None:
            left = ca.cert.not_valid_after_utc - datetime.datetime.now(datetime.UTC)
            if left < CA_RENEW_BEFORE:
                # This call installs the trust afresh and the agent starts with it, so an
                # expiring CA is replaced here; past its end it could sign no leaf at all.
                log.warning("crew %s: its CA ends in %s; replacing it", crew, left)
                self.forget(crew)
                ca = None
        made = ca is None
        if ca is None:
            ca = new_ca(crew)
            with SecretValue(ca.key_pem()) as key:
                self.store.put_crew_ca(crew, ca.cert_pem, key)
            self._caches[crew] = LeafCache(ca)
            log.info("crew %s: made its CA (valid until %s)", crew, ca.cert.not_valid_after_utc)
        try:
            trust = self.trust(crew)
            try:
                system = self.system_bundle.read_bytes()
            except FileNotFoundError:
                system = b""
            if system and not system.endswith(b"\n"):
                system += b"\n"
            self.dir.mkdir(mode=0o700, exist_ok=True)
            trust.ca.parent.mkdir(mode=0o755, exist_ok=True)
            _write(trust.ca, ca.cert_pem)
            _write(trust.bundle, system + ca.cert_pem)
        except BaseException:
            if made:  # the caller's undo runs only for what this call returned
                self.forget(crew)
            raise
        return trust, made

    def forget(self, crew: str) -> None:
        """The crew's CA, leaves and files gone (idempotent)."""
        self._caches.pop(crew, None)
        self.store.delete_crew_ca(crew)
        shutil.rmtree(self.dir / crew, ignore_errors=True)

    def known(self) -> tuple[str, ...]:
        """The crews the store holds a CA for."""
        return self.store.crew_ca_names()

    def _ca(self, crew: str) -> CrewCA | None:
        cache = self._caches.get(crew)
        if cache is not None:
            return cache.ca
        found = self.store.crew_ca(crew)
        if found is None:
            return None
        cert_pem, key = found
        with key:
            ca = CrewCA.load(crew, cert_pem, key.reveal())
        self._caches[crew] = LeafCache(ca)
        return ca

    # -- the leaves -------------------------------------------------------------------------

    def source(self, entry: CrewEntry, early: datetime.timedelta) -> control.CrewLeaves | None:
        """ProxyPool.leaves_source."""
        return self.leaves(entry.name, tuple(rule.host for rule in entry.rules), early=early)

    async def keep_renewed(self, proxy: ProxyPool) -> None:
        """Every RENEW_INTERVAL, renew what is due and send the sets that changed; runs until
        cancelled. A round that fails (no worker running) is logged; the next one retries."""
        while True:
            await trio.sleep(RENEW_INTERVAL.total_seconds())
            try:
                sent = await proxy.push_leaves(RENEW_EARLY)
            except Unavailable as exc:
                log.error("renewing the crews' leaves: %s (again in %s)", exc, RENEW_INTERVAL)
                continue
            except Exception:
                # Best effort: a round that fails for any other reason must not end applianced
                # (this task runs in its main nursery); the leaves still valid keep serving.
                log.exception("renewing the crews' leaves failed (again in %s)", RENEW_INTERVAL)
                continue
            if sent:
                log.info("renewed leaves sent for %d crew(s)", sent)

    def hosts(self, crew: str, rule_hosts: tuple[str, ...]) -> tuple[str, ...]:
        """Where the crew's plaintext is needed: its rules' hosts, then the provider hosts it
        has a credential for (the store's crew-wide grants, or the provider's configured key)."""
        providers = self.proxy_config.providers
        granted = {
            info.provider
            for info in self.store.list()
            if info.provider in PROXY_PROVIDERS
            and info.revoked is None
            and not info.tampered
            and any(g.crew == crew and g.agent is None for g in info.grants)
        }
        hosts = dict.fromkeys(rule_hosts)
        for name in PROXY_PROVIDERS:
            configured: ProviderConfig = getattr(providers, name)
            if name in granted or configured.credential_env or configured.credential_file:
                url = urllib.parse.urlsplit(configured.base_url or DEFAULT_BASE_URLS[name])
                assert url.hostname is not None  # checked by the config's validation
                hosts[url.hostname.lower()] = None
        return tuple(hosts)[:MAX_LEAVES]

    def leaves(
        self,
        crew: str,
        rule_hosts: tuple[str, ...],
        *,
        early: datetime.timedelta = datetime.timedelta(0),
    ) -> control.CrewLeaves | None:
        """The crew's whole set, minting what is missing or due (`early`: that long before its
        half-life); None for a crew without a CA (see the theory of operation)."""
        if self._ca(crew) is None:
            return None
        cache = self._caches[crew]
        now = datetime.datetime.now(datetime.UTC)
        pems: list[control.LeafPem] = []
        for host in self.hosts(crew, rule_hosts):
            leaf = cache.get(host, now=now, early=early)
            pems.append(
                control.LeafPem(
                    host=host, cert_pem=leaf.cert_pem.decode(), key_pem=leaf.key_pem.decode()
                )
            )
        return control.CrewLeaves(crew=crew, leaves=tuple(pems))


def _write(path: Path, data: bytes) -> None:
    """Replaced whole (a reader never sees half a bundle), 0644: the agent's UID reads it."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(tmp, path)


__all__ = ["CONTAINER_BUNDLE", "CONTAINER_CA", "SYSTEM_BUNDLE", "CrewTLS", "CrewTrust"]
