"""An upstream HTTP/2 connection's failure is its own: a bug while it ends never leaves its task.

The pool runs each connection's task in one nursery with the worker's other work, so an
exception that escaped a connection's `run` would end every crew's upstream connections and the
worker. Here a real socket pair stands for the upstream, the connection is adopted by a running
pool, and the code that ends its streams is made to fail as a bug would.
"""

from __future__ import annotations

import socket

import pytest
import trio

from proxycore.io import upstream_h2
from proxycore.io.fastio import PlainStream
from proxycore.io.upstream import CrewUpstreams, UpstreamConnection
from proxycore.io.upstream_h2 import H2Pool, H2Upstream
from proxycore.protocol import http1
from proxycore.protocol.http2 import H2Limits


def _pool() -> H2Pool:
    return H2Pool(H2Limits(), http1.Limits(), write_timeout=5.0, idle_timeout=30.0)


@pytest.mark.trio
async def test_a_failure_while_ending_stays_in_the_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken_break(self: H2Upstream, why: str) -> None:
        raise RuntimeError("a bug while ending the streams")

    monkeypatch.setattr(upstream_h2.H2Upstream, "_break", broken_break)
    ours, theirs = socket.socketpair()
    pool = _pool()
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        link = UpstreamConnection(
            ("crew", False, "upstream.test", 80), "127.0.0.1", PlainStream(ours), CrewUpstreams()
        )
        pool.adopt(link)
        await trio.sleep(0.05)
        theirs.close()  # the upstream goes away: the connection ends, and its _break fails
        with trio.fail_after(5):
            while not link.closed:
                await trio.sleep(0.01)
        # The pool (and so the worker's nursery) is still running: the failure stayed inside.
        assert pool.running
        nursery.cancel_scope.cancel()
    assert link.closed
