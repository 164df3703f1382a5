"""`appliancectl doctor`: is this host able to run the appliance? Each check is run and reported;
a failed required check makes the command exit 1.

The checks read the host as it is now and change nothing that outlives them (the veth probe
lives in a throwaway network namespace that disappears with its process).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import msgspec

from .config import ApplianceConfig


class Check(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    required: bool
    detail: str


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


def _engine(config: ApplianceConfig) -> list[Check]:
    if config.daemon.provider != "docker":
        from .main import load_provider

        try:
            provider = load_provider(config)
            runtimes = provider.runtimes()
        except Exception as exc:
            return [Check("provider", False, True, f"{config.daemon.provider}: {exc}")]
        return [
            Check(
                "provider", True, True, f"{config.daemon.provider} (isolated: {provider.isolated})"
            ),
            Check("runtimes", bool(runtimes), True, "available: " + ", ".join(runtimes)),
        ]
    from appliance.runtime.docker import DockerProvider
    from appliance.runtime.engine import detect_engine

    try:
        client, report = detect_engine()
        status = DockerProvider(client).runtime_status()
    except Exception as exc:  # EngineUnavailable lists every address tried and why
        return [Check("engine", False, True, str(exc))]
    checks = [
        Check(
            "engine",
            True,
            True,
            f"Docker {report.server_version} (API {report.api_version}) at {report.address}",
        )
    ]
    for runtime, state in status.items():
        # runc is required (the infra container always runs on it); the others are optional.
        checks.append(Check(f"runtime {runtime}", state == "available", runtime == "runc", state))
    return checks


def _kernel() -> list[Check]:
    checks: list[Check] = []
    ok, out = _run(
        "unshare",
        "--net",
        "sh",
        "-c",
        "ip link add dr0 type veth peer name dr1 && ip link show dr0",
    )
    checks.append(
        Check("netns + veth", ok, True, "created a veth pair in a new namespace" if ok else out)
    )
    filesystems = open("/proc/filesystems").read()  # noqa: SIM115 (small, read once)
    checks.append(
        Check(
            "overlayfs",
            "overlay" in filesystems,
            True,
            "in /proc/filesystems" if "overlay" in filesystems else "missing",
        )
    )
    libc = ctypes.CDLL(None, use_errno=True)
    pr_get_seccomp = 21
    seccomp = libc.prctl(pr_get_seccomp, 0, 0, 0, 0) >= 0
    checks.append(
        Check(
            "seccomp", seccomp, True, "prctl(PR_GET_SECCOMP) answers" if seccomp else "not built in"
        )
    )
    return checks


def _nftables(config: ApplianceConfig) -> Check:
    if shutil.which("nft") is None:
        return Check(
            "nftables", False, True, "the nft command is not installed (apt install nftables)"
        )
    ok, out = _run("nft", "list", "tables")
    return Check(
        "nftables",
        ok,
        True,
        f"nft works; the appliance's table is inet {config.net.table}" if ok else out,
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
        return Check("address pool", False, True, f"cannot read the host's addresses: {exc}")
    finally:
        host.close()
    if conflicts:
        return Check("address pool", False, True, f"{pool} collides: " + "; ".join(conflicts))
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
    """A proxy worker: started by a root process as `proxycore.worker ... --drop-to`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = file.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as file:
            parent = file.read().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return False
    return b"proxycore.worker" in argv and b"--drop-to" in argv and _uids(parent)[:1] == [0]


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
    return Check("proxy identity", not others and expected, False, detail)


def run_checks(config: ApplianceConfig) -> Report:
    checks = [Check("root", os.geteuid() == 0, True, f"euid {os.geteuid()}")]
    checks += _engine(config)
    checks.append(_nftables(config))
    checks += _kernel()
    checks.append(_pool(config))
    checks.append(_proxy_identity(config))
    ok = all(check.ok for check in checks if check.required)
    return Report(ok=ok, checks=tuple(checks))
