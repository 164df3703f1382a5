"""Instances: what `CrewNetworks.reconcile` checks and renames before it reconciles.

Theory of operation
-------------------
An appliance with an instance id names its table and interfaces with it (`addressing.naming`), so
everything it lists and removes is its own. Two things are checked before anything is changed
(`check_claims`), each refusing the start with `InstanceConflictError`:

- no other inet table on the host matches, by an interface wildcard, names of this instance's
  prefix (its 3-character tag collides with another's, or a former appliance configured alike
  still has its table): that table's rules would judge this instance's crews;
- this instance's table, if it exists, names this appliance as its owner (the token in the
  dispatch rule's comment): another state directory given the same id would take it over.

And, with or without an instance id, no other appliance's table claims a pool that overlaps
this one's (`check_pool_claims`, `PoolConflictError`): each table refuses its whole pool to all
but its own crews' interfaces, so the crews of one in the other's pool would be refused by it.
Its links would show the overlap too (`CrewNetworks.check_pool`), but an appliance with no crew
has none; its table says so from its first start.

State made under other names (before instance ids, or with another table or prefix) is taken
off them (`rename`): the crews' former links first (each crew is cut off), then the former
table, or only this appliance's chains in it if other crews still use it. `reconcile` then makes
them again under the current names, rules before links, as for any crew whose link is missing.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from .addressing import Naming, chain_name
from .errors import InstanceConflictError, PoolConflictError
from .kernel import HostNetwork
from .nft import (
    CREW_CHAIN_PREFIX,
    Layout,
    NftBackend,
    TableState,
    interface_patterns,
    pool_claims,
    read_table,
    table_claim,
)

# (action, detail, crew): what `rename` changed, in the form of manager.Change.
Renamed = tuple[str, str, str | None]


def _other_chains(table: TableState, old_links: Sequence[str]) -> list[str]:
    ours = {chain_name(ifname) for ifname in old_links}
    return sorted(
        name for name in table.chains if name.startswith(CREW_CHAIN_PREFIX) and name not in ours
    )


def check_claims(
    nft: NftBackend,
    layout: Layout,
    naming: Naming,
    owner: str,
    old: Naming | None,
    old_links: Sequence[str],
) -> TableState | None:
    """Refuse (InstanceConflictError, before anything is changed) to run beside another
    appliance that claims this one's names; returns the table under the former names (a
    rename), if it exists. Only with an instance id: without one, the names are the
    configuration's, as before instance ids."""
    old_table = None
    if old is not None and old.table != naming.table:
        old_table = read_table(nft, Layout(old.table, 0, old.ifname_prefix, (), layout.pool))
    if naming.instance is None:
        return old_table
    mine = naming.ifname_prefix
    # A former table that only this appliance's crews use is renamed; one that others share
    # is another appliance's claim like any other.
    keep_old = old_table is not None and bool(_other_chains(old_table, old_links))
    for table, prefixes in sorted(interface_patterns(nft).items()):
        if table == naming.table or (old is not None and table == old.table and not keep_old):
            continue
        for prefix in sorted(prefixes):
            if prefix.startswith(mine) or mine.startswith(prefix):
                raise InstanceConflictError(
                    f"table inet {table} matches interfaces {prefix}*, and this appliance's "
                    f"(instance {naming.instance}) are {mine}*: its rules would judge this "
                    "appliance's crews, and they its. If that table belongs to an appliance "
                    "that is gone, delete it (and its links); otherwise give one of them "
                    "another [net] ifname_prefix or instance id"
                )
    current = read_table(nft, layout)
    claim = table_claim(current) if current is not None else {}
    if claim.get("owner") not in (None, owner):
        raise InstanceConflictError(
            f"table inet {naming.table} belongs to another appliance with instance id "
            f"{naming.instance} (owner {claim.get('owner')}, this one is {owner}): two "
            "state directories were given one instance id; give each its own"
        )
    return old_table


def check_pool_claims(nft: NftBackend, layout: Layout, old: Naming | None) -> None:
    """Refuse (PoolConflictError, before anything is changed) to run beside another table of an
    appliance that refuses part of this pool to all but its crews. This table, and the one
    under the former names (a rename), are this appliance's own."""
    mine = ipaddress.IPv4Network(layout.pool)
    ours = {layout.table, old.table if old is not None else layout.table}
    conflicts: list[str] = []
    for table, pools in sorted(pool_claims(nft).items()):
        if table in ours:
            continue
        for pool in sorted(pools):
            try:
                claimed = ipaddress.IPv4Network(pool)
            except ValueError:
                continue
            if claimed.overlaps(mine):
                conflicts.append(
                    f"table inet {table} keeps {claimed} for the crews of another appliance"
                )
    if conflicts:
        raise PoolConflictError(str(mine), tuple(conflicts))


def rename(
    nft: NftBackend,
    host: HostNetwork,
    layout: Layout,
    naming: Naming,
    old: Naming,
    old_links: Sequence[str],
    crews: Sequence[str],
    old_table: TableState | None,
) -> list[Renamed]:
    """Take the crews' objects off their former names (`old_links[i]` is `crews[i]`'s)."""
    changes: list[Renamed] = []
    for ifname, crew in zip(old_links, crews, strict=True):
        if host.delete_link(ifname):
            changes.append(("deleted link", f"{ifname} (former name)", crew))
    if old_table is None:
        return changes
    others = _other_chains(old_table, old_links)
    if others:
        present = [ifname for ifname in old_links if chain_name(ifname) in old_table.chains]
        nft.run(layout.remove_from(old.table, present))
        changes.append(
            (
                "removed rules",
                f"{len(present)} chains from inet {old.table}, which keeps "
                f"{len(others)} of another appliance",
                None,
            )
        )
    else:
        nft.run(layout.drop_table(old.table))
        changes.append(("deleted table", f"inet {old.table} (now inet {naming.table})", None))
    return changes
