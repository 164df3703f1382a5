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
