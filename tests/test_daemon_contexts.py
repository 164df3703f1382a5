"""Two applianced on this machine as two "hosts" (each its own state directory, admin socket,
address pool, instance id), driven by one appliancectl through contexts (docs/hosts.md):

- host A through its `[admin_tls]` listener: mutual TLS 1.3, our client certificate signed by
  the CA it admits; a client without a certificate, one whose certificate another CA signed,
  and one that does not trust the daemon's certificate are all refused;
- host B over SSH: a real sshd on a loopback port (a temporary host key, an authorized key),
  its admin socket forwarded by `ssh -L` to a socket of our own;

then crews are created, listed, run in (`run`, with stdin: the session's frames over TLS and
over the tunnel) and removed on each through `--context`, $APPLIANCE_CONTEXT and `context use`,
and each host sees only its own. Nothing secret is in the repository: trustme and ssh-keygen
make every key in the test's temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme

from appliance.ctl import exits
from appliance.demo_upstream import FakeServer
from tests.conftest import ROOT, free_port, in_ci, proxy_env, wait_for_port
from tests.daemon_support import (
    Appliance,
    busybox_images,
    needs_root_and_docker,
    new_appliance,
    sigint_as_in_a_terminal,
)

SSHD = "/usr/sbin/sshd"


def _write(path: Path, blob: trustme.Blob) -> str:
    blob.write_to_path(str(path))
    return str(path)


class Pki:
    """The daemon's CA (its server certificate) and the admins' CA (client certificates)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir()
        self.dir = directory
        self.server_ca = trustme.CA()
        self.client_ca = trustme.CA()
        server = self.server_ca.issue_cert("host-a.test", "127.0.0.1")
        self.server_cert = _write(directory / "server.pem", server.cert_chain_pems[0])
        self.server_key = _write(directory / "server.key", server.private_key_pem)
        os.chmod(self.server_key, 0o600)
        self.server_ca_file = _write(directory / "server-ca.pem", self.server_ca.cert_pem)
        self.client_ca_file = _write(directory / "client-ca.pem", self.client_ca.cert_pem)

    def client(self, name: str, ca: trustme.CA | None = None) -> tuple[str, str]:
        issued = (ca or self.client_ca).issue_cert(f"{name}@ops.test")
        cert = _write(self.dir / f"{name}.pem", issued.cert_chain_pems[0])
        key = _write(self.dir / f"{name}.key", issued.private_key_pem)
        return cert, key


class Sshd:
    """sshd -D on 127.0.0.1:PORT with a throwaway host key and one authorized key (root).
    (`AllowTcpForwarding no` would deny the Unix-socket forward too: OpenSSH 9.2, docs/hosts.md.)"""

    def __init__(self, directory: Path) -> None:
        if not os.path.exists(SSHD) or shutil.which("ssh") is None:
            message = "sshd or ssh is not installed (scripts/install --dev: openssh-server)"
            if in_ci():
                pytest.fail(message)
            pytest.skip(message)
        directory.mkdir()
        self.dir = directory
        for key in ("host_key", "client_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / key)],
                check=True,
            )
        authorized = directory / "authorized_keys"
        authorized.write_text((directory / "client_key.pub").read_text())
        authorized.chmod(0o600)
        self.port = free_port()
        config = directory / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {directory}/host_key\n"
            f"AuthorizedKeysFile {authorized}\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "StrictModes no\nPidFile none\nAllowStreamLocalForwarding yes\n"
            "X11Forwarding no\nPermitTTY no\n"
        )
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # its privilege separation dir
        self.log = directory / "sshd.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(config)], stdout=log, stderr=log
            )
        wait_for_port("127.0.0.1", self.port, process=self.process)
        host_key = (directory / "host_key.pub").read_text().split()
        self.known_hosts = directory / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_key[0]} {host_key[1]}\n")
        self.identity = str(directory / "client_key")

    def options(self, known_hosts: Path | None = None) -> list[str]:
        return [
            f"UserKnownHostsFile={known_hosts or self.known_hosts}",
            "GlobalKnownHostsFile=/dev/null",
            "StrictHostKeyChecking=yes",
        ]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture
def hosts(
    tmp_path: Path, provider: FakeServer, plain_host: FakeServer, ca_file: str
) -> Iterator[tuple[Appliance, Appliance, Pki, Sshd]]:
    needs_root_and_docker()
    sshd = Sshd(tmp_path / "sshd")
    pki = Pki(tmp_path / "pki")
    agent, infra = busybox_images()
    made: list[Appliance] = []
    try:
        for name in ("host-a", "host-b"):
            directory = tmp_path / name
            directory.mkdir()
            app = new_appliance(directory, provider.port, plain_host.port, ca_file)
            app.infra_pool = 1
            app.write_config(agent, infra)
            made.append(app)
        a, b = made
        a.tls_port = free_port()  # type: ignore[attr-defined]
        with open(a.config, "a") as config:
            config.write(
                f'\n[admin_tls]\nlisten = "127.0.0.1:{a.tls_port}"\n'  # type: ignore[attr-defined]
                f'cert_file = "{pki.server_cert}"\nkey_file = "{pki.server_key}"\n'
                f'client_ca_file = "{pki.client_ca_file}"\n'
            )
        a.start()
        b.start()
        yield a, b, pki, sshd
    finally:
        for app in reversed(made):
            app.cleanup()
        sshd.stop()


Ctl = Callable[..., subprocess.CompletedProcess[str]]


def make_ctl(config_home: Path) -> Ctl:
    def ctl(
        *args: str, env: dict[str, str] | None = None, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        environment = {
            k: v
            for k, v in proxy_env().items()
            if k not in ("APPLIANCECTL_SOCKET", "APPLIANCE_CONTEXT")
        }
        environment.update(XDG_CONFIG_HOME=str(config_home), **(env or {}))
        done = subprocess.run(
            [sys.executable, "-m", "appliance.ctl", *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=environment,
            cwd=ROOT,
            timeout=120,
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done

    return ctl


def tunnels_left() -> list[str]:
    """ssh processes of ours still running (their -L names our temporary directory)."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "appliancectl-ssh-" in line and "-L" in line]


def test_two_hosts_through_contexts(
    hosts: tuple[Appliance, Appliance, Pki, Sshd], tmp_path: Path
) -> None:
    a, b, pki, sshd = hosts
    ctl = make_ctl(tmp_path / "config")
    cert, key = pki.client("alice")
    address = f"127.0.0.1:{a.tls_port}"  # type: ignore[attr-defined]

    def add_tls(name: str, cert: str, key: str, ca: str, server_name: str = "host-a.test") -> None:
        done = ctl(
            "context", "add", name, "--tls", address, "--ca-file", ca, "--cert-file", cert,
            "--key-file", key, "--server-name", server_name,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    add_tls("host-a", cert, key, pki.server_ca_file)
    done = ctl(
        "context", "add", "host-b", "--ssh", "root@127.0.0.1", "--ssh-port", str(sshd.port),
        "--identity-file", sshd.identity, "--remote-socket", str(b.socket),
        *(arg for option in sshd.options() for arg in ("--ssh-option", option)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr

    # Each context reaches its own daemon: `status` names the instance.
    for name, app in (("host-a", a), ("host-b", b)):
        done = ctl("--context", name, "-o", "json", "status")
        assert done.returncode == 0, done.stderr + a.log_text()[-2000:]
        assert json.loads(done.stdout)["instance"] == app.instance

    # A crew on each, through the context; each host lists only its own.
    crew_a, crew_b = a.crew("ctx"), b.crew("ctx")
    assert ctl("--context", "host-a", "crew", "create", crew_a).returncode == 0
    done = ctl("crew", "create", crew_b, env={"APPLIANCE_CONTEXT": "host-b"})
    assert done.returncode == 0, done.stderr
    assert ctl("--context", "host-a", "crew", "ls", "-o", "name").stdout.split() == [crew_a]
    assert ctl("--context", "host-b", "crew", "ls", "-o", "name").stdout.split() == [crew_b]
    # What the hosts' own sockets say agrees.
    assert a.ctl("crew", "ls", "-o", "name").stdout.split() == [crew_a]
    assert b.ctl("crew", "ls", "-o", "name").stdout.split() == [crew_b]

    # `run`: the upgraded session's frames over TLS and through the tunnel, stdin included,
    # and the command's exit code back.
    for name, crew in (("host-a", crew_a), ("host-b", crew_b)):
        done = ctl("--context", name, "run", "-i", crew, "--", "sh", "-c", "cat; exit 3",
                   stdin="through the context\n")  # fmt: skip
        assert done.returncode == 3, done.stderr
        assert done.stdout == "through the context\n"

    # Ctrl-C during `run`: forwarded to the command in the crew (exit 130 as a shell reports
    # it), on both transports; the SSH tunnel, in a session of its own, does not get it.
    for name, crew in (("host-a", crew_a), ("host-b", crew_b)):
        environment = {k: v for k, v in proxy_env().items() if k != "APPLIANCECTL_SOCKET"}
        environment["XDG_CONFIG_HOME"] = str(tmp_path / "config")
        process = subprocess.Popen(
            [sys.executable, "-m", "appliance.ctl", "--context", name, "run", crew, "--",
             "sh", "-c", "echo started; exec sleep 60"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
            cwd=ROOT, preexec_fn=sigint_as_in_a_terminal,
        )  # fmt: skip
        assert process.stdout is not None
        assert process.stdout.readline() == "started\n"
        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
        assert process.returncode == exits.INTERRUPTED, (name, out, err)
        assert time.monotonic() - started < 10 and "Traceback" not in err

    # What each transport costs a command (printed with -s): `status`, median of five.
    for name in ("default", "host-a", "host-b"):
        extra = {"APPLIANCECTL_SOCKET": str(a.socket)} if name == "default" else {}
        times = []
        for _ in range(5):
            begin = time.monotonic()
            args = ("status",) if name == "default" else ("--context", name, "status")
            assert ctl(*args, env=extra).returncode == 0
            times.append(time.monotonic() - begin)
        print(f"status through {name}: {sorted(times)[2] * 1000:.0f} ms (median of 5)")

    # The current context, then the flag over it.
    assert ctl("context", "use", "host-b").returncode == 0
    assert ctl("crew", "ls", "-o", "name").stdout.split() == [crew_b]
    done = ctl("run", crew_b, "--", "echo", "fast path defers")  # python -m appliance.ctl
    assert done.returncode == 0 and done.stdout == "fast path defers\n", done.stderr
    assert ctl("--context", "host-a", "crew", "ls", "-o", "name").stdout.split() == [crew_a]
    events = ctl("--context", "host-a", "-o", "json", "events", "-n", "50")
    assert events.returncode == 0, events.stderr
    assert crew_a in events.stdout and crew_b not in events.stdout

    # Refused: another CA's client certificate, no certificate at all, a daemon whose
    # certificate we do not trust, a name it does not carry; never a traceback, exit 5.
    other_cert, other_key = pki.client("mallory", trustme.CA())
    add_tls("wrong-ca", other_cert, other_key, pki.server_ca_file)
    refused = ctl("--context", "wrong-ca", "crew", "ls")
    assert refused.returncode == exits.UNREACHABLE, refused.stderr
    assert "context wrong-ca" in refused.stderr and address in refused.stderr
    add_tls("untrusted", cert, key, pki.client_ca_file)  # not the CA of the daemon's cert
    refused = ctl("--context", "untrusted", "crew", "ls")
    assert refused.returncode == exits.UNREACHABLE
    assert "does not verify" in refused.stderr
    add_tls("misnamed", cert, key, pki.server_ca_file, server_name="host-z.test")
    assert ctl("--context", "misnamed", "crew", "ls").returncode == exits.UNREACHABLE
    no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    no_cert.load_verify_locations(pki.server_ca_file)
    tls_port: int = a.tls_port  # type: ignore[attr-defined]
    with (
        socket.create_connection(("127.0.0.1", tls_port), timeout=10) as raw,
        no_cert.wrap_socket(raw, server_hostname="host-a.test") as tls,
        pytest.raises((ssl.SSLError, ConnectionError)),
    ):
        tls.sendall(b"GET /v1/crews HTTP/1.1\r\nHost: x\r\n\r\n")
        if not tls.recv(4096):
            raise ConnectionError("closed without an answer")
    # TLS 1.2 is not spoken at all.
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    old.load_verify_locations(pki.server_ca_file)
    old.load_cert_chain(cert, key)
    with (
        socket.create_connection(("127.0.0.1", tls_port), timeout=10) as raw,
        pytest.raises(ssl.SSLError),
    ):
        old.wrap_socket(raw, server_hostname="host-a.test")
    log = a.log_text()
    assert "refused an admin TLS connection" in log
    tls_lines = "\n".join(line for line in log.splitlines() if "TLS" in line)
    assert "admin TLS connection from 127.0.0.1" in log, tls_lines
    assert "email:alice@ops.test" in log, tls_lines
    # host A still serves after all that.
    assert ctl("--context", "host-a", "status").returncode == 0

    # SSH refusals: an unknown host key, a socket that is not there.
    stranger = tmp_path / "stranger_known_hosts"
    stranger.write_text("")
    done = ctl(
        "context", "add", "b-unknown-key", "--ssh", "root@127.0.0.1", "--ssh-port",
        str(sshd.port), "--identity-file", sshd.identity,
        *(arg for option in sshd.options(stranger) for arg in ("--ssh-option", option)),
    )  # fmt: skip
    assert done.returncode == 0
    refused = ctl("--context", "b-unknown-key", "status")
    assert refused.returncode == exits.UNREACHABLE
    assert "Host key verification failed" in refused.stderr, refused.stderr
    done = ctl(
        "context", "add", "b-no-socket", "--ssh", "root@127.0.0.1", "--ssh-port",
        str(sshd.port), "--identity-file", sshd.identity, "--remote-socket", "/run/none.sock",
        *(arg for option in sshd.options() for arg in ("--ssh-option", option)),
    )  # fmt: skip
    refused = ctl("--context", "b-no-socket", "status")
    assert refused.returncode == exits.UNREACHABLE, refused.stderr
    print("no remote socket:", refused.stderr.strip())
    assert "context b-no-socket: applianced on ssh://root@127.0.0.1/run/none.sock" in (
        refused.stderr
    )
    assert tunnels_left() == []  # no ssh outlives its appliancectl

    for name, crew in (("host-a", crew_a), ("host-b", crew_b)):
        done = ctl("--context", name, "crew", "rm", crew)
        assert done.returncode == 0, done.stderr
    assert a.ctl("crew", "ls", "-o", "name").stdout.split() == []
    assert b.ctl("crew", "ls", "-o", "name").stdout.split() == []
