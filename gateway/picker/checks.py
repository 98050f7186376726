"""What the picker asks a worker whose relayed stream broke after its headers: the
client leaving and the worker failing look the same to Envoy (both sides reset), so a
grpc.health Check tells them apart before the reservation goes back."""

from __future__ import annotations

import asyncio

import grpc
from grpc import aio

from gateway.core import health
from gateway.proxy import Reservation, Upstreams
from gateway.upstream.worker import Worker


class WorkerChecks:
    """One check per worker at a time; the reservations that wait on it share it."""

    __slots__ = ("_pending", "_timeout_s", "_upstreams")

    def __init__(self, upstreams: Upstreams, timeout_s: float) -> None:
        self._upstreams = upstreams
        self._timeout_s = timeout_s  # `probe.timeout_s`
        self._pending: dict[Worker, asyncio.Task[bool]] = {}

    def release_checked(self, reservation: Reservation) -> None:
        """Release once the worker answered a Check (no verdict: the client left), or
        failed to (UNAVAILABLE: the worker failed)."""
        worker = reservation.worker
        pending = self._pending.get(worker)
        if pending is None:
            pending = self._pending[worker] = self._upstreams.tasks.spawn(
                self._answers(worker), "worker_check"
            )
            pending.add_done_callback(lambda _: self._pending.pop(worker, None))

        def settle(done: asyncio.Task[bool]) -> None:
            gone = not done.cancelled() and done.exception() is None and not done.result()
            reservation.release(grpc.StatusCode.UNAVAILABLE if gone else None)

        pending.add_done_callback(settle)

    async def _answers(self, worker: Worker) -> bool:
        """Whether the worker answers a Check (any answer but UNAVAILABLE, or no answer
        in time)."""
        try:
            check = self._upstreams.fleet.method(worker, health.CHECK, streaming=False)
            await check(b"", timeout=self._timeout_s)  # HealthCheckRequest(service=""): no bytes
        except aio.AioRpcError as error:
            return error.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        except KeyError:  # no longer registered: its channel is closed
            return False
        return True
