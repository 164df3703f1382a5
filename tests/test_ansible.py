"""ansible/: the collection's roles and playbook, checked without a host.

Nothing here touches this machine's /etc, services or users:

- the syntax check and ansible-lint read the playbook only;
- the templates are rendered by ansible's own template module into a temporary directory, then
  the config is parsed by applianced's parser and the unit checked by `systemd-analyze verify`
  and `systemd-analyze security`;
- the roles' argument specs are checked by running the play in check mode with only the
  `always` tasks selected: a bad variable stops it at the validation, before any task.

tests/test_provision.py runs the roles for real, on a systemd-booted Debian machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from appliance.daemon.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
ANSIBLE_DIR = ROOT / "ansible"
ROLE = ANSIBLE_DIR / "roles" / "appliance"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
        return found
    return str(path)


def _run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "LC_ALL": "C.UTF-8"}
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_playbook_syntax() -> None:
    _run(
        [
            _tool("ansible-playbook"),
            "--syntax-check",
            "-i",
            "inventory.example.ini",
            "site.yml",
        ],
        ANSIBLE_DIR,
    )


def test_ansible_lint_production_profile() -> None:
    proc = _run([_tool("ansible-lint"), "--profile", "production", "site.yml"], ANSIBLE_DIR)
    assert "0 failure(s)" in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The role's two templates rendered by ansible with the role's defaults, into a temporary
    directory; appliance_bin_dir points at this venv so that ExecStart names a real applianced."""
    return _render(tmp_path_factory.mktemp("rendered"))


def _render(out: Path, *extra_vars: str) -> Path:
    playbook = out / "render.yml"
    playbook.write_text(
        json.dumps(
            [
                {
                    "name": "render",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "vars_files": [str(ROLE / "defaults" / "main.yml")],
                    "tasks": [
                        {
                            "name": f"render {name}",
                            "ansible.builtin.template": {
                                "src": str(ROLE / "templates" / f"{name}.j2"),
                                "dest": str(out / name),
                                "mode": "0600",
                            },
                        }
                        for name in ("appliance.toml", "applianced.service")
                    ],
                }
            ]
        )
    )
    _run(
        [
            _tool("ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"appliance_bin_dir={sys.prefix}/bin",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            *(arg for var in extra_vars for arg in ("-e", var)),
            str(playbook),
        ],
        out,
    )
    return out


def test_inventory_example_for_n_hosts(tmp_path: Path) -> None:
    """The example inventory: several hosts in `appliance`, one with the admin TLS listener,
    and what the role writes for that one is an [admin_tls] section applianced accepts."""
    proc = _run([_tool("ansible-inventory"), "-i", "inventory.example.ini", "--list"], ANSIBLE_DIR)
    inventory = json.loads(proc.stdout)
    hosts = inventory["appliance"]["hosts"]
    assert len(hosts) >= 2
    listen = {
        host: inventory["_meta"]["hostvars"][host].get("appliance_admin_tls_listen")
        for host in hosts
    }
    tls_hosts = [host for host, value in listen.items() if value]
    assert len(tls_hosts) == 1
    out = _render(tmp_path, f"appliance_admin_tls_listen={listen[tls_hosts[0]]}")
    config = parse_config((out / "appliance.toml").read_text(), source="appliance.toml")
    assert config.admin_tls.listen == listen[tls_hosts[0]]
    assert config.admin_tls.cert_file == "/etc/agent-appliance/admin-tls.pem"
    assert config.admin_tls.client_ca_file == "/etc/agent-appliance/admin-clients-ca.pem"


def test_rendered_config_parses_with_the_defaults_of_the_role(rendered: Path) -> None:
    text = (rendered / "appliance.toml").read_text()
    config = parse_config(text, source="appliance.toml")
    assert config.daemon.state_dir == "/var/lib/agent-appliance"
    assert config.daemon.admin_socket == "/run/agent-appliance/admin.sock"
    assert config.daemon.proxy_port == 9119
    assert (config.proxy.uid, config.proxy.gid, config.proxy.workers) == (1002, 1002, 0)
    # Nothing secret: exactly these keys, no [credentials] or provider sections.
    assert tomllib.loads(text) == {
        "daemon": {
            "state_dir": "/var/lib/agent-appliance",
            "admin_socket": "/run/agent-appliance/admin.sock",
            "proxy_port": 9119,
        },
        "proxy": {"workers": 0, "uid": 1002, "gid": 1002},
        "journal": {"keep_days": 365.0, "keep_bytes": 20 << 30},
    }
    assert (config.journal.keep_days, config.journal.keep_bytes) == (365.0, 20 << 30)


def test_rendered_unit(rendered: Path) -> None:
    unit = (rendered / "applianced.service").read_text()
    lines = {line.strip() for line in unit.splitlines()}
    applianced = Path(sys.prefix) / "bin" / "applianced"
    assert f"ExecStart={applianced} --config /etc/agent-appliance/appliance.toml" in lines
    # The image build, the one step that needs the whole of root, runs before the daemon and
    # outside its sandbox ("+"); the daemon only finds the images (docs/systemd.md).
    assert (
        f"ExecStartPre=+{applianced} --config /etc/agent-appliance/appliance.toml --build-images"
        in lines
    )
    # sd_notify (appliance/daemon/notify.py): ready when serving, a watchdog, no restart for a
    # configuration this host cannot run (exit 2). `exec`: the build step may extend the start
    # timeout; the workers (not Exec*= processes) may not notify.
    assert {"Type=notify", "NotifyAccess=exec", "RestartPreventExitStatus=2"} <= lines
    assert "WatchdogSec=30" in lines and "TimeoutStartSec=120" in lines
    assert "KillMode=mixed" in lines
    assert any(re.fullmatch(r"TimeoutStopSec=\d+", line) for line in lines)
    assert "Requires=docker.service" in lines
    assert "WantedBy=multi-user.target" in lines
    # Writable: the state, the backups, the run directories; nothing else.
    assert "ReadWritePaths=/var/lib/agent-appliance -/var/backups/agent-appliance" in lines
    assert "RuntimeDirectory=agent-appliance agent-appliance-keeper" in lines
    assert "ProtectSystem=strict" in lines
    # Directives that would break what applianced does (docs/systemd.md says why for each).
    for forbidden in (
        "PrivateNetwork",  # the veths' host ends, the listeners on the crews' gateways
        "PrivateUsers",  # capabilities over the host's network and the crews' namespaces
        "ProtectKernelTunables",  # net sysctls of the crews' interfaces
        "PrivateTmp",  # a crew's mounts must be checked in the view dockerd mounts them from
        "PrivateDevices",  # the same
        "ProcSubset",  # /proc/sys/net
        "IPAddressDeny",  # the workers reach the providers and the allowed hosts
    ):
        assert not any(line.startswith(f"{forbidden}=") for line in lines), forbidden
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return  # the key lines above are the check on a machine without systemd's tools
    target = rendered / "applianced.service"
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Without a running systemd, verify still loads and checks the unit; it prints nothing
    # about a correct one except complaints on other units (docker.service's dependencies).
    problems = [line for line in proc.stderr.splitlines() if target.name in line]
    assert proc.returncode == 0 and not problems, proc.stderr


# The figure docs/systemd.md reports; the target is at most 5.0 (10 is a unit with no sandbox).
UNIT_EXPOSURE = 3.8
MAX_EXPOSURE = 5.0


def test_rendered_unit_exposure(rendered: Path) -> None:
    """systemd's own assessment of the unit's sandbox (systemd-analyze(1), "security"), offline:
    it reads the file, not a running service, so it works without systemd as PID 1."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip(
            "systemd-analyze is not installed (Debian package systemd; scripts/install --dev "
            "installs it)"
        )
    target = rendered / "applianced.service"
    proc = subprocess.run(
        [analyze, "security", "--offline=true", "--no-pager", str(target)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", proc.stdout)
    assert found is not None, proc.stdout + proc.stderr
    exposure = float(found.group(1))
    assert exposure <= MAX_EXPOSURE, proc.stdout
    # Not worse than what the docs say; a better figure means the docs need the new one.
    assert exposure == UNIT_EXPOSURE, proc.stdout
    # The passing lines the docs rely on, in systemd's own words.
    for held in (
        "NoNewPrivileges=",
        "ProtectSystem=",
        "RestrictSUIDSGID=",
        "MemoryDenyWriteExecute=",
        "SystemCallArchitectures=",
        "LockPersonality=",
    ):
        assert any(line.startswith(f"\u2713 {held}") for line in proc.stdout.splitlines()), held


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        # No artifact: the one variable without a default.
        ({}, "appliance_artifact"),
        ({"appliance_artifact": "/x.tar.gz", "appliance_proxy_uid": "one"}, "appliance_proxy_uid"),
        ({"appliance_artifact": "/x.tar.gz", "docker_host_audit": "perhaps"}, "docker_host_audit"),
    ],
)
def test_argument_specs_refuse_bad_variables_before_any_task(
    tmp_path: Path, variables: dict[str, object], named: str
) -> None:
    """meta/argument_specs.yml of each role: the play stops at the role's validation, naming
    the variable. `--tags` selects no task of the roles (only the `always` ones run: the
    validation and the platform check), and `--check` changes nothing anyway."""
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        "[appliance]\n"
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"
    )
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "LC_ALL": "C.UTF-8"}
    proc = subprocess.run(
        [
            _tool("ansible-playbook"), "-i", str(inventory), "--check",
            "--tags", "no-such-tag", "-e", json.dumps(variables), "site.yml",
        ],
        cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Validating arguments against arg spec" in out, out
    assert named in out, out
