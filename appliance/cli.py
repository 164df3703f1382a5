"""`appliancectl`: the operator's command line.

Exit codes: 0 success, 1 a runtime failure (could not listen, peer refused, a step failed), 2 bad
usage or a bad configuration or request (the message names the key or argument), 3 not found (no
such crew), 4 conflict (the crew exists, or is not in a phase that allows it), 5 applianced is
not reachable, 6 the journal failed verification (`journal verify` names the entry). `run`
returns the command's own exit code (124 if it timed out). Every command takes `--json`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The proxy's modules (trio, proxycore, native) are imported where they are used: the admin
# commands (`crew`, `run`, `status`) then start in about a third of the time, which is most of
# what `appliancectl run` costs over `docker exec` (docs/benchmarks.md, crews).
if TYPE_CHECKING:
    from proxycore import control
    from proxycore.config import ProxyConfig

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
EXIT_NOT_FOUND, EXIT_CONFLICT, EXIT_UNREACHABLE = 3, 4, 5
EXIT_TAMPERED = 6
EXIT_NOT_IN_EFFECT = 7  # a credential change stored, not confirmed by the running proxy (502)
EXIT_TIMED_OUT = 124  # as timeout(1)


class _Output:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def result(self, human: str, data: dict[str, Any]) -> None:
        print(json.dumps(data) if self.as_json else human, flush=True)

    def error(self, message: str, code: int, *, kind: str | None = None) -> int:
        if self.as_json:
            data: dict[str, Any] = {"ok": False, "error": message}
            if kind is not None:
                data["kind"] = kind
            print(json.dumps(data), flush=True)
        else:
            print(f"appliancectl: error: {message}", file=sys.stderr, flush=True)
        return code


def cmd_proxy(args: argparse.Namespace, out: _Output) -> int:
    """The standalone proxy (no applianced): one worker in this process, or `--workers N`
    forked by appliance/proxy_supervisor.py. applianced's workers are `python -m
    proxycore.worker` processes of their own (appliance/daemon/proxy.py)."""
    from proxycore.config import load_config, validate
    from proxycore.errors import ConfigError, ProxyError

    try:
        config = load_config(args.config)
        warnings = validate(config, source=args.config)
    except ConfigError as exc:
        return out.error(str(exc), EXIT_USAGE)
    for warning in warnings:
        print(f"appliancectl: warning: {warning}", file=sys.stderr, flush=True)
    workers = args.workers or config.listen.workers
    if workers > 1:
        import msgspec

        config = msgspec.structs.replace(
            config, listen=msgspec.structs.replace(config.listen, workers=workers)
        )
    if args.check:
        out.result(f"{args.config}: ok", {"ok": True, "warnings": warnings})
        return EXIT_OK
    try:
        if workers == 1:
            from proxycore.worker import run_worker

            # Binds before announcing readiness, so a caller that sees "listening" can connect.
            run_worker(config, 0)
            return EXIT_OK
        return _run_workers(config, workers)
    except ConfigError as exc:
        return out.error(str(exc), EXIT_USAGE)
    except ProxyError as exc:
        return out.error(str(exc), EXIT_FAILURE)
    except KeyboardInterrupt:
        return EXIT_OK


def _run_workers(config: ProxyConfig, workers: int) -> int:
    from appliance.proxy_supervisor import run_supervised

    return run_supervised(config, workers)


def _control_request(path: str, message: control.ControlMessage) -> control.ControlReply:
    """One message to a proxy's control socket and its reply; OSError if unreachable."""
    from proxycore import control

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(control.encoder.encode(message) + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return control.reply_decoder.decode(data)


def cmd_proxy_allow(args: argparse.Namespace, out: _Output) -> int:
    from proxycore import control

    message = control.AllowHost(crew=args.crew, host=args.host)
    try:
        reply = _control_request(args.socket, message)
    except OSError as exc:
        return out.error(f"cannot reach control socket {args.socket}: {exc}", EXIT_FAILURE)
    if not reply.ok:
        return out.error(reply.error or "refused", EXIT_FAILURE)
    state = "added" if reply.changed else "already allowed"
    out.result(
        f"{args.host}: {state} for crew {args.crew}",
        {"ok": True, "crew": args.crew, "host": args.host, "changed": reply.changed},
    )
    return EXIT_OK


def cmd_proxy_reload_credentials(args: argparse.Namespace, out: _Output) -> int:
    from proxycore import control

    try:
        reply = _control_request(args.socket, control.ReloadCredentials())
    except OSError as exc:
        return out.error(f"cannot reach control socket {args.socket}: {exc}", EXIT_FAILURE)
    if not reply.ok:
        return out.error(reply.error or "refused", EXIT_FAILURE)
    state = "changed" if reply.changed else "unchanged"
    out.result(f"credentials reloaded ({state})", {"ok": True, "changed": reply.changed})
    return EXIT_OK


def _named_secret(spec: str, *, from_env: bool) -> tuple[str, bytes]:
    name, sep, where = spec.partition("=")
    if not sep or not name or not where:
        raise ValueError(f"{spec!r}: expected NAME={'VARIABLE' if from_env else 'PATH'}")
    if from_env:
        value = os.environ.get(where)
        if value is None:
            raise ValueError(f"--secret-env {name}: variable {where} is not set")
        return name, value.encode()
    try:
        return name, Path(where).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"--secret-file {name}: cannot read {where}: {exc.strerror}") from None


def cmd_scrub(args: argparse.Namespace, out: _Output) -> int:
    """Standard input to standard output through the scrubber, streaming (logs, command output)."""
    from native.scrub import PatternError, Scrubber

    try:
        secrets = [_named_secret(s, from_env=False) for s in args.secret_file]
        secrets += [_named_secret(s, from_env=True) for s in args.secret_env]
        scrubber = Scrubber(secrets)
    except (ValueError, PatternError) as exc:
        return out.error(str(exc), EXIT_USAGE)
    stream = scrubber.stream()
    sink = sys.stdout.buffer
    # os.read, not a buffered read: output follows input as it arrives (a tailed log).
    while chunk := os.read(sys.stdin.fileno(), 65536):
        sink.write(stream.feed(chunk))
        sink.flush()
    sink.write(stream.flush())
    sink.flush()
    return EXIT_OK


def cmd_demo(args: argparse.Namespace, out: _Output) -> int:
    from appliance import demo

    return demo.main(as_json=out.as_json)


# -- applianced and its admin API ---------------------------------------------------------------

DEFAULT_CONFIG = "/etc/agent-appliance/appliance.toml"
SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'512m', '1g', '1.5G', '536870912', '512MiB' -> bytes (binary units)."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1:] if value[-1:] in SIZE_UNITS else ""
    number = value[: len(value) - len(unit)]
    try:
        size = float(number) * SIZE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512m, 2g)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return int(size)


def _daemon_config(args: argparse.Namespace) -> Any:
    from appliance.daemon.config import load_config as load_daemon_config

    path = args.config
    if path is None and os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
    return load_daemon_config(path)


def _socket_path(args: argparse.Namespace) -> str:
    if args.socket:
        return str(args.socket)
    env = os.environ.get("APPLIANCECTL_SOCKET")
    if env:
        return env
    if args.config or os.path.exists(DEFAULT_CONFIG):
        try:
            return str(_daemon_config(args).daemon.admin_socket)
        except Exception:  # noqa: S110 (the default below is as good an answer)
            pass
    from appliance.daemon.client import DEFAULT_ADMIN_SOCKET

    return DEFAULT_ADMIN_SOCKET


def _admin(
    args: argparse.Namespace, out: _Output, method: str, target: str, body: object = None
) -> tuple[int, Any]:
    """One admin API call; (exit code, decoded body or None). Errors are printed here."""
    from appliance.daemon.client import AdminClient, AdminError, Unreachable

    client = AdminClient(_socket_path(args))
    try:
        return EXIT_OK, client.call(method, target, body)
    except Unreachable as exc:
        return out.error(str(exc), EXIT_UNREACHABLE), None
    except AdminError as exc:
        return out.error(exc.message, _exit_for_status(exc.status), kind=exc.error), None


def _exit_for_status(status: int) -> int:
    if status == 502:
        return EXIT_NOT_IN_EFFECT
    if status == 404:
        return EXIT_NOT_FOUND
    if status == 409:
        return EXIT_CONFLICT
    if 400 <= status < 500:
        return EXIT_USAGE
    return EXIT_FAILURE


def cmd_up(args: argparse.Namespace, out: _Output) -> int:
    try:
        config = _daemon_config(args)
    except Exception as exc:
        return out.error(str(exc), EXIT_USAGE)
    if os.geteuid() != 0:
        return out.error("applianced needs root (netlink, nftables, the engine)", EXIT_FAILURE)
    if args.detach:
        return _up_detached(args, config, out)
    from appliance.daemon.main import run_daemon

    return run_daemon(config)


def _up_detached(args: argparse.Namespace, config: Any, out: _Output) -> int:
    """Start applianced in its own session, logging to a file; return once its socket answers."""
    import subprocess
    import time

    from appliance.daemon.client import AdminClient, AdminError, Unreachable

    state_dir = Path(config.daemon.state_dir)
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_path = Path(args.log) if args.log else state_dir / "applianced.log"
    command = [sys.executable, "-m", "appliance.cli", "up"]
    if args.config:
        command += ["--config", str(args.config)]
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    client = AdminClient(config.daemon.admin_socket, timeout=5)
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-5:]
            return out.error(
                f"applianced exited with {process.returncode}; {log_path}: " + " | ".join(tail),
                EXIT_FAILURE,
            )
        try:
            status = client.call("GET", "/v1/status")
        except (Unreachable, AdminError):
            time.sleep(0.2)
            continue
        if status.get("pid") == process.pid:
            out.result(
                f"applianced running (pid {process.pid}), log {log_path}",
                {"ok": True, "pid": process.pid, "log": str(log_path), "status": status},
            )
            return EXIT_OK
        time.sleep(0.2)
    return out.error(
        f"applianced did not answer within {args.wait} s (log: {log_path})", EXIT_FAILURE
    )


def cmd_status(args: argparse.Namespace, out: _Output) -> int:
    code, status = _admin(args, out, "GET", "/v1/status")
    if code:
        return code
    lines = [
        f"applianced pid {status['pid']}, instance {status.get('instance')}, "
        f"state {status['state_dir']}",
        f"provider {status['provider']} (isolated: {status['isolated']}), runtimes: "
        + ", ".join(status["runtimes"]),
        f"proxy workers {', '.join(map(str, status.get('proxy_pids') or ())) or 'none'} "
        f"(uid {status.get('proxy_uid')}), alive: {status['proxy_alive']}, port "
        f"{status['proxy_port']}, restarts {status['proxy_restarts']}",
        f"crews: {status['crews']} ({status['crews_ready']} ready)",
    ]
    lines += [_worker_line(worker) for worker in status.get("proxy_workers") or ()]
    lines += [f"reconciled at start: {change}" for change in status["reconcile"]]
    out.result("\n".join(lines), {"ok": True, **status})
    return EXIT_OK


def _worker_line(worker: dict[str, Any]) -> str:
    """One proxy worker for `status`: pid and uid (or when it restarts), restarts, last exit."""
    import time

    def clock(ts: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))

    if worker.get("restart_at") is not None:
        left = max(0.0, worker["restart_at"] - time.time())
        state = f"down, back in {left:.1f} s (backoff {worker.get('backoff') or 0:.1f} s)"
    elif worker.get("pid") is not None:
        state = f"pid {worker['pid']}, uid {worker.get('uid')}"
    else:
        state = "starting"
    line = f"  worker {worker['index']}: {state}, restarts {worker['restarts']}"
    if worker.get("last_exit"):
        line += f"; last exit {clock(worker['last_exit_time'])}: {worker['last_exit']}"
        if worker.get("last_stderr"):
            line += f" (stderr: {worker['last_stderr']})"
    return line


def cmd_doctor(args: argparse.Namespace, out: _Output) -> int:
    import msgspec

    from appliance.daemon.doctor import run_checks

    try:
        config = _daemon_config(args)
    except Exception as exc:
        return out.error(str(exc), EXIT_USAGE)
    report = run_checks(config)
    lines = [
        f"{'ok  ' if c.ok else ('FAIL' if c.required else 'no  ')} {c.name}: {c.detail}"
        for c in report.checks
    ]
    lines.append("all required checks passed" if report.ok else "a required check failed")
    out.result("\n".join(lines), msgspec.to_builtins(report))
    return EXIT_OK if report.ok else EXIT_FAILURE


def _crew_line(crew: dict[str, Any]) -> str:
    return (
        f"{crew['name']:<20} {crew['phase']:<9} {crew['mode']:<10} {crew['runtime']:<8} "
        f"{crew.get('gateway') or '-':<16} {','.join(crew['allow']) or '-'}"
    )


def _crew_details(crew: dict[str, Any]) -> str:
    lines = [
        f"name:     {crew['name']}",
        f"phase:    {crew['phase']}" + (f" ({crew['error']})" if crew.get("error") else ""),
        f"mode:     {crew['mode']}",
        f"allow:    {', '.join(crew['allow']) or '-'}",
        f"reach:    {', '.join(crew.get('ssrf_allow') or ()) or '-'} (ssrf_allow)",
        f"runtime:  {crew['runtime']}",
        f"memory:   {crew['memory_bytes'] // (1 << 20)} MiB",
        f"cpus:     {crew['cpus']}",
        f"gateway:  {crew.get('gateway') or '-'}  address: {crew.get('address') or '-'}",
    ]
    for container in crew.get("containers", []):
        state = "running" if container["running"] else "stopped"
        lines.append(f"{container['role']:<6}    {container['container_id'][:12]} {state}")
    return "\n".join(lines)


def _effective_allow(crew: dict[str, Any]) -> str:
    """`crew show`: what the proxy lets this crew reach, each host with where it comes from
    (crew: its own allow; default: [proxy.policy] default_allow; provider: a provider's URL)."""
    if crew["mode"] == "free":
        return "egress:   any host (mode free; the SSRF guard still applies)"
    if crew["mode"] == "none":
        return "egress:   none (mode none)"
    entries = crew.get("effective_allow") or []
    lines = [f"egress:   only these {len(entries)} hosts (mode restricted):"]
    width = max((len(entry["host"]) for entry in entries), default=0)
    lines += [
        f"          {entry['host']:<{width}}  {', '.join(entry['sources'])}" for entry in entries
    ]
    return "\n".join(lines)


def cmd_crew_create(args: argparse.Namespace, out: _Output) -> int:
    # A plain dict (the fields of messages.CreateCrew): the admin commands leave msgspec out.
    request = {
        "name": args.name,
        "mode": args.mode,
        "allow": [host for group in args.allow for host in group],
        "runtime": args.runtime,
        "memory_bytes": args.memory,
        "cpus": args.cpus,
        "ssrf_allow": args.ssrf_allow,
    }
    code, crew = _admin(args, out, "POST", "/v1/crews", request)
    if code:
        return code
    out.result(f"crew {crew['name']} created\n" + _crew_details(crew), {"ok": True, "crew": crew})
    return EXIT_OK


def cmd_crew_ls(args: argparse.Namespace, out: _Output) -> int:
    code, listing = _admin(args, out, "GET", "/v1/crews")
    if code:
        return code
    header = f"{'NAME':<20} {'PHASE':<9} {'MODE':<10} {'RUNTIME':<8} {'GATEWAY':<16} ALLOW"
    human = "\n".join([header, *(_crew_line(c) for c in listing["crews"])])
    out.result(human, {"ok": True, **listing})
    return EXIT_OK


def cmd_crew_show(args: argparse.Namespace, out: _Output) -> int:
    code, crew = _admin(args, out, "GET", f"/v1/crews/{args.name}")
    if code:
        return code
    out.result(_crew_details(crew) + "\n" + _effective_allow(crew), {"ok": True, "crew": crew})
    return EXIT_OK


def cmd_crew_allow(args: argparse.Namespace, out: _Output) -> int:
    code, result = _admin(args, out, "POST", f"/v1/crews/{args.name}/allow", {"host": args.host})
    if code:
        return code
    state = "added" if result["changed"] else "already allowed"
    out.result(f"{args.host}: {state} for crew {args.name}", {"ok": True, **result})
    return EXIT_OK


def cmd_crew_rm(args: argparse.Namespace, out: _Output) -> int:
    code, result = _admin(args, out, "DELETE", f"/v1/crews/{args.name}")
    if code:
        return code
    out.result(f"crew {args.name} removed", {"ok": True, **result})
    return EXIT_OK


def cmd_run(args: argparse.Namespace, out: _Output) -> int:
    # The same streaming and exit codes as the console script's fast path (appliance/ctl.py),
    # by the same code.
    from appliance.ctl import RunLine, run

    argv = list(args.argv)
    if not argv:
        return out.error("argument CMD: give the command after --", EXIT_USAGE)
    line = RunLine()
    line.as_json, line.timeout, line.name, line.argv = out.as_json, args.timeout, args.name, argv
    return run(line, _socket_path(args))


def _journal_line(row: dict[str, Any]) -> str:
    import time

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["ts"]))
    return f"{row['seq']:>7} {when} {row['type']:<20} {row['crew'] or '-':<16} {row['summary']}"


def _journal_query(**params: object) -> str:
    from urllib.parse import urlencode

    return urlencode({k: v for k, v in params.items() if v is not None})


def cmd_journal_tail(args: argparse.Namespace, out: _Output) -> int:
    import time

    if args.n < 0:
        return out.error("argument -n: must be >= 0", EXIT_USAGE)
    after = 0
    count = args.n
    if args.follow and count == 0:
        # Nothing of the past: start at the current end.
        code, reply = _admin(args, out, "GET", f"/v1/journal?{_journal_query(n=1)}")
        if code:
            return code
        after = max([row["seq"] for row in reply["entries"]], default=0)
    while True:
        query = _journal_query(n=count, crew=args.crew, type=args.type, after=after)
        code, reply = _admin(args, out, "GET", f"/v1/journal?{query}")
        if code:
            return code
        for row in reply["entries"]:
            print(json.dumps(row) if out.as_json else _journal_line(row), flush=True)
            after = max(after, row["seq"])
        if not args.follow:
            return EXIT_OK
        count = 1000
        if len(reply["entries"]) < count:
            time.sleep(0.5)


def cmd_journal_search(args: argparse.Namespace, out: _Output) -> int:
    query = _journal_query(q=args.query, n=args.n)
    code, reply = _admin(args, out, "GET", f"/v1/journal/search?{query}")
    if code:
        return code
    if out.as_json:
        out.result("", {"ok": True, **reply})
    else:
        for row in reply["entries"]:
            print(_journal_line(row), flush=True)
    return EXIT_OK


def cmd_journal_export(args: argparse.Namespace, out: _Output) -> int:
    from appliance.daemon.client import AdminClient, AdminError, Unreachable

    client = AdminClient(_socket_path(args), timeout=None)
    try:
        for line in client.lines("/v1/journal/export"):
            sys.stdout.buffer.write(line)
        sys.stdout.flush()
    except Unreachable as exc:
        return out.error(str(exc), EXIT_UNREACHABLE)
    except AdminError as exc:
        return out.error(exc.message, _exit_for_status(exc.status), kind=exc.error)
    return EXIT_OK


def cmd_journal_verify(args: argparse.Namespace, out: _Output) -> int:
    code, report = _admin(args, out, "GET", "/v1/journal/verify")
    if code:
        return code
    problem = report.get("problem")
    if problem is None:
        out.result(
            f"journal intact: {report['entries']} entries, head {report['head_seq']} "
            f"{report['head_hash']} (anchor at {report['anchor_seq']})",
            {**report},
        )
        return EXIT_OK
    message = f"journal TAMPERED at entry {problem['seq']} ({problem['kind']}): {problem['detail']}"
    if out.as_json:
        print(json.dumps(report), flush=True)
    else:
        print(f"appliancectl: {message}", file=sys.stderr, flush=True)
    return EXIT_TAMPERED


def cmd_net_show(args: argparse.Namespace, out: _Output) -> int:
    code, report = _admin(args, out, "GET", "/v1/net")
    if code:
        return code
    lines = [
        f"table {report['table']}: {'present' if report['table_present'] else 'MISSING'}"
        + (
            f"; differs: {'; '.join(report['base_differences'])}"
            if report["base_differences"]
            else ""
        )
    ]
    for crew in report["crews"]:
        lines.append(
            f"{crew['crew']:<20} {crew['phase']:<9} {crew['ifname']} gw {crew['gateway']} "
            f"crew {crew['address']} ns {'alive' if crew['namespace_alive'] else 'gone'} "
            f"accepted {crew['accepted_packets']} dropped {crew['dropped_packets']}"
        )
    for counter in report["counters"]:
        lines.append(f"counter {counter['role']}: {counter['packets']} packets")
    if report["orphan_links"] or report["orphan_chains"]:
        lines.append(f"orphans: links {report['orphan_links']} chains {report['orphan_chains']}")
    out.result("\n".join(lines), {"ok": True, **report})
    return EXIT_OK


# -- cred: the credential store ------------------------------------------------------------------
# A value is read from a file (--from-file) or standard input (a prompt without echo on a TTY, or
# piped), never from an argument: argv is readable by every user in /proc/PID/cmdline and lands
# in shell histories. No option takes a value.


def _read_value(args: argparse.Namespace, out: _Output) -> bytes | None:
    """The value from --from-file or stdin, one trailing newline removed; None after an error."""
    if args.from_file:
        try:
            with open(args.from_file, "rb") as handle:
                data = handle.read(1 << 20)
        except OSError as exc:
            out.error(f"argument --from-file: cannot read {args.from_file}: {exc.strerror}", 2)
            return None
    elif sys.stdin.isatty():
        import getpass

        try:
            data = getpass.getpass(f"value for {args.name} (not echoed): ").encode()
        except (EOFError, KeyboardInterrupt):
            out.error("no value entered", EXIT_USAGE)
            return None
    else:
        data = sys.stdin.buffer.read(1 << 20)
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        source = f"--from-file {args.from_file}" if args.from_file else "standard input"
        out.error(f"the value from {source} is empty", EXIT_USAGE)
        return None
    return data


def _cred_line(cred: dict[str, Any]) -> str:
    grants = ",".join(g["crew"] + (f"/{g['agent']}" if g["agent"] else "") for g in cred["grants"])
    state = "TAMPERED" if cred.get("tampered") else "revoked" if cred["revoked"] else "active"
    refused = "; ".join(
        f"{r['crew']}" + (f"/{r['agent']}" if r["agent"] else "") + f" ({r['reason']})"
        for r in cred.get("refused", ())
    )
    return (
        f"{cred['name']:<20} {cred['provider']:<10} {cred['kind']:<11} {cred['level']:<5} "
        f"{cred['version']:<3} {state:<8} {grants or '-'}"
        + (f"  REFUSED: {refused}" if refused else "")
    )


def _cred_result(out: _Output, human: str, cred: dict[str, Any]) -> int:
    out.result(human, {"ok": True, "credential": cred})
    return EXIT_OK


def cmd_cred_add(args: argparse.Namespace, out: _Output) -> int:
    from appliance.daemon import messages

    value = _read_value(args, out)
    if value is None:
        return EXIT_USAGE
    request = messages.AddCredential(
        name=args.name, provider=args.provider, value=value, level=args.level, kind=args.kind
    )
    del value
    code, cred = _admin(args, out, "POST", "/v1/credentials", request)
    if code:
        return code
    human = f"credential {cred['name']} added ({cred['provider']}, {cred['kind']}, {cred['level']})"
    return _cred_result(out, human, cred)


def cmd_cred_ls(args: argparse.Namespace, out: _Output) -> int:
    code, listing = _admin(args, out, "GET", "/v1/credentials")
    if code:
        return code
    header = (
        f"{'NAME':<20} {'PROVIDER':<10} {'KIND':<11} {'LEVEL':<5} {'VER':<3} {'STATE':<8} GRANTS"
    )
    human = "\n".join([header, *(_cred_line(c) for c in listing["credentials"])])
    # A record or grant that does not verify is never used; the listing exits 6 (as `journal
    # verify` does) so that a script notices.
    bad = [c["name"] for c in listing["credentials"] if c.get("tampered") or c.get("refused")]
    if bad:
        human += (
            f"\n{len(bad)} credential(s) with a record or grant that does not verify (never "
            f"used): {', '.join(bad)}; see docs/credentials.md"
        )
    out.result(human, {"ok": not bad, **listing})
    return EXIT_TAMPERED if bad else EXIT_OK


def cmd_cred_grant(args: argparse.Namespace, out: _Output) -> int:
    from appliance.daemon import messages

    request = messages.GrantCredential(crew=args.crew, agent=args.agent)
    code, cred = _admin(args, out, "POST", f"/v1/credentials/{args.name}/grant", request)
    if code:
        return code
    who = f"agent {args.agent} of crew {args.crew}" if args.agent else f"crew {args.crew}"
    return _cred_result(out, f"credential {args.name} granted to {who}", cred)


def cmd_cred_revoke(args: argparse.Namespace, out: _Output) -> int:
    from appliance.daemon import messages

    request = messages.RevokeCredential(crew=args.crew, agent=args.agent)
    code, cred = _admin(args, out, "POST", f"/v1/credentials/{args.name}/revoke", request)
    if code:
        return code
    who = f"crew {args.crew}" if args.crew else "every crew (marked revoked)"
    return _cred_result(out, f"credential {args.name} revoked from {who}", cred)


def cmd_cred_rotate(args: argparse.Namespace, out: _Output) -> int:
    from appliance.daemon import messages

    value = _read_value(args, out)
    if value is None:
        return EXIT_USAGE
    request = messages.RotateCredential(value=value, level=args.level)
    del value
    code, cred = _admin(args, out, "POST", f"/v1/credentials/{args.name}/rotate", request)
    if code:
        return code
    return _cred_result(out, f"credential {args.name} rotated to version {cred['version']}", cred)


def _add_cred_parsers(commands: Any, leaf: Any) -> None:
    cred = commands.add_parser("cred", help="the credential store (values never in arguments)")
    creds = cred.add_subparsers(dest="cred_command", required=True)
    from_file = {
        "metavar": "F",
        "help": "read the value from this file (default: standard input; a prompt on a TTY)",
    }
    add = leaf(creds.add_parser("add", help="add a credential; the value from stdin or a file"))
    add.add_argument("name")
    add.add_argument(
        "--provider", required=True, help="anthropic, openai, google, or a keeper secret's name"
    )
    add.add_argument("--level", default="L3", choices=["L1", "L2", "L3"], help="default L3")
    add.add_argument("--kind", choices=["api_key", "oauth_token", "secret"], default=None)
    add.add_argument("--from-file", **from_file)
    add.set_defaults(func=cmd_cred_add)
    leaf(creds.add_parser("ls", help="list credentials (never their values)")).set_defaults(
        func=cmd_cred_ls
    )
    grant = leaf(creds.add_parser("grant", help="let a crew (or one agent) use a credential"))
    grant.add_argument("name")
    grant.add_argument("crew")
    grant.add_argument("--agent", metavar="ID", help="only this agent id of the crew")
    grant.set_defaults(func=cmd_cred_grant)
    revoke = leaf(
        creds.add_parser("revoke", help="remove a crew's grants, or every grant and mark revoked")
    )
    revoke.add_argument("name")
    revoke.add_argument("crew", nargs="?")
    revoke.add_argument("--agent", metavar="ID", help="only this agent id's grant")
    revoke.set_defaults(func=cmd_cred_revoke)
    rotate = leaf(
        creds.add_parser("rotate", help="a new value (version + 1), from stdin or a file")
    )
    rotate.add_argument("name")
    rotate.add_argument("--level", choices=["L1", "L2", "L3"], default=None)
    rotate.add_argument("--from-file", **from_file)
    rotate.set_defaults(func=cmd_cred_rotate)


def _add_admin_parsers(commands: Any) -> None:
    def leaf(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
        )
        parser.add_argument(
            "--socket",
            default=argparse.SUPPRESS,
            help="applianced's admin socket (default: $APPLIANCECTL_SOCKET, the config's, or "
            "/run/agent-appliance/admin.sock)",
        )
        parser.add_argument(
            "--config",
            default=argparse.SUPPRESS,
            help=f"appliance config (default {DEFAULT_CONFIG})",
        )
        return parser

    up = leaf(commands.add_parser("up", help="run applianced (foreground unless --detach)"))
    up.add_argument("--detach", action="store_true", help="run in the background, return when up")
    up.add_argument("--log", help="log file with --detach (default <state_dir>/applianced.log)")
    up.add_argument("--wait", type=float, default=120.0, help="seconds to wait with --detach")
    up.set_defaults(func=cmd_up)

    leaf(commands.add_parser("status", help="applianced's state")).set_defaults(func=cmd_status)
    leaf(
        commands.add_parser("doctor", help="check that this host can run the appliance")
    ).set_defaults(func=cmd_doctor)

    crew = commands.add_parser("crew", help="manage crews")
    crews = crew.add_subparsers(dest="crew_command", required=True)
    create = leaf(crews.add_parser("create", help="create a crew and start its agent container"))
    create.add_argument("name")
    create.add_argument("--mode", default="restricted", help="free, restricted (default) or none")
    create.add_argument(
        "--allow", nargs="+", action="append", default=[], metavar="HOST", help="allowed hosts"
    )
    create.add_argument("--runtime", help="container runtime (default: the configured one)")
    create.add_argument("--memory", type=parse_size, help="memory limit, e.g. 512m, 2g")
    create.add_argument("--cpus", type=float, help="CPU limit, e.g. 0.5, 2")
    create.add_argument(
        "--ssrf-allow",
        action="append",
        default=[],
        metavar="CIDR",
        help="a destination range only this crew may reach although the SSRF guard refuses it, "
        "the appliance host's own addresses included (repeatable; docs/proxy.md)",
    )
    create.set_defaults(func=cmd_crew_create)
    leaf(crews.add_parser("ls", help="list crews")).set_defaults(func=cmd_crew_ls)
    show = leaf(crews.add_parser("show", help="one crew in detail"))
    show.add_argument("name")
    show.set_defaults(func=cmd_crew_show)
    allow = leaf(crews.add_parser("allow", help="allow a host for a crew, at run time"))
    allow.add_argument("name")
    allow.add_argument("host")
    allow.set_defaults(func=cmd_crew_allow)
    rm = leaf(crews.add_parser("rm", help="remove a crew (containers, network, proxy)"))
    rm.add_argument("name")
    rm.set_defaults(func=cmd_crew_rm)

    run = leaf(commands.add_parser("run", help="run a command in a crew's agent container"))
    run.add_argument("--timeout", type=float, help="seconds, then the command is killed (exit 124)")
    run.add_argument("name")
    # Everything after the first "--" is the command (split off in main(), so that options
    # may come before or after NAME).
    run.add_argument("argv", nargs="*", metavar="-- CMD")
    run.set_defaults(func=cmd_run)

    _add_cred_parsers(commands, leaf)

    journal = commands.add_parser("journal", help="the tamper-evident journal")
    journals = journal.add_subparsers(dest="journal_command", required=True)
    tail = leaf(journals.add_parser("tail", help="the latest entries, oldest first"))
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing new entries")
    tail.add_argument("--crew", help="only this crew's entries")
    tail.add_argument("--type", help="only this type (run matches every run.* type)")
    tail.add_argument("-n", type=int, default=20, help="how many (default 20)")
    tail.set_defaults(func=cmd_journal_tail)
    search = leaf(journals.add_parser("search", help="full-text search (FTS5 syntax)"))
    search.add_argument("query")
    search.add_argument("-n", type=int, default=50, help="at most this many (default 50)")
    search.set_defaults(func=cmd_journal_search)
    export = leaf(journals.add_parser("export", help="every entry as JSON lines, to stdout"))
    export.add_argument(
        "--jsonl", action="store_true", required=True, help="JSON lines (the only format)"
    )
    export.set_defaults(func=cmd_journal_export)
    leaf(
        journals.add_parser("verify", help="check the hash chain; exit 6 naming the entry if not")
    ).set_defaults(func=cmd_journal_verify)

    net = commands.add_parser("net", help="the crews' networks")
    nets = net.add_subparsers(dest="net_command", required=True)
    leaf(nets.add_parser("show", help="links, addresses, rules and counters")).set_defaults(
        func=cmd_net_show
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliancectl", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--socket", default=None, help="applianced's admin socket")
    parser.add_argument("--config", default=None, help="appliance config file")
    commands = parser.add_subparsers(dest="command", required=True)

    proxy = commands.add_parser("proxy", help="run the proxy core in the foreground")
    proxy.add_argument("--config", required=True, help="TOML configuration file")
    proxy.add_argument("--workers", type=int, default=0, help="worker processes (SO_REUSEPORT)")
    proxy.add_argument("--check", action="store_true", help="validate the config and exit")
    proxy.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    proxy.set_defaults(func=cmd_proxy)

    allow = commands.add_parser("proxy-allow", help="add a host to a crew's allowlist at run time")
    allow.add_argument("--socket", required=True, help="the proxy's control socket")
    allow.add_argument("crew")
    allow.add_argument("host")
    allow.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    allow.set_defaults(func=cmd_proxy_allow)

    reload = commands.add_parser(
        "proxy-reload-credentials",
        help="make a running proxy read its provider credentials again (rotation) and rescrub",
    )
    reload.add_argument("--socket", required=True, help="the proxy's control socket")
    reload.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    reload.set_defaults(func=cmd_proxy_reload_credentials)

    scrub = commands.add_parser(
        "scrub", help="filter standard input to standard output through the secret scrubber"
    )
    scrub.add_argument(
        "--secret-file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a secret to redact, read from a file (repeatable)",
    )
    scrub.add_argument(
        "--secret-env",
        action="append",
        default=[],
        metavar="NAME=VARIABLE",
        help="a secret to redact, read from an environment variable (repeatable)",
    )
    scrub.set_defaults(func=cmd_scrub)

    demo = commands.add_parser("demo", help="a scripted tour against a local fake provider")
    demo.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    demo.set_defaults(func=cmd_demo)
    _add_admin_parsers(commands)
    return parser


# The commands that only talk to applianced's admin socket: they import the socket client and
# json, nothing else (no logging, msgspec, trio, docker, netns, proxycore, native).
_ADMIN_SOCKET_COMMANDS = frozenset({"status", "crew", "run", "net"})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "run" in arguments and "--" in arguments[arguments.index("run") :]:
        split = arguments.index("--", arguments.index("run"))
        arguments, command = arguments[:split], arguments[split + 1 :]
    args = parser.parse_args(arguments)
    if args.command == "run":
        args.argv = [*args.argv, *command]
    if args.command == "proxy" and args.workers < 0:
        parser.error("argument --workers: must be >= 1")
    if args.command not in _ADMIN_SOCKET_COMMANDS:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(levelname)s: %(message)s")
    out = _Output(args.json)
    try:
        result: int = args.func(args, out)
    except BrokenPipeError:
        # The reader went away (`appliancectl crew ls | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it
    return result


if __name__ == "__main__":
    sys.exit(main())
