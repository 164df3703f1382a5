"""The errors of `appliance.daemon`: one base, never raised directly; each carries the HTTP status
and the stable error code the admin API answers with (in the manner of h11's
`error_status_hint`), so the API layer maps an error without a table of its own."""

from __future__ import annotations


class DaemonError(Exception):
    """Base of every error this package raises; never raised directly."""

    status = 500
    code = "internal"


class InvalidRequest(DaemonError):
    """A request value is invalid; the message names the argument."""

    status = 400
    code = "invalid"


class CrewNotFound(DaemonError):
    status = 404
    code = "not_found"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no crew named {name!r}")


class CrewExists(DaemonError):
    status = 409
    code = "exists"

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"a crew named {name!r} already exists")


class CrewBusy(DaemonError):
    """The crew is not in a phase that allows the operation (e.g. run on a crew being created)."""

    status = 409
    code = "conflict"


class Unavailable(DaemonError):
    """A runtime, the engine or the proxy is not available."""

    status = 503
    code = "unavailable"


class StepFailed(DaemonError):
    """A step of creating or removing a crew failed; what was done has been rolled back."""

    status = 500
    code = "failed"

    def __init__(self, crew: str, step: str, cause: BaseException, undo_errors: tuple[str, ...]):
        self.crew = crew
        self.step = step
        self.cause = cause
        self.undo_errors = undo_errors
        message = f"crew {crew!r}: step {step!r} failed: {cause}"
        if undo_errors:
            message += "; rollback incomplete (the next start removes the rest): " + "; ".join(
                undo_errors
            )
        else:
            message += "; rolled back"
        super().__init__(message)


class ConfigInvalid(DaemonError):
    """The daemon's configuration file is invalid; the message names the key."""

    status = 500
    code = "config"
