"""Binding a listener: one error a person can read, whichever port it is."""

from __future__ import annotations

import grpc
from grpc import aio


class CannotListen(Exception):
    """A listener could not bind its address: the process says so in one line."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")


def bind(
    server: aio.Server, address: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Add a port (TLS with `credentials`); `CannotListen` if it cannot be bound."""
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        port = 0
    if port == 0:
        raise CannotListen(address, "address in use or not available")
    return int(port)
