"""applianced end to end: a real daemon process, the real Docker engine (runc), the real agent and
infra images, real veths and nftables, the real proxy child, appliancectl as the operator runs
it. The "internet" is the fake provider and a plain host on loopback, reached only through the
proxy's split-horizon table (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from appliance.demo_upstream import FakeServer
from appliance.runtime.base import agent_keys
from tests.conftest import REAL_KEYS
from tests.daemon_support import (
    REACH_TEST_HOSTS,
    ROOT,
    Appliance,
)

pytestmark = pytest.mark.docker


class HostListener:
    """A TCP listener on every host address: a crew reaching it would bypass the proxy."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_crew_lifecycle_and_traffic_end_to_end(
    appliance: Appliance, provider: FakeServer, plain_host: FakeServer
) -> None:
    app = appliance
    app.start()
    name = app.crew("alpha")
    code, created = app.ctl_json(
        "crew",
        "create",
        name,
        *REACH_TEST_HOSTS,
        "--mode",
        "restricted",
        "--allow",
        "plain.test",
        "--memory",
        "256m",
    )
    assert code == 0, (created, app.log_text())
    crew = created["crew"]
    assert crew["phase"] == "ready" and crew["allow"] == ["plain.test"]
    gateway = crew["gateway"]
    assert gateway.rsplit(".", 1)[0] == app.pool.rsplit(".", 1)[0].rsplit("/", 1)[0]
    assert {c["role"] for c in crew["containers"] if c["running"]} == {"infra", "agent"}

    code, listing = app.ctl_json("crew", "ls")
    assert code == 0 and [c["name"] for c in listing["crews"]] == [name]
    human = app.ctl("crew", "show", name)
    assert human.returncode == 0 and "phase:    ready" in human.stdout

    # The reverse route: the appliance's key arrives upstream; the agent never held it.
    provider.clear()
    run = app.ctl(
        "run", name, "--", "sh", "-c", 'wget -Y off -q -O- "$ANTHROPIC_BASE_URL/v1/models"'
    )
    assert run.returncode == 0, run.stderr
    assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]
    env = app.ctl("run", name, "--", "env")
    assert env.returncode == 0
    assert f"HTTP_PROXY=http://{gateway}:{app.port}" in env.stdout
    assert f"ANTHROPIC_BASE_URL=http://{gateway}:{app.port}/anthropic" in env.stdout
    for key in REAL_KEYS.values():
        assert key not in env.stdout
    # no credential: the only *_KEY variables are the crew's placeholders the agent CLIs need
    keys = {line for line in env.stdout.splitlines() if "KEY" in line.split("=")[0].upper()}
    assert keys == {f"{variable}={value}" for variable, value in agent_keys(name).items()}

    # Forward proxy: an allowed host works, another gets the proxy's readable refusal.
    plain_host.clear()
    allowed = app.ctl(
        "run", name, "--", "wget", "-q", "-O-", f"http://plain.test:{app.plain_port}/x"
    )
    assert allowed.returncode == 0, allowed.stderr
    assert plain_host.received
    raw = (
        f"printf 'GET http://other.test:{app.plain_port}/x HTTP/1.1\\r\\nHost: other.test\\r\\n"
        f"Connection: close\\r\\n\\r\\n' | nc {gateway} {app.port}"
    )
    denied = app.ctl("run", name, "--", "sh", "-c", raw)
    assert "403" in denied.stdout.splitlines()[0], denied.stdout
    assert "not on the allowlist" in denied.stdout

    # Around the proxy: the host's listener on every address is not reachable, nor the proxy's
    # address on another port.
    listener = HostListener()
    try:
        direct = app.ctl(
            "run",
            name,
            "--timeout",
            "20",
            "--",
            "sh",
            "-c",
            f"echo hi | nc -w 3 {gateway} {listener.port}",
        )
        assert direct.returncode == 1, direct  # nc: timed out connecting
        assert listener.hits == 0
    finally:
        listener.close()

    # Allowed at run time: state and proxy.
    code, result = app.ctl_json("crew", "allow", name, "other.test")
    assert code == 0 and result["changed"] is True
    again = app.ctl("run", name, "--", "wget", "-q", "-O-", f"http://other.test:{app.plain_port}/y")
    assert again.returncode == 0, again.stderr
    code, shown = app.ctl_json("crew", "show", name)
    assert shown["crew"]["allow"] == ["plain.test", "other.test"]

    # The command's exit code comes back; a timeout is 124.
    assert app.ctl("run", name, "--", "sh", "-c", "exit 7").returncode == 7
    assert app.ctl("run", name, "--timeout", "1", "--", "sleep", "30").returncode == 124

    code, status = app.ctl_json("status")
    assert code == 0 and status["crews_ready"] == 1 and status["proxy_alive"]
    net = app.ctl_json("net", "show")
    assert net[0] == 0 and net[1]["crews"][0]["crew"] == name

    code, removed = app.ctl_json("crew", "rm", name)
    assert code == 0 and removed["removed"]
    assert app.containers() == [] and app.links() == [] and app.chains() == []
    assert app.ctl_json("crew", "ls")[1]["crews"] == []
    assert app.ctl("crew", "show", name).returncode == 3


def test_bad_input_is_refused_and_nothing_is_half_created(appliance: Appliance) -> None:
    app = appliance
    app.start()
    cases = [
        (["crew", "create", app.crew("Bad_name!")], 2, "argument name"),
        (["crew", "create", "x" + app.crew("a")], 2, "must start with"),
        (["crew", "create", app.crew("a"), "--runtime", "nosuch"], 2, "argument runtime"),
        (["crew", "create", app.crew("a"), "--mode", "open"], 2, "argument mode"),
        (["crew", "create", app.crew("a"), "--allow", "exa mple"], 2, "argument allow"),
        (["crew", "create", app.crew("a"), "--memory", "1m"], 2, "argument memory"),
        (["crew", "create", app.crew("a"), "--cpus", "999"], 2, "argument cpus"),
        (["crew", "show", app.crew("nope")], 3, "no crew named"),
        (["crew", "rm", app.crew("nope")], 3, "no crew named"),
        (["crew", "allow", app.crew("nope"), "a.test"], 3, "no crew named"),
        (["run", app.crew("nope"), "--", "true"], 3, "no crew named"),
    ]
    for args, code, words in cases:
        done = app.ctl(*args)
        assert done.returncode == code, (args, done.stdout, done.stderr)
        assert words in done.stderr, (args, done.stderr)
    # argparse's own usage errors name the argument too.
    bad_size = app.ctl("crew", "create", app.crew("a"), "--memory", "12q")
    assert bad_size.returncode == 2 and "--memory" in bad_size.stderr
    assert app.containers() == [] and app.links() == [] and app.chains() == []
    assert app.ctl_json("crew", "ls")[1]["crews"] == []

    name = app.crew("dup")
    assert app.ctl("crew", "create", name, *REACH_TEST_HOSTS).returncode == 0
    dup = app.ctl_json("crew", "create", name)
    assert dup[0] == 4 and dup[1]["kind"] == "exists"
    assert len(app.containers()) == 2 and len(app.links()) == 1


def test_reconcile_after_sigkill_mid_create_and_with_a_ready_crew(
    appliance: Appliance, provider: FakeServer
) -> None:
    app = appliance
    # 1. Killed right after it took a pool slot (infra and network of the slot: containers,
    #    link and rules exist), the crew is not in the proxy and its row says "creating".
    #    (Without the pool, the same point is after "attach network": test_daemon_pool.py.)
    app.start(env={"APPLIANCED_TEST_KILL_AFTER_STEP": "record intent"})
    app.wait_pool()
    half = app.crew("half")
    done = app.ctl("crew", "create", half)
    assert done.returncode in (1, 5)
    assert app.wait_exit() == -signal.SIGKILL
    assert len(app.containers()) == 1 and len(app.links()) == 1 and len(app.chains()) == 1

    # 2. Restarted: the interrupted create is rolled back.
    app.start()
    assert app.containers() == [] and app.links() == [] and app.chains() == []
    _, status = app.ctl_json("status")
    assert any("rolled back an interrupted create" in c for c in status["reconcile"])
    assert app.ctl_json("crew", "ls")[1]["crews"] == []

    # 3. A ready crew survives a SIGKILL of the daemon: adopted and served again.
    name = app.crew("keep")
    assert app.ctl("crew", "create", name, *REACH_TEST_HOSTS).returncode == 0
    app.stop(signal.SIGKILL)
    app.start()
    provider.clear()
    run = app.ctl(
        "run", name, "--", "sh", "-c", 'wget -Y off -q -O- "$ANTHROPIC_BASE_URL/v1/models"'
    )
    assert run.returncode == 0, (run.stderr, app.log_text())
    assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]

    # 4. Its agent container removed behind the daemon's back: re-created at the next start.
    app.stop()
    import subprocess

    subprocess.run(
        ["docker", "rm", "-f", f"appliance-{name}-agent.{app.instance}"],
        check=True,
        capture_output=True,
    )
    app.start()
    _, shown = app.ctl_json("crew", "show", name)
    assert shown["crew"]["phase"] == "ready", json.dumps(shown)
    assert app.ctl("run", name, "--", "true").returncode == 0
    assert len(app.containers()) == 2 and len(app.links()) == 1


def test_the_launcher_streams_returns_the_exit_code_and_its_death_kills_the_command(
    appliance: Appliance,
) -> None:
    # bin/appliancectl as an operator venv runs it: `python -S`, the fast path (appliance/ctl/)
    app = appliance
    app.start()
    name = app.crew("fast")
    code, created = app.ctl_json("crew", "create", name, *REACH_TEST_HOSTS, "--mode", "restricted")
    assert code == 0, (created, app.log_text())
    launcher = [str(ROOT / "bin" / "appliancectl"), "--socket", str(app.socket), "run", name]
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPROFILEIMPORTTIME": "1",  # -S keeps the environment: what the fast path imports
    }
    script = "echo one; echo two >&2; sleep 2; echo three; exit 7"
    started = time.monotonic()
    process = subprocess.Popen(
        [*launcher, "--", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == b"one\n"
    assert time.monotonic() - started < 1.9, "the first line waited for the command to end"
    rest, err = process.communicate(timeout=60)
    assert process.returncode == 7 and rest == b"three\n", (rest, err)
    assert b"two\n" in err
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in err.decode().splitlines()
        if line.startswith("import time:")
    }
    assert "appliance.ctl" in imported
    assert not imported & {"site", "socket", "json", "msgspec", "argparse"}, imported

    timed_out = subprocess.run(
        [*launcher, "--timeout", "1", "--", "sleep", "30"], capture_output=True, timeout=60
    )
    assert timed_out.returncode == 124

    # The client dies mid-run: applianced's next write fails and the command is killed.
    marker = f"tick-{name}"
    process = subprocess.Popen(
        [*launcher, "--", "sh", "-c", "while :; do echo tick; sleep 0.2; done", marker],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None and process.stdout.readline() == b"tick\n"
    process.kill()
    process.wait()
    deadline = time.monotonic() + 15
    while True:
        ps = app.ctl("run", name, "--", "ps", "-eo", "args")
        assert ps.returncode == 0, ps
        if marker not in ps.stdout:
            break
        assert time.monotonic() < deadline, f"the command outlived its client: {ps.stdout}"
        time.sleep(0.5)
    # The run's lifecycle is journaled as before: the timeout and the cancellation.
    tail = app.ctl("--json", "journal", "tail", "--crew", name, "--type", "run", "-n", "50")
    assert tail.returncode == 0, tail
    types = [json.loads(line)["type"] for line in tail.stdout.splitlines()]
    assert "run.timeout" in types and "run.cancelled" in types, types
