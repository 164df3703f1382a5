"""The journal through a real applianced: crew, run, allowlist and proxy entries land in
journal.db; appliancectl journal tail/search/export/verify; tampering found after a restart."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time

import pytest

from appliance.demo_upstream import FakeServer
from tests.conftest import ROOT, proxy_env
from tests.daemon_support import (
    REACH_TEST_HOSTS,
    Appliance,
)

pytestmark = pytest.mark.docker


def entries(app: Appliance, *args: str) -> list[dict[str, object]]:
    done = app.ctl("--json", "journal", "tail", "-n", "1000", *args)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def wait_for_type(app: Appliance, kind: str, timeout: float = 10.0) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = entries(app, "--type", kind)
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"no {kind} entry in the journal: {entries(app)}")


def test_journal_records_crews_runs_and_proxy_decisions(
    appliance: Appliance, plain_host: FakeServer
) -> None:
    app = appliance
    app.start()
    name = app.crew("jr")
    code, created = app.ctl_json("crew", "create", name, *REACH_TEST_HOSTS, "--allow", "plain.test")
    assert code == 0, (created, app.log_text())
    gateway = created["crew"]["gateway"]

    # Credential changes: names and actions, never the value.
    # (random-looking, like a real key: the journal's scrubber knows stored values, and any 8
    # bytes of one are redacted, so a value holding "credential" would redact the entry's type)
    value = "jv-7Qx2Lr9Zp4Kt8Wm3Nc6Bh1Vd5"
    added = subprocess.run(
        [
            *(sys.executable, "-m", "appliance.cli", "--socket", str(app.socket)),
            *("cred", "add", "jcred", "--provider", "anthropic"),
        ],
        input=value + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=proxy_env(),
        cwd=ROOT,
    )
    assert added.returncode == 0, added.stderr
    assert app.ctl("cred", "grant", "jcred", name).returncode == 0
    changes = entries(app, "--type", "credential.changed")
    assert [json.loads(str(c["payload"]))["action"] for c in changes] == ["added", "granted"]
    for suffix in ("", "-wal"):
        path = app.state_dir / f"journal.db{suffix}"
        assert not path.exists() or value.encode() not in path.read_bytes()

    allowed = app.ctl(
        "run", name, "--", "wget", "-q", "-O-", f"http://plain.test:{app.plain_port}/x"
    )
    assert allowed.returncode == 0, allowed.stderr
    raw = (
        f"printf 'GET http://other.test:{app.plain_port}/x HTTP/1.1\\r\\nHost: other.test\\r\\n"
        f"Connection: close\\r\\n\\r\\n' | nc {gateway} {app.port}"
    )
    assert "403" in app.ctl("run", name, "--", "sh", "-c", raw).stdout
    assert app.ctl("run", name, "--", "sh", "-c", "exit 7").returncode == 7
    assert app.ctl("run", name, "--timeout", "1", "--", "sleep", "30").returncode == 124
    follow = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "appliance.cli",
            "--socket",
            str(app.socket),
            "--json",
            "journal",
            "tail",
            "-f",
            "-n",
            "0",
            "--type",
            "allowlist.changed",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=proxy_env(),
    )
    try:
        time.sleep(1.0)  # it has read the current end
        assert app.ctl_json("crew", "allow", name, "other.test")[0] == 0
        assert follow.stdout is not None
        followed = json.loads(follow.stdout.readline())
        assert followed["type"] == "allowlist.changed" and "other.test" in followed["summary"]
    finally:
        follow.kill()
        follow.wait()

    allow = wait_for_type(app, "proxy.allow")
    assert any(e["crew"] == name and "plain.test" in str(e["summary"]) for e in allow)
    deny = wait_for_type(app, "proxy.deny")
    assert any("other.test" in str(e["summary"]) for e in deny)

    rows = entries(app, "--crew", name)
    types = [r["type"] for r in rows]
    assert types[0] == "crew.created"
    assert {"run.started", "run.completed", "run.timeout", "allowlist.changed"} <= set(types)
    runs = [r for r in rows if str(r["type"]).startswith("run.")]
    completed = [json.loads(str(r["payload"])) for r in runs if r["type"] == "run.completed"]
    assert sorted(c["exit_code"] for c in completed) == [0, 0, 7]
    # A run's entries share its trace id: four runs, each started and ended.
    by_trace: dict[object, list[object]] = {}
    for r in runs:
        by_trace.setdefault(r["trace_id"], []).append(r["type"])
    assert len(by_trace) == 4 and all(
        v[0] == "run.started" and len(v) == 2 for v in by_trace.values()
    )

    human = app.ctl("journal", "tail", "--crew", name, "--type", "run", "-n", "2")
    assert human.returncode == 0 and len(human.stdout.splitlines()) == 2
    assert "run timed out" in human.stdout

    found = app.ctl("--json", "journal", "search", '"other.test"')
    assert found.returncode == 0
    assert {e["type"] for e in json.loads(found.stdout)["entries"]} >= {
        "proxy.deny",
        "allowlist.changed",
    }
    # Plain text (a quote is a character), and an FTS5 query only with --fts.
    assert app.ctl("journal", "search", '"unterminated').returncode == 0
    bad = app.ctl("journal", "search", "--fts", '"unterminated')
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad

    assert app.ctl_json("crew", "rm", name)[0] == 0
    assert entries(app, "-n", "1")[-1]["type"] == "crew.removed"

    exported = app.ctl("journal", "export", "--jsonl")
    assert exported.returncode == 0
    # A signed export: a header line, the rows, a signed end line (docs/journal.md, "Export").
    header, *lines, end = [json.loads(line) for line in exported.stdout.splitlines()]
    assert "export" in header and "export_end" in end
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    verified = app.ctl("journal", "verify")
    assert verified.returncode == 0 and "journal intact" in verified.stdout

    # An attacker with the file, daemon stopped: drop the triggers, edit an entry.
    app.stop()
    target = next(line["seq"] for line in lines if line["type"] == "proxy.deny")
    db = sqlite3.connect(app.state_dir / "journal.db")
    db.execute("DROP TRIGGER entries_no_update")
    db.execute(
        "UPDATE entries SET payload = replace(payload, 'other.test', 'fine.test') WHERE seq = ?",
        (target,),
    )
    db.commit()
    db.close()
    app.start()
    tampered = app.ctl("journal", "verify")
    assert tampered.returncode == 6
    assert f"entry {target} (edited)" in tampered.stderr
    code, report = app.ctl_json("journal", "verify")
    assert code == 6 and report["problem"]["seq"] == target
