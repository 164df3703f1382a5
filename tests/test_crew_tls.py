"""applianced's crew CAs without a daemon: the sealed `crew_cas` rows of the credential store,
the trust files and variables, which hosts get a leaf, renewal before the half-life, and the
pool's push of changed sets. The real-applianced side: tests/test_daemon_crew_tls.py."""

from __future__ import annotations

import datetime
import os
import stat
from pathlib import Path

import msgspec
import pytest
import trio

from appliance.credstore import CredentialStore, SecretValue, TamperedCrewCA
from appliance.crew_ca import LEAF_LIFETIME, LeafCache, new_ca
from appliance.daemon.crew_tls import RENEW_EARLY, CrewTLS
from appliance.daemon.proxy import CrewEntry, ProxyPool
from proxycore import control
from proxycore.config import ProxyConfig, RuleConfig

KEY = bytes(range(32))


def _store(tmp_path: Path) -> CredentialStore:
    return CredentialStore(tmp_path / "credentials.db", KEY)


def _config(**providers: dict[str, str]) -> ProxyConfig:
    return msgspec.convert({"providers": providers}, ProxyConfig)


def test_crew_ca_rows_are_sealed_to_their_crew_and_certificate(tmp_path: Path) -> None:
    store = _store(tmp_path)
    one, two = new_ca("one"), new_ca("two")
    for ca in (one, two):
        with SecretValue(ca.key_pem()) as key:
            store.put_crew_ca(ca.crew, ca.cert_pem, key)
    found = store.crew_ca("one")
    assert found is not None and found[0] == one.cert_pem
    assert found[1].reveal() == one.key_pem()
    assert store.crew_ca("nobody") is None
    assert store.crew_ca_names() == ("one", "two")
    # Not a credential: never listed, granted or sent to the proxy.
    assert store.list() == [] and store.proxy_credentials() == {}
    # The key is not in the file in clear.
    raw = (tmp_path / "credentials.db").read_bytes()
    if (tmp_path / "credentials.db-wal").exists():
        raw += (tmp_path / "credentials.db-wal").read_bytes()
    body = b"".join(one.key_pem().splitlines()[1:-1])
    assert body[:40] not in raw
    db = store._db
    # Paired with another crew's certificate, or moved to another crew: refused.
    db.execute("UPDATE crew_cas SET cert_pem = ? WHERE crew = 'one'", (two.cert_pem,))
    with pytest.raises(TamperedCrewCA):
        store.crew_ca("one")
    db.execute("DELETE FROM crew_cas WHERE crew = 'one'")
    db.execute("UPDATE crew_cas SET crew = 'one' WHERE crew = 'two'")
    with pytest.raises(TamperedCrewCA):
        store.crew_ca("one")
    store.delete_crew_ca("one")
    store.delete_crew_ca("one")  # idempotent
    assert store.crew_ca_names() == ()
    store.close()
    # Another key: refused at open, as for the credentials.
    with pytest.raises(Exception, match="another key"):
        CredentialStore(tmp_path / "credentials.db", bytes(32))


def test_ensure_writes_the_trust_once_per_ca_and_forget_removes_it(tmp_path: Path) -> None:
    system = tmp_path / "system.crt"
    system.write_bytes(b"-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----")
    tls = CrewTLS(_store(tmp_path), tmp_path / "state", _config(), system_bundle=system)
    (tmp_path / "state").mkdir(mode=0o700)
    trust, made = tls.ensure("crew")
    assert made
    ca_pem = trust.ca.read_bytes()
    assert trust.bundle.read_bytes() == system.read_bytes() + b"\n" + ca_pem
    for path in (trust.ca, trust.bundle):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "state" / "crew-tls").st_mode) == 0o700
    # Again (a re-create at start, or another applianced on the same store): the same CA.
    assert tls.ensure("crew") == (trust, False)
    again = CrewTLS(_store(tmp_path), tmp_path / "state", _config(), system_bundle=system)
    assert again.ensure("crew")[1] is False and trust.ca.read_bytes() == ca_pem
    # No system bundle: the CA alone.
    bare = CrewTLS(_store(tmp_path), tmp_path / "state", _config(), system_bundle=tmp_path / "x")
    assert bare.ensure("crew")[0].bundle.read_bytes() == ca_pem
    assert trust.environment(isolated=True) == {
        "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
        "REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt",
        "CURL_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt",
        "NODE_EXTRA_CA_CERTS": "/etc/agent-appliance/crew-ca.pem",
    }
    assert trust.environment(isolated=False)["SSL_CERT_FILE"] == str(trust.bundle)
    assert trust.mounts() == (
        (str(trust.bundle), "/etc/ssl/certs/ca-certificates.crt", True),
        (str(trust.ca), "/etc/agent-appliance/crew-ca.pem", True),
    )
    tls.forget("crew")
    assert tls.known() == () and not trust.ca.parent.exists()
    assert tls.leaves("crew", ("a.test",)) is None  # no CA: opaque, nothing sent


def test_terminated_hosts_are_rules_and_credentialed_providers(tmp_path: Path) -> None:
    store = _store(tmp_path)
    config = _config(openai={"credential_env": "OPENAI_KEY"})
    tls = CrewTLS(store, tmp_path, config)
    rules = ("api.github.com", "example.test")
    # The provider with a configured key serves every crew; the others only with a grant.
    assert tls.hosts("crew", rules) == ("api.github.com", "example.test", "api.openai.com")
    store.add("anth", "anthropic", b"sk-ant-api03-" + b"x" * 40)
    store.grant("anth", "crew")
    store.add("gem", "google", b"AIza" + b"y" * 35)
    store.grant("gem", "crew", "agent-1")  # an agent's grant is the keeper's, not the proxy's
    assert tls.hosts("crew", ()) == ("api.anthropic.com", "api.openai.com")
    assert tls.hosts("other", ()) == ("api.openai.com",)
    store.revoke("anth", "crew")
    assert tls.hosts("crew", ()) == ("api.openai.com",)


def test_leaves_are_cached_and_renewed_before_their_half_life(tmp_path: Path) -> None:
    tls = CrewTLS(_store(tmp_path), tmp_path, _config())
    tls.ensure("crew")
    first = tls.leaves("crew", ("a.test",))
    assert first is not None and [leaf.host for leaf in first.leaves] == ["a.test"]
    assert tls.leaves("crew", ("a.test",)) == first  # cached
    assert "BEGIN" not in repr(first.leaves[0])
    # Just before the half: kept by a plain get, renewed by the renewal's early look.
    cache = LeafCache(new_ca("x"))
    now = datetime.datetime.now(datetime.UTC)
    leaf = cache.get("a.test", now=now)
    later = leaf.not_before + LEAF_LIFETIME / 2 - RENEW_EARLY / 2
    assert cache.get("a.test", now=later) is leaf
    assert cache.get("a.test", now=later, early=RENEW_EARLY) is not leaf


class _Channel:
    """A worker's control channel that records what it is sent."""

    def __init__(self) -> None:
        self.sent: list[control.ControlMessage] = []

    async def request(
        self, message: control.ControlMessage, listener: object = None, fds: object = ()
    ) -> object:
        self.sent.append(message)
        return control.ControlReply(ok=True, changed=True)


def test_push_leaves_sends_only_the_sets_that_changed(tmp_path: Path) -> None:
    tls = CrewTLS(_store(tmp_path), tmp_path, _config())
    tls.ensure("crew")
    pool = ProxyPool(_config(), tmp_path, 0)
    pool.leaves_source = tls.source
    channel = _Channel()
    pool.workers[0].client = channel  # type: ignore[assignment]
    rule = RuleConfig(host="a.test", preset="read-only")
    pool.crews["crew"] = CrewEntry("crew", "100.64.0.1", "restricted", (), rules=(rule,))
    pool.crews["old"] = CrewEntry("old", "100.64.0.5", "restricted", ())  # no CA: nothing

    async def main() -> None:
        assert await pool.push_leaves() == 1
        assert await pool.push_leaves() == 0  # unchanged
        assert await pool.push_leaves(LEAF_LIFETIME) == 1  # everything due: renewed, sent

    trio.run(main)
    assert [type(m) for m in channel.sent] == [control.CrewLeaves, control.CrewLeaves]
    first, second = channel.sent
    assert isinstance(first, control.CrewLeaves) and isinstance(second, control.CrewLeaves)
    assert first.crew == "crew" and [leaf.host for leaf in first.leaves] == ["a.test"]
    assert first.leaves[0].cert_pem != second.leaves[0].cert_pem


def test_a_ca_near_its_end_is_replaced_and_a_failed_install_forgets_the_new_one(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    old = new_ca("crew", lifetime=datetime.timedelta(days=10))
    with SecretValue(old.key_pem()) as key:
        store.put_crew_ca("crew", old.cert_pem, key)
    (tmp_path / "state").mkdir()
    tls = CrewTLS(store, tmp_path / "state", _config(), system_bundle=tmp_path / "none")
    trust, made = tls.ensure("crew")
    assert made and trust.ca.read_bytes() != old.cert_pem  # replaced, not reused to its end
    # A CA made by a call whose trust files cannot be written is not left in the store.
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the directory goes")
    failing = CrewTLS(_store(tmp_path), blocked, _config(), system_bundle=tmp_path / "none")
    with pytest.raises(OSError):
        failing.ensure("other")
    assert "other" not in failing.known()
