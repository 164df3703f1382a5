"""appliancectl as a shell user meets it, without a daemon."""

from __future__ import annotations

import subprocess
import sys


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


def test_the_fast_path_and_the_full_cli_agree() -> None:
    from appliance import cli, ctl

    assert ctl.DEFAULT_CONFIG == cli.DEFAULT_CONFIG
    assert (ctl.EXIT_FAILURE, ctl.EXIT_USAGE, ctl.EXIT_UNREACHABLE, ctl.EXIT_TIMED_OUT) == (
        cli.EXIT_FAILURE,
        cli.EXIT_USAGE,
        cli.EXIT_UNREACHABLE,
        cli.EXIT_TIMED_OUT,
    )
    # Same refusal, same bytes, when the daemon is not there.
    for entry in ("appliance.ctl", "appliance.cli"):
        done = subprocess.run(
            [sys.executable, "-m", entry, *NO_DAEMON, "run", "x", "--", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 5, done
        assert done.stderr.startswith("appliancectl: error: applianced is not answering"), done
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
