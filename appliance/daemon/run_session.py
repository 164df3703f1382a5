"""applianced's end of a `run` session: `POST /v1/crews/NAME/run`, upgraded (framing.py).

Theory of operation
-------------------
Everything that can refuse the run (no such crew, not ready, bad arguments) is checked before
the upgrade, so it is answered as any request is (an HTTP error status). Then `101 Switching
Protocols`, and two tasks share the connection:

- the output side iterates the exec's events (journaled by the recorder around them) and
  writes STDOUT/STDERR frames, then one EXIT frame (or ERROR if the exec failed);
- the input side reads the client's frames: STDIN, STDIN_EOF, SIGNAL and RESIZE go to the
  provider's exec as control messages (`ExecControl`, runtime/base.py). When the client's side
  ends (appliancectl killed, its terminal gone), the run is cancelled, which kills the command:
  a run never outlives its client.

A provider without an attached exec (the subprocess provider) runs the command without stdin
or TTY; there SIGINT, SIGTERM and SIGHUP end the command (killed, exit 128 + N).
"""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import TYPE_CHECKING, Any

import h11
import trio

from . import framing, messages
from .errors import DaemonError, InvalidRequest

if TYPE_CHECKING:
    from .main import Daemon

log = logging.getLogger("applianced.run")

_ENDING_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def attached(provider: Any) -> bool:
    """Whether the provider's exec takes stdin, a TTY and control messages."""
    return bool(getattr(provider, "attached_exec", False))


async def serve_run(
    daemon: Daemon,
    name: str,
    run: messages.RunCommand,
    stream: trio.abc.Stream,
    conn: h11.Connection,
) -> None:
    provider = daemon.provider
    options: dict[str, Any] = {}
    if attached(provider):
        size = (run.rows, run.columns) if run.rows and run.columns else None
        options = {"attach": True, "stdin": run.stdin, "tty": run.tty, "size": size}
    elif run.stdin or run.tty:
        raise InvalidRequest(
            f"argument stdin/tty: the {provider.name} provider runs commands without a TTY or "
            "standard input"
        )
    events = await daemon.crews.run(name, run.argv, run.timeout, **options)
    upgrade = h11.InformationalResponse(
        status_code=101, headers=[("Upgrade", framing.UPGRADE), ("Connection", "Upgrade")]
    )
    await stream.send_all(conn.send(upgrade))
    first, _ = conn.trailing_data
    await _Session(stream, attached(provider)).serve(events, bytes(first))


class _Session:
    def __init__(self, stream: trio.abc.Stream, attached: bool) -> None:
        self.stream = stream
        self.attached = attached
        # The client's input, queued until the exec's input side exists (ExecAttached).
        self.control_send, self.control_receive = trio.open_memory_channel[tuple[int, bytes]](256)
        self.ended_by: int | None = None  # a signal that ended a run without an input side

    async def serve(self, events: Any, first: bytes) -> None:
        async with trio.open_nursery() as nursery:
            output = trio.CancelScope()
            nursery.start_soon(self._input, first, nursery.cancel_scope, output)
            with output:
                await self._output(events, nursery)
            if self.ended_by is not None:
                exited = messages.RunExit(128 + self.ended_by)
                await self._send(framing.EXIT, messages.encoder.encode(exited))
            nursery.cancel_scope.cancel()

    async def _send(self, kind: int, payload: bytes = b"") -> None:
        await self.stream.send_all(framing.frame(kind, payload))

    async def _output(self, events: Any, nursery: trio.Nursery) -> None:
        from appliance.runtime.base import ExecAttached, ExecExited

        try:
            async with contextlib.aclosing(events) as iterator:
                async for event in iterator:
                    if isinstance(event, ExecAttached):
                        nursery.start_soon(self._apply, event.handle)
                        continue
                    if isinstance(event, ExecExited):
                        body = messages.RunExit(event.exit_code, event.timed_out)
                        await self._send(framing.EXIT, messages.encoder.encode(body))
                        return
                    kind = framing.STDOUT if event.stream == "stdout" else framing.STDERR
                    view = memoryview(event.line)
                    for start in range(0, len(view), framing.MAX_FRAME):
                        await self._send(kind, bytes(view[start : start + framing.MAX_FRAME]))
        except DaemonError as exc:
            error = messages.RunError(exc.status, exc.code, str(exc))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise
        except Exception as exc:
            log.warning("run failed after the upgrade: %s", exc)
            error = messages.RunError(500, "failed", str(exc) or type(exc).__name__)
        else:
            error = messages.RunError(500, "failed", "the command ended without an exit status")
        await self._send(framing.ERROR, messages.encoder.encode(error))

    async def _apply(self, handle: Any) -> None:
        """The client's input frames to the exec's input side, in order."""
        async for kind, payload in self.control_receive:
            if kind == framing.STDIN:
                await handle.write(payload)
            elif kind == framing.STDIN_EOF:
                await handle.close_stdin()
            elif kind == framing.SIGNAL:
                await handle.signal(framing.parse_signal(payload))
            elif kind == framing.RESIZE:
                await handle.resize(*framing.parse_resize(payload))

    async def _input(
        self, first: bytes, everything: trio.CancelScope, output: trio.CancelScope
    ) -> None:
        """The client's frames, until its side ends: then the run is cancelled (killed)."""
        reader = framing.FrameReader()
        data = first
        try:
            while True:
                for kind, payload in reader.feed(data):
                    client_kinds = (
                        framing.STDIN,
                        framing.STDIN_EOF,
                        framing.SIGNAL,
                        framing.RESIZE,
                    )
                    if kind not in client_kinds:
                        raise framing.FramingError(f"frame kind {kind} from the client")
                    if kind == framing.SIGNAL:
                        signum = framing.parse_signal(payload)
                        if not self.attached and signum in _ENDING_SIGNALS:
                            self.ended_by = signum
                            output.cancel()
                            return
                    if self.attached:
                        await self.control_send.send((kind, payload))
                data = bytes(await self.stream.receive_some(65536))
                if not data:
                    # Expected (Ctrl-C, a killed appliancectl): not an error, and the command
                    # must not outlive its client.
                    log.info("run: the admin client went away; the command is stopped")
                    break
        except (framing.FramingError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("run: the admin client went away (%s); the command is stopped", exc)
        everything.cancel()
