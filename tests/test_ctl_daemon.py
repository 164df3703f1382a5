"""appliancectl against a real applianced and a real crew container: `run` as `docker exec`
(-i, -t on a pty, signals, exit codes), `status` exit codes, `events -f` with filters, `journal
search` of plain text, output formats and errors."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import termios
import time

import yaml

from appliance.ctl import exits
from tests.conftest import ROOT, proxy_env
from tests.daemon_support import REACH_TEST_HOSTS, Appliance, sigint_as_in_a_terminal


def _crew(app: Appliance, short: str) -> str:
    name = app.crew(short)
    code, created = app.ctl_json("crew", "create", name, *REACH_TEST_HOSTS)
    assert code == 0, (created, app.log_text())
    return name


def _read_until(fd: int, needle: bytes, timeout: float = 30) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, seen
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    assert needle in seen, seen
    return seen


def test_run_attaches_stdin_a_tty_and_forwards_signals(appliance: Appliance) -> None:
    app = appliance
    app.start()
    name = _crew(app, "exec")
    run = [*app.ctl_argv(), "run"]

    # -i: our stdin is the command's, EOF included; no -i: the command has none.
    done = subprocess.run(
        [*run, "-i", name, "--", "sh", "-c", "cat; echo end"],
        input=b"line one\nline two\n",
        capture_output=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0 and done.stdout == b"line one\nline two\nend\n", done
    done = subprocess.run(
        [*run, name, "--", "sh", "-c", "cat; echo end"],
        input=b"not read\n",
        capture_output=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0 and done.stdout == b"end\n", done
    # stdout and stderr stay apart without a TTY, and the exit code is the command's.
    done = subprocess.run(
        [*run, name, "--", "sh", "-c", "echo out; echo err >&2; exit 3"],
        capture_output=True,
        timeout=60,
        cwd=ROOT,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, b"out\n", b"err\n"), done

    # Ctrl-C without a TTY: SIGINT is forwarded to the command, which may handle it...
    script = "trap 'echo trapped; exit 42' INT; echo ready; while :; do sleep 0.1; done"
    process = subprocess.Popen(
        [*run, name, "--", "sh", "-c", script], stdout=subprocess.PIPE, cwd=ROOT
    )
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    process.send_signal(signal.SIGINT)
    rest, _ = process.communicate(timeout=60)
    assert (process.returncode, rest) == (42, b"trapped\n")
    # ... or die of it: 128 + 2, as a shell reports it.
    process = subprocess.Popen(
        [*run, name, "--", "sh", "-c", "echo ready; exec sleep 60"],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)
    assert process.returncode == 130 and time.monotonic() - started < 20
    # SIGTERM too.
    process = subprocess.Popen(
        [
            *run,
            name,
            "--",
            "sh",
            "-c",
            "trap 'exit 15' TERM; echo ready; while :; do sleep 0.1; done",
        ],
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == 15

    # -i -t on a terminal (a pty here): the command has a TTY of our window size, our terminal
    # is raw (what we type reaches it as bytes, echoed by the crew's TTY), and Ctrl-C is a
    # byte that its line discipline turns into SIGINT.
    leader, follower = pty.openpty()
    termios.tcsetwinsize(follower, (33, 111))
    script = "stty size; test -t 0 && echo tty-yes; read x; echo got-$x; exec sleep 60"
    process = subprocess.Popen(
        [*run, "-it", name, "--", "sh", "-c", script],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        cwd=ROOT,
        env=proxy_env(),
        start_new_session=True,
    )
    os.close(follower)
    try:
        seen = _read_until(leader, b"tty-yes")
        assert b"33 111" in seen, seen
        os.write(leader, b"abc\r")
        _read_until(leader, b"got-abc")
        time.sleep(0.5)
        os.write(leader, b"\x03")
        assert process.wait(timeout=60) == 130
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)

    # A refused run never upgrades: the usual error and exit code.
    done = app.ctl("run", app.crew("nope"), "--", "true")
    assert done.returncode == exits.NOT_FOUND and "error" in done.stderr, done


def test_status_events_search_and_formats(appliance: Appliance) -> None:
    app = appliance
    app.start()
    name = _crew(app, "obs")

    done = app.ctl("status")
    assert done.returncode == exits.OK, (done, app.log_text())
    assert "ok   proxy" in done.stdout and "ok   engine" in done.stdout, done.stdout
    code, status = app.ctl_json("status")
    assert code == 0 and status["ok"] is True
    assert {part["name"] for part in status["health"]} == {"proxy", "engine", "journal"}

    # A worker killed: until its successor runs (0.5 s backoff, then its start-up), status
    # says the proxy is down, and why, and exits 9.
    os.kill(status["proxy_workers"][0]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        done = app.ctl("status")
        if done.returncode == exits.DEGRADED or time.monotonic() > deadline:
            break
    assert done.returncode == exits.DEGRADED, done
    assert "DEGRADED: proxy down" in done.stdout and "SIGKILL" in done.stdout, done.stdout
    deadline = time.monotonic() + 30
    while app.ctl("status").returncode != exits.OK:
        assert time.monotonic() < deadline, "the worker never came back"
        time.sleep(0.2)

    # Output formats: json, yaml, name, wide; errors on stderr.
    listing = app.ctl("crew", "ls", "-o", "yaml")
    assert listing.returncode == 0 and yaml.safe_load(listing.stdout)["crews"][0]["name"] == name
    assert app.ctl("crew", "ls", "-o", "name").stdout == f"{name}\n"
    wide = app.ctl("crew", "ls", "-o", "wide").stdout
    assert "ADDRESS" in wide.splitlines()[0] and name in wide
    missing = app.ctl("crew", "show", app.crew("nope"), "-o", "json")
    assert missing.returncode == exits.NOT_FOUND and missing.stdout == ""
    assert json.loads(missing.stderr)["kind"] == "not_found"

    # events -f: live, filtered by crew and by decision.
    follow = subprocess.Popen(
        [*app.ctl_argv(), "-o", "json", "events", "-f", "-n", "0", "--crew", name, "--type", "run"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=sigint_as_in_a_terminal,
    )
    try:
        time.sleep(2)
        assert app.ctl("run", name, "--", "echo", "denied.test").returncode == 0
        assert follow.stdout is not None
        first = json.loads(follow.stdout.readline())
        second = json.loads(follow.stdout.readline())
        assert (first["type"], second["type"]) == ("run.started", "run.completed"), (first, second)
        assert first["crew"] == second["crew"] == name
    finally:
        follow.send_signal(signal.SIGINT)
        follow.communicate(timeout=30)
    assert follow.returncode == exits.INTERRUPTED

    # Traffic the proxy denies, then `--decision deny` shows only that.
    denied = app.ctl("run", name, "--", "sh", "-c", 'wget -q -O- "http://denied.test/" ; true')
    assert denied.returncode == 0, denied
    deny = app.ctl("-o", "json", "events", "-n", "50", "--decision", "deny")
    types = {json.loads(line)["type"] for line in deny.stdout.splitlines()}
    assert types <= {"proxy.deny"} and deny.returncode == 0, deny

    # journal search of plain text: dots, quotes, operators are words.
    for text in ("denied.test", "echo denied.test", 'say "x" OR NEAR -z'):
        done = app.ctl("-o", "json", "journal", "search", text)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (text, done)
    found = json.loads(app.ctl("-o", "json", "journal", "search", "denied.test").stdout)
    assert any(entry["type"] == "run.started" for entry in found["entries"]), found
    bad = app.ctl("journal", "search", "--fts", 'AND "')
    assert bad.returncode == exits.USAGE and "Traceback" not in bad.stderr, bad


def test_crew_ls_watch_repeats_until_ctrl_c(appliance: Appliance) -> None:
    app = appliance
    app.start()
    process = subprocess.Popen(
        [*app.ctl_argv(), "-o", "json", "crew", "ls", "--watch", "--interval", "0.3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=sigint_as_in_a_terminal,
    )
    time.sleep(2.5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == exits.INTERRUPTED and "Traceback" not in err, err
    documents = [json.loads(line) for line in out.splitlines()]
    assert len(documents) >= 3 and all(d["crews"] == [] for d in documents)
