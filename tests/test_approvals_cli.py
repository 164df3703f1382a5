"""`appliancectl approvals` through a real applianced: a crew refused a host files a pending
request (listed with its window, seen by `list --watch`), `allow --once` lets the next request
through and it is refused again once the grant ends, `deny` makes the refusal say denied, a
permanent allow and a grant survive an applianced restart, a crew filing 1,000 hosts keeps 32
requests, and bad input names the argument. Real Docker crew (busybox), real proxy workers,
the plain "internet" host on loopback."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import time
from typing import Any

import pytest

from appliance.ctl import exits
from appliance.demo_upstream import FakeServer
from tests.conftest import ROOT, proxy_env
from tests.daemon_support import REACH_TEST_HOSTS, Appliance, sigint_as_in_a_terminal

pytestmark = pytest.mark.docker


def fetch(app: Appliance, crew: str, gateway: str, host: str) -> tuple[str, dict[str, Any] | None]:
    """From inside the crew, a forward request to `host`: (status line, the proxy's refusal
    body if it refused)."""
    raw = (
        f"printf 'GET http://{host}:{app.plain_port}/x HTTP/1.1\\r\\nHost: {host}\\r\\n"
        f"Connection: close\\r\\n\\r\\n' | nc -w 30 {gateway} {app.port}"
    )
    done = app.ctl("run", crew, "--", "sh", "-c", raw)
    lines = done.stdout.splitlines()
    assert lines and lines[0].startswith("HTTP/1.1"), (done, app.log_text()[-4000:])
    refusal = None
    if "x-appliance-proxy: refusal" in done.stdout:
        refusal = json.loads(done.stdout[done.stdout.index("{") :])
    return lines[0], refusal


def pending(app: Appliance, crew: str) -> dict[str, Any]:
    code, listing = app.ctl_json("approvals", "list", "--crew", crew)
    assert code == 0, listing
    return {request["host"]: request for request in listing["requests"]} | {"": listing}


def journaled(app: Appliance, kind: str, crew: str) -> list[dict[str, Any]]:
    done = app.ctl("--json", "events", "--type", kind, "--crew", crew, "-n", "5000")
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    try:
        if not selector.select(timeout):
            return ""
        return process.stdout.readline()
    finally:
        selector.close()


def test_approvals_through_a_real_daemon(appliance: Appliance, plain_host: FakeServer) -> None:
    app = appliance
    with open(app.config, "a") as config:
        config.write("\n[approvals]\nwindow = 120\nonce = 600\n")
    app.start()
    crew = app.crew("appr")
    code, created = app.ctl_json("crew", "create", crew, *REACH_TEST_HOSTS)
    assert code == 0, (created, app.log_text())
    gateway = created["crew"]["gateway"]

    # --watch, started before anything is refused, sees the request as it is filed.
    watch = subprocess.Popen(
        [*app.ctl_argv(), "--json", "approvals", "list", "--watch"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=proxy_env(),
        cwd=ROOT,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        time.sleep(1.0)
        # Refused: the agent reads that a request is pending, for how long, and what to run.
        status, refusal = fetch(app, crew, gateway, "other.test")
        assert " 403 " in status and refusal is not None
        assert refusal["rule"] == "not_in_allowlist" and refusal["host"] == "other.test"
        assert refusal["approval"] == "pending" and refusal["approval_expires_in"] == 120
        assert refusal["approval_command"] == f"appliancectl approvals allow {crew} other.test"
        assert "pending for 2 minutes" in refusal["message"]
        seen = read_line(watch, 30)
        assert seen, app.log_text()[-3000:]
        assert json.loads(seen)["host"] == "other.test" and json.loads(seen)["crew"] == crew
        # Ctrl-C ends it quietly, with the shell's code for it.
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=30)
        assert watch.returncode == exits.INTERRUPTED, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()

    # Listed with its window; a second refusal refreshes it, files nothing new.
    fetch(app, crew, gateway, "other.test")
    listing = pending(app, crew)
    request = listing["other.test"]
    assert (
        listing[""]["window"] == 120
        and request["count"] == 2
        and request["port"] == (app.plain_port)
    )
    assert 100 < request["expires"] - time.time() <= 120
    table = app.ctl("approvals", "list")
    assert table.returncode == 0 and "other.test" in table.stdout and crew in table.stdout
    assert len(journaled(app, "approval.requested", crew)) == 1

    # allow --once: the next request passes, nothing restarted; once it ends, refused again.
    plain_host.clear()
    code, granted = app.ctl_json("approvals", "allow", crew, "other.test", "--once", "--for", "6s")
    assert code == 0 and granted["decision"] == "allowed_once" and granted["was_pending"], granted
    status, refusal = fetch(app, crew, gateway, "other.test")
    assert " 200 " in status and refusal is None and plain_host.received
    assert "other.test" not in pending(app, crew)
    time.sleep(max(0.0, granted["until"] - time.time()) + 0.5)
    status, refusal = fetch(app, crew, gateway, "other.test")
    assert " 403 " in status and refusal is not None and refusal["approval"] == "pending"
    [allowed] = journaled(app, "approval.allowed", crew)
    payload = json.loads(allowed["payload"])
    assert payload["once"] and payload["peer"] == "uid 0" and payload["host"] == "other.test"

    # deny: the request is dropped, and the refusal says denied without filing another.
    code, denied = app.ctl_json("approvals", "deny", crew, "other.test")
    assert code == 0 and denied["decision"] == "denied" and denied["was_pending"], denied
    status, refusal = fetch(app, crew, gateway, "other.test")
    assert " 403 " in status and refusal is not None and refusal["approval"] == "denied"
    assert "other.test" not in pending(app, crew)
    assert len(journaled(app, "approval.denied", crew)) == 1

    # A grant and a permanent allow survive a restart of applianced (fresh workers).
    code, _ = app.ctl_json("approvals", "allow", crew, "plain.test", "--once", "--for", "10m")
    assert code == 0
    assert " 200 " in fetch(app, crew, gateway, "plain.test")[0]
    app.stop()
    app.start()
    assert " 200 " in fetch(app, crew, gateway, "plain.test")[0], app.log_text()[-4000:]
    status, refusal = fetch(app, crew, gateway, "other.test")
    assert refusal is not None and refusal["approval"] == "denied"  # the denial came back too
    # A worker that restarts is sent its crews' grants again: every worker restarted here.
    for index in range(app.proxy_workers):
        app.kill_worker(index)
    for _ in range(3):
        assert " 200 " in fetch(app, crew, gateway, "plain.test")[0], app.log_text()[-4000:]
    code, allowed = app.ctl_json("approvals", "allow", crew, "plain.test")
    assert code == 0 and allowed["decision"] == "allowed" and allowed["changed"], allowed
    assert pending(app, crew)[""]["grants"] == []  # the grant gave way to the allowlist
    app.stop()
    app.start()
    assert " 200 " in fetch(app, crew, gateway, "plain.test")[0]
    code, shown = app.ctl_json("crew", "show", crew)
    assert "plain.test" in shown["crew"]["allow"]

    # A crew that tries 1,000 hosts keeps 32 pending requests, journaled once each.
    loop = (
        "i=0; while [ $i -lt 1000 ]; do i=$((i+1)); "
        'printf "GET http://h$i.test/ HTTP/1.1\\r\\nHost: h$i.test\\r\\n\\r\\n" | '
        f"nc -w 5 {gateway} {app.port} >/dev/null; done"
    )
    done = app.ctl("run", crew, "--", "sh", "-c", loop, timeout=600)
    assert done.returncode == 0, done
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        hosts = [h for h in pending(app, crew) if h.startswith("h")]
        if "h1000.test" in hosts:
            break
        time.sleep(0.5)
    assert len(hosts) == 32 and "h1000.test" in hosts, hosts
    assert "dropped the pending request" in app.log_text()
    filed = [json.loads(e["payload"])["host"] for e in journaled(app, "approval.requested", crew)]
    assert len([h for h in filed if h.startswith("h")]) == 1000  # once each, never per refusal

    # Bad input: exit codes, and messages naming what is wrong.
    unknown = app.ctl("approvals", "allow", app.crew("nobody"), "x.test")
    assert unknown.returncode == exits.NOT_FOUND and "no crew named" in unknown.stderr
    bad_host = app.ctl("approvals", "allow", crew, "bad host")
    assert bad_host.returncode == exits.USAGE and "argument host" in bad_host.stderr
    bad_deny = app.ctl("approvals", "deny", crew, "0x7f.1")
    assert bad_deny.returncode == exits.USAGE and "argument host" in bad_deny.stderr
    zero = app.ctl("approvals", "allow", crew, "x.test", "--once", "--for", "0")
    assert zero.returncode == exits.USAGE and "argument --for" in zero.stderr
    for endless in ("inf", "nan", "1e400"):  # float() reads them; no grant without an end
        done = app.ctl("approvals", "allow", crew, "x.test", "--once", "--for", endless)
        assert done.returncode == exits.USAGE and "argument --for" in done.stderr, done
    words = app.ctl("approvals", "allow", crew, "x.test", "--once", "--for", "soon")
    assert words.returncode == exits.USAGE and "argument --for" in words.stderr
    long = app.ctl("approvals", "allow", crew, "x.test", "--once", "--for", "90d")
    assert long.returncode == exits.USAGE and "argument duration" in long.stderr
    alone = app.ctl("approvals", "allow", crew, "x.test", "--for", "5m")
    assert alone.returncode == exits.USAGE and "argument --for" in alone.stderr
    listed = app.ctl("--json", "approvals", "deny", crew, "plain.test")
    assert listed.returncode == exits.CONFLICT and "allowlist" in listed.stderr
