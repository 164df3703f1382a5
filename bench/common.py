"""Shared machinery for the benchmark scripts: processes, pinning, wrk, peers, tables.

Theory of operation
-------------------
The machine has two cores. The process under test (our proxy, or a peer) is pinned to core 0
with `taskset -c 0`; the load generator (wrk, or `fixed_rate.py`) and the upstream (nginx) are
pinned to core 1, so the thing measured has one core to itself. Every process is started in its
own session (`start_new_session=True`), so its process group id is its pid and stopping it means
`killpg` on that group: forked workers (nginx, proxy.py, squid's helpers) go with it.
A `Workspace` owns the temporary directory and every process started in it; it stops them on
exit, on an exception, and on SIGTERM/SIGINT.

All traffic stays on loopback (127.0.0.0/8), and every load run is bounded in time (`wrk -d`,
`fixed_rate.py --duration`). Every command is printed (`$ ...`) before it runs, so each figure
can be reproduced by hand.

Background load from other processes on the machine distorts every figure here, so each
measurement also records how much CPU processes outside the benchmark used while it ran
(`ForeignLoad`); results taken while that was high are flagged.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

PROXY_CORE = "0"  # the process under test
LOAD_CORE = "1"  # wrk, the fixed-rate client, nginx
BOTH_CORES = "0,1"

BODY_SIZE = 1024
UPSTREAM_HOST = "upstream.test"  # resolved by our proxy's split-horizon table to 127.0.0.1
MITM_VENV = Path(os.environ.get("MITM_VENV", "/tmp/mitm-venv"))

# Above this share of one core used by processes outside the benchmark, a figure is flagged.
FOREIGN_LOAD_WARN_PCT = 5.0


class Unavailable(Exception):
    """A peer cannot run here; the message says why (reported, never replaced by a figure)."""


def show(argv: Sequence[str], note: str = "") -> None:
    """Print the exact command about to run."""
    suffix = f"    # {note}" if note else ""
    print(f"$ {shlex.join(argv)}{suffix}", flush=True)


def pinned(core: str | None, argv: Sequence[str]) -> list[str]:
    return ["taskset", "-c", core, *argv] if core is not None else list(argv)


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- processes


@dataclass
class Service:
    name: str
    host: str
    port: int
    proc: subprocess.Popen[bytes]
    argv: list[str]
    log: Path
    # What the load sends: an absolute-form URI and its Host header (forward proxies), or None
    # for an origin server.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Workspace:
    """A temporary directory plus every process started in it; all stopped on exit."""

    def __init__(self, prefix: str = "bench-") -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        # Peers drop privileges (squid, tinyproxy run as `proxy`, nginx workers as `nobody`).
        self.dir.chmod(0o755)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Workspace:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def path(self, name: str) -> Path:
        return self.dir / name

    def subdir(self, name: str, owner: str | None = None) -> Path:
        directory = self.dir / name
        directory.mkdir(exist_ok=True)
        if owner is not None:
            shutil.chown(directory, owner, owner)
        return directory

    @property
    def pgids(self) -> set[int]:
        return {proc.pid for proc in self.procs}

    def spawn(
        self,
        argv: Sequence[str],
        *,
        log: Path,
        note: str = "",
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        show(argv, note)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `timeout`."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # The leader may be gone while forked children of its group live on.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
        if proc in self.procs:
            self.procs.remove(proc)

    def close(self) -> None:
        while self.procs:
            self.stop(self.procs[-1])
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_for_port(
    host: str, port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listening on {host}:{port} after {timeout:.0f} s")


def _started(ws: Workspace, service: Service, timeout: float = 20.0) -> Service:
    try:
        wait_for_port(service.host, service.port, service.proc, timeout)
    except RuntimeError as exc:
        tail = service.log_tail()
        ws.stop(service.proc)
        raise Unavailable(f"{service.name}: {exc}; log:\n{tail}") from None
    return service


# --------------------------------------------------------------------------- upstream


def start_nginx(
    ws: Workspace, core: str | None = LOAD_CORE, tls: tuple[Path, Path] | None = None
) -> Service:
    """nginx with one worker serving /1k (1 KiB) over keep-alive, as the upstream origin.

    `tls`: (certificate chain, key), PEM files: the listener speaks TLS (1.2 and 1.3, HTTP/1.1)
    with that certificate for every name instead of plain HTTP.
    """
    if shutil.which("nginx") is None:
        raise Unavailable("nginx not installed (apt-get install -y nginx)")
    root = ws.subdir("nginx")
    (root / "1k").write_bytes(b"a" * BODY_SIZE)
    port = free_port()
    conf = root / "nginx.conf"
    tls_lines = (
        f"ssl_certificate {tls[0]};\n        ssl_certificate_key {tls[1]};\n"
        "        ssl_protocols TLSv1.2 TLSv1.3;"
        if tls
        else ""
    )
    conf.write_text(
        f"""\
worker_processes 1;
worker_rlimit_nofile 65536;
daemon off;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    client_header_timeout 300s;
    server {{
        listen 127.0.0.1:{port}{" ssl" if tls else ""} backlog=4096;
        {tls_lines}
        root {root};
        location / {{ }}
    }}
}}
"""
    )
    argv = pinned(core, ["nginx", "-p", str(root), "-c", str(conf)])
    note = "upstream origin" + (", TLS" if tls else "")
    proc = ws.spawn(argv, log=root / "stdout.log", note=note)
    return _started(ws, Service("nginx", "127.0.0.1", port, proc, argv, root / "stdout.log"))


# --------------------------------------------------------------------------- our proxy


def source_revision(source: Path, paths: Sequence[str] = ("proxycore", "appliance")) -> str:
    """The commit of the tree under test, plus "+uncommitted" if `paths` have local changes."""

    def git(*argv: str) -> str:
        out = subprocess.run(
            ["git", "-C", str(source), *argv], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()

    try:
        commit = git("describe", "--always")
        # Untracked modules count too: `describe --dirty` would miss a new proxycore file.
        changed = git("status", "--porcelain", "--", *paths)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}+uncommitted" if changed else commit


def crew_gateway(index: int) -> str:
    """Crew `index`'s gateway: 127.0.0.1 for the first, then 127.1.X.Y (all of 127/8 is local)."""
    if index == 0:
        return "127.0.0.1"
    return f"127.1.{index // 250}.{index % 250 + 1}"


def ours_config(
    *,
    port: int,
    events_path: Path,
    crews: int = 1,
    allow: Sequence[str] = (UPSTREAM_HOST,),
    resolve: dict[str, str] | None = None,
    limits: dict[str, int] | None = None,
    upstream: Sequence[str] = (),
    crew_lines: Sequence[str] = (),
) -> str:
    """`upstream`: more lines for the [upstream] table (e.g. `h2c = [...]`); `crew_lines`: more
    lines after each [[crew]] table (e.g. its `[[crew.leaves]]`)."""
    lines = ["[listen]", f"port = {port}", ""]
    if limits:
        lines += ["[limits]", *(f"{key} = {value}" for key, value in limits.items()), ""]
    allow_list = ", ".join(json.dumps(host) for host in allow)
    for index in range(crews):
        lines += [
            "[[crew]]",
            f'name = "bench{index}"',
            f'gateway = "{crew_gateway(index)}"',
            'mode = "restricted"',
            f"allow = [{allow_list}]",
            # The upstream is on this host's loopback: only a crew that names it reaches it.
            'ssrf_allow = ["127.0.0.1/32"]',
            "",
            *crew_lines,
        ]
    table = resolve if resolve is not None else {host: "127.0.0.1" for host in allow}
    resolve_items = ", ".join(f"{json.dumps(h)} = {json.dumps(a)}" for h, a in table.items())
    lines += [
        "[upstream]",
        "# The upstream is on loopback, which the SSRF guard refuses unless allowed explicitly.",
        'ssrf_allow = ["127.0.0.1/32"]',
        f"resolve = {{ {resolve_items} }}",
        *upstream,
        "",
        "[events]",
        f'path = "{events_path}"',
        "",
    ]
    return "\n".join(lines)


def start_ours(
    ws: Workspace,
    *,
    source: Path = REPO,
    crews: int = 1,
    workers: int = 1,
    core: str | None = PROXY_CORE,
    allow: Sequence[str] = (UPSTREAM_HOST,),
    limits: dict[str, int] | None = None,
    tag: str = "ours",
    upstream: Sequence[str] = (),
    crew_lines: Sequence[str] = (),
) -> Service:
    """Our proxy: restricted policy, SSRF guard, events to a JSON-lines file (as in production)."""
    root = ws.subdir(tag)
    port = free_port()
    events = root / "events.jsonl"
    conf = root / "proxy.toml"
    conf.write_text(
        ours_config(
            port=port,
            events_path=events,
            crews=crews,
            allow=allow,
            limits=limits,
            upstream=upstream,
            crew_lines=crew_lines,
        )
    )
    argv = pinned(
        core,
        [sys.executable, "-m", "appliance.cli", "proxy", "--config", str(conf)]
        + (["--workers", str(workers)] if workers > 1 else []),
    )
    env = {**os.environ, "PYTHONPATH": str(source)}
    note = f"our proxy, {workers} worker(s), {crews} crew(s)"
    proc = ws.spawn(argv, log=root / "stderr.log", note=note, cwd=source, env=env)
    gateway = crew_gateway(crews - 1)  # the load goes to the last crew configured
    service = Service(tag, gateway, port, proc, argv, root / "stderr.log")
    service.extra["events"] = events
    service.extra["config"] = conf
    return _started(ws, service, timeout=60.0)


# --------------------------------------------------------------------------- peers


def start_squid(ws: Workspace, core: str | None = PROXY_CORE) -> Service:
    if shutil.which("squid") is None:
        raise Unavailable("squid not installed (apt-get install -y squid)")
    root = ws.subdir("squid", owner="proxy")
    port = free_port()
    conf = root / "squid.conf"
    conf.write_text(
        f"""\
http_port 127.0.0.1:{port}
workers 1
acl benchclients src 127.0.0.0/8
http_access allow benchclients
http_access deny all
cache deny all
cache_mem 0 MB
access_log none
cache_store_log none
cache_log {root}/cache.log
pid_filename {root}/squid.pid
coredump_dir {root}
cache_effective_user proxy
pinger_enable off
max_filedescriptors 16384
shutdown_lifetime 1 seconds
"""
    )
    argv = pinned(core, ["squid", "-N", "-f", str(conf)])
    proc = ws.spawn(argv, log=root / "stdout.log", note="squid, no cache, one process (-N)")
    return _started(ws, Service("squid", "127.0.0.1", port, proc, argv, root / "cache.log"))


def start_tinyproxy(ws: Workspace, core: str | None = PROXY_CORE) -> Service:
    if shutil.which("tinyproxy") is None:
        raise Unavailable("tinyproxy not installed (apt-get install -y tinyproxy)")
    root = ws.subdir("tinyproxy", owner="proxy")
    port = free_port()
    conf = root / "tinyproxy.conf"
    conf.write_text(
        f"""\
User proxy
Group proxy
Port {port}
Listen 127.0.0.1
Timeout 600
MaxClients 4096
LogLevel Critical
LogFile "{root}/tinyproxy.log"
PidFile "{root}/tinyproxy.pid"
Allow 127.0.0.0/8
"""
    )
    argv = pinned(core, ["tinyproxy", "-d", "-c", str(conf)])
    proc = ws.spawn(argv, log=root / "stdout.log", note="tinyproxy, foreground")
    return _started(ws, Service("tinyproxy", "127.0.0.1", port, proc, argv, root / "stdout.log"))


def start_proxypy(ws: Workspace, core: str | None = PROXY_CORE) -> Service:
    check = subprocess.run(
        [sys.executable, "-c", "import proxy"], capture_output=True, text=True, check=False
    )
    if check.returncode != 0:
        raise Unavailable("proxy.py not installed (pip install proxy.py)")
    root = ws.subdir("proxypy")
    port = free_port()
    argv = pinned(
        core,
        [
            sys.executable,
            "-m",
            "proxy",
            "--hostname",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-workers",
            "1",
            "--num-acceptors",
            "1",
            "--log-level",
            "WARNING",
            "--data-dir",
            str(root / "data"),
        ],
    )
    proc = ws.spawn(argv, log=root / "stdout.log", note="proxy.py, default HttpProxyPlugin")
    return _started(ws, Service("proxy.py", "127.0.0.1", port, proc, argv, root / "stdout.log"))


def mitmdump_path() -> Path | None:
    found = os.environ.get("MITMDUMP") or shutil.which("mitmdump")
    if found:
        return Path(found)
    candidate = MITM_VENV / "bin" / "mitmdump"
    return candidate if candidate.exists() else None


def start_mitmdump(
    ws: Workspace, core: str | None = PROXY_CORE, extra: Sequence[str] = ()
) -> Service:
    """`extra`: more mitmdump arguments (e.g. `--set ssl_verify_upstream_trusted_ca=...`)."""
    binary = mitmdump_path()
    if binary is None:
        raise Unavailable(
            "mitmdump not found: `pip install mitmproxy` fails here building zstandard from "
            "source; bench/setup_peers.sh installs it from wheels into $MITM_VENV (/tmp/mitm-venv)"
        )
    root = ws.subdir("mitmdump")
    port = free_port()
    argv = pinned(
        core,
        [
            str(binary),
            "--listen-host",
            "127.0.0.1",
            "--listen-port",
            str(port),
            "--quiet",
            "--set",
            f"confdir={root / 'conf'}",
            *extra,
        ],
    )
    proc = ws.spawn(argv, log=root / "stdout.log", note="mitmdump, no addons, quiet")
    return _started(ws, Service("mitmdump", "127.0.0.1", port, proc, argv, root / "stdout.log"))


def start_socat_forwarder(
    ws: Workspace, target_port: int, core: str | None = PROXY_CORE, buffer: int = 1 << 20
) -> Service:
    """A plain TCP relay (no proxy protocol): the floor for a user-space relay."""
    if shutil.which("socat") is None:
        raise Unavailable("socat not installed (apt-get install -y socat)")
    root = ws.subdir("socat")
    port = free_port()
    argv = pinned(
        core,
        [
            "socat",
            "-b",
            str(buffer),
            # fork: one child per connection, so the readiness probe does not use it up.
            f"TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork",
            f"TCP:127.0.0.1:{target_port}",
        ],
    )
    proc = ws.spawn(argv, log=root / "stdout.log", note=f"TCP relay, {buffer}-byte buffer")
    return _started(ws, Service("socat", "127.0.0.1", port, proc, argv, root / "stdout.log"))


PEERS = {
    "squid": start_squid,
    "proxy.py": start_proxypy,
    "tinyproxy": start_tinyproxy,
    "mitmdump": start_mitmdump,
}


def _first_line(argv: Sequence[str], pattern: str = "") -> str:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "not available"
    text = (out.stdout + out.stderr).strip()
    for line in text.splitlines():
        if pattern in line:
            return line.strip()
    return text.splitlines()[0].strip() if text else "not available"


def versions() -> dict[str, str]:
    mitm = mitmdump_path()
    return {
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "debian": Path("/etc/debian_version").read_text().strip()
        if Path("/etc/debian_version").exists()
        else "unknown",
        "nginx": _first_line(["nginx", "-v"]),
        "wrk": _first_line(["wrk", "-v"], "wrk"),
        "squid": _first_line(["squid", "-v"], "Version"),
        "tinyproxy": _first_line(["tinyproxy", "-v"]),
        "socat": _first_line(["socat", "-V"], "socat version"),
        "proxy.py": _first_line([sys.executable, "-m", "proxy", "--version"]),
        "mitmdump": _first_line([str(mitm), "--version"], "Mitmproxy") if mitm else "not available",
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


# --------------------------------------------------------------------------- checks


def http_get(
    host: str, port: int, target: str, host_header: str, timeout: float = 5.0
) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a fresh connection; returns (status, body). For sanity checks."""
    request = (
        f"GET {target} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request)
        data = bytearray()
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    if b"transfer-encoding: chunked" in head.lower():
        body = _dechunk(body)
    return status, body


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


def forward_target(service_name: str, upstream_port: int) -> tuple[str, str]:
    """The absolute-form URI and Host header the load sends through `service_name`.

    Ours resolves `upstream.test` with its split-horizon table; the peers have no such override,
    so they get the IP literal (one name lookup fewer for them, none of them does DNS here).
    """
    host = UPSTREAM_HOST if service_name.startswith("ours") else "127.0.0.1"
    authority = f"{host}:{upstream_port}"
    return f"http://{authority}/1k", authority


def check_forward(service: Service, upstream_port: int) -> None:
    uri, authority = forward_target(service.name, upstream_port)
    try:
        status, body = http_get(service.host, service.port, uri, authority)
    except OSError as exc:
        raise Unavailable(f"{service.name}: sanity request failed: {exc}") from None
    if status != 200 or len(body) != BODY_SIZE:
        raise Unavailable(
            f"{service.name}: sanity request got status {status} and {len(body)} body bytes"
        )


# --------------------------------------------------------------------------- foreign load


def _process_ticks() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (comm, pgid, own utime+stime, reaped children's cutime+cstime), in clock ticks."""
    table: dict[int, tuple[str, int, int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        # fields[0] is field 3 (state) of proc(5): pgrp is field 5, utime..cstime 14-17.
        table[int(entry.name)] = (
            comm,
            int(fields[2]),
            int(fields[11]) + int(fields[12]),
            int(fields[13]) + int(fields[14]),
        )
    return table


def _machine_ticks() -> int:
    """user + nice + system ticks of all cores (irq and softirq left out: see ForeignLoad)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    return int(fields[1]) + int(fields[2]) + int(fields[3])


def _children_ticks() -> int:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = resource.getrusage(resource.RUSAGE_SELF)
    hz = os.sysconf("SC_CLK_TCK")
    return round((usage.ru_utime + usage.ru_stime + own.ru_utime + own.ru_stime) * hz)


class ForeignLoad:
    """CPU used by processes outside the benchmark while a measurement ran, in % of one core.

    The machine's user+system time (/proc/stat) minus the time of the benchmark's own processes
    (their process groups and the children they reaped, plus reaped children of this process such
    as wrk, plus this process). Interrupt time is left out on both sides, since loopback traffic
    is partly processed in softirq context. The three heaviest foreign processes still alive at
    the end are named.
    """

    def __init__(self, ws: Workspace | None) -> None:
        self.ws = ws
        self.elapsed = 0.0

    def _ours(self) -> set[int]:
        return (self.ws.pgids if self.ws else set()) | {os.getpgid(0)}

    def __enter__(self) -> ForeignLoad:
        self.pgids = self._ours()
        self.before = _process_ticks()
        self.machine_before = _machine_ticks()
        self.children_before = _children_ticks()
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.monotonic() - self.started
        self.pgids |= self._ours()
        self.after = _process_ticks()
        self.machine_after = _machine_ticks()
        self.children_after = _children_ticks()

    def report(self) -> dict[str, Any]:
        hz = os.sysconf("SC_CLK_TCK")
        ours = self.children_after - self.children_before
        foreign: dict[str, int] = {}
        for pid, (comm, pgid, ticks, children) in self.after.items():
            previous = self.before.get(pid)
            same = previous is not None and previous[0] == comm
            delta = ticks - (previous[2] if previous and same else 0)
            if pgid in self.pgids:
                # A forking server (socat fork) reaps its own children: count their time too.
                ours += delta + children - (previous[3] if previous and same else 0)
            elif delta > 0:
                foreign[comm] = foreign.get(comm, 0) + delta
        total_foreign = max(0, self.machine_after - self.machine_before - ours)
        scale = 100.0 / (hz * self.elapsed) if self.elapsed > 0 else 0.0
        top = sorted(foreign.items(), key=lambda item: -item[1])[:3]
        return {
            "foreign_cpu_pct": round(total_foreign * scale, 1),
            "foreign_top": [f"{name} {ticks * scale:.0f}%" for name, ticks in top if ticks],
        }


# Set once from the command line (--wait-quiet, --retry-busy): how hard to try for measurements
# that other processes on the machine did not disturb.
_quiet_wait = 0.0
_busy_retries = 0


def configure(*, wait_quiet: float, retry_busy: int) -> None:
    global _quiet_wait, _busy_retries
    _quiet_wait = wait_quiet
    _busy_retries = retry_busy


def wait_for_quiet(ws: Workspace, sample: float = 2.0) -> None:
    """Wait up to --wait-quiet seconds until other processes use under 5% of a core."""
    deadline = time.monotonic() + _quiet_wait
    while time.monotonic() < deadline:
        with ForeignLoad(ws) as load:
            time.sleep(sample)
        report = load.report()
        if report["foreign_cpu_pct"] <= FOREIGN_LOAD_WARN_PCT:
            return
        print(
            f"  (waiting for quiet: others use {report['foreign_cpu_pct']}% of a core: "
            f"{', '.join(report['foreign_top'])})",
            flush=True,
        )
    if _quiet_wait:
        print("  (still busy; measuring anyway, the figure will be flagged)", flush=True)


def warn_if_loaded(label: str, load: dict[str, Any]) -> None:
    if load["foreign_cpu_pct"] > FOREIGN_LOAD_WARN_PCT:
        print(
            f"  ! {label}: other processes used {load['foreign_cpu_pct']}% of a core during this "
            f"run ({', '.join(load['foreign_top'])}): the figure is disturbed",
            flush=True,
        )


# --------------------------------------------------------------------------- wrk


@dataclass
class WrkResult:
    requests_per_s: float
    requests: int
    latency_ms: dict[str, float]
    non_2xx: int = 0
    socket_errors: dict[str, int] = field(default_factory=dict)
    foreign: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _to_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not match:
        raise ValueError(f"unexpected wrk latency {text!r}")
    return float(match.group(1)) * _UNITS_MS[match.group(2)]


def parse_wrk(output: str) -> WrkResult:
    rate = re.search(r"Requests/sec:\s+([\d.]+)", output)
    total = re.search(r"(\d+) requests in", output)
    if not rate or not total:
        raise RuntimeError(f"cannot parse wrk output:\n{output}")
    latency = {
        f"p{m.group(1)}": _to_ms(m.group(2))
        for m in re.finditer(r"^\s+(50|75|90|99)%\s+(\S+)", output, re.MULTILINE)
    }
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    socket_errors = (
        dict(zip(("connect", "read", "write", "timeout"), map(int, errors.groups()), strict=True))
        if errors
        else {}
    )
    return WrkResult(
        requests_per_s=float(rate.group(1)),
        requests=int(total.group(1)),
        latency_ms=latency,
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=socket_errors,
    )


def wrk_script(ws: Workspace, uri: str, authority: str) -> Path:
    """A Lua script sending `GET <uri>` (absolute-form for a forward proxy) with its Host."""
    script = ws.path(f"wrk-{abs(hash((uri, authority)))}.lua")
    script.write_text(
        "request = function()\n"
        f'  return wrk.format("GET", "{uri}", {{["Host"] = "{authority}"}})\n'
        "end\n"
    )
    return script


def group_cpu_ticks(pgid: int) -> int:
    """utime+stime of the live processes of process group `pgid` (a server and its workers)."""
    return sum(ticks for _, group, ticks, _ in _process_ticks().values() if group == pgid)


def run_measured(
    ws: Workspace,
    argv: list[str],
    timeout: float,
    *,
    warmup: bool = False,
    watch_pgid: int | None = None,
) -> tuple[str, dict[str, Any]]:
    """Run one measuring command; returns its stdout and the foreign load during it.

    With --retry-busy N, a run that other processes disturbed is run again (up to N times) and
    the least disturbed attempt is kept: the choice looks at the disturbance, never at the figure.
    A warm-up run is run once, at once. With `watch_pgid`, the report also gives the CPU that
    process group (the server under test) used during the kept attempt, in % of one core
    (`watched_cpu_pct`): whether the figure is the server's limit or the load generator's, and
    in seconds (`watched_cpu_s`, for CPU per request).
    """
    best: tuple[str, dict[str, Any]] | None = None
    for attempt in range(1 if warmup else _busy_retries + 1):
        if not warmup:
            wait_for_quiet(ws)
        show(argv, "warm-up, not recorded" if warmup else "")
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        ws.procs.append(proc)
        watched = group_cpu_ticks(watch_pgid) if watch_pgid is not None else 0
        try:
            with ForeignLoad(ws) as load:
                out, err = proc.communicate(timeout=timeout)
        finally:
            ws.stop(proc)
        if proc.returncode != 0:
            message = (err or out).decode(errors="replace").strip()
            raise RuntimeError(f"{argv[0]} exited with {proc.returncode}: {message}")
        report = load.report()
        report["attempts"] = attempt + 1
        if watch_pgid is not None and load.elapsed > 0:
            watched = group_cpu_ticks(watch_pgid) - watched
            hz = os.sysconf("SC_CLK_TCK")
            report["watched_cpu_pct"] = round(100.0 * watched / (hz * load.elapsed), 1)
            report["watched_cpu_s"] = watched / hz
        if best is None or report["foreign_cpu_pct"] < best[1]["foreign_cpu_pct"]:
            best = (out.decode(errors="replace"), report)
        if warmup or report["foreign_cpu_pct"] <= FOREIGN_LOAD_WARN_PCT:
            break
        if attempt < _busy_retries:
            print(
                f"  (disturbed: others used {report['foreign_cpu_pct']}% of a core; "
                "running it again)",
                flush=True,
            )
    assert best is not None
    return best


def run_wrk(
    ws: Workspace,
    url: str,
    *,
    duration: float,
    connections: int,
    script: Path | None = None,
    threads: int = 1,
    core: str | None = LOAD_CORE,
    warmup: bool = False,
    watch_pgid: int | None = None,
) -> WrkResult:
    if shutil.which("wrk") is None:
        raise Unavailable("wrk not installed (apt-get install -y wrk)")
    argv = pinned(
        core,
        [
            "wrk",
            f"-t{threads}",
            f"-c{connections}",
            f"-d{max(1, round(duration))}s",
            "--timeout",
            "10s",
            "--latency",
            *(["-s", str(script)] if script else []),
            url,
        ],
    )
    output, foreign = run_measured(
        ws, argv, timeout=duration + 60, warmup=warmup, watch_pgid=watch_pgid
    )
    result = parse_wrk(output)
    result.foreign = foreign
    return result


def run_fixed_rate(
    ws: Workspace,
    *,
    host: str,
    port: int,
    uri: str,
    authority: str,
    rate: int,
    duration: float,
    connections: int,
    core: str | None = LOAD_CORE,
) -> dict[str, Any]:
    """Run `fixed_rate.py` (open-loop client: latency from the scheduled send time)."""
    argv = pinned(
        core,
        [
            sys.executable,
            str(BENCH_DIR / "fixed_rate.py"),
            "--connect",
            f"{host}:{port}",
            "--uri",
            uri,
            "--host-header",
            authority,
            "--rate",
            str(rate),
            "--duration",
            str(duration),
            "--connections",
            str(connections),
        ],
    )
    output, foreign = run_measured(ws, argv, timeout=duration + 60)
    result: dict[str, Any] = json.loads(output)
    result.update(foreign)
    return result


# --------------------------------------------------------------------------- output


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; numbers right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(
                cell.rjust(widths[i]) if numeric[i] else cell.ljust(widths[i])
                for i, cell in enumerate(row)
            )
            + " |"
        )

    rule = (
        "|"
        + "|".join(
            "-" * (widths[i] + 1) + ":" if numeric[i] else "-" * (widths[i] + 2)
            for i in range(len(headers))
        )
        + "|"
    )
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)


def header(title: str) -> None:
    print(f"\n## {title}\n", flush=True)


@contextlib.contextmanager
def section(title: str) -> Iterator[None]:
    started = time.monotonic()
    print(f"\n### {title}", flush=True)
    yield
    print(f"    ({time.monotonic() - started:.0f} s)", flush=True)


def common_arguments(parser: Any, duration: float, what: str = "seconds per load run") -> None:
    parser.add_argument(
        "--duration", type=float, default=duration, help=f"{what} (default {duration:g})"
    )
    parser.add_argument(
        "--source",
        type=Path,
        default=REPO,
        help="the tree whose proxy is measured (default: this checkout)",
    )
    parser.add_argument("--json-out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each measurement, wait up to this many seconds for other processes on "
        "the machine to use under 5%% of a core (default 0: measure at once, flag if busy)",
    )
    parser.add_argument(
        "--retry-busy",
        type=int,
        default=0,
        help="re-run a measurement that other processes disturbed, up to this many times, "
        "keeping the least disturbed attempt (default 0)",
    )


def describe_machine(source: Path) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "source": str(source),
        "revision": source_revision(source),
        "versions": versions(),
        "pinning": {"proxy_under_test": PROXY_CORE, "load_and_upstream": LOAD_CORE},
    }
