"""applianced under the privileges its systemd unit grants, for real.

The unit (ansible/roles/appliance/templates/applianced.service.j2, docs/systemd.md) gives the
daemon a capability bounding set of its own, no_new_privs and a umask of 0077. This machine has
no systemd as PID 1, so these are applied by setpriv(1) and the shell instead, exactly as the
unit spells them (read from the template): the daemon then serves a crew end to end (veths,
nftables, setns into the crew's namespace, the engine, the proxy workers' drop, a credential
injected), restarts a killed worker, stops cleanly, and at a second start adopts the running
crew (which opens /proc/PID/ns/net of the infra container's process again). The workers it
starts hold no capability at all and no_new_privs (/proc/PID/status, proc(5)).

The second run ("whole-unit") adds, in systemd's order, the unit's mount namespace (unshare(1):
the root read-only as `ProtectSystem=strict` and `ProtectHome=read-only` make it, the state and
run directories bound writable as `ReadWritePaths=` and `RuntimeDirectory=` do, a /proc with
hidepid=invisible as `ProtectProc=invisible`) and its seccomp filter, built from the template
by tests/unit_seccomp.py with libseccomp and systemd's own system call groups
(`SystemCallFilter=@system-service`, `SystemCallErrorNumber=EPERM`, `RestrictAddressFamilies=`,
`RestrictNamespaces=net`, `MemoryDenyWriteExecute=`, `RestrictSUIDSGID=` on chmod,
`LockPersonality=`). These are emulations of what systemd does, not systemd: the unit itself
has not been started by systemd here (docs/systemd.md says what is left).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.demo_upstream import FakeServer
from proxycore.privileges import CAPABILITY_FIELDS, process_status
from tests.conftest import REAL_KEYS, ROOT
from tests.daemon_support import REACH_TEST_HOSTS, Appliance

pytestmark = pytest.mark.docker

UNIT = ROOT / "ansible" / "roles" / "appliance" / "templates" / "applianced.service.j2"
# capabilities(7) numbers (linux/capability.h) of the capabilities the unit may name.
CAPABILITY_NUMBERS = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_DAC_READ_SEARCH": 2,
    "CAP_FOWNER": 3,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_NET_ADMIN": 12,
    "CAP_NET_RAW": 13,
    "CAP_SYS_CHROOT": 18,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
}
WORKER_UNPRIVILEGED = {
    "Uid": "1002\t1002\t1002\t1002",
    "NoNewPrivs": "1",
    **{field: "0000000000000000" for field in CAPABILITY_FIELDS},
}


def unit_directives() -> dict[str, str]:
    """The [Service] directives of the template that hold no Jinja (those are the sandbox's)."""
    directives: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#") and "{{" not in value:
            directives[key.strip()] = value.strip()
    return directives


# ProtectSystem=strict (with ProtectHome=read-only: the whole root read-only), ReadWritePaths= and
# RuntimeDirectory= (bind mounts made writable again), ProtectProc=invisible (a procfs of its
# own with hidepid=invisible), in a mount namespace whose mounts the host does not see
# (PrivateMounts=). On this machine every path is on the root file system.
def mount_wrapper(writable: list[Path]) -> list[str]:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    script = "\n".join(
        [
            "set -e",
            *(f"mkdir -p '{path}'" for path in writable),
            "mount -o remount,bind,ro /",
            *(
                f"mount --bind '{path}' '{path}' && mount -o remount,bind,rw '{path}'"
                for path in writable
            ),
            "mount -t proc -o hidepid=invisible proc /proc",
            'exec "$@"',
        ]
    )
    return [unshare, "--mount", "--propagation", "slave", "--", "/bin/sh", "-c", script, "mounts"]


def sandbox_wrapper(writable: list[Path], whole_unit: bool) -> tuple[list[str], int]:
    """The argv prefix that gives its command the unit's privileges (with `whole_unit`, also
    its mount namespace and its system call filter: tests/unit_seccomp.py); the CapBnd it must
    have."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    unit = unit_directives()
    names = unit["CapabilityBoundingSet"].split()
    unknown = [name for name in names if name not in CAPABILITY_NUMBERS]
    assert not unknown, f"add {unknown} to CAPABILITY_NUMBERS"
    assert unit["NoNewPrivileges"] == "yes" and unit["AmbientCapabilities"] == ""
    mask = sum(1 << CAPABILITY_NUMBERS[name] for name in names)
    caps = ",".join(f"+{name.removeprefix('CAP_').lower()}" for name in names)
    wrapper: list[str] = []
    if whole_unit:
        if shutil.which("systemd-analyze") is None:
            pytest.skip("systemd-analyze (Debian package systemd) lists the unit's system calls")
        assert unit["ProtectSystem"] == "strict" and unit["ProtectProc"] == "invisible"
        wrapper += mount_wrapper(writable)
    wrapper += [
        setpriv,
        f"--bounding-set=-all,{caps}",
        "--inh-caps=-all",
        "--no-new-privs",
        "--",
    ]
    if whole_unit:
        wrapper += [sys.executable, str(ROOT / "tests" / "unit_seccomp.py"), "--unit", str(UNIT)]
        wrapper += ["--"]
    wrapper += [
        "/bin/sh",
        "-c",
        f'umask {unit["UMask"]} && exec "$@"',
        "applianced",
    ]
    return wrapper, mask


def daemon_status(app: Appliance) -> dict:
    code, answer = app.ctl_json("status")
    assert code in (0, 9), answer  # 9: a part is down (a worker restarting)
    return dict(answer)


def wait_workers(app: Appliance, count: int, not_in: tuple[int, ...] = ()) -> tuple[int, ...]:
    deadline = time.monotonic() + 30
    while True:
        pids = tuple(daemon_status(app)["proxy_pids"])
        if len(pids) == count and not set(pids) & set(not_in):
            return pids
        assert time.monotonic() < deadline, (pids, app.log_text()[-3000:])
        time.sleep(0.1)


def assert_unprivileged(pid: int) -> None:
    fields = process_status(pid)
    assert {key: fields[key] for key in WORKER_UNPRIVILEGED} == WORKER_UNPRIVILEGED, pid


def call_provider(app: Appliance, crew: str, provider: FakeServer) -> None:
    provider.clear()
    run = app.ctl(
        "run", crew, "--", "sh", "-c", 'wget -Y off -q -O- "$ANTHROPIC_BASE_URL/v1/models"'
    )
    assert run.returncode == 0, (run.stderr, app.log_text()[-3000:])
    assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]


@pytest.mark.parametrize("whole_unit", [False, True], ids=["capabilities", "whole-unit"])
def test_applianced_serves_with_only_the_units_privileges(
    appliance: Appliance, provider: FakeServer, plain_host: FakeServer, whole_unit: bool
) -> None:
    app = appliance
    # The test instance's ReadWritePaths (its state directory) and RuntimeDirectory (its admin
    # socket's directory, and the keeper's run_dir, the default).
    writable = [app.state_dir, app.socket.parent, Path("/run/agent-appliance-keeper")]
    wrapper, mask = sandbox_wrapper(writable, whole_unit)
    seccomp = whole_unit
    app.start(wrapper=wrapper)
    assert app.process is not None
    fields = process_status(app.process.pid)
    assert "python" in Path(f"/proc/{app.process.pid}/exe").resolve().name
    for field in ("CapBnd", "CapPrm", "CapEff"):
        assert int(fields[field], 16) == mask, (field, fields[field], hex(mask))
    assert fields["NoNewPrivs"] == "1"
    # With the filter: mode 2 (SECCOMP_MODE_FILTER, proc(5)), and the workers inherit it.
    assert fields["Seccomp"] == ("2" if seccomp else "0")
    if whole_unit:
        # Its own mount namespace: the root read-only, the state writable, /proc hidepid.
        pid = app.process.pid
        assert os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
        mounts = {
            line.split()[4]: line.split()
            for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        }
        assert mounts["/"][5].startswith("ro"), mounts["/"]
        assert mounts[str(app.state_dir)][5].startswith("rw"), mounts[str(app.state_dir)]
        assert "hidepid=invisible" in " ".join(mounts["/proc"]), mounts["/proc"]
    # The umask reached it: what it creates is its own (the state directory's files).
    assert (app.state_dir / "applianced.lock").stat().st_mode & 0o077 == 0

    workers = wait_workers(app, 2)
    for pid in workers:
        assert_unprivileged(pid)
        assert process_status(pid)["Seccomp"] == ("2" if seccomp else "0")

    crew = app.crew("units")
    code, created = app.ctl_json(
        "crew", "create", crew, *REACH_TEST_HOSTS, "--mode", "restricted", "--allow", "plain.test"
    )
    assert code == 0, (created, app.log_text()[-3000:])
    gateway = created["crew"]["gateway"]
    call_provider(app, crew, provider)
    raw = (
        f"printf 'GET http://other.test:{app.plain_port}/x HTTP/1.1\\r\\nHost: other.test\\r\\n"
        f"Connection: close\\r\\n\\r\\n' | nc {gateway} {app.port}"
    )
    denied = app.ctl("run", crew, "--", "sh", "-c", raw)
    assert "403" in denied.stdout.splitlines()[0], denied.stdout

    # applianced kills its workers when one stops answering or a credential push fails (they
    # restart with the whole state: fail closed). They are another UID: that takes CAP_KILL
    # (kill(2)). A process with exactly the unit's privileges may signal them:
    probe = [*wrapper, sys.executable, "-c", "import os, sys; os.kill(int(sys.argv[1]), 0)"]
    for pid in workers:
        done = subprocess.run([*probe, str(pid)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr

    # A worker killed: applianced (still inside the set) starts another that drops again.
    os.kill(workers[0], signal.SIGKILL)
    again = wait_workers(app, 2, not_in=(workers[0],))
    for pid in again:
        assert_unprivileged(pid)
    call_provider(app, crew, provider)

    # A clean stop: applianced signals its workers (another UID: CAP_KILL).
    app.stop()
    assert app.process.returncode == 0, app.log_text()[-3000:]
    for pid in again:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in process_status(pid)["State"]

    # The second start adopts the running crew: setns into its namespace through
    # /proc/PID/ns/net of the infra process (UID 65534: CAP_SYS_PTRACE).
    app.start(wrapper=wrapper)
    code, shown = app.ctl_json("crew", "show", crew)
    assert code == 0 and shown["crew"]["phase"] == "ready", shown
    call_provider(app, crew, provider)
    code, removed = app.ctl_json("crew", "rm", crew)
    assert code == 0, (removed, app.log_text()[-3000:])
    assert not any(crew in name for name in app.containers())
    app.stop()
    assert app.process.returncode == 0, app.log_text()[-3000:]


def test_build_images_step_with_configured_images(appliance: Appliance) -> None:
    """`applianced --build-images` (the unit's ExecStartPre) with the images configured: it
    finds them and exits 0 at once; it does not start a daemon."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "appliance.daemon.main",
            "--config",
            str(appliance.config),
            "--build-images",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "applianced: images ready: agent " in done.stdout
    assert not appliance.socket.exists()


def test_the_sandboxed_daemon_finds_the_images_the_build_step_built(tmp_path: Path) -> None:
    """The unit's two steps with the real images: `applianced --build-images` outside the
    sandbox (the ExecStartPre, which builds them if missing), then the lookup the sandboxed
    daemon makes at start (the engine's CLI, `docker image inspect`) inside the whole unit's
    emulation: it must find them and build nothing (a build there would fail)."""
    from tests.daemon_support import needs_root_and_docker

    needs_root_and_docker()
    config = tmp_path / "appliance.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n')
    step = subprocess.run(
        [sys.executable, "-m", "appliance.daemon.main", "--config", str(config), "--build-images"],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert step.returncode == 0, step.stdout + step.stderr
    wrapper, _ = sandbox_wrapper([tmp_path / "state"], whole_unit=True)
    lookup = "from images.build import ensure_images; print(ensure_images().agent)"
    found = subprocess.run(
        [*wrapper, sys.executable, "-c", lookup],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert found.returncode == 0, found.stderr
    assert f"agent {found.stdout.strip()}," in step.stdout, (step.stdout, found.stdout)
