"""Command output through the scrubber: real processes, secrets split across writes and pipes."""

from __future__ import annotations

import sys

from appliance.process_output import run_scrubbed
from native.scrub import Scrubber

SECRET = "glpat-Secret0Value1For2Process3Output"
SCRUBBER = Scrubber([("gitlab", SECRET)])


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


async def test_secret_split_across_writes_on_both_pipes() -> None:
    code = (
        "import os, sys, time\n"
        "s = os.environ['TOKEN']\n"
        "for out in (sys.stdout, sys.stderr):\n"
        "    out.write('token: ' + s[:9]); out.flush(); time.sleep(0.05)\n"
        "    out.write(s[9:] + ' ok\\n'); out.flush()\n"
        "print(s.encode().hex())\n"
    )
    result = await run_scrubbed(python(code), SCRUBBER, env={"TOKEN": SECRET}, timeout=20)
    assert result.returncode == 0
    assert result.stdout == b"token: [REDACTED:gitlab] ok\n[REDACTED:gitlab]\n"
    assert result.stderr == b"token: [REDACTED:gitlab] ok\n"
    assert not result.truncated


async def test_output_cap_and_deadline() -> None:
    code = "import sys, time\nsys.stdout.write('x' * 300000); sys.stdout.flush(); time.sleep(30)"
    result = await run_scrubbed(python(code), SCRUBBER, timeout=2, max_output=1000)
    assert result.returncode is None  # killed at the deadline
    assert result.stdout == b"x" * 1000 and result.truncated


async def test_exit_status_is_kept() -> None:
    result = await run_scrubbed(["sh", "-c", "echo $0 >&2; exit 3", SECRET], SCRUBBER, timeout=20)
    assert result.returncode == 3
    assert result.stderr == b"[REDACTED:gitlab]\n"
