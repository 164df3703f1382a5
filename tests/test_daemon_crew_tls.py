"""A crew's CA through a real applianced (busybox images, loopback only): the crew is given its
trust (the variables, the bundle over the system bundle's path, the CA alone), the CA key is in
none of the crew's files or environment and in no log or journal, a CONNECT to a ruled host and
to a provider host with a key is terminated with a leaf that verifies under the crew CA, a
CONNECT to an allowed host without rules stays an opaque tunnel, and all of it holds after a
proxy worker is SIGKILLed and applianced restarted. Removing the crew removes its CA. The unit
side: tests/test_crew_tls.py."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
from pathlib import Path

from cryptography import x509

from appliance.credstore import CredentialStore, load_key
from appliance.demo_upstream import FakeServer
from tests.conftest import ROOT
from tests.daemon_support import REACH_TEST_HOSTS, Appliance, busybox_images

RULE = "plain.test read-only /repos/acme/**"
SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def _connect(gateway: str, port: int, host: str, target_port: int) -> socket.socket:
    """A CONNECT through the crew's gateway, its 200 read; the socket, at the tunnel's start."""
    sock = socket.create_connection((gateway, port), timeout=10)
    sock.sendall(
        f"CONNECT {host}:{target_port} HTTP/1.1\r\nHost: {host}:{target_port}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)  # byte by byte: nothing of the tunnel is read past the head
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _read_all(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def probe(gateway: str, port: str, host: str, target_port: str, bundle: str, request: str) -> None:
    """Run in the crew's network namespace (the gateway admits the crew's side only): one
    CONNECT, then TLS verified against `bundle` (or, for "", the request as it is); prints
    JSON {leaf: DER hex or null, answer: the reply's text}."""
    sock = _connect(gateway, int(port), host, int(target_port))
    leaf = None
    if bundle:
        context = ssl.create_default_context(cafile=bundle)
        sock = context.wrap_socket(sock, server_hostname=host)
        leaf = (sock.getpeercert(binary_form=True) or b"").hex()
    with sock:
        sock.sendall(request.encode())
        answer = _read_all(sock)
    print(json.dumps({"leaf": leaf, "answer": answer.decode("latin-1")}))


def _in_crew(infra_pid: int, *args: str) -> tuple[x509.Certificate | None, bytes]:
    done = subprocess.run(
        ["nsenter", "-t", str(infra_pid), "-n", sys.executable, "-c",
         "import sys; from tests.test_daemon_crew_tls import probe; probe(*sys.argv[1:])",
         *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    leaf = result["leaf"]
    cert = x509.load_der_x509_certificate(bytes.fromhex(leaf)) if leaf is not None else None
    return cert, result["answer"].encode("latin-1")


def _get(host: str, port: int, path: str, method: str = "GET") -> str:
    return f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"


def _check_tunnels(
    app: Appliance, pid: int, gateway: str, bundle: Path, ca: x509.Certificate
) -> None:
    through = (gateway, str(app.port))
    # A ruled host: terminated (the rules are applied inside: a DELETE is refused by the proxy).
    leaf, answer = _in_crew(
        pid, *through, "plain.test", str(app.plain_port), str(bundle),
        _get("plain.test", app.plain_port, "/repos/acme/x", "DELETE"),
    )  # fmt: skip
    assert leaf is not None and leaf.issuer == ca.subject
    assert answer.startswith(b"HTTP/1.1 403"), answer[:200]
    assert b"l7_method" in answer
    # A provider host with a configured key: terminated, served by the (fake) provider.
    leaf, answer = _in_crew(
        pid, *through, "api.anthropic.test", str(app.provider_port), str(bundle),
        _get("api.anthropic.test", app.provider_port, "/v1/models"),
    )  # fmt: skip
    assert leaf is not None and leaf.issuer == ca.subject
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    # An allowed host without rules or credential: an opaque tunnel (plain HTTP passes through
    # it to the host as it is; a terminated one would expect a TLS handshake).
    _, answer = _in_crew(
        pid, *through, "other.test", str(app.plain_port), "",
        _get("other.test", app.plain_port, "/opaque"),
    )  # fmt: skip
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_crew_ca_trust_and_terminated_tunnels(appliance: Appliance, plain_host: FakeServer) -> None:
    app = appliance
    app.infra_pool = 0
    app.write_config(*busybox_images())
    app.start()
    name = app.crew("tls")
    created = app.ctl(
        "crew", "create", name, *REACH_TEST_HOSTS,
        "--allow", "plain.test", "--allow", "other.test", "--rule", RULE,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    code, shown = app.ctl_json("crew", "show", name)
    assert code == 0
    gateway = shown["crew"]["gateway"]
    inspect = ["docker", "inspect", "-f", "{{.State.Pid}}", shown["crew"]["infra_id"]]
    pid = int(subprocess.run(inspect, capture_output=True, text=True, check=True).stdout)

    # The CA: its key sealed in the credential store, its certificate in the crew's files.
    store = CredentialStore(
        app.state_dir / "credentials.db", load_key(None, app.state_dir / "credentials.key")[0]
    )
    try:
        found = store.crew_ca(name)
        assert found is not None
        cert_pem, key = found
        with key:
            key_pem = key.reveal()
    finally:
        store.close()
    ca = x509.load_pem_x509_certificate(cert_pem)
    key_lines = [line for line in key_pem.decode().splitlines() if not line.startswith("-----")]
    assert key_lines

    # The crew's environment and files.
    env = app.ctl("run", name, "--", "env")
    assert env.returncode == 0, env.stderr
    variables = dict(line.split("=", 1) for line in env.stdout.splitlines() if "=" in line)
    for variable in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        assert variables[variable] == "/etc/ssl/certs/ca-certificates.crt"
    assert variables["NODE_EXTRA_CA_CERTS"] == "/etc/agent-appliance/crew-ca.pem"
    alone = app.ctl("run", name, "--", "cat", "/etc/agent-appliance/crew-ca.pem")
    assert alone.returncode == 0 and alone.stdout.encode() == cert_pem, alone.stderr
    bundle_text = app.ctl("run", name, "--", "cat", "/etc/ssl/certs/ca-certificates.crt")
    assert bundle_text.returncode == 0, bundle_text.stderr
    assert bundle_text.stdout.endswith(cert_pem.decode())
    if SYSTEM_BUNDLE.exists():
        assert bundle_text.stdout.startswith(SYSTEM_BUNDLE.read_text().rstrip("\n"))
    # Read-only: the agent cannot replace its trust.
    write = app.ctl("run", name, "--", "sh", "-c", "echo x >> /etc/agent-appliance/crew-ca.pem")
    assert write.returncode != 0
    bundle = app.tmp / "crew-bundle.pem"
    bundle.write_text(bundle_text.stdout)

    # The key: in no file the crew can read, not in its environment. (Each line searched for is
    # passed in two halves: the journal records the argv, and must not show the line either.)
    search = (
        'for d in /*; do case "$d" in /proc|/sys|/dev) ;; *) grep -rlsF "$1$2" "$d";; esac; '
        "done; true"
    )
    cert_line = cert_pem.decode().splitlines()[1]
    half = len(cert_line) // 2
    control = app.ctl(
        "run", name, "--", "sh", "-c", search, "sh", cert_line[:half], cert_line[half:]
    )
    # The search finds what is there (the certificate, in both files)
    assert "/etc/agent-appliance/crew-ca.pem" in control.stdout, control
    assert "/etc/ssl/certs/ca-certificates.crt" in control.stdout, control
    for line in (key_lines[0], key_lines[-1]):
        assert line not in env.stdout
        half = len(line) // 2
        found_in = app.ctl("run", name, "--", "sh", "-c", search, "sh", line[:half], line[half:])
        assert found_in.returncode == 0, found_in.stderr
        assert found_in.stdout.strip() == "", found_in.stdout

    _check_tunnels(app, pid, gateway, bundle, ca)

    # A worker SIGKILLed: its successor is sent the crew and its leaves again.
    app.kill_worker(0)
    for _ in range(4):  # whichever worker accepts, each holds the leaves
        _check_tunnels(app, pid, gateway, bundle, ca)

    # applianced restarted: the crew is adopted with the same CA (reloaded from the store).
    app.stop()
    app.start()
    _check_tunnels(app, pid, gateway, bundle, ca)

    # Nowhere in applianced's logs, the journal (as shown and as stored) or the workers' config.
    journal = app.ctl("--json", "journal", "tail", "-n", "1000")
    assert journal.returncode == 0, journal.stderr
    stored = [
        app.state_dir / "journal.db",
        app.state_dir / "journal.db-wal",
        app.state_dir / "proxy.json",
        *app.logs,
    ]
    texts = [journal.stdout, *(p.read_bytes().decode("latin-1") for p in stored if p.exists())]
    for line in key_lines:
        for text in texts:
            assert line not in text

    # Removed with the crew: the sealed key and the files.
    removed = app.ctl("crew", "rm", name)
    assert removed.returncode == 0, removed.stderr
    store = CredentialStore(
        app.state_dir / "credentials.db", load_key(None, app.state_dir / "credentials.key")[0]
    )
    try:
        assert store.crew_ca(name) is None
    finally:
        store.close()
    assert not (app.state_dir / "crew-tls" / name).exists()
