"""appliancectl's daemon commands outside a crew: doctor, config errors, up --detach, unreachable
daemon, exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.demo_upstream import FakeServer
from tests.conftest import ROOT, proxy_env
from tests.daemon_support import (
    REACH_TEST_HOSTS,
    busybox_images,
    needs_root_and_docker,
    new_appliance,
)


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=proxy_env(),
    )


def test_doctor_reports_every_check() -> None:
    needs_root_and_docker()
    done = ctl("doctor", "--json")
    report = json.loads(done.stdout)
    names = {check["name"] for check in report["checks"]}
    assert {"root", "engine", "runtime runc", "nftables", "netns + veth", "overlayfs"} <= names
    assert {"seccomp", "address pool"} <= names
    assert done.returncode == (0 if report["ok"] else 1)


def test_doctor_names_a_foreign_process_with_the_proxy_uid(tmp_path: Path) -> None:
    """Anything else running as the workers' uid could signal them: doctor says which pid."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    config = tmp_path / "uid.toml"
    config.write_text("[proxy]\nuid = 1077\ngid = 1077\n")

    def become() -> None:
        os.setgroups([])
        os.setresgid(1077, 1077, 1077)
        os.setresuid(1077, 1077, 1077)

    def identity() -> dict[str, object]:
        done = ctl("doctor", "--json", "--config", str(config))
        report = json.loads(done.stdout)
        return next(c for c in report["checks"] if c["name"] == "proxy identity")

    before = identity()
    assert before["ok"] and "uid 1077" in str(before["detail"]), before
    foreign = subprocess.Popen(["sleep", "30"], preexec_fn=become)
    try:
        check = identity()
        assert not check["ok"] and not check["required"]
        assert f"other than proxy workers run with it: {foreign.pid}" in str(check["detail"])
    finally:
        foreign.kill()
        foreign.wait()


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[daemon]\nstate_dri = "/x"\n')
    done = ctl("doctor", "--config", str(config))
    assert done.returncode == 2 and "state_dri" in done.stderr
    config.write_text('[net]\npool = "not a pool"\n')
    done = ctl("up", "--config", str(config))
    assert done.returncode == 2 and "net" in done.stderr
    config.write_text("[proxy]\nuid = 1001\n")
    done = ctl("up", "--config", str(config))
    assert done.returncode == 2 and "`proxy.uid`" in done.stderr and "agents'" in done.stderr
    config.write_text('[proxy.events]\npath = "/tmp/events.jsonl"\n')
    done = ctl("up", "--config", str(config))
    assert done.returncode == 2 and "`proxy.events.path`" in done.stderr


def test_unreachable_daemon_is_exit_5(tmp_path: Path) -> None:
    done = ctl("--socket", str(tmp_path / "none.sock"), "crew", "ls")
    assert done.returncode == 5 and "not answering" in done.stderr
    done = ctl("--json", "--socket", str(tmp_path / "none.sock"), "status")
    assert done.returncode == 5 and json.loads(done.stdout)["ok"] is False


def test_up_detach_answers_then_stops_on_sigterm(
    tmp_path: Path, provider: FakeServer, plain_host: FakeServer, ca_file: str
) -> None:
    needs_root_and_docker()
    app = new_appliance(tmp_path, provider.port, plain_host.port, ca_file)
    agent, infra = busybox_images()
    app.write_config(agent, infra, stop_crews_on_exit=True)
    try:
        done = ctl("--json", "up", "--detach", "--config", str(app.config))
        assert done.returncode == 0, done.stdout + done.stderr
        pid = json.loads(done.stdout)["pid"]
        assert oct(os.stat(app.state_dir).st_mode & 0o777) == "0o700"
        assert oct(os.stat(app.socket).st_mode & 0o777) == "0o600"
        name = app.crew("stop")
        assert app.ctl("crew", "create", name, *REACH_TEST_HOSTS).returncode == 0
        status = app.ctl("status")
        assert status.returncode == 0 and "crews: 1 (1 ready)" in status.stdout
        os.kill(pid, signal.SIGTERM)
        for _ in range(300):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            subprocess.run(["sleep", "0.1"])
        else:
            raise AssertionError("applianced did not stop")
        # stop_crews_on_exit: containers and links gone, the row kept as "stopped".
        assert app.containers() == [] and app.links() == []
        app.start()
        code, shown = app.ctl_json("crew", "show", name)
        assert code == 0 and shown["crew"]["phase"] == "ready"  # re-created at start
        assert app.ctl("run", name, "--", "true").returncode == 0
    finally:
        app.cleanup()
