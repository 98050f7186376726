"""The main port of a multi-process gateway: found and held by the supervisor, shared by
its serving processes through SO_REUSEPORT."""

from __future__ import annotations

import socket

from gateway.config import parse_address
from gateway.core.listen import CannotListen


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def hold_port(listen: str) -> tuple[socket.socket, int]:
    """Check that nobody listens on `listen`, pick the port if it is 0, and keep it bound
    (with SO_REUSEPORT, not listening) so that only processes of this user that also set
    SO_REUSEPORT can join it: the serving processes. A bound socket that does not listen
    receives no connections. Raises CannotListen."""
    host, port = parse_address(listen, "listen address")
    host = host or "0.0.0.0"
    family = _family(host)
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does
        # Without SO_REUSEPORT this bind fails if anything listens there, even a process
        # that set SO_REUSEPORT itself: a busy port is refused, as in one-process mode.
        probe.bind((host, port))
        port = probe.getsockname()[1]
    except OSError as exc:
        probe.close()
        raise CannotListen(listen, exc.strerror or str(exc)) from None
    holder = socket.socket(family, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        probe.close()
        holder.bind((host, port))
    except OSError as exc:
        holder.close()
        raise CannotListen(listen, exc.strerror or str(exc)) from None
    return holder, port
