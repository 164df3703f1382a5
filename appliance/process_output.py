"""Running a command whose output an agent will see: both pipes pass through the scrubber.

The keeper's execute (docs/architecture.md) runs a command with a credential in its environment
and returns its output to the agent; the command can print the credential (`env`, `set -x`, an
error message). Each pipe gets its own scrubber stream, so a secret split across two writes is
still caught, and output is capped so a chatty command cannot fill memory. A command that
outlives its deadline is killed; what it printed until then is returned, scrubbed.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import trio

from native.scrub import Scrubber, ScrubStream

READ_SIZE = 65536


@dataclass(frozen=True, slots=True)
class ScrubbedResult:
    returncode: int | None  # None: killed at the deadline
    stdout: bytes
    stderr: bytes
    truncated: bool  # more than max_output bytes came out of a pipe; the rest was discarded


class _Capture:
    def __init__(self, stream: ScrubStream, limit: int) -> None:
        self.stream = stream
        self.limit = limit
        self.data = bytearray()
        self.truncated = False

    def add(self, scrubbed: bytes) -> None:
        room = self.limit - len(self.data)
        if len(scrubbed) > room:
            self.truncated = True
            scrubbed = scrubbed[: max(room, 0)]
        self.data += scrubbed


async def run_scrubbed(
    command: Sequence[str],
    scrubber: Scrubber,
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    timeout: float = math.inf,
    max_output: int = 1 << 20,
) -> ScrubbedResult:
    """Run `command`; its stdout and stderr, scrubbed, each capped at `max_output` bytes."""
    process = await trio.lowlevel.open_process(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else None,
        cwd=cwd,
    )
    captures = (
        _Capture(scrubber.stream(), max_output),
        _Capture(scrubber.stream(), max_output),
    )

    async def pump(pipe: trio.abc.ReceiveStream, capture: _Capture) -> None:
        # Read to the end even past the cap, so the command never blocks on a full pipe.
        while data := await pipe.receive_some(READ_SIZE):
            if not capture.truncated:
                # (what the stream holds back is bounded: Patterns.hold_bound_bytes)
                capture.add(capture.stream.feed(bytes(data)))

    killed = False
    try:
        with trio.move_on_after(timeout) as scope:
            async with trio.open_nursery() as nursery:
                assert process.stdout is not None and process.stderr is not None
                nursery.start_soon(pump, process.stdout, captures[0])
                nursery.start_soon(pump, process.stderr, captures[1])
            await process.wait()
        if scope.cancelled_caught:
            killed = True
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
    for capture in captures:
        if not capture.truncated:
            capture.add(capture.stream.flush())
    return ScrubbedResult(
        returncode=None if killed else process.returncode,
        stdout=bytes(captures[0].data),
        stderr=bytes(captures[1].data),
        truncated=any(c.truncated for c in captures),
    )
