"""The proxy's privilege separation, through a real applianced and a real Docker crew.

applianced starts `[proxy] workers` worker processes that drop to UID/GID 1002 with every
capability set empty and no_new_privs (proxycore/privileges.py). These tests read what the kernel
says about each worker (/proc/PID/status), try to reach a worker's memory and the credential store
from inside a crew and, on the host, from another process of the workers' own UID, and check that
the workers share the crews' connections and that one worker's death leaves the crew served.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from appliance.daemon.config import load_config
from appliance.daemon.main import KEEPER_SOCKET, keeper_dir
from appliance.demo_upstream import FakeServer
from proxycore.privileges import CAPABILITY_FIELDS, process_status
from tests.daemon_support import REACH_TEST_HOSTS, Appliance

pytestmark = pytest.mark.docker

WORKER_UID = 1002
# A Python that UID 1002 may run (the test's own may live under /root, 0700).
SYSTEM_PYTHON = "/usr/bin/python3"
STORE_KEY = "8899aabbccddeeff00112233445566778899aabbccddeeff0011223344556677"
STORED_VALUE = "sk-ant-api03-PRIVSEP-stored-0123456789abcdef"


def as_uid(uid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run argv on the host as UID/GID `uid`, with no supplementary group."""

    def become() -> None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)

    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, preexec_fn=become)


def as_worker_uid(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run argv on the host as UID/GID 1002: any other process of the workers' own UID."""
    return as_uid(WORKER_UID, *argv)


KEEPER_KNOCK = """
import socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
sock.settimeout(10)
try:
    sock.sendall(b"POST /internal/keeper/request HTTP/1.1\\r\\nHost: x\\r\\n"
                 b"Content-Length: 2\\r\\n\\r\\n{}")
    print("closed" if sock.recv(100) == b"" else "answered")
except ConnectionResetError:
    print("reset")
except BrokenPipeError:  # closed before the request was even written
    print("closed")
"""


# One connection to the crew's gateway from a process on the host, as some user: the attack of
# a local process acting as the crew (its key injected). How its connect ends.
HOST_CLIENT = """
import errno, socket, sys
sock = socket.socket()
sock.settimeout(10)
try:
    sock.connect((sys.argv[1], int(sys.argv[2])))
    sock.sendall(b"GET /anthropic/v1/models HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    print("answered: " + sock.recv(100).decode(errors="replace").split("\\r\\n")[0])
except OSError as exc:
    print("error:" + errno.errorcode.get(exc.errno, str(exc.errno)))
"""


def crew_netns(app: Appliance, gateway: str) -> str:
    """The crew's network namespace (its infra container's), from `net show`: the only place
    on this host from which its gateway answers (netns/nft.py: the pool is the crews' alone)."""
    code, report = app.ctl_json("net", "show")
    assert code == 0, report
    (path,) = [crew["netns"] for crew in report["crews"] if crew["gateway"] == gateway]
    return str(path)


def in_crew(netns: str, *argv: str) -> list[str]:
    """argv run in the crew's network namespace (the host's files and users)."""
    return ["nsenter", f"--net={netns}", *argv]


def crew_socket(netns: str) -> socket.socket:
    """A TCP socket of the crew's network namespace (a socket keeps the namespace it was made
    in: any thread may connect it)."""
    from netns.kernel import run_in_namespace

    fd = os.open(netns, os.O_RDONLY)
    try:
        return run_in_namespace(fd, socket.socket)
    finally:
        os.close(fd)


def status(app: Appliance, *, degraded: bool = False) -> dict:
    """`status`; with degraded, also while a part is down (exit 9: a worker restarting)."""
    code, answer = app.ctl_json("status")
    assert code == 0 or (degraded and code == 9 and answer["ok"] is False), answer
    return dict(answer)


def wait_workers(app: Appliance, count: int, not_in: tuple[int, ...] = ()) -> tuple[int, ...]:
    deadline = time.monotonic() + 30
    while True:
        pids = tuple(status(app, degraded=True)["proxy_pids"])
        if len(pids) == count and not set(pids) & set(not_in):
            return pids
        assert time.monotonic() < deadline, (pids, app.log_text()[-3000:])
        time.sleep(0.1)


def worker_ids_and_caps(pid: int) -> dict[str, str]:
    fields = process_status(pid)
    return {key: fields[key] for key in ("Uid", "Gid", "Groups", "NoNewPrivs", *CAPABILITY_FIELDS)}


UNPRIVILEGED = {
    "Uid": "1002\t1002\t1002\t1002",
    "Gid": "1002\t1002\t1002\t1002",
    "Groups": "",
    "NoNewPrivs": "1",
    **{field: "0000000000000000" for field in CAPABILITY_FIELDS},
}


def assert_crew_served(app: Appliance, crew: str, gateway: str, provider: FakeServer) -> None:
    """The crew, from its own namespace, is answered 200 through the proxy with the stored key
    injected."""
    done = app.ctl(
        "run", crew, "--", "sh", "-c",
        f"printf 'GET /anthropic/v1/models HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n"
        f"\\r\\n' | nc -w 30 {gateway} {app.port}",
    )  # fmt: skip
    assert " 200 " in done.stdout, (done.stdout, done.stderr)
    assert provider.last().all("x-api-key") == [STORED_VALUE]


def test_workers_are_unprivileged_and_out_of_a_crews_reach(
    appliance: Appliance, provider: FakeServer
) -> None:
    app = appliance
    app.start(env={"ENCRYPTION_KEY": STORE_KEY})
    pids = wait_workers(app, 2)
    assert status(app)["proxy_uid"] == WORKER_UID
    for pid in pids:
        # What the kernel says, for every worker: UID 1002 (real, effective, saved, fs), no
        # supplementary group, five empty capability sets, no_new_privs.
        assert worker_ids_and_caps(pid) == UNPRIVILEGED, pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"--drop-to" in cmdline and b"1002:1002" in cmdline

    # A credential in the store, granted to the crew: the workers hold its value in memory.
    stored = app.ctl_stdin(STORED_VALUE, "cred", "add", "claude", "--provider", "anthropic")
    assert stored.returncode == 0, stored.stderr
    crew = app.crew("privsep")
    code, created = app.ctl_json("crew", "create", crew, *REACH_TEST_HOSTS)
    assert code == 0, (created, app.log_text())
    gateway = created["crew"]["gateway"]
    assert app.ctl("cred", "grant", "claude", crew).returncode == 0
    # The worker does inject it (so it is in a worker's memory)...
    provider.clear()
    assert_crew_served(app, crew, gateway, provider)

    # ...and from inside the crew neither a worker nor the store can be reached: the crew's PID
    # namespace has no worker in it, its mount namespace has no state directory, no keeper
    # socket, and the crew's user (1001, no capabilities) could not read them anyway.
    state = app.state_dir
    keeper = keeper_dir(load_config(app.config)) / KEEPER_SOCKET
    assert keeper.exists()
    probe = " ; ".join(
        [
            *(f"cat /proc/{pid}/status >/dev/null 2>&1 && echo SEEN-{pid}" for pid in pids),
            *(f"head -c1 /proc/{pid}/mem >/dev/null 2>&1 && echo MEM-{pid}" for pid in pids),
            f"ls {state} >/dev/null 2>&1 && echo STATE",
            f"head -c1 {state}/credentials.db >/dev/null 2>&1 && echo STORE",
            f"test -e {keeper} && echo KEEPER",
            "grep -l '^Uid:.*1002' /proc/[0-9]*/status 2>/dev/null | sed 's/^/UID1002 /'",
            f"grep -rl {STORED_VALUE} /proc/[0-9]*/environ 2>/dev/null | sed 's/^/VALUE /'",
            "echo probed",
        ]
    )
    done = app.ctl("run", crew, "--", "sh", "-c", probe)
    assert done.returncode == 0 and done.stdout.strip() == "probed", done.stdout

    # On the host, another process with the workers' very UID: the workers are not dumpable
    # (their /proc files are root's, ptrace refused), and the state directory is root's 0700.
    for pid in pids:
        for name in ("mem", "environ", "maps"):
            read = as_worker_uid("head", "-c1", f"/proc/{pid}/{name}")
            assert read.returncode != 0 and "Permission denied" in read.stderr, (name, read)
    read = as_worker_uid("head", "-c1", str(state / "credentials.db"))
    assert read.returncode != 0 and "Permission denied" in read.stderr, read
    assert (state.stat().st_mode & 0o777) == 0o700
    # The keeper socket admits the workers' group, and then only a worker's pid: a process of
    # their UID that is not a worker is closed on before a byte is read.
    answer = as_worker_uid(SYSTEM_PYTHON, "-c", KEEPER_KNOCK, str(keeper))
    assert answer.stdout.strip() in ("closed", "reset"), answer
    assert "keeper channel: refused peer" in app.log_text()

    # A process on the host is not the crew: nobody (65534), the workers' UID, or root, dialling
    # the crew's gateway and proxy port is refused by the appliance's table before the proxy
    # sees a byte (it would have had the crew's key injected). The crew itself still is served.
    provider.clear()
    for uid in (65534, WORKER_UID, 0):
        tried = as_uid(uid, SYSTEM_PYTHON, "-c", HOST_CLIENT, gateway, str(app.port))
        assert tried.stdout.strip() == "error:EHOSTUNREACH", (uid, tried)
    assert provider.received == []
    assert_crew_served(app, crew, gateway, provider)


def test_workers_share_connections_and_survive_one_death(appliance: Appliance) -> None:
    app = appliance
    app.start()
    crew = app.crew("share")
    code, created = app.ctl_json("crew", "create", crew, *REACH_TEST_HOSTS)
    assert code == 0, (created, app.log_text())
    gateway = created["crew"]["gateway"]
    pids = wait_workers(app, 2)

    # Open connections to the crew's gateway from its namespace and see, with ss, which
    # process accepted each: both workers take connections from the one listening socket.
    netns = crew_netns(app, gateway)
    held: list[socket.socket] = []

    def connect() -> socket.socket:
        sock = crew_socket(netns)
        sock.settimeout(10)
        sock.connect((gateway, app.port))
        # One request each, so the connection is accepted (and answered) by a worker.
        sock.sendall(b"GET http://unlisted.test/ HTTP/1.1\r\nHost: unlisted.test\r\n\r\n")
        sock.recv(65536)
        return sock

    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            held = list(pool.map(lambda _: connect(), range(64)))
        owners = accepted_by(app.port)
        assert set(owners) == set(pids), (owners, pids)
        assert sum(owners.values()) >= 64
    finally:
        for sock in held:
            sock.close()

    # Kill one worker: the other serves the crew at once; the killed one comes back
    # unprivileged, with the crew (its listener and policy) restored.
    os.kill(pids[0], signal.SIGKILL)
    refused = subprocess.run(
        in_crew(netns, "curl", "-sS", "--noproxy", "", "--max-time", "10", "-x",
                f"http://{gateway}:{app.port}", "http://unlisted.test/"),
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert "egress_denied" in refused.stdout, refused
    new = wait_workers(app, 2, not_in=(pids[0],))
    assert pids[1] in new
    restarted = next(pid for pid in new if pid != pids[1])
    assert worker_ids_and_caps(restarted) == UNPRIVILEGED
    os.kill(pids[1], signal.SIGSTOP)  # only the restarted worker can answer now
    try:
        refused = subprocess.run(
            in_crew(netns, "curl", "-sS", "--noproxy", "", "--max-time", "10", "-x",
                    f"http://{gateway}:{app.port}", "http://unlisted.test/"),
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        assert "egress_denied" in refused.stdout and crew in refused.stdout, refused
    finally:
        os.kill(pids[1], signal.SIGCONT)
    assert status(app)["proxy_restarts"] >= 1


def accepted_by(port: int) -> dict[int, int]:
    """pid -> established connections on local port `port` (from ss's process column)."""
    out = subprocess.run(
        ["ss", "-Htnp", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    owners: dict[int, int] = {}
    for line in out.splitlines():
        for part in line.split("pid=")[1:]:
            pid = int(part.split(",", 1)[0])
            owners[pid] = owners.get(pid, 0) + 1
    return owners


def test_a_stopping_workers_last_events_reach_the_journal(appliance: Appliance) -> None:
    """The workers' events travel on their channels; at SIGTERM a worker sends what it still
    holds as it exits, and applianced reads it to the end before it closes the journal. With a
    flush interval of 30 s, the decisions below exist only in the workers' queues until then."""
    app = appliance
    with open(app.config, "a") as config:
        config.write("\n[proxy.events]\nflush_interval = 30\n")
    app.start()
    crew = app.crew("last")
    code, created = app.ctl_json("crew", "create", crew, *REACH_TEST_HOSTS)
    assert code == 0, (created, app.log_text())
    gateway = created["crew"]["gateway"]
    hosts = [f"denied-{i}.test" for i in range(20)]
    netns = crew_netns(app, gateway)
    for host in hosts:
        with crew_socket(netns) as sock:
            sock.settimeout(10)
            sock.connect((gateway, app.port))
            sock.sendall(f"GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            assert b" 403 " in sock.recv(65536)
    app.stop()
    assert app.wait_exit() == 0, app.log_text()[-3000:]
    db = sqlite3.connect(f"file:{app.state_dir / 'journal.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT payload FROM entries WHERE type = 'proxy.deny'").fetchall()
    finally:
        db.close()
    # [ts, route, method, host, port, rule, status] per request (appliance/journal/entries.py)
    journaled = {request[3] for (payload,) in rows for request in json.loads(payload)["requests"]}
    assert set(hosts) <= journaled, sorted(journaled)
