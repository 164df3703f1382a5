"""Fuzz the crew DNS responder (proxycore/protocol/dns_responder.py) against its invariants.

Run:  python fuzz/fuzz_dns.py -runs=500000 -max_len=1024 /tmp/corpus-dns
(atheris is imported only in main(); tests import `TestOneInput` and `SEEDS` without it.)

The input's first byte picks the crew (mode NONE, RESTRICTED or FREE; real or synthetic
addresses) and how the rest becomes a query: raw bytes, or a well-formed query (name, type,
class, EDNS from the bytes) with a few bytes of it overwritten. Each query is handled, any
resolution it asks for completed with fixed addresses, and the query handled again (the cache).

Invariants:
- `handle`, `resolved`, `remember` and `failed` never raise; every decision is a known verdict.
- Every answer is a DNS response dnspython reads, with the query's ID, QR set, one question
  echoing the query's at most, no TC.
- An answer with records (or a resolution asked for) is for an A or AAAA question whose name
  the crew's policy allows (`decide_egress`), and, for a FREE-mode name not on the allowlist,
  one the label limits pass; its addresses are the resolver's (filtered by the SSRF guard) or
  from the crew's synthetic range, and the synthetic range maps each back to that name.
- Nothing is ever answered for NONE beyond refusals.
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dns.flags
import dns.message
import dns.name
import dns.rdataclass
import dns.rdatatype

from proxycore.protocol.dns_responder import (
    DnsLimits,
    DnsResponder,
    SyntheticPool,
    Verdict,
    label_refusal,
)
from proxycore.protocol.policy import (
    Allowlist,
    CrewPolicy,
    NetworkMode,
    decide_egress,
    normalize_host,
)

_ALLOW = ("api.example.com", "a.b.example", "x" * 50 + ".example", "xn--80ak6aa92e.com")
_MODES = (NetworkMode.NONE, NetworkMode.RESTRICTED, NetworkMode.FREE)
_RESOLVED = ["93.184.216.34", "10.0.0.1", "2606:2800::1", "::1", "169.254.169.254"]
_GLOBAL = {"93.184.216.34", "2606:2800::1"}
_SYNTHETIC = ipaddress.ip_network("198.18.8.0/28")
_LIMITS = DnsLimits(
    queries_rate=1e9, queries_burst=1e9, names_rate=1e9, names_burst=1e9, cache_entries=8
)
_TYPES = (1, 28, 65, 64, 16, 10, 255, 15, 33, 5, 12, 0, 41, 250, 65535)
_NAMES = (
    "api.example.com",
    "API.Example.COM",
    "a.b.example",
    "evil.example",
    "x" * 50 + ".example",
    "deadbeef0123456789.example",
    "127.1",
    "1.2.3.4",
    "a_b.example",
    "xn--80ak6aa92e.com",
)

SEEDS: tuple[bytes, ...] = (
    b"\x00",
    b"\x01\x00\x00\x01",
    b"\x02\x01\x00\x01",
    b"\x05\x04\x01\x00",
    b"\x09\x02\x00\x02\x00",
    b"\x0a\x05\x0e\x00\x03\xffzz",
    b"\x80\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"
    b"\x03api\x07example\x03com\x00\x00\x01\x00\x01",
    b"\x81\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\xc0\x0c\x00\x01\x00\x01",
    b"\x82" + b"\x00" * 12,
)


class Failure(AssertionError):
    pass


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


def _build(body: bytes) -> bytes:
    """A well-formed query from the bytes, then a few of its bytes overwritten by them."""
    pick = body[0] if body else 0
    name = _NAMES[pick % len(_NAMES)]
    if pick & 0x80 and len(body) > 4:
        # A name of the input's own labels (any octets), to reach the name checks.
        raw = body[4 : 4 + (body[1] % 80)]
        labels = [raw[i : i + 1 + body[2] % 63] for i in range(0, len(raw), 1 + body[2] % 63)]
        try:
            qname = dns.name.Name([*labels, b""])
        except Exception:
            qname = dns.name.from_text(name)
    else:
        qname = dns.name.from_text(name)
    rdtype = _TYPES[(body[1] if len(body) > 1 else 0) % len(_TYPES)]
    flags = body[2] if len(body) > 2 else 0
    message = dns.message.make_query(
        qname,
        dns.rdatatype.RdataType.make(rdtype),
        rdclass=dns.rdataclass.CH if flags & 0x40 else dns.rdataclass.IN,
        use_edns=(flags & 0x03) - 1 if flags & 0x03 != 3 else 1,
    )
    wire = bytearray(message.to_wire())
    # Overwrite up to three bytes at offsets the input picks.
    for i in range(3, min(len(body), 9), 2):
        if body[i] & 0x80:
            wire[body[i] % len(wire)] = body[i + 1] if i + 1 < len(body) else 0
    return bytes(wire)


def _check_answer(responder: DnsResponder, wire: bytes, out: bytes, resolved: bool) -> None:
    _require(len(out) >= 12, "answer shorter than a header")
    _require(out[:2] == wire[:2], "answer with another ID")
    try:
        message = dns.message.from_wire(out)
    except Exception as exc:
        raise Failure(f"answer dnspython cannot read: {exc!r} {out.hex()}") from None
    _require(bool(message.flags & dns.flags.QR), "answer without QR")
    _require(not message.flags & dns.flags.TC, "answer with TC")
    _require(len(message.question) <= 1, "answer with several questions")
    _require(not message.authority and not message.additional, "records beyond the answer")
    if not message.answer:
        return
    policy = responder.policy
    _require(policy.mode is not NetworkMode.NONE, "records answered in mode NONE")
    [question] = message.question
    _require(question.rdtype in (1, 28), f"records for qtype {question.rdtype}")
    _require(question.rdclass == dns.rdataclass.IN, "records for a class other than IN")
    name = normalize_host(question.name.to_text(omit_final_dot=True))
    _require(decide_egress(policy.mode, policy.allowlist, name, 443).allowed, f"{name} answered")
    if policy.mode is NetworkMode.FREE and name not in policy.allowlist:
        _require(label_refusal(name) is None, f"{name} answered past the label limits")
    for rrset in message.answer:
        _require(rrset.name == question.name and rrset.rdtype == question.rdtype, "other rrset")
        for rdata in rrset:
            address = rdata.address
            if responder.synthetic is not None:
                _require(ipaddress.ip_address(address) in _SYNTHETIC, f"{address} not synthetic")
                _require(responder.name_for(address) == name, f"{address} maps elsewhere")
            else:
                _require(resolved and address in _GLOBAL, f"{address} answered")


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    selector, body = data[0], data[1:]
    mode = _MODES[selector % 3]
    synthetic = SyntheticPool(str(_SYNTHETIC), 8) if selector & 0x04 else None
    policy = CrewPolicy("fuzz", mode, Allowlist(_ALLOW))
    responder = DnsResponder(policy, limits=_LIMITS, synthetic=synthetic)
    wire = body if selector & 0x80 else _build(body)
    resolved = False
    for now in (1.0, 2.0, 100.0):
        decision = responder.handle(wire, now)
        _require(decision.verdict in (Verdict.ANSWER, Verdict.RESOLVE, Verdict.DROP), "verdict")
        if decision.journal is not None:
            _require(not decision.journal.rule.startswith("internal_error"), repr(decision.journal))
        if decision.verdict is Verdict.ANSWER:
            _check_answer(responder, wire, decision.wire, resolved)
        elif decision.verdict is Verdict.RESOLVE:
            resolution = decision.resolution
            _require(resolution is not None, "RESOLVE without a resolution")
            assert resolution is not None
            _require(synthetic is None, "resolution asked for in synthetic mode")
            _require(resolution.qtype in (1, 28), f"resolution for qtype {resolution.qtype}")
            name = resolution.name
            _require(decide_egress(mode, policy.allowlist, name, 443).allowed, f"{name} resolved")
            if mode is NetworkMode.FREE and name not in policy.allowlist:
                _require(label_refusal(name) is None, f"{name} resolved past the label limits")
            if selector & 0x08:
                failed = responder.failed(resolution, now)
                _check_answer(responder, wire, failed.wire, resolved)
            else:
                answer = responder.resolved(resolution, _RESOLVED, now)
                _require(set(answer.addresses) <= _GLOBAL, f"hook given {answer.addresses}")
                resolved = True
                _check_answer(responder, wire, answer.wire, resolved)
                responder.remember(answer, now)
    _require(len(responder._cache) <= _LIMITS.cache_entries, "cache over its bound")


def main() -> None:
    from seeded import fuzz

    fuzz("dns", SEEDS, TestOneInput)


if __name__ == "__main__":
    main()
