"""`make demo` runs `appliancectl demo`: the whole tour, for real (the engine, the images, a real
applianced with its own pool and table, a hardened crew), and it must leave nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from appliance.demo import DEMO_KEY
from tests.conftest import ROOT, needs

pytestmark = pytest.mark.docker


def _needs_root_and_docker() -> None:
    if os.geteuid() != 0:
        pytest.skip(needs("root", "the demo"))
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip(needs("Docker", "no engine answers `docker info`"))


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    # Up to ten minutes: the first run on a machine builds the images (about 75 s here).
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *args, "demo"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


def test_demo_tour_passes_and_says_what_it_shows() -> None:
    _needs_root_and_docker()
    result = _demo()
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    # The key lines of the tour, as a reader sees them.
    assert "crew create demo" in out and "--mode restricted --allow api.anthropic.test" in out
    assert '"text": "Hello from the fake provider."' in out
    assert "the fake provider received POST /v1/messages with x-api-key: sk-ant-api03-D" in out
    assert "invalid x-api-key: [REDACTED:anthropic]" in out
    assert '"rule":"not_in_allowlist"' in out and "HTTP 403" in out
    assert "CONNECT tunnel failed, response 403" in out
    assert "uid=1001(agent)" in out
    assert "Read-only file system" in out
    assert "NoNewPrivs:\t1" in out
    assert "crew demo" in out and "removed" in out
    assert "Uid ['1002', '1002', '1002', '1002'], CapEff 0000000000000000" in out
    assert "proxy.allow x" in out and "credential.injected x" in out
    assert "demo: all 17 steps behaved as expected" in out
    # The demo key itself is never printed, only a masked form of it.
    assert DEMO_KEY not in out and "[REDACTED:anthropic]ctl" not in out


def test_demo_json_report() -> None:
    _needs_root_and_docker()
    result = _demo("--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] is True and report["failed_step"] is None
    steps = [step["step"] for step in report["steps"]]
    assert steps[0] == "container engine" and steps[-1] == "nothing left behind"
    assert all(step["ok"] for step in report["steps"]) and len(steps) == 17
