"""The whole configuration is checked before applianced starts, and by `applianced --check` and
`appliancectl config check`: every problem is one line on stderr naming the file, the key and
the reason; exit 2; never a traceback, and nothing on the host touched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.daemon.config import parse_config
from appliance.daemon.errors import ConfigInvalid
from tests.conftest import ROOT, needs
from tests.daemon_support import needs_root_and_docker

CTL = [sys.executable, "-m", "appliance.cli"]
DAEMON = [sys.executable, "-m", "appliance.daemon.main"]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False
    )


def isolated(tmp_path: Path, extra: str = "") -> str:
    """A configuration whose state, sockets and port are this test's own."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return (
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'admin_socket = "{tmp_path / "admin.sock"}"\nproxy_port = {port}\n{extra}'
    )


def assert_clean_failure(done: subprocess.CompletedProcess[str], file: Path, key: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    line = next(line for line in done.stderr.splitlines() if f"`{key}`" in line)
    assert str(file) in line, done.stderr


# -- the file alone (config.py) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ('[net]\npool = "8.8.8.0/24"\n', "net.pool", "not a private range"),
        ('[net]\npool = "100.128.0.0/16"\n', "net.pool", "not a private range"),  # past CGNAT
        ('[net]\npool = "172.32.0.0/16"\n', "net.pool", "not a private range"),  # past 172.16/12
        ('[net]\npool = "nonsense"\n', "net.pool", "not a network address"),
        ('[net]\nifname_prefix = "X"\n', "net.ifname_prefix", "lowercase"),
        ('[crews]\nname_prefix = "-x"\n', "crews.name_prefix", "starting with a letter"),
        ('[crews]\nname_prefix = "a_b"\n', "crews.name_prefix", "letters, digits or '-'"),
        (f'[crews]\nname_prefix = "{"a" * 41}"\n', "crews.name_prefix", "1-40"),
        ('[crews]\ndefault_runtime = "runq"\n', "crews.default_runtime", "not a runtime"),
    ],
)
def test_values_are_refused_naming_file_and_key(text: str, key: str, reason: str) -> None:
    with pytest.raises(ConfigInvalid) as caught:
        parse_config(text, source="/etc/x.toml")
    message = str(caught.value)
    assert message.startswith(f"/etc/x.toml: `{key}`: ") and reason in message, message


@pytest.mark.parametrize(
    "pool", ["10.9.0.0/16", "172.16.4.0/24", "192.168.77.0/24", "100.64.0.0/10", "100.127.0.0/16"]
)
def test_private_and_shared_pools_are_accepted(pool: str) -> None:
    assert parse_config(f'[net]\npool = "{pool}"\n').net.pool == pool


@pytest.mark.parametrize("prefix", ["", "demo-", "t1a2b-", "A9"])
def test_name_prefixes_that_begin_a_crew_name_are_accepted(prefix: str) -> None:
    assert parse_config(f'[crews]\nname_prefix = "{prefix}"\n').crews.name_prefix == prefix


def test_not_utf8_is_a_config_error_everywhere(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[daemon]\nstate_dir = "/tmp/\xe9t\xe9"\n')
    for argv in (
        [*DAEMON, "--check", "--config", str(path)],
        [*CTL, "config", "check", "--config", str(path)],
        [*CTL, "up", "--config", str(path)],
        [*CTL, "proxy", "--check", "--config", str(path)],
    ):
        done = run(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert f"{path}: not UTF-8 (byte 27)" in done.stderr, (argv, done.stderr)
        assert "Traceback" not in done.stderr


# -- the host (preflight.py) ----------------------------------------------------------------------


def test_missing_credential_file_is_named_before_anything_starts(tmp_path: Path) -> None:
    """Once a silent crash loop: each worker exited reading the file, applianced never answered."""
    path = tmp_path / "appliance.toml"
    missing = tmp_path / "nowhere" / "anthropic.key"
    path.write_text(
        isolated(tmp_path)
        + f'[proxy.providers.anthropic]\ncredential_file = "{missing}"\n'
        + '[proxy.providers.openai]\ncredential_env = "H15_UNSET_VARIABLE"\n'
    )
    for argv in ([*DAEMON, "--check"], [*CTL, "config", "check"]):
        done = run(*argv, "--config", str(path))
        assert_clean_failure(done, path, "proxy.providers.anthropic.credential_file")
        assert f"cannot read {missing}: No such file or directory" in done.stderr
        assert_clean_failure(done, path, "proxy.providers.openai.credential_env")
        assert "H15_UNSET_VARIABLE is not set" in done.stderr
    if os.geteuid() == 0:
        done = run(*CTL, "up", "--config", str(path))
        assert_clean_failure(done, path, "proxy.providers.anthropic.credential_file")
        assert not (tmp_path / "state").exists(), "the failed start touched the state"


def test_a_credential_file_that_holds_one_passes_and_a_loose_mode_is_noted(tmp_path: Path) -> None:
    key = tmp_path / "anthropic.key"
    key.write_text("sk-ant-api03-test-0000000000000000\n")
    key.chmod(0o644)
    path = tmp_path / "appliance.toml"
    path.write_text(
        isolated(tmp_path) + f'[proxy.providers.anthropic]\ncredential_file = "{key}"\n'
    )
    done = run(*CTL, "--json", "config", "check", "--config", str(path))
    report = json.loads(done.stdout)
    assert not [p for p in report["problems"] if p["key"].startswith("proxy.")], report
    assert any("mode 0644" in note and f"chmod 600 {key}" in note for note in report["notes"])


def test_ca_file_must_be_a_pem_bundle(tmp_path: Path) -> None:
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate\n")
    path = tmp_path / "appliance.toml"
    path.write_text(isolated(tmp_path) + f'[proxy.upstream]\nca_file = "{bogus}"\n')
    done = run(*DAEMON, "--check", "--config", str(path))
    assert_clean_failure(done, path, "proxy.upstream.ca_file")
    assert "not a PEM CA bundle" in done.stderr


def test_a_wildcard_listener_on_the_proxy_port_is_named(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "appliance.toml"
        path.write_text(isolated(tmp_path).replace("proxy_port =", f"proxy_port = {port}\n#"))
        done = run(*DAEMON, "--check", "--config", str(path))
    assert_clean_failure(done, path, "daemon.proxy_port")
    assert f"0.0.0.0:{port} is taken by pid {os.getpid()}" in done.stderr


def test_an_engine_that_does_not_answer_is_named(tmp_path: Path) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text(isolated(tmp_path))
    env_socket = f"unix://{tmp_path / 'no-engine.sock'}"
    done = subprocess.run(
        [*DAEMON, "--check", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "DOCKER_HOST": env_socket},
        check=False,
    )
    assert_clean_failure(done, path, "daemon.provider")
    assert "start the engine" in done.stderr


def test_runtime_and_images_are_checked_against_the_engine(tmp_path: Path) -> None:
    needs_root_and_docker()
    path = tmp_path / "appliance.toml"
    path.write_text(
        isolated(tmp_path)
        + '[crews]\ndefault_runtime = "kata-runtime"\n'
        + '[images]\nagent = "agent-appliance/none:0"\ninfra = "agent-appliance/none:1"\n'
    )
    for argv in ([*DAEMON, "--check"], [*CTL, "config", "check"], [*CTL, "up"]):
        done = run(*argv, "--config", str(path))
        assert_clean_failure(done, path, "crews.default_runtime")
        assert "'kata-runtime' is not available: not registered in the engine" in done.stderr
        assert_clean_failure(done, path, "images.agent")
        assert_clean_failure(done, path, "images.infra")
        assert "agent-appliance/none:0 is not in the engine, and applianced never pulls" in (
            done.stderr
        )
    assert not (tmp_path / "state").exists()


def test_a_good_configuration_passes_with_what_was_checked(tmp_path: Path) -> None:
    needs_root_and_docker()
    from tests.daemon_support import busybox_images

    agent, infra = busybox_images()
    path = tmp_path / "appliance.toml"
    path.write_text(isolated(tmp_path) + f'[images]\nagent = "{agent}"\ninfra = "{infra}"\n')
    done = run(*DAEMON, "--check", "--config", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{path}: ok (checked values, runtime runc, the agent image")
    done = run(*CTL, "--json", "config", "check", "--config", str(path))
    report = json.loads(done.stdout)
    assert done.returncode == 0 and report["ok"] is True and report["problems"] == []
    assert report["file"] == str(path) and "the admin socket" in report["checked"]


def test_a_missing_credential_file_is_named_even_when_the_engine_is_down(tmp_path: Path) -> None:
    """The engine coming back would not fix it: exit 2 (no restart), not 1 (restart loop)."""
    if os.geteuid() != 0:
        pytest.skip(needs("root"))
    missing = tmp_path / "anthropic.key"
    path = tmp_path / "appliance.toml"
    path.write_text(
        isolated(tmp_path) + f'[proxy.providers.anthropic]\ncredential_file = "{missing}"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    env["DOCKER_HOST"] = f"unix://{tmp_path / 'no-engine.sock'}"
    for argv in ([*DAEMON, "--config", str(path)], [*CTL, "up", "--config", str(path)]):
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False
        )
        assert_clean_failure(done, path, "proxy.providers.anthropic.credential_file")
        assert "daemon.provider" not in done.stderr
    assert not (tmp_path / "state").exists()
