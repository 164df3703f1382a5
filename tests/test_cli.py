"""appliancectl as a shell user meets it, without a daemon: conventions (--version, -o, errors on
stderr, exit codes, completion, Ctrl-C), the parser (no positional swallowed), the run fast
path against the full CLI."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.ctl import exits
from appliance.ctl.main import build_parser, split_run
from tests.daemon_support import sigint_as_in_a_terminal

ROOT = Path(__file__).resolve().parent.parent
NO_DAEMON = ("--socket", "/nonexistent/admin.sock")
ENTRIES = ("appliance.ctl", "appliance.cli")
LAUNCHER = [str(ROOT / "bin" / "appliancectl")]
# As in a venv's bin/: the launcher starts the python3 next to it, else the one on PATH.
LAUNCHER_ENV = {
    **os.environ,
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
}


def ctl(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
        **kwargs,  # type: ignore[call-overload]
    )


def test_a_reader_that_goes_away_is_not_a_traceback() -> None:
    # `appliancectl ... | head`: the pipe closes early; the command ends quietly with 141
    # (128 + SIGPIPE, what a shell reports), not with a BrokenPipeError traceback.
    script = (
        f"head -c 5000000 /dev/zero | tr '\\0' a | {sys.executable} -m appliance.cli scrub "
        "| head -c 10 >/dev/null; echo ${PIPESTATUS[2]}"
    )
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60, check=True, cwd=ROOT
    )
    assert done.stdout.strip() == "141", done
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_version() -> None:
    done = ctl("--version")
    assert done.returncode == 0 and done.stdout.startswith("appliancectl "), done
    assert done.stdout.split()[1][0].isdigit(), done


def test_usage_errors_exit_2_on_stderr() -> None:
    for args in (("crew",), ("crew", "frobnicate"), ("--bogus",), ("crew", "ls", "-o", "xml")):
        done = ctl(*args)
        assert done.returncode == exits.USAGE, (args, done)
        assert done.stdout == "" and "usage:" in done.stderr and "Traceback" not in done.stderr


def test_errors_go_to_stderr_also_as_json() -> None:
    for output in (("--json",), ("-o", "json"), ("-o", "yaml")):
        done = ctl(*output, *NO_DAEMON, "crew", "ls")
        assert done.returncode == exits.UNREACHABLE and done.stdout == "", done
        error = json.loads(done.stderr)
        assert error["ok"] is False and error["exit_code"] == exits.UNREACHABLE
        assert "not answering" in error["error"] and error["kind"] == "unreachable"
    # after the subcommand too
    done = ctl("crew", "ls", "-o", "json", *NO_DAEMON)
    assert done.returncode == exits.UNREACHABLE and json.loads(done.stderr)["ok"] is False


def test_status_of_no_daemon_is_exit_5() -> None:
    done = ctl(*NO_DAEMON, "status")
    assert done.returncode == exits.UNREACHABLE, done
    assert done.stderr.startswith("appliancectl: error: applianced is not answering")


def test_allow_never_swallows_the_crew_name() -> None:
    parser = build_parser()
    for argv in (
        ["crew", "create", "c1", "--allow", "a.example", "--allow", "b.example"],
        ["crew", "create", "--allow", "a.example", "c1", "--allow", "b.example"],
        ["crew", "create", "--allow", "a.example,b.example", "c1"],
        ["crew", "create", "--allow", "a.example", "--allow", "b.example", "c1"],
    ):
        args = parser.parse_args(argv)
        from appliance.ctl.crew import hosts

        assert args.name == "c1", argv
        assert hosts(args.allow) == ("a.example", "b.example"), argv


def test_run_takes_i_t_and_the_command_after_the_double_dash() -> None:
    parser = build_parser()
    arguments, command = split_run(["run", "-it", "c1", "--", "sh", "-c", "echo -- -i"])
    args = parser.parse_args(arguments)
    assert (args.interactive, args.tty, args.name, command) == (
        True,
        True,
        "c1",
        ["sh", "-c", "echo -- -i"],
    )


def test_every_listing_and_showing_command_takes_output_formats() -> None:
    parser = build_parser()
    for argv in (
        ["status"],
        ["crew", "ls"],
        ["crew", "show", "c"],
        ["cred", "ls"],
        ["journal", "tail"],
        ["journal", "search", "x"],
        ["journal", "verify"],
        ["events"],
        ["net", "show"],
        ["doctor"],
    ):
        for option in (["-o", "json"], ["-o", "yaml"], ["-o", "wide"], ["-o", "name"]):
            assert parser.parse_args([*argv, *option]).output == option[1], argv
        assert parser.parse_args([*argv, "--json"]).output == "json", argv
    assert parser.parse_args(["crew", "ls", "--watch"]).watch
    assert parser.parse_args(["status", "-w", "--interval", "1"]).interval == 1.0


def test_the_exit_code_table_is_consistent() -> None:
    codes = [code for code, _, _ in exits.TABLE]
    assert len(codes) == len(set(codes))
    assert (exits.OK, exits.FAILURE, exits.USAGE) == (0, 1, 2)
    assert exits.for_status(404) == exits.NOT_FOUND and exits.for_status(409) == exits.CONFLICT
    assert exits.for_status(400) == exits.for_status(418) == exits.USAGE
    assert exits.for_status(502) == exits.NOT_IN_EFFECT
    assert exits.for_status(503) == exits.UNAVAILABLE and exits.for_status(500) == exits.FAILURE
    assert exits.for_process(-2) == 130 and exits.for_process(7) == 7
    for status in exits.HTTP_STATUS.values():
        assert status in codes


def test_completion_scripts(tmp_path: Path) -> None:
    for shell in ("bash", "zsh", "fish"):
        done = ctl("completion", shell)
        assert done.returncode == 0 and "appliancectl" in done.stdout, done
        (tmp_path / f"c.{shell}").write_text(done.stdout)
    script = (
        f"source {tmp_path / 'c.bash'}\n"
        'complete() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); _appliancectl; '
        'echo "${COMPREPLY[*]}"; }\n'
        "complete appliancectl cr\n"
        "complete appliancectl crew c\n"
        "complete appliancectl --json journal s\n"
        "complete appliancectl crew create c1 --al\n"
        "complete appliancectl completion f\n"
    )
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.stdout.splitlines() == [
        "crew cred",
        "create",
        "search",
        "--allow",
        "fish",
    ], done
    fish_script = (tmp_path / "c.fish").read_text()
    assert "complete -c appliancectl -n '__appliancectl_at crew' -a create" in fish_script


def _shell(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (scripts/install --dev installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def test_zsh_completion_through_bashcompinit(tmp_path: Path) -> None:
    """zsh runs the script through bashcompinit, which fills COMP_WORDS as a zsh array
    (1-based) and COMP_CWORD as bash counts: called here exactly so. The candidates are what
    zsh's compadd then narrows to the typed prefix."""
    zsh = _shell("zsh")
    (tmp_path / "c.zsh").write_text(ctl("completion", "zsh").stdout)
    script = (
        "autoload -U compinit && compinit -u -d " + str(tmp_path / "zcompdump") + "\n"
        f"source {tmp_path / 'c.zsh'}\n"
        'try() { local -a COMP_WORDS COMPREPLY; local COMP_CWORD; COMP_WORDS=( "$@" ); '
        'COMP_CWORD=$(( $# - 1 )); _appliancectl; print -r -- "${(j: :)COMPREPLY}"; }\n'
        "try appliancectl cr\n"
        "try appliancectl journal ''\n"
        "try appliancectl crew create c1 --al\n"
    )
    done = subprocess.run([zsh, "-f", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done
    top, journal, create = (set(line.split()) for line in done.stdout.splitlines())
    assert {"crew", "cred", "journal", "--version"} <= top and "prune" not in top, top
    assert {"tail", "prune", "backup", "restore"} <= journal and "crew" not in journal, journal
    assert {"--allow", "--mode", "--ssrf-allow"} <= create and "create" not in create, create


def test_fish_completion(tmp_path: Path) -> None:
    """fish asks the script itself (`complete -C`), as when Tab is pressed."""
    fish = _shell("fish")
    path = tmp_path / "appliancectl.fish"
    path.write_text(ctl("completion", "fish").stdout)
    assert subprocess.run([fish, "-n", str(path)], capture_output=True).returncode == 0

    def complete(line: str) -> list[str]:
        done = subprocess.run(
            [fish, "--no-config", "-c", f"source {path}; complete -C {shlex.quote(line)}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0 and not done.stderr, done
        return [candidate.split("\t", 1)[0] for candidate in done.stdout.splitlines()]

    assert complete("appliancectl cr") == ["cred", "crew"]
    assert "prune" in complete("appliancectl journal ") and "crew" not in complete(
        "appliancectl journal "
    )
    assert complete("appliancectl crew create c1 --al") == ["--allow"]
    assert complete("appliancectl completion f") == ["fish"]


def test_ctrl_c_is_exit_130_without_a_traceback(tmp_path: Path) -> None:
    # A daemon that accepts and never answers: appliancectl waits, Ctrl-C ends it.
    path = tmp_path / "admin.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    held: list[socket.socket] = []

    def accept_one() -> None:
        with contextlib.suppress(OSError):  # closed at the end of the test
            held.append(server.accept()[0])

    threading.Thread(target=accept_one, daemon=True).start()
    for args in (("crew", "ls"), ("events", "-f")):
        process = subprocess.Popen(
            [sys.executable, "-m", "appliance.cli", "--socket", str(path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            preexec_fn=sigint_as_in_a_terminal,
        )
        time.sleep(1.5)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
        assert process.returncode == exits.INTERRUPTED, (args, out, err)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        threading.Thread(target=accept_one, daemon=True).start()
    server.close()


def test_the_run_fast_path_reads_only_the_plain_form() -> None:
    from appliance.ctl.fast import parse_run

    line = parse_run(["--socket", "/s", "run", "--timeout", "2.5", "crew-a", "--", "ls", "-l"])
    assert line is not None
    assert (line.socket, line.timeout, line.name, line.argv, line.as_json) == (
        "/s",
        2.5,
        "crew-a",
        ["ls", "-l"],
        False,
    )
    line = parse_run(["run", "--json", "crew-a", "--", "echo", "--", "x"])
    assert line is not None and line.as_json and line.argv == ["echo", "--", "x"]
    line = parse_run(["run", "-i", "-t", "crew-a", "--", "sh"])
    assert line is not None and line.interactive and line.tty
    # Anything else is the full CLI's to read (and to refuse with its own messages).
    for other in (
        ["run", "crew-a"],  # no command
        ["run", "crew-a", "--"],  # an empty one
        ["--config", "/c", "run", "crew-a", "--", "true"],
        ["run", "--timeout", "soon", "crew-a", "--", "true"],
        ["run", "a", "b", "--", "true"],
        ["crew", "ls", "--", "x"],
        ["-h", "run", "a", "--", "true"],
        ["run", "--bogus", "a", "--", "true"],
    ):
        assert parse_run(other) is None, other


def test_the_fast_path_and_the_full_cli_agree() -> None:
    # Same refusal, same bytes, when the daemon is not there: both modules, and the launcher.
    for argv in (*([sys.executable, "-m", entry] for entry in ENTRIES), LAUNCHER):
        done = subprocess.run(
            [*argv, *NO_DAEMON, "run", "x", "--", "true"],
            capture_output=True,
            text=True,
            timeout=30,
            env=LAUNCHER_ENV,
            cwd=ROOT,
        )
        assert done.returncode == exits.UNREACHABLE, done
        assert done.stderr == (
            "appliancectl: error: applianced is not answering on /nonexistent/admin.sock: "
            "No such file or directory\n"
        ), done
    json_runs = [
        subprocess.run(
            [sys.executable, "-m", entry, "--json", *NO_DAEMON, "run", "x", "--", "true"],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=ROOT,
        )
        for entry in ENTRIES
    ]
    assert json_runs[0].stderr == json_runs[1].stderr and '"ok": false' in json_runs[0].stderr
    assert json_runs[0].stdout == json_runs[1].stdout == ""


def test_the_launcher_hands_other_commands_to_the_full_cli() -> None:
    # Started without site, it runs site for the full CLI (argparse, its own messages).
    done = subprocess.run(
        [*LAUNCHER, "crew", "--help"], capture_output=True, text=True, timeout=30, env=LAUNCHER_ENV
    )
    assert done.returncode == 0 and "usage: appliancectl crew" in done.stdout, done
    done = subprocess.run(
        [*LAUNCHER, *NO_DAEMON, "run", "x"],
        capture_output=True,
        text=True,
        timeout=30,
        env=LAUNCHER_ENV,
    )
    assert done.returncode == 2 and "give the command after --" in done.stderr, done


def test_the_admin_commands_import_nothing_heavy(tmp_path: Path) -> None:
    """The admin commands' start-up: msgspec (the typed client) but no trio, docker, netns,
    proxycore, native, http.client, ssl, yaml or logging in the process."""
    probe = (
        "import sys, runpy\n"
        "sys.argv = ['appliancectl', '--socket', sys.argv[1], 'status']\n"
        "try:\n"
        "    runpy.run_module('appliance.cli', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('trio', 'docker', 'netns', 'proxycore', 'native', 'http.client',"
        " 'logging', 'ssl', 'yaml')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m in heavy))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "none.sock")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.stdout.strip().splitlines()[-1] == "[]", (done.stdout, done.stderr)


_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
_OBJECTS = st.dictionaries(st.text(), _SCALARS | st.lists(st.text()))


@given(_OBJECTS)
def test_the_fast_path_writes_json_as_the_json_module_does(data: dict[str, object]) -> None:
    from appliance.ctl import tinyjson

    assert tinyjson.dumps(data) == json.dumps(data)
    assert tinyjson.dumps(data, compact=True) == json.dumps(data, separators=(",", ":"))


@given(_OBJECTS)
def test_the_fast_path_reads_json_as_the_json_module_does(data: dict[str, object]) -> None:
    from appliance.ctl import tinyjson

    for text in (json.dumps(data), json.dumps(data, ensure_ascii=False, indent=1)):
        # NaN != NaN: compare the documents' JSON text, not the values
        assert json.dumps(tinyjson.loads(text.encode())) == json.dumps(json.loads(text))


@pytest.mark.parametrize("text", ["a", "denied.test", 'say "hi"', "a OR b", "x NEAR y", "-z *"])
def test_plain_search_text_is_quoted_as_fts5_phrases(text: str, tmp_path: Path) -> None:
    import sqlite3

    from appliance.daemon.api import fts_phrases

    conn = sqlite3.connect(tmp_path / "fts.db")
    conn.execute("CREATE VIRTUAL TABLE t USING fts5(body)")
    conn.execute("INSERT INTO t VALUES (?)", (f"before {text} after",))
    conn.execute("INSERT INTO t VALUES ('nothing of it')")
    rows = conn.execute("SELECT body FROM t WHERE t MATCH ?", (fts_phrases(text),)).fetchall()
    assert rows == [(f"before {text} after",)]
