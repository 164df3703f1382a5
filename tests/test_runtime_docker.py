"""The Docker provider against the real engine, with runc and with gVisor (runsc).

Every container here runs the test image of tests/runtime_images.py (a static busybox). The
network test builds a crew network with netns.CrewNetworks in a private pool and an nftables
table of its own, and talks only to listeners on the crew's gateway address on this host.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(
        shutil.which("dockerd") is None and shutil.which("docker") is None,
        reason="needs Docker (apt-get install docker.io)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (engine socket, namespaces)"),
]

RUNTIMES = ["runc", "runsc"]


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def client():  # type: ignore[no-untyped-def]
    from appliance.runtime.engine import ensure_dockerd

    client = ensure_dockerd()
    yield client
    client.close()


@pytest.fixture(scope="session")
def image(client) -> str:  # type: ignore[no-untyped-def]
    from tests.runtime_images import ensure_test_image

    return ensure_test_image(client)


# The instance id of this session's providers: what they create carries it, and they see
# nothing else on the (shared) engine.
INSTANCE = f"rt{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def provider(client):  # type: ignore[no-untyped-def]
    from appliance.runtime.docker import DockerProvider

    return DockerProvider(client, instance=INSTANCE)


def new_crew() -> str:
    return f"rt-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def crew(provider) -> Iterator[str]:  # type: ignore[no-untyped-def]
    name = new_crew()
    yield name
    provider.remove_crew(name, volumes=True)


def spec_for(name: str, image: str, runtime: str = "runc", **kwargs: object):  # type: ignore[no-untyped-def]
    from appliance.runtime import CrewSpec

    return CrewSpec(name=name, image=image, infra_image=image, runtime=runtime, **kwargs)  # type: ignore[arg-type]


def crew_leftovers(provider, client, name: str) -> list[str]:  # type: ignore[no-untyped-def]
    from appliance.runtime.base import LABEL_CREW

    owned = {c.container_id for c in provider.owned() if c.crew == name}
    found = [f"container {container_id[:12]}" for container_id in sorted(owned)]
    everything = client.api.containers(all=True, filters={"label": f"{LABEL_CREW}={name}"})
    found += [f"unowned container {c['Id'][:12]}" for c in everything if c["Id"] not in owned]
    volumes = client.api.volumes(filters={"label": f"{LABEL_CREW}={name}"}).get("Volumes") or []
    found += [f"volume {v['Name']}" for v in volumes]
    return found


@dataclass
class Started:
    name: str
    runtime: str
    pod: object
    agent_id: str


@pytest.fixture(scope="module", params=RUNTIMES)
def started(request, provider, image) -> Iterator[Started]:  # type: ignore[no-untyped-def]
    """One running crew per runtime, shared by the tests that only exec in it."""
    name = new_crew()
    spec = spec_for(name, image, request.param, env={"CREW_VAR": "from-spec"})
    pod = provider.create_infra(spec)
    try:
        agent = provider.start_agent(spec, pod)
        yield Started(name, request.param, pod, agent)
    finally:
        provider.remove_crew(name, volumes=True)


async def run(provider, crew: str, argv: list[str], **kwargs):  # type: ignore[no-untyped-def]
    from appliance.runtime import ExecExited, ExecOutput

    out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    exited = None
    async for event in provider.exec(crew, argv, **kwargs):
        if isinstance(event, ExecOutput):
            out[event.stream].append(event.line)
        else:
            assert isinstance(event, ExecExited)
            exited = event
    assert exited is not None
    return b"".join(out["stdout"]).decode(), b"".join(out["stderr"]).decode(), exited


def sh(provider, crew: str, script: str, **kwargs):  # type: ignore[no-untyped-def]
    return trio.run(lambda: run(provider, crew, ["sh", "-c", script], **kwargs))


def processes(provider, crew: str) -> str:  # type: ignore[no-untyped-def]
    stdout, _, _ = sh(provider, crew, "ps -o pid,args")
    return stdout


# --- engine detection -----------------------------------------------------------------------------


def test_docker_host_that_does_not_answer_is_an_error_not_a_fallback(tmp_path: Path) -> None:
    from appliance.runtime import EngineUnavailable
    from appliance.runtime.engine import detect_engine

    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(dead))  # a socket file nobody listens on
    with pytest.raises(EngineUnavailable) as caught:
        detect_engine(env={"DOCKER_HOST": f"unix://{dead}", "HOME": str(tmp_path)})
    message = str(caught.value)
    assert str(dead) in message and "refused" in message
    assert "DOCKER_HOST is set, so no other engine is tried" in message
    assert len(caught.value.attempts) == 1  # the real engine on /var/run/docker.sock: not tried


def test_detection_finds_the_real_engine_and_reports_what_it_tried(tmp_path: Path) -> None:
    from appliance.runtime.engine import DEFAULT_SOCKET, candidate_sockets, detect_engine

    env = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "xdg")}
    paths = [path for _, path in candidate_sockets(env)]
    assert paths[:2] == ["/var/run/docker.sock", "/run/docker.sock"]
    assert f"{tmp_path}/xdg/podman/podman.sock" in paths and "/run/podman/podman.sock" in paths
    assert f"{tmp_path}/.colima/default/docker.sock" in paths
    assert f"{tmp_path}/.orbstack/run/docker.sock" in paths
    assert f"{tmp_path}/.rd/docker.sock" in paths
    assert f"{tmp_path}/.docker/desktop/docker.sock" in paths
    assert paths[-1] == "/run/containerd/containerd.sock"
    client, report = detect_engine(env=env)
    try:
        assert report.address == f"unix://{DEFAULT_SOCKET}"
        assert report.attempts[-1].outcome == "answered"
        assert report.api_version and report.server_version
        assert client.ping()
    finally:
        client.close()


def test_every_failed_candidate_is_reported_with_its_reason(tmp_path: Path) -> None:
    from appliance.runtime import EngineUnavailable
    from appliance.runtime.engine import detect_engine

    regular = tmp_path / "regular.sock"
    regular.write_text("")
    refused = tmp_path / "refused.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(refused))
    silent = tmp_path / "silent.sock"  # accepts connections, never answers
    containerd = tmp_path / "containerd.sock"
    listeners = []
    for path in (silent, containerd):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        listener.listen(8)
        listeners.append(listener)
    candidates = [
        ("docker", str(tmp_path / "absent.sock")),
        ("colima", str(regular)),
        ("podman", str(refused)),
        ("orbstack", str(silent)),
        ("containerd", str(containerd)),
    ]
    started = time.monotonic()
    try:
        with pytest.raises(EngineUnavailable) as caught:
            detect_engine(env={"HOME": str(tmp_path)}, candidates=candidates, timeout=0.5)
    finally:
        for listener in listeners:
            listener.close()
    assert time.monotonic() - started < 10
    reasons = dict(caught.value.attempts)
    assert reasons[f"unix://{tmp_path}/absent.sock (docker)"] == "absent"
    assert reasons[f"unix://{regular} (colima)"] == "not-a-socket"
    assert reasons[f"unix://{refused} (podman)"].startswith("refused")
    assert reasons[f"unix://{silent} (orbstack)"].startswith(("timeout", "error"))
    assert reasons[f"unix://{containerd} (containerd)"].startswith("unsupported")
    assert "not the Docker API" in str(caught.value)


# --- runtimes, images, mounts: refused before anything is created ---------------------------------


def test_runtimes_of_this_engine(provider) -> None:  # type: ignore[no-untyped-def]
    assert {"runc", "runsc"} <= set(provider.runtimes())
    status = provider.runtime_status()
    assert status["kata-runtime"] != "available" and status["sysbox-runc"] != "available"
    assert status["crun"] != "available"  # not registered, or broken on cgroups hybrid mode


def test_unavailable_runtime_creates_nothing(provider, client, image, crew) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import RuntimeUnavailable

    with pytest.raises(RuntimeUnavailable) as caught:
        provider.create_infra(spec_for(crew, image, "kata-runtime"))
    assert caught.value.runtime == "kata-runtime"
    assert {"runc", "runsc"} <= set(caught.value.available)
    assert "kata-runtime" in str(caught.value) and "runsc" in str(caught.value)
    assert crew_leftovers(provider, client, crew) == []


def test_missing_image_creates_nothing(provider, client, image, crew) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import CrewSpec, ImageMissing

    missing = "agent-appliance/does-not-exist:0"
    with pytest.raises(ImageMissing, match="never pulls"):
        provider.create_infra(CrewSpec(name=crew, image=missing, infra_image=image))
    assert crew_leftovers(provider, client, crew) == []


def test_engine_socket_mounts_are_refused_before_anything_is_created(  # type: ignore[no-untyped-def]
    provider, client, image, crew, tmp_path: Path
) -> None:
    from appliance.runtime import UnsafeMount

    link = tmp_path / "innocent"
    link.symlink_to("/var/run/docker.sock")
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(nested / "docker.sock"))
        for source in ("/var/run/docker.sock", "/run/docker.sock", "/var/run", "/", str(link)):
            with pytest.raises(UnsafeMount):
                provider.create_infra(spec_for(crew, image, mounts=((source, "/mnt/x", True),)))
        with pytest.raises(UnsafeMount, match="holds a container engine socket"):
            provider.create_infra(spec_for(crew, image, mounts=((str(tmp_path), "/mnt/x", True),)))
    assert crew_leftovers(provider, client, crew) == []


def test_invalid_spec_values_name_the_field(provider, image) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import InvalidSpec

    for kwargs, field in [
        ({"name": "bad name!"}, "name"),
        ({"name": "ok", "memory_bytes": 1024}, "memory_bytes"),
        ({"name": "ok", "cpus": 0.0}, "cpus"),
        ({"name": "ok", "mounts": (("relative", "/x", True),)}, "mounts[0]"),
    ]:
        name = str(kwargs.pop("name"))
        with pytest.raises(InvalidSpec) as caught:
            provider.create_infra(spec_for(name, image, **kwargs))
        assert caught.value.field == field


# --- hardening ------------------------------------------------------------------------------------


def test_hardened_agent_container(provider, client, started: Started) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime.base import PIDS_LIMIT

    name = started.name
    stdout, _, exited = sh(provider, name, "id")
    assert exited.exit_code == 0 and stdout.startswith("uid=1001(agent) gid=1001(agent)"), stdout
    status, _, _ = sh(provider, name, "cat /proc/self/status")
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    for cap in ("CapEff", "CapPrm", "CapBnd", "CapInh"):
        assert int(fields[cap].strip(), 16) == 0, (cap, fields[cap])
    if started.runtime == "runc":
        assert fields["NoNewPrivs"].strip() == "1"
        assert fields["Seccomp"].strip() == "2"  # the engine's default profile, filtering
    # gVisor's /proc does not show NoNewPrivs or Seccomp: the engine's view is checked below.
    # Read-only root, even where the agent owns the directory (/srv is the agent's in the image).
    stdout, stderr, exited = sh(provider, name, "touch /srv/x")
    assert exited.exit_code != 0 and "Read-only file system" in stderr, stderr
    stdout, stderr, exited = sh(
        provider, name, "echo ok > /tmp/t && cat /tmp/t && grep ' /tmp ' /proc/mounts"
    )
    assert exited.exit_code == 0 and stdout.startswith("ok\n"), stderr
    assert "tmpfs" in stdout
    stdout, _, exited = sh(provider, name, 'echo "$HOME $CREW_VAR" && touch "$HOME/x" && pwd')
    assert exited.exit_code == 0 and stdout.split() == ["/home/agent", "from-spec", "/home/agent"]
    stdout, _, exited = sh(
        provider, name, "ls -la /var/run/docker.sock /run/docker.sock /run/podman 2>&1; exit 0"
    )
    assert "No such file" in stdout and "docker.sock " not in stdout.replace("No such", "")

    agent = client.api.inspect_container(started.agent_id)
    host = agent["HostConfig"]
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert not any("seccomp" in option for option in host["SecurityOpt"])  # default profile
    assert host["ReadonlyRootfs"] is True and host["Privileged"] is False
    assert host["PidsLimit"] == PIDS_LIMIT
    assert host["Memory"] == 512 * 1024 * 1024 and host["MemorySwap"] == host["Memory"]
    assert host["NanoCpus"] == 1_000_000_000
    assert host["NetworkMode"] == f"container:{started.pod.infra_id}"  # type: ignore[attr-defined]
    assert host["Runtime"] == started.runtime
    assert host["Tmpfs"]["/tmp"].startswith("rw,nosuid,nodev,size=500m,mode=1777")
    assert agent["Config"]["User"] == "1001:1001"
    sources = {m["Type"]: m for m in agent["Mounts"]}
    assert set(sources) == {"volume"}  # no bind mount at all
    assert {m["Destination"] for m in agent["Mounts"]} == {"/home/agent", "/opt/tools"}

    infra = client.api.inspect_container(started.pod.infra_id)  # type: ignore[attr-defined]
    assert infra["HostConfig"]["NetworkMode"] == "none"
    assert infra["HostConfig"]["CapDrop"] == ["ALL"] and infra["HostConfig"]["ReadonlyRootfs"]
    assert infra["HostConfig"]["Runtime"] == "runc"
    assert infra["Config"]["User"] == "65534:65534"
    assert infra["State"]["Pid"] == started.pod.infra_pid  # type: ignore[attr-defined]


def test_net_raw_only_when_asked(provider, client, image, crew) -> None:  # type: ignore[no-untyped-def]
    spec = spec_for(crew, image, net_raw=True)
    pod = provider.create_infra(spec)
    agent = provider.start_agent(spec, pod)
    assert client.api.inspect_container(agent)["HostConfig"]["CapAdd"] == ["NET_RAW"]
    status, _, _ = sh(provider, crew, "grep CapBnd /proc/self/status")
    assert int(status.split()[1], 16) == 1 << 13  # CAP_NET_RAW, nothing else


# --- the pod's network ----------------------------------------------------------------------------


class Listener:
    """A TCP listener on this host that records every connection and answers one line."""

    def __init__(self, address: str, port: int) -> None:
        self.hits: list[tuple[str, bytes]] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((address, port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn, peer = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(3)
                with contextlib.suppress(OSError):
                    data = conn.recv(1024)
                    self.hits.append((peer[0], data))
                    conn.sendall(b"welcome\n")

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=2)
        self.sock.close()


@pytest.mark.netns
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_pod_reaches_its_gateway_port_and_nothing_else(  # type: ignore[no-untyped-def]
    provider, client, image, crew, tmp_path: Path, runtime: str
) -> None:
    from appliance.runtime import launch_crew
    from netns import CrewNetworks, NetConfig
    from tests.test_netns_support import make_lab

    with make_lab(tmp_path) as lab:
        net = CrewNetworks(
            NetConfig(
                pool=lab.pool, table=lab.table, ifname_prefix=lab.prefix, proxy_ports=(lab.port,)
            ),
            lab.state_dir,
        )
        listeners: list[Listener] = []
        try:
            net.reconcile()
            networks = []
            _pod, _agent = launch_crew(
                provider,
                spec_for(crew, image, runtime),
                lambda pod: networks.append(net.attach(crew, pod.netns_path)),
            )
            network = networks[0]
            proxy = Listener(network.gateway, lab.port)
            other = Listener(network.gateway, lab.other_port)
            listeners += [proxy, other]
            stdout, _, _ = sh(provider, crew, "ip -o addr show; ip route")
            assert (
                f"inet {network.address}/30" in stdout
                and "default via " + network.gateway in stdout
            )
            assert "docker0" not in stdout and "172.17." not in stdout
            stdout, stderr, exited = sh(
                provider, crew, f"echo hello | nc -w 3 {network.gateway} {lab.port}"
            )
            assert exited.exit_code == 0 and stdout == "welcome\n", (stdout, stderr)
            assert proxy.hits == [(network.address, b"hello\n")]
            # Another port on the same host address: dropped by the host's rules (times out).
            started = time.monotonic()
            stdout, stderr, exited = sh(
                provider, crew, f"echo hello | nc -w 2 {network.gateway} {lab.other_port}"
            )
            assert exited.exit_code != 0 and stdout == "", (stdout, stderr)
            assert time.monotonic() - started < 10
            assert other.hits == []
            status = next(c for c in net.show().crews if c.crew == crew)
            assert status.dropped_packets >= 1 and status.accepted_packets >= 1
        finally:
            for listener in listeners:
                listener.close()
            with contextlib.suppress(Exception):
                net.detach(crew)
            provider.remove_crew(crew, volumes=True)
            net.close()


# --- exec -----------------------------------------------------------------------------------------


def test_exec_streams_lines_in_order_with_exit_codes(provider, started: Started) -> None:  # type: ignore[no-untyped-def]
    script = 'for i in $(seq 1 300); do echo "line $i"; done; echo oops >&2; printf tail; exit 7'
    stdout, stderr, exited = sh(provider, started.name, script)
    assert stdout == "".join(f"line {i}\n" for i in range(1, 301)) + "tail"
    assert stderr == "oops\n"
    assert exited.exit_code == 7 and not exited.timed_out
    stdout, _, exited = trio.run(
        lambda: run(provider, started.name, ["sh", "-c", 'echo "$ONE"'], env={"ONE": "1 2"})
    )
    assert stdout == "1 2\n" and exited.exit_code == 0
    # argv is passed as is: no shell word splitting or expansion of the caller's arguments.
    stdout, _, exited = trio.run(lambda: run(provider, started.name, ["echo", "$HOME", "a b"]))
    assert stdout == "$HOME a b\n"
    _, _, exited = trio.run(lambda: run(provider, started.name, ["false"]))
    assert exited.exit_code == 1


def test_exec_timeout_kills_the_process_and_its_children(provider, started: Started) -> None:  # type: ignore[no-untyped-def]
    began = time.monotonic()
    # A child that leaves the process group (setsid) is found by the exec's marker.
    stdout, _, exited = sh(
        provider, started.name, "setsid sleep 31 & echo started; sleep 30", timeout=1.0
    )
    elapsed = time.monotonic() - began
    assert exited.timed_out and exited.exit_code == -1
    assert stdout == "started\n"
    assert elapsed < 4, elapsed
    assert _gone(provider, started.name, ("sleep 30", "sleep 31"))


def test_exec_cancellation_kills_the_process(provider, started: Started) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import ExecOutput

    async def main() -> list[ExecOutput]:
        seen = []
        with trio.move_on_after(1.0):
            async for event in provider.exec(started.name, ["sh", "-c", "echo up; sleep 32"]):
                seen.append(event)
        return seen

    began = time.monotonic()
    seen = trio.run(main)
    assert seen == [ExecOutput("stdout", b"up\n")]
    assert time.monotonic() - began < 5
    assert _gone(provider, started.name, ("sleep 32",))

    async def stop_reading() -> None:
        events = provider.exec(started.name, ["sh", "-c", "echo up; sleep 33"])
        async for _ in events:
            break
        await events.aclose()  # the consumer stops: the process must not outlive it

    trio.run(stop_reading)
    assert _gone(provider, started.name, ("sleep 33",))


def _gone(provider, crew: str, commands: tuple[str, ...]) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 3
    while True:
        listing = processes(provider, crew)
        # The `ps` exec's own wrapper holds no such command; the engine's view agrees below.
        if not any(command in listing for command in commands):
            return True
        if time.monotonic() > deadline:
            raise AssertionError(f"still running: {listing}")
        time.sleep(0.1)


def _host_side_processes(client, started: Started) -> set[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """(pid, command) of every process in the agent container, seen from outside it: the
    engine's `top` for runc; for gVisor `runsc ps` against the engine's runtime state (the
    engine's `top` lists host processes, not the sandbox's: seen with runsc and Docker 20.10),
    which reads the sandbox's own process table and prints commands without arguments."""
    if started.runtime != "runsc":
        rows = client.api.top(started.agent_id)["Processes"]
        return {(row[1], " ".join(row[7:])) for row in rows}
    runsc = shutil.which("runsc")
    assert runsc is not None, "gVisor's runsc is not on PATH"
    # dockerd keeps each container's runtime state under <exec-root>/runtime-<runtime>/moby;
    # a gVisor container's is "<id>_sandbox:<id>.state".
    roots = {
        path.parent for path in Path("/run/docker").glob(f"runtime-*/*/*{started.agent_id}*.state")
    }
    assert len(roots) == 1, f"no single runtime root for {started.agent_id[:12]}: {roots}"
    out = subprocess.run(
        [runsc, "--root", str(roots.pop()), "ps", started.agent_id],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    return {(row[1], " ".join(row[7:])) for row in rows}


def test_engine_sees_no_leftover_process(provider, client, started: Started) -> None:  # type: ignore[no-untyped-def]
    """A cancelled exec leaves no process behind, as seen from outside the container."""
    before = _host_side_processes(client, started)

    def new_sleep() -> bool:
        return any(
            "sleep" in command for _, command in _host_side_processes(client, started) - before
        )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, provider, started.name, ["sleep", "34"])
            for _ in range(100):  # the control: the outside view does see it while it runs
                await trio.sleep(0.05)
                if await trio.to_thread.run_sync(new_sleep):
                    break
            else:
                raise AssertionError("the exec never appeared in the outside view")
            nursery.cancel_scope.cancel()

    trio.run(main)
    # Nothing but what ran before (the exec's own wrapper and the sleep are gone).
    deadline = time.monotonic() + 3
    while (left := _host_side_processes(client, started) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left


def test_exec_in_a_crew_without_agent(provider) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import CrewContainerError

    with pytest.raises(CrewContainerError, match="no running agent container"):
        trio.run(lambda: run(provider, "no-such-crew", ["true"]))


def test_exec_notices_an_agent_container_stopped_or_replaced_behind_its_back(  # type: ignore[no-untyped-def]
    provider, client, image, crew
) -> None:
    # The provider remembers the agent container's id (no engine listing per exec); a stale id
    # must never run the command elsewhere or hide that the crew has no agent.
    from appliance.runtime import CrewContainerError

    spec = spec_for(crew, image)
    pod = provider.create_infra(spec)
    first = provider.start_agent(spec, pod)
    assert trio.run(lambda: run(provider, crew, ["sh", "-c", "exit 3"]))[2].exit_code == 3
    client.api.stop(first, timeout=0)  # 409 "not running" for the remembered id
    with pytest.raises(CrewContainerError, match="no running agent container"):
        trio.run(lambda: run(provider, crew, ["true"]))
    client.api.remove_container(first, force=True)  # 404 for it now
    with pytest.raises(CrewContainerError, match="no running agent container"):
        trio.run(lambda: run(provider, crew, ["true"]))
    second = provider.start_agent(spec, pod)
    assert second != first
    # runc puts an exec in its container's cgroups, named by the container's id (cgroup v1 here)
    stdout, _, exited = trio.run(lambda: run(provider, crew, ["cat", "/proc/self/cgroup"]))
    assert exited.exit_code == 0 and second in stdout and first not in stdout, stdout


# --- removal, rollback, leftovers -----------------------------------------------------------------


def test_remove_crew_leaves_nothing_and_is_idempotent(provider, client, image, crew) -> None:  # type: ignore[no-untyped-def]
    spec = spec_for(crew, image)
    pod = provider.create_infra(spec)
    provider.start_agent(spec, pod)
    assert {c.role.value for c in provider.owned() if c.crew == crew} == {"infra", "agent"}
    provider.remove_crew(crew)
    assert [c for c in provider.owned() if c.crew == crew] == []
    # Volumes stay unless asked (the crew's home survives a restart of its containers).
    assert sorted(crew_leftovers(provider, client, crew)) == [
        f"volume appliance-{crew}-home.{INSTANCE}",
        f"volume appliance-{crew}-tools.{INSTANCE}",
    ]
    provider.remove_crew(crew)  # again: nothing to do, no error
    provider.remove_crew(crew, volumes=True)
    assert crew_leftovers(provider, client, crew) == []
    assert not os.path.exists(pod.netns_path)  # the infra's process is gone with it


def test_a_crew_is_created_once(provider, image, crew) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import CrewContainerError

    spec = spec_for(crew, image)
    provider.create_infra(spec)
    with pytest.raises(CrewContainerError, match="already has containers"):
        provider.create_infra(spec)


def test_failed_infra_start_is_rolled_back(client, image, crew) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import CrewContainerError
    from appliance.runtime.docker import DockerProvider

    broken = DockerProvider(client, instance=INSTANCE, infra_command=("/no/such/program",))
    with pytest.raises(CrewContainerError) as caught:
        broken.create_infra(spec_for(crew, image))
    assert caught.value.crew == crew and caught.value.step == "start infra container"
    assert caught.value.rollback_errors == ()
    assert crew_leftovers(broken, client, crew) == []


def test_failed_agent_creation_is_rolled_back(provider, client, image, crew) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import CrewContainerError, launch_crew

    spec = spec_for(crew, image)
    # A container squatting the agent's name makes the engine refuse the agent container,
    # after start_agent has created the crew's volumes.
    squatter = client.containers.create(image, ["true"], name=f"appliance-{crew}-agent.{INSTANCE}")
    try:
        # start_agent undoes its own work (the volumes it created); the infra is the caller's,
        # created by an earlier call...
        pod = provider.create_infra(spec)
        with pytest.raises(CrewContainerError) as caught:
            provider.start_agent(spec, pod)
        assert caught.value.step == "create agent container"
        assert "Conflict" in str(caught.value) or "already in use" in str(caught.value)
        assert crew_leftovers(provider, client, crew) == [f"container {pod.infra_id[:12]}"]
        provider.remove_crew(crew)
        # ... and launch_crew, which owns the whole sequence, removes the infra as well.
        attached: list[str] = []
        with pytest.raises(CrewContainerError):
            launch_crew(provider, spec, lambda pod: attached.append(pod.netns_path))
        assert len(attached) == 1
        assert crew_leftovers(provider, client, crew) == []
    finally:
        squatter.remove(force=True)


def test_launch_crew_rolls_back_when_the_attach_fails(provider, client, image, crew) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import launch_crew

    def attach(pod) -> None:  # type: ignore[no-untyped-def]
        raise OSError("the network step failed")

    with pytest.raises(OSError, match="network step failed"):
        launch_crew(provider, spec_for(crew, image), attach)
    assert crew_leftovers(provider, client, crew) == []


# --- instances ------------------------------------------------------------------------------------


def test_instances_see_and_remove_only_their_own(client, image) -> None:  # type: ignore[no-untyped-def]
    """Two providers of two instances on one engine, with a crew of the same name each: each
    lists, removes and names only its own; a container with the appliance's labels but no
    instance label (an appliance from before instance ids) is nobody's until adopted."""
    from appliance.runtime.base import LABEL_APPLIANCE, LABEL_CREW, LABEL_INSTANCE, LABEL_ROLE
    from appliance.runtime.docker import DockerProvider

    one = DockerProvider(client, instance=f"{INSTANCE}a")
    two = DockerProvider(client, instance=f"{INSTANCE}b")
    crew = new_crew()
    legacy = client.containers.create(
        image,
        ["sleep", "3600"],
        name=f"appliance-{crew}-infra",
        labels={LABEL_APPLIANCE: "applianced", LABEL_CREW: crew, LABEL_ROLE: "infra"},
    )
    try:
        for provider in (one, two):
            spec = spec_for(crew, image)
            provider.start_agent(spec, provider.create_infra(spec))
        mine = {p: {c.container_id for c in p.owned() if c.crew == crew} for p in (one, two)}
        assert len(mine[one]) == len(mine[two]) == 2 and not mine[one] & mine[two]
        for provider in (one, two):
            assert legacy.id not in {c.container_id for c in provider.owned()}
            assert (legacy.id, crew, None) in provider.unowned()
            labels = {
                c["Id"]: c["Labels"]
                for c in client.api.containers(all=True, filters={"id": sorted(mine[provider])})
            }
            assert {v[LABEL_INSTANCE] for v in labels.values()} == {provider.instance}
            names = {
                c["Names"][0]
                for c in client.api.containers(all=True, filters={"id": sorted(mine[provider])})
            }
            assert names == {
                f"/appliance-{crew}-infra.{provider.instance}",
                f"/appliance-{crew}-agent.{provider.instance}",
            }
        one.remove_crew(crew, volumes=True)
        assert [c for c in one.owned() if c.crew == crew] == []
        assert {c.container_id for c in two.owned() if c.crew == crew} == mine[two]
        assert sorted(two.owned_volumes()) == [
            f"appliance-{crew}-home.{two.instance}",
            f"appliance-{crew}-tools.{two.instance}",
        ]
        assert client.containers.get(legacy.id).status == "created"  # untouched
        # Adopted by id (the daemon's state names it), it is the instance's to list and remove.
        one.adopt({legacy.id}, {crew})
        assert [c.container_id for c in one.owned() if c.crew == crew] == [legacy.id]
        assert legacy.id not in {c.container_id for c in two.owned()}
        one.remove_crew(crew)
        assert legacy.id not in {c["Id"] for c in client.api.containers(all=True)}
        assert {c.container_id for c in two.owned() if c.crew == crew} == mine[two]
    finally:
        with contextlib.suppress(Exception):
            legacy.remove(force=True)
        two.remove_crew(crew, volumes=True)
        one.remove_crew(crew, volumes=True)


def test_a_crew_from_before_instance_ids_keeps_its_volumes(client, image) -> None:  # type: ignore[no-untyped-def]
    """An adopted crew's agent, re-created, mounts the volumes of its former names (its home
    survives the upgrade); a crew that is not adopted never gets them."""
    from appliance.runtime.base import LABEL_APPLIANCE, LABEL_CREW
    from appliance.runtime.docker import DockerProvider

    provider = DockerProvider(client, instance=f"{INSTANCE}c")
    crew = new_crew()
    old = {"/home/agent": f"appliance-{crew}-home", "/opt/tools": f"appliance-{crew}-tools"}
    for name in old.values():
        client.api.create_volume(name, labels={LABEL_APPLIANCE: "applianced", LABEL_CREW: crew})
    try:
        provider.adopt(set(), {crew})
        spec = spec_for(crew, image)
        agent = provider.start_agent(spec, provider.create_infra(spec))
        mounts = {
            m["Destination"]: m["Name"] for m in client.api.inspect_container(agent)["Mounts"]
        }
        assert mounts == old
        provider.remove_crew(crew, volumes=True)
        assert not {v["Name"] for v in client.api.volumes()["Volumes"] or []} & set(old.values())
    finally:
        provider.remove_crew(crew, volumes=True)
        for name in old.values():
            with contextlib.suppress(Exception):
                client.api.remove_volume(name, force=True)


def test_a_provider_without_instance_touches_nothing(client) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime import InvalidSpec
    from appliance.runtime.docker import DockerProvider

    bare = DockerProvider(client)
    assert "runc" in bare.runtimes()
    for call in (bare.owned, bare.owned_volumes, lambda: bare.remove_crew("x")):
        with pytest.raises(InvalidSpec, match="no instance id"):
            call()
    with pytest.raises(InvalidSpec, match="instance id"):
        DockerProvider(client, instance="Bad-Id")
    # applianced binds the id it reads from its state, once; never another after it.
    with pytest.raises(InvalidSpec, match="instance id"):
        bare.bind_instance("bad_id")
    bare.bind_instance(f"{INSTANCE}-z")
    bare.bind_instance(f"{INSTANCE}-z")
    assert bare.owned() == []
    with pytest.raises(InvalidSpec, match="instance"):
        bare.bind_instance(INSTANCE)


def test_runsc_processes_are_tied_to_their_container(provider, image, crew) -> None:  # type: ignore[no-untyped-def]
    from appliance.runtime.docker import runtime_processes

    spec = spec_for(crew, image, "runsc")
    pod = provider.create_infra(spec)
    agent = provider.start_agent(spec, pod)
    kinds = {p.kind for p in runtime_processes() if p.container_id == agent}
    assert {"runsc-sandbox", "runsc-gofer", "shim"} <= kinds, kinds
    assert all(p.container_id != agent for p in provider.stray_runsc_processes())
    provider.remove_crew(crew)
    deadline = time.monotonic() + 5
    while any(p.container_id == agent for p in runtime_processes()):
        assert time.monotonic() < deadline, "runsc processes outlived their container"
        time.sleep(0.1)


def test_register_runsc_keeps_the_rest_of_daemon_json(tmp_path: Path) -> None:
    import json

    from appliance.runtime.engine import RUNSC_RUNTIME, register_runsc

    daemon_json = tmp_path / "daemon.json"
    daemon_json.write_text(json.dumps({"log-level": "warn", "runtimes": {"other": {"path": "x"}}}))
    assert register_runsc(daemon_json) is True
    config = json.loads(daemon_json.read_text())
    assert config["log-level"] == "warn" and config["runtimes"]["other"] == {"path": "x"}
    assert config["runtimes"]["runsc"] == RUNSC_RUNTIME
    assert RUNSC_RUNTIME["runtimeArgs"] == ["--network=host"]
    assert register_runsc(daemon_json) is False  # already there: untouched
    missing = tmp_path / "new" / "daemon.json"
    assert register_runsc(missing) is True and "runsc" in missing.read_text()


def test_a_sandbox_whose_container_is_gone_is_killed_and_a_live_one_is_not(  # type: ignore[no-untyped-def]
    provider, image, crew
) -> None:
    # A failed runsc start can leave runsc-sandbox running with no container (docs/runtime.md);
    # it cannot be provoked on demand here, so a stand-in process carries the same command line
    # (program name and the bundle path naming a container id the engine does not have).
    import secrets
    import subprocess
    import sys

    gone = secrets.token_hex(32)
    bundle = f"/run/containerd/io.containerd.runtime.v2.task/moby/{gone}"
    # (the interpreter itself, not `python3`: a shim on PATH, pyenv's say, would exec the real
    # one under its own name)
    stand_in = f"exec -a runsc-sandbox {sys.executable} -c 'import time; time.sleep(60)' {bundle}"
    stray = subprocess.Popen(["bash", "-c", stand_in])
    spec = spec_for(crew, image, "runsc")
    agent = provider.start_agent(spec, provider.create_infra(spec))
    try:
        deadline = time.monotonic() + 5
        while not any(p.pid == stray.pid for p in provider.stray_runsc_processes()):
            # (another appliance's reconcile on this engine may kill it first: say so)
            assert stray.poll() is None, f"the stand-in died first ({stray.returncode})"
            assert time.monotonic() < deadline, "the stand-in was not seen as a stray"
            time.sleep(0.05)
        killed = provider.kill_stray_runsc_processes()
        assert stray.pid in {p.pid for p in killed}
        assert all(p.container_id != agent for p in killed)
        assert stray.wait(timeout=5) == -9
        ran = subprocess.run(
            ["docker", "exec", agent, "true"], capture_output=True, timeout=30, check=False
        )
        assert ran.returncode == 0, ran.stderr  # the live sandbox was left alone
    finally:
        stray.kill()
        provider.remove_crew(crew)


def test_another_pid_namespaces_shims_are_not_ours() -> None:
    """A Docker engine in a container (nested dockerd, a CI runner's, a test machine's) has
    shims that /proc shows here, naming container ids this engine does not know. Reconciliation
    kills strays of this engine only: such a shim, in another PID namespace with its parents, is
    not reported (killing it once broke a test machine's image build); the same process in this
    namespace is."""
    from appliance.runtime.docker import runtime_processes

    fake_id = "ab" * 32
    # A process whose command line is a moby shim's: argv[0] and `moby` and a 64-hex id.
    shim = f"exec -a containerd-shim-runc-v2 tail -F -- /dev/null moby {fake_id}"
    here = subprocess.Popen(["bash", "-c", shim], stderr=subprocess.DEVNULL)
    # There: not the namespace's init but its child, as a nested engine's shim is (its parent,
    # the nested init or containerd, is in that namespace too).
    there = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "bash",
            "-c",
            f"{shim} & wait",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        # Both running, as /proc shows them, before asking.
        deadline = time.monotonic() + 10
        while len(_fake_shims(fake_id)) < 2:
            assert time.monotonic() < deadline, _fake_shims(fake_id)
            time.sleep(0.05)
        assert here.pid in _fake_shims(fake_id)
        pids = {p.pid for p in runtime_processes() if p.container_id == fake_id}
        assert pids == {here.pid}, (pids, _fake_shims(fake_id))
    finally:
        for process in (here, there):
            process.kill()
            process.wait(timeout=10)


def _fake_shims(fake_id: str) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            cmdline = _cmdline(entry)
            if cmdline.startswith(b"containerd-shim") and fake_id.encode() in cmdline:
                found.add(int(entry.name))
    return found


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""
