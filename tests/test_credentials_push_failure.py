"""A credential change the running proxy does not confirm, through a real applianced: the proxy
is frozen with SIGSTOP (so it cannot answer), then `cred revoke` runs. The change is stored and
journaled (credential.changed), the failed push is journaled (credential.push_failed, with the
pid killed), the command exits 7 (HTTP 502 not_in_effect), the frozen proxy is killed, and its
successor, started from the store, no longer injects the revoked key. Then the sealed grants
end to end: a grant row forged into the daemon's store is listed as refused (exit 6) and never
reaches the proxy. Real Docker crew (busybox), real proxy, TLS fake provider on loopback."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from appliance.demo_upstream import FakeServer
from tests.conftest import REAL_KEYS
from tests.daemon_support import REACH_TEST_HOSTS, Appliance

pytestmark = pytest.mark.docker

KEY_ONE = "sk-ant-api03-PUSHFAIL-one-0123456789abcdef"
KEY_TWO = "sk-ant-api03-PUSHFAIL-two-fedcba9876543210"
STORE_KEY = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100"


def injected_key(app: Appliance, provider: FakeServer, crew: str, gateway: str) -> list[str]:
    """The x-api-key the provider received for one request from inside the crew."""
    provider.clear()
    raw = (
        "printf 'POST /anthropic/v1/messages HTTP/1.1\\r\\nHost: x\\r\\n"
        "content-length: 2\\r\\nConnection: close\\r\\n\\r\\n{}' | "
        f"nc -w 30 {gateway} {app.port}"
    )
    for _ in range(2):
        done = app.ctl("run", crew, "--", "sh", "-c", raw)
        if provider.received:
            return list(provider.last().all("x-api-key"))
        # Nothing reached the provider (seen once in CI, right after the crew was created):
        # one more try, and if that fails too, what the run and the daemon said.
        time.sleep(1)
    raise AssertionError(f"no request reached the provider: {done!r}\n{app.log_text()[-3000:]}")


def journal(app: Appliance, kind: str) -> list[dict[str, Any]]:
    done = app.ctl("--json", "journal", "tail", "-n", "1000", "--type", kind)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return [{**row, "payload": json.loads(str(row["payload"]))} for row in rows]


def proxy_status(app: Appliance, *, degraded: bool = False) -> dict[str, Any]:
    """`status`; with degraded, also while a part is down (exit 9: a worker restarting)."""
    code, status = app.ctl_json("status")
    assert code == 0 or (degraded and code == 9 and status["ok"] is False), status
    return dict(status)


def gone(pid: int) -> bool:
    """Dead and reaped, or a zombie awaiting its parent's wait()."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_a_revoke_the_proxy_does_not_confirm_is_journaled_and_the_proxy_restarted(
    appliance: Appliance, provider: FakeServer
) -> None:
    app = appliance
    app.start(env={"ENCRYPTION_KEY": STORE_KEY})
    assert (
        app.ctl_stdin(KEY_ONE, "cred", "add", "claude", "--provider", "anthropic").returncode == 0
    )
    crew = app.crew("push")
    code, created = app.ctl_json("crew", "create", crew, *REACH_TEST_HOSTS)
    assert code == 0, (created, app.log_text())
    gateway = created["crew"]["gateway"]
    assert app.ctl("cred", "grant", "claude", crew).returncode == 0
    assert injected_key(app, provider, crew, gateway) == [KEY_ONE]

    # One of the two proxy workers is frozen: it holds the map with KEY_ONE and cannot answer
    # the push; the other one can.
    status = proxy_status(app)
    frozen, restarts = status["proxy_pid"], status["proxy_restarts"]
    (other,) = [pid for pid in status["proxy_pids"] if pid != frozen]
    os.kill(frozen, signal.SIGSTOP)
    try:
        started = time.monotonic()
        done = app.ctl("--json", "cred", "revoke", "claude", crew)
        took = time.monotonic() - started
    finally:
        if not gone(frozen):
            os.kill(frozen, signal.SIGCONT)  # the daemon did not kill it: let cleanup work
    # An error is a JSON object on stderr (docs/cli.md: data on stdout, errors on stderr).
    answer = json.loads(done.stderr.splitlines()[-1])
    assert done.returncode == 7, (done.stdout, done.stderr)
    assert answer["kind"] == "not_in_effect" and answer["ok"] is False, answer
    assert f"killed the proxy worker(s) that did not confirm (pid {frozen})" in answer["error"]
    assert "revoked in the store (and journaled)" in answer["error"]
    assert 4 < took < 30, took  # the push's deadline (5 s), not the proxy's 15 s ones
    assert gone(frozen), "the worker that may still hold the revoked key is still alive"
    assert not gone(other), "the worker that confirmed the revoke was killed too"

    # The change is stored (the answer was not a rollback) ...
    code, listing = app.ctl_json("cred", "ls")
    assert code == 0 and listing["credentials"][0]["grants"] == []
    # ... journaled, and so is the window: changed first, then the failed push.
    (changed,) = [
        e for e in journal(app, "credential.changed") if e["payload"]["action"] == "revoked"
    ]
    assert changed["crew"] == crew and changed["payload"]["name"] == "claude"
    assert changed["payload"]["provider"] == "anthropic" and changed["payload"]["level"] == "L3"
    (failed,) = journal(app, "credential.push_failed")
    assert failed["seq"] > changed["seq"] and failed["crew"] == crew
    assert failed["payload"]["action"] == "revoked"
    assert failed["payload"]["proxy_killed"] == [frozen]
    assert "did not answer within 5 s" in failed["payload"]["error"]
    assert "not confirmed by the proxy" in failed["summary"]

    # The successor starts from the store: the revoked key is no longer injected.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = proxy_status(app, degraded=True)
        if (
            status["proxy_restarts"] > restarts
            and status["proxy_alive"]
            and len(status["proxy_pids"]) == 2
            and frozen not in status["proxy_pids"]
        ):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the proxy did not come back: {app.log_text()[-3000:]}")
    assert other in status["proxy_pids"]  # the worker that confirmed was left alone
    assert injected_key(app, provider, crew, gateway) == [REAL_KEYS["anthropic"]]

    # A push that works: exit 0, credential.changed, no new push_failed.
    assert app.ctl("cred", "grant", "claude", crew).returncode == 0
    assert injected_key(app, provider, crew, gateway) == [KEY_ONE]
    assert len(journal(app, "credential.push_failed")) == 1
    actions = [e["payload"]["action"] for e in journal(app, "credential.changed")]
    assert actions == ["added", "granted", "revoked", "granted"]
    assert "did not confirm" in app.log_text() and KEY_ONE not in app.log_text()

    # Sealed grants end to end: a row forged into the daemon's store (a second key, granted to
    # a crew by nobody) is listed as refused and never injected, even after a push.
    assert (
        app.ctl_stdin(KEY_TWO, "cred", "add", "claude2", "--provider", "anthropic").returncode == 0
    )
    assert app.ctl("cred", "revoke", "claude", crew).returncode == 0
    db = sqlite3.connect(app.state_dir / "credentials.db", isolation_level=None)
    db.execute(
        "INSERT INTO grants (name, crew, agent, granted, seal) VALUES ('claude2', ?, '', ?, ?)",
        (crew, time.time(), os.urandom(32)),
    )
    db.close()
    listing_text = app.ctl("cred", "ls")
    assert listing_text.returncode == 6, listing_text.stdout
    assert f"REFUSED: {crew} (does not authenticate)" in listing_text.stdout
    code, as_json = app.ctl_json("cred", "ls")
    rows = {c["name"]: c for c in as_json["credentials"]}
    assert code == 6 and rows["claude2"]["grants"] == []
    assert rows["claude2"]["refused"] == [
        {"crew": crew, "agent": None, "reason": "does not authenticate"}
    ]
    code, _ = app.ctl_json("cred", "grant", "claude", app.crew("other"))  # any push
    assert code == 0
    assert injected_key(app, provider, crew, gateway) == [REAL_KEYS["anthropic"]]
    assert "claude2: grant to " + crew + " refused (does not authenticate)" in app.log_text()
    # The operator removes it; the listing is clean again.
    assert app.ctl("cred", "revoke", "claude2", crew).returncode == 0
    assert app.ctl("cred", "ls").returncode == 0
