"""A crew's method and path rules through a real applianced: `appliancectl crew create --rule`,
the proxy holding the crew to them (a DELETE refused with a readable 403 and journaled, a GET on
an allowed path served), and the rules kept across a restart of a proxy worker and of applianced.
The unit side (spelling, validation, state, migration): tests/test_crew_rules.py."""

from __future__ import annotations

import json
import time

from appliance.demo_upstream import FakeServer
from tests.daemon_support import REACH_TEST_HOSTS, Appliance, busybox_images

RULE = "plain.test read-only /repos/acme/**"


def _send(app: Appliance, crew: str, gateway: str, method: str, path: str) -> tuple[str, str]:
    """(status line, body) of one forward request the crew sends to the proxy by hand."""
    target = f"http://plain.test:{app.plain_port}{path}"
    raw = (
        f"printf '{method} {target} HTTP/1.1\\r\\nHost: plain.test:{app.plain_port}\\r\\n"
        f"Connection: close\\r\\n\\r\\n' | nc {gateway} {app.port}"
    )
    done = app.ctl("run", crew, "--", "sh", "-c", raw)
    # Text mode: the response's CRLFs read as line breaks.
    head, _, body = done.stdout.partition("\n\n")
    return head.splitlines()[0] if head else "", body


def _assert_refused_delete(app: Appliance, crew: str, gateway: str) -> None:
    status, body = _send(app, crew, gateway, "DELETE", "/repos/acme/widget")
    assert status.split()[1:2] == ["403"], (status, body)
    refusal = json.loads(body)
    assert refusal["rule"] == "l7_method", refusal


def _journaled_refusals(app: Appliance, crew: str) -> list[list[object]]:
    tail = app.ctl("--json", "journal", "tail", "--crew", crew, "--type", "proxy.deny", "-n", "50")
    assert tail.returncode == 0, tail.stderr
    entries = [json.loads(line) for line in tail.stdout.splitlines() if line.strip()]
    return [r for e in entries for r in json.loads(e["payload"])["requests"]]


def test_rules_hold_through_the_proxy_and_a_restart(
    appliance: Appliance, plain_host: FakeServer
) -> None:
    app = appliance
    app.infra_pool = 0
    app.write_config(*busybox_images())
    app.start()
    name = app.crew("rules")
    base = ("crew", "create", name, *REACH_TEST_HOSTS, "--allow", "plain.test")

    # A rule the proxy would refuse is refused before anything is created, naming it.
    bad = app.ctl(*base, "--rule", RULE, "--rule", "plain.test GET x")
    assert bad.returncode == 2, bad
    assert "argument rule[1]: path pattern 'x': must start with /" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    assert app.ctl("crew", "show", name).returncode == 3  # not found: nothing was made

    created = app.ctl(*base, "--rule", RULE)
    assert created.returncode == 0, created.stderr
    code, shown = app.ctl_json("crew", "show", name)
    assert code == 0
    assert shown["crew"]["rules"] == [
        {"host": "plain.test", "methods": [], "preset": "read-only", "paths": ["/repos/acme/**"]}
    ]
    assert f"rules:    {RULE}" in app.ctl("crew", "show", name).stdout
    gateway = shown["crew"]["gateway"]

    # A GET on an allowed path reaches the host; a DELETE is refused by the proxy.
    plain_host.clear()
    got = app.ctl(
        "run", name, "--", "wget", "-q", "-O-", f"http://plain.test:{app.plain_port}/repos/acme/x"
    )
    assert got.returncode == 0, got.stderr
    assert [(r.method, r.path) for r in plain_host.received] == [("GET", "/repos/acme/x")]
    _assert_refused_delete(app, name, gateway)
    status, body = _send(app, name, gateway, "GET", "/repos/other")
    assert status.split()[1:2] == ["403"] and json.loads(body)["rule"] == "l7_path", body
    assert [r.method for r in plain_host.received] == ["GET"]  # neither reached the host

    # The refusals are in the journal (the events arrive in batches: wait for them).
    for _ in range(100):
        refused = _journaled_refusals(app, name)
        if {r[5] for r in refused} >= {"l7_method", "l7_path"}:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"no l7 refusal journaled: {refused}")
    assert ["DELETE", "plain.test", "l7_method", 403] in [[r[2], r[3], r[5], r[6]] for r in refused]

    # A proxy worker that restarts is sent the crew again, its rules with it.
    app.kill_worker(0)
    for _ in range(4):  # whichever worker accepts, each holds the rule
        _assert_refused_delete(app, name, gateway)

    # applianced restarted: the crew is served again with the rules from its state.
    app.stop()
    app.start()
    code, shown = app.ctl_json("crew", "show", name)
    assert code == 0 and shown["crew"]["phase"] == "ready"
    assert [r["preset"] for r in shown["crew"]["rules"]] == ["read-only"]
    _assert_refused_delete(app, name, gateway)
    got = app.ctl(
        "run", name, "--", "wget", "-q", "-O-", f"http://plain.test:{app.plain_port}/repos/acme/y"
    )
    assert got.returncode == 0, got.stderr
