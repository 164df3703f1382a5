"""A real applianced for the tests: its own state directory, admin socket, address pool, instance
id (so its own nftables table, interface prefix, container and volume labels), and crew-name
prefix, so it never touches anything it did not create (another test session's crews, or a real
appliance's)."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import PLAIN_NAMES, PROVIDER_NAMES, ROOT, free_port, needs, proxy_env

# The fake providers and plain hosts listen on this host's loopback, which the proxy refuses as
# a destination unless the crew names it (docs/proxy.md "Destinations"): every crew a test
# creates to reach them says so.
REACH_TEST_HOSTS = ("--ssrf-allow", "127.0.0.0/8")


def needs_root_and_docker() -> None:
    if os.geteuid() != 0:
        pytest.skip(needs("root", "applianced"))
    try:
        import docker

        docker.from_env(timeout=5).ping()
    except Exception as exc:
        pytest.skip(needs("Docker", f"no engine answers: {exc}"))


def busybox_images() -> tuple[str, str]:
    """(agent, infra): the runtime tests' busybox image (built locally in a second, no
    registry) serves as both; the real images (images/) take minutes to build."""
    import docker

    from tests.runtime_images import ensure_test_image

    try:
        tag = ensure_test_image(docker.from_env())
    except RuntimeError as exc:
        pytest.skip(needs("Docker", f"the test image: {exc}"))
    return tag, tag


def _routes_any(networks: list[str]) -> bool:
    out = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True
    )
    # "100.91.7." for "100.91.7.0/24": the /24 itself, not every pool of the same /16 (another
    # test session's crews on the machine must not make every pool look taken).
    return any(net.rsplit(".", 1)[0] + "." in out.stdout for net in networks)


def sigint_as_in_a_terminal() -> None:
    """For Popen(preexec_fn=...) of a process a test Ctrl-Cs: SIGINT's default action, as a
    terminal's foreground job has it. A test run started in the background (`cmd &`, nohup, some
    CI runners) hands SIGINT down ignored, and a program rightly keeps an ignored SIGINT so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Appliance:
    tmp: Path
    tag: str
    provider_port: int
    plain_port: int
    ca_file: str
    pool: str = ""
    port: int = 0
    infra_pool: int = 2  # [crews] infra_pool (the daemon's default)
    proxy_workers: int = 2  # [proxy] workers (the daemon's default is one per CPU)
    process: subprocess.Popen[bytes] | None = None
    logs: list[Path] = field(default_factory=list)
    tree: Path | None = None  # the source tree applianced was started from (start())
    # False: no `daemon.instance` in the config (the daemon derives one from its state directory).
    configure_instance: bool = True
    # Run by an applianced from before instance ids (its objects carry the configured names).
    legacy: bool = False

    def __post_init__(self) -> None:
        for _ in range(20):
            pool = f"100.91.{random.randrange(256)}.0/24"
            if not _routes_any([pool]):
                self.pool = pool
                break
        else:
            pytest.skip("no free test pool")
        self.port = free_port()
        self.state_dir = self.tmp / "state"
        self.socket = self.tmp / "run" / "admin.sock"
        self.config = self.tmp / "appliance.toml"
        # What the config says; the daemon marks them with its instance id (`table`, `prefix`).
        self.config_table = f"appliance_test_{self.tag}"
        self.config_prefix = f"t{self.tag}"
        self.name_prefix = f"t{self.tag}-"
        self.configured_instance = f"t{self.tag}"

    @property
    def instance(self) -> str | None:
        """The daemon's instance id: the configured one, else what its state records (None
        before its first start)."""
        if self.configure_instance:
            return self.configured_instance
        rows = self._query("SELECT value FROM meta WHERE key='instance_id'")
        return str(rows[0][0]) if rows else None

    def _naming(self) -> Any:
        from netns import naming

        return naming(self.config_table, self.config_prefix, self.instance)

    @property
    def table(self) -> str:
        """The daemon's nftables table (family inet)."""
        return str(self._naming().table)

    @property
    def prefix(self) -> str:
        """What the daemon's interface names start with."""
        return str(self._naming().ifname_prefix)

    def crew(self, short: str) -> str:
        return f"{self.name_prefix}{short}"

    def write_config(self, agent: str, infra: str, **daemon: Any) -> None:
        resolve = ", ".join(f'"{n}" = "127.0.0.1"' for n in [*PROVIDER_NAMES, *PLAIN_NAMES])
        extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in daemon.items())
        self.config.write_text(
            f"""
[daemon]
state_dir = "{self.state_dir}"
admin_socket = "{self.socket}"
proxy_port = {self.port}
{self._instance_line()}{extra}
[images]
agent = "{agent}"
infra = "{infra}"

[crews]
name_prefix = "{self.name_prefix}"
default_memory_bytes = 268435456
infra_pool = {self.infra_pool}

[net]
pool = "{self.pool}"
table = "{self.config_table}"
ifname_prefix = "{self.config_prefix}"

[proxy]
workers = {self.proxy_workers}

[proxy.providers.anthropic]
base_url = "https://api.anthropic.test:{self.provider_port}"
credential_env = "TEST_ANTHROPIC_KEY"

[proxy.providers.openai]
base_url = "https://api.openai.test:{self.provider_port}/v1"
credential_env = "TEST_OPENAI_KEY"

[proxy.providers.google]
base_url = "https://generativelanguage.googleapis.test:{self.provider_port}"
credential_env = "TEST_GOOGLE_KEY"

[proxy.upstream]
ca_file = "{self.ca_file}"
ssrf_allow = ["127.0.0.0/8"]
resolve = {{ {resolve} }}
"""
        )

    def _instance_line(self) -> str:
        return f'instance = "{self.configured_instance}"\n' if self.configure_instance else ""

    def start(
        self,
        env: dict[str, str] | None = None,
        *,
        tree: Path | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        """`tree`: the source tree to run applianced from (another version's), else this one.
        `wrapper`: a command that execs its arguments (setpriv with the unit's capabilities)."""
        log = self.tmp / f"applianced-{len(self.logs)}.log"
        self.logs.append(log)
        # An applianced of another version is driven by that version's appliancectl (its admin
        # protocol is its own: `run` before the upgraded session, for one).
        self.tree = tree
        environment = proxy_env()
        environment.update(env or {})
        if tree is not None:
            environment["PYTHONPATH"] = str(tree)
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [
                    *wrapper,
                    sys.executable,
                    "-m",
                    "appliance.cli",
                    "up",
                    "--config",
                    str(self.config),
                ],
                env=environment,
                stdout=out,
                stderr=out,
                cwd=tree or ROOT,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"applianced exited: {self.log_text()}")
            text = self.log_text()
            # text logs: "... INFO applianced: ready (pid ..."; JSON: {"logger":"applianced",
            # "msg":"ready (pid ...
            if "applianced: ready" in text or '"msg":"ready (pid' in text:
                return
            time.sleep(0.1)
        raise TimeoutError(f"applianced not ready: {self.log_text()}")

    def log_text(self) -> str:
        return self.logs[-1].read_text(errors="replace") if self.logs else ""

    def ctl_argv(self) -> list[str]:
        return [sys.executable, "-m", "appliance.cli", "--socket", str(self.socket)]

    def ctl_stdin(self, stdin: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`appliancectl ARGS` with `stdin` piped in (credential values never go in argv)."""
        return subprocess.run(
            [*self.ctl_argv(), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            env=proxy_env(),
            cwd=ROOT,
        )

    def ctl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        tree = self.tree
        environment = proxy_env()
        if tree is not None:
            environment["PYTHONPATH"] = str(tree)
        return subprocess.run(
            [sys.executable, "-m", "appliance.cli", "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environment,
            cwd=tree or ROOT,
        )

    def ctl_json(self, *args: str) -> tuple[int, Any]:
        done = self.ctl("--json", *args)
        # Data on stdout; an error (a JSON object too) on stderr.
        text = done.stdout if done.stdout.strip() else done.stderr
        lines = [line for line in text.splitlines() if line.strip()]
        return done.returncode, json.loads(lines[-1]) if lines else None

    def kill_worker(self, index: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
        """SIGKILL proxy worker `index` and wait until its successor runs: (the victim's status
        before, the whole status after)."""
        _, before = self.ctl_json("status")
        victim = before["proxy_workers"][index]
        os.kill(victim["pid"], signal.SIGKILL)
        for _ in range(300):
            _, status = self.ctl_json("status")
            worker = status["proxy_workers"][index]
            if worker["restarts"] == victim["restarts"] + 1 and worker["pid"] not in (
                None,
                victim["pid"],
            ):
                return victim, status
            time.sleep(0.05)
        raise AssertionError(f"worker {index} not restarted: {status}")

    def wait_exit(self, timeout: float = 30) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    # -- what exists in the world -------------------------------------------------------------

    def _query(self, sql: str) -> list[Any]:
        path = self.state_dir / "applianced.db"
        if not path.exists():
            return []
        db = sqlite3.connect(path)
        try:
            return db.execute(sql).fetchall()
        except sqlite3.OperationalError:
            return []
        finally:
            db.close()

    def pool_slots(self, *, ready_only: bool = False) -> list[str]:
        """The free pool slots in the daemon's state (a slot a crew took is the crew's)."""
        rows = self._query("SELECT slot, phase FROM pool")
        return [slot for slot, phase in rows if phase == "ready" or not ready_only]

    def taken_slots(self) -> dict[str, str]:
        """slot -> crew, for the crews that took a pool slot (their infra carries its label)."""
        return dict(self._query("SELECT slot, name FROM crews WHERE slot IS NOT NULL"))

    def crew_labels(self, crew: str) -> list[str]:
        """The container labels of a crew: its name, and the pool slot it took, if any."""
        return [crew, *(slot for slot, name in self.taken_slots().items() if name == crew)]

    def wait_pool(self, timeout: float = 60) -> list[str]:
        """Until [crews] infra_pool slots are ready (the daemon refills in the background)."""
        deadline = time.monotonic() + timeout
        while True:
            ready = self.pool_slots(ready_only=True)
            if len(ready) == self.infra_pool and len(self.pool_slots()) == self.infra_pool:
                return ready
            if time.monotonic() > deadline:
                raise AssertionError(f"pool not refilled: {ready}\n{self.log_text()[-3000:]}")
            time.sleep(0.1)

    def _pool_ifnames(self, free: list[str]) -> set[str]:
        from netns.addressing import interface_name

        return {interface_name(self.prefix, slot) for slot in free}

    def containers(self, *, include_pool: bool = False) -> list[str]:
        """`CREW STATE` of our containers (a taken slot's infra under its crew's name); free
        pool slots' left out unless include_pool. (The free slots are read after the listing:
        a slot's row exists before its container and outlives it, so nothing listed escapes.)"""
        out = subprocess.run(
            [
                "docker",
                "ps",
                "-a",
                "--filter",
                f"label=io.agent-appliance.instance={self.instance}",
                "--format",
                '{{.Label "io.agent-appliance.crew"}} {{.State}}',
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        lines = [line for line in out.splitlines() if line.startswith(self.name_prefix)]
        taken = self.taken_slots()
        lines = [
            " ".join([taken.get(line.split()[0], line.split()[0]), *line.split()[1:]])
            for line in lines
        ]
        if include_pool:
            return lines
        free = set(self.pool_slots())
        return [line for line in lines if line.split()[0] not in free]

    def links(self, *, include_pool: bool = False) -> list[str]:
        out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        links = [
            line.split(":")[1].strip().split("@")[0]
            for line in out.splitlines()
            if line.split(":")[1].strip().startswith(self.prefix)
        ]
        if include_pool:
            return links
        free = self._pool_ifnames(self.pool_slots())
        return [link for link in links if link not in free]

    def chains(self, *, include_pool: bool = False) -> list[str]:
        done = subprocess.run(
            ["nft", "list", "table", "inet", self.table], capture_output=True, text=True
        )
        chains = [
            line.split()[1]
            for line in done.stdout.splitlines()
            if line.strip().startswith("chain crew_")
        ]
        if include_pool:
            return chains
        from netns.addressing import chain_name

        free = {chain_name(ifname) for ifname in self._pool_ifnames(self.pool_slots())}
        return [chain for chain in chains if chain not in free]

    def cleanup(self) -> None:
        self.stop()
        instance = self.instance
        if self.legacy:  # what it made before an upgrade carries no instance label
            self._cleanup_by_names()
        if instance is None:  # never started (by this version)
            return
        # By the instance label: a crew that took a pool slot keeps the slot's infra container,
        # which a name made from the crew's would miss, and a crew-name prefix may be "".
        label = f"label=io.agent-appliance.instance={instance}"
        ours = subprocess.run(
            ["docker", "ps", "-aq", "--filter", label], capture_output=True, text=True
        ).stdout.split()
        if ours:
            subprocess.run(["docker", "rm", "-f", *ours], capture_output=True)
        for link in self.links(include_pool=True):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["nft", "delete", "table", "inet", self.table], capture_output=True)
        volumes = subprocess.run(
            ["docker", "volume", "ls", "-q", "--filter", label], capture_output=True, text=True
        ).stdout.split()
        if volumes:
            subprocess.run(["docker", "volume", "rm", "-f", *volumes], capture_output=True)
        remove_volumes(self.name_prefix)
        from appliance.daemon.instance import lock_path

        lock_path("/run/agent-appliance-keeper", instance).unlink(missing_ok=True)

    def _cleanup_by_names(self) -> None:
        """What an applianced from before instance ids made: by the names of its config."""
        if self.name_prefix:  # "appliance-" alone is every appliance's
            ours = subprocess.run(
                ["docker", "ps", "-aq", "--filter", f"name=^/appliance-{self.name_prefix}"],
                capture_output=True,
                text=True,
            ).stdout.split()
            if ours:
                subprocess.run(["docker", "rm", "-f", *ours], capture_output=True)
        out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            link = line.split(":")[1].strip().split("@")[0]
            if link.startswith(self.config_prefix) and len(link) == 15:
                subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["nft", "delete", "table", "inet", self.config_table], capture_output=True)
        remove_volumes(self.name_prefix)


def new_appliance(tmp: Path, provider_port: int, plain_port: int, ca_file: str) -> Appliance:
    return Appliance(tmp, uuid.uuid4().hex[:4], provider_port, plain_port, ca_file)


def remove_volumes(prefix: str) -> None:
    if not prefix:  # "appliance-*" is every appliance's
        return
    out = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"name=appliance-{prefix}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if out:
        subprocess.run(["docker", "volume", "rm", "-f", *out], capture_output=True)
