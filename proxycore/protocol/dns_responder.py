"""A crew's DNS responder, sans-IO: one query's bytes in, an explicit decision out.

Theory of operation
-------------------
Each crew gets a `DnsResponder` built from its `CrewPolicy` (the proxy's own name policy: the
same normalizer, the same exact allowlist, the same NONE/RESTRICTED/FREE mode). It answers only
names the crew may reach; it never forwards a query, so no recursion reaches the crew and nothing
the crew writes in a query reaches a nameserver except a name the policy allows, asked by us.

`handle(wire, now)` returns a `Decision`:
- `ANSWER`: send `wire` now (a refusal, an empty answer, a cached answer, a synthetic address);
- `RESOLVE`: the IO layer resolves `resolution.name` (A and AAAA at once, with the proxy's
  resolver), then calls `resolved(resolution, addresses, now)`, which returns an `Answer`; the IO
  layer awaits its `before_answer` hook with `answer.addresses` (the place for a kernel set of
  answered addresses, with a timeout of at least `answer.ttl`; the appliance's wiring opens
  nothing per answer: docs/proxy.md "DNS"), then calls `remember(answer, now)`
  and sends `answer.wire`. If resolution or the hook fails: `failed(resolution, now)` (SERVFAIL);
- `DROP`: send nothing (not even a DNS header, a response, or the crew over its query rate).
Every refusal carries a `DnsRefusal` for the journal.

The order of checks, and the answer each failure gets:
1. queries/s token bucket (per crew) -> DROP; one journal event per second at most, with a count.
2. not a header, longer than `MAX_QUERY`, QR set -> DROP. Anything dnspython cannot read, more
   than one question, records in the answer or authority section, anything in the additional
   section but one OPT (TSIG, say), a compression pointer in the question -> FORMERR. Opcode other
   than QUERY -> NOTIMP. EDNS version above 0 -> BADVERS (RFC 6891 §6.1.3). Class other than IN
   -> REFUSED.
3. qtype: A and AAAA are answered. HTTPS (65) and SVCB (64) get an empty NOERROR for a name the
   crew may reach: curl, browsers and Go ask them first and treat REFUSED or SERVFAIL as a lookup
   failure (a slow fallback or an error), while NODATA just means "no such record" and they go
   on with A/AAAA; nothing is asked upstream for them. Everything else (TXT, NULL, ANY, MX, SRV,
   CNAME, PTR, ...) -> REFUSED: a crew has no use for them and TXT/NULL are the tunnels' carriers.
4. The name: `normalize_host` (refused names, IP literals and IPv4 shorthand -> NXDOMAIN), then
   the crew's `CrewPolicy.decide` (NONE, or not allowlisted in RESTRICTED -> NXDOMAIN).
5. Label limits, before anything goes upstream, for names allowed only by FREE mode (an exact
   allowlist entry is the operator's own text and exempt) -> REFUSED. See `label_refusal`.
6. The per-crew cache of wire answers (a hit is answered at once, ID patched, TTL counting down).
7. Synthetic mode: an address from the crew's synthetic range, mapped back to the name.
   Real mode: the names-upstream-per-minute token bucket (REFUSED when empty), then RESOLVE.

Label limits, and why these numbers. The exfiltration vector is a name we resolve upstream on
the crew's behalf: in FREE mode `<data>.attacker.example` makes our resolver carry `<data>` to the
attacker's nameserver. DNS tunnels (iodine, dnscat2, DNSExfiltrator) pack base32/base64/hex into
labels of up to 63 octets and names of up to 253. We refuse, for a FREE-mode name: a label over
`MAX_LABEL` (40) characters, a name over `MAX_NAME` (120), and labels of `ENTROPY_MIN_LENGTH` (16)
characters or more that are either all hex digits mixing letters and digits (hex-encoded data) or
whose Shannon entropy exceeds `MAX_LABEL_ENTROPY` (4.0 bits per character). Measured on random
labels: base32/base36 of 24 characters have a median entropy of 4.0-4.05 and of 32 characters
4.2-4.3, while the longest real host labels we collected (cloud buckets, CDN shards, API
gateways, e.g. "production-api-gateway-eu-west-1") stay at or under 4.02. These checks make a
tunnel slow and awkward, not impossible (short labels of English-looking text pass): what bounds
the channel is the names-upstream-per-minute bucket, since a name only leaves when it is not
already in the cache.

Memory: the wire cache, the synthetic table and the decision memo are bounded per crew; the
token buckets are two floats each. Nothing grows with the number of queries.

Pure: no trio, no sockets; time comes in as `now` (a monotonic clock, seconds).
"""

from __future__ import annotations

import collections
import enum
import ipaddress
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rdataclass
import dns.rdatatype

from proxycore.errors import PolicyDenied
from proxycore.protocol.policy import CrewPolicy, NetworkMode, is_ip_literal, normalize_host
from proxycore.protocol.ssrf import AddressGuard

__all__ = [
    "DEFAULT_LIMITS",
    "Answer",
    "Decision",
    "DnsLimits",
    "DnsRefusal",
    "DnsResponder",
    "Resolution",
    "SyntheticPool",
    "Verdict",
    "label_refusal",
]

# A query is one question and at most one OPT record: 12 + 255 + 4 + 11 octets, plus EDNS
# options (a client cookie is 12). Anything longer is not a query we answer.
MAX_QUERY = 512
# Answers carry at most this many addresses, so that every answer fits the 512 octets a UDP
# client without EDNS accepts (RFC 1035 §4.2.1): 12 + 259 (question) + 16 x 28 (AAAA) = 719 is
# too many, 8 x 28 = 224 fits. No answer is ever truncated, so TC is never set.
MAX_ADDRESSES = 8
# What we say our UDP payload size is in our OPT record: the DNS Flag Day 2020 value.
EDNS_PAYLOAD = 1232

MAX_LABEL = 40
MAX_NAME = 120
ENTROPY_MIN_LENGTH = 16
MAX_LABEL_ENTROPY = 4.0

_A = 1
_AAAA = 28
_SVCB = 64
_HTTPS = 65
_OPT = 41
_IN = 1

_NOERROR = 0
_FORMERR = 1
_SERVFAIL = 2
_NXDOMAIN = 3
_NOTIMP = 4
_REFUSED = 5
_BADVERS = 16

_HEX = frozenset("0123456789abcdef")
_DIGITS = frozenset("0123456789")

# The port CrewPolicy.decide is asked about: the name policy does not depend on the port, and
# the memo then holds one entry per name.
_POLICY_PORT = 443

_HEADER = struct.Struct(">HBBHHHH")
_OPT_RECORD = b"\x00\x00\x29" + struct.pack(">H", EDNS_PAYLOAD) + b"\x00\x00\x00\x00\x00\x00"


class Verdict(enum.Enum):
    ANSWER = "answer"
    RESOLVE = "resolve"
    DROP = "drop"


@dataclass(frozen=True, slots=True)
class DnsLimits:
    """A crew's DNS limits. Rates are token buckets: `*_rate` per second refill, `*_burst` cap."""

    queries_rate: float = 200.0
    queries_burst: float = 400.0
    # Names resolved upstream (cache misses): 60 a minute, 30 at once.
    names_rate: float = 1.0
    names_burst: float = 30.0
    # The TTL of every answer we give. The proxy's resolver does not report upstream TTLs; a
    # short fixed TTL keeps the crew's nftables set entries short-lived and re-resolves names
    # that move. Refusals are not cached by the client (we give no SOA), failures for `fail_ttl`
    # by us.
    ttl: int = 60
    fail_ttl: int = 5
    # Answers and refusals remembered per crew and worker (each holds its question, its answer
    # and, for the hottest, the bytes of a whole reply): a crew asking thousands of distinct
    # names must not make every worker hold megabytes for it.
    cache_entries: int = 512
    synthetic_entries: int = 4096


DEFAULT_LIMITS = DnsLimits()


@dataclass(frozen=True, slots=True)
class DnsRefusal:
    """A journal entry: a query refused, or (rule "rate_limited_queries") `count` queries dropped.

    `name` is a printable rendering of the question (at most 255 characters), `qtype` its type
    as text, `rcode` the answer's rcode as text ("DROP" when nothing was sent).
    """

    crew: str
    name: str
    qtype: str
    rule: str
    rcode: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class Resolution:
    """What the IO layer must resolve: `name` (normalized), for the query that asked `qtype`.

    The rest is the query's own, to build its answer from when the addresses come back.
    """

    name: str
    qtype: int
    query_id: int
    rd: int
    question: bytes
    key: bytes
    edns: bool


@dataclass(frozen=True, slots=True)
class Answer:
    """A resolved answer, not yet sent: the hook first gets `addresses` (valid `ttl` seconds)."""

    wire: bytes
    addresses: tuple[str, ...]
    ttl: int
    resolution: Resolution
    journal: DnsRefusal | None = None


class Decision(NamedTuple):
    # A NamedTuple rather than a frozen dataclass: one is made per query, and a tuple is made
    # several times faster, which shows on the cache-hit path (the server's throughput).
    verdict: Verdict
    wire: bytes = b""
    resolution: Resolution | None = None
    journal: DnsRefusal | None = None


_DROP = Decision(Verdict.DROP)


def _entropy(label: str) -> float:
    n = len(label)
    return -sum(c / n * math.log2(c / n) for c in collections.Counter(label).values())


def label_refusal(name: str) -> str | None:
    """The rule a FREE-mode name breaks ("label_too_long", "name_too_long", "label_hex",
    "label_entropy"), or None. `name` is normalized. Thresholds: see the module docstring."""
    if len(name) > MAX_NAME:
        return "name_too_long"
    for label in name.split("."):
        if len(label) > MAX_LABEL:
            return "label_too_long"
        if len(label) >= ENTROPY_MIN_LENGTH:
            chars = set(label)
            if chars <= _HEX and chars & _DIGITS and chars - _DIGITS:
                return "label_hex"
            if _entropy(label) > MAX_LABEL_ENTROPY:
                return "label_entropy"
    return None


class _Bucket:
    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp: float | None = None

    def take(self, now: float) -> bool:
        if self.stamp is not None and now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        if self.stamp is None or now > self.stamp:
            self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class SyntheticPool:
    """A per-crew range of synthetic IPv4 addresses, each mapped to one name.

    Bounded: at most `capacity` names (and never more than the range holds). A new name takes a
    never-used address, else the least recently answered name's address, but only once the last
    answer that gave it out has expired (its TTL); a crew that holds every address live gets
    SERVFAIL for a new name rather than an address that still means another name to it.
    `name_for(address)` is the reverse look-up for the transparent proxy.
    """

    __slots__ = ("_address_of", "_expiry", "_name_of", "_next", "_size", "network")

    def __init__(self, network: str, capacity: int) -> None:
        parsed = ipaddress.ip_network(network, strict=True)
        if not isinstance(parsed, ipaddress.IPv4Network):
            raise ValueError(f"synthetic range {network!r} is not IPv4")
        self.network = parsed
        # The network and broadcast addresses are left out: some stacks refuse to connect there.
        self._size = max(0, min(capacity, parsed.num_addresses - 2))
        if self._size == 0:
            raise ValueError(f"synthetic range {network!r} holds no address")
        self._next = 0
        # name -> expiry of the last answer naming it, least recently answered first.
        self._expiry: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._address_of: dict[str, str] = {}
        self._name_of: dict[str, str] = {}

    def address_for(self, name: str, now: float, ttl: int) -> str | None:
        address = self._address_of.get(name)
        if address is not None:
            self._expiry[name] = now + ttl
            self._expiry.move_to_end(name)
            return address
        if self._next < self._size:
            address = str(self.network.network_address + 1 + self._next)
            self._next += 1
        else:
            oldest, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                return None
            del self._expiry[oldest]
            address = self._address_of.pop(oldest)
        self._expiry[name] = now + ttl
        self._address_of[name] = address
        self._name_of[address] = name
        return address

    def name_for(self, address: str) -> str | None:
        return self._name_of.get(address)

    def __len__(self) -> int:
        return len(self._expiry)


class _Entry:
    """A cached answer: rcode and records (each without its TTL), valid until `expiry`."""

    __slots__ = ("ancount", "expiry", "headers", "journal", "rcode", "records", "tail", "tail_ttl")

    def __init__(
        self,
        rcode: int,
        records: Sequence[tuple[bytes, bytes]],
        expiry: float,
        journal: DnsRefusal | None = None,
    ) -> None:
        self.rcode = rcode
        self.records = records
        self.ancount = len(records)
        self.expiry = expiry
        self.journal = journal
        self.tail = b""
        self.tail_ttl = -1
        # The header after the ID, by (query's RD bit | query had EDNS << 1): flags (QR, RD
        # echoed, RA, rcode) and the counts (one question, the answers, an OPT if asked).
        self.headers = tuple(
            bytes((0x80 | (index & 1), 0x80 | rcode))
            + struct.pack(">HHHH", 1, self.ancount, 0, index >> 1)
            for index in range(4)
        )

    def tail_for(self, ttl: int) -> bytes:
        # Rebuilt at most once a second per entry: the TTL counts down to the entry's expiry,
        # so a client never holds an address past the moment we (and the nftables set) forget.
        if ttl != self.tail_ttl:
            packed = struct.pack(">I", ttl)
            self.tail = b"".join(head + packed + rdata for head, rdata in self.records)
            self.tail_ttl = ttl
        return self.tail


def _printable(raw: bytes | str, limit: int = 255) -> str:
    text = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    clipped = text[:limit]
    return clipped.encode("unicode_escape", "backslashreplace").decode("ascii")


def _walk_question(wire: bytes, start: int) -> int:
    """The offset just past the question's name (plain labels only), or -1."""
    i = start
    end = len(wire)
    total = 0
    while i < end:
        length = wire[i]
        if length == 0:
            return i + 1
        if length > 63:
            return -1
        total += length + 1
        if total > 254:
            return -1
        i += length + 1
    return -1


def _records(addresses: Sequence[str], qtype: int) -> list[tuple[bytes, bytes]]:
    # Each answer names the question by a compression pointer to offset 12 (RFC 1035 §4.1.4),
    # so the crew's own spelling of the name (0x20 case randomization included) is echoed.
    head = b"\xc0\x0c" + struct.pack(">HH", qtype, _IN)
    out: list[tuple[bytes, bytes]] = []
    for text in addresses:
        packed = ipaddress.ip_address(text).packed
        out.append((head, struct.pack(">H", len(packed)) + packed))
        if len(out) == MAX_ADDRESSES:
            break
    return out


class DnsResponder:
    """One crew's responder. Not thread-safe; one trio task at a time calls it (no awaits)."""

    def __init__(
        self,
        policy: CrewPolicy,
        *,
        guard: AddressGuard | None = None,
        limits: DnsLimits = DEFAULT_LIMITS,
        synthetic: SyntheticPool | None = None,
    ) -> None:
        self.policy = policy
        self.crew = policy.name
        self.guard = guard if guard is not None else AddressGuard()
        self.limits = limits
        self.synthetic = synthetic
        self._queries = _Bucket(limits.queries_rate, limits.queries_burst)
        self._names = _Bucket(limits.names_rate, limits.names_burst)
        self._cache: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()
        # The hottest path: a query byte-for-byte the same as one answered from the cache a
        # moment ago (but for its ID: a client asking the same name again) gets the same bytes.
        # Keyed by the query without its ID; each entry holds until its answer would change
        # (the TTL ticks down a second, or one second at most for a refusal), and the whole
        # dict is dropped when it reaches the cache's size.
        self._hot: dict[bytes, tuple[float, bytes, DnsRefusal | None]] = {}
        # What the policy answers changes (`crew allow`, an approval granted, denied or ended by
        # the operator, address rules): no cached answer or refusal outlives that.
        self._generation = policy.generation
        self._dropped = 0
        self._dropped_reported_at = -math.inf

    # -- the IO layer's calls --------------------------------------------------------------

    def handle(self, wire: bytes, now: float) -> Decision:
        """Decide one query (UDP payload or TCP message without its length). Never raises."""
        bucket = self._queries
        if now != bucket.stamp:
            if bucket.stamp is not None and now > bucket.stamp:
                tokens = bucket.tokens + (now - bucket.stamp) * bucket.rate
                bucket.tokens = tokens if tokens < bucket.burst else bucket.burst
            bucket.stamp = now
            # Checked once per distinct `now` (the server reads the clock once per batch of
            # datagrams): soon enough, and it keeps an attribute read off every query.
            if self.policy.generation != self._generation:
                self._cache.clear()
                self._hot.clear()
                self._generation = self.policy.generation
        if bucket.tokens < 1.0:
            return self._rate_limited(now)
        bucket.tokens -= 1.0
        hot = self._hot.get(wire[2:])
        if hot is not None and now <= hot[0]:
            return Decision(Verdict.ANSWER, wire[0:2] + hot[1], None, hot[2])
        try:
            # The fast path, inline (it is the server's throughput): the common query shape,
            # whose question is in the cache. Anything else goes to `_handle`.
            size = len(wire)
            if (
                12 < size <= MAX_QUERY
                and wire[2] & 0xFA == 0
                and wire[4:11] == b"\x00\x01\x00\x00\x00\x00\x00"
                and wire[11] <= 1
            ):
                end = _walk_question(wire, 12)
                if end > 0:
                    qend = end + 4
                    edns = wire[11]
                    if (not edns and qend == size) or (
                        edns
                        and size >= qend + 11
                        and wire[qend : qend + 3] == b"\x00\x00\x29"
                        and wire[qend + 6] == 0
                        and qend + 11 + (wire[qend + 9] << 8 | wire[qend + 10]) == size
                    ):
                        key = wire[12:end].lower() + wire[end:qend]
                        entry = self._cache.get(key)
                        if entry is not None and entry.expiry > now:
                            self._cache.move_to_end(key)
                            if entry.ancount:
                                ttl = int(entry.expiry - now)
                                # int(expiry - now) stays `ttl` until now passes expiry - ttl.
                                until = entry.expiry - ttl
                            else:
                                ttl = 0
                                until = min(entry.expiry, now + 1.0)
                            out = b"".join(
                                (
                                    entry.headers[(wire[2] & 0x01) | edns << 1],
                                    wire[12:qend],
                                    entry.tail_for(ttl),
                                    _OPT_RECORD if edns else b"",
                                )
                            )
                            answers = self._hot
                            if len(answers) >= self.limits.cache_entries:
                                answers.clear()
                            answers[wire[2:]] = (until, out, entry.journal)
                            return Decision(Verdict.ANSWER, wire[0:2] + out, None, entry.journal)
            return self._handle(wire, now)
        except Exception as exc:  # a bug here must cost one query, never the server
            return Decision(
                Verdict.DROP,
                journal=DnsRefusal(
                    self.crew, "", "", f"internal_error:{type(exc).__name__}", "DROP"
                ),
            )

    def resolved(self, resolution: Resolution, addresses: Sequence[str], now: float) -> Answer:
        """The answer for `resolution` from what the resolver returned (before the hook runs).

        Every address passes the SSRF guard first; refused ones are left out (journaled). The
        answer holds the asked family's addresses; `Answer.addresses` holds both families', all
        that `remember` will let the cache give out, so the hook sees every one of them.
        """
        allowed: list[str] = []
        refused: list[str] = []
        for address in dict.fromkeys(addresses):
            (allowed if self.guard.check(address).allowed else refused).append(address)
        v4 = [a for a in allowed if ":" not in a][:MAX_ADDRESSES]
        v6 = [a for a in allowed if ":" in a][:MAX_ADDRESSES]
        journal = None
        if refused:
            journal = DnsRefusal(
                self.crew,
                resolution.name,
                _qtype_text(resolution.qtype),
                "address_refused",
                "NOERROR",
                count=len(refused),
            )
        asked = v4 if resolution.qtype == _A else v6
        records = _records(asked, resolution.qtype)
        ttl = self.limits.ttl
        wire = self._build(resolution, _NOERROR, records, ttl)
        return Answer(wire, (*v4, *v6), ttl, resolution, journal)

    def remember(self, answer: Answer, now: float) -> None:
        """Cache `answer` (both families) once the hook has taken its addresses."""
        resolution = answer.resolution
        expiry = now + answer.ttl
        v4 = [a for a in answer.addresses if ":" not in a]
        v6 = [a for a in answer.addresses if ":" in a]
        base = resolution.key[:-4]
        self._store(base + struct.pack(">HH", _A, _IN), _Entry(_NOERROR, _records(v4, _A), expiry))
        self._store(
            base + struct.pack(">HH", _AAAA, _IN), _Entry(_NOERROR, _records(v6, _AAAA), expiry)
        )

    def failed(
        self, resolution: Resolution, now: float, why: str = "resolution_failed"
    ) -> Decision:
        """SERVFAIL for `resolution`, remembered `fail_ttl` seconds (RFC 9520: a failure is
        cached, so that a crew repeating a name that does not resolve does not repeat the work)."""
        journal = DnsRefusal(
            self.crew, resolution.name, _qtype_text(resolution.qtype), why, "SERVFAIL"
        )
        self._store(resolution.key, _Entry(_SERVFAIL, (), now + self.limits.fail_ttl, journal))
        return Decision(Verdict.ANSWER, self._build(resolution, _SERVFAIL, (), 0), journal=journal)

    def name_for(self, address: str) -> str | None:
        """The name a synthetic address was given out for (None if not ours or forgotten)."""
        return None if self.synthetic is None else self.synthetic.name_for(address)

    # -- inside ----------------------------------------------------------------------------

    def _rate_limited(self, now: float) -> Decision:
        self._dropped += 1
        if now - self._dropped_reported_at < 1.0:
            return _DROP
        count, self._dropped, self._dropped_reported_at = self._dropped, 0, now
        return Decision(
            Verdict.DROP,
            journal=DnsRefusal(self.crew, "", "", "rate_limited_queries", "DROP", count=count),
        )

    def _handle(self, wire: bytes, now: float) -> Decision:
        size = len(wire)
        if size < 12 or size > MAX_QUERY or wire[2] & 0x80:
            # No header to answer, a message too long to be a query, or a response (answering
            # responses is how two servers get to bounce packets off each other forever).
            return _DROP
        end = _walk_question(wire, 12)
        if end > 0 and end + 4 <= size:
            key = wire[12:end].lower() + wire[end : end + 4]
            entry = self._cache.get(key)
            if entry is not None and entry.expiry <= now:
                del self._cache[key]
        return self._slow(wire, now)

    def _slow(self, wire: bytes, now: float) -> Decision:
        query_id = wire[0] << 8 | wire[1]
        rd = wire[2] & 0x01
        try:
            message = dns.message.from_wire(wire)
        except Exception:  # dnspython on hostile bytes: any failure is a malformed query
            return self._bare(wire, _FORMERR, "malformed_query")
        opcode = message.opcode()
        if opcode != dns.opcode.QUERY:
            return self._bare(wire, _NOTIMP, "opcode")
        if (
            len(message.question) != 1
            or message.answer
            or message.authority
            or message.additional
            or message.tsig is not None
            or message.flags & dns.flags.TC
        ):
            return self._bare(wire, _FORMERR, "malformed_query")
        end = _walk_question(wire, 12)
        if end < 0 or end + 4 > len(wire):
            return self._bare(wire, _FORMERR, "malformed_query")
        question_wire = wire[12 : end + 4]
        rrset = message.question[0]
        qtype = int(rrset.rdtype)
        edns = message.edns >= 0
        shown = _printable(rrset.name.to_text(omit_final_dot=True))
        qtext = dns.rdatatype.to_text(rrset.rdtype)
        resolution = Resolution(
            name="",
            qtype=qtype,
            query_id=query_id,
            rd=rd,
            question=question_wire,
            key=wire[12:end].lower() + wire[end : end + 4],
            edns=edns,
        )
        if message.edns > 0:
            # RFC 6891 §6.1.3: BADVERS is an extended rcode, carried in our OPT record.
            return self._refuse(resolution, _BADVERS, shown, qtext, "edns_version")
        if rrset.rdclass != dns.rdataclass.IN:
            return self._refuse(resolution, _REFUSED, shown, qtext, "class", cache=True)
        if qtype not in (_A, _AAAA, _HTTPS, _SVCB):
            return self._refuse(resolution, _REFUSED, shown, qtext, "qtype", cache=True)
        try:
            name = normalize_host(rrset.name.to_text(omit_final_dot=True))
        except PolicyDenied:
            return self._refuse(resolution, _NXDOMAIN, shown, qtext, "malformed_host", cache=True)
        if is_ip_literal(name):
            return self._refuse(resolution, _NXDOMAIN, shown, qtext, "ip_literal", cache=True)
        decision = self.policy.decide(name, _POLICY_PORT)
        if not decision.allowed:
            return self._refuse(resolution, _NXDOMAIN, shown, qtext, decision.rule, cache=True)
        if self.policy.mode is NetworkMode.FREE and name not in self.policy.allowlist:
            rule = label_refusal(name)
            if rule is not None:
                return self._refuse(resolution, _REFUSED, shown, qtext, rule, cache=True)
        if qtype in (_HTTPS, _SVCB):
            self._store(resolution.key, _Entry(_NOERROR, (), now + self.limits.ttl))
            return Decision(Verdict.ANSWER, self._build(resolution, _NOERROR, (), 0))
        resolution = Resolution(name, qtype, query_id, rd, question_wire, resolution.key, edns)
        if self.synthetic is not None:
            return self._synthetic(resolution, now)
        if not self._names.take(now):
            return self._refuse(resolution, _REFUSED, name, qtext, "rate_limited_names")
        return Decision(Verdict.RESOLVE, resolution=resolution)

    def _synthetic(self, resolution: Resolution, now: float) -> Decision:
        assert self.synthetic is not None
        qtext = _qtype_text(resolution.qtype)
        if resolution.qtype != _A:
            # The synthetic range is IPv4: AAAA gets NODATA and the client uses A.
            self._store(resolution.key, _Entry(_NOERROR, (), now + self.limits.ttl))
            return Decision(Verdict.ANSWER, self._build(resolution, _NOERROR, (), 0))
        ttl = self.limits.ttl
        address = self.synthetic.address_for(resolution.name, now, ttl)
        if address is None:
            journal = DnsRefusal(
                self.crew, resolution.name, qtext, "synthetic_table_full", "SERVFAIL"
            )
            return Decision(
                Verdict.ANSWER, self._build(resolution, _SERVFAIL, (), 0), journal=journal
            )
        records = _records([address], _A)
        self._store(resolution.key, _Entry(_NOERROR, records, now + ttl))
        return Decision(Verdict.ANSWER, self._build(resolution, _NOERROR, records, ttl))

    def _store(self, key: bytes, entry: _Entry) -> None:
        cache = self._cache
        cache[key] = entry
        cache.move_to_end(key)
        while len(cache) > self.limits.cache_entries:
            cache.popitem(last=False)

    def _refuse(
        self,
        resolution: Resolution,
        rcode: int,
        shown: str,
        qtext: str,
        rule: str,
        *,
        cache: bool = False,
    ) -> Decision:
        journal = DnsRefusal(self.crew, shown, qtext, rule, _rcode_text(rcode))
        if cache:
            # A refusal that depends only on the question and the policy is the same until the
            # allowlist changes (then the cache is cleared); remembering it spares a repeat
            # (a flood of TXT, say) the dnspython parse. Not given to the
            # client as cacheable: no SOA, so it asks again and we journal again.
            self._store(resolution.key, _Entry(rcode, (), math.inf, journal))
        return Decision(Verdict.ANSWER, self._build(resolution, rcode, (), 0), journal=journal)

    def _build(
        self, resolution: Resolution, rcode: int, records: Sequence[tuple[bytes, bytes]], ttl: int
    ) -> bytes:
        packed = struct.pack(">I", ttl)
        edns = resolution.edns
        out = (
            _HEADER.pack(
                resolution.query_id,
                0x80 | resolution.rd,
                0x80 | (rcode & 0x0F),
                1,
                len(records),
                0,
                1 if edns else 0,
            )
            + resolution.question
            + b"".join(head + packed + rdata for head, rdata in records)
        )
        if edns:
            out += (
                b"\x00\x00\x29" + struct.pack(">HBBH", EDNS_PAYLOAD, rcode >> 4, 0, 0) + b"\x00\x00"
            )
        return out

    def _bare(self, wire: bytes, rcode: int, rule: str) -> Decision:
        # An answer without the question: the query could not be read far enough to echo it.
        out = wire[0:2] + bytes((0x80 | (wire[2] & 0x79), 0x80 | rcode)) + b"\x00" * 8
        journal = DnsRefusal(self.crew, "", "", rule, _rcode_text(rcode))
        return Decision(Verdict.ANSWER, out, journal=journal)


def _rcode_text(rcode: int) -> str:
    return {
        _NOERROR: "NOERROR",
        _FORMERR: "FORMERR",
        _SERVFAIL: "SERVFAIL",
        _NXDOMAIN: "NXDOMAIN",
        _NOTIMP: "NOTIMP",
        _REFUSED: "REFUSED",
        _BADVERS: "BADVERS",
    }.get(rcode, str(rcode))


def _qtype_text(qtype: int) -> str:
    return dns.rdatatype.to_text(dns.rdatatype.RdataType.make(qtype))
