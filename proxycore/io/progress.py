"""What one request's exchange carries between the connection and its executors.

`Phase` names what a connection waits for (and so what an expired deadline means), `Progress`
holds a request until its one terminal event, `Refused` unwinds an executor to the connection
with a prepared refusal (proxycore/protocol/exchange.py builds them).
"""

from __future__ import annotations

import dataclasses
import enum

from proxycore.errors import UpstreamError
from proxycore.protocol.plans import Refuse, Request

RECV_SIZE = 65536


class Phase(enum.Enum):
    """What a connection is waiting for; decides what a deadline expiring means."""

    IDLE = "idle"  # between requests: a timeout closes silently
    HEAD = "head"  # inside a request head: 408
    BODY = "body"  # reading the agent's request body: 408
    UPSTREAM = "upstream"  # waiting for the upstream (its answer, or room to send): 504
    QUEUED = "queued"  # waiting for the crew's turn (fairness.py): bounded by fair_max_wait
    RELAY = "relay"  # relaying a response: the connection can only be closed


@dataclasses.dataclass(slots=True)
class Progress:
    """The request in progress, until its one terminal event is emitted."""

    request: Request
    started: float
    rule: str = "policy"
    address: str = ""
    status: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    # Secrets the scrubber redacted from the answer's body (proxycore/protocol/scrubbing.py).
    redactions: int = 0
    # The request's body has been read (or it had none): a refusal need not drain it.
    body_consumed: bool = False


class Refused(Exception):
    """Internal: a prepared refusal to answer (never escapes this package)."""

    def __init__(self, plan: Refuse) -> None:
        super().__init__(plan.status)
        self.plan = plan


def upstream_refusal(request: Request, exc: UpstreamError, *, close: bool) -> Refuse:
    """A failed dial: 502 (unreachable), 503 (the crew's share or the descriptors used up), 504
    (timed out)."""
    if exc.status_hint == 503:
        return request.refused(503, "overloaded", str(exc), rule="overloaded", close=close)
    return request.refused(
        exc.status_hint, "upstream_failed", str(exc), rule="upstream_unreachable", close=close
    )
