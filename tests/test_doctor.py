"""`appliancectl doctor` checks what a crew is made of (engine, every runtime including runsc,
the images, nftables, the kernel's netns, veth, overlayfs, seccomp and cgroups) and gives a fix
for every check that fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT
from tests.daemon_support import needs_root_and_docker

CTL = [sys.executable, "-m", "appliance.cli"]


def doctor(*args: str) -> tuple[int, str, dict[str, dict[str, object]]]:
    text = subprocess.run(
        [*CTL, "doctor", *args], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    as_json = subprocess.run(
        [*CTL, "doctor", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert text.returncode == as_json.returncode
    checks = {check["name"]: check for check in json.loads(as_json.stdout)["checks"]}
    return text.returncode, text.stdout, checks


def test_every_check_is_there_and_every_failure_has_a_fix() -> None:
    needs_root_and_docker()
    code, text, checks = doctor()
    expected = {"root", "engine", "nftables", "netns", "veth", "overlayfs", "seccomp", "cgroups"}
    expected |= {f"runtime {r}" for r in ("runc", "runsc", "kata-runtime", "sysbox-runc", "crun")}
    expected |= {"image agent", "image infra", "address pool", "proxy identity"}
    assert expected <= set(checks), sorted(checks)
    assert checks["runtime runsc"]["ok"], checks["runtime runsc"]  # registered with --network=host
    for check in checks.values():
        assert check["ok"] or check["hint"], check
    assert text.count("fix: ") == sum(not c["ok"] for c in checks.values()), text
    assert code == (0 if all(c["ok"] for c in checks.values() if c["required"]) else 1)


def test_a_default_runtime_that_is_missing_fails_with_its_fix(tmp_path: Path) -> None:
    needs_root_and_docker()
    config = tmp_path / "appliance.toml"
    config.write_text(
        '[crews]\ndefault_runtime = "kata-runtime"\n'
        '[images]\nagent = "agent-appliance/none:0"\ninfra = "agent-appliance/none:1"\n'
    )
    code, text, checks = doctor("--config", str(config))
    assert code == 1
    kata = checks["runtime kata-runtime"]
    assert not kata["ok"] and kata["required"] and "default_runtime" in str(kata["detail"])
    assert "FAIL runtime kata-runtime" in text
    assert "     fix: Kata Containers is not packaged in Debian 12" in text
    agent = checks["image agent"]
    assert not agent["ok"] and "applianced never pulls" in str(agent["hint"])
