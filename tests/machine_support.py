"""A systemd-booted Debian 12 machine for the provisioning test (tests/test_provision.py).

The machine is a Docker container whose PID 1 is systemd, made from Debian's archive here:

- `machine_image()`: `debootstrap --variant=minbase` of bookworm with systemd, dbus,
  openssh-server and python3 (what Ansible needs on a target), a unit that makes the cgroup v1
  controllers writable for a nested dockerd, then `docker import`, tagged by the hash of this
  recipe, so a second run of the suite reuses it (about 60-90 s to build, mostly the archive).
- `Machine`: one booted container. It runs with every capability this host's bounding set has
  (CAP_SYS_RESOURCE is not in it here), no seccomp or AppArmor profile and a private cgroup
  namespace: what systemd, a nested dockerd, applianced's network namespaces and nftables need.
  It is never `--privileged` and never sees the host's /sys/fs/cgroup read-write: a privileged
  systemd container once remounted the host's cgroup tmpfs read-only here. Its /var/lib/docker
  is a volume of its own (overlayfs cannot stack on the container's overlay root).
- Ansible reaches it the way it reaches a real host: over SSH as root, with a key made for the
  test, at the container's address on Docker's bridge (ansible-core's own ssh connection; no
  collection needed).

`python -m tests.machine_support build|boot` builds the image, or boots one machine and prints
how to reach it (for trying the role by hand; `docker rm -f -v NAME` ends it).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPOSITORY = "agent-appliance-test/machine"
SUITE = "bookworm"
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-apt",
    "iproute2",
    "ca-certificates",
    "procps",
)
# Docker mounts the cgroup v1 controllers and /proc/sys read-only in a container that is not
# privileged; a nested dockerd must create cgroups, and set its network's sysctls (route_localnet
# for userland-proxy=false, ip_forward), as must applianced for its crews. This unit remounts the
# container's own view of them read-write before docker or containerd start (the container's
# mount namespace only: the host's mounts are untouched). Of /proc/sys only net/ is made
# writable: its files are the container's own network namespace's, while kernel/, vm/ and the
# rest are the host's.
CGROUP_UNIT = """\
[Unit]
Description=Make this container's cgroups and network sysctls writable for a nested dockerd
DefaultDependencies=no
Before=containerd.service docker.service sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'for d in /sys/fs/cgroup /sys/fs/cgroup/*; do mountpoint -q "$d" && mount -o remount,bind,rw "$d"; done; true'
ExecStart=/bin/sh -c 'mount --bind /proc/sys/net /proc/sys/net && mount -o remount,bind,rw /proc/sys/net'

[Install]
WantedBy=sysinit.target
"""  # noqa: E501
# Units that have nothing to do in a container (no consoles, no udev, no kernel modules).
MASKED = (
    "getty@tty1.service",
    "console-getty.service",
    "serial-getty@.service",
    "systemd-udevd.service",
    "systemd-udev-trigger.service",
    "systemd-modules-load.service",
    "sys-kernel-config.mount",
    "sys-kernel-debug.mount",
    "sys-kernel-tracing.mount",
    "systemd-firstboot.service",
)


def recipe_hash() -> str:
    document = {
        "suite": SUITE, "packages": PACKAGES, "cgroup": CGROUP_UNIT, "masked": MASKED,
        "dpkg": "force-unsafe-io",
    }  # fmt: skip
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:12]


def image_tag() -> str:
    return f"{REPOSITORY}:{SUITE}-{recipe_hash()}"


def _run(argv: list[str], timeout: float = 600, **kwargs: object) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return str(done.stdout)


def machine_image() -> str:
    """The machine's image tag, built now unless this recipe's image is there."""
    tag = image_tag()
    if subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory(prefix="machine-", dir="/var/tmp") as work:
        tree = Path(work) / "tree"
        _run(
            [
                "unshare", "--mount", "--propagation", "private",
                "debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
                SUITE, str(tree),
            ],
            timeout=900,
        )  # fmt: skip
        unit = tree / "etc/systemd/system/cgroup-rw.service"
        unit.write_text(CGROUP_UNIT)
        wants = tree / "etc/systemd/system/sysinit.target.wants"
        wants.mkdir(parents=True, exist_ok=True)
        (wants / "cgroup-rw.service").symlink_to("/etc/systemd/system/cgroup-rw.service")
        for name in MASKED:
            masked = tree / "etc/systemd/system" / name
            masked.unlink(missing_ok=True)
            masked.symlink_to("/dev/null")
        # dpkg without fsync (as Docker's own Debian images do): the machine is thrown away
        # after the test, and its apt runs beside the rest of the suite (make unit), whose
        # timings an fsync storm would stretch.
        (tree / "etc/dpkg/dpkg.cfg.d/unsafe-io").write_text("force-unsafe-io\n")
        # A new machine id at every boot (systemd writes one when the file is empty).
        (tree / "etc/machine-id").write_text("")
        (tree / "etc/hostname").write_text("machine\n")
        (tree / "root/.ssh").mkdir(mode=0o700, exist_ok=True)
        for cache in (tree / "var/cache/apt/archives").glob("*.deb"):
            cache.unlink()
        archive = subprocess.Popen(["tar", "-C", str(tree), "-c", "."], stdout=subprocess.PIPE)
        _run(
            [
                "docker", "import",
                "--change", 'CMD ["/sbin/init"]',
                "-", tag,
            ],
            stdin=archive.stdout,
        )  # fmt: skip
        archive.wait()
        # The tree holds device nodes and root-owned files: remove it as root, now.
        shutil.rmtree(tree, ignore_errors=True)
    return tag


class Machine:
    """One booted machine: `with Machine(key) as machine:` boots it and removes it after."""

    def __init__(self, public_key: str, name: str | None = None) -> None:
        self.public_key = public_key
        self.name = name or f"appliance-machine-{uuid.uuid4().hex[:8]}"
        self.address = ""

    def boot(self, timeout: float = 120) -> None:
        image = machine_image()
        _run(
            [
                "docker", "create", "--name", self.name, "--hostname", "machine",
                "--cap-add", "ALL", "--cap-drop", "SYS_RESOURCE",
                "--security-opt", "seccomp=unconfined",
                "--security-opt", "apparmor=unconfined",
                "--cgroupns", "private",
                # A quarter of the default CPU weight: when the rest of the suite runs beside
                # the provisioning test (make unit), the suite's processes come first.
                "--cpu-shares", "256",
                # systemd's own request for a clean shutdown (docker import cannot record it).
                "--stop-signal", "SIGRTMIN+3",
                "--tmpfs", "/run", "--tmpfs", "/run/lock", "--tmpfs", "/tmp:exec",
                "-v", "/var/lib/docker",
                "--label", "agent-appliance-test=machine",
                image,
            ]
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as work:
            keys = Path(work) / "authorized_keys"
            keys.write_text(self.public_key.strip() + "\n")
            keys.chmod(0o600)
            _run(["docker", "cp", str(keys), f"{self.name}:/root/.ssh/authorized_keys"])
        # The machine trusts what this host trusts: a site whose traffic to the package
        # registries passes a TLS-inspecting proxy has its CA in /usr/local/share/ca-certificates
        # and npm told to use the system's bundle (/etc/npmrc), and a host provisioned there
        # would be given the same. Nothing else of the host's goes in.
        for site_ca in sorted(Path("/usr/local/share/ca-certificates").glob("*.crt")):
            _run(["docker", "cp", str(site_ca), f"{self.name}:{site_ca}"])
        if Path("/etc/npmrc").is_file():
            _run(["docker", "cp", "/etc/npmrc", f"{self.name}:/etc/npmrc"])
        _run(["docker", "start", self.name])
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            done = subprocess.run(
                ["docker", "exec", self.name, "systemctl", "is-system-running"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            state = done.stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"machine {self.name} did not boot ({state!r}):\n{self.logs()}")
        self.exec("update-ca-certificates")
        self.address = _run(
            [
                "docker", "inspect", "-f",
                "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", self.name,
            ]
        ).strip()  # fmt: skip

    def exec(self, *argv: str, timeout: float = 120, check: bool = True) -> str:
        done = subprocess.run(
            ["docker", "exec", self.name, *argv], capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} in {self.name} exited {done.returncode}:\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def failed_units(self) -> str:
        return self.exec("systemctl", "--failed", "--no-legend", check=False)

    def logs(self) -> str:
        done = subprocess.run(
            ["docker", "logs", "--tail", "60", self.name], capture_output=True, text=True
        )
        return done.stdout + done.stderr

    def remove(self) -> None:
        subprocess.run(["docker", "rm", "-f", "-v", self.name], capture_output=True, timeout=120)

    def __enter__(self) -> Machine:
        try:
            self.boot()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        print(machine_image())
        return 0
    if argv[:1] == ["boot"]:
        key = Path(argv[1]).read_text() if len(argv) > 1 else ""
        machine = Machine(key)
        machine.boot()
        print(f"{machine.name} at {machine.address}; failed units:\n{machine.failed_units()}")
        return 0
    print("usage: python -m tests.machine_support build | boot [PUBLIC_KEY_FILE]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
