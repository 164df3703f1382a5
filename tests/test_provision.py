"""ansible/ provisions a systemd-booted Debian 12 machine end to end, for real.

The machine (tests/machine_support.py) is a container made from Debian's archive with debootstrap,
systemd as its PID 1, reached by Ansible over SSH like any host. The collection's playbook
(ansible/site.yml: the docker_host and appliance roles) runs against it from this venv's
ansible-core, in the order an operator would:

1. `--check` on the new machine: the play completes, and the machine is left as it was (no
   Docker, no applianced);
2. the first run: Debian's packages from the archive, dockerd hardened per the CIS Docker
   Benchmark (its daemon.json as the role writes it is what the engine reports), the artifact
   installed, applianced.service active under systemd (Type=notify: `systemctl start` returned
   only once it said READY=1, after building its images in the machine);
3. a restricted crew created with `appliancectl`, a credential added and granted: a request from
   the crew reaches a fake provider inside the machine with the appliance's key, not the agent's;
4. a second run: changed=0;
5. an upgrade to a newer artifact (the same tree, version `+upgrade.test`): applianced runs the
   new version, and the crew's containers are the same, still running, still served.

The whole module takes about 5 to 7 minutes here (most of it the machine's apt and the image
build inside it); the machine image and the artifacts are cached between runs. What the test
machine cannot show (the kernel's audit rules: a container shares the host's) is set off with
`docker_host_audit=false` and documented in docs/docker-host.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from appliance._version import __version__
from appliance.demo_tls import server_context
from tests.artifact_support import built_artifact, tarball, upgrade_artifact
from tests.conftest import needs
from tests.machine_support import Machine

ROOT = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = ROOT / "ansible"
BIN = Path(sys.executable).parent
PROVIDER_HOST = "api.anthropic.test"
PROVIDER_PORT = 8443
# Fake, and held by the appliance only.
KEY = "sk-ant-api03-PROVISIONED-held-by-the-appliance-0000000000"
AGENT_KEY = "sk-agent-dummy"
CREW = "probe"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason=needs("root", "it runs a machine container")),
    pytest.mark.skipif(shutil.which("docker") is None, reason=needs("Docker", "the machine")),
]

# The fake provider in the machine: appliance/demo_upstream.py (standard library only) on its
# loopback with TLS, writing what it received to a file after each request.
UPSTREAM_RUNNER = f"""\
import json, os, ssl, sys, time
sys.path.insert(0, "/root")
from demo_upstream import start_fake
context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
context.load_cert_chain("/root/provider.pem")
fake = start_fake("127.0.0.1", {PROVIDER_PORT}, context)
while True:
    seen = [{{"method": r.method, "path": r.path, "headers": r.headers}} for r in fake.received]
    with open("/root/received.tmp", "w") as out:
        json.dump(seen, out)
    os.replace("/root/received.tmp", "/root/received.json")
    time.sleep(0.2)
"""

CONFIG_EXTRA = f"""\
[proxy.providers.anthropic]
base_url = "https://{PROVIDER_HOST}:{PROVIDER_PORT}"

[proxy.upstream]
ca_file = "/usr/local/share/provider-ca.pem"
# The fake provider is on the machine's loopback: the name resolves there in the proxy's table
# only, and only a crew created with --ssrf-allow 127.0.0.1/32 may reach it.
resolve = {{ "{PROVIDER_HOST}" = "127.0.0.1" }}
"""


@dataclass
class Run:
    name: str
    seconds: float
    recap: dict[str, int]
    changed_tasks: list[str]
    output: str


@dataclass
class Host:
    machine: Machine
    inventory: Path
    runs: list[Run] = field(default_factory=list)
    exposure: float | None = None

    def ssh(self, command: str, timeout: float = 300, check: bool = True) -> str:
        return self.machine.exec("sh", "-c", command, timeout=timeout, check=check)

    def play(self, name: str, artifact: Path, *extra: str, timeout: float = 1200) -> Run:
        env = {
            **os.environ,
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "LC_ALL": "C.UTF-8",
            # One line per task with its status: the changed ones are named in the report.
            "ANSIBLE_STDOUT_CALLBACK": "default",
            "ANSIBLE_HOST_KEY_CHECKING": "False",
            "ANSIBLE_RETRY_FILES_ENABLED": "False",
            # One SSH session per task instead of several (the machine has no requiretty).
            "ANSIBLE_PIPELINING": "True",
        }
        variables = {
            "appliance_artifact": str(artifact),
            "appliance_config_extra": CONFIG_EXTRA,
            # The machine shares this host's kernel: its audit rules would be the host's.
            "docker_host_audit": False,
        }
        started = time.monotonic()
        done = subprocess.run(
            [
                str(BIN / "ansible-playbook"),
                "-i", str(self.inventory),
                "-e", json.dumps(variables),
                *extra,
                "site.yml",
            ],
            cwd=ANSIBLE_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )  # fmt: skip
        seconds = time.monotonic() - started
        assert done.returncode == 0, (
            f"ansible-playbook ({name}) exited {done.returncode}:\n{done.stdout[-8000:]}\n"
            f"{done.stderr[-3000:]}\nfailed units:\n{self.machine.failed_units()}\n"
            + self.ssh("journalctl -u applianced --no-pager -n 40", check=False)
        )
        match = re.search(r"machine\s*:\s*((?:\w+=\d+\s*)+)", done.stdout)
        assert match, done.stdout[-3000:]
        recap = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(1))}
        changed = [
            block.split("]", 1)[0]
            for block in re.split(r"^(?:TASK|RUNNING HANDLER) \[", done.stdout, flags=re.M)[1:]
            if re.search(r"^changed: \[machine\]", block, flags=re.M)
        ]
        run = Run(name, seconds, recap, changed, done.stdout)
        self.runs.append(run)
        return run

    def ctl(self, *argv: str, timeout: float = 180) -> str:
        return self.ssh(" ".join(["appliancectl", *argv]), timeout=timeout)

    def received(self) -> list[dict[str, object]]:
        text = self.ssh("cat /root/received.json 2>/dev/null || echo []")
        return list(json.loads(text))

    def container_states(self) -> dict[str, str]:
        """Name -> start time of every container in the machine's engine."""
        lines = self.ssh(
            "docker ps --no-trunc --format '{{.ID}}' | xargs -r docker inspect "
            "-f '{{.Name}} {{.Id}} {{.State.StartedAt}}'"
        ).split("\n")
        return {line.split()[0]: " ".join(line.split()[1:]) for line in lines if line.strip()}


def _report(host: Host) -> str:
    lines = []
    for run in host.runs:
        recap = " ".join(f"{k}={v}" for k, v in run.recap.items())
        lines.append(f"{run.name}: {run.seconds:.0f} s, {recap}")
        if run.changed_tasks and "check" not in run.name:
            lines.append("    changed: " + "; ".join(run.changed_tasks))
    if host.exposure is not None:
        lines.append(f"systemd-analyze security applianced (running): {host.exposure}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    work = tmp_path_factory.mktemp("provision")
    key = work / "id_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, timeout=30
    )
    with Machine(key.with_suffix(".pub").read_text()) as machine:
        inventory = work / "inventory.ini"
        inventory.write_text(
            "[appliance]\n"
            f"machine ansible_host={machine.address} ansible_user=root"
            f" ansible_ssh_private_key_file={key}"
            " ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null'"
            " ansible_python_interpreter=/usr/bin/python3\n"
        )
        # The fake provider: its certificate and CA, demo_upstream.py and the runner, started as
        # a transient unit of the machine's systemd.
        context_dir = work / "tls"
        context_dir.mkdir()
        server_context(PROVIDER_HOST, context_dir)
        for source, target in (
            (context_dir / "demo-server.pem", "/root/provider.pem"),
            (context_dir / "demo-ca.pem", "/usr/local/share/provider-ca.pem"),
            (ROOT / "appliance" / "demo_upstream.py", "/root/demo_upstream.py"),
        ):
            subprocess.run(
                ["docker", "cp", str(source), f"{machine.name}:{target}"], check=True, timeout=60
            )
        runner = work / "upstream.py"
        runner.write_text(UPSTREAM_RUNNER)
        subprocess.run(
            ["docker", "cp", str(runner), f"{machine.name}:/root/upstream.py"],
            check=True,
            timeout=60,
        )
        machine.exec("systemd-run", "--unit", "fake-provider", "python3", "/root/upstream.py")
        # An operator's own engine setting, there before the role: it must survive the merge.
        machine.exec(
            "sh", "-c", "mkdir -p /etc/docker && echo '{\"max-concurrent-downloads\": 2}' > "
            "/etc/docker/daemon.json",
        )  # fmt: skip
        host = Host(machine, inventory)
        yield host
        print("\nprovisioning runs:\n" + _report(host))


@pytest.fixture(scope="module")
def artifacts() -> tuple[Path, Path]:
    return tarball(built_artifact()), tarball(upgrade_artifact())


def test_check_mode_on_a_new_machine_changes_nothing(
    host: Host, artifacts: tuple[Path, Path]
) -> None:
    run = host.play("check mode, new machine", artifacts[0], "--check")
    assert run.recap["failed"] == 0 and run.recap["changed"] > 0, run.recap
    # It said what it would do, and did none of it.
    assert host.ssh("command -v dockerd appliancectl || true").strip() == ""
    assert (
        host.ssh("test -e /etc/systemd/system/applianced.service && echo yes || echo no").strip()
        == "no"
    )


def test_first_run_provisions_the_machine(host: Host, artifacts: tuple[Path, Path]) -> None:
    run = host.play("first run", artifacts[0])
    assert run.recap["failed"] == 0 and run.recap["changed"] > 0, run.recap
    assert host.ssh("systemctl is-active docker applianced").split() == ["active", "active"]
    # The engine runs with the CIS settings the role wrote.
    info = json.loads(host.ssh("docker info --format '{{json .}}'"))
    assert info["LiveRestoreEnabled"] is True
    assert "runsc" in info["Runtimes"]
    daemon = json.loads(host.ssh("cat /etc/docker/daemon.json"))
    assert daemon["icc"] is False and daemon["no-new-privileges"] is True
    assert daemon["userland-proxy"] is False and daemon["live-restore"] is True
    assert daemon["max-concurrent-downloads"] == 2  # the operator's key, kept
    assert host.ssh("stat -c '%U:%G %a' /run/docker.sock").strip() == "root:docker 660"
    # applianced is the artifact's, under the hardened unit, and says it is ready.
    assert host.ssh("readlink -f /usr/local/bin/appliancectl").startswith(
        "/opt/agent-appliance/releases/"
    )
    assert host.ssh("appliancectl --version").split()[-1] == __version__
    show = host.ssh("systemctl show applianced -p Type -p NoNewPrivileges -p ActiveState")
    assert "Type=notify" in show and "NoNewPrivileges=yes" in show, show
    assert host.ssh("systemctl show -p WatchdogUSec --value applianced").strip() == "30s"
    # systemd's own assessment of the running service's sandbox (docs/systemd.md: 3.7 offline,
    # target at most 5.0).
    security = host.ssh("systemd-analyze security --no-pager applianced", check=False)
    found = re.search(r"Overall exposure level for applianced.service: (\d+\.\d)", security)
    assert found is not None and float(found.group(1)) <= 5.0, security[-2000:]
    host.exposure = float(found.group(1))
    # The proxy workers under the unit: UID 1002, no capability at all, no_new_privs.
    workers = host.ssh("pgrep -u 1002 -f proxy-worker").split()
    assert workers, host.ssh("ps -ef")
    for pid in workers:
        status = dict(
            line.split(":\t", 1)
            for line in host.ssh(f"cat /proc/{pid}/status").splitlines()
            if ":\t" in line
        )
        assert all(int(status[key], 16) == 0 for key in ("CapPrm", "CapEff", "CapBnd")), status
        assert status["NoNewPrivs"].strip() == "1", status


def test_a_restricted_crew_gets_its_key_injected(host: Host) -> None:
    host.ctl("crew", "create", CREW, "--mode", "restricted", "--allow", PROVIDER_HOST,
             "--ssrf-allow", "127.0.0.1/32")  # fmt: skip
    host.ssh(f"printf %s {KEY} > /root/key && chmod 600 /root/key")
    host.ctl("cred", "add", "provider-key", "--provider", "anthropic", "--from-file", "/root/key")
    host.ctl("cred", "grant", "provider-key", CREW)
    host.ssh("shred -u /root/key")
    _agent_calls_the_provider(host)


def _agent_calls_the_provider(host: Host) -> None:
    before = len(host.received())
    reply = host.ctl(
        "run", CREW, "--", "sh", "-c",
        "'curl -sS \"$ANTHROPIC_BASE_URL/v1/messages\" -H \"content-type: application/json\""
        f" -H \"x-api-key: {AGENT_KEY}\" -d \"{{}}\"'",
    )  # fmt: skip
    assert KEY not in reply
    deadline = time.monotonic() + 10
    while len(seen := host.received()) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(seen) > before, f"the provider received nothing; the agent got {reply!r}"
    headers = seen[-1]["headers"]
    assert isinstance(headers, dict)
    assert headers.get("x-api-key") == [KEY], headers
    assert AGENT_KEY not in json.dumps(headers)


def test_second_run_changes_nothing(host: Host, artifacts: tuple[Path, Path]) -> None:
    run = host.play("second run", artifacts[0])
    assert run.recap["changed"] == 0, (run.recap, run.changed_tasks)


def test_upgrade_keeps_the_crews_running(host: Host, artifacts: tuple[Path, Path]) -> None:
    containers = host.container_states()
    assert any(CREW in name for name in containers), containers
    old_pid = host.ssh("systemctl show -p MainPID --value applianced").strip()
    run = host.play("upgrade", artifacts[1])
    assert run.recap["failed"] == 0 and run.recap["changed"] > 0, run.recap
    assert host.ssh("appliancectl --version").split()[-1] == f"{__version__}+upgrade.test"
    assert host.ssh("systemctl show -p MainPID --value applianced").strip() != old_pid
    assert host.ssh("systemctl is-active applianced").strip() == "active"
    # The same containers, started at the same time: nothing was stopped or re-created.
    assert host.container_states() == containers
    _agent_calls_the_provider(host)
    # And a run after the upgrade changes nothing either.
    again = host.play("after the upgrade", artifacts[1])
    assert again.recap["changed"] == 0, (again.recap, again.changed_tasks)
