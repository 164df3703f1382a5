"""Replays the exchange fuzz harness' seeds as ordinary tests, and shows its checks can fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))

import fuzz_exchange as harness


@pytest.mark.parametrize("seed", harness.SEEDS, ids=range(len(harness.SEEDS)))
def test_exchange_seed(seed: bytes) -> None:
    harness.TestOneInput(seed)


def test_harness_detects_a_malformed_refusal() -> None:
    with pytest.raises(AssertionError):
        harness._check_response_bytes(b"HTTP/1.1 200 OK\r\nbad line\r\n\r\n", "a head")


def test_harness_detects_a_credential_towards_a_plain_host(monkeypatch) -> None:
    """A forward plan that leaked the key to a non-provider host fails the forward check."""
    from proxycore.protocol import http1
    from proxycore.protocol.exchange import plan_request
    from proxycore.protocol.plans import Forward
    from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode

    head = http1.parse_request_head(b"GET http://allowed.test/ HTTP/1.1\r\nHost: a\r\n\r\n")
    assert head is not None
    crew = CrewPolicy("fuzz", NetworkMode.FREE, Allowlist([]))
    plan = plan_request(head[0], crew, harness._routes(False), audit_blocked=False, max_body=99)
    assert isinstance(plan, Forward)
    leaked = plan.__class__(
        request=plan.request,
        host=plan.host,
        port=plan.port,
        tls=plan.tls,
        head=plan.head + b"\r\nx-api-key: " + harness.KEY.encode(),
        provider=None,
        keep_alive=plan.keep_alive,
        expect_continue=plan.expect_continue,
        empty_body_length=plan.empty_body_length,
    )
    with pytest.raises(AssertionError):
        harness._check_forward(leaked, head[0])
