"""The parts of a failed credential push that need no daemon: `kill_proxy` signals only
applianced's own proxy child (never a pid recycled by another process), and the two credential
entries round-trip through a real journal file with the summaries an auditor reads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.daemon.credentials import kill_proxy
from appliance.journal import Journal
from appliance.journal import entries as E

SLEEPER = "import time; time.sleep(60)"


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for child in started:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_kill_proxy_kills_only_our_proxy_child(
    children: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    # Our child, but not a proxy: left alone.
    other = subprocess.Popen([sys.executable, "-c", SLEEPER])
    children.append(other)
    # Our child with "proxy" in its argv (as `python -m appliance.cli proxy ...`): killed.
    proxy = subprocess.Popen([sys.executable, "-c", SLEEPER, "proxy"])
    children.append(proxy)
    # A proxy-looking process that is not our child (a pid recycled by someone else): left.
    pid_file = tmp_path / "pid"
    shell = subprocess.Popen(
        ["sh", "-c", f'{sys.executable} -c "{SLEEPER}" proxy & echo $! > {pid_file}; wait']
    )
    children.append(shell)
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    time.sleep(0.3)  # both have exec'd python by now

    assert kill_proxy(None) is None
    assert kill_proxy(other.pid) is None and other.poll() is None
    assert kill_proxy(grandchild) is None
    os.kill(grandchild, 0)  # still alive
    assert kill_proxy(proxy.pid) == proxy.pid
    assert proxy.wait(timeout=10) == -9
    assert kill_proxy(proxy.pid) is None  # reaped: nothing to signal
    os.kill(grandchild, 9)


def test_credential_entries_round_trip_with_their_summaries(tmp_path: Path) -> None:
    written = [
        E.CredentialChanged(
            name="claude", action="revoked", provider="anthropic", level="L3", version=2, crew="c1"
        ),
        E.CredentialChanged(name="gh", action="granted", crew="c1", agent="a1"),
        E.CredentialChanged(name="gh", action="added", provider="github"),
        E.CredentialPushFailed(
            name="claude", action="revoked", error="timeout", proxy_killed=4242, crew="c1"
        ),
        E.CredentialPushFailed(name="claude", action="rotated", error="not running"),
    ]
    journal = Journal(tmp_path / "journal.db")
    try:
        for entry in written:
            journal.append(entry)
        rows = journal.tail(10)
        assert [E.decode(r.payload) for r in rows] == written
        assert [r.summary for r in rows] == [
            "credential claude revoked (crew c1)",
            "credential gh granted (crew c1, agent a1)",
            "credential gh added",
            "credential claude revoked not confirmed by the proxy: proxy 4242 killed, restarts "
            "from the store",
            "credential claude rotated not confirmed by the proxy: no proxy running; it starts "
            "from the store",
        ]
        assert rows[3].type == "credential.push_failed" and rows[3].crew == "c1"
        assert journal.tail(10, type="credential")[-1].type == "credential.push_failed"
    finally:
        journal.close()
