"""Dispatch: the one attempt loop, and the attempts it runs on a placement.

Placement and reservation happen in one step (nothing awaits in between), so the next
request's placement already sees this one on every worker it picked. Before the client
has seen a response message, a retryable upstream failure (no connection, UNAVAILABLE,
the worker's own CANCELLED) is tried again on a placement without that worker; any other
status, and any failure after the first message, reaches the client as it is, with the
worker's trailing metadata. The client's remaining deadline goes on every upstream call;
a client cancel cancels them all at once (each call's `close`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from gateway.placement.verdicts import Verdict
from gateway.proxy.call import Place, abort_with_failure
from gateway.proxy.job import Job
from gateway.proxy.upstream import (
    RETRYABLE,
    Reserved,
    UpstreamCall,
    UpstreamFailure,
    Upstreams,
)

Attempt = Callable[[Job, Reserved], Awaitable[bytes | None]]


class Dispatcher:
    def __init__(self, upstreams: Upstreams, max_attempts: int) -> None:
        self.upstreams = upstreams
        self._max_attempts = max_attempts

    async def serve(
        self, job: Job, place: Place, attempt: Attempt, placed_ahead: Reserved | None = None
    ) -> bytes | None:
        """Run the job; an upstream failure becomes the client's status."""
        try:
            return await self.run(job, place, attempt, placed_ahead)
        except UpstreamFailure as failure:
            await abort_with_failure(job.context, failure)

    async def run(
        self, job: Job, place: Place, attempt: Attempt, placed_ahead: Reserved | None = None
    ) -> bytes | None:
        """The attempt loop: place and reserve, run the attempt; a retryable failure before
        anything reached the client is tried again without the worker that failed.
        `placed_ahead`: the first attempt's placement, made and reserved already (by a waiting
        room, as capacity came free)."""
        tried: list[str] = []
        failure: UpstreamFailure | None = None
        for _ in range(self._max_attempts):
            if placed_ahead is not None:
                reserved, placed_ahead = placed_ahead, None
            else:
                started_ns = time.time_ns()
                placed = place(tried)
                if job.call.trace is not None:
                    job.call.trace.placement(started_ns, placed, tried)
                if isinstance(placed, Verdict):
                    if failure is None:
                        await job.call.refuse(placed)
                    break  # nobody else to try: the last worker's own failure is the answer
                reserved = self.upstreams.reserve_all(placed)
            job.call.placed(reserved, retry=failure is not None)
            try:
                return await attempt(job, reserved)
            except UpstreamFailure as error:
                if error.code not in RETRYABLE or job.sink.delivered:
                    raise
                failure = error
                tried.append(error.worker.id)
            finally:
                reserved.release_unused()
        assert failure is not None
        raise failure

    # -- regular attempts: one worker answers the whole call ---------------------------

    def attempt(self, streaming: bool) -> Attempt:
        """The regular attempt for an RPC of this shape: one worker answers it all."""
        return self.stream if streaming else self.unary

    async def stream(self, job: Job, reserved: Reserved) -> None:
        with self._lone_call(job, reserved, streaming=True) as call:
            await call.relay(job.sink, await call.first(job.sink))

    async def unary(self, job: Job, reserved: Reserved) -> bytes:
        with self._lone_call(job, reserved, streaming=False) as call:
            reply = await call.response()
            await job.sink.headers(await call.headers(), always=True)
            job.sink.trailers(await call.trailers())
            return reply

    def _lone_call(self, job: Job, reserved: Reserved, *, streaming: bool) -> UpstreamCall:
        worker = reserved.decision.lone
        request = job.for_worker(job.raw, reserved.decision, worker)
        return job.open_leg(
            self.upstreams,
            reserved,
            worker,
            worker.role,
            request,
            streaming=streaming,
            answers=True,
        )
