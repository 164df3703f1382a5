"""The errors of `netns`: one base class, never raised directly, and one class per kind of failure.

Library exceptions (pyroute2's `NetlinkError`, `OSError` from /proc/sys, libnftables' error
buffer) are converted at the boundary that calls the library (`kernel.py`, `nft.py`), so a caller
only ever sees these. A failure while setting up or tearing down a crew is a `CrewNetworkError`
that names the crew and the step, says whether the partial work was rolled back, and keeps the
underlying error as `cause`.
"""

from __future__ import annotations


class NetnsError(Exception):
    """Base of every error this package raises; never raised directly."""


class NetConfigError(NetnsError):
    """The network configuration is invalid; the message names the key."""


class PoolConflictError(NetnsError):
    """The address pool overlaps an address or a route of the host."""

    def __init__(self, pool: str, conflicts: tuple[str, ...]) -> None:
        self.pool = pool
        self.conflicts = conflicts
        super().__init__(
            f"address pool {pool} collides with the host: "
            + "; ".join(conflicts)
            + " (choose another pool in the network configuration)"
        )


class InstanceConflictError(NetnsError):
    """Another appliance on the host holds names this one would use (its table, or interfaces
    that its rules match): nothing was changed."""


class PoolExhaustedError(NetnsError):
    """Every subnet of the pool is allocated or in use on the host."""


class StateError(NetnsError):
    """The state file cannot be read, written or locked, or belongs to another pool."""


class KernelError(NetnsError):
    """A netlink request or a sysctl write failed."""

    def __init__(self, what: str, errno: int | None, detail: str) -> None:
        self.what = what
        self.errno = errno
        super().__init__(f"{what}: {detail}")


class NftError(NetnsError):
    """An nftables transaction was refused; the kernel kept the previous ruleset whole."""

    def __init__(self, message: str) -> None:
        self.message = message.strip()
        super().__init__(f"nftables transaction refused: {self.message}")


class CrewNetworkError(NetnsError):
    """Setting up or tearing down one crew's network failed at a named step."""

    def __init__(
        self,
        crew: str,
        step: str,
        cause: BaseException,
        *,
        rolled_back: bool = True,
        rollback_errors: tuple[str, ...] = (),
    ) -> None:
        self.crew = crew
        self.step = step
        self.cause = cause
        self.rolled_back = rolled_back
        self.rollback_errors = rollback_errors
        outcome = "rolled back" if rolled_back and not rollback_errors else "not rolled back"
        message = f"crew {crew!r}: step {step!r} failed: {cause} ({outcome}"
        if rollback_errors:
            message += "; rollback left: " + "; ".join(rollback_errors)
            message += "; the next reconcile removes what is left"
        super().__init__(message + ")")
