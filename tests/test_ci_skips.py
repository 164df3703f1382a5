"""In CI a skip for want of root, Docker, gVisor or the native build is a failure; locally it is
a skip with its reason shown (tests/conftest.py). Checked on a real pytest run of sample tests
that use the suite's own hooks."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.conftest import ROOT, environment_need, needs

SAMPLES = """
import pytest

from tests.conftest import needs


@pytest.fixture
def sandbox():
    pytest.skip("needs gVisor (the engine has no runtime runsc)")


def test_root():
    pytest.skip(needs("root", "namespaces"))


@pytest.mark.skipif(True, reason="needs Docker (apt-get install docker.io)")
def test_docker_mark():
    pass


def test_gvisor_fixture(sandbox):
    pass


def test_native():
    pytest.skip(needs("the native build"))


def test_not_the_environment():
    pytest.skip("the host already routes the lab's test networks")


def test_a_longer_word():
    pytest.skip("needs rootless podman")


def test_runs():
    pass
"""

MODULE_SKIP = """
import pytest

from tests.conftest import needs

pytest.skip(needs("Docker", "no engine"), allow_module_level=True)


def test_never():
    pass
"""


def _run(tmp_path: Path, ci: str | None) -> tuple[dict[str, str], str]:
    """Each sample test's outcome (passed, skipped, failure, error) and pytest's output."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport\n"
        "__all__ = ['pytest_make_collect_report', 'pytest_runtest_makereport']\n"
    )
    (tmp_path / "test_samples.py").write_text(SAMPLES)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    report = tmp_path / f"report-{ci}.xml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:trio",
            "--rootdir", str(tmp_path), "-c", os.devnull, "-ra",
            "--continue-on-collection-errors", f"--junitxml={report}", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    outcomes: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        name = case.get("name") or case.get("classname") or "?"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = kinds[0] if kinds else "passed"
    return outcomes, done.stdout + done.stderr


def test_locally_every_skip_stays_a_skip_with_its_reason(tmp_path: Path) -> None:
    outcomes, output = _run(tmp_path, None)
    assert outcomes == {
        "test_root": "skipped",
        "test_docker_mark": "skipped",
        "test_gvisor_fixture": "skipped",
        "test_native": "skipped",
        "test_not_the_environment": "skipped",
        "test_a_longer_word": "skipped",
        "test_runs": "passed",
        "test_module_skip": "skipped",
    }, output
    assert "needs root (namespaces)" in output and "needs gVisor (the engine" in output


def test_in_ci_a_skip_for_want_of_the_environment_fails(tmp_path: Path) -> None:
    outcomes, output = _run(tmp_path, "true")
    assert outcomes == {
        "test_root": "failure",
        # A skipif mark and a fixture act at setup: pytest calls a failed setup an error.
        "test_docker_mark": "error",
        "test_gvisor_fixture": "error",
        "test_native": "failure",
        "test_not_the_environment": "skipped",
        "test_a_longer_word": "skipped",
        "test_runs": "passed",
        "test_module_skip": "error",  # at collection
    }, output
    assert "skipped in CI, which counts as a failure: needs root (namespaces)" in output


def test_ci_must_say_true(tmp_path: Path) -> None:
    outcomes, _ = _run(tmp_path, "0")
    assert outcomes["test_root"] == "skipped"


def test_the_reasons_are_recognised_by_their_start() -> None:
    assert needs("root") == "needs root"
    assert needs("Docker", "no engine") == "needs Docker (no engine)"
    assert environment_need("needs root and iproute2") == "root"
    assert environment_need("needs the native build: C scrubber") == "the native build"
    assert environment_need("needs rootless podman") is None
    assert environment_need("no free test pool") is None
    assert environment_need("needs iproute2 (`ip netns`)") is None
