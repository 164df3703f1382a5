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
from tests.conftest import ROOT, needs, proxy_env
from tests.daemon_support import (
    REACH_TEST_HOSTS,
    Appliance,
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
    assert {"root", "engine", "runtime runc", "nftables", "netns", "veth", "overlayfs"} <= names
    assert {"seccomp", "address pool"} <= names
    assert done.returncode == (0 if report["ok"] else 1)


def test_doctor_names_a_foreign_process_with_the_proxy_uid(tmp_path: Path) -> None:
    """Anything else running as the workers' uid could signal them: doctor says which pid."""
    if os.geteuid() != 0:
        pytest.skip(needs("root"))
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
    assert done.returncode == 5 and done.stdout == ""
    assert json.loads(done.stderr)["ok"] is False  # errors on stderr, as JSON too


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


def test_crew_show_lists_the_effective_allowlist_the_proxy_enforces(appliance: Appliance) -> None:
    """Every host a restricted crew may reach, with where it comes from: its own allow, the
    operator's [proxy.policy] default_allow, the providers' hosts; and the proxy agrees."""
    app = appliance
    app.infra_pool = 0
    app.write_config(*busybox_images())
    with app.config.open("a") as config:
        config.write('\n[proxy.policy]\ndefault_allow = ["other.test", "plain.test"]\n')
    app.start()
    name = app.crew("allow")
    created = app.ctl(
        "crew", "create", name, *REACH_TEST_HOSTS, "--allow", "plain.test", "--allow", "pypi.org"
    )
    assert created.returncode == 0, created.stderr
    code, shown = app.ctl_json("crew", "show", name)
    assert code == 0
    assert [[e["host"], e["sources"]] for e in shown["crew"]["effective_allow"]] == [
        ["plain.test", ["crew", "default"]],
        ["pypi.org", ["crew"]],
        ["other.test", ["default"]],
        ["api.anthropic.test", ["provider"]],
        ["api.openai.test", ["provider"]],
        ["generativelanguage.googleapis.test", ["provider"]],
    ]
    human = app.ctl("crew", "show", name).stdout
    assert "egress:   only these 6 hosts (mode restricted):" in human, human
    assert any(line.split() == ["plain.test", "crew,", "default"] for line in human.splitlines())
    assert any(line.split() == ["other.test", "default"] for line in human.splitlines())
    # The proxy holds the same list: a default host is reached, an unlisted one refused
    # (by name, before any lookup: nothing leaves the machine).
    reached = app.ctl(
        "run", name, "--", "wget", "-q", "-O-", f"http://other.test:{app.plain_port}/"
    )
    assert reached.returncode == 0, reached.stderr
    gateway = shown["crew"]["gateway"]
    raw = (
        f"printf 'GET http://chatgpt.com/ HTTP/1.1\\r\\nHost: chatgpt.com\\r\\n"
        f"Connection: close\\r\\n\\r\\n' | nc {gateway} {app.port}"
    )
    refused = app.ctl("run", name, "--", "sh", "-c", raw)
    assert "403" in refused.stdout.splitlines()[0] and "not_in_allowlist" in refused.stdout
    # Modes that consult no allowlist say so.
    free = app.crew("free")
    assert app.ctl("crew", "create", free, *REACH_TEST_HOSTS, "--mode", "free").returncode == 0
    code, shown = app.ctl_json("crew", "show", free)
    assert shown["crew"]["effective_allow"] == []
    assert "egress:   any host (mode free" in app.ctl("crew", "show", free).stdout


def test_status_says_why_a_worker_exited_and_the_journal_too(appliance: Appliance) -> None:
    app = appliance
    app.infra_pool = 0
    app.write_config(*busybox_images())
    app.start()
    code, status = app.ctl_json("status")
    assert code == 0 and len(status["proxy_workers"]) == app.proxy_workers
    victim = status["proxy_workers"][0]
    other = status["proxy_workers"][1]
    assert victim["restarts"] == 0 and victim["last_exit"] is None
    assert victim["uid"] == 1002 and other["uid"] == 1002  # the kernel's word: they dropped
    _, status = app.kill_worker(0)
    worker = status["proxy_workers"][0]
    assert worker["last_exit"] == "killed by SIGKILL" and worker["last_exit_time"]
    assert worker["restart_at"] is None and worker["uid"] == 1002
    assert status["proxy_workers"][1]["pid"] == other["pid"]  # the other one never stopped
    assert status["proxy_restarts"] == 1
    human = app.ctl("status").stdout
    assert f"  worker 0: pid {worker['pid']}, uid 1002, restarts 1; last exit " in human, human
    assert human.rstrip().count("killed by SIGKILL") == 1
    journal = app.ctl("--json", "journal", "tail", "--type", "proxy.worker_exited")
    assert journal.returncode == 0, journal.stderr
    (entry,) = [json.loads(line) for line in journal.stdout.splitlines() if line.strip()]
    assert entry["summary"].startswith(f"proxy worker 0 (pid {victim['pid']}) killed by SIGKILL")
    payload = json.loads(entry["payload"])
    assert payload["signal"] == "SIGKILL" and payload["killed_by"] is None
    assert payload["restarts"] == 1 and 0.375 <= payload["restart_in"] <= 0.5
