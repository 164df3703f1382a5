"""appliancectl as a shell user meets it, without a daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st


def test_a_reader_that_goes_away_is_not_a_traceback() -> None:
    # `appliancectl ... | head`: the pipe closes early; the command ends quietly with 141
    # (128 + SIGPIPE, what a shell reports), not with a BrokenPipeError traceback.
    script = (
        f"head -c 5000000 /dev/zero | tr '\\0' a | {sys.executable} -m appliance.cli scrub "
        "| head -c 10 >/dev/null; echo ${PIPESTATUS[2]}"
    )
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "141", done
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_the_run_fast_path_reads_only_the_plain_form() -> None:
    from appliance.ctl import parse_run

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


NO_DAEMON = ("--socket", "/nonexistent/admin.sock")
ENTRIES = ("appliance.ctl", "appliance.cli")
LAUNCHER = [str(Path(__file__).resolve().parent.parent / "bin" / "appliancectl")]
# As in a venv's bin/: the launcher starts the python3 next to it, else the one on PATH.
LAUNCHER_ENV = {
    **os.environ,
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
}


def test_the_fast_path_and_the_full_cli_agree() -> None:
    from appliance.daemon.client import DEFAULT_ADMIN_SOCKET

    from appliance import cli, ctl

    assert ctl.DEFAULT_CONFIG == cli.DEFAULT_CONFIG
    assert ctl.DEFAULT_ADMIN_SOCKET == DEFAULT_ADMIN_SOCKET
    assert (
        ctl.EXIT_FAILURE,
        ctl.EXIT_USAGE,
        ctl.EXIT_NOT_FOUND,
        ctl.EXIT_CONFLICT,
        ctl.EXIT_UNREACHABLE,
        ctl.EXIT_TIMED_OUT,
    ) == (
        cli.EXIT_FAILURE,
        cli.EXIT_USAGE,
        cli.EXIT_NOT_FOUND,
        cli.EXIT_CONFLICT,
        cli.EXIT_UNREACHABLE,
        cli.EXIT_TIMED_OUT,
    )
    for status in (400, 403, 404, 409, 413, 500, 503):
        assert ctl._exit_for_status(status) == cli._exit_for_status(status)
    # Same refusal, same bytes, when the daemon is not there: both modules, and the launcher.
    for argv in (*([sys.executable, "-m", entry] for entry in ENTRIES), LAUNCHER):
        done = subprocess.run(
            [*argv, *NO_DAEMON, "run", "x", "--", "true"],
            capture_output=True,
            text=True,
            timeout=30,
            env=LAUNCHER_ENV,
        )
        assert done.returncode == 5, done
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
        ).stdout
        for entry in ("appliance.ctl", "appliance.cli")
    ]
    assert json_runs[0] == json_runs[1] and '"ok": false' in json_runs[0]


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


_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
_OBJECTS = st.dictionaries(st.text(), _SCALARS | st.lists(st.text()))


@given(_OBJECTS)
def test_the_fast_path_writes_json_as_the_json_module_does(data: dict[str, object]) -> None:
    from appliance import ctl

    assert ctl.dumps(data) == json.dumps(data)


@given(_OBJECTS)
def test_the_fast_path_reads_json_as_the_json_module_does(data: dict[str, object]) -> None:
    from appliance import ctl

    for text in (json.dumps(data), json.dumps(data, ensure_ascii=False, indent=1)):
        # NaN != NaN: compare the documents' JSON text, not the values
        assert json.dumps(ctl.loads(text.encode())) == json.dumps(json.loads(text))
