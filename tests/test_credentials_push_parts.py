"""The parts of a failed credential push that need no daemon: the two credential entries
round-trip through a real journal file with the summaries an auditor reads."""

from __future__ import annotations

from pathlib import Path

from appliance.journal import Journal
from appliance.journal import entries as E


def test_credential_entries_round_trip_with_their_summaries(tmp_path: Path) -> None:
    written = [
        E.CredentialChanged(
            name="claude", action="revoked", provider="anthropic", level="L3", version=2, crew="c1"
        ),
        E.CredentialChanged(name="gh", action="granted", crew="c1", agent="a1"),
        E.CredentialChanged(name="gh", action="added", provider="github"),
        E.CredentialPushFailed(
            name="claude", action="revoked", error="timeout", proxy_killed=(4242, 4243), crew="c1"
        ),
        E.CredentialPushFailed(name="claude", action="rotated", error="not running"),
    ]
    journal = Journal(tmp_path / "journal.db")
    try:
        for entry in written:
            journal.append(entry)
        rows = journal.tail(10)
        assert [E.decode(r.payload) for r in rows] == written
        assert [r.summary for r in rows] == [
            "credential claude revoked (crew c1)",
            "credential gh granted (crew c1, agent a1)",
            "credential gh added",
            "credential claude revoked not confirmed by the proxy: proxy worker(s) 4242, 4243 "
            "killed, restart from the store",
            "credential claude rotated not confirmed by the proxy: no proxy running; it starts "
            "from the store",
        ]
        assert rows[3].type == "credential.push_failed" and rows[3].crew == "c1"
        assert journal.tail(10, type="credential")[-1].type == "credential.push_failed"
    finally:
        journal.close()
