"""A client's address as grpc names it, reduced to what its connections share."""

from __future__ import annotations

import ipaddress

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def unmapped(address: IpAddress) -> IpAddress:
    """An IPv4-mapped IPv6 address (`::ffff:10.0.0.1`, a dual-stack socket's) as the IPv4
    one it is; any other as it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def peer_host(peer: str | None) -> str:
    """`ipv4:10.0.0.1:5555` -> `10.0.0.1`, `ipv6:[::1]:5555` -> `[::1]`: a client's
    connections share its host, whatever their ports."""
    if not peer:
        return "unknown"
    address = peer.partition(":")[2] if peer.startswith(("ipv4:", "ipv6:")) else peer
    host, sep, port = address.rpartition(":")
    return host if sep and port.isdigit() else address
