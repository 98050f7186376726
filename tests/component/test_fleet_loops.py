"""The fleet's background work survives whatever a worker answers, and run-time
registration is race-free."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway.config import build_config, parse_worker_url
from gateway.core import tasks as tasks_module
from gateway.engines import engine_adapters
from gateway.placement.policies import build_policy
from gateway.upstream.manager import Fleet, WorkerExists
from gateway.upstream.signals.probe import ProbeKind
from gateway.upstream.worker import WorkerStatus
from tests.support.waits import until


@pytest.fixture
async def garbled() -> AsyncIterator[tuple[str, list[int]]]:
    """A 'worker' with no grpc.health whose engine HealthCheck answers bytes that do not
    decode; the list counts the HealthCheck calls it got."""
    calls: list[int] = []

    async def health_check(request: bytes, context: aio.ServicerContext) -> bytes:
        calls.append(1)
        return b"\xff"  # a truncated varint: no protobuf message parses it

    server = aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "sglang.grpc.scheduler.SglangScheduler",
                {"HealthCheck": grpc.unary_unary_rpc_method_handler(health_check)},
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", calls
    await server.stop(None)


async def test_probing_goes_on_after_an_answer_that_does_not_decode(
    garbled: tuple[str, list[int]],
) -> None:
    address, calls = garbled
    config = build_config(
        worker_urls=[f"grpc://{address}?model=m&runtime=sglang"],
        overrides={"probe.interval_s": 0.02, "probe.failure_threshold": 2},
    )
    fleet = Fleet(config, engine_adapters(), build_policy)
    try:
        await fleet.start(config.workers)
        worker = fleet.registry.get(address)
        assert worker is not None
        await until(lambda: len(calls) >= 3)
        last = worker.probe.last
        assert last is not None and last.kind is ProbeKind.ERROR
        assert last.detail.startswith("bad answer: DecodeError(")
        assert worker.status is WorkerStatus.NOT_READY
    finally:
        await fleet.close()


async def test_a_background_loop_that_raises_is_logged_once_and_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tasks_module, "RESTART_S", 0.0)
    config = build_config(worker_urls=["grpc://127.0.0.1:1?model=m&runtime=sglang"])
    fleet = Fleet(config, engine_adapters(), build_policy)
    runs: list[int] = []
    finished = asyncio.Event()

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise ValueError("undecodable answer")
        finished.set()

    try:
        await fleet.start(config.workers)
        worker = fleet.registry.get("127.0.0.1:1")
        assert worker is not None
        with capture_logs() as logs:
            fleet._keep(worker, "flaky", flaky)
            async with asyncio.timeout(5):
                await finished.wait()
        assert len(runs) == 3
        failures = [e for e in logs if e["event"] == "loop_failed"]
        assert [type(e.pop("exc_info")) for e in failures] == [ValueError]  # its traceback
        assert failures == [
            {
                "event": "loop_failed",
                "loop": "flaky",
                "worker": "127.0.0.1:1",
                "error": "ValueError('undecodable answer')",
                "log_level": "error",
            }
        ]
    finally:
        await fleet.close()


async def test_concurrent_adds_of_one_address_register_it_once() -> None:
    fleet = Fleet(build_config(), engine_adapters(), build_policy)
    spec = parse_worker_url("grpc://127.0.0.1:1?model=m&runtime=sglang")
    try:
        results = await asyncio.gather(fleet.add(spec), fleet.add(spec), return_exceptions=True)
        assert len(fleet.registry) == 1
        added = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, WorkerExists)]
        assert len(added) == 1 and len(refused) == 1
        assert str(refused[0]) == "worker 127.0.0.1:1 is already registered"
    finally:
        await fleet.close()
