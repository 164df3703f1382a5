"""Issue 5's acceptance tests: crews as an operator makes them, on runc and on runsc.

Everything is real: an applianced process (tests/daemon_support.py: its own state directory,
admin socket, address pool, nftables table, interface and crew-name prefixes), the Docker engine,
the images of images/ (the agent image with curl and the native Claude Code program), the proxy
child, appliancectl as the operator types it.

The world the crews live in::

    crew netns (runc / runsc)         host                           test namespace "apx-e2e-*"
    agent ── veth ─────────── gateway:proxy_port ── proxy ── e2e*h ══ e2e*n ── fake Anthropic
                                 (nft: nothing else)         100.92.N.1/30   100.92.N.2:443 (TLS)

The fake Anthropic API (tests/fake_anthropic.py, TLS with a test CA) lives in a namespace this
module creates; the host routes to it through a veth, and that namespace has a route back to
the crews' pool. So a direct packet from a crew to the fake could be forwarded by the host (IP
forwarding is on here: Docker turns it on). The appliance's nftables rules drop it in
prerouting; Docker's own iptables FORWARD policy (DROP) would too, which is why the tests also
require the crew chain's drop counter to move: that proves it was our rules. (Checked by hand
with an `accept` inserted ahead of them: the listener on the gateway is reached and the test
fails.) The proxy reaches the fake through its split-horizon table (`api.anthropic.test` and
`api.openai.test` -> 100.92.N.2) and an `ssrf_allow` of exactly that /30, verifying TLS against
the test CA. Both names are provider hosts the appliance has a key for, so each crew holds a leaf
for them from its own CA and a CONNECT to them is terminated (section 3).

Nothing is ever sent to an address outside the machine: no test dials a public address (the
issue suggested 1.1.1.1 as a "the internet is unreachable" probe; a crew's only route is the
veth to the host, whose nft rules would drop it, but if they did not, the packet would leave the
machine, which the project's network rule forbids; the fake's namespace is the same probe with
nothing at stake).

One daemon and two crews (runc, runsc) for the whole module; the restart test runs last and
ends with nothing left behind.
"""

from __future__ import annotations

import functools
import json
import random
import re
import signal
import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import trustme

from appliance.runtime.base import agent_keys
from proxycore.protocol.placeholders import PLACEHOLDER_PREFIX
from tests.conftest import AGENT_DUMMY_KEY, REAL_KEYS, needs
from tests.daemon_support import Appliance, needs_root_and_docker, new_appliance, remove_volumes
from tests.fake_anthropic import REPLY, FakeAnthropic, Request, bind_listener

pytestmark = pytest.mark.docker

RUNTIMES = ["runc", "runsc"]
PROVIDER_HOST = "api.anthropic.test"
# A second provider host with a key (so each crew holds a leaf for it: terminated), served by the
# same fake, and an allowed host that is nobody's provider.
OPENAI_HOST = "api.openai.test"
OTHER_HOST = "elsewhere.test"
# Names an environment variable holding a credential would likely have.
CREDENTIAL_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)


# --- the test's own namespace, where the fake provider lives -------------------------------------


def _routed(prefix: str) -> bool:
    out = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True
    ).stdout
    return prefix in out


@dataclass
class UpstreamNamespace:
    """A named namespace joined to the host by a veth (a /30 from 100.92.0.0/16), with a route
    back to the crews' pool so that only nftables stands between a crew and it."""

    name: str
    host_if: str
    host_address: str
    address: str
    subnet: str

    @classmethod
    def create(cls, tag: str, crew_pool: str) -> UpstreamNamespace:
        for _ in range(20):
            third = random.randrange(256)
            if not _routed(f"100.92.{third}."):
                break
        else:
            pytest.skip("no free /30 for the test namespace")
        made = cls(
            name=f"apx-e2e-{tag}-{uuid.uuid4().hex[:4]}",
            host_if=f"e2e{tag}h",
            host_address=f"100.92.{third}.1",
            address=f"100.92.{third}.2",
            subnet=f"100.92.{third}.0/30",
        )
        inner_if = f"e2e{tag}n"
        try:
            for command in [
                ["ip", "netns", "add", made.name],
                ["ip", "link", "add", made.host_if, "type", "veth", "peer", "name", inner_if],
                ["ip", "link", "set", inner_if, "netns", made.name],
                ["ip", "addr", "add", f"{made.host_address}/30", "dev", made.host_if],
                ["ip", "link", "set", made.host_if, "up"],
                ["ip", "-n", made.name, "link", "set", "lo", "up"],
                ["ip", "-n", made.name, "addr", "add", f"{made.address}/30", "dev", inner_if],
                ["ip", "-n", made.name, "link", "set", inner_if, "up"],
                # The way back to the crews: without it a crew's SYN could arrive but never be
                # answered, and "the fake saw no connection" would prove nothing about nft.
                ["ip", "-n", made.name, "route", "add", crew_pool, "via", made.host_address],
            ]:
                subprocess.run(command, check=True, capture_output=True)
        except subprocess.CalledProcessError as exc:
            made.delete()
            raise RuntimeError(f"{exc.cmd}: {exc.stderr.decode(errors='replace')}") from None
        return made

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


# --- the module's world: one daemon, one fake, two crews -----------------------------------------


@dataclass
class World:
    app: Appliance
    upstream: UpstreamNamespace
    fake: FakeAnthropic
    ca_pem: str
    crews: dict[str, str] = field(default_factory=dict)  # runtime -> crew name
    gateways: dict[str, str] = field(default_factory=dict)  # runtime -> gateway
    container_ids: dict[str, list[str]] = field(default_factory=dict)  # crew -> ids

    def run(
        self, runtime: str, *argv: str, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return self.app.ctl(
            "run", "--timeout", str(timeout), self.crews[runtime], "--", *argv, timeout=timeout + 30
        )


def _engine_runtimes() -> set[str]:
    out = subprocess.run(
        ["docker", "info", "--format", "{{json .Runtimes}}"], capture_output=True, text=True
    )
    return set(json.loads(out.stdout or "{}"))


def _write_config(app: Appliance, agent: str, infra: str, up: UpstreamNamespace) -> None:
    app.config.write_text(
        f"""
[daemon]
state_dir = "{app.state_dir}"
admin_socket = "{app.socket}"
proxy_port = {app.port}
instance = "{app.configured_instance}"

[images]
agent = "{agent}"
infra = "{infra}"

[crews]
name_prefix = "{app.name_prefix}"

[net]
pool = "{app.pool}"
table = "{app.config_table}"
ifname_prefix = "{app.config_prefix}"

[proxy.providers.anthropic]
base_url = "https://{PROVIDER_HOST}"
credential_env = "TEST_ANTHROPIC_KEY"

[proxy.providers.openai]
base_url = "https://{OPENAI_HOST}"
credential_env = "TEST_OPENAI_KEY"

[proxy.upstream]
ca_file = "{app.ca_file}"
ssrf_allow = ["{up.subnet}"]
resolve = {{ "{PROVIDER_HOST}" = "{up.address}", "{OPENAI_HOST}" = "{up.address}" }}
"""
    )


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, ca: trustme.CA, ca_file: str
) -> Iterator[World]:
    needs_root_and_docker()
    from images.build import ensure_images

    # Built once and cached by recipe hash (images/README.md): about 0.1 s when present, over a
    # minute from nothing. The acceptance tests need the real agent image, so no skip here.
    images = ensure_images()
    app = new_appliance(tmp_path_factory.mktemp("crew-e2e"), 443, 0, ca_file)
    # Private tags for this module's daemon: other test sessions on the same engine build,
    # untag and prune the shared tags (tests/test_images.py), and an image that still has one
    # of our tags survives that.
    agent, infra = (
        f"{image.split(':')[0]}:e2e-{app.tag}" for image in (images.agent, images.infra)
    )
    subprocess.run(["docker", "tag", images.agent, agent], check=True)
    subprocess.run(["docker", "tag", images.infra, infra], check=True)
    upstream = UpstreamNamespace.create(app.tag, app.pool)
    try:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(PROVIDER_HOST, OPENAI_HOST).configure_cert(tls)
        listener = bind_listener(upstream.address, 443, netns_path=upstream.path)
        fake = FakeAnthropic(listener, tls)
        try:
            _write_config(app, agent, infra, upstream)
            app.start()
            world = World(app, upstream, fake, ca.cert_pem.bytes().decode())
            available = _engine_runtimes()
            for runtime in RUNTIMES:
                if runtime not in available:
                    continue
                name = app.crew(runtime)
                # 1 GiB: the Claude Code program alone is a 381 MB executable.
                code, created = app.ctl_json(
                    "crew", "create", name, "--mode", "restricted", "--runtime", runtime,
                    "--allow", PROVIDER_HOST, "--allow", OPENAI_HOST, "--allow", OTHER_HOST,
                    "--memory", "1g",
                )  # fmt: skip
                assert code == 0, (created, app.log_text())
                crew = created["crew"]
                assert crew["phase"] == "ready" and crew["runtime"] == runtime
                world.crews[runtime] = name
                world.gateways[runtime] = crew["gateway"]
                world.container_ids[name] = [c["container_id"] for c in crew["containers"]]
            yield world
        finally:
            fake.close()
            app.cleanup()
            remove_volumes(app.name_prefix)
    finally:
        upstream.delete()
        subprocess.run(["docker", "rmi", agent, infra], capture_output=True)


@pytest.fixture(params=RUNTIMES)
def runtime(request: pytest.FixtureRequest, world: World) -> str:
    name: str = request.param
    if name not in world.crews:
        # runsc is gVisor; runc comes with the engine.
        what = "gVisor" if name == "runsc" else "Docker"
        pytest.skip(needs(what, f"the engine has no runtime {name}"))
    return name


# --- helpers -------------------------------------------------------------------------------------


def _crew_drops(app: Appliance) -> int:
    """Packets the table's crew chains dropped (their final `counter drop`)."""
    out = subprocess.run(
        ["nft", "list", "table", "inet", app.table], capture_output=True, text=True, check=True
    ).stdout
    total = 0
    chain = ""
    for line in out.splitlines():
        words = line.split()
        if words[:1] == ["chain"]:
            chain = words[1]
        elif chain.startswith("crew_") and "drop" in words and "packets" in words:
            total += int(words[words.index("packets") + 1])
    return total


class HostListener:
    """A TCP listener on every host address, the crew's gateway included: reaching it from a
    crew would be a way around the proxy."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(8)
        self.port = int(self.sock.getsockname()[1])
        self.hits = 0
        threading.Thread(target=self._accept, daemon=True).start()

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


def _containers_of(*labels: str) -> list[str]:
    """Ids of the containers with one of these crew labels (a crew's name, the pool slot its
    infra came from: Appliance.crew_labels)."""
    found: list[str] = []
    for label in labels:
        out = subprocess.run(
            [
                "docker",
                "ps",
                "-a",
                "--no-trunc",
                "-q",
                "--filter",
                f"label=io.agent-appliance.crew={label}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        found += out.split()
    return found


def _runtime_processes_of(container_ids: list[str]) -> list[str]:
    """runsc sandbox/gofer processes and shims (read from /proc) that name one of these ids."""
    from appliance.runtime.docker import runtime_processes

    wanted = set(container_ids)
    return [
        f"{p.pid} {p.kind} {p.cmdline}" for p in runtime_processes() if p.container_id in wanted
    ]


# --- 1. a restricted crew, as the agent sees it ---------------------------------------------------


def test_agent_is_unprivileged_and_confined(world: World, runtime: str) -> None:
    # /var/tmp is on the image's root filesystem and world-writable (1777): a write there can
    # only fail because the root is read-only (a write to / would fail for uid 1001 anyway,
    # and gVisor reports that permission check first). Python's stat, not coreutils':
    # this gVisor refuses statx (which `stat` and `ls` use) with EINVAL.
    done = world.run(
        runtime,
        "sh",
        "-c",
        "id -u; id -g; grep '^CapEff:' /proc/self/status; grep ' / ' /proc/self/mounts;"
        " python3 -c 'import os; print(oct(os.stat(\"/var/tmp\").st_mode & 0o7777))';"
        " touch /var/tmp/probe; echo touch=$?",
    )
    lines = done.stdout.splitlines()
    assert lines[:2] == ["1001", "1001"], done
    assert re.fullmatch(r"CapEff:\s+0+", lines[2]), done
    root_options = lines[3].split()[3].split(",")
    assert "ro" in root_options, done
    assert lines[4:] == ["0o1777", "touch=1"], done
    assert "Read-only file system" in done.stderr, done


def test_environment_holds_the_proxy_and_no_credential(world: World, runtime: str) -> None:
    done = world.run(runtime, "env")
    assert done.returncode == 0, done
    env = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    base = f"http://{world.gateways[runtime]}:{world.app.port}"
    assert env["HTTPS_PROXY"] == base and env["HTTP_PROXY"] == base
    assert env["ANTHROPIC_BASE_URL"] == f"{base}/anthropic"
    # Only the crew's placeholders the agent CLIs need to start (the proxy replaces what they
    # send).
    credential_like = {name: value for name, value in env.items() if CREDENTIAL_NAME.search(name)}
    assert credential_like == agent_keys(world.crews[runtime])
    for key in REAL_KEYS.values():
        assert key not in done.stdout


def test_provider_key_is_injected_over_verified_tls(world: World, runtime: str) -> None:
    world.fake.clear()
    body = json.dumps(
        {"model": "claude-e2e", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    )
    done = world.run(
        runtime,
        "sh",
        "-c",
        'curl -sS --max-time 30 -X POST "$ANTHROPIC_BASE_URL/v1/messages"'
        f" -H 'content-type: application/json' -H 'x-api-key: {AGENT_DUMMY_KEY}'"
        f" -H 'authorization: Bearer {AGENT_DUMMY_KEY}' --data-binary '{body}'",
    )
    assert done.returncode == 0, (done, world.app.log_text())
    assert json.loads(done.stdout)["content"][0]["text"] == REPLY
    (received,) = world.fake.messages()
    # The appliance's key, exactly once; nothing the agent sent as a credential.
    assert received.all("x-api-key") == [REAL_KEYS["anthropic"]]
    assert received.all("authorization") == []
    assert AGENT_DUMMY_KEY.encode() not in received.body
    assert received.all("host") == [PROVIDER_HOST]


def test_denied_host_gets_the_proxys_readable_refusal(world: World, runtime: str) -> None:
    # Plain HTTP through HTTP_PROXY: the policy decides on the name, before any resolution.
    done = world.run(
        runtime, "curl", "-sS", "--max-time", "20", "-w", "\n%{http_code}", "http://denied.test/x"
    )
    body, status = done.stdout.rsplit("\n", 1)
    assert status == "403", done
    refusal = json.loads(body)
    assert refusal["rule"] == "not_in_allowlist" and refusal["host"] == "denied.test"
    assert refusal["crew"] == world.crews[runtime] and refusal["mode"] == "restricted"
    # HTTPS: the CONNECT is refused the same way, and curl says so.
    tunnel = world.run(runtime, "curl", "-sS", "--max-time", "20", "https://denied.test/")
    assert tunnel.returncode == 56 and "403" in tunnel.stderr, tunnel


def test_no_way_around_the_proxy(world: World, runtime: str) -> None:
    """Direct connections (curl --noproxy '*'): to the fake provider's own address on 443 and 80
    (captured: the kernel sends them to the proxy, which refuses them, a TLS alert for the
    first since it names no host, a 403 for the second since an address is not on the
    allowlist), and to a listener on every host address through the gateway on a port neither
    the proxy's nor captured (dropped). The targets see nothing, the proxy journals the two
    refusals, and the crew's nft drop counter moves for the third."""
    app = world.app
    crew = world.crews[runtime]
    gateway = world.gateways[runtime]
    listener = HostListener()
    before_drops = _crew_drops(app)
    before_denied = _denied_rules(app, crew)
    try:
        targets = [
            f"https://{world.upstream.address}/",
            f"http://{world.upstream.address}:80/",
            f"http://{gateway}:{listener.port}/",
        ]
        script = "".join(
            f"curl --noproxy '*' -fsS --connect-timeout 3 -o /dev/null {t}; echo rc=$?; "
            for t in targets
        )
        done = world.run(runtime, "sh", "-c", script)
        codes = [line for line in done.stdout.splitlines() if line.startswith("rc=")]
        # 35: the TLS handshake failed (the proxy's access_denied alert); 22: an HTTP error
        # (the proxy's 403); 28: connect timed out (dropped, nothing answers, not even an RST).
        assert codes == ["rc=35", "rc=22", "rc=28"], done
        assert listener.hits == 0
        # The proxy's connections come from the host end of the test's veth; a crew's would come
        # from its own address (nothing is NATed).
        assert set(world.fake.peers) <= {world.upstream.host_address}, world.fake.peers
        assert _crew_drops(app) >= before_drops + 1, "nft did not count the drop"
        rules: list[str] = []
        for _ in range(50):  # the proxy's batches reach the journal a moment later
            rules = sorted(_denied_rules(app, crew)[len(before_denied) :])
            if len(rules) >= 2:
                break
            time.sleep(0.1)
        assert rules == ["captured_unreadable", "not_in_allowlist"], rules
    finally:
        listener.close()
    # The same address is reachable from the host, so the test above could have failed.
    with socket.create_connection((world.upstream.address, 443), timeout=5):
        pass


def test_a_tool_that_ignores_the_proxy_is_captured_and_injected(world: World, runtime: str) -> None:
    """curl with no proxy at all (--noproxy '*'), told the provider's address as a tool with its
    own resolver would be: the kernel captures its connection to port 443, the proxy reads the
    server name from its ClientHello, terminates it with the crew's leaf (the crew trusts its
    CA) and sends the request on with the appliance's key, as through HTTPS_PROXY."""
    crew = world.crews[runtime]
    world.fake.clear()
    before = len(_journal(world.app, crew, "tunnel.opened"))
    done = world.run(
        runtime,
        "sh",
        "-c",
        f"curl --noproxy '*' -fsS --max-time 30 --resolve {PROVIDER_HOST}:443:"
        f"{world.upstream.address} -H 'x-api-key: {AGENT_DUMMY_KEY}' "
        f"https://{PROVIDER_HOST}/v1/echo",
    )
    assert done.returncode == 0, (done, world.fake.log(), world.app.log_text()[-3000:])
    (echoed,) = [r for r in world.fake.requests if r.route == "/v1/echo"]
    _assert_injected(echoed, crew)
    assert REAL_KEYS["anthropic"] not in done.stdout
    assert set(world.fake.peers) <= {world.upstream.host_address}, world.fake.peers
    opened = _journal(world.app, crew, "tunnel.opened", before + 1)[before:]
    assert [(entry["host"], entry["port"]) for entry in opened] == [(PROVIDER_HOST, 443)], opened


# A TXT query built by hand (the agent image has python3, no dig): prints the answer's rcode.
_TXT_QUERY = """
import socket, struct
name = b"".join(bytes([len(p)]) + p for p in b"%s".split(b".")) + b"\\0"
query = struct.pack(">HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + name + struct.pack(">HH", 16, 1)
server = open("/etc/resolv.conf").read().split("nameserver", 1)[1].split()[0]
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.settimeout(5)
sock.sendto(query, (server, 53))
print("rcode", sock.recv(512)[3] & 0x0F)
"""


def test_crew_resolves_through_its_own_dns(world: World, runtime: str) -> None:
    """The crew's /etc/resolv.conf names its gateway, where the proxy workers serve its DNS
    responder: an allowed name resolves to the address the proxy's resolve table has (so a tool
    with no proxy settings reaches it, captured and injected), a name not allowed is NXDOMAIN, a
    TXT query is REFUSED, and the refusals are journaled as dns.refused."""
    crew = world.crews[runtime]
    gateway = world.gateways[runtime]
    before = len(_journal(world.app, crew, "dns.refused"))
    conf = world.run(runtime, "cat", "/etc/resolv.conf")
    assert conf.stdout.split() == ["nameserver", gateway, "options", "ndots:1", "timeout:2",
                                   "attempts:2"], conf  # fmt: skip
    allowed = world.run(runtime, "getent", "hosts", PROVIDER_HOST)
    assert allowed.returncode == 0 and allowed.stdout.split()[0] == world.upstream.address, (
        allowed, world.app.log_text()[-3000:],
    )  # fmt: skip
    denied = world.run(runtime, "getent", "hosts", "denied.test")
    assert denied.returncode == 2 and not denied.stdout, denied  # 2: not found (NXDOMAIN)
    txt = world.run(runtime, "python3", "-c", _TXT_QUERY % PROVIDER_HOST)
    assert txt.stdout.split() == ["rcode", "5"], txt  # REFUSED
    # A tool that ignores the proxy now finds the provider by name, and is captured.
    world.fake.clear()
    done = world.run(
        runtime, "sh", "-c",
        f"curl --noproxy '*' -fsS --max-time 30 -H 'x-api-key: {AGENT_DUMMY_KEY}' "
        f"https://{PROVIDER_HOST}/v1/echo",
    )  # fmt: skip
    assert done.returncode == 0, (done, world.app.log_text()[-3000:])
    (echoed,) = [r for r in world.fake.requests if r.route == "/v1/echo"]
    _assert_injected(echoed, crew)
    queries: list[tuple[str, str, str]] = []
    for _ in range(50):
        entries = _journal(world.app, crew, "dns.refused")[before:]
        # [ts, name, qtype, rule, rcode, count]
        queries = [(q[1], q[2], q[4]) for entry in entries for q in entry["queries"]]
        if {("denied.test", "A", "NXDOMAIN"), (PROVIDER_HOST, "TXT", "REFUSED")} <= set(queries):
            break
        time.sleep(0.1)
    assert ("denied.test", "A", "NXDOMAIN") in queries, queries
    assert (PROVIDER_HOST, "TXT", "REFUSED") in queries, queries


# --- 2. the real Claude Code CLI -----------------------------------------------------------------


def test_claude_code_completes_through_the_proxy(world: World, runtime: str) -> None:
    """`claude -p` (the native program of the agent image, /usr/local/bin/claude) with only what
    the daemon put in the agent's environment (ANTHROPIC_BASE_URL = the crew's gateway, the
    placeholder key it needs to start, telemetry off): the streamed reply is printed, and the
    fake saw the operator's key, never the placeholder. (With telemetry off, 2.1.330 sends
    exactly one POST /v1/messages?beta=true; anything else would be refused by the policy.)"""
    world.fake.clear()
    started = time.monotonic()
    done = world.run(
        runtime,
        "env",
        "-C",
        "/home/agent",
        "claude",
        "-p",
        "say hi",
        timeout=120,
    )
    elapsed = time.monotonic() - started
    asked = world.fake.log()
    assert done.returncode == 0, (done, asked, elapsed)
    assert REPLY in done.stdout, (done, asked)
    messages = world.fake.messages()
    assert messages, asked
    for request in messages:
        assert request.all("x-api-key") == [REAL_KEYS["anthropic"]], asked
        assert PLACEHOLDER_PREFIX not in request.body
        assert json.loads(request.body).get("stream") is True  # SSE, as the real client asks
    for request in world.fake.requests:
        assert PLACEHOLDER_PREFIX.decode() not in json.dumps(request.headers)


# --- 3. real clients through HTTPS_PROXY to the provider's HTTPS URL: terminated ----------------
#
# The agent's environment points the CLIs at the proxy's reverse route (section 1, 2); a client
# given the provider's own URL instead goes through HTTPS_PROXY: CONNECT api.anthropic.test:443,
# then its own TLS. Each crew holds a leaf for that host (a provider host the appliance has a key
# for: docs/daemon.md "Crew CAs"), so the proxy terminates the tunnel and injects, checks and
# scrubs inside it. The clients trust the leaf through what applianced installed: the system
# bundle's path (curl, Python, OpenSSL), NODE_EXTRA_CA_CERTS (Claude Code).

PROVIDER_URL = f"https://{PROVIDER_HOST}:443"


def _denied_rules(app: Appliance, crew: str) -> list[str]:
    """The rule of every request the proxy denied the crew, oldest first (`proxy.deny` entries
    batch them: docs/journal.md)."""
    return [
        str(request[5])
        for entry in _journal(app, crew, "proxy.deny")
        for request in entry["requests"]
    ]


def _journal(app: Appliance, crew: str, kind: str, wanted: int = 0) -> list[dict[str, Any]]:
    """The payloads of the crew's journal entries of this type, oldest first. The proxy's events
    reach the journal through applianced a moment after the response: this waits (5 s at most)
    until there are `wanted`."""
    payloads: list[dict[str, Any]] = []
    for _ in range(50):
        done = app.ctl("--json", "journal", "tail", "-n", "500", "--crew", crew, "--type", kind)
        assert done.returncode == 0, done.stderr
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        payloads = [json.loads(str(row["payload"])) for row in rows]
        if len(payloads) >= wanted:
            break
        time.sleep(0.1)
    return payloads


def _denials(app: Appliance, crew: str, wanted: int = 0) -> list[tuple[str, str]]:
    """(host, rule) of every request the proxy denied for the crew, oldest first: `proxy.deny`
    entries hold a batch of requests each (docs/journal.md)."""
    found: list[tuple[str, str]] = []
    for _ in range(50):
        entries = _journal(app, crew, "proxy.deny")
        # [ts, route, method, host, port, rule, status]
        found = [(r[3], r[5]) for entry in entries for r in entry["requests"]]
        if len(found) >= wanted:
            break
        time.sleep(0.1)
    return found


def _assert_injected(request: Request, crew: str) -> None:
    """The operator's key, exactly once; nothing of the crew's own (its placeholders) anywhere."""
    assert request.all("x-api-key") == [REAL_KEYS["anthropic"]], request
    assert request.all("authorization") == [], request
    assert PLACEHOLDER_PREFIX not in request.body
    assert PLACEHOLDER_PREFIX.decode() not in json.dumps(request.headers), request
    assert crew not in json.dumps(request.headers), request


def test_clients_through_https_proxy_are_terminated_and_injected(
    world: World, runtime: str
) -> None:
    """curl and Python's own urllib (the agent image has no httpx or SDKs: images/README.md),
    each sending the placeholder as its key, to the provider's HTTPS URL through HTTPS_PROXY:
    they verify the proxy's leaf under the crew CA, the fake sees the appliance's key and never
    the placeholder, and a response echoing the key comes back with it scrubbed."""
    crew = world.crews[runtime]
    world.fake.clear()
    body = json.dumps(
        {"model": "claude-e2e", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    )
    python = (
        "import json, os, urllib.request\n"
        "request = urllib.request.Request(os.environ['ANTHROPIC_BASE_URL'] + '/v1/messages',"
        " data=os.environ['BODY'].encode(), method='POST', headers={"
        "'content-type': 'application/json', 'x-api-key': os.environ['ANTHROPIC_API_KEY']})\n"
        "print(json.load(urllib.request.urlopen(request, timeout=30))['content'][0]['text'])\n"
    )
    script = (
        # Nothing in the crew's environment names the host: the client's own proxy handling.
        'case "$HTTPS_PROXY" in http://*) ;; *) exit 99;; esac; '
        'curl -sS --max-time 30 -X POST "$ANTHROPIC_BASE_URL/v1/messages"'
        ' -H "content-type: application/json" -H "x-api-key: $ANTHROPIC_API_KEY"'
        ' --data-binary "$BODY"; echo; echo curl=$?; '
        'python3 -c "$1"; echo python=$?; '
        'curl -sS --max-time 30 -H "x-api-key: $ANTHROPIC_API_KEY" "$ANTHROPIC_BASE_URL/v1/echo";'
        " echo; echo echo=$?"
    )
    done = world.run(
        runtime, "env", f"ANTHROPIC_BASE_URL={PROVIDER_URL}", f"BODY={body}",
        "sh", "-c", script, "sh", python,
    )  # fmt: skip
    assert done.returncode == 0, (done, world.fake.log(), world.app.log_text()[-3000:])
    lines = done.stdout.splitlines()
    assert json.loads(lines[0])["content"][0]["text"] == REPLY, done
    assert lines[1:4] == ["curl=0", REPLY, "python=0"], done
    assert lines[-1] == "echo=0", done
    messages = world.fake.messages()
    assert len(messages) == 2, world.fake.log()
    for request in messages:
        _assert_injected(request, crew)
        assert request.all("host") in ([PROVIDER_HOST], [f"{PROVIDER_HOST}:443"]), request
    (echoed,) = [r for r in world.fake.requests if r.route == "/v1/echo"]
    _assert_injected(echoed, crew)
    # The fake echoed the appliance's key; the scrubber took it out of the terminated reply.
    echo = json.loads(lines[-2])["headers"]
    key_field = {name.lower(): value for name, value in echo.items()}["x-api-key"]
    assert key_field != REAL_KEYS["anthropic"] and REAL_KEYS["anthropic"] not in done.stdout
    for key in REAL_KEYS.values():
        for start in range(0, len(key) - 8, 4):
            assert key[start : start + 8] not in done.stdout, (key, done.stdout)
    # The proxy, not the crew, dialled the fake.
    assert set(world.fake.peers) <= {world.upstream.host_address}, world.fake.peers


def test_claude_code_through_https_proxy_to_the_providers_url(world: World, runtime: str) -> None:
    """`claude -p` as in section 2, but with ANTHROPIC_BASE_URL = the provider's own HTTPS URL:
    Claude Code goes through HTTPS_PROXY, trusts the proxy's leaf through NODE_EXTRA_CA_CERTS,
    and the fake sees the appliance's key."""
    crew = world.crews[runtime]
    world.fake.clear()
    done = world.run(
        runtime, "env", "-C", "/home/agent", f"ANTHROPIC_BASE_URL={PROVIDER_URL}",
        "claude", "-p", "say hi", timeout=120,
    )  # fmt: skip
    asked = world.fake.log()
    assert done.returncode == 0, (done, asked, world.app.log_text()[-3000:])
    assert REPLY in done.stdout, (done, asked)
    messages = world.fake.messages()
    assert messages, asked
    for request in messages:
        _assert_injected(request, crew)
        assert json.loads(request.body).get("stream") is True
    for request in world.fake.requests:
        assert PLACEHOLDER_PREFIX.decode() not in json.dumps(request.headers)


SDK_DIR = "/home/agent/.e2e-sdks"


@functools.cache
def _sdk_tarball() -> bytes:
    """httpx, the anthropic and openai SDKs and what they import, from this test run's own
    environment (they are test dependencies: pyproject.toml), as a tar.gz for SDK_DIR. The agent
    image holds no Python package beyond the standard library, and a test crew's allowlist has
    no package index: this is what `pip install --target` would have put there.

    The pure-Python packages go in one zip (sdk.zip, imported from the zip): the SDKs are
    thousands of small files, and a file created under gVisor costs a round trip to its gofer
    (unpacked one by one, they took 16 s under runsc). Only what zipimport cannot import is
    unpacked as files."""
    import importlib.metadata
    import io
    import tarfile
    import zipfile

    from packaging.requirements import Requirement

    dists: dict[str, importlib.metadata.Distribution] = {}
    todo = ["httpx", "anthropic", "openai"]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in dists:
            continue
        dists[key] = dist = importlib.metadata.distribution(name)
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    # Not the scripts in bin/ nor byte code (a zip's modules are compiled on import).
    files = [
        (dist, file)
        for dist in dists.values()
        for file in dist.files or []
        if file.parts[0] != ".." and "__pycache__" not in file.parts
    ]
    native = {file.parts[0] for _, file in files if file.suffix == ".so"}
    zipped_files = [(dist, file) for dist, file in files if file.parts[0] not in native]
    # zipimport finds no namespace package (a directory of modules without __init__.py:
    # opentelemetry, anthropic._decoders): an empty one makes each a plain package.
    names = {str(file) for _, file in zipped_files}
    bare = {
        f"{directory}/__init__.py"
        for _, file in zipped_files
        if file.suffix == ".py"
        for directory in file.parents
        if directory.parts
    } - names
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as zipped:
        for dist, file in zipped_files:
            zipped.write(str(dist.locate_file(file)), str(file))
        for name in sorted(bare):
            zipped.writestr(name, b"")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("sdk.zip")
        info.size, info.mode = len(archive.getvalue()), 0o644
        tar.addfile(info, io.BytesIO(archive.getvalue()))
        for dist, file in files:
            if file.parts[0] in native:
                tar.add(str(dist.locate_file(file)), arcname=str(file), recursive=False)
    return out.getvalue()


SDK_SCRIPT = """
import os, sys
import anthropic, httpx, openai

messages = [{"role": "user", "content": "hi"}]
body = {"model": "claude-e2e", "max_tokens": 16, "messages": messages}
key = {"x-api-key": os.environ["ANTHROPIC_API_KEY"]}
url = os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages"
print("httpx", httpx.post(url, json=body, headers=key, timeout=30).json()["content"][0]["text"])
# Key and base URL from the environment, as the SDKs take them by default.
reply = anthropic.Anthropic().messages.create(model="claude-e2e", max_tokens=16, messages=messages)
print("anthropic", reply.content[0].text)
chat = openai.OpenAI().chat.completions.create(model="gpt-e2e", messages=messages)
print("openai", chat.choices[0].message.content)
"""


def test_python_sdks_through_https_proxy(world: World, runtime: str) -> None:
    """httpx and the anthropic and openai SDKs (the project's own test dependencies, unpacked
    into the crew's tmpfs) at the providers' HTTPS URLs through HTTPS_PROXY: each trusts the
    proxy's leaf through the crew's trust, and each provider gets its own key injected."""
    import sys

    crew = world.crews[runtime]
    version = world.run(runtime, "python3", "-c", "import sys; print(sys.version_info[:2])")
    if version.stdout.strip() != str(sys.version_info[:2]):
        # pydantic-core and jiter are compiled for this run's Python.
        pytest.skip(f"the crew's Python {version.stdout.strip()} is not {sys.version_info[:2]}")
    # Into HOME, not /tmp: the crew's /tmp is noexec, and pydantic-core and jiter are shared
    # objects (runc refuses to map them from there).
    unpack = [
        *world.app.ctl_argv(), "run", "-i", "--timeout", "60", crew, "--",
        "sh", "-c", f"mkdir -p {SDK_DIR} && tar -xzf - -C {SDK_DIR}",
    ]  # fmt: skip
    try:
        done_unpack = subprocess.run(unpack, input=_sdk_tarball(), capture_output=True, timeout=90)
        assert done_unpack.returncode == 0, done_unpack
        world.fake.clear()
        done = world.run(
            runtime,
            "env",
            f"PYTHONPATH={SDK_DIR}:{SDK_DIR}/sdk.zip",
            f"ANTHROPIC_BASE_URL={PROVIDER_URL}",
            f"OPENAI_BASE_URL=https://{OPENAI_HOST}:443/v1",
            "python3",
            "-c",
            SDK_SCRIPT,
            timeout=90,
        )
    finally:
        world.run(runtime, "rm", "-rf", SDK_DIR)
    assert done.returncode == 0, (done, world.fake.log(), world.app.log_text()[-3000:])
    expected = [f"{sdk} {REPLY}" for sdk in ("httpx", "anthropic", "openai")]
    assert done.stdout.splitlines() == expected, done
    anthropic_requests = world.fake.messages()
    assert len(anthropic_requests) == 2, world.fake.log()
    for request in anthropic_requests:
        _assert_injected(request, crew)
    (chat,) = [r for r in world.fake.requests if r.route == "/v1/chat/completions"]
    assert chat.all("authorization") == [f"Bearer {REAL_KEYS['openai']}"], chat
    assert chat.all("x-api-key") == [] and chat.all("host")[0].startswith(OPENAI_HOST), chat
    assert PLACEHOLDER_PREFIX.decode() not in json.dumps(chat.headers), chat


def test_placeholder_to_another_host_is_refused(world: World, runtime: str) -> None:
    """The Anthropic placeholder sent where it does not belong: to an allowed host that is no
    provider, over plain HTTP through HTTP_PROXY; and through HTTPS_PROXY to a terminated host
    that is another provider's (the crew holds a leaf for it, so the proxy reads the request).
    Both refused before anything is dialled, and journaled naming the provider."""
    crew = world.crews[runtime]
    world.fake.clear()
    before = len(_denials(world.app, crew))
    script = (
        'curl -sS --max-time 20 -w "\n%{http_code}\n" -H "x-api-key: $ANTHROPIC_API_KEY"'
        f" http://{OTHER_HOST}/collect; "
        'curl -sS --max-time 20 -w "\n%{http_code}\n" -H "x-api-key: $ANTHROPIC_API_KEY"'
        f' -H "content-type: application/json" --data-binary "{{}}"'
        f" https://{OPENAI_HOST}/v1/chat/completions"
    )
    done = world.run(runtime, "sh", "-c", script)
    assert done.returncode == 0, (done, world.app.log_text()[-3000:])
    # The refusal's JSON, its status (the empty lines: the newline each JSON ends with).
    lines = [line for line in done.stdout.splitlines() if line]
    assert lines[1] == "403" and lines[3] == "403", done
    for line, host in ((lines[0], OTHER_HOST), (lines[2], OPENAI_HOST)):
        refusal = json.loads(line)
        assert refusal["rule"] == "placeholder_misdirected" and refusal["host"] == host, refusal
        assert "anthropic" in refusal["message"], refusal
    assert world.fake.requests == [] and world.fake.log() == "(nothing)"
    # In either order: the two connections may be served by different workers, whose events
    # reach the journal each in its own batch.
    assert sorted(_denials(world.app, crew, before + 2)[before:]) == sorted(
        [(OTHER_HOST, "placeholder_misdirected"), (OPENAI_HOST, "placeholder_misdirected")]
    )


def test_pinned_client_is_refused_and_journaled(world: World, runtime: str) -> None:
    """A client that trusts only the provider's real CA (curl --cacert, the fake's CA written to
    the crew's tmpfs) rejects the proxy's leaf: the request never leaves, the fake sees nothing,
    and the journal's tunnel_closed names the host and why."""
    crew = world.crews[runtime]
    world.fake.clear()
    before = len(_journal(world.app, crew, "tunnel.closed"))
    done = world.run(
        runtime,
        "sh",
        "-c",
        'printf "%s" "$1" > /tmp/ca.pem && curl -sS --max-time 30 --cacert /tmp/ca.pem'
        f" -H 'x-api-key: {AGENT_DUMMY_KEY}' https://{PROVIDER_HOST}/v1/echo",
        "sh",
        world.ca_pem,
    )
    # 60: the peer's certificate could not be verified against the CA given.
    assert done.returncode == 60, done
    assert world.fake.requests == [], world.fake.log()
    closed = _journal(world.app, crew, "tunnel.closed", before + 1)[before:]
    reasons = [(c["host"], c["reason"]) for c in closed]
    assert reasons == [(PROVIDER_HOST, "agent_rejected_certificate")], closed


def test_crew_cannot_read_its_ca_key(world: World, runtime: str) -> None:
    """The crew CA's key is nowhere in the crew: every PEM file it can find is a certificate
    (the crew CA alone, and the system bundle with it), no file it can read under /etc, /home,
    /tmp, /run or /var holds a private key, and its environment names none."""
    crew = world.crews[runtime]
    done = world.run(
        runtime,
        "sh",
        "-c",
        "find / \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -name '*.pem' -type f"
        " -print 2>/dev/null | sort; echo --; "
        # Two halves, so that the journal (which records the argv) shows no key marker either.
        'grep -rlsF "$1$2" /etc /home /tmp /run /var; echo --; env',
        "sh",
        "PRIVATE",
        " KEY",
        timeout=120,
    )
    found, keys, env = done.stdout.split("--\n")
    assert keys == "", done
    pems = found.split()
    assert "/etc/agent-appliance/crew-ca.pem" in pems, done
    cat = world.run(runtime, "sh", "-c", 'for f in "$@"; do cat "$f"; done', "sh", *pems)
    assert cat.returncode == 0 and "PRIVATE" not in cat.stdout, cat
    blocks = re.findall(r"-----BEGIN ([A-Z0-9 ]+)-----", cat.stdout)
    assert blocks and set(blocks) == {"CERTIFICATE"}, set(blocks)
    assert "PRIVATE" not in env and "crew-ca.key" not in env
    variables = dict(line.split("=", 1) for line in env.splitlines() if "=" in line)
    assert variables["NODE_EXTRA_CA_CERTS"] == "/etc/agent-appliance/crew-ca.pem"
    from appliance.credstore import CredentialStore, load_key

    # The key as applianced sealed it: none of its lines is in the crew's environment either.
    state = world.app.state_dir
    store = CredentialStore(state / "credentials.db", load_key(None, state / "credentials.key")[0])
    try:
        found_ca = store.crew_ca(crew)
        assert found_ca is not None
        with found_ca[1] as key:
            key_pem = key.reveal().decode()
    finally:
        store.close()
    for line in key_pem.splitlines()[1:-1]:
        assert line not in done.stdout


# --- 4. restart: adoption, interrupted creates, nothing orphaned ---------------------------------


def test_restart_adopts_crews_rolls_back_interrupted_ones_and_leaves_nothing(world: World) -> None:
    app = world.app
    runtimes = sorted(world.crews)
    # A SIGKILLed daemon: its crews keep running and are served again after the restart.
    app.stop(signal.SIGKILL)
    interrupted_runtime = "runsc" if "runsc" in world.crews else "runc"
    half = app.crew("half")
    app.start(env={"APPLIANCED_TEST_KILL_AFTER_STEP": f"{half}:start agent"})
    for runtime in runtimes:
        assert world.run(runtime, "true").returncode == 0, app.log_text()

    # Killed right after the agent started (under runsc: a sandbox and a gofer are running).
    done = app.ctl("crew", "create", half, "--runtime", interrupted_runtime, "--memory", "256m")
    assert done.returncode in (1, 5), done
    assert app.wait_exit() == -signal.SIGKILL
    half_labels = app.crew_labels(half)
    half_ids = _containers_of(*half_labels)
    assert len(half_ids) == 2
    if interrupted_runtime == "runsc":
        assert _runtime_processes_of(half_ids), "expected a running sandbox to clean up"

    app.start()
    _, status = app.ctl_json("status")
    assert any("rolled back an interrupted create" in c for c in status["reconcile"]), status
    assert _containers_of(*half_labels) == []
    assert _runtime_processes_of(half_ids) == []
    assert sorted(c.split()[0] for c in app.containers()) == sorted(
        world.crews[r] for r in runtimes for _ in range(2)
    )

    # Removing every crew leaves nothing: containers, links, rules, volumes, sandboxes.
    for runtime in runtimes:
        code, removed = app.ctl_json("crew", "rm", world.crews[runtime])
        assert code == 0 and removed["removed"], removed
    all_ids = [i for ids in world.container_ids.values() for i in ids] + half_ids
    assert app.containers() == []
    assert app.links() == []
    assert app.chains() == []
    ingress = subprocess.run(
        ["nft", "list", "map", "inet", app.table, "crew_ingress"], capture_output=True, text=True
    )
    # Only the free pool slots' interfaces remain in the map (each jumps to its own chain).
    from netns.addressing import interface_name

    free = {interface_name(app.prefix, slot) for slot in app.pool_slots()}
    elements = set(re.findall(r'"([^"]+)" : jump', ingress.stdout))
    assert ingress.returncode == 0 and elements == free, (ingress.stdout, free)
    assert len(free) == app.infra_pool
    assert _runtime_processes_of(all_ids) == []
    volumes = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"name=appliance-{app.name_prefix}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert volumes == []
    assert app.ctl_json("crew", "ls")[1]["crews"] == []
