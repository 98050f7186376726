"""Dispatch: the one attempt loop, and the attempts it runs on a placement.

Placement and reservation happen in one step (nothing awaits in between), so the next
request's placement already sees this one on every worker it picked. Before the client
has seen a response message, a retryable upstream failure (no connection, UNAVAILABLE,
the worker's own CANCELLED) is tried again on a placement without that worker. After it,
a Generate stream whose worker failed goes on on another worker where it can (see
`proxy/migration.py`); any other status reaches the client as it is, with the worker's
trailing metadata. The client's remaining deadline goes on every upstream call; a client
cancel cancels them all at once (each call's `close`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from gateway.core import verdicts
from gateway.core.verdicts import Verdict
from gateway.placement.decision import Decision
from gateway.proxy.call import Place, abort_with_failure
from gateway.proxy.failures import UpstreamFailure, retryable
from gateway.proxy.job import Job
from gateway.proxy.lora import LoadFailed, LoraLoader
from gateway.proxy.migration import Migrations
from gateway.proxy.reservation import ReservedPlacement
from gateway.proxy.upstream import Upstreams
from gateway.proxy.upstream_call import UpstreamCall

Attempt = Callable[[Job, ReservedPlacement], Awaitable[bytes | None]]


class Dispatcher:
    def __init__(
        self,
        upstreams: Upstreams,
        max_attempts: int,
        migrations: Migrations | None = None,
        loras: LoraLoader | None = None,
        retry_after_ms: int = 1000,
    ) -> None:
        self.upstreams = upstreams
        self._max_attempts = max_attempts
        self._migrations = migrations
        self._loras = loras  # loads a call's LoRA adapter before its legs open
        self._retry_after_ms = retry_after_ms

    def configure(self, max_attempts: int, retry_after_ms: int) -> None:
        """A reload: attempts per call and the retry hint, from the next call on."""
        self._max_attempts, self._retry_after_ms = max_attempts, retry_after_ms

    async def serve(
        self,
        job: Job,
        place: Place,
        attempt: Attempt,
        placed_ahead: ReservedPlacement | None = None,
    ) -> bytes | None:
        """Run the job; an upstream failure becomes the client's status."""
        try:
            return await self.run(job, place, attempt, placed_ahead)
        except UpstreamFailure as failure:
            await abort_with_failure(job.context, failure)

    async def run(
        self,
        job: Job,
        place: Place,
        attempt: Attempt,
        placed_ahead: ReservedPlacement | None = None,
    ) -> bytes | None:
        """The attempt loop: place and reserve, run the attempt; a retryable failure before
        anything reached the client is tried again without the worker that failed, and a
        stream whose worker failed after it goes on elsewhere if it can (a new stretch,
        with attempts of its own). `placed_ahead`: the first attempt's placement, made and
        reserved already (by a waiting room, as capacity came free)."""
        migrations = self._migrations
        if migrations is None:
            return await self._run(job, place, attempt, placed_ahead, None)
        job = migrations.watch(job)
        try:
            return await self._run(job, place, attempt, placed_ahead, migrations)
        finally:
            migrations.done(job)  # every stretch shares the first one's progress

    async def _run(
        self,
        job: Job,
        place: Place,
        attempt: Attempt,
        placed_ahead: ReservedPlacement | None,
        migrations: Migrations | None,
    ) -> bytes | None:
        tried: list[str] = []
        failure: UpstreamFailure | None = None  # the answer when nobody else can take it
        broke: UpstreamFailure | None = None  # the failure the stream went on after
        attempts = migrated = 0
        retry = False
        unloaded: LoadFailed | None = None  # the last worker that could not load its adapter
        while attempts < self._max_attempts:
            attempts += 1
            if placed_ahead is not None:
                reserved, placed_ahead = placed_ahead, None
            else:
                placed = self._place(job, place, tried)
                if isinstance(placed, Verdict):
                    if failure is None:
                        await job.call.refuse(self._unloaded(job, unloaded) or placed)
                    break  # nobody else to try: the last worker's own failure is the answer
                reserved = self.upstreams.reserve_all(placed)
            job.call.placed(reserved, retry=retry)
            try:
                if self._loras is None:
                    return await attempt(job, reserved)
                with await self._loras.prepare(job, reserved):  # before any leg opens
                    return await attempt(job, reserved)
            except LoadFailed as error:  # nothing was sent: another worker may load it
                tried.append(error.worker.id)
                unloaded, retry = error, True
                continue
            except UpstreamFailure as error:
                tried.append(error.worker.id)
                if not job.sink.delivered:
                    if not retryable(error):
                        if broke is not None and migrations is not None:
                            # The continuation refused (its prompt past the new worker's
                            # context, say): the stream ends with what broke it.
                            migrations.note(job, broke, "refused_by_worker")
                            raise broke from None
                        raise
                    failure, retry = broke or error, True
                    continue
                if migrations is None:
                    raise
                outcome = migrations.verdict(job, error, migrated)
                if outcome is None:
                    raise
                if outcome:
                    migrations.note(job, error, outcome)
                    raise
                # Without the worker that just failed; one that failed the stream before
                # may serve again (a rolling restart brings each worker back in turn).
                tried = [error.worker.id]
                placed = self._place(job, place, tried)
                if isinstance(placed, Verdict):
                    migrations.note(job, error, "unplaced")
                    raise
                migrations.note(job, error, "continued")
                placed_ahead = self.upstreams.reserve_all(placed)
                job = migrations.continuation(job, migrated)
                failure = broke = error
                attempts, retry = 0, False
                migrated += 1
            finally:
                reserved.release_unused()
        if failure is None:  # every attempt's worker failed to load the call's adapter
            verdict = self._unloaded(job, unloaded)
            assert verdict is not None
            await job.call.refuse(verdict)
        raise failure

    def _unloaded(self, job: Job, failed: LoadFailed | None) -> Verdict | None:
        """The verdict when the call's adapter could be loaded on no worker tried."""
        if failed is None:
            return None
        return verdicts.adapter_load_failed(
            job.call.model, failed.adapter, failed.why, self._retry_after_ms
        )

    def _place(self, job: Job, place: Place, tried: list[str]) -> Decision | Verdict:
        started_ns = time.time_ns()
        placed = place(tried)
        if job.call.trace is not None:
            job.call.trace.placement(started_ns, placed, tried)
        return placed

    # -- regular attempts: one worker answers the whole call ---------------------------

    def attempt(self, streaming: bool) -> Attempt:
        """The regular attempt for an RPC of this shape: one worker answers it all."""
        return self.stream if streaming else self.unary

    async def stream(self, job: Job, reserved: ReservedPlacement) -> None:
        with self._lone_call(job, reserved, streaming=True) as call:
            await call.relay(job.sink, await call.first(job.sink))

    async def unary(self, job: Job, reserved: ReservedPlacement) -> bytes:
        with self._lone_call(job, reserved, streaming=False) as call:
            reply = await call.response()
            await job.sink.headers(await call.headers(), always=True)
            job.sink.trailers(await call.trailers())
            return reply

    def _lone_call(self, job: Job, reserved: ReservedPlacement, *, streaming: bool) -> UpstreamCall:
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
