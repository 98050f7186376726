"""The call carries every placement made for it, with its reservations: a retry is a
second placement without the worker that failed, each counted on the record; every
reservation is released when its attempt ends."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, cast

import grpc
import pytest

from gateway.config import WorkerSpec
from gateway.core import verdicts
from gateway.core.roles import Role, Runtime
from gateway.core.verdicts import Verdict
from gateway.engines import engine_adapters
from gateway.observability.record import CallRecord
from gateway.placement.decision import Decision
from gateway.placement.policies import Hints
from gateway.proxy.call import Call
from gateway.proxy.dispatch import Dispatcher
from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.inflight import InflightTable
from gateway.proxy.job import Job
from gateway.proxy.metadata import RequestMeta
from gateway.proxy.reservation import ReservedPlacement
from gateway.proxy.upstream import Upstreams
from gateway.upstream.signals.outlier import Outcome
from gateway.upstream.worker import Worker
from tests.support.factories import make_worker

ADAPTER = engine_adapters()[Runtime.SGLANG]


class Fleet:
    """Outcomes are counted; no method is ever asked for (the attempts here call nobody)."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, Outcome]] = []

    def method(self, worker: Worker, path: str, *, streaming: bool) -> Any:
        raise AssertionError("no upstream call in these tests")

    def on_dispatch(self, worker: Worker) -> bool:
        return False

    def released(self, worker: Worker) -> None:
        pass

    def record_outcome(self, worker: Worker, outcome: Outcome, *, trial: bool) -> None:
        self.outcomes.append((worker.id, outcome))


class Sink:
    delivered = False


def job() -> Job:
    record = CallRecord(rpc="Generate", service=ADAPTER.service_name)
    meta = RequestMeta(model="m", hints=Hints(), forward=())
    call = Call(ADAPTER.rpcs["Generate"], cast(Any, None), record, meta, "peer:127.0.0.1")
    return Job(call, ADAPTER, b"", Sink(), "r")  # type: ignore[arg-type]


async def test_a_retry_is_a_second_placement_on_the_call_without_the_failed_worker() -> None:
    a, b = (make_worker(WorkerSpec("h", port, "m", Runtime.SGLANG)) for port in (1, 2))
    tried_at: list[list[str]] = []

    def place(tried: Collection[str]) -> Decision | Verdict:
        tried_at.append(list(tried))
        return Decision.single(b if a.id in tried else a, policy="round_robin")

    async def attempt(job: Job, reserved: ReservedPlacement) -> bytes:
        worker = reserved.decision.lone
        assert worker.inflight == 1  # reserved before the attempt runs
        if worker is a:
            raise UpstreamFailure(Role.REGULAR, a, grpc.StatusCode.UNAVAILABLE, "down")
        return b"ok"

    fleet = Fleet()
    dispatcher = Dispatcher(Upstreams(fleet, InflightTable(), 1.0), max_attempts=3)
    the_job = job()
    assert await dispatcher.run(the_job, place, attempt) == b"ok"
    call = the_job.call
    assert [p.decision.lone for p in call.placements] == [a, b]
    assert tried_at == [[], [a.id]]
    assert (call.record.attempts, call.record.retries) == (2, 1)
    # The attempt took no reservation: each was released unused when its attempt ended.
    assert a.inflight == b.inflight == 0
    assert all(p.slots == {} for p in call.placements)
    assert fleet.outcomes == [(a.id, Outcome.IGNORED), (b.id, Outcome.IGNORED)]


class Aborted(Exception):
    pass


class Context:
    """A client call's context: `abort` ends the call (grpc raises, so does this)."""

    def __init__(self) -> None:
        self.aborted: list[tuple[grpc.StatusCode, str]] = []

    async def abort(self, code: grpc.StatusCode, details: str, trailers: Any = ()) -> None:
        self.aborted.append((code, details))
        raise Aborted


async def test_a_refused_call_has_no_placement_and_no_reservation() -> None:
    unavailable = verdicts.workers_unavailable("m", "", 1, 1000)

    async def attempt(job: Job, reserved: ReservedPlacement) -> bytes:
        raise AssertionError("never run")

    the_job = job()
    context: Any = Context()
    the_job.call.context = context
    dispatcher = Dispatcher(Upstreams(Fleet(), InflightTable(), 1.0), max_attempts=3)
    with pytest.raises(Aborted):
        await dispatcher.run(the_job, lambda tried: unavailable, attempt)
    assert context.aborted == [(grpc.StatusCode.UNAVAILABLE, unavailable.message)]
    assert the_job.call.placements == [] and the_job.call.record.attempts == 0
    assert the_job.call.record.verdict is unavailable
