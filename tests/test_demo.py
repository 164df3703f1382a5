"""`make demo` runs `appliancectl demo`; it must keep working on a fresh checkout."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_tour_passes() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "--json", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] is True
    assert [step["ok"] for step in report["steps"]] == [True] * 6
