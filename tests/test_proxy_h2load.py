"""h2load (nghttp2's load generator) as the agent: many h2c streams over a few connections
through a real worker, bounded in count. What it shows that a single client cannot: every one
of hundreds of multiplexed streams gets its own exchange (injection on every provider request,
one terminal event each), a refused authority is refused stream by stream while the
connection lives on, and the worker is still serving afterwards."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance.demo_upstream import FakeServer
from proxycore.protocol.events import RequestAllowed, RequestDenied
from tests.conftest import REAL_KEYS, RunningProxy

pytestmark = pytest.mark.skipif(
    shutil.which("h2load") is None, reason="h2load (Debian nghttp2-client) is not installed"
)

_COUNTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored, (\d+) timeout"
)
_STATUS = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")


def h2load(proxy: RunningProxy, path: str, *args: str) -> dict[str, int]:
    """Run h2load against the proxy (h2c, prior knowledge); its request and status counts."""
    done = subprocess.run(
        ["h2load", *args, f"http://{proxy.host}:{proxy.port}{path}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    counts, status = _COUNTS.search(done.stdout), _STATUS.search(done.stdout)
    assert counts and status, (done.stdout, done.stderr)
    names = ("total", "started", "done", "succeeded", "failed", "errored", "timeout")
    result = dict(zip(names, map(int, counts.groups()), strict=True))
    result.update(zip(("2xx", "3xx", "4xx", "5xx"), map(int, status.groups()), strict=True))
    return result


def test_many_multiplexed_provider_streams_each_injected_and_journaled(
    proxy: RunningProxy, provider: FakeServer
) -> None:
    """300 streams, 4 connections, 10 in flight on each, to the reverse provider route: each
    reaches the provider with the real key (the agent sent a fake one) and ends in its own
    terminal event."""
    result = h2load(
        proxy,
        "/anthropic/v1/models",
        "-n",
        "300",
        "-c",
        "4",
        "-m",
        "10",
        "-H",
        "x-api-key: agent-fake-key",
    )
    assert result["succeeded"] == 300 and result["2xx"] == 300, result
    seen = [r for r in provider.received if r.path == "/v1/models"]
    assert len(seen) == 300
    assert all(r.all("x-api-key") == [REAL_KEYS["anthropic"]] for r in seen)
    allowed = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
    assert len(allowed) == 300
    assert all(e.route == "reverse" and e.status == 200 for e in allowed)


def test_denied_authority_is_refused_per_stream_and_the_worker_serves_on(
    proxy: RunningProxy, plain_host: FakeServer
) -> None:
    """Forward requests (`:authority` names the target): 100 streams to a host off the
    allowlist are each a 403 with a journal entry, never reaching the host; then 100 streams
    to the allowed host all succeed on the same worker."""
    denied = h2load(
        proxy,
        "/x",
        "-n",
        "100",
        "-c",
        "2",
        "-m",
        "10",
        "-H",
        f":authority: denied.test:{plain_host.port}",
    )
    # h2load counts any answered stream as succeeded: the refusals are the 4xx.
    assert denied["done"] == 100 and denied["4xx"] == 100, denied
    assert not plain_host.received
    refusals = [e for e in proxy.events() if isinstance(e, RequestDenied)]
    assert len(refusals) == 100 and all(e.host == "denied.test" for e in refusals)

    allowed = h2load(
        proxy,
        "/hello",
        "-n",
        "100",
        "-c",
        "2",
        "-m",
        "10",
        "-H",
        f":authority: plain.test:{plain_host.port}",
    )
    assert allowed["succeeded"] == 100 and allowed["2xx"] == 100, allowed
    assert len(plain_host.received) == 100
    served = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
    assert len(served) == 100 and all(e.host == "plain.test" for e in served)


def test_request_bodies_over_many_streams(
    proxy: RunningProxy, provider: FakeServer, tmp_path: Path
) -> None:
    """POST bodies larger than one DATA frame on 60 concurrent streams: every body arrives
    whole upstream (flow control per stream and per connection)."""
    body = tmp_path / "body.bin"
    body.write_bytes(b"z" * 40_000)
    result = h2load(proxy, "/anthropic/upload", "-n", "60", "-c", "2", "-m", "30", "-d", str(body))
    assert result["succeeded"] == 60 and result["2xx"] == 60, result
    seen = [r for r in provider.received if r.path == "/upload"]
    assert len(seen) == 60 and all(r.body == b"z" * 40_000 for r in seen)
    allowed = [e for e in proxy.events() if isinstance(e, RequestAllowed)]
    assert len(allowed) == 60 and all(e.bytes_up == 40_000 for e in allowed)
