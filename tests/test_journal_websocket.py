"""A WebSocket session's counts in applianced's journal: from a real proxy's terminal event to
the `proxy.allow` row, its summary (what `appliancectl events` and `journal search` print) and
its payload (`--json`); and journals written before the counts existed still read and verify."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
from wsproto.events import BytesMessage, TextMessage

from appliance.ctl import events as ctl_events
from appliance.ctl import output
from appliance.daemon import messages
from appliance.journal import Journal
from appliance.journal import entries as E
from appliance.journal.recorder import entries_for_batch
from proxycore.protocol import events as pe
from tests.conftest import RunningProxy
from tests.h2_ws_client import H2WsClient
from tests.test_proxy_websocket_h2 import authority, closed_cleanly, upstream


def as_entry(row: object) -> messages.JournalEntry:
    return messages.JournalEntry(*msgspec.structs.astuple(row))  # type: ignore[arg-type]


def test_a_sessions_counts_reach_the_row_the_cli_and_search(make_proxy, tmp_path: Path) -> None:
    proxy: RunningProxy = make_proxy(allow=["plain.test"])
    with upstream() as port, H2WsClient(proxy) as client:
        ws = client.websocket(1, "/", authority(port))
        assert ws.accepted() == 200
        ws.send(TextMessage("hello"))
        assert ws.message() == "hello"
        ws.send(BytesMessage(b"\x00" * 300))
        assert ws.message() == b"\x00" * 300
        closed_cleanly(ws)

    deadline = time.monotonic() + 10
    while True:
        events = proxy.events()
        if any(isinstance(e, pe.RequestAllowed) and e.status == 101 for e in events):
            break
        assert time.monotonic() < deadline, events
    journal = Journal(tmp_path / "journal.db")
    try:
        for entry in entries_for_batch(list(events)):
            journal.append(entry)
        [row] = journal.tail(10, type="proxy.allow")
        entry = E.decode(row.payload)
        assert isinstance(entry, E.ProxyAllow)
        [request] = entry.requests
        assert request.status == 101 and (request.bytes_up, request.bytes_down) == (305, 305)
        assert request.websocket == E.WebSocketCounts(
            frames_up=3, frames_down=3, messages_up=2, messages_down=2, closed_by="agent",
            close_code=1000,
        )  # fmt: skip
        # The text line of `appliancectl events` / `journal tail` / `journal search`.
        line = ctl_events.line(as_entry(row))
        assert (
            "-> 101, websocket 305 B up / 305 B down, messages 2 up / 2 down, frames 3 up / "
            "3 down, closed by agent (1000)"
        ) in line
        # --json: the row with its payload, the counts by name.
        payload = json.loads(output.builtins(as_entry(row))["payload"])
        assert payload["requests"][0][-1] == {
            "frames_up": 3, "frames_down": 3, "messages_up": 2, "messages_down": 2,
            "closed_by": "agent", "close_code": 1000,
        }  # fmt: skip
        assert [r.seq for r in journal.search("websocket")] == [row.seq]
        assert journal.verify().ok
    finally:
        journal.close()


class _OldAllowedRequest(msgspec.Struct, frozen=True, array_like=True):
    """AllowedRequest as it was before the WebSocket counts were appended."""

    ts: float
    route: str
    method: str
    host: str
    port: int
    address: str
    rule: str
    status: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    duration: float = 0.0
    ended: str = "complete"


class _OldProxyAllow(E.Entry, frozen=True, tag="proxy.allow"):
    mode: str
    requests: tuple[_OldAllowedRequest, ...]

    def summary(self) -> str:
        return "allow GET old.test:80 (forward, rule allowlist) -> 101"


def test_rows_written_before_the_counts_still_read_and_verify(tmp_path: Path) -> None:
    """The journal's migration path for a payload field: appended with a default, so rows
    written before it decode (websocket None) and the chain, hashed over the stored text,
    verifies across old and new rows alike."""
    path = tmp_path / "journal.db"
    journal = Journal(path)
    request = _OldAllowedRequest(
        1.0, "forward", "GET", "old.test", 80, "127.0.0.1", "allowlist", 101, 10, 20, 0.5,
    )  # fmt: skip
    old = _OldProxyAllow(mode="restricted", requests=(request,), crew="c1")
    journal.append(old)
    journal.close()

    journal = Journal(path)  # reopened by the new code
    try:
        [row] = journal.tail(10)
        assert '0.5,"complete"]]' in row.payload  # the old shape, as it was written
        entry = E.decode(row.payload)
        assert isinstance(entry, E.ProxyAllow)
        assert entry.requests[0].websocket is None and entry.requests[0].bytes_down == 20
        new = entries_for_batch(
            [
                pe.RequestAllowed(
                    ts=2.0, crew="c1", mode="restricted", route="forward", method="GET",
                    host="new.test", port=80, address="127.0.0.1", rule="allowlist",
                    status=101, bytes_up=5, bytes_down=7, ended="idle_timeout",
                    websocket=pe.WebSocketSession(
                        frames_up=1, frames_down=2, messages_up=1, messages_down=1,
                        closed_by="proxy", close_code=1001,
                    ),
                ),
                pe.RequestAllowed(
                    ts=3.0, crew="c2", mode="restricted", route="forward", method="GET",
                    host="plain.test", port=80, address="127.0.0.1", rule="allowlist",
                    status=200, bytes_down=9,
                ),
            ]
        )  # fmt: skip
        for item in new:
            journal.append(item)
        rows = journal.tail(10)
        assert rows[1].summary == (
            "allow GET new.test:80 (forward, rule allowlist) -> 101, websocket 5 B up / 7 B "
            "down, messages 1 up / 1 down, frames 1 up / 2 down, closed by proxy (1001), "
            "ended: idle_timeout"
        )
        # An ordinary request: its summary as before, a null where the counts would be.
        assert rows[2].summary == "allow GET plain.test:80 (forward, rule allowlist) -> 200"
        assert '"complete",null]]' in rows[2].payload
        assert journal.verify().ok
    finally:
        journal.close()
