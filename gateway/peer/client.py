"""The sibling serving processes, as one process sees them: ask them to abort."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
import structlog
from grpc import aio

from gateway.peer.service import metadata_to_headers
from gateway.peer.v1 import peer_pb2 as pb
from gateway.peer.v1 import peer_pb2_grpc
from gateway.proxy import Metadata

log = structlog.get_logger("gateway.peer")

ASK_TIMEOUT_S = 5.0  # a sibling that does not answer by then is restarting or stuck


class Siblings:
    """Channels to the other serving processes' control sockets, opened on first use (a
    sibling may still be starting when this one starts)."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = tuple(addresses)
        self._stubs: list[peer_pb2_grpc.PeerServiceStub] = []
        self._channels: list[aio.Channel] = []

    def _peers(self) -> list[peer_pb2_grpc.PeerServiceStub]:
        if not self._stubs:
            self._channels = [aio.insecure_channel(a) for a in self._addresses]
            self._stubs = [peer_pb2_grpc.PeerServiceStub(c) for c in self._channels]
        return self._stubs

    async def abort_held(
        self,
        service: str,
        request: bytes,
        principal: str | None,
        forward: Metadata,
        time_left: float | None,
    ) -> list[bytes]:
        """Ask every sibling; the replies of those that held a named request (a sibling
        that fails to answer held nothing we can reach)."""
        message = pb.AbortHeldRequest(
            service=service, request=request, headers=metadata_to_headers(forward)
        )
        if principal is not None:
            message.principal = principal
        wait = ASK_TIMEOUT_S if time_left is None else min(time_left, ASK_TIMEOUT_S)
        answers = await asyncio.gather(
            *(peer.AbortHeld(message, timeout=wait) for peer in self._peers()),
            return_exceptions=True,
        )
        held = []
        for answer in answers:
            if isinstance(answer, grpc.RpcError):
                log.warning("sibling_abort_failed", error=str(answer.details()))
            elif isinstance(answer, BaseException):
                raise answer
            elif answer.held:
                held.append(bytes(answer.response))
        return held

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels, self._stubs = [], []
