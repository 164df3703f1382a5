"""`appliancectl demo`: the tour of the appliance, on embedded defaults.

Theory of operation
-------------------
The tour runs the real thing, as an operator would, and leaves nothing behind:

    engine             ensure_dockerd(): the local engine answers (started if this machine has
                       no init system to start it)
    images             images.build.ensure_images(): the agent and infra images (cached by recipe)
    fake provider      a real TLS server on 127.0.0.1 that plays api.anthropic.test and records
                       what it receives; a throw-away CA; the demo key in a 0600 file
    start applianced   a child process with everything of its own: a temporary state directory
                       and admin socket, an unrouted /24 of 100.64/10, an nftables table, an
                       interface prefix and a crew-name prefix, so it cannot touch an operator's
                       appliance or its crews. The proxy reaches the fake provider only because
                       the operator says so: `resolve` maps the name to 127.0.0.1, and the
                       crew names exactly that address (`--ssrf-allow`: the host's own
                       addresses are refused to every crew that does not).
    create crew        `appliancectl crew create` (restricted, allowing only the provider host)
    ... agent processes in the hardened container, through `appliancectl run` ...
    remove crew        `appliancectl crew rm`
    stop applianced    SIGTERM
    nothing left       containers, volumes, links, the nftables table, processes, the temp dir

Every step is named; the first that fails ends the tour (exit 1, the step named, applianced's
log tail shown) and the cleanup runs anyway. Traffic goes only to loopback and to the demo's own
crew namespace: the names the agent uses resolve only in the proxy's own table.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from appliance.demo_tls import server_context
from appliance.demo_upstream import FakeServer, start_fake
from appliance.runtime.base import agent_keys
from appliance.selfexec import self_command
from netns.addressing import naming

ROOT = Path(__file__).resolve().parents[1]
# An embedded, obviously fake key: the appliance holds it, the agent never sees it.
# No word in it: the scrubber redacts any long enough piece of a held key wherever it appears,
# and "appliance" inside the key made it redact the word in the proxy's own refusals.
DEMO_KEY = "sk-ant-api03-DEMO7kQ2xV9mR4tB8nW3zL6pH1cJ5fGa8Ys0000"
# What an agent might send on its own: the proxy drops it before injecting the appliance's.
AGENT_KEY = "sk-agent-dummy"
PROVIDER_HOST = "api.anthropic.test"
REFUSED_HOST = "exfil.example"
PROXY_PORT = 9119


class TourFailed(Exception):
    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"step '{step}' failed: {why}")
        self.step = step
        self.why = why


class CheckFailed(Exception):
    pass


def expect(condition: object, why: str) -> None:
    if not condition:
        raise CheckFailed(why)


def masked(secret: str) -> str:
    """Enough of a key to recognise it, never the whole key."""
    return f"{secret[:14]}...{secret[-4:]} ({len(secret)} chars)"


@dataclass
class Tour:
    as_json: bool
    records: list[dict[str, Any]] = field(default_factory=list)
    number: int = 0

    def say(self, text: str = "") -> None:
        if self.records:
            self.records[-1]["lines"].append(text)
        if not self.as_json:
            for line in text.splitlines() or [""]:
                print(f"   {line}", flush=True)

    @contextlib.contextmanager
    def step(self, title: str) -> Iterator[None]:
        self.number += 1
        record: dict[str, Any] = {"step": title, "ok": False, "lines": []}
        self.records.append(record)
        if not self.as_json:
            print(f"\n{self.number}. {title}", flush=True)
        started = time.monotonic()
        try:
            yield
        except TourFailed:
            raise
        except Exception as exc:
            record["error"] = str(exc) or type(exc).__name__
            if not self.as_json:
                print(f"   FAILED: {record['error']}", flush=True)
            raise TourFailed(title, record["error"]) from exc
        record["ok"] = True
        record["seconds"] = round(time.monotonic() - started, 3)
        if not self.as_json:
            print(f"   ok ({record['seconds']:.2f} s)", flush=True)


def _unrouted_pool() -> str:
    """A /24 of 100.64.0.0/10 (CGNAT, never routed to the internet) that this host does not
    route: the demo's crews get addresses nobody else here uses."""
    routes = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True
    ).stdout
    for _ in range(50):
        prefix = f"100.{random.randrange(80, 120)}.{random.randrange(256)}"
        if f"{prefix}." not in routes:
            return f"{prefix}.0/24"
    raise CheckFailed("no free /24 in 100.80.0.0-100.119.255.255 on this host")


class _Listener:
    """A TCP listener on the crew's gateway address: reachable from the crew only by going
    around the proxy, which the crew's nftables chain forbids."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((address, 0))
        self.sock.listen(4)
        self.port = int(self.sock.getsockname()[1])
        self.hits = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            connection.close()

    def close(self) -> None:
        self.sock.close()


class DemoAppliance:
    """applianced as a child process, with a state, pool, table and prefixes of its own."""

    def __init__(self, workdir: Path) -> None:
        tag = uuid.uuid4().hex[:4]
        self.workdir = workdir
        self.tag = tag
        self.state_dir = workdir / "state"
        self.socket = workdir / "run" / "admin.sock"
        self.config_path = workdir / "appliance.toml"
        self.log_path = workdir / "applianced.log"
        self.key_file = workdir / "anthropic.key"
        self.table = f"appliance_demo_{tag}"
        self.ifname_prefix = f"d{tag}"
        self.name_prefix = f"demo{tag}-"
        self.crew = f"{self.name_prefix}crew"
        # The daemon's table carries its instance id (docs/daemon.md, "Instances").
        self.instance = f"demo{tag}"
        self.net_table = naming(self.table, self.ifname_prefix, self.instance).table
        self.pool = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.proxy_pids: tuple[int, ...] = ()

    def write_config(
        self,
        agent: str,
        infra: str,
        provider_port: int | None,
        ca_file: Path | None,
        extra_daemon: str = "",
        extra_crews: str = "",
    ) -> None:
        """The demo's config; with no provider port, no provider (bench/bench_crews.py)."""
        self.pool = _unrouted_pool()
        provider = ""
        if provider_port is not None:
            self.key_file.write_text(DEMO_KEY)
            self.key_file.chmod(0o600)
            provider = f"""
[proxy.providers.anthropic]
base_url = "https://{PROVIDER_HOST}:{provider_port}"
credential_file = "{self.key_file}"

[proxy.upstream]
ca_file = "{ca_file}"
# The fake provider lives on 127.0.0.1, which only a crew that names it may reach (the crew
# is created with --ssrf-allow 127.0.0.1/32); the name resolves there only in the proxy's table.
resolve = {{ "{PROVIDER_HOST}" = "127.0.0.1" }}
"""
        self.config_path.write_text(f"""\
[daemon]
state_dir = "{self.state_dir}"
admin_socket = "{self.socket}"
proxy_port = {PROXY_PORT}
# If the tour stops half way, SIGTERM still tears the crew down.
stop_crews_on_exit = true
instance = "{self.instance}"
{extra_daemon}
[images]
agent = "{agent}"
infra = "{infra}"

[crews]
name_prefix = "{self.name_prefix}"
default_memory_bytes = 268435456
{extra_crews}
[net]
pool = "{self.pool}"
table = "{self.table}"
ifname_prefix = "{self.ifname_prefix}"
{provider}
""")

    def start(self, wait: float = 120.0) -> dict[str, Any]:
        from appliance.ctl.client import AdminClient, AdminError, Unreachable

        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [*self_command("appliance.cli"), "up", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=ROOT,
            )
        client = AdminClient(str(self.socket), timeout=5)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise CheckFailed(
                    f"applianced exited with {self.process.returncode}: {self.log_tail()}"
                )
            with contextlib.suppress(Unreachable, AdminError):
                status = client.status()
                if status.pid == self.process.pid:
                    self.proxy_pids = status.proxy_pids
                    return dict(msgspec.to_builtins(status))
            time.sleep(0.1)
        raise CheckFailed(f"applianced did not answer within {wait:g} s: {self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int | None:
        process = self.process
        if process is None or process.poll() is not None:
            return process.returncode if process else None
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            return None

    def log_tail(self, lines: int = 8) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def ctl(
        self, tour: Tour, *args: str, timeout: float = 120, show: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """`appliancectl ARGS` as the operator types it, shown with its output."""
        if show:
            tour.say(f"$ appliancectl {shlex.join(args)}")
        done = subprocess.run(
            [*self_command("appliance.cli"), "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        output = (done.stdout + done.stderr).rstrip()
        if output and show:
            tour.say("  " + output.replace("\n", "\n  "))
        return done

    def run(self, tour: Tour, *argv: str) -> subprocess.CompletedProcess[str]:
        return self.ctl(tour, "run", self.crew, "--", *argv)

    # -- what exists in the world -------------------------------------------------------------

    def leftovers(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        containers = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"name=appliance-{self.name_prefix}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        volumes = subprocess.run(
            ["docker", "volume", "ls", "-q", "--filter", f"name=appliance-{self.name_prefix}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        links = [
            line.split(":")[1].strip().split("@")[0]
            for line in subprocess.run(
                ["ip", "-o", "link", "show"], capture_output=True, text=True
            ).stdout.splitlines()
            if line.split(":")[1].strip().startswith(self.ifname_prefix)
        ]
        table = subprocess.run(
            ["nft", "list", "table", "inet", self.net_table], capture_output=True, text=True
        )
        processes = [
            str(pid)
            for pid in (self.process.pid if self.process else None, *self.proxy_pids)
            if pid is not None and _alive(pid)
        ]
        for what, items in (
            ("containers", containers),
            ("volumes", volumes),
            ("links", links),
            ("nft table", [self.net_table] if table.returncode == 0 else []),
            ("processes", processes),
        ):
            if items:
                found[what] = items
        return found

    def force_cleanup(self) -> None:
        """After a failure: remove whatever of the demo's own still exists (by its prefixes)."""
        self.stop(timeout=30)
        found = self.leftovers()
        if found.get("containers"):
            subprocess.run(["docker", "rm", "-f", *found["containers"]], capture_output=True)
        if found.get("volumes"):
            subprocess.run(["docker", "volume", "rm", "-f", *found["volumes"]], capture_output=True)
        for link in found.get("links", []):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if found.get("nft table"):
            subprocess.run(["nft", "delete", "table", "inet", self.net_table], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie of ours (already exited, not yet reaped) is not a leftover.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    return False


def main(*, as_json: bool = False) -> int:
    tour = Tour(as_json)
    began = time.monotonic()
    if os.geteuid() != 0:
        print("appliancectl demo: needs root (the engine, network namespaces, nftables)")
        return 1
    if not as_json:
        print(
            "appliancectl demo: the appliance end to end on this machine, on embedded defaults.\n"
            "Traffic stays on loopback and in the demo's own crew; all of it is removed at the end."
        )
    workdir = Path(tempfile.mkdtemp(prefix="appliance-demo-"))
    app = DemoAppliance(workdir)
    upstream: FakeServer | None = None
    failed: TourFailed | None = None
    try:
        upstream = _tour(tour, app)
    except TourFailed as exc:
        failed = exc
        tail = app.log_tail(12)
        if not as_json:
            print(f"\napplianced log (last lines): {tail}", flush=True)
    finally:
        if failed is not None:
            app.force_cleanup()
        if upstream is not None:
            upstream.close()
        shutil.rmtree(workdir, ignore_errors=True)
    if failed is None:
        try:
            with tour.step("nothing left behind"):
                found = app.leftovers()
                expect(not found, f"left behind: {found}")
                expect(not workdir.exists(), f"{workdir} still exists")
                tour.say(
                    f"no container or volume named appliance-{app.name_prefix}*, no link "
                    f"{app.ifname_prefix}*, no table inet {app.net_table}, applianced and its "
                    f"proxy exited, {workdir} removed"
                )
        except TourFailed as exc:
            failed = exc
    elapsed = time.monotonic() - began
    if as_json:
        print(
            json.dumps(
                {
                    "ok": failed is None,
                    "failed_step": failed.step if failed else None,
                    "seconds": round(elapsed, 2),
                    "steps": tour.records,
                }
            )
        )
    elif failed is None:
        print(f"\ndemo: all {tour.number} steps behaved as expected ({elapsed:.1f} s)")
    else:
        print(f"\ndemo: FAILED at step '{failed.step}': {failed.why} ({elapsed:.1f} s)")
    return 0 if failed is None else 1


def _tour(tour: Tour, app: DemoAppliance) -> FakeServer:
    """The steps up to stopping applianced; returns the fake provider for closing."""
    from appliance.runtime.engine import ensure_dockerd

    with tour.step("container engine"):
        client = ensure_dockerd()
        info = client.info()
        tour.say(
            f"dockerd {info.get('ServerVersion')} answers; runtimes: "
            + ", ".join(sorted(info.get("Runtimes") or {}))
        )

    with tour.step("agent and infra images"):
        from images.build import ensure_images

        images = ensure_images(log=lambda message: tour.say(message))
        tour.say(f"agent {images.agent}, infra {images.infra} (built locally, never pulled)")

    with tour.step("fake provider (real TLS on 127.0.0.1, a throw-away CA)"):
        tls, ca_file = server_context(PROVIDER_HOST, app.workdir)
        upstream = start_fake(tls_context=tls)
        tour.say(f"https://{PROVIDER_HOST}:{upstream.port} plays Anthropic's Messages API")

    try:
        _crew_tour(tour, app, upstream, images.agent, images.infra, ca_file)
    except BaseException:
        upstream.close()
        raise
    return upstream


def _proc_status(pid: int) -> dict[str, str]:
    from proxycore.privileges import process_status

    try:
        return process_status(pid)
    except OSError:
        return {}


def _crew_tour(
    tour: Tour, app: DemoAppliance, upstream: FakeServer, agent: str, infra: str, ca_file: Path
) -> None:
    with tour.step("start applianced (its own state, address pool, nft table and name prefix)"):
        app.write_config(agent, infra, upstream.port, ca_file)
        status = app.start()
        tour.say(
            f"applianced pid {status['pid']}, proxy workers {list(app.proxy_pids)}, state "
            f"{app.state_dir}\npool {app.pool}, table inet {app.net_table}, interfaces "
            f"{app.ifname_prefix}*, crews {app.name_prefix}*\nthe demo key is in "
            f"{app.key_file.name} (0600), read by the proxy only: {masked(DEMO_KEY)}"
        )

    with tour.step("the proxy workers run unprivileged (UID 1002, no capabilities)"):
        for pid in app.proxy_pids:
            fields = _proc_status(pid)
            tour.say(
                f"worker {pid}: Uid {fields.get('Uid', '?').split()}, CapEff "
                f"{fields.get('CapEff')}, CapBnd {fields.get('CapBnd')}, NoNewPrivs "
                f"{fields.get('NoNewPrivs')}"
            )
            expect(fields.get("Uid", "").split() == ["1002"] * 4, f"worker {pid} is not UID 1002")
            expect(
                all(int(fields.get(k, "1"), 16) == 0 for k in ("CapPrm", "CapEff", "CapBnd")),
                f"worker {pid} holds capabilities",
            )
            expect(fields.get("NoNewPrivs") == "1", f"worker {pid} lacks no_new_privs")

    crew = app.crew
    with tour.step("create a restricted crew that may reach only the provider host"):
        started = time.monotonic()
        done = app.ctl(
            tour,
            "crew",
            "create",
            crew,
            "--mode",
            "restricted",
            "--allow",
            PROVIDER_HOST,
            "--ssrf-allow",
            "127.0.0.1/32",
        )
        expect(done.returncode == 0, f"crew create exited {done.returncode}")
        tour.say(f"ready to exec {time.monotonic() - started:.2f} s after the command started")
        gateway = json.loads(app.ctl(tour, "--json", "crew", "show", crew, show=False).stdout)[
            "crew"
        ]["gateway"]

    with tour.step("the agent calls the provider through the proxy; the key is injected upstream"):
        upstream.clear()
        body = json.dumps(
            {
                "model": "claude-demo",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "hi"}],
            }
        )
        done = app.run(
            tour,
            "sh",
            "-c",
            'curl -sS "$ANTHROPIC_BASE_URL/v1/messages" -H "content-type: application/json" '
            f"-H 'x-api-key: {AGENT_KEY}' -d '{body}'",
        )
        expect(done.returncode == 0, f"curl exited {done.returncode}")
        reply = json.loads(done.stdout)
        expect(reply.get("content", [{}])[0].get("text"), "no reply text from the provider")
        seen = upstream.last()
        keys = seen.all("x-api-key")
        tour.say(
            f"the fake provider received {seen.method} {seen.path} with x-api-key: "
            + ", ".join(masked(k) for k in keys)
        )
        expect(keys == [DEMO_KEY], "the provider did not receive exactly the appliance's key")
        expect(AGENT_KEY not in json.dumps(seen.headers), "the agent's own key reached upstream")
        tour.say("= the appliance's key; the agent's own x-api-key was removed on the way")

    with tour.step("a provider that echoes the key back: the agent sees it scrubbed"):
        upstream.clear()
        done = app.run(
            tour,
            "sh",
            "-c",
            'curl -sS "$ANTHROPIC_BASE_URL/v1/messages" -H "x-fake-leak: error" -d "{}"',
        )
        expect(upstream.last().all("x-api-key") == [DEMO_KEY], "the key was not injected")
        expect(DEMO_KEY not in done.stdout + done.stderr, "the key came back to the agent")
        expect("[REDACTED:anthropic]" in done.stdout, "no redaction marker in the reply")

    with tour.step("the agent's environment holds no key"):
        done = app.run(tour, "env")
        expect(done.returncode == 0, f"env exited {done.returncode}")
        expect(DEMO_KEY not in done.stdout, "the demo key is in the agent's environment")
        pairs = [line.split("=", 1) for line in done.stdout.splitlines() if "=" in line]
        # The only key-like variables are the crew's placeholders the agent CLIs need to start.
        placeholders = agent_keys(crew)
        suspicious = [
            name
            for name, value in pairs
            if any(w in name.upper() for w in ("KEY", "TOKEN", "SECRET"))
            and placeholders.get(name) != value
        ]
        expect(not suspicious, f"credential-like variables: {suspicious}")
        tour.say("no credential and no *KEY*/*TOKEN*/*SECRET* variable: only the proxy's address")

    with tour.step(f"another host ({REFUSED_HOST}) is refused with a readable 403"):
        done = app.run(
            tour, "curl", "-sS", "-w", "\\nHTTP %{http_code}\\n", f"http://{REFUSED_HOST}/upload"
        )
        expect("HTTP 403" in done.stdout, "no 403 from the proxy")
        refusal = json.loads(done.stdout.split("\nHTTP ")[0])
        expect(refusal.get("rule") == "not_in_allowlist", f"unexpected refusal {refusal}")
        done = app.run(tour, "curl", "-sS", f"https://{REFUSED_HOST}/")
        expect(done.returncode != 0 and "403" in done.stderr, "CONNECT was not refused with 403")

    with tour.step("around the proxy: a direct connection is dropped by the crew's nft chain"):
        listener = _Listener(gateway)
        try:
            done = app.run(
                tour,
                "curl",
                "-sS",
                "--noproxy",
                "*",
                "--max-time",
                "2",
                f"http://{gateway}:{listener.port}/",
            )
            expect(done.returncode != 0, "the direct connection succeeded")
            expect(listener.hits == 0, "a host listener outside the proxy port was reached")
            tour.say(f"a listener on {gateway}:{listener.port} (the host side) saw no connection")
        finally:
            listener.close()
        net = json.loads(app.ctl(tour, "--json", "net", "show", show=False).stdout)
        dropped = next(c["dropped_packets"] for c in net["crews"] if c["crew"] == crew)
        tour.say(f"the crew's drop counter: {dropped} packets")
        expect(dropped > 0, "the drop counter did not move")

    with tour.step("who the agent is: uid 1001, no capabilities, no new privileges"):
        done = app.run(tour, "id")
        expect(done.stdout.startswith("uid=1001"), f"id said {done.stdout!r}")
        done = app.run(tour, "grep", "-E", "^(CapEff|NoNewPrivs)", "/proc/self/status")
        expect("CapEff:\t0000000000000000" in done.stdout, "capabilities are not empty")
        expect("NoNewPrivs:\t1" in done.stdout, "no_new_privs is not set")

    with tour.step("the root file system is read-only; /tmp and HOME are writable"):
        done = app.run(
            tour,
            "sh",
            "-c",
            'touch /usr/bin/implant; echo "root fs: exit $?"; '
            'touch /tmp/scratch "$HOME/notes" && echo "/tmp and HOME: writable"',
        )
        expect("Read-only file system" in done.stderr, "writing under /usr did not fail")
        expect("/tmp and HOME: writable" in done.stdout, "/tmp or HOME is not writable")

    with tour.step("the journal holds the proxy's decisions, and no credential"):
        kinds: dict[str, int] = {}
        wanted = {"proxy.allow", "credential.injected", "proxy.deny"}
        deadline = time.monotonic() + 5  # the workers send their events every 50 ms
        while True:
            done = app.ctl(tour, "journal", "export", "--jsonl", show=False)
            kinds = {}
            for line in done.stdout.splitlines():
                # A signed export: a header line, the entries, a signed end line (docs/journal.md).
                kind = json.loads(line).get("type")
                if kind is not None:
                    kinds[kind] = kinds.get(kind, 0) + 1
            if wanted <= set(kinds) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        tour.say(", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items())))
        expect(wanted <= set(kinds), "an expected journal entry is missing")
        expect(DEMO_KEY not in done.stdout, "the key is in the journal")

    with tour.step("remove the crew"):
        done = app.ctl(tour, "crew", "rm", crew)
        expect(done.returncode == 0, f"crew rm exited {done.returncode}")

    with tour.step("stop applianced"):
        code = app.stop()
        expect(code == 0, f"applianced exited with {code}: {app.log_tail()}")
        # The proxy exits when applianced's end of its control channel closes.
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in app.proxy_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        # applianced keeps its table between starts (the rules of running crews live in it);
        # this table was the demo's own.
        subprocess.run(["nft", "delete", "table", "inet", app.net_table], capture_output=True)
        tour.say(f"applianced exited 0; the demo's table inet {app.net_table} deleted")


if __name__ == "__main__":
    sys.exit(main(as_json="--json" in sys.argv))
