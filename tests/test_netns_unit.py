"""The parts of netns that need no kernel: configuration, address plan, state file, table layout,
and the dependency direction of the package. Runs without root."""

from __future__ import annotations

import ast
import ipaddress
import json
import os
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("pyroute2")

from netns import NetConfig, NetConfigError, PoolExhaustedError, StateError, validate_config
from netns.addressing import (
    HostUse,
    check_crew_id,
    first_free_index,
    interface_name,
    parse_pool,
    plan_for,
    pool_conflicts,
)
from netns.nft import Layout, base_differences, parse_table
from netns.state import CrewRecord, NetnsIdentity, NetState, Phase, StateStore

ROOT = Path(__file__).resolve().parent.parent


# --- configuration --------------------------------------------------------------------------------


def test_defaults_are_valid_and_inside_the_shared_address_space() -> None:
    config = validate_config(NetConfig())
    assert config.proxy_ports == (9119,)
    pool = ipaddress.ip_network(config.pool)
    assert pool.prefixlen == 16 and pool.subnet_of(ipaddress.ip_network("100.64.0.0/10"))


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"pool": "2001:db8::/64"}, "pool"),
        ({"pool": "100.64.0.1/16"}, "pool"),  # host bits set
        ({"pool": "100.64.0.0/30"}, "pool"),  # room for one crew only
        ({"pool": "nonsense"}, "pool"),
        ({"proxy_ports": ()}, "proxy_ports"),
        ({"proxy_ports": (9119, 9119)}, "proxy_ports"),
        ({"table": "bad-name"}, "table"),
        ({"table": "1table"}, "table"),
        ({"ifname_prefix": "a"}, "ifname_prefix"),
        ({"ifname_prefix": "toolong7"}, "ifname_prefix"),
        ({"ifname_prefix": "Apx"}, "ifname_prefix"),
        ({"inner_ifname": "a/b"}, "inner_ifname"),
        ({"inner_ifname": "sixteen-chars-xx"}, "inner_ifname"),
        ({"priority": 0}, "priority"),  # after DNAT: a rewritten destination would be judged
        ({"priority": -250}, "priority"),  # before conntrack: no ct state
    ],
)
def test_invalid_config_names_the_key(change: dict[str, object], key: str) -> None:
    with pytest.raises(NetConfigError, match=f"`{key}`"):
        validate_config(NetConfig(**change))  # type: ignore[arg-type]


def test_config_decodes_strictly() -> None:
    with pytest.raises(msgspec.ValidationError, match="proxy_prots"):
        msgspec.json.decode(b'{"proxy_prots": [1]}', type=NetConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"proxy_ports": [70000]}', type=NetConfig)


# --- address plan ---------------------------------------------------------------------------------


def test_interface_names_are_deterministic_length_safe_and_distinct() -> None:
    names = {interface_name("apx", f"crew-{i}") for i in range(5000)}
    assert len(names) == 5000
    assert all(len(name) == 15 and name.startswith("apx") for name in names)
    assert interface_name("apx", "alpha") == interface_name("apx", "alpha")
    assert len(interface_name("abcdef", "x" * 63)) == 15


@pytest.mark.parametrize("crew", ["a", "crew-1", "Crew_2.x", "x" * 63])
def test_crew_ids_accepted(crew: str) -> None:
    assert check_crew_id(crew) == crew


@pytest.mark.parametrize("crew", ["", "-a", "a b", "a/b", 'a"b', "x" * 64, "é"])
def test_crew_ids_refused(crew: str) -> None:
    with pytest.raises(NetConfigError):
        check_crew_id(crew)


def test_plan_cuts_the_pool_into_30s_gateway_first() -> None:
    pool = parse_pool("100.127.0.0/16")
    plan = plan_for(pool, "apx", "alpha", 0)
    assert (plan.subnet, plan.gateway, plan.address) == (
        "100.127.0.0/30",
        "100.127.0.1",
        "100.127.0.2",
    )
    last = plan_for(pool, "apx", "omega", 16383)
    assert (last.subnet, last.gateway, last.address) == (
        "100.127.255.252/30",
        "100.127.255.253",
        "100.127.255.254",
    )
    assert plan.chain == f"crew_{plan.ifname}"
    with pytest.raises(PoolExhaustedError):
        plan_for(pool, "apx", "x", 16384)


def test_first_free_index_skips_allocated_and_host_used_subnets() -> None:
    pool = parse_pool("100.127.0.0/28")  # four /30s
    used_by_host = {ipaddress.IPv4Network("100.127.0.4/30")}
    assert first_free_index(pool, [0], lambda subnet: subnet in used_by_host) == 2
    assert first_free_index(pool, [], lambda subnet: False) == 0
    with pytest.raises(PoolExhaustedError):
        first_free_index(pool, [0, 2, 3], lambda subnet: subnet in used_by_host)


def test_pool_conflicts_ignore_default_routes_and_other_ranges() -> None:
    pool = parse_pool("100.127.0.0/16")
    uses = [
        HostUse("0.0.0.0/0", "default route"),
        HostUse("192.0.2.0/24", "route elsewhere"),
        HostUse("100.64.0.0/10", "route 100.64.0.0/10 dev tailscale0 table 52"),
        HostUse("100.127.3.7/24", "address 100.127.3.7/24 on eth1"),
        HostUse("100.126.0.0/16", "route next door"),
    ]
    assert pool_conflicts(pool, uses) == (
        "route 100.64.0.0/10 dev tailscale0 table 52",
        "address 100.127.3.7/24 on eth1",
    )


# --- state file -----------------------------------------------------------------------------------


def test_state_round_trips_atomically(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    try:
        assert store.load("100.127.0.0/16") == NetState(pool="100.127.0.0/16")
        record = CrewRecord("alpha", 3, Phase.READY, NetnsIdentity("/proc/1/ns/net", 4, 5))
        state = NetState(pool="100.127.0.0/16").with_record(record)
        store.save(state)
        assert store.load("100.127.0.0/16") == state
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "netns-state.json",
            "netns-state.lock",
        ]  # no temporary file left behind
        assert oct(os.stat(tmp_path / "netns-state.json").st_mode & 0o777) == "0o600"
        with pytest.raises(StateError, match="pool"):
            store.load("100.126.0.0/16")  # renumbering would change crews' identities
        (tmp_path / "netns-state.json").write_text("{not json")
        with pytest.raises(StateError, match="not a valid state file"):
            store.load("100.127.0.0/16")
    finally:
        store.close()


def test_state_lock_is_exclusive(tmp_path: Path) -> None:
    first = StateStore(tmp_path)
    try:
        with pytest.raises(StateError, match="in use"):
            StateStore(tmp_path)
    finally:
        first.close()
    StateStore(tmp_path).close()


def test_state_updates_are_functional() -> None:
    state = NetState(pool="p")
    a = CrewRecord("a", 0, Phase.CREATING)
    state2 = state.with_record(a).with_record(CrewRecord("a", 0, Phase.READY))
    assert state.crews == () and [r.phase for r in state2.crews] == [Phase.READY]
    assert state2.without("a").crews == ()


# --- table layout ---------------------------------------------------------------------------------


def layout(**overrides: object) -> Layout:
    values: dict[str, object] = {
        "table": "t",
        "priority": -150,
        "ifname_prefix": "apx",
        "proxy_ports": (9119,),
        "pool": "100.127.0.0/16",
    }
    values.update(overrides)
    return Layout(**values)  # type: ignore[arg-type]


def test_install_batch_is_self_sufficient_and_orders_chain_before_element() -> None:
    plan = plan_for(parse_pool("100.127.0.0/16"), "apx", "alpha", 0)
    batch = layout().install_crew(plan)
    kinds = [(verb, next(iter(body))) for command in batch for verb, body in command.items()]
    assert kinds[:2] == [("add", "table"), ("add", "map")]
    # The hooked chains are (re)written in the same batch as the crew's chain.
    assert ("add", "chain") in kinds[:8] and ("flush", "chain") in kinds
    assert kinds[-1] == ("add", "element")
    text = json.dumps(batch)
    assert '"hook": "prerouting"' in text and '"hook": "forward"' in text
    assert '"apx*"' in text  # the catch-all for crew interfaces without a chain
    assert plan.gateway in text and plan.address in text


def test_rule_comments_fingerprint_the_rule() -> None:
    plan = plan_for(parse_pool("100.127.0.0/16"), "apx", "alpha", 0)
    one = [rule.comment for rule in layout().crew_rules(plan)]
    two = [rule.comment for rule in layout(proxy_ports=(9119, 9120)).crew_rules(plan)]
    assert [c.split()[0] for c in one] == ["allow", "to-pool", "net-deny", "net-allow", "drop"]
    assert one[0] != two[0] and one[1:] == two[1:]  # a port change is seen by reconciliation
    logged = [rule.role for rule in layout(log_drops=True).crew_rules(plan)]
    assert logged == ["allow", "to-pool", "net-deny", "net-allow", "log", "drop"]


def test_the_pool_is_refused_to_everything_but_the_crews() -> None:
    """After the crews' verdicts (dispatch, catch-all): the refusal let back in to a client on
    the host, the host rejected, everything else dropped; all of it for this pool only."""
    lay = layout()
    rules = lay.base_rules()["prerouting"]
    assert [rule.role for rule in rules] == [
        "dispatch",
        "unmapped",
        "refusals",
        "foreign-local",
        "foreign",
    ]
    pool = {"prefix": {"addr": "100.127.0.0", "len": 16}}
    for rule in rules[2:]:
        assert {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}},
                          "right": pool}} in rule.expr  # fmt: skip
    refusals, local, foreign = rules[2:]
    assert refusals.expr[-1] == {"accept": None}
    assert local.expr[0] == {"match": {"op": "==", "left": {"meta": {"key": "iifname"}},
                                       "right": "lo"}}  # fmt: skip
    assert local.expr[-2:] == (
        {"counter": "foreign_to_pool"},
        {"reject": {"type": "icmpx", "expr": "admin-prohibited"}},
    )
    assert foreign.expr[-2:] == ({"counter": "foreign_to_pool"}, {"drop": None})
    assert foreign.comment.startswith("foreign 100.127.0.0/16 v=")
    # Another pool is another rule (reconciliation sees a changed pool).
    other = layout(pool="100.126.0.0/16").base_rules()["prerouting"]
    assert other[4].comment != foreign.comment and other[:2] == rules[:2]


def test_the_pools_that_tables_claim_are_read_back() -> None:
    from netns.nft import pool_claims

    tables = {"one": layout(table="one"), "two": layout(table="two", pool="100.90.3.0/24")}

    class Listing:
        def run(self, commands: list[dict[str, object]]) -> list[dict[str, object]]:
            assert commands == [{"list": {"ruleset": {"family": "inet"}}}]
            items: list[dict[str, object]] = [{"table": {"family": "inet", "name": "empty"}}]
            for name, lay in tables.items():
                for item in _listing(lay):
                    kind, body = next(iter(item.items()))
                    items.append({kind: {"family": "inet", "table": name, **body}})
            # A hand-made rule that happens to match the pool claims nothing.
            items.append({"rule": {"family": "inet", "table": "mine", "chain": "c",
                                   "comment": "mine", "expr": []}})  # fmt: skip
            return items

    assert pool_claims(Listing()) == {"one": {"100.127.0.0/16"}, "two": {"100.90.3.0/24"}}


def test_removal_is_idempotent_by_construction() -> None:
    commands = layout().remove_crew("apx0123456789ab")
    verbs = [next(iter(c)) for c in commands[-9:]]
    # The chain and its map element, then the crew's two sets (after the rules using them).
    assert verbs == ["add", "add", "delete", "flush", "delete", "add", "delete", "add", "delete"]


def _listing(lay: Layout, extra: list[dict[str, object]] | None = None) -> list[dict[str, object]]:
    """What `nft -j list table` returns for a table written by `lay` with no crews."""
    items: list[dict[str, object]] = [
        {"table": {"family": "inet", "name": lay.table}},
        {"map": {"family": "inet", "name": "crew_ingress", "type": "ifname", "map": "verdict"}},
        {"map": {"family": "inet", "name": "crew_capture", "type": "ifname", "map": "verdict"}},
    ]
    items += [{"counter": {"name": n, "packets": 0, "bytes": 0}} for n in ("unmapped_drops",)]
    for chain, rules in lay.base_rules().items():
        spec = lay.base_chain_spec(chain)
        items.append({"chain": {k: v for k, v in spec.items() if k != "table"}})
        items += [
            {"rule": {"chain": chain, "handle": i, "comment": r.comment, "expr": list(r.expr)}}
            for i, r in enumerate(rules)
        ]
    return items + (extra or [])


def test_base_differences_sees_tampering() -> None:
    lay = layout()
    assert base_differences(lay, parse_table(_listing(lay))) == []
    tampered = _listing(lay, [{"rule": {"chain": "prerouting", "handle": 99, "expr": []}}])
    assert any("prerouting" in d for d in base_differences(lay, parse_table(tampered)))
    foreign = _listing(lay, [{"set": {"name": "crews", "type": "ifname"}}])
    assert base_differences(lay, parse_table(foreign)) == ["unknown set crews"]
    other_priority = layout(priority=-160)
    assert any(
        "prerouting is" in d for d in base_differences(other_priority, parse_table(_listing(lay)))
    )


def test_parse_table_reads_counters_and_map_targets() -> None:
    items = [
        {"map": {"name": "crew_ingress", "type": "ifname", "map": "verdict",
                 "elem": [["apx1", {"jump": {"target": "crew_apx1"}}]]}},
        {"chain": {"name": "crew_apx1"}},
        {"rule": {"chain": "crew_apx1", "handle": 7, "comment": "drop a v=1",
                  "expr": [{"counter": {"packets": 5, "bytes": 300}}, {"drop": None}]}},
    ]  # fmt: skip
    table = parse_table(items)
    assert table.maps["crew_ingress"][2] == {"apx1": "jump crew_apx1"}
    rule = table.chains["crew_apx1"].rules[0]
    assert (rule.comment, rule.packets, rule.bytes) == ("drop a v=1", 5, 300)


# --- dependency direction -------------------------------------------------------------------------


def test_netns_imports_nothing_from_the_appliance_or_the_proxy() -> None:
    for path in (ROOT / "netns").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in {"appliance", "proxycore"}, (path, name)


# --- instances ------------------------------------------------------------------------------------


def test_instance_ids_and_the_names_they_give() -> None:
    from netns import check_instance_id, instance_tag, naming

    for good in ("a", "prod", "3f2a9c81", "x" * 16, "prod-eu-1"):
        assert check_instance_id(good) == good
    for bad in ("", "Prod", "-prod", "prod-", "pro_d", "pro.d", "x" * 17, "é"):
        with pytest.raises(NetConfigError, match="instance id"):
            check_instance_id(bad)
    tag = instance_tag("prod")
    assert len(tag) == 3 and tag.isalnum() and tag == tag.lower()
    assert instance_tag("prod") == tag and instance_tag("prod2") != tag
    named = naming("appliance", "apx", "prod")
    assert named.table == "appliance_prod" and named.ifname_prefix == f"apx{tag}"
    assert naming("appliance", "apx", None).table == "appliance"
    assert naming("appliance", "apx", "prod-eu").table == "appliance_prod_eu"
    # Every interface name still fits IFNAMSIZ, with the longest configurable prefix too.
    longest = naming("t", "abcdef", "x" * 16).ifname_prefix
    name = interface_name(longest, "crew")
    assert len(name) == 15 and name.startswith(longest)
    # The table name is one nft accepts (letters, digits, '_'), for the longest ids too.
    validate_config(NetConfig(table=naming("a" * 32, "apx", "x" * 16).table[:32]))


def test_the_claim_and_the_patterns_are_read_back() -> None:
    from netns.nft import interface_patterns, table_claim

    lay = layout(table="appliance_prod", ifname_prefix="apxk3q", claim="instance=prod owner=ab")
    assert table_claim(parse_table(_listing(lay))) == {"instance": "prod", "owner": "ab"}
    assert table_claim(parse_table(_listing(layout()))) == {}

    class Listing:
        def run(self, commands: list[dict[str, object]]) -> list[dict[str, object]]:
            assert commands == [{"list": {"ruleset": {"family": "inet"}}}]
            items: list[dict[str, object]] = [{"table": {"family": "inet", "name": "empty"}}]
            for table, wildcard in (("one", "apx*"), ("two", "tab1*")):
                items.append({"table": {"family": "inet", "name": table}})
                items.append(
                    {
                        "rule": {
                            "family": "inet",
                            "table": table,
                            "chain": "prerouting",
                            "expr": [
                                {
                                    "match": {
                                        "op": "==",
                                        "left": {"meta": {"key": "iifname"}},
                                        "right": wildcard,
                                    }
                                },
                                {"drop": None},
                            ],
                        }
                    }
                )
            return items

    assert interface_patterns(Listing()) == {"empty": set(), "one": {"apx"}, "two": {"tab1"}}


def test_a_state_file_from_before_instance_ids_is_read(tmp_path: Path) -> None:
    (tmp_path / "netns-state.json").write_text(
        json.dumps(
            {
                "pool": "100.127.0.0/16",
                "version": 1,
                "crews": [{"crew": "a", "index": 0, "phase": "ready", "netns": None}],
            }
        )
    )
    store = StateStore(tmp_path)
    try:
        state = store.load("100.127.0.0/16")
        assert state.naming is None and state.owner is None and len(state.crews) == 1
        assert state.crews[0].net == ()  # no address rules before version 3
        store.save(state)
        assert json.loads((tmp_path / "netns-state.json").read_text())["version"] == 3
    finally:
        store.close()
