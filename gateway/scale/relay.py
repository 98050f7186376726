"""Discovery with `--processes N`: the sources run once, in the supervisor (one resolver,
one watch of the Kubernetes API, whatever N is); every report is kept, so a serving
process that starts later starts from it, and sent to each serving process that listens
(PeerService.Discovered on its control socket), which applies it to its own fleet."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import structlog
from grpc import aio

from gateway.config import DiscoverySource
from gateway.core.tasks import TaskScope
from gateway.discovery.runner import Sources
from gateway.discovery.source import Discovered
from gateway.peer.service import discovered_message
from gateway.peer.v1 import peer_pb2_grpc

log = structlog.get_logger("gateway.supervisor")

PUSH_TIMEOUT_S = 5.0


class DiscoveryRelay:
    """`channels()`: the control channels of the serving processes that listen now."""

    def __init__(
        self, configs: Sequence[DiscoverySource], channels: Callable[[], list[aio.Channel]]
    ) -> None:
        self.sources = Sources(configs)
        self.claims: dict[str, list[Discovered]] = {}
        self._channels = channels
        self._lock = asyncio.Lock()  # reports reach every process in the order made
        self._reported: dict[str, asyncio.Event] = {n: asyncio.Event() for n in self.sources.names}
        self._pushes = TaskScope()

    def start(self) -> None:
        self.sources.start(self._report)

    async def first_reports(self, timeout_s: float) -> bool:
        """Wait (bounded) until every source answered once: processes start with it."""
        deadline = time.monotonic() + timeout_s
        for event in self._reported.values():
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await event.wait()
            except TimeoutError:
                return False
        return True

    def origins(self, address: str) -> list[str]:
        """The discovery sources that list `address` now."""
        return sorted({h.origin for hosts in self.claims.values() for h in hosts
                       if h.spec.address == address})  # fmt: skip

    def _report(self, source: str, hosts: Sequence[Discovered]) -> None:
        self.claims[source] = list(hosts)
        self._reported[source].set()
        self._pushes.spawn(self._push([source], self._channels()), "discovery_push", source=source)

    async def catch_up(self, channel: aio.Channel) -> None:
        """A process that just started: every source's latest report (it started from
        the reports known when its launch file was written)."""
        await self._push(list(self.claims), [channel])

    async def _push(self, sources: list[str], channels: list[aio.Channel]) -> None:
        async with self._lock:
            for source in sources:
                message = discovered_message(source, self.claims[source])
                stubs = [peer_pb2_grpc.PeerServiceStub(channel) for channel in channels]
                answers = await asyncio.gather(
                    *(s.Discovered(message, timeout=PUSH_TIMEOUT_S) for s in stubs),
                    return_exceptions=True,
                )
                for answer in answers:
                    if isinstance(answer, aio.AioRpcError):
                        # A process that stopped or is stuck: replaced by the supervisor,
                        # and a new one starts from the reports.
                        log.warning("discovery_push_failed", source=source, error=answer.details())
                    elif isinstance(answer, BaseException):
                        raise answer

    async def close(self) -> None:
        await self.sources.close()
        await self._pushes.close()
