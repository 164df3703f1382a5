"""Shared fixtures: a test CA, fake provider upstreams and the proxy run as a real process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trustme

from appliance.crew_ca import CrewCA, new_ca
from appliance.demo_upstream import FakeServer, start_fake

if TYPE_CHECKING:
    from tests.daemon_support import Appliance

ROOT = Path(__file__).resolve().parent.parent
PROVIDER_NAMES = ["api.anthropic.test", "api.openai.test", "generativelanguage.googleapis.test"]
# Plain "internet" hosts; like the provider names they resolve only through the proxy's
# split-horizon table (to loopback), never through DNS.
PLAIN_NAMES = ["plain.test", "other.test"]
# What the appliance holds; the agent never sees these.
REAL_KEYS = {
    "anthropic": "sk-ant-api03-REALKEY-appliance-only-0123456789abcdef",
    "openai": "sk-proj-REALKEY-appliance-only-0123456789abcdef",
    "google": "AIzaSyREALKEY-appliance-only-0123456789",
}
AGENT_DUMMY_KEY = "sk-agent-dummy-key-must-never-reach-upstream"


# -- skips for want of an environment, and CI -----------------------------------------------------
#
# A test that cannot run here for want of root, Docker, gVisor or the native build skips with a
# reason that starts "needs root", "needs Docker", "needs gVisor" or "needs the native build"
# (`needs()` writes one). Locally such a skip stays a skip, its reason listed at the end of the
# run (`-ra` in pyproject.toml). In CI (`CI=true`, which .ci/run exports after installing all
# four) it is a failure: a suite whose boundary tests skip passes with the boundary untested
# (a worker that never dropped its UID went unnoticed when every privilege-separation test
# skipped for want of a Docker engine). Any other skip (a host that already routes the test
# networks, a test that does not apply) stays a skip everywhere.
ENVIRONMENT_NEEDS = ("root", "Docker", "gVisor", "the native build")


def needs(what: str, detail: str = "") -> str:
    """The reason of a skip for want of an environment (see above)."""
    assert what in ENVIRONMENT_NEEDS, what
    return f"needs {what}" + (f" ({detail})" if detail else "")


def environment_need(reason: str) -> str | None:
    """Which of ENVIRONMENT_NEEDS a skip's reason names, if it is such a skip."""
    for what in ENVIRONMENT_NEEDS:
        head = f"needs {what}"
        if reason.startswith(head) and not reason[len(head) : len(head) + 1].isalnum():
            return what
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_environment_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    what = environment_need(reason)
    if what is not None:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped in CI, which counts as a failure: {reason}\n"
            f"(CI=true: a test that needs {what} must run; .ci/run installs it; tests/conftest.py)"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _fail_environment_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _fail_environment_skip(report)
    return report


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float = 10.0, process=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{host}:{port} did not open")


def wait_for_path(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def ca_file(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture(scope="session")
def provider(ca: trustme.CA) -> Iterator[FakeServer]:
    """One TLS server answering for all three provider test names."""
    cert = ca.issue_cert(*PROVIDER_NAMES, "127.0.0.1")
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(context)
    fake = start_fake(tls_context=context)
    yield fake
    fake.close()


@pytest.fixture(scope="session")
def plain_host() -> Iterator[FakeServer]:
    """A plain-HTTP "internet" host on loopback."""
    fake = start_fake()
    yield fake
    fake.close()


@pytest.fixture
def appliance(
    tmp_path: Path, provider: FakeServer, plain_host: FakeServer, ca_file: str
) -> Iterator[Appliance]:
    """A configured applianced (not started) with its own pool, table and name prefix, the
    busybox test images and the fake providers; everything it made is removed afterwards."""
    from tests.daemon_support import (
        busybox_images,
        needs_root_and_docker,
        new_appliance,
        remove_volumes,
    )

    needs_root_and_docker()
    agent, infra = busybox_images()
    app = new_appliance(tmp_path, provider.port, plain_host.port, ca_file)
    app.write_config(agent, infra)
    try:
        yield app
    finally:
        app.cleanup()
        remove_volumes(app.name_prefix)


@dataclass
class RunningProxy:
    port: int
    host: str
    config_path: Path
    events_path: Path
    process: subprocess.Popen[bytes]
    control_socket: Path | None = None
    stderr_lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def events(self) -> list[object]:
        from proxycore.protocol.events import decode_events

        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            time.sleep(0.3)  # the sink writes in batches, every 0.2 s
            if self.events_path.exists():
                break
        return decode_events(self.events_path.read_bytes()) if self.events_path.exists() else []

    def wait_for_stderr(self, needles: set[str], timeout: float = 10.0) -> list[str]:
        """Read the proxy's stderr until every needle has appeared in some line."""
        import select

        assert self.process.stderr is not None
        seen = self.stderr_lines
        deadline = time.monotonic() + timeout
        while not all(any(n in line for line in seen) for n in needles):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"never saw {needles} in {seen}")
            # os.read, not readline: a buffered reader may hold lines that select cannot see.
            fd = self.process.stderr.fileno()
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"proxy exited; stderr so far: {seen}")
                seen.extend(chunk.decode(errors="replace").splitlines(keepends=True))
        return seen

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        rest = ""
        if self.process.stderr:
            rest = b"".join(iter(lambda: os.read(self.process.stderr.fileno(), 65536), b"")).decode(
                errors="replace"
            )
        return "".join(self.stderr_lines) + rest


def proxy_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["TEST_ANTHROPIC_KEY"] = REAL_KEYS["anthropic"]
    env["TEST_OPENAI_KEY"] = REAL_KEYS["openai"]
    env["TEST_GOOGLE_KEY"] = REAL_KEYS["google"]
    return env


def write_proxy_config(
    tmp: Path,
    *,
    port: int,
    provider_port: int,
    ca_file: str,
    mode: str = "restricted",
    allow: list[str] | None = None,
    ssrf_allow: list[str] | None = None,
    gateway: str = "127.0.0.1",
    extra: str = "",
    with_control: bool = False,
    listen_addresses: list[str] | None = None,
    resolve_names: list[str] | None = None,
    net: list[str] | None = None,
) -> tuple[Path, Path, Path | None]:
    events = tmp / "events.jsonl"
    control = tmp / "control.sock" if with_control else None
    allow_list = ", ".join(f'"{h}"' for h in (allow or []))
    ssrf = ", ".join(f'"{r}"' for r in (["127.0.0.0/8"] if ssrf_allow is None else ssrf_allow))
    # resolve_names: more names for loopback (real names, e.g. a default allowlist host: the
    # split-horizon table keeps their traffic on this machine).
    names = [*PROVIDER_NAMES, *PLAIN_NAMES, *(resolve_names or [])]
    resolve = ", ".join(f'"{name}" = "127.0.0.1"' for name in names)
    text = f"""
[listen]
port = {port}
addresses = [{", ".join(f'"{a}"' for a in (listen_addresses or []))}]

[[crew]]
name = "test"
gateway = "{gateway}"
mode = "{mode}"
allow = [{allow_list}]
# The test upstreams listen on this host's loopback, which only a range the crew names opens.
ssrf_allow = [{ssrf}]
net = [{", ".join(f'"{rule}"' for rule in (net or []))}]

[providers.anthropic]
base_url = "https://api.anthropic.test:{provider_port}"
credential_env = "TEST_ANTHROPIC_KEY"

[providers.openai]
base_url = "https://api.openai.test:{provider_port}/v1"
credential_env = "TEST_OPENAI_KEY"

[providers.google]
base_url = "https://generativelanguage.googleapis.test:{provider_port}"
credential_env = "TEST_GOOGLE_KEY"

[upstream]
ca_file = "{ca_file}"
ssrf_allow = [{ssrf}]
resolve = {{ {resolve} }}

[events]
path = "{events}"
flush_interval = 0.05

{extra}
"""
    if control is not None:
        text += f'\n[control]\nsocket = "{control}"\n'
    path = tmp / "proxy.toml"
    path.write_text(text)
    return path, events, control


def start_proxy(
    config_path: Path,
    *,
    host: str,
    port: int,
    events: Path,
    control: Path | None = None,
    netns: str | None = None,
    workers: int = 1,
) -> RunningProxy:
    command = [
        sys.executable,
        "-m",
        "appliance.cli",
        "proxy",
        "--config",
        str(config_path),
        "--workers",
        str(workers),
    ]
    if netns:
        command = ["ip", "netns", "exec", netns, *command]
    process = subprocess.Popen(
        command, env=proxy_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL
    )
    running = RunningProxy(port, host, config_path, events, process, control)
    try:
        if netns:
            _wait_netns_port(netns, host, port, process)
        else:
            wait_for_port(host, port, process=process)
    except Exception:
        raise RuntimeError("proxy did not start: " + running.stop()) from None
    return running


def _wait_netns_port(netns: str, host: str, port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    probe = f"import socket; socket.create_connection(('{host}', {port}), timeout=0.3)"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("proxy exited")
        if (
            subprocess.run(
                ["ip", "netns", "exec", netns, sys.executable, "-c", probe], capture_output=True
            ).returncode
            == 0
        ):
            return
        time.sleep(0.1)
    raise TimeoutError("proxy in netns did not open its port")


@pytest.fixture
def make_proxy(tmp_path: Path, provider: FakeServer, ca_file: str):
    started: list[RunningProxy] = []

    def make(workers: int = 1, **kwargs: object) -> RunningProxy:
        port = free_port()
        sub = tmp_path / f"p{len(started)}"
        sub.mkdir()
        config, events, control = write_proxy_config(
            sub,
            port=port,
            provider_port=provider.port,
            ca_file=ca_file,
            **kwargs,  # type: ignore[arg-type]
        )
        proxy = start_proxy(
            config,
            host=str(kwargs.get("gateway", "127.0.0.1")),
            port=port,
            events=events,
            control=control,
            workers=workers,
        )
        if control is not None:
            wait_for_path(control)
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


@pytest.fixture
def proxy(make_proxy, plain_host: FakeServer, provider: FakeServer) -> RunningProxy:
    """Restricted crew; the plain test host is allowlisted by address."""
    provider.clear()
    plain_host.clear()
    return make_proxy(allow=["plain.test"], with_control=True)


# -- TLS termination: a crew CA and a proxy whose crew holds a leaf ----------------------------


@pytest.fixture(scope="module")
def crew_ca() -> CrewCA:
    return new_ca("test")


@pytest.fixture
def crew_ca_file(crew_ca: CrewCA, tmp_path: Path) -> str:
    path = tmp_path / "crew-ca.pem"
    path.write_bytes(crew_ca.cert_pem)
    return str(path)


def leaf_toml(crew_ca: CrewCA, tmp_path: Path, host: str) -> str:
    """A `[[crew.leaves]]` table for `host`, its leaf minted by `crew_ca` into `tmp_path`."""
    leaf = crew_ca.mint(host)
    cert, key = tmp_path / f"{host}.crt", tmp_path / f"{host}.key"
    cert.write_bytes(leaf.cert_pem)
    key.write_bytes(leaf.key_pem)
    return f'[[crew.leaves]]\nhost = "{host}"\ncert_file = "{cert}"\nkey_file = "{key}"\n'


@pytest.fixture
def terminating(make_proxy, provider: FakeServer, crew_ca: CrewCA, tmp_path: Path) -> RunningProxy:
    """A proxy whose crew holds a leaf for the fake Anthropic, and rules for it."""
    provider.clear()
    rules = (
        '[[crew.rules]]\nhost = "api.anthropic.test"\nmethods = ["POST", "GET"]\n'
        'paths = ["/v1/messages", "/v1/models"]\n'
    )
    return make_proxy(extra=leaf_toml(crew_ca, tmp_path, "api.anthropic.test") + rules)
