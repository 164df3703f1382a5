"""The workers' privilege drop and its self-check, with real worker processes and no Docker.

tests/test_proxy_privsep.py reads the same facts through a whole applianced with Docker crews;
without a Docker engine it skips, and a worker that never dropped its UID would go unnoticed.
Here applianced's ProxyPool starts real workers (python -m proxycore.worker --drop-to
1002:1002) and the kernel is asked what each of them is; a worker whose drop fails for real
(root without CAP_SETUID, as under a bounded capability set) must exit before it serves; and
`check_dropped`, the check a worker runs on itself, is held to processes that dropped only
part of what they hold.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.daemon.doctor import _is_worker as is_worker
from appliance.daemon.proxy import CrewEntry, ProxyPool
from proxycore import control
from proxycore.config import parse_config
from proxycore.privileges import CAPABILITY_FIELDS, PR_CAPBSET_DROP, process_status
from tests.conftest import ROOT, free_port
from tests.worker_support import WORKER_IDS, PoolThread, as_worker_uid

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root (the workers drop to UID 1002)"
)

CAP_SETUID = 7
UNPRIVILEGED = {
    "Uid": "1002\t1002\t1002\t1002",
    "Gid": "1002\t1002\t1002\t1002",
    "Groups": "",
    "NoNewPrivs": "1",
    **{field: "0000000000000000" for field in CAPABILITY_FIELDS},
}


def worker_facts(pid: int) -> dict[str, str]:
    fields = process_status(pid)
    return {key: fields[key] for key in UNPRIVILEGED}


def test_every_worker_is_unprivileged_by_the_kernels_account(tmp_path: Path) -> None:
    port = free_port()
    pool = ProxyPool(parse_config(""), tmp_path, port, workers=2, drop_to=WORKER_IDS)
    runner = PoolThread(pool).start()
    try:
        runner.call(pool.add_crew, CrewEntry("self", "127.0.0.64", "restricted", ()))
        pids = pool.pids
        assert len(pids) == 2
        for pid in pids:
            # UID and GID 1002 real, effective, saved and filesystem; no supplementary group;
            # five empty capability sets; no_new_privs.
            assert worker_facts(pid) == UNPRIVILEGED, pid
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert argv[1:3] == [b"-m", b"proxycore.worker"] and b"1002:1002" in argv, argv
            assert is_worker(str(pid))  # `appliancectl doctor` knows it for a worker
            # Not dumpable: the kernel makes its /proc files root's (proc(5)), and another
            # process of the workers' own UID can neither read its memory nor its environment.
            assert os.stat(f"/proc/{pid}/environ").st_uid == 0
            for name in ("mem", "environ"):
                read = as_worker_uid("head", "-c1", f"/proc/{pid}/{name}")
                assert read.returncode != 0 and "Permission denied" in read.stderr, (name, read)
        # Both serve the crew (the drop happened before serving, not instead of it).
        with socket.create_connection(("127.0.0.64", port), timeout=10) as sock:
            sock.sendall(b"GET /_appliance/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert pool.pids == pids and pool.restarts == 0
    finally:
        runner.stop()


def _without_cap_setuid() -> None:
    """preexec: this child and what it executes keep root's UID but lose CAP_SETUID (from the
    bounding set: an execve as root gets its permitted set from there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_SETUID, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def test_a_worker_whose_drop_fails_exits_before_it_serves(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text("")
    ours, theirs = socket.socketpair()
    listener = socket.create_server(("127.0.0.65", 0))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxycore.worker",
            "--config",
            str(config),
            "--control-fd",
            str(theirs.fileno()),
            "--drop-to",
            "1002:1002",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        pass_fds=[theirs.fileno()],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_without_cap_setuid,
    )
    theirs.close()
    try:
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 1, stderr
        assert "cannot drop privileges: cannot become 1002:1002" in stderr, stderr
        assert "listening" not in stderr, stderr
        # It never read its control channel: a crew and its listener sent now find nobody.
        ours.settimeout(5)
        try:
            data = control.encoder.encode(control.Ping()) + b"\n"
            ours.sendall(data)
            assert ours.recv(100) == b""
        except (BrokenPipeError, ConnectionResetError):
            pass
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        ours.close()
        listener.close()


CHECK = """
import os, sys, threading
from proxycore.privileges import PrivilegeDropError, check_dropped, drop_privileges

def check():
    try:
        check_dropped(1002, 1002)
    except PrivilegeDropError as exc:
        print("refused:", exc.strerror)
    else:
        print("passed")

case = sys.argv[1]
if case == "root":  # nothing dropped
    pass
elif case == "saved-root":  # a saved UID of 0 could win root back
    os.setgroups([])
    os.setresgid(1002, 1002, 1002)
    os.setresuid(1002, 1002, 0)
elif case == "groups":  # UID and GID right, a supplementary group kept
    os.setgroups([0])
    os.setresgid(1002, 1002, 1002)
    os.setresuid(1002, 1002, 1002)
elif case == "threads":  # a thread at the drop would keep its capabilities
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    try:
        drop_privileges(1002, 1002)
    except PrivilegeDropError as exc:
        print("refused:", exc.strerror, "uid", os.getuid())
    sys.exit(0)
elif case == "full":
    drop_privileges(1002, 1002)
check()
"""


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # (the fields are quoted with repr(): a tab reads \\t)
        ("root", [r"Uid '0\t0\t0\t0'", "CapEff", "NoNewPrivs '0'", "dumpable", "setuid(0)"]),
        ("saved-root", [r"Uid '1002\t1002\t0\t1002'", "CapPrm", "setuid(0) succeeded"]),
        ("groups", ["Groups '0'", "CapBnd", "NoNewPrivs '0'"]),
        ("threads", ["2 threads at the privilege drop", "uid 0"]),
        ("full", ["passed"]),
    ],
)
def test_the_self_check_names_every_privilege_left(case: str, expected: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK, case],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    for part in expected:
        assert part in done.stdout, (case, done.stdout)
    if case != "full":
        assert done.stdout.startswith("refused:"), done.stdout
