"""The SSRF guard: only globally routable unicast passes, unless the operator allowed a range.

These are strings classified in memory; nothing is sent anywhere.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxycore.protocol.ssrf import AddressGuard, AddressVerdict


@pytest.fixture(scope="module")
def guard() -> AddressGuard:
    return AddressGuard()


REFUSED = [
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("10.0.0.1", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    ("169.254.169.254", "metadata"),
    ("169.254.170.2", "metadata"),
    ("100.100.100.200", "metadata"),
    ("168.63.129.16", "metadata"),
    ("fd00:ec2::254", "metadata"),
    ("169.254.1.1", "link_local"),
    ("100.64.0.1", "cgnat"),
    ("100.127.255.255", "cgnat"),
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "unspecified"),
    ("255.255.255.255", "broadcast"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("240.0.0.1", "reserved"),
    ("192.0.0.9", "reserved"),
    ("192.0.2.1", "documentation"),
    ("198.51.100.1", "documentation"),
    ("203.0.113.1", "documentation"),
    ("198.18.0.1", "benchmarking"),
    ("198.19.255.255", "benchmarking"),
    ("192.88.99.1", "6to4"),
    ("::1", "loopback"),
    ("::", "unspecified"),
    ("::ffff:127.0.0.1", "ipv4_mapped"),
    ("::ffff:7f00:1", "ipv4_mapped"),
    ("::ffff:8.8.8.8", "ipv4_mapped"),  # refused whatever the embedded address
    ("::127.0.0.1", "ipv4_compatible"),
    ("::8.8.8.8", "ipv4_compatible"),
    ("::ffff:0:7f00:1", "ipv4_translated"),
    ("2002:7f00:1::", "6to4"),
    ("2002:808:808::1", "6to4"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "teredo"),
    ("64:ff9b::7f00:1", "nat64"),
    ("64:ff9b::808:808", "nat64"),
    ("64:ff9b:1::a9fe:a9fe", "nat64"),
    ("fe80::1%eth0", "link_local"),
    ("fe80::1", "link_local"),
    ("fc00::1", "unique_local"),
    ("fd12:3456::1", "unique_local"),
    ("fec0::1", "site_local"),
    ("ff02::1", "multicast"),
    ("ff02::1%eth0", "multicast"),
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation"),
    ("2001:2::1", "benchmarking"),
    ("2001:10::1", "reserved"),
    ("100::1", "reserved"),
    ("5f00::1", "reserved"),
    ("4000::1", "reserved"),  # outside 2000::/3 global unicast
    ("1::1", "reserved"),
]


@pytest.mark.parametrize(("address", "reason"), REFUSED)
def test_refused(guard: AddressGuard, address: str, reason: str) -> None:
    assert guard.check(address) == AddressVerdict(False, address, reason)


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "160.79.104.10", "2a00:1450::1"]
)
def test_global_allowed(guard: AddressGuard, address: str) -> None:
    assert guard.check(address) == AddressVerdict(True, address, "global")


@pytest.mark.parametrize(
    "address",
    [
        "",
        "localhost",
        "127.1",
        "2130706433",
        "0x7f.0.0.1",
        "0177.0.0.1",
        "01.2.3.4",
        "8.8.8.8 ",
        " 8.8.8.8",
        "8.8.8.8%eth0",
        "[::1]",
        "fe80::1%",
        "fe80::1%eth 0",
        "fe80::1%eth\n0",
        "::1/128",
        "\u0668.8.8.8",
        "1" * 1000,
    ],
)
def test_invalid_is_refused_not_raised(guard: AddressGuard, address: str) -> None:
    verdict = guard.check(address)
    assert (verdict.allowed, verdict.reason) == (False, "invalid")
    assert len(verdict.address) <= 100


def test_non_string_is_refused(guard: AddressGuard) -> None:
    verdict = guard.check(ipaddress.ip_address("8.8.8.8"))  # type: ignore[arg-type]
    assert (verdict.allowed, verdict.reason) == (False, "invalid")


def test_zone_on_global_address_is_refused(guard: AddressGuard) -> None:
    # Only link-local and multicast carry zones; a zone picks an interface.
    assert guard.check("2606:4700:4700::1111%eth0") == AddressVerdict(
        False, "2606:4700:4700::1111%eth0", "scoped"
    )


# --- operator ranges ---------------------------------------------------------------------------


def test_operator_range_overrides() -> None:
    guard = AddressGuard(["127.0.0.0/8", "fd00::/8"])
    assert guard.check("127.0.0.5") == AddressVerdict(True, "127.0.0.5", "operator_allowed")
    assert guard.check("fd00::5").reason == "operator_allowed"
    assert guard.check("10.0.0.1").reason == "private"
    assert guard.check("8.8.8.8").reason == "global"
    # The v4 range does not open the mapped or NAT64 forms of the same addresses.
    assert guard.check("::ffff:127.0.0.5").reason == "ipv4_mapped"
    assert guard.check("64:ff9b::7f00:5").reason == "nat64"


def test_metadata_needs_the_exact_address() -> None:
    broad = AddressGuard(["169.254.0.0/16", "100.64.0.0/10", "fd00::/8"])
    assert broad.check("169.254.1.1").reason == "operator_allowed"
    assert broad.check("169.254.169.254") == AddressVerdict(False, "169.254.169.254", "metadata")
    assert broad.check("100.100.100.200").reason == "metadata"
    assert broad.check("fd00:ec2::254").reason == "metadata"
    exact = AddressGuard(["169.254.169.254/32", "fd00:ec2::254/128"])
    assert exact.check("169.254.169.254").reason == "operator_allowed"
    assert exact.check("fd00:ec2::254").reason == "operator_allowed"


def test_operator_allowed_link_local_keeps_its_zone() -> None:
    guard = AddressGuard(["fe80::/10"])
    assert guard.check("fe80::1%eth0") == AddressVerdict(True, "fe80::1%eth0", "operator_allowed")


@pytest.mark.parametrize(
    "entry",
    [
        "0.0.0.0/0",
        "::/0",
        "0.0.0.0/1",
        "128.0.0.0/1",
        "8000::/1",
        "::ffff:0:0/96",
        "::ffff:127.0.0.0/104",
        "::/96",
        "::/8",
        "64:ff9b::/96",
        "64:ff9b:1::/48",
        "2002::/16",
        "2001::/32",
        "127.0.0.1/8",  # host bits set
        "10.0.0.0/33",
        "localhost",
        "",
        "10.0.0.0 /8",
    ],
)
def test_bad_operator_ranges_refused(entry: str) -> None:
    with pytest.raises(ValueError) as info:
        AddressGuard(["10.0.0.0/8", entry])
    assert repr(entry) in str(info.value)


def test_operator_ranges_must_be_an_iterable_of_strings() -> None:
    with pytest.raises(TypeError):
        AddressGuard("127.0.0.0/8")
    with pytest.raises(ValueError):
        AddressGuard([ipaddress.ip_network("127.0.0.0/8")])  # type: ignore[list-item]


def test_allowed_ranges_round_trip() -> None:
    guard = AddressGuard(["127.0.0.0/8", "FD00::/8", "192.168.1.7"])
    assert guard.allowed_ranges == ("127.0.0.0/8", "fd00::/8", "192.168.1.7/32")


# --- properties --------------------------------------------------------------------------------

_GLOBAL_V6 = ipaddress.IPv6Network("2000::/3")


@given(st.ip_addresses())
def test_allowed_implies_global_unicast(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> None:
    verdict = AddressGuard().check(str(address))
    if verdict.allowed:
        assert verdict.reason == "global"
        assert address.is_global and not address.is_multicast
        if isinstance(address, ipaddress.IPv6Address):
            assert address in _GLOBAL_V6
            assert address.ipv4_mapped is None and address.sixtofour is None
            assert address.teredo is None


@given(st.ip_addresses(v=4))
def test_every_embedding_of_ipv4_is_refused(address: ipaddress.IPv4Address) -> None:
    guard = AddressGuard()
    packed = int(address)
    for prefix, reason in [
        ("::ffff:0:0", "ipv4_mapped"),
        ("64:ff9b::", "nat64"),
        ("::ffff:0:0:0", "ipv4_translated"),
    ]:
        embedded = ipaddress.IPv6Address(int(ipaddress.IPv6Address(prefix)) | packed)
        assert guard.check(str(embedded)).reason == reason
    sixtofour = ipaddress.IPv6Address((0x2002 << 112) | (packed << 80))
    assert guard.check(str(sixtofour)).reason == "6to4"


@given(st.ip_addresses(v=4), st.integers(min_value=8, max_value=32))
def test_operator_range_contains_implies_allowed(
    address: ipaddress.IPv4Address, prefix: int
) -> None:
    network = ipaddress.ip_network(f"{address}/{prefix}", strict=False)
    verdict = AddressGuard([str(network)]).check(str(address))
    if (
        str(address)
        in {
            "169.254.169.254",
            "169.254.170.2",
            "169.254.170.23",
            "100.100.100.200",
            "168.63.129.16",
        }
        and prefix != 32
    ):
        assert verdict == AddressVerdict(False, str(address), "metadata")
    else:
        assert verdict == AddressVerdict(True, str(address), "operator_allowed")
