"""Where Envoy sends a call: a worker's `IP:PORT`. Envoy's original-destination cluster
takes an address, not a name, so a worker configured by host name is resolved here
(off the event loop, cached for a while; discovery's workers are addresses already)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import time

CACHE_S = 30.0  # how long a host name's address is used before it is looked up again


def endpoint(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@functools.lru_cache(maxsize=4096)
def literal(host: str) -> str | None:
    """`host` as an IP address, if it is one (`[::1]` too); a worker's host is asked
    of every call placed on it, so the answer is kept."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        return None


class Destinations:
    """Workers' `IP:PORT`, by host and port."""

    def __init__(self) -> None:
        self._names: dict[str, tuple[str, float]] = {}  # host name -> (IP, looked up at)

    async def address(self, host: str, port: int) -> str:
        ip = literal(host)
        if ip is None:
            ip = await self._resolve(host)
        return endpoint(ip, port)

    async def _resolve(self, host: str) -> str:
        now = time.monotonic()
        cached = self._names.get(host)
        if cached is not None and now - cached[1] < CACHE_S:
            return cached[0]
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        ip = str(infos[0][4][0])
        self._names[host] = (ip, now)
        return ip
