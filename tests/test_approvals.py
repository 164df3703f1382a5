"""Run-time approvals without I/O: applianced's book of pending requests, grants and denials
(appliance/daemon/approvals.py), the worker's side (a grant read against the clock at each
decision, `crew_approvals` applied all or nothing) and what the agent's refusal says. The real
daemon's side is tests/test_approvals_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from appliance.daemon import messages
from appliance.daemon.approvals import MAX_ENTRIES, ApprovalBook, Approvals, check_host
from appliance.daemon.config import ApprovalsSection
from appliance.daemon.config import parse_config as parse_daemon_config
from appliance.daemon.errors import ConfigInvalid, CrewBusy, CrewNotFound, InvalidRequest
from appliance.daemon.state import SCHEMA_VERSION, CrewPhase, CrewRow, StateStore
from appliance.journal import entries as E
from proxycore import control
from proxycore.config import parse_config
from proxycore.io.sinks import MemorySink
from proxycore.protocol import events as pe
from proxycore.protocol import http1
from proxycore.protocol.credentials import Routes
from proxycore.protocol.exchange import plan_request
from proxycore.protocol.plans import Forward, OpenTunnel, Refuse
from proxycore.protocol.policy import (
    RULE_APPROVED,
    RULE_NOT_IN_ALLOWLIST,
    Allowlist,
    CrewPolicy,
    NetworkMode,
)
from proxycore.runtime import ProxyRuntime


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- the book -------------------------------------------------------------------------------


def test_a_refusal_files_a_request_once_and_refreshes_it() -> None:
    clock = Clock()
    book = ApprovalBook(900, clock=clock)
    filed, dropped = book.note("c", "pypi.org", 443)
    assert filed is not None and filed.seq == 1 and not dropped
    clock.now += 100
    again, _ = book.note("c", "pypi.org", 80)
    assert again is None  # refreshed, not filed again (journaled once per window)
    [request] = book.requests()
    assert (request.count, request.port, request.first_seen) == (2, 80, 1_000_000.0)
    assert request.message(900).expires == clock.now + 900
    # The window runs from the last refusal; past it the request is gone, and filed anew.
    clock.now += 899
    assert book.requests()
    clock.now += 1
    assert book.requests() == []
    filed, _ = book.note("c", "pypi.org", 443)
    assert filed is not None and filed.seq == 2 and book.count == 1


def test_a_crew_filing_a_thousand_hosts_keeps_its_bound() -> None:
    clock = Clock()
    book = ApprovalBook(900, per_crew=32, total=40, clock=clock)
    dropped_all = []
    for index in range(1000):
        clock.now += 0.001
        _, dropped = book.note("noisy", f"h{index}.test", 443)
        dropped_all += dropped
    # The 32 most recently refused stay; every other was dropped (and the caller logs it).
    hosts = [p.host for p in book.requests("noisy")]
    assert hosts == [f"h{index}.test" for index in range(968, 1000)]
    assert len(dropped_all) == 968 and book.count == 32
    # A retried host moves to the end: the least recently refused one goes first.
    book.note("noisy", "h968.test", 443)
    book.note("noisy", "new.test", 443)
    assert "h968.test" in {p.host for p in book.requests("noisy")}
    assert "h969.test" not in {p.host for p in book.requests("noisy")}
    # And the total bounds every crew together.
    for index in range(20):
        clock.now += 0.001
        book.note("other", f"o{index}.test", 443)
    assert book.count == 40 and len(book.requests()) == 40
    assert len(book.requests("other")) == 20


def test_denied_and_granted_hosts_file_nothing_and_answers_drop_the_request() -> None:
    clock = Clock()
    book = ApprovalBook(900, clock=clock)
    book.note("c", "a.test", 443)
    book.deny("c", "a.test", clock.now + 900)
    assert book.take("c", "a.test") and book.requests() == []
    assert book.note("c", "a.test", 443) == (None, [])
    assert book.message("c").denied == (control.HostUntil("a.test", clock.now + 900),)
    # A grant replaces the denial (and the reverse), never both.
    book.grant("c", "a.test", clock.now + 60)
    message = book.message("c")
    assert message.denied == () and message.grants == (control.HostUntil("a.test", clock.now + 60),)
    assert book.note("c", "a.test", 443) == (None, [])
    # Ended: no longer sent, and a refusal files a request again.
    clock.now += 61
    assert book.message("c") == control.CrewApprovals(crew="c")
    assert book.expire() == {"c"}
    assert book.note("c", "a.test", 443)[0] is not None
    book.allowed("c", "a.test")
    book.forget_crew("c")
    assert book.requests() == [] and book.count == 0


def test_grants_per_crew_are_bounded() -> None:
    clock = Clock()
    book = ApprovalBook(900, clock=clock)
    for index in range(MAX_ENTRIES):
        book.grant("c", f"h{index}.test", clock.now + 60)
    book.grant("c", "h0.test", clock.now + 120)  # a renewal is not a new one
    with pytest.raises(CrewBusy):
        book.grant("c", "one-more.test", clock.now + 60)
    for index in range(MAX_ENTRIES + 10):
        book.deny("d", f"h{index}.test", clock.now + index + 1)
    assert len(book.denied["d"]) == MAX_ENTRIES and "h0.test" not in book.denied["d"]


@pytest.mark.parametrize("host", ["", "a b", "0x7f.1", "a.test.", "ex\u0430mple.com", "x" * 300])
def test_bad_hosts_name_the_argument(host: str) -> None:
    with pytest.raises(InvalidRequest, match="argument host"):
        check_host(host)


def test_hosts_are_normalized_as_the_proxy_compares_them() -> None:
    assert check_host("PyPI.org:443") == "pypi.org"
    assert check_host("[::1]") == "::1"


# -- the worker -----------------------------------------------------------------------------


def policy(clock: Clock, window: float | None = 900.0) -> CrewPolicy:
    return CrewPolicy(
        "alpha",
        NetworkMode.RESTRICTED,
        Allowlist(["allowed.test"]),
        approval_window=window,
        clock=clock,
    )


def test_a_grant_is_read_against_the_clock_at_each_decision() -> None:
    clock = Clock()
    crew = policy(clock)
    assert crew.decide("granted.test", 443).rule == RULE_NOT_IN_ALLOWLIST
    crew.grants = {"granted.test": clock.now + 10}
    decision = crew.decide("granted.test", 443)
    assert decision.allowed and decision.rule == RULE_APPROVED
    clock.now += 10  # ends on time, with no message and nothing to clear
    assert crew.decide("granted.test", 443).rule == RULE_NOT_IN_ALLOWLIST
    # A grant never opens what is refused for another reason.
    crew.grants = {"0x7f.1": clock.now + 10, "other.test": clock.now + 10}
    assert not crew.decide("0x7f.1", 80).allowed
    none = CrewPolicy("n", NetworkMode.NONE, Allowlist([]), grants={"other.test": clock.now + 9})
    assert not none.decide("other.test", 443).allowed


def head(data: bytes) -> http1.RequestHead:
    parsed = http1.parse_request_head(data)
    assert parsed is not None
    return parsed[0]


def plan(crew: CrewPolicy, data: bytes) -> object:
    return plan_request(head(data), crew, Routes({}, {}, {}), audit_blocked=False, max_body=1000)


def body(refusal: object) -> dict[str, object]:
    assert isinstance(refusal, Refuse) and refusal.status == 403
    decoded: dict[str, object] = json.loads(msgspec.json.encode(refusal.body))
    return decoded


GET_OTHER = b"GET http://other.test/x HTTP/1.1\r\nHost: other.test\r\n\r\n"
CONNECT_OTHER = b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n"


def test_the_refusal_says_pending_for_how_long_and_what_to_run() -> None:
    clock = Clock()
    crew = policy(clock)
    for request in (GET_OTHER, CONNECT_OTHER):
        got = body(plan(crew, request))
        # The fields the refusal always had are all there, unchanged.
        assert {k: got[k] for k in ("error", "host", "rule", "mode", "crew")} == {
            "error": "egress_denied",
            "host": "other.test",
            "rule": "not_in_allowlist",
            "mode": "restricted",
            "crew": "alpha",
        }
        assert got["approval"] == "pending" and got["approval_expires_in"] == 900
        assert got["approval_command"] == "appliancectl approvals allow alpha other.test"
        message = str(got["message"])
        assert message.startswith("other.test is not on the allowlist of crew alpha; ")
        assert "pending for 15 minutes" in message and "approvals allow alpha other.test" in message
    # The event applianced files the request from is the same as ever.
    refused = plan(crew, GET_OTHER)
    assert isinstance(refused, Refuse) and refused.event.rule == RULE_NOT_IN_ALLOWLIST


def test_a_denied_host_is_said_denied_and_approvals_off_is_the_plain_refusal() -> None:
    clock = Clock()
    crew = policy(clock)
    crew.denied = {"other.test": clock.now + 120}
    got = body(plan(crew, GET_OTHER))
    assert got["approval"] == "denied" and got["approval_expires_in"] == 120
    assert "denied" in str(got["message"]) and "approval_command" not in got
    clock.now += 120
    assert body(plan(crew, GET_OTHER))["approval"] == "pending"
    plain = body(plan(policy(clock, window=None), GET_OTHER))
    assert plain["message"] == "other.test is not on the allowlist of crew alpha"
    assert "approval" not in plain


def test_a_granted_host_is_planned_as_allowed() -> None:
    clock = Clock()
    crew = policy(clock)
    crew.grants = {"other.test": clock.now + 5}
    assert isinstance(plan(crew, GET_OTHER), Forward)
    assert isinstance(plan(crew, CONNECT_OTHER), OpenTunnel)
    clock.now += 5
    assert isinstance(plan(crew, GET_OTHER), Refuse)


RUNTIME = """
[approvals]
enabled = true
window = 60

[[crew]]
name = "a"
gateway = "127.0.0.1"
"""


def test_crew_approvals_are_applied_all_or_nothing() -> None:
    runtime = ProxyRuntime(parse_config(RUNTIME), MemorySink())
    crew = runtime.crews["127.0.0.1"].policy
    assert crew.approval_window == 60.0
    good = control.CrewApprovals(
        crew="a",
        grants=(control.HostUntil("Pypi.ORG", 2e9),),
        denied=(control.HostUntil("bad.test", 2e9),),
    )
    reply = runtime.handle_control(control.message_decoder.decode(control.encoder.encode(good)))
    assert reply.ok and reply.changed
    assert crew.grants == {"pypi.org": 2e9} and crew.denied == {"bad.test": 2e9}
    assert not runtime.handle_control(good).changed
    for bad in (
        control.CrewApprovals(crew="a", grants=(control.HostUntil("a b", 2e9),)),
        control.CrewApprovals(crew="a", denied=(control.HostUntil("127.1", 2e9),)),
        control.CrewApprovals(crew="a", grants=(control.HostUntil("x.test", float("nan")),)),
        control.CrewApprovals(
            crew="a",
            grants=tuple(
                control.HostUntil(f"h{i}.test", 2e9) for i in range(control.MAX_APPROVALS + 1)
            ),
        ),
        control.CrewApprovals(crew="nobody"),
    ):
        reply = runtime.handle_control(bad)
        assert not reply.ok and reply.error
        assert crew.grants == {"pypi.org": 2e9}  # nothing changed
    # The whole set each time: an empty one withdraws everything.
    assert runtime.handle_control(control.CrewApprovals(crew="a")).changed
    assert crew.grants == {} and crew.denied == {}
    # A proxy on its own says nothing of approvals.
    alone = ProxyRuntime(parse_config(RUNTIME.replace("enabled = true", "")), MemorySink())
    assert alone.crews["127.0.0.1"].policy.approval_window is None


# -- applianced's configuration and journal -------------------------------------------------


def test_applianced_writes_the_window_for_its_workers() -> None:
    config = parse_daemon_config("[approvals]\nwindow = 120\nper_crew = 4\n")
    approvals = config.proxy_config().approvals
    assert approvals.enabled and approvals.window == 120
    off = parse_daemon_config("[approvals]\nenabled = false\n").proxy_config().approvals
    assert not off.enabled
    for text, named in (
        ("[approvals]\nwindow = 0\n", "window"),
        ("[approvals]\nper_crew = 0\n", "per_crew"),
        ("[approvals]\nonce = 100\nmax_once = 10\n", "approvals.once"),
        ("[approvals]\nwindw = 1\n", "windw"),
    ):
        with pytest.raises(ConfigInvalid, match=named):
            parse_daemon_config(text)


def test_approval_entries_round_trip() -> None:
    for entry in (
        E.ApprovalRequested(crew="c", host="pypi.org", port=443, expires=2e9),
        E.ApprovalAllowed(crew="c", host="pypi.org", once=True, until=2e9, by="ops", peer="uid 0"),
        E.ApprovalAllowed(crew="c", host="pypi.org"),
        E.ApprovalDenied(crew="c", host="pypi.org", until=2e9, was_pending=True),
    ):
        assert E.decode(E.encode(entry)) == entry
        assert entry.summary().startswith("approval")
        assert str(type(entry).__struct_config__.tag) in E.ENTRY_TYPES


def test_the_state_keeps_grants_and_denials(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    try:
        store.approval_set("c", "once", "a.test", 100.0)
        store.approval_set("c", "denied", "a.test", 200.0)  # replaces the grant for that host
        store.approval_set("c", "once", "b.test", 300.0)
        store.approval_set("d", "once", "a.test", 50.0)
        assert store.approvals() == [
            ("d", "once", "a.test", 50.0),
            ("c", "denied", "a.test", 200.0),
            ("c", "once", "b.test", 300.0),
        ]
        assert store.approvals_expire(200.0) == 2
        store.approval_delete("c", "b.test")
        assert store.approvals() == []
        # Whatever deletes a crew's row deletes its approvals: a crew made again under the
        # name (after reconcile removed a half-made one, say) inherits nothing.
        store.approval_set("c", "once", "c.test", 900.0)
        store.approval_set("d", "once", "d.test", 900.0)
        store.delete("c")
        assert store.approvals() == [("d", "once", "d.test", 900.0)]
    finally:
        store.close()
    # Created again at a start where it is missing; the schema version is not touched.
    again = StateStore(tmp_path)
    try:
        assert again._meta("schema_version") == str(SCHEMA_VERSION)
    finally:
        again.close()


# -- the service, with applianced around it faked ---------------------------------------------


class FakeProxy:
    def __init__(self) -> None:
        self.crews: dict[str, object] = {"c": object(), "n": object()}
        self.pushed: list[str] = []

    async def push_approvals(self, name: str) -> None:
        self.pushed.append(name)


class FakeRecorder:
    def __init__(self) -> None:
        self.entries: list[E.Entry] = []

    async def record(self, entry: E.Entry) -> None:
        self.entries.append(entry)


class FakeCrews:
    def __init__(self) -> None:
        self.allowed: list[tuple[str, str]] = []

    async def allow(self, name: str, host: str) -> bool:
        self.allowed.append((name, host))
        return True

    def effective_allow(self, row: CrewRow) -> tuple[messages.AllowEntry, ...]:
        return (messages.AllowEntry("api.anthropic.com", ("default",)),)


def service(tmp_path: Path, clock: Clock) -> tuple[Approvals, FakeProxy, FakeRecorder, StateStore]:
    store = StateStore(tmp_path)
    for name, mode in (("c", "restricted"), ("n", "none")):
        store.insert(
            CrewRow(name, mode, (), "runc", 1 << 28, 1.0, CrewPhase.READY, clock.now, clock.now)
        )
    proxy, recorder = FakeProxy(), FakeRecorder()
    approvals = Approvals(
        ApprovalsSection(window=60),
        store,
        proxy,  # type: ignore[arg-type]
        recorder,  # type: ignore[arg-type]
        FakeCrews(),  # type: ignore[arg-type]
        clock=clock,
    )
    return approvals, proxy, recorder, store


def denied_event(crew: str, host: str, rule: str = RULE_NOT_IN_ALLOWLIST) -> pe.RequestDenied:
    return pe.RequestDenied(
        crew=crew, mode="restricted", route="forward", method="GET", host=host, port=80,
        rule=rule, status=403,
    )  # fmt: skip


async def test_the_service_files_answers_pushes_and_reloads(tmp_path: Path) -> None:
    clock = Clock()
    approvals, proxy, recorder, store = service(tmp_path, clock)
    entry = approvals.on_refused(denied_event("c", "a.test"))
    assert isinstance(entry, E.ApprovalRequested) and entry.expires == clock.now + 60
    assert approvals.on_refused(denied_event("c", "a.test")) is None
    assert approvals.on_refused(denied_event("c", "b.test", rule="ssrf_local")) is None
    assert approvals.on_refused(denied_event("gone", "a.test")) is None
    listing = await approvals.listing(since=0, wait=0.01)
    assert [r.host for r in listing.requests] == ["a.test"] and listing.seq == 1
    assert (await approvals.listing(since=1, wait=0.01)).requests == ()

    once = messages.ApprovalDecision(host="A.test", once=True, duration=30, by="ops")
    result = await approvals.allow("c", once)
    assert result.decision == "allowed_once" and result.was_pending and result.until == 1_000_030
    assert proxy.pushed == ["c"] and store.approvals() == [("c", "once", "a.test", 1_000_030)]
    assert approvals.source("c") == control.CrewApprovals(
        crew="c", grants=(control.HostUntil("a.test", 1_000_030),)
    )
    allowed = recorder.entries[-1]
    assert isinstance(allowed, E.ApprovalAllowed) and allowed.once and allowed.by == "ops"

    result = await approvals.deny("c", messages.ApprovalDecision(host="a.test"))
    assert result.decision == "denied" and store.approvals() == [
        ("c", "denied", "a.test", 1_000_060)
    ]
    assert approvals.source("c") == control.CrewApprovals(
        crew="c", denied=(control.HostUntil("a.test", 1_000_060),)
    )

    # What the next applianced loads (ended and orphaned rows go).
    store.approval_set("c", "once", "b.test", clock.now - 1)
    store.approval_set("gone", "once", "b.test", clock.now + 99)
    fresh = Approvals(
        ApprovalsSection(window=60),
        store,
        proxy,
        recorder,
        FakeCrews(),
        clock=clock,  # type: ignore[arg-type]
    )
    fresh.load()
    assert fresh.source("c") == approvals.source("c") and fresh.source("gone") is None
    assert store.approvals() == [("c", "denied", "a.test", 1_000_060)]

    # Permanent: the crew's allowlist; the denial gives way, and the workers are told.
    proxy.pushed.clear()
    result = await approvals.allow("c", messages.ApprovalDecision(host="a.test"))
    assert result.decision == "allowed" and approvals.source("c") is None
    assert proxy.pushed == ["c"] and store.approvals() == []

    for call, decision, error in (
        (approvals.allow, messages.ApprovalDecision(host="x.test", once=True), CrewBusy),
        (approvals.deny, messages.ApprovalDecision(host="x.test"), CrewBusy),
    ):
        with pytest.raises(error, match="mode none"):
            await call("n", decision)
    with pytest.raises(CrewNotFound):
        await approvals.allow("nobody", messages.ApprovalDecision(host="x.test"))
    with pytest.raises(CrewBusy, match="allowlist"):
        await approvals.deny("c", messages.ApprovalDecision(host="api.anthropic.com"))
    for decision, named in (
        (messages.ApprovalDecision(host="x.test", once=True, duration=0), "argument duration"),
        (messages.ApprovalDecision(host="x.test", once=True, duration=1e9), "argument duration"),
        (messages.ApprovalDecision(host="x.test", duration=5), "argument duration"),
        (messages.ApprovalDecision(host="x..test"), "argument host"),
    ):
        with pytest.raises(InvalidRequest, match=named):
            await approvals.allow("c", decision)
    store.close()


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e400", "infs"])
def test_a_duration_without_an_end_is_refused(text: str) -> None:
    import argparse

    from appliance.ctl.approvals import positive_duration

    with pytest.raises(argparse.ArgumentTypeError):
        positive_duration(text)
