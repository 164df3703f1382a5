"""`appliancectl doctor`: is this host able to run the appliance? Each check is run and reported;
a failed required check makes the command exit 1, and every failed check carries a hint: the
command or the setting that fixes it.

    root            applianced needs it (netlink, nftables, the engine)
    engine          a Docker engine answers (appliance/runtime/engine.py: every address tried)
    runtime NAME    every runtime the appliance knows (runc, runsc, kata-runtime, sysbox-runc,
                    crun): available or why not; runc and the configured default are required;
                    runsc registered with --network=host (docs/runtime.md)
    image KIND      the agent and infra images exist in the engine (applianced never pulls)
    nftables        the nft command, libnftables (netns/ drives it through ctypes), a listing
    netns, veth, overlayfs, seccomp, cgroups     the kernel features crews are made of
    address pool    the configured pool collides with nothing on this host
    forwarding      what a crew's address allow rules need for traffic past the proxy: the
                    host forwards, and an iptables FORWARD policy of DROP (Docker's) lets the
                    crews' interfaces through DOCKER-USER (optional: crews without such rules
                    need neither; docs/netns.md "Address rules")
    proxy identity  the workers' uid is theirs alone

The checks read the host as it is now and change nothing that outlives them (the veth probe
lives in a throwaway network namespace that disappears with its process).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from typing import Any

import msgspec

from .config import ApplianceConfig


class Check(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    required: bool
    detail: str
    # What fixes it (a command, a setting); set on every check that failed.
    hint: str = ""


class Report(msgspec.Struct, frozen=True):
    ok: bool
    checks: tuple[Check, ...]


def _run(*argv: str) -> tuple[bool, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    out = (done.stdout + done.stderr).strip()
    return done.returncode == 0, out.splitlines()[-1] if out else ""


ENGINE_HINT = (
    "start the engine: systemctl start docker (a host without an init system: scripts/install "
    "starts dockerd); or set DOCKER_HOST to the engine's socket"
)
RUNTIME_HINTS = {
    "runc": "apt-get install runc (docker.io depends on it), then restart dockerd",
    "runsc": "apt-get install runsc and register it in /etc/docker/daemon.json as "
    '"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=host"]}, then reload '
    "dockerd (scripts/install or ansible/ do both)",
    "kata-runtime": "Kata Containers is not packaged in Debian 12: install it from its project, "
    "register kata-runtime in /etc/docker/daemon.json, reload dockerd (optional)",
    "sysbox-runc": "sysbox is not packaged in Debian 12: install it from its project, register "
    "sysbox-runc in /etc/docker/daemon.json, reload dockerd (optional)",
    "crun": "apt-get install crun and register it in /etc/docker/daemon.json; crun 1.8 needs the "
    "unified cgroup hierarchy (systemd.unified_cgroup_hierarchy=1) (optional)",
}


def _engine(config: ApplianceConfig) -> list[Check]:
    if config.daemon.provider != "docker":
        from .main import load_provider

        try:
            provider = load_provider(config)
            runtimes = provider.runtimes()
        except Exception as exc:
            return [
                Check(
                    "provider",
                    False,
                    True,
                    f"{config.daemon.provider}: {exc}",
                    "check [daemon] provider: a module:factory that returns a RuntimeProvider",
                )
            ]
        return [
            Check(
                "provider", True, True, f"{config.daemon.provider} (isolated: {provider.isolated})"
            ),
            Check(
                "runtimes",
                bool(runtimes),
                True,
                "available: " + ", ".join(runtimes),
                "" if runtimes else "the provider reports no runtime",
            ),
        ]
    from appliance.runtime.docker import DockerProvider
    from appliance.runtime.engine import detect_engine

    try:
        client, report = detect_engine()
        status = DockerProvider(client).runtime_status()
        registered = client.info().get("Runtimes") or {}
    except Exception as exc:  # EngineUnavailable lists every address tried and why
        return [Check("engine", False, True, " ".join(str(exc).split()), ENGINE_HINT)]
    checks = [
        Check(
            "engine",
            True,
            True,
            f"Docker {report.server_version} (API {report.api_version}) at {report.address}",
        )
    ]
    default = config.crews.default_runtime
    for runtime, state in status.items():
        ok = state == "available"
        hint = "" if ok else RUNTIME_HINTS.get(runtime, "register it in /etc/docker/daemon.json")
        detail = state
        if runtime == "runsc" and ok:
            args = (registered.get("runsc") or {}).get("runtimeArgs") or []
            if "--network=host" not in args:
                # Without it the sandbox cannot join the crew's namespace (docs/runtime.md).
                ok, detail = False, f"registered without --network=host (runtimeArgs {args})"
                hint = RUNTIME_HINTS["runsc"]
        # runc is required (the infra container always runs on it), and so is the default.
        required = runtime in ("runc", default)
        if runtime == default:
            detail += " ([crews] default_runtime)"
        checks.append(Check(f"runtime {runtime}", ok, required, detail, hint))
    checks += _images(config, client)
    return checks


def _images(config: ApplianceConfig, client: Any) -> list[Check]:
    import docker.errors

    from .preflight import image_state, missing_build_tools

    checks = []
    for kind in ("agent", "infra"):
        named = getattr(config.images, kind)
        try:
            if named:
                try:
                    client.images.get(named)
                    checks.append(Check(f"image {kind}", True, True, f"{named} ([images] {kind})"))
                except docker.errors.ImageNotFound:
                    checks.append(
                        Check(
                            f"image {kind}",
                            False,
                            True,
                            f"{named} ([images] {kind}) is not in the engine",
                            "applianced never pulls: build it (make images) or name an image "
                            "that exists (docker image ls)",
                        )
                    )
                continue
            tag, state = image_state(client, kind)
        except Exception as exc:  # the engine's error, or a recipe that cannot be read
            checks.append(
                Check(
                    f"image {kind}",
                    False,
                    True,
                    f"cannot tell: {exc}",
                    "python -m images.build --tags",
                )
            )
            continue
        if state == "current":
            checks.append(Check(f"image {kind}", True, True, f"{tag} (this recipe's)"))
            continue
        tools = missing_build_tools()
        checks.append(
            Check(
                f"image {kind}",
                False,
                # applianced builds it at start when it can; without the tools it cannot start.
                bool(tools),
                f"{tag} is {state}"
                + (f"; the build needs {', '.join(tools)}" if tools else "; built at start"),
                "make images (python -m images.build) builds it ahead"
                + (f"; first install {', '.join(tools)}" if tools else ""),
            )
        )
    return checks


def _probe(name: str, script: str, ok_detail: str, hint: str) -> Check:
    ok, out = _run("unshare", "--net", "sh", "-c", script)
    return Check(name, ok, True, ok_detail if ok else out or "failed", "" if ok else hint)


def _kernel() -> list[Check]:
    checks = [
        _probe(
            "netns",
            "ip link show lo >/dev/null",
            "a new network namespace (unshare --net)",
            "the kernel needs CONFIG_NET_NS, and the caller CAP_SYS_ADMIN (run as root; inside a "
            "container: --cap-add SYS_ADMIN)",
        ),
        _probe(
            "veth",
            "ip link add dr0 type veth peer name dr1 && ip link show dr0 >/dev/null",
            "created a veth pair in a new namespace",
            "modprobe veth (CONFIG_VETH); iproute2 installed (apt-get install iproute2)",
        ),
    ]
    with open("/proc/filesystems") as file:
        filesystems = file.read()
    overlay = "overlay" in filesystems
    checks.append(
        Check(
            "overlayfs",
            overlay,
            True,
            "in /proc/filesystems" if overlay else "not in /proc/filesystems",
            "" if overlay else "modprobe overlay (CONFIG_OVERLAY_FS): Docker's overlay2 needs it",
        )
    )
    # Filter mode (what Docker's default profile and no-new-privileges rely on): the kernel
    # lists the filter actions it supports only when built with CONFIG_SECCOMP_FILTER.
    try:
        with open("/proc/sys/kernel/seccomp/actions_avail") as file:
            actions = file.read().split()
    except OSError:
        actions = []
    seccomp = "errno" in actions
    checks.append(
        Check(
            "seccomp",
            seccomp,
            True,
            f"filter actions: {' '.join(actions)}" if seccomp else "no seccomp filter support",
            "" if seccomp else "a kernel built with CONFIG_SECCOMP_FILTER (Debian's is)",
        )
    )
    cgroups = os.path.isdir("/sys/fs/cgroup") and bool(os.listdir("/sys/fs/cgroup"))
    checks.append(
        Check(
            "cgroups",
            cgroups,
            True,
            "/sys/fs/cgroup mounted" if cgroups else "/sys/fs/cgroup is empty or missing",
            ""
            if cgroups
            else "mount the cgroup hierarchy (an init system does; without one: "
            "mount -t cgroup2 none /sys/fs/cgroup)",
        )
    )
    return checks


def _nftables(config: ApplianceConfig) -> list[Check]:
    if shutil.which("nft") is None:
        return [
            Check(
                "nftables",
                False,
                True,
                "the nft command is not installed",
                "apt-get install nftables",
            )
        ]
    try:
        ctypes.CDLL("libnftables.so.1")
    except OSError as exc:
        return [
            Check(
                "nftables",
                False,
                True,
                f"libnftables cannot be loaded: {exc}",
                "apt-get install libnftables1 (with nftables)",
            )
        ]
    ok, out = _run("nft", "list", "tables")
    return [
        Check(
            "nftables",
            ok,
            True,
            f"nft and libnftables work; the appliance's table is inet {config.net.table}"
            if ok
            else out,
            "" if ok else "modprobe nf_tables (CONFIG_NF_TABLES), and run as root (CAP_NET_ADMIN)",
        )
    ]


def _forwarding(config: ApplianceConfig) -> Check:
    prefix = config.net.ifname_prefix
    name = "forwarding"
    try:
        with open("/proc/sys/net/ipv4/conf/all/forwarding") as file:
            forwarding = file.read().strip() == "1"
    except OSError:
        forwarding = False
    if not forwarding:
        return Check(
            name,
            False,
            False,
            "the host does not forward IPv4: a crew's address allow rules reach nothing past "
            "the host (its proxy traffic is unaffected)",
            "sysctl -w net.ipv4.ip_forward=1 (the appliance's table still drops everything a "
            "crew may not send; only its allow rules are forwarded)",
        )
    if shutil.which("iptables") is None:
        return Check(name, True, False, "the host forwards IPv4; no iptables to check")

    def rules(chain: str) -> list[str]:
        try:
            done = subprocess.run(
                ["iptables", "-w", "-S", chain], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.TimeoutExpired):
            return []
        return done.stdout.splitlines()

    if "-P FORWARD DROP" not in rules("FORWARD"):
        return Check(name, True, False, "the host forwards IPv4; iptables FORWARD accepts")
    user = rules("DOCKER-USER")
    out = any(f"-i {prefix}+" in line and "-j ACCEPT" in line for line in user)
    back = any(
        f"-o {prefix}+" in line and "ESTABLISHED" in line and "-j ACCEPT" in line for line in user
    )
    if out and back:
        return Check(name, True, False, f"forwarding on; DOCKER-USER lets {prefix}+ through")
    return Check(
        name,
        False,
        False,
        "the iptables FORWARD policy is DROP (Docker's): a crew's address allow rules reach "
        "nothing past the host",
        f"iptables -I DOCKER-USER -i {prefix}+ -j ACCEPT; iptables -I DOCKER-USER -o {prefix}+ "
        "-m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT (the appliance's table has "
        "already judged those packets: these widen nothing it refuses)",
    )


def _pool(config: ApplianceConfig) -> Check:
    from netns.addressing import parse_pool, pool_conflicts
    from netns.kernel import HostNetwork

    pool = parse_pool(config.net.pool)
    host = HostNetwork()
    try:
        with host.session():
            conflicts = pool_conflicts(pool, host.host_uses(config.net.ifname_prefix))
    except Exception as exc:
        return Check(
            "address pool",
            False,
            True,
            f"cannot read the host's addresses: {exc}",
            "run as root with iproute2 installed",
        )
    finally:
        host.close()
    if conflicts:
        return Check(
            "address pool",
            False,
            True,
            f"{pool} collides: " + "; ".join(conflicts),
            "choose a free private range for [net] pool in the configuration",
        )
    return Check("address pool", True, True, f"{pool} is free on this host")


# The system account (no login, no home) that ansible/ creates to reserve the workers' ids.
PROXY_ACCOUNT = "appliance-proxy"


def _uids(pid: str) -> list[int]:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return [int(field) for field in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def _is_worker(pid: str) -> bool:
    """A proxy worker: started by a root process as `proxycore.worker ... --drop-to` (in the
    artifact, `agent-appliance proxy-worker ... --drop-to`: appliance/entry.py)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = file.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as file:
            parent = file.read().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return False
    named = b"proxycore.worker" in argv or argv[1:2] == [b"proxy-worker"]
    return named and b"--drop-to" in argv and _uids(parent)[:1] == [0]


def _proxy_identity(config: ApplianceConfig) -> Check:
    """The workers' uid must be theirs alone: any other process with it could signal them (stop,
    kill) and read whatever they leave readable to their uid. Not required: an account holding
    the uid is a warning unless it is PROXY_ACCOUNT (made for them by ansible/, no login); a
    foreign process is not fatal to start either, but the operator should know."""
    import pwd

    uid = config.proxy.uid
    try:
        account = pwd.getpwuid(uid).pw_name
    except KeyError:
        account = None
    others: list[str] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and uid in _uids(entry) and not _is_worker(entry):
            others.append(entry)
    detail = f"uid {uid}, gid {config.proxy.gid}: " + (
        f"account {account!r} holds the uid" if account else "no account holds the uid"
    )
    if others:
        detail += f"; processes other than proxy workers run with it: {', '.join(others[:10])}"
    # The account ansible/ creates to reserve the ids is theirs; any other name is someone's.
    expected = account in (None, PROXY_ACCOUNT)
    ok = not others and expected
    hint = ""
    if not ok:
        hint = (
            "give the workers a uid nothing else uses ([proxy] uid and gid; ansible/ creates the "
            f"{PROXY_ACCOUNT} account for it)"
        )
    return Check("proxy identity", ok, False, detail, hint)


def run_checks(config: ApplianceConfig) -> Report:
    root = os.geteuid() == 0
    checks = [
        Check(
            "root",
            root,
            True,
            f"euid {os.geteuid()}",
            "" if root else "run it as root (sudo appliancectl doctor): applianced runs as root",
        )
    ]
    checks += _engine(config)
    checks += _nftables(config)
    checks += _kernel()
    checks.append(_pool(config))
    checks.append(_forwarding(config))
    checks.append(_proxy_identity(config))
    ok = all(check.ok for check in checks if check.required)
    return Report(ok=ok, checks=tuple(checks))


def format_report(report: Report) -> str:
    """The text form: one line a check, a `fix:` line under each that failed."""
    lines = []
    for check in report.checks:
        mark = "ok  " if check.ok else ("FAIL" if check.required else "no  ")
        lines.append(f"{mark} {check.name}: {check.detail}")
        if not check.ok and check.hint:
            lines.append(f"     fix: {check.hint}")
    lines.append("all required checks passed" if report.ok else "a required check failed")
    return "\n".join(lines)
