"""The errors of `appliance.runtime`: one base class, never raised directly, one class per failure.

The docker SDK's exceptions (`docker.errors.*`, `requests` errors under them) are converted at
the boundary that calls the SDK (`engine.py`, `docker.py`), so a caller only ever sees these.
Every message says what was asked, what was found, and what the operator can do about it.
"""

from __future__ import annotations

from collections.abc import Sequence


class RuntimeProviderError(Exception):
    """Base of every error this package raises; never raised directly."""


class EngineUnavailable(RuntimeProviderError):
    """No container engine answered. Lists every address tried and why each failed."""

    def __init__(
        self, attempts: Sequence[tuple[str, str]], *, no_fallback_reason: str = ""
    ) -> None:
        # (address, why) pairs, in the order they were tried.
        self.attempts = tuple(attempts)
        lines = [f"  {address}: {why}" for address, why in self.attempts] or ["  (nothing)"]
        head = "no container engine answered"
        if no_fallback_reason:
            head += f" ({no_fallback_reason})"
        super().__init__(head + "; tried:\n" + "\n".join(lines))


class EngineCallError(RuntimeProviderError):
    """A call to the engine that is not tied to one crew failed (listing, info)."""

    def __init__(self, what: str, cause: BaseException) -> None:
        self.what = what
        self.cause = cause
        super().__init__(f"container engine: {what}: {cause}")


class RuntimeUnavailable(RuntimeProviderError):
    """The runtime a crew asks for is not in the engine, or is there but known not to work.

    Never answered by falling back to another runtime: a crew configured for gVisor must not
    silently run on runc.
    """

    def __init__(self, runtime: str, available: Sequence[str], why: str = "") -> None:
        self.runtime = runtime
        self.available = tuple(available)
        detail = f": {why}" if why else ""
        super().__init__(
            f"runtime {runtime!r} is not available{detail}; "
            f"available: {', '.join(self.available) or '(none)'}"
        )


class ImageMissing(RuntimeProviderError):
    """The image is not in the engine. Images are built locally (images/); never pulled."""

    def __init__(self, image: str, role: str) -> None:
        self.image = image
        self.role = role
        super().__init__(
            f"{role} image {image!r} is not in the engine (images are built locally, see images/;"
            " the appliance never pulls)"
        )


class InvalidSpec(RuntimeProviderError):
    """A crew spec value is out of range; the message names the field."""

    def __init__(self, field: str, why: str) -> None:
        self.field = field
        super().__init__(f"crew spec `{field}`: {why}")


def check_exec_arguments(argv: list[str], timeout: float | None) -> None:
    """What every provider's `exec` refuses before running anything."""
    if not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
        raise InvalidSpec("argv", "must be a non-empty list of strings without NUL")
    if timeout is not None and not timeout > 0:
        raise InvalidSpec("timeout", "must be a positive number of seconds")


class UnsafeMount(RuntimeProviderError):
    """A mount was refused before anything was created.

    A container engine's socket (or a directory holding one) is refused outright, whatever the
    configuration says: it is root on the host for whoever can write to it.
    """

    def __init__(self, source: str, target: str, why: str) -> None:
        self.source = source
        self.target = target
        super().__init__(f"mount {source!r} -> {target!r} refused: {why}")


class CrewContainerError(RuntimeProviderError):
    """Creating, starting, running in or removing a crew's container failed at a named step.

    `rolled_back` says whether what this call created was removed again; `rollback_errors`
    lists what could not be removed (reconciliation finds it by its labels).
    """

    def __init__(
        self,
        crew: str,
        step: str,
        cause: BaseException | str,
        *,
        rolled_back: bool = True,
        rollback_errors: Sequence[str] = (),
    ) -> None:
        self.crew = crew
        self.step = step
        self.cause = cause
        self.rolled_back = rolled_back
        self.rollback_errors = tuple(rollback_errors)
        message = f"crew {crew!r}: {step}: {cause}"
        if self.rollback_errors:
            message += "; rollback incomplete: " + "; ".join(self.rollback_errors)
        elif not rolled_back:
            message += " (nothing to roll back)"
        super().__init__(message)
