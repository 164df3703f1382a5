"""What `status` judges: each part of the appliance up or down, with a reason.

`appliancectl status` exits 9 (degraded) when a part is down, 5 when applianced itself does not
answer (docs/cli.md, "Exit codes"); the parts:

- proxy: every worker has a process (none waiting out a restart backoff) and the pool answers a
  ping; a worker that crashed shows here until its successor runs (`status` also says why it
  exited and how often).
- engine: the runtime provider answers (Docker: the engine's info, within ENGINE_TIMEOUT); the
  subprocess provider has no engine and is reported as such (no isolation, but not down).
- journal: the writer keeps up (no backpressure: the proxy refuses crews' traffic while it is
  behind, so "behind" is an outage of its own).
"""

from __future__ import annotations

from typing import Any

import trio

from . import messages

ENGINE_TIMEOUT = 3.0


def proxy_health(status: messages.Status) -> messages.PartHealth:
    down = [w for w in status.proxy_workers if w.pid is None or w.restart_at is not None]
    total = len(status.proxy_workers)
    if down:
        which = ", ".join(
            f"worker {w.index} " + (f"({w.last_exit})" if w.last_exit else "(starting)")
            for w in down
        )
        return messages.PartHealth("proxy", False, f"{len(down)} of {total} down: {which}")
    if not status.proxy_alive:
        return messages.PartHealth("proxy", False, "the workers do not answer")
    return messages.PartHealth("proxy", True, f"{total} worker(s) up")


async def engine_health(provider: Any) -> messages.PartHealth:
    if provider.name == "subprocess":
        return messages.PartHealth("engine", True, "none (subprocess provider, no isolation)")
    runtimes: tuple[str, ...] | None = None
    error = f"no answer within {ENGINE_TIMEOUT:g} s"
    with trio.move_on_after(ENGINE_TIMEOUT):
        try:
            runtimes = tuple(
                await trio.to_thread.run_sync(provider.runtimes, abandon_on_cancel=True)
            )
        except Exception as exc:
            error = str(exc) or type(exc).__name__
    if runtimes is None:
        return messages.PartHealth("engine", False, error)
    return messages.PartHealth("engine", True, f"answering (runtimes: {', '.join(runtimes)})")


def journal_health(recorder: Any, journal: Any) -> messages.PartHealth:
    pending = getattr(journal, "pending", 0)
    if getattr(recorder, "backpressure", False):
        return messages.PartHealth(
            "journal", False, f"behind: {pending} entries queued; crews' traffic is refused"
        )
    return messages.PartHealth("journal", True, f"writing ({pending} queued)")


async def judge(
    status: messages.Status, provider: Any, recorder: Any, journal: Any
) -> tuple[messages.PartHealth, ...]:
    return (
        proxy_health(status),
        await engine_health(provider),
        journal_health(recorder, journal),
    )
