"""appliancectl's contexts without a daemon (docs/hosts.md): the per-user store (its path, modes
and format), `context add/use/list/show/remove`, the documented order in which a context is
chosen, and bad input: each a message naming the file, key or argument and a documented exit
code, never a traceback. The daemons themselves: tests/test_daemon_contexts.py.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trustme

from appliance.ctl import exits
from appliance.daemon.config import parse_config
from appliance.daemon.errors import ConfigInvalid
from tests.conftest import ROOT, free_port


def ctl(
    home: Path, *args: str, env: dict[str, str] | None = None, module: str = "appliance.cli"
) -> subprocess.CompletedProcess[str]:
    environment = {
        k: v
        for k, v in os.environ.items()
        if k not in ("APPLIANCECTL_SOCKET", "APPLIANCE_CONTEXT", "APPLIANCECTL_DEBUG")
    }
    environment.update(XDG_CONFIG_HOME=str(home), PYTHONPATH=str(ROOT), **(env or {}))
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=60,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done


def store(home: Path) -> Path:
    return home / "agent-appliance" / "contexts.json"


def make_certs(directory: Path) -> dict[str, str]:
    """A CA and a client certificate signed by it (trustme: nothing secret in the repo)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    client = ca.issue_cert("admin@test")
    paths = {k: directory / f for k, f in (("ca_file", "ca.pem"), ("cert_file", "c.pem"))}
    paths["key_file"] = directory / "c.key"
    ca.cert_pem.write_to_path(str(paths["ca_file"]))
    client.cert_chain_pems[0].write_to_path(str(paths["cert_file"]))
    client.private_key_pem.write_to_path(str(paths["key_file"]))
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, str]:
    return make_certs(tmp_path / "certs")


def add_tls(
    home: Path, name: str, address: str, certs: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    return ctl(
        home,
        "context",
        "add",
        name,
        "--tls",
        address,
        "--ca-file",
        certs["ca_file"],
        "--cert-file",
        certs["cert_file"],
        "--key-file",
        certs["key_file"],
    )


def test_store_format_modes_and_commands(tmp_path: Path, certs: dict[str, str]) -> None:
    home = tmp_path / "config"
    done = ctl(home, "-o", "json", "context", "ls")
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    assert [r["name"] for r in listing["contexts"]] == ["default"]
    assert listing["contexts"][0]["current"] is True
    assert not store(home).exists()  # listing writes nothing

    assert add_tls(home, "host-a", "127.0.0.1:7443", certs).returncode == 0
    done = ctl(
        home,
        "context",
        "add",
        "host-b",
        "--ssh",
        "root@host-b.example",
        "--ssh-port",
        "2222",
        "--ssh-option",
        "ConnectTimeout=5",
        "--description",
        "rack 2",
    )
    assert done.returncode == 0, done.stderr
    assert ctl(home, "context", "add", "lab", "--unix", "/run/lab/admin.sock").returncode == 0
    assert stat.S_IMODE(store(home).stat().st_mode) == 0o600
    assert stat.S_IMODE(store(home).parent.stat().st_mode) == 0o700
    document = json.loads(store(home).read_text())
    assert document["contexts"]["host-a"] == {"type": "tls", "address": "127.0.0.1:7443", **certs}
    assert document["contexts"]["host-b"] == {
        "type": "ssh",
        "destination": "root@host-b.example",
        "port": 2222,
        "ssh_options": ["ConnectTimeout=5"],
        "description": "rack 2",
    }
    assert document["current"] == ""

    # A second add of one name is a conflict; --force replaces it.
    again = ctl(home, "context", "add", "lab", "--unix", "/run/other.sock")
    assert again.returncode == exits.CONFLICT and "--force" in again.stderr
    assert ctl(home, "context", "add", "lab", "--unix", "/x.sock", "--force").returncode == 0

    assert ctl(home, "context", "use", "host-b").returncode == 0
    done = ctl(home, "context", "ls")
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["NAME", "TYPE", "ENDPOINT", "DESCRIPTION"]
    assert any(line.startswith("host-b *") for line in lines), done.stdout
    assert "ssh://root@host-b.example:2222/run/agent-appliance/admin.sock" in done.stdout
    assert ctl(home, "-o", "name", "context", "ls").stdout.split() == [
        "default",
        "host-a",
        "host-b",
        "lab",
    ]

    # Removing the current one needs --force, and then `default` is current.
    refused = ctl(home, "context", "rm", "host-b")
    assert refused.returncode == exits.CONFLICT
    assert ctl(home, "context", "rm", "host-b", "--force").returncode == 0
    assert json.loads(store(home).read_text())["current"] == ""
    assert ctl(home, "context", "rm", "nope").returncode == exits.NOT_FOUND


def chosen(home: Path, *args: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    done = ctl(home, "-o", "json", *args, "context", "show", env=env)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    return shown["name"], shown["chosen_by"]


def test_precedence_flag_env_current_default(tmp_path: Path) -> None:
    home = tmp_path / "config"
    for name in ("one", "two", "three"):
        assert ctl(home, "context", "add", name, "--unix", f"/run/{name}.sock").returncode == 0
    assert chosen(home) == ("default", "no context chosen")
    assert ctl(home, "context", "use", "one").returncode == 0
    assert chosen(home)[0] == "one"
    env = {"APPLIANCE_CONTEXT": "two"}
    assert chosen(home, env=env) == ("two", "$APPLIANCE_CONTEXT")
    assert chosen(home, "--context", "three", env=env) == ("three", "--context")
    # The local socket named on the command line or in the environment is `default`.
    assert chosen(home, "--socket", "/tmp/x.sock", env=env) == ("default", "--socket")
    assert chosen(home, env={"APPLIANCECTL_SOCKET": "/tmp/x.sock"}) == (
        "default",
        "$APPLIANCECTL_SOCKET",
    )
    # Two choices at one level: refused, not one silently winning.
    both = ctl(home, "--context", "two", "--socket", "/tmp/x.sock", "status")
    assert both.returncode == exits.USAGE and "--context" in both.stderr
    both = ctl(home, "status", env={**env, "APPLIANCECTL_SOCKET": "/tmp/x.sock"})
    assert both.returncode == exits.USAGE and "APPLIANCE_CONTEXT" in both.stderr
    assert ctl(home, "context", "use", "default").returncode == 0
    assert chosen(home) == ("default", "no context chosen")


def test_commands_go_where_the_context_says(tmp_path: Path) -> None:
    """The current context is what `status` and `run` (its fast path too) dial."""
    home = tmp_path / "config"
    target = tmp_path / "nobody.sock"
    assert ctl(home, "context", "add", "lab", "--unix", str(target)).returncode == 0
    assert ctl(home, "context", "use", "lab").returncode == 0
    for module in ("appliance.cli", "appliance.ctl"):
        done = ctl(home, "status", module=module)
        assert done.returncode == exits.UNREACHABLE
        assert f"context lab: applianced is not answering on {target}" in done.stderr
        done = ctl(home, "run", "crew", "--", "true", module=module)
        assert done.returncode == exits.UNREACHABLE, done.stderr
        assert str(target) in done.stderr


def test_bad_input_names_what_is_wrong(tmp_path: Path, certs: dict[str, str]) -> None:
    home = tmp_path / "config"
    path = store(home)

    unknown = ctl(home, "--context", "nope", "status")
    assert unknown.returncode == exits.NOT_FOUND
    assert "no context 'nope'" in unknown.stderr and str(path) in unknown.stderr
    unknown = ctl(home, "crew", "ls", env={"APPLIANCE_CONTEXT": "nope"})
    assert unknown.returncode == exits.NOT_FOUND
    bad_name = ctl(home, "context", "add", "-x/", "--unix", "/x.sock")
    assert bad_name.returncode == exits.USAGE
    assert ctl(home, "context", "add", "default", "--unix", "/x").returncode == exits.USAGE
    neither = ctl(home, "context", "add", "x")
    assert neither.returncode == exits.USAGE and "--tls" in neither.stderr
    missing = add_tls(home, "x", "127.0.0.1:1", {**certs, "ca_file": "/none.pem"})
    assert missing.returncode == exits.USAGE and "--ca-file: /none.pem" in missing.stderr
    partial = ctl(home, "context", "add", "x", "--tls", "127.0.0.1:1", "--ca-file", "/none.pem")
    assert partial.returncode == exits.USAGE and "--cert-file" in partial.stderr
    address = add_tls(home, "x", "no-port", certs)
    assert address.returncode == exits.USAGE and "HOST:PORT" in address.stderr

    # A certificate path that went away after `add`: the file, context and key are named.
    assert add_tls(home, "gone", f"127.0.0.1:{free_port()}", certs).returncode == 0
    os.unlink(certs["cert_file"])
    gone = ctl(home, "--context", "gone", "status")
    assert gone.returncode == exits.USAGE
    assert f"{path}: `contexts.gone.cert_file`" in gone.stderr
    # A certificate that is not one: named too.
    Path(certs["cert_file"]).write_text("not a certificate\n")
    garbage = ctl(home, "--context", "gone", "status")
    assert garbage.returncode == exits.USAGE and "cert_file" in garbage.stderr

    # A certificate from another key pair than key_file: named too.
    trustme.CA().issue_cert("admin").cert_chain_pems[0].write_to_path(certs["cert_file"])
    mismatched = ctl(home, "--context", "gone", "status")
    assert mismatched.returncode == exits.USAGE and "cert_file" in mismatched.stderr

    # Nothing listens there: unreachable (5), the context and the address named.
    good = make_certs(tmp_path / "good")
    port = free_port()
    assert add_tls(home, "nobody", f"127.0.0.1:{port}", good).returncode == 0
    nobody = ctl(home, "--context", "nobody", "crew", "ls")
    assert nobody.returncode == exits.UNREACHABLE
    assert f"context nobody: applianced is not answering on tls://127.0.0.1:{port}" in (
        nobody.stderr
    )

    # The store itself: unreadable JSON, unknown keys, group-writable, not ours.
    text = path.read_text()
    path.write_text("{not json")
    broken = ctl(home, "status")
    assert broken.returncode == exits.USAGE and str(path) in broken.stderr
    path.write_text(json.dumps({"current": "", "contexts": {"a": {"type": "tls"}}}))
    keyless = ctl(home, "context", "ls")
    assert keyless.returncode == exits.USAGE
    assert "`contexts.a.address`: missing" in keyless.stderr
    path.write_text(json.dumps({"contexts": {"a": {"type": "unix", "socket": "/s", "x": 1}}}))
    extra = ctl(home, "context", "ls")
    assert extra.returncode == exits.USAGE and "`contexts.a.x`: unknown key" in extra.stderr
    path.write_text(json.dumps({"current": "zz", "contexts": {}}))
    dangling = ctl(home, "status")
    assert dangling.returncode == exits.USAGE and "`current`" in dangling.stderr
    path.write_text(text)
    path.chmod(0o620)
    writable = ctl(home, "status")
    assert writable.returncode == exits.USAGE and "writable by others" in writable.stderr
    path.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(path, 4242, -1)
        foreign = ctl(home, "status")
        assert foreign.returncode == exits.USAGE and "not by you" in foreign.stderr
        os.chown(path, 0, -1)
    # -o json: the error is a JSON object on stderr, stdout stays empty.
    path.write_text("[]")
    as_json = ctl(home, "-o", "json", "status")
    assert as_json.stdout == ""
    assert json.loads(as_json.stderr)["exit_code"] == exits.USAGE


def test_admin_tls_config_is_checked(tmp_path: Path) -> None:
    assert parse_config("").admin_tls.listen == ""  # off by default
    with pytest.raises(ConfigInvalid, match=r"`admin_tls\.cert_file`: required"):
        parse_config('[admin_tls]\nlisten = "127.0.0.1:7443"\n')
    with pytest.raises(ConfigInvalid, match=r"`admin_tls\.listen`"):
        parse_config('[admin_tls]\nlisten = "localhost"\n')
    with pytest.raises(ConfigInvalid, match=r"`admin_tls\.key_file`: must be an absolute"):
        parse_config(
            '[admin_tls]\nlisten = "127.0.0.1:1"\ncert_file = "/c"\nkey_file = "k"\n'
            'client_ca_file = "/ca"\n'
        )
    with pytest.raises(ConfigInvalid, match="unknown field"):
        parse_config("[admin_tls]\nport = 1\n")


def test_admin_tls_preflight_names_the_key(tmp_path: Path) -> None:
    from appliance.daemon.preflight import _admin_tls, _Collect

    config = parse_config(
        f'[admin_tls]\nlisten = "127.0.0.1:1"\ncert_file = "{tmp_path}/c.pem"\n'
        f'key_file = "{tmp_path}/k.pem"\nclient_ca_file = "{tmp_path}/ca.pem"\n'
    )
    found = _Collect("appliance.toml")
    _admin_tls(config, found)
    assert [p.key for p in found.problems] == ["admin_tls.cert_file"]
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(f"{tmp_path}/c.pem")
    server.private_key_pem.write_to_path(f"{tmp_path}/k.pem")
    found = _Collect("appliance.toml")
    _admin_tls(config, found)
    assert [p.key for p in found.problems] == ["admin_tls.client_ca_file"]
    ca.cert_pem.write_to_path(f"{tmp_path}/ca.pem")
    found = _Collect("appliance.toml")
    _admin_tls(config, found)
    assert found.problems == []


def test_completion_offers_context_names(tmp_path: Path) -> None:
    """bash (and zsh through it) and fish complete context names after --context and for
    `context use/show/rm`, from `appliancectl context ls -o name`."""
    home = tmp_path / "config"
    for name in ("rack1-a", "rack1-b"):
        assert ctl(home, "context", "add", name, "--unix", f"/run/{name}.sock").returncode == 0
    shim = tmp_path / "bin" / "appliancectl"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m appliance.cli "$@"\n')
    shim.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shim.parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "XDG_CONFIG_HOME": str(home),
    }
    script = tmp_path / "c.bash"
    script.write_text(ctl(home, "completion", "bash").stdout)
    lines = (
        f"source {script}\n"
        'complete() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _appliancectl; '
        'echo "${COMPREPLY[*]}"; }\n'
        "complete appliancectl --context r\n"
        "complete appliancectl context use ''\n"
        "complete appliancectl context rm rack1-b\n"
        "complete appliancectl context u\n"
    )
    done = subprocess.run(
        ["bash", "-c", lines], capture_output=True, text=True, timeout=60, env=env
    )
    flag, use, rm, sub = done.stdout.splitlines()
    assert (flag, rm, sub) == ("rack1-a rack1-b", "rack1-b", "use"), done
    assert {"default", "rack1-a", "rack1-b", "--context"} <= set(use.split()), done
    fish = shutil.which("fish")
    if fish is None:
        return  # tests/test_cli.py says what installs it
    path = tmp_path / "c.fish"
    path.write_text(ctl(home, "completion", "fish").stdout)

    def complete(line: str) -> list[str]:
        done = subprocess.run(
            [fish, "--no-config", "-c", f"source {path}; complete -C {shlex.quote(line)}"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert done.returncode == 0 and not done.stderr, done
        return [candidate.split("\t", 1)[0] for candidate in done.stdout.splitlines()]

    assert complete("appliancectl --context r") == ["rack1-a", "rack1-b"]
    assert complete("appliancectl context use rack1-") == ["rack1-a", "rack1-b"]
