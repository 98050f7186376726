"""Binding a listener: one error a person can read, whichever port it is."""

from __future__ import annotations

from grpc import aio


class CannotListen(Exception):
    """A listener could not bind its address: the process says so in one line."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")


def bind(server: aio.Server, address: str) -> int:
    """Add an insecure port; `CannotListen` if the address cannot be bound."""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        port = 0
    if port == 0:
        raise CannotListen(address, "address in use or not available")
    return int(port)
