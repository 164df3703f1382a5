"""The sans-IO DNS responder's decisions (proxycore/protocol/dns_responder.py), no sockets."""

from __future__ import annotations

import struct

import dns.edns
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from proxycore.protocol.dns_responder import (
    MAX_QUERY,
    Decision,
    DnsLimits,
    DnsResponder,
    SyntheticPool,
    Verdict,
    label_refusal,
)
from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode

WIDE = DnsLimits(queries_rate=1e6, queries_burst=1e6, names_rate=1e6, names_burst=1e6)


def responder(
    mode: NetworkMode = NetworkMode.RESTRICTED,
    allow: tuple[str, ...] = ("api.example.com", "cdn.example.net"),
    limits: DnsLimits = WIDE,
    synthetic: SyntheticPool | None = None,
) -> DnsResponder:
    return DnsResponder(
        CrewPolicy("crew-a", mode, Allowlist(allow)), limits=limits, synthetic=synthetic
    )


def query(name: str, rdtype: str = "A", *, edns: int = -1, qid: int | None = None) -> bytes:
    message = dns.message.make_query(name, rdtype, use_edns=edns)
    if qid is not None:
        message.id = qid
    return message.to_wire()


def read(decision: Decision) -> dns.message.Message:
    assert decision.verdict is Verdict.ANSWER
    return dns.message.from_wire(decision.wire)


def rcode(decision: Decision) -> str:
    return dns.rcode.to_text(read(decision).rcode())


def resolve(r: DnsResponder, name: str, addresses: list[str], rdtype: str = "A", now: float = 1.0):
    decision = r.handle(query(name, rdtype), now)
    assert decision.verdict is Verdict.RESOLVE and decision.resolution is not None
    answer = r.resolved(decision.resolution, addresses, now)
    r.remember(answer, now)
    return answer


# -- the policy ------------------------------------------------------------------------------


def test_allowed_name_is_resolved_and_answered_with_its_addresses():
    r = responder()
    decision = r.handle(query("API.Example.com"), 1.0)
    assert decision.verdict is Verdict.RESOLVE and decision.journal is None
    assert decision.resolution is not None and decision.resolution.name == "api.example.com"
    answer = r.resolved(decision.resolution, ["93.184.216.34", "2606:2800::1"], 1.0)
    assert answer.addresses == ("93.184.216.34", "2606:2800::1") and answer.ttl == 60
    message = dns.message.from_wire(answer.wire)
    assert message.rcode() == dns.rcode.NOERROR
    assert message.flags & dns.flags.QR and message.flags & dns.flags.RA
    # The crew's own spelling of the name is echoed (0x20 case randomization survives).
    assert message.question[0].name.to_text() == "API.Example.com."
    [rrset] = message.answer
    assert [r.address for r in rrset] == ["93.184.216.34"] and rrset.ttl == 60


@pytest.mark.parametrize(
    ("mode", "name", "rule"),
    [
        (NetworkMode.RESTRICTED, "evil.example.org", "not_in_allowlist"),
        (NetworkMode.RESTRICTED, "x.api.example.com", "not_in_allowlist"),
        (NetworkMode.RESTRICTED, "example.com", "not_in_allowlist"),
        (NetworkMode.NONE, "api.example.com", "mode_none"),
        (NetworkMode.FREE, "127.1", "ip_shorthand"),
        (NetworkMode.FREE, "1.2.3.4", "ip_literal"),
        (NetworkMode.FREE, "under_score.example.com", "malformed_host"),
    ],
)
def test_names_the_crew_may_not_reach_get_nxdomain_and_a_journal_entry(mode, name, rule):
    r = responder(mode)
    decision = r.handle(query(name), 1.0)
    assert rcode(decision) == "NXDOMAIN"
    assert decision.journal is not None and decision.journal.rule == rule
    assert decision.journal.crew == "crew-a" and decision.journal.rcode == "NXDOMAIN"
    # The second time comes from the cache, still journaled.
    again = r.handle(query(name), 2.0)
    assert rcode(again) == "NXDOMAIN" and again.journal is not None
    assert again.journal.rule == rule


@pytest.mark.parametrize("rdtype", ["TXT", "NULL", "ANY", "MX", "SRV", "CNAME", "PTR", "NS"])
def test_record_types_the_crew_has_no_use_for_are_refused(rdtype):
    r = responder()
    decision = r.handle(query("api.example.com", rdtype), 1.0)
    assert rcode(decision) == "REFUSED"
    assert decision.journal is not None and decision.journal.rule == "qtype"
    assert decision.journal.qtype == rdtype


@pytest.mark.parametrize("rdtype", ["HTTPS", "SVCB"])
def test_https_and_svcb_get_an_empty_answer_without_resolving(rdtype):
    r = responder()
    decision = r.handle(query("api.example.com", rdtype), 1.0)
    message = read(decision)
    assert message.rcode() == dns.rcode.NOERROR and not message.answer
    assert decision.journal is None
    # Not for a name the crew may not reach.
    assert rcode(r.handle(query("evil.example.org", rdtype), 1.0)) == "NXDOMAIN"


def test_class_other_than_in_is_refused():
    message = dns.message.make_query("api.example.com", "A", rdclass="CH")
    decision = responder().handle(message.to_wire(), 1.0)
    assert rcode(decision) == "REFUSED" and decision.journal is not None
    assert decision.journal.rule == "class"


# -- malformed queries -----------------------------------------------------------------------


def test_garbage_is_formerr_and_no_header_is_dropped():
    r = responder()
    assert r.handle(b"", 1.0).verdict is Verdict.DROP
    assert r.handle(b"\x12\x34" + b"\x00" * 9, 1.0).verdict is Verdict.DROP
    decision = r.handle(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xff", 1.0)
    message = read(decision)
    assert message.id == 0x1234 and message.rcode() == dns.rcode.FORMERR
    assert decision.journal is not None and decision.journal.rule == "malformed_query"


def test_responses_and_oversized_messages_are_dropped():
    r = responder()
    response = dns.message.make_response(dns.message.make_query("api.example.com", "A"))
    assert r.handle(response.to_wire(), 1.0).verdict is Verdict.DROP
    assert r.handle(query("api.example.com") + b"\x00" * MAX_QUERY, 1.0).verdict is Verdict.DROP


def test_two_questions_records_in_the_query_and_pointers_are_formerr():
    r = responder()
    two = query("api.example.com")
    header = bytearray(two[:12])
    header[5] = 2
    assert rcode(r.handle(bytes(header) + two[12:] + two[12:], 1.0)) == "FORMERR"
    message = dns.message.make_query("api.example.com", "A")
    message.answer.append(dns.rrset.from_text("api.example.com.", 60, "IN", "A", "1.2.3.4"))
    assert rcode(r.handle(message.to_wire(), 1.0)) == "FORMERR"
    # A question name that is a compression pointer (into the header).
    pointer = two[:12] + b"\xc0\x04" + b"\x00\x01\x00\x01"
    assert rcode(r.handle(pointer, 1.0)) == "FORMERR"


def test_opcode_other_than_query_is_notimp_and_edns_version_1_is_badvers():
    r = responder()
    message = dns.message.make_query("api.example.com", "A")
    message.set_opcode(dns.opcode.NOTIFY)
    assert rcode(r.handle(message.to_wire(), 1.0)) == "NOTIMP"
    decision = r.handle(query("api.example.com", edns=1), 1.0)
    assert read(decision).rcode() == dns.rcode.BADVERS


def test_trailing_bytes_do_not_get_a_cached_answer():
    r = responder()
    resolve(r, "api.example.com", ["93.184.216.34"])
    decision = r.handle(query("api.example.com") + b"\x00", 2.0)
    assert rcode(decision) == "FORMERR"


# -- the cache -------------------------------------------------------------------------------


def test_a_repeat_is_answered_from_the_cache_with_its_id_and_a_decreasing_ttl():
    r = responder()
    resolve(r, "api.example.com", ["93.184.216.34", "2606:2800::1"], now=100.0)
    decision = r.handle(query("api.EXAMPLE.com", qid=4321), 130.5)
    message = read(decision)
    assert message.id == 4321 and message.question[0].name.to_text() == "api.EXAMPLE.com."
    [rrset] = message.answer
    assert rrset.ttl == 29 and [a.address for a in rrset] == ["93.184.216.34"]
    # The AAAA came with the same resolution: no second upstream query.
    aaaa = read(r.handle(query("api.example.com", "AAAA", edns=0), 101.0))
    assert [a.address for a in aaaa.answer[0]] == ["2606:2800::1"]
    assert aaaa.edns == 0 and aaaa.payload == 1232
    # Expired: resolved again.
    assert r.handle(query("api.example.com"), 160.0).verdict is Verdict.RESOLVE


def test_fast_path_and_slow_path_answer_the_same_bytes():
    r = responder()
    answer = resolve(r, "api.example.com", ["93.184.216.34"], now=10.0)
    decision = r.handle(query("api.example.com", qid=answer.resolution.query_id), 10.0)
    assert decision.wire == answer.wire


def test_ssrf_guard_filters_resolved_addresses():
    r = responder()
    answer = resolve(r, "api.example.com", ["10.0.0.1", "127.0.0.1", "169.254.169.254", "8.8.8.8"])
    assert answer.addresses == ("8.8.8.8",)
    assert answer.journal is not None and answer.journal.rule == "address_refused"
    assert answer.journal.count == 3


def test_failed_resolution_is_servfail_remembered_for_a_few_seconds():
    r = responder()
    decision = r.handle(query("api.example.com"), 1.0)
    assert decision.resolution is not None
    failed = r.failed(decision.resolution, 1.0)
    assert rcode(failed) == "SERVFAIL"
    assert rcode(r.handle(query("api.example.com"), 3.0)) == "SERVFAIL"
    assert r.handle(query("api.example.com"), 7.0).verdict is Verdict.RESOLVE


def test_cached_nxdomain_is_forgotten_when_the_allowlist_grows():
    r = responder()
    assert rcode(r.handle(query("new.example.com"), 1.0)) == "NXDOMAIN"
    r.policy.allow("new.example.com")
    assert r.handle(query("new.example.com"), 2.0).verdict is Verdict.RESOLVE


def test_cached_answers_and_refusals_follow_grants_and_denials():
    """An approval granted (or a denial, or address rules) changes what the policy answers
    without growing the allowlist: the cached NXDOMAIN goes, and so does a cached answer."""
    r = responder()
    assert rcode(r.handle(query("granted.example.com"), 1.0)) == "NXDOMAIN"
    r.policy.grants = {"granted.example.com": 1e12}
    r.policy.changed()
    resolve(r, "granted.example.com", ["93.184.216.34"], now=2.0)
    assert rcode(r.handle(query("granted.example.com"), 3.0)) == "NOERROR"
    # The grant withdrawn by the operator (a denial): refused at the next batch.
    r.policy.grants = {}
    r.policy.denied = {"granted.example.com": 1e12}
    r.policy.changed()
    assert rcode(r.handle(query("granted.example.com"), 4.0)) == "NXDOMAIN"


def test_the_cache_is_bounded():
    r = responder(NetworkMode.FREE, limits=DnsLimits(names_burst=1e6, cache_entries=16))
    for i in range(100):
        r.handle(query(f"n{i}.example.com"), 1.0)
    assert len(r._cache) <= 16


# -- exfiltration limits ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("label", "rule"),
    [
        ("a" * 41, "label_too_long"),
        ("deadbeef0123456789abcdef", "label_hex"),
        ("mzxw6ytboi2dsnrtgq3tmnzy", "label_entropy"),  # base32
        ("k7q2x9w4m1z8p5r3v6bn", "label_entropy"),
    ],
)
def test_long_or_high_entropy_labels_are_refused_in_free_mode(label, rule):
    r = responder(NetworkMode.FREE)
    decision = r.handle(query(f"{label}.tunnel.example"), 1.0)
    assert rcode(decision) == "REFUSED"
    assert decision.journal is not None and decision.journal.rule == rule


def test_long_names_are_refused_in_free_mode():
    name = ".".join(["abcdefghij"] * 11) + ".example"
    decision = responder(NetworkMode.FREE).handle(query(name), 1.0)
    assert decision.journal is not None and decision.journal.rule == "name_too_long"


@pytest.mark.parametrize(
    "name",
    [
        "generativelanguage.googleapis.com",
        "production-api-gateway-eu-west-1.example.com",
        "prod-us-east-1-starport-layer-bucket.s3.dualstack.us-east-1.amazonaws.com",
        "d1a2b3c4d5e6f7.cloudfront.net",
        "objects.githubusercontent.com",
    ],
)
def test_real_host_names_pass_the_label_limits(name):
    assert label_refusal(name) is None
    assert responder(NetworkMode.FREE).handle(query(name), 1.0).verdict is Verdict.RESOLVE


def test_an_exact_allowlist_entry_is_exempt_from_the_label_limits():
    long = "deadbeef0123456789abcdef.example.com"
    r = responder(NetworkMode.FREE, allow=(long,))
    assert r.handle(query(long), 1.0).verdict is Verdict.RESOLVE


def test_names_resolved_upstream_are_rate_limited():
    r = responder(NetworkMode.FREE, limits=DnsLimits(names_rate=1.0, names_burst=5))
    verdicts = [r.handle(query(f"n{i}.example.com"), 1.0).verdict for i in range(8)]
    assert verdicts.count(Verdict.RESOLVE) == 5
    refused = r.handle(query("n9.example.com"), 1.0)
    assert rcode(refused) == "REFUSED" and refused.journal is not None
    assert refused.journal.rule == "rate_limited_names"
    # The bucket refills: one more a second.
    assert r.handle(query("n10.example.com"), 2.0).verdict is Verdict.RESOLVE


def test_queries_over_the_rate_are_dropped_with_one_journal_entry_a_second():
    r = responder(limits=DnsLimits(queries_rate=10, queries_burst=10))
    decisions = [r.handle(query("api.example.com", "HTTPS"), 1.0) for _ in range(30)]
    assert sum(d.verdict is Verdict.ANSWER for d in decisions) == 10
    journals = [d.journal for d in decisions if d.verdict is Verdict.DROP and d.journal]
    assert len(journals) == 1 and journals[0].rule == "rate_limited_queries"
    later = r.handle(query("api.example.com", "HTTPS"), 1.05)
    assert later.verdict is Verdict.DROP and later.journal is None
    report = r.handle(b"", 2.0)  # the bucket has refilled by then
    assert report.verdict is Verdict.DROP


# -- synthetic addresses ---------------------------------------------------------------------


def test_synthetic_mode_answers_from_the_crews_range_and_maps_back():
    pool = SyntheticPool("198.18.4.0/24", 100)
    r = responder(NetworkMode.FREE, synthetic=pool)
    first = read(r.handle(query("api.example.com"), 1.0))
    address = first.answer[0][0].address
    assert address == "198.18.4.1" and r.name_for(address) == "api.example.com"
    second = read(r.handle(query("cdn.example.net"), 1.0))
    assert second.answer[0][0].address == "198.18.4.2"
    assert rcode(r.handle(query("api.example.com", "AAAA"), 1.0)) == "NOERROR"
    assert r.name_for("198.18.4.99") is None and r.name_for("8.8.8.8") is None


def test_synthetic_table_is_bounded_and_reuses_only_expired_addresses():
    pool = SyntheticPool("198.18.0.0/29", 100)  # six usable addresses
    r = responder(NetworkMode.FREE, synthetic=pool, limits=DnsLimits(queries_burst=1e6, ttl=10))
    for i in range(6):
        assert rcode(r.handle(query(f"n{i}.example.com"), 1.0)) == "NOERROR"
    full = r.handle(query("n6.example.com"), 5.0)
    assert rcode(full) == "SERVFAIL" and full.journal is not None
    assert full.journal.rule == "synthetic_table_full"
    later = read(r.handle(query("n6.example.com"), 12.0))
    assert later.answer[0][0].address == "198.18.0.1"
    assert pool.name_for("198.18.0.1") == "n6.example.com" and len(pool) == 6


def test_synthetic_pool_refuses_ipv6_and_empty_ranges():
    with pytest.raises(ValueError):
        SyntheticPool("2001:db8::/64", 10)
    with pytest.raises(ValueError):
        SyntheticPool("198.18.0.0/31", 10)


def test_edns_options_in_the_query_are_accepted():
    message = dns.message.make_query(
        "api.example.com", "A", use_edns=0, options=[dns.edns.GenericOption(10, b"\x01" * 8)]
    )
    r = responder()
    decision = r.handle(message.to_wire(), 1.0)
    assert decision.verdict is Verdict.RESOLVE and decision.resolution is not None
    r.remember(r.resolved(decision.resolution, ["8.8.4.4"], 1.0), 1.0)
    cached = read(r.handle(message.to_wire(), 1.0))
    assert cached.rcode() == dns.rcode.NOERROR and cached.answer[0][0].address == "8.8.4.4"


def test_many_addresses_are_capped_so_the_answer_fits_512_octets():
    r = responder()
    answer = resolve(r, "api.example.com", [f"8.8.{i}.{i}" for i in range(40)])
    assert len(answer.wire) <= 512
    assert len(dns.message.from_wire(answer.wire).answer[0]) == 8


def test_header_flags_echo_rd():
    wire = bytearray(query("api.example.com", "HTTPS"))
    wire[2] &= ~0x01
    decision = responder().handle(bytes(wire), 1.0)
    assert not read(decision).flags & dns.flags.RD
    assert struct.unpack(">H", decision.wire[:2]) == struct.unpack(">H", wire[:2])


def test_a_bug_inside_costs_one_query(monkeypatch):
    r = responder()

    def boom(*_args: object) -> Decision:
        raise RuntimeError("bug")

    monkeypatch.setattr(r, "_handle", boom)
    decision = r.handle(query("api.example.com"), 1.0)
    assert decision.verdict is Verdict.DROP and decision.journal is not None
    assert dns.rdatatype.A  # the module stays importable and usable after


def test_a_repeated_query_gets_the_same_bytes_but_its_id_and_the_ttl_ticks_down():
    r = responder()
    resolve(r, "api.example.com", ["93.184.216.34"], now=100.0)
    first = r.handle(query("api.example.com", qid=1), 100.2)
    second = r.handle(query("api.example.com", qid=2), 100.7)  # the hot path
    assert first.wire[2:] == second.wire[2:] and second.wire[:2] == b"\x00\x02"
    assert read(second).answer[0].ttl == 59
    later = read(r.handle(query("api.example.com", qid=3), 101.5))
    assert later.id == 3 and later.answer[0].ttl == 58
    # A different spelling is a different query: its own bytes, its own echo.
    upper = read(r.handle(query("API.example.com", qid=4), 101.5))
    assert upper.question[0].name.to_text() == "API.example.com."


def test_a_repeated_refusal_is_journaled_each_time_and_forgotten_when_the_allowlist_grows():
    r = responder()
    decisions = [r.handle(query("new.example.com"), 1.0 + i / 10) for i in range(4)]
    assert all(rcode(d) == "NXDOMAIN" and d.journal is not None for d in decisions)
    r.policy.allow("new.example.com")
    assert r.handle(query("new.example.com"), 1.5).verdict is Verdict.RESOLVE
