"""HOST:PORT addresses, and whether a host is loopback."""

from __future__ import annotations

import ipaddress

from gateway.config.errors import ConfigError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(text: str) -> tuple[str, int] | None:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return None
    return host.strip("[]"), int(port)


def parse_address(text: str, what: str) -> tuple[str, int]:
    address = host_port(text)
    if address is None:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT")
    return address
