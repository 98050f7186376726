"""A client's address as grpc names it, reduced to what its connections share."""

from __future__ import annotations


def peer_host(peer: str | None) -> str:
    """`ipv4:10.0.0.1:5555` -> `10.0.0.1`, `ipv6:[::1]:5555` -> `[::1]`: a client's
    connections share its host, whatever their ports."""
    if not peer:
        return "unknown"
    address = peer.partition(":")[2] if peer.startswith(("ipv4:", "ipv6:")) else peer
    host, sep, port = address.rpartition(":")
    return host if sep and port.isdigit() else address
