"""Address rules (`--net allow:tcp:10.9.0.0/24:5432`): one spelling, refusals that name what is
wrong, the kernel's reading agreeing with the proxy's, the disjoint set elements, the proxy's
decision (deny wins; an allow rule opens the address for that crew), the daemon's validation,
its state migration and journal entry, and a 403 from a running proxy.

The kernel half with real packets is tests/test_netns_netrules.py.
"""

from __future__ import annotations

import ipaddress
import json
import random
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from appliance.ctl.main import build_parser
from appliance.daemon import messages
from appliance.daemon.state import SCHEMA_VERSION, CrewPhase, CrewRow, StateStore
from appliance.journal.entries import CrewCreated
from appliance.journal.recorder import crew_created
from netns.errors import NetnsError
from netns.netrules import elements, parse_rule, parse_rules
from proxycore.errors import PolicyDenied
from proxycore.io.dns import Resolver
from proxycore.io.upstream import CrewReach, Dialer
from proxycore.protocol.netrules import NetRules, parse_net_rule, parse_net_rules
from proxycore.protocol.policy import Allowlist, CrewPolicy, NetworkMode
from proxycore.protocol.ssrf import _METADATA, AddressGuard
from tests.test_crew_rules import _manager

# -- the one spelling --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("typed", "spec"),
    [
        ("allow:tcp:10.9.0.0/24:5432", "allow:tcp:10.9.0.0/24:5432"),
        ("allow:udp:10.9.0.53:53", "allow:udp:10.9.0.53/32:53"),  # a bare address is a /32
        ("deny:tcp:10.9.0.66/32:1-65535", "deny:tcp:10.9.0.66/32:*"),
        ("deny:tcp:0.0.0.0/0:*", "deny:tcp:0.0.0.0/0:*"),  # deny has no breadth limit
        ("allow:tcp:192.168.1.0/24:8000-8100", "allow:tcp:192.168.1.0/24:8000-8100"),
        ("allow:tcp:192.168.1.0/24:53-53", "allow:tcp:192.168.1.0/24:53"),
        ("allow:tcp:169.254.169.254/32:80", "allow:tcp:169.254.169.254/32:80"),
    ],
)
def test_rules_have_one_spelling_read_alike_by_proxy_and_kernel(typed: str, spec: str) -> None:
    rule = parse_net_rule(typed)
    assert rule.spec == spec
    assert parse_net_rule(spec) == rule
    # The kernel's reader takes exactly that spelling, and gives it back.
    assert parse_rule(spec).spec == spec


@pytest.mark.parametrize(
    ("typed", "why"),
    [
        ("allow:tcp:10.9.0.0/24", "write allow|deny"),
        ("permit:tcp:10.9.0.0/24:80", "action 'permit'"),
        ("allow:icmp:10.9.0.0/24:80", "protocol 'icmp'"),
        ("allow:TCP:10.9.0.0/24:80", "protocol 'TCP'"),
        ("allow:tcp:10.9.0.1/24:80", "host bits set"),
        ("allow:tcp:fd00::/64:80", "IPv6"),
        ("allow:tcp:10.9.0.0/24:0", "not in 1-65535"),
        ("allow:tcp:10.9.0.0/24:65536", "not in 1-65535"),
        ("allow:tcp:10.9.0.0/24:+80", "not a number"),
        ("allow:tcp:10.9.0.0/24:90-80", "backwards"),
        ("allow:tcp: 10.9.0.0/24:80", "not an IPv4 network"),
        ("allow:tcp:0.0.0.0/0:443", "broader than /8"),
        ("allow:tcp:127.0.0.0/8:80", "never a destination"),
        ("allow:udp:224.0.0.0/24:5353", "never a destination"),
        ("allow:tcp:169.254.0.0/16:80", "metadata address 169.254.169.254"),
        ("allow:tcp:100.100.0.0/16:80", "metadata address 100.100.100.200"),
    ],
)
def test_bad_rules_are_refused_saying_why(typed: str, why: str) -> None:
    with pytest.raises(ValueError, match="") as caught:
        parse_net_rule(typed)
    assert why in str(caught.value) and repr(typed) in str(caught.value)


def test_the_kernel_refuses_any_other_spelling_and_rules_into_the_pool() -> None:
    for other in ("allow:udp:10.9.0.53:53", "deny:tcp:10.9.0.66/32:1-65535", "allow:tcp:x:1"):
        with pytest.raises(NetnsError):
            parse_rule(other)
    pool = ipaddress.IPv4Network("100.127.0.0/16")
    with pytest.raises(NetnsError, match="pool"):
        parse_rules(["allow:tcp:100.127.4.0/24:80"], pool)
    # A deny rule over the pool is harmless (the pool is dropped anyway).
    assert parse_rules(["deny:tcp:100.127.4.0/24:80"], pool)


def test_the_metadata_addresses_are_the_ssrf_guards() -> None:
    from proxycore.protocol import netrules

    v4 = {a for a in _METADATA if a.version == 4}
    assert set(netrules._METADATA) == v4


def test_several_rules_are_deduplicated_and_capped() -> None:
    rules = parse_net_rules(["allow:udp:10.9.0.53:53", "allow:udp:10.9.0.53/32:53"])
    assert [rule.spec for rule in rules] == ["allow:udp:10.9.0.53/32:53"]
    with pytest.raises(ValueError, match=r"\[1\]"):
        parse_net_rules(["allow:udp:10.9.0.53:53", "bad"])
    with pytest.raises(ValueError, match="over 64"):
        parse_net_rules([f"deny:tcp:10.9.0.{i}/32:*" for i in range(65)])


# -- the kernel's elements ------------------------------------------------------------------------


def test_elements_are_disjoint_and_cover_exactly_the_rules() -> None:
    """Random overlapping rules: the boxes never overlap (the kernel refuses overlapping
    elements) and a point is in a box exactly when some rule covers it."""
    pool = ipaddress.IPv4Network("100.127.0.0/16")
    rng = random.Random(7)
    for _ in range(200):
        specs = []
        for _ in range(rng.randrange(1, 8)):
            length = rng.choice([22, 24, 26, 30, 32])
            base = ipaddress.IPv4Address(0x0A090000 + rng.randrange(0, 1 << 11))
            network = ipaddress.IPv4Network(f"{base}/{length}", strict=False)
            low = rng.choice([1, 50, 80, 100])
            high = rng.choice([low, low + 20, 65535])
            specs.append(
                parse_net_rule(f"allow:{rng.choice(['tcp', 'udp'])}:{network}:{low}-{high}")
            )
        rules = parse_rules([rule.spec for rule in specs], pool)
        boxes = elements(rules, "allow")
        assert list(boxes) == sorted(boxes)
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                overlap = (
                    a.protocol == b.protocol
                    and a.first <= b.last
                    and b.first <= a.last
                    and a.low <= b.high
                    and b.low <= a.high
                )
                assert not overlap, (a, b)
        for _ in range(200):
            address = 0x0A090000 + rng.randrange(0, 1 << 12)
            port = rng.choice([1, 49, 50, 70, 80, 99, 100, 120, 121, 65535])
            protocol = rng.choice(["tcp", "udp"])
            covered = any(
                r.protocol == protocol
                and int(r.network.network_address) <= address <= int(r.network.broadcast_address)
                and r.low <= port <= r.high
                for r in rules
            )
            inside = any(
                b.protocol == protocol and b.first <= address <= b.last and b.low <= port <= b.high
                for b in boxes
            )
            assert covered == inside
        # Order does not matter: reconcile compares these with the kernel's.
        assert elements(tuple(reversed(rules)), "allow") == boxes


# -- the proxy's decision -------------------------------------------------------------------------


def _dialer() -> Dialer:
    return Dialer(
        AddressGuard(),
        Resolver({}, ("127.0.0.1",), timeout=1),  # never asked: check() takes addresses
        None,  # type: ignore[arg-type]
        appliance_ranges=("100.127.0.0/16",),
        connect_timeout=1,
        max_open_per_crew=1,
        max_idle_per_crew=1,
        idle_timeout=1,
    )


def _reach(*specs: str, ranges: tuple[str, ...] = ()) -> CrewReach:
    return CrewReach(AddressGuard(ranges) if ranges else None, NetRules(parse_net_rules(specs)))


def test_deny_wins_over_allow_rules_ssrf_allow_and_global_addresses() -> None:
    dialer = _dialer()
    reach = _reach(
        "allow:tcp:10.9.0.0/24:5432",
        "deny:tcp:10.9.0.66/32:*",
        "deny:tcp:1.1.1.0/24:443",
        ranges=("10.9.0.0/24",),
    )
    dialer.check("db.lan", ["10.9.0.5"], reach, 5432)  # allowed by the rule
    for address, port in (("10.9.0.66", 5432), ("1.1.1.1", 443)):
        with pytest.raises(PolicyDenied) as caught:
            dialer.check("x.test", [address], reach, port)
        assert caught.value.rule == "net_deny"
        assert "deny:tcp:" in str(caught.value) and f"{address}:{port}" in str(caught.value)
    # One denied answer among several refuses the name (as the SSRF guard does).
    with pytest.raises(PolicyDenied, match=r"refuses"):
        dialer.check("x.test", ["10.9.0.5", "10.9.0.66"], reach, 5432)
    dialer.check("x.test", ["1.1.1.1"], reach, 80)  # another port: global, allowed


def test_an_allow_rule_opens_its_range_and_port_only_and_never_the_pool() -> None:
    dialer = _dialer()
    reach = _reach("allow:tcp:10.9.0.0/24:5432")
    dialer.check("db.lan", ["10.9.0.5"], reach, 5432)
    with pytest.raises(PolicyDenied) as caught:
        dialer.check("db.lan", ["10.9.0.5"], reach, 22)
    assert caught.value.rule == "ssrf_private"
    with pytest.raises(PolicyDenied) as caught:
        dialer.check("db.lan", ["10.9.0.5"], None, 5432)  # another crew: no rule
    assert caught.value.rule == "ssrf_private"
    # A UDP rule opens nothing in the proxy (it speaks TCP).
    with pytest.raises(PolicyDenied):
        dialer.check("dns.lan", ["10.9.0.53"], _reach("allow:udp:10.9.0.53/32:53"), 53)
    # The pool stays closed even if a rule named it (the daemon refuses such a rule).
    forged = CrewReach(None, NetRules([parse_net_rule("allow:tcp:100.127.0.0/16:*")]))
    with pytest.raises(PolicyDenied) as caught:
        dialer.check("x", ["100.127.0.1"], forged, 9119)
    assert caught.value.rule == "ssrf_appliance"


def test_an_ip_literal_in_an_allow_rule_passes_the_allowlist_a_name_does_not() -> None:
    rules = NetRules(parse_net_rules(["allow:tcp:10.9.0.0/24:5432", "deny:tcp:10.9.0.66/32:*"]))
    policy = CrewPolicy("c", NetworkMode.RESTRICTED, Allowlist([]), net=rules)
    decision = policy.decide("10.9.0.5", 5432)
    assert decision.allowed and decision.rule == "net_allow"
    assert not policy.decide("10.9.0.5", 22).allowed
    assert not policy.decide("db.lan", 5432).allowed  # a name still needs the allowlist
    assert not policy.decide("10.9.0.66", 5432).allowed  # the allow rule does not cover it
    none = CrewPolicy("c", NetworkMode.NONE, Allowlist([]), net=rules)
    assert not none.decide("10.9.0.5", 5432).allowed  # mode none stays none


# -- the daemon, the CLI, the state and the journal ---------------------------------------------


def test_applianced_normalizes_rules_and_names_the_argument(tmp_path: Path) -> None:
    manager = _manager(tmp_path)

    def validate(*net: str) -> CrewRow:
        return trio.run(manager.validate, messages.CreateCrew(name="c1", net=net))

    row = validate("allow:udp:10.9.0.53:53", "allow:udp:10.9.0.53/32:53", "deny:tcp:0.0.0.0/0:*")
    assert row.net == ("allow:udp:10.9.0.53/32:53", "deny:tcp:0.0.0.0/0:*")
    with pytest.raises(Exception, match=r"argument net\[1\]: .*protocol 'icmp'"):
        validate("allow:udp:10.9.0.53:53", "allow:icmp:10.9.0.0/24:1")
    # The default pool (100.127.0.0/16): no crew reaches another.
    with pytest.raises(Exception, match=r"argument net\[0\]: .*pool"):
        validate("allow:tcp:100.127.0.0/24:80")


def test_the_cli_sends_the_rules_as_typed() -> None:
    args = build_parser().parse_args(
        [
            "crew",
            "create",
            "c1",
            "--net",
            "allow:tcp:10.9.0.0/24:5432",
            "--net",
            "deny:udp:10.9.0.1:*",
        ]
    )
    assert args.net == ["allow:tcp:10.9.0.0/24:5432", "deny:udp:10.9.0.1:*"]
    help_text = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "crew", "create", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--net" in help_text and "deny wins" in help_text


def test_a_state_from_before_address_rules_migrates(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    store.insert(
        CrewRow(
            name="a",
            mode="restricted",
            allow=(),
            runtime="runc",
            memory_bytes=1,
            cpus=1.0,
            phase=CrewPhase.READY,
            created=0.0,
            updated=0.0,
            net=("deny:tcp:0.0.0.0/0:*",),
        )
    )
    assert store.crews()[0].net == ("deny:tcp:0.0.0.0/0:*",)
    store.close()
    # Make it a version 5 state: no column, version 5.
    db = sqlite3.connect(tmp_path / "applianced.db")
    db.execute("ALTER TABLE crews DROP COLUMN net")
    db.execute("UPDATE meta SET value='5' WHERE key='schema_version'")
    db.commit()
    db.close()
    store = StateStore(tmp_path)
    try:
        assert store.crews()[0].net == ()
    finally:
        store.close()
    db = sqlite3.connect(tmp_path / "applianced.db")
    version = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
    db.close()
    assert version == str(SCHEMA_VERSION) == "6"


def test_the_journal_entry_carries_the_rules() -> None:
    row = CrewRow(
        name="a",
        mode="restricted",
        allow=("x.test",),
        runtime="runc",
        memory_bytes=1,
        cpus=1.0,
        phase=CrewPhase.CREATING,
        created=0.0,
        updated=0.0,
        net=("allow:tcp:10.9.0.0/24:5432",),
    )
    entry = crew_created(row)
    assert entry.net == ("allow:tcp:10.9.0.0/24:5432",)
    assert "net allow:tcp:10.9.0.0/24:5432" in entry.summary()
    # An entry of an older applianced (no field) reads as none.
    import msgspec

    old = {"type": "crew.created", "crew": "a", "mode": "m", "allow": [], "runtime": "r"}
    decoded = msgspec.json.decode(json.dumps(old), type=CrewCreated, strict=False)
    assert decoded.net == ()


# -- a running proxy --------------------------------------------------------------------------


def test_a_running_proxy_refuses_a_denied_address_with_a_readable_403(
    make_proxy, plain_host
) -> None:  # type: ignore[no-untyped-def]
    """plain.test resolves to 127.0.0.1, allowlisted and opened by `ssrf_allow`: the deny rule
    refuses it all the same, for requests and CONNECT alike, and names itself."""
    import socket

    from appliance.ctl.proxy import _control_request
    from proxycore import control
    from proxycore.protocol.events import RequestDenied

    port = plain_host.port
    plain_host.clear()
    deny = f"deny:tcp:127.0.0.1/32:{port}"
    proxy = make_proxy(allow=["plain.test"], net=[deny], with_control=True)

    def fetch() -> tuple[str, str]:
        done = subprocess.run(
            [
                *("curl", "-sS", "--noproxy", "", "--max-time", "10", "-x", proxy.url),
                *("-w", "\n%{http_code}", f"http://plain.test:{port}/"),
            ],
            capture_output=True,
            text=True,
            timeout=15,
        )
        body, status = done.stdout.rsplit("\n", 1)
        return body, status

    body, status = fetch()
    assert status == "403", body
    refusal = json.loads(body)
    assert refusal["rule"] == "net_deny" and refusal["host"] == "plain.test"
    assert f"deny:tcp:127.0.0.1/32:{port}" in refusal["message"]
    with socket.create_connection((proxy.host, proxy.port), timeout=10) as sock:
        sock.sendall(b"CONNECT plain.test:%d HTTP/1.1\r\nHost: plain.test\r\n\r\n" % port)
        assert sock.recv(4096).startswith(b"HTTP/1.1 403")
    denied = [e for e in proxy.events() if isinstance(e, RequestDenied)]
    assert [e.rule for e in denied] == ["net_deny", "net_deny"]
    assert not plain_host.received  # nothing reached the upstream

    # Replaced at run time (applianced's `crew net`): no rule, then the deny rule again.
    socket_path = str(proxy.control_socket)
    reply = _control_request(socket_path, control.CrewNet(crew="test", net=()))
    assert reply.ok and reply.changed
    assert fetch()[1] == "200" and plain_host.received
    reply = _control_request(socket_path, control.CrewNet(crew="test", net=(deny,)))
    assert reply.ok and reply.changed
    assert fetch()[1] == "403"
    with pytest.raises(Exception, match=r"net\[0\]: 'allow:x'"):
        _control_request(socket_path, control.CrewNet(crew="test", net=("allow:x",)))


def test_doctor_says_what_forwarded_rules_need_without_failing_the_host() -> None:
    from appliance.daemon.config import parse_config
    from appliance.daemon.doctor import _forwarding

    check = _forwarding(parse_config(b""))
    assert check.name == "forwarding" and not check.required
    if not check.ok:
        assert "DOCKER-USER -i apx+ -j ACCEPT" in check.hint or "ip_forward=1" in check.hint
