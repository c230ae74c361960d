"""Allow-list address matching as properties: IPv4, IPv6, IPv4-mapped IPv6, zones, junk.

Hypothesis draws addresses and networks; the reference is Python's
``ipaddress`` membership on the address as the kernel would report it.  No
server: the live side of the same rules is fuzz/access.py and fuzz/tls.py.
"""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from hydra_trio.transport.access import AllowList, normalize_address, parse_network
from hydra_trio.transport.tls import plain_allowed

v4 = st.ip_addresses(v=4)
v6 = st.ip_addresses(v=6)


@st.composite
def networks(draw: st.DrawFn, version: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    addr = draw(st.ip_addresses(v=version))
    prefix = draw(st.integers(0, addr.max_prefixlen))
    return ipaddress.ip_network(f"{addr}/{prefix}", strict=False)


def mapped(addr: ipaddress.IPv4Address) -> str:
    return f"::ffff:{addr}"


@given(addr=v4, net=networks(4))
def test_ipv4_and_its_mapped_form_match_alike(addr: ipaddress.IPv4Address, net: ipaddress.IPv4Network) -> None:
    allow = AllowList.parse([str(net)])
    assert allow.allows(str(addr)) == (addr in net)
    assert allow.allows(mapped(addr)) == (addr in net)  # a dual-stack socket reports IPv4 peers so
    assert allow.allows(ipaddress.IPv6Address(mapped(addr))) == (addr in net)


@given(addr=v4, net=networks(4))
def test_a_mapped_network_is_its_ipv4_network(addr: ipaddress.IPv4Address, net: ipaddress.IPv4Network) -> None:
    as_v6 = f"::ffff:{net.network_address}/{96 + net.prefixlen}"
    assert parse_network(as_v6) == net
    assert AllowList.parse([as_v6]).allows(str(addr)) == (addr in net)


v6_or_mapped = st.one_of(v6, v4.map(lambda a: ipaddress.IPv6Address(mapped(a))))


@st.composite
def v6_networks(draw: st.DrawFn) -> ipaddress.IPv6Network:
    """IPv6 networks, a fair share of them inside ``::ffff:0:0/96`` (IPv4-mapped)."""
    addr = draw(v6_or_mapped)
    return ipaddress.ip_network(f"{addr}/{draw(st.integers(0, 128))}", strict=False)


@given(addr=v6_or_mapped, net=v6_networks(), zone=st.sampled_from(["", "%eth0", "%1", "%lo"]))
def test_ipv6_matches_by_membership_zone_ignored(
    addr: ipaddress.IPv6Address, net: ipaddress.IPv6Network, zone: str
) -> None:
    """A plain IPv6 peer matches by membership; a mapped one is matched as IPv4, so only by a network
    inside ``::ffff:0:0/96`` (which becomes its IPv4 network), never by a wider IPv6 one such as ``::/0``."""
    want = addr in net and (addr.ipv4_mapped is None or net.prefixlen >= 96)
    assert AllowList.parse([str(net)]).allows(str(addr) + zone) == want


@given(addr=v4)
def test_families_never_cross(addr: ipaddress.IPv4Address) -> None:
    """``::/0`` is every IPv6 peer, not every peer; ``0.0.0.0/0`` is every IPv4 peer (mapped ones too)."""
    assert not AllowList.parse(["::/0"]).allows(str(addr))
    assert not AllowList.parse(["::/0"]).allows(mapped(addr))
    assert AllowList.parse(["0.0.0.0/0"]).allows(mapped(addr))
    assert not AllowList.parse(["0.0.0.0/0"]).allows("2001:db8::1")


@given(junk=st.one_of(st.text(max_size=60), st.none()), nets=st.lists(st.one_of(networks(4), networks(6)), max_size=4))
def test_junk_addresses_are_refused_never_raise(junk: str | None, nets: list) -> None:
    allow = AllowList.parse(map(str, nets))
    try:
        ipaddress.ip_address((junk or "").split("%", 1)[0])
    except ValueError:
        assert allow.allows(junk) is False
    else:
        allow.allows(junk)  # a real address: matched, no error


@given(addr=st.one_of(v4, v6))
def test_plain_allowed_with_tls_required_is_loopback_only(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    real = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped else addr
    assert plain_allowed(str(addr), required=True) == real.is_loopback
    assert plain_allowed(str(addr), required=False)


@given(addr=st.one_of(v4, v6))
def test_normalize_is_idempotent(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    once = normalize_address(str(addr))
    assert normalize_address(once) == once and normalize_address(str(once)) == once
