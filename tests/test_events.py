"""The JSON-lines sink: batched off the request path, bounded, typed round trip."""

from __future__ import annotations

import trio

from proxycore.io.sinks import JsonLinesSink
from proxycore.protocol.events import (
    CredentialInjected,
    EventsDropped,
    RequestAllowed,
    decode_events,
)


async def test_batches_are_written_and_read_back(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonLinesSink(str(path), flush_interval=0.05, max_batch=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        for i in range(25):
            sink.emit(
                RequestAllowed(
                    crew="c",
                    mode="free",
                    route="forward",
                    method="GET",
                    host=f"h{i}.test",
                    port=80,
                    address="192.0.2.1",
                    rule="policy",
                )
            )
        sink.emit(CredentialInjected(crew="c", provider="anthropic", host="api.anthropic.com"))
        await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    events = decode_events(path.read_bytes())
    assert [e.host for e in events if isinstance(e, RequestAllowed)] == [
        f"h{i}.test" for i in range(25)
    ]
    assert isinstance(events[-1], CredentialInjected)


async def test_backlog_is_bounded_and_drops_are_counted(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonLinesSink(str(path), flush_interval=10, max_batch=10_000, max_pending=5)
    for i in range(12):
        sink.emit(CredentialInjected(crew="c", provider="openai", host=f"h{i}"))
    async with trio.open_nursery() as nursery:
        await nursery.start(sink.run)
        nursery.cancel_scope.cancel()  # shutdown flushes what is queued
    events = decode_events(path.read_bytes())
    assert len([e for e in events if isinstance(e, CredentialInjected)]) == 5
    dropped = [e for e in events if isinstance(e, EventsDropped)]
    assert dropped and dropped[0].count == 7
