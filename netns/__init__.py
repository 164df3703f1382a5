"""netns: the kernel half of the network policy (issue 3).

Each crew gets a veth pair whose crew end lives in the crew's network namespace, a /30 from a
configured pool (the gateway on the host end is the crew's identity at the proxy), and a chain
in the appliance's nftables table that lets it reach exactly one thing: TCP to the proxy ports
on its own gateway. Everything else (other host addresses, other crews, DNS, ICMP, IPv6,
anything forwarded) is counted and dropped. And since the gateway is the crew's identity, the
pool is refused to everything but the crews' own interfaces (the host itself, the LAN, other
appliances' crews). A crew may also be given address rules (`netrules`: allow or deny by IPv4
range, TCP or UDP, port), held in two nftables sets of its own: what an allow rule names, and
no deny rule, is forwarded and masqueraded. docs/netns.md has the design and threat model.

Modules, from the bottom up: `config` (frozen settings), `addressing` (the address plan, pure),
`netrules` (address rules: their one spelling and disjoint set elements, pure), `state` (the
persistent allocation file), `nft` (table layout and atomic transactions), `kernel`
(netlink, namespaces, sysctls), `instances` (the claims checked and the renames done before a
reconcile), `manager` (`CrewNetworks`: attach, detach, reconcile, show).
This package imports nothing from `appliance/` or `proxycore/`.
"""

from .addressing import CrewPlan, Naming, check_instance_id, instance_tag, interface_name, naming
from .config import DEFAULT_POOL, DEFAULT_PROXY_PORT, NetConfig, validate_config
from .errors import (
    CrewNetworkError,
    InstanceConflictError,
    KernelError,
    NetConfigError,
    NetnsError,
    NftError,
    PoolConflictError,
    PoolExhaustedError,
    StateError,
)
from .kernel import InnerView, LinkInfo
from .manager import (
    Change,
    CrewNetwork,
    CrewNetworks,
    CrewStatus,
    NetworkReport,
    ReconcileReport,
    RuleCounter,
    netns_of_pid,
)
from .nft import LibNftables, NftBackend, NftCli, default_backend
from .state import CrewRecord, NetnsIdentity, Phase

__all__ = [
    "DEFAULT_POOL",
    "DEFAULT_PROXY_PORT",
    "Change",
    "CrewNetwork",
    "CrewNetworkError",
    "CrewNetworks",
    "CrewPlan",
    "CrewRecord",
    "CrewStatus",
    "InnerView",
    "InstanceConflictError",
    "KernelError",
    "LibNftables",
    "LinkInfo",
    "Naming",
    "NetConfig",
    "NetConfigError",
    "NetnsError",
    "NetnsIdentity",
    "NetworkReport",
    "NftBackend",
    "NftCli",
    "NftError",
    "Phase",
    "PoolConflictError",
    "PoolExhaustedError",
    "ReconcileReport",
    "RuleCounter",
    "StateError",
    "check_instance_id",
    "default_backend",
    "instance_tag",
    "interface_name",
    "naming",
    "netns_of_pid",
    "validate_config",
]
