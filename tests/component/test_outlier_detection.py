"""Outlier detection through the front, in process (tests/component/harness): N
consecutive worker failures eject the worker (open), the cool-down admits exactly one
trial, client errors never count. Its subject is the gateway's placement and outlier
detection, which the calls reach over a real gRPC connection either way; the admin
WatchWorkers stream and ListWorkers are read over the admin port, the metrics from the
gateway's registry.
(It was an end-to-end test with a 1 s cool-down; in process too, 1 s leaves room for
the six calls that must fall within one on a machine busy with other work.) Every wait
for an outlier event is bounded by WAIT_S, a safety net: each returns as the event comes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import pytest
from grpc import aio
from structlog.testing import capture_logs

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway_sim.client import channel, collect, list_workers, model_md, sgl_generate, sgl_grpc
from tests.support.availability import admin_watch
from tests.support.inproc import gateway, sim
from tests.support.waits import WAIT_S, until

THRESHOLD, COOLDOWN_S = 3, 1.0


def outlier_event(worker_id: str, old: int, new: int) -> Any:
    def match(event: Any) -> bool:
        return bool(
            event.kind == admin_pb.WORKER_EVENT_KIND_BREAKER
            and event.worker.id == worker_id
            and event.breaker_change.old_state == old
            and event.breaker_change.new_state == new
        )

    return match


async def call(
    stub: Any, request_id: str, *extra: tuple[str, str]
) -> tuple[str, int, aio.AioRpcError | None]:
    """One Generate: (worker name or "", messages, error)."""
    c = stub.Generate(sgl_generate(request_id, tokens=2), metadata=model_md("m", *extra), timeout=5)
    messages, error = await collect(c)
    worker = dict(await c.initial_metadata() or ()).get("x-sim-worker", "")
    return str(worker), len(messages), error


async def events_for(
    logs: Sequence[Mapping[str, Any]], prefix: str, count: int
) -> list[Mapping[str, Any]]:
    """The request events of Generate calls whose id starts with `prefix`, once `count`
    are logged (the line follows the reply)."""

    def found() -> list[Mapping[str, Any]]:
        return [
            e
            for e in logs
            if e.get("event") == "request"
            and e.get("rpc") == "Generate"
            and str(e.get("request_id", "")).startswith(prefix)
        ]

    await until(lambda: len(found()) >= count)
    return found()


# Serial from its start: run_alone() mid-test would block this event loop (gateway and
# workers included) while it waits; steps are timed against the cool-down.
@pytest.mark.serial
async def test_outlier_detection_ejects_admits_one_trial_and_ignores_client_errors() -> None:
    # `bad` fails every Generate with INTERNAL after its first message (so a trial stays
    # in flight for a moment when the request asks for a slow first token).
    outlier: dict[str, Any] = {
        "outlier_detection.failure_threshold": THRESHOLD,
        "outlier_detection.cooldown_s": COOLDOWN_S,
        "outlier_detection.success_threshold": 1,
        "probe.interval_s": 0.2,
        "migration.enabled": False,  # each INTERNAL reaches the client (none goes on)
    }
    bad_flags = ("--model", "m", "--name", "bad", "--fail-code", "INTERNAL", "--fail-after", "1")
    with capture_logs() as logs:
        async with (
            sim(*bad_flags) as bad,
            sim("--model", "m", "--name", "good") as good,
            gateway(
                bad.url(model="m", runtime="sglang"),
                good.url(model="m", runtime="sglang"),
                **outlier,
            ) as gw,
            channel(f"127.0.0.1:{gw.port}") as ch,
            aio.insecure_channel(f"127.0.0.1:{gw.admin_port}") as admin_ch,
        ):
            admin = f"127.0.0.1:{gw.admin_port}"
            stub = sgl_grpc.SglangSchedulerStub(ch)
            watch = admin_watch(admin_ch)
            metric = gw.parts.metrics.prometheus.get_sample_value

            # 1. Client errors say the worker answered: twice the threshold of
            #    INVALID_ARGUMENT on each worker leaves both closed.
            invalid = (("x-sim-fail-code", "INVALID_ARGUMENT"), ("x-sim-fail-after", "0"))
            for i in range(4 * THRESHOLD):
                _, _, error = await call(stub, f"inv{i}", *invalid)
                assert error is not None and error.code() is grpc.StatusCode.INVALID_ARGUMENT
            workers = await list_workers(admin)
            assert [w.breaker_state for w in workers.values()] == [
                admin_pb.BREAKER_STATE_CLOSED
            ] * 2
            inv = await events_for(logs, "inv", 4 * THRESHOLD)
            assert len([e for e in inv if e["worker"] == bad.address]) == 2 * THRESHOLD

            # 2. INTERNAL from `bad` THRESHOLD times in a row ejects it (open).
            failed = 0
            for i in range(2 * THRESHOLD):
                name, messages, error = await call(stub, f"open{i}")
                if name == "bad":
                    assert error is not None and error.code() is grpc.StatusCode.INTERNAL
                    assert messages == 1
                    failed += 1
                else:
                    assert error is None and name == "good"
            assert failed == THRESHOLD
            opened_at, opened = await watch.wait_for(
                outlier_event(
                    bad.address, admin_pb.BREAKER_STATE_CLOSED, admin_pb.BREAKER_STATE_OPEN
                ),
                WAIT_S,
            )
            workers = await list_workers(admin)
            assert workers[bad.address].breaker_state == admin_pb.BREAKER_STATE_OPEN
            assert workers[bad.address].status == admin_pb.WORKER_STATUS_READY  # probes pass
            assert workers[good.address].breaker_state == admin_pb.BREAKER_STATE_CLOSED
            assert metric("gateway_worker_outlier_state", {"worker": bad.address}) == 2.0
            assert metric("gateway_worker_outlier_state", {"worker": good.address}) == 0.0
            for address, current in ((bad.address, "open"), (good.address, "closed")):
                for state in ("closed", "half_open", "open"):
                    labels = {"worker": address, "state": state}
                    assert metric("gateway_worker_outlier", labels) == (state == current)

            # 3. While it is open, every request goes to the other worker.
            for i in range(6):
                name, _, error = await call(stub, f"cool{i}")
                assert (name, error) == ("good", None)
            assert time.monotonic() - opened_at < COOLDOWN_S  # all inside the cool-down
            assert {e["worker"] for e in await events_for(logs, "cool", 6)} == {good.address}

            # 4. After the cool-down, a burst: exactly one request is the trial on `bad`.
            await watch.wait_for(
                outlier_event(
                    bad.address, admin_pb.BREAKER_STATE_OPEN, admin_pb.BREAKER_STATE_OPEN
                ),
                COOLDOWN_S + WAIT_S,
            )
            cooled = time.monotonic() - opened_at
            slow = ("x-sim-ttft-ms", "300")
            results = await asyncio.gather(*(call(stub, f"trial{i}", slow) for i in range(8)))
            names = sorted(name for name, _, _ in results)
            assert names == ["bad"] + ["good"] * 7, names
            for name, messages, error in results:
                if name == "bad":
                    assert error is not None and error.code() is grpc.StatusCode.INTERNAL
                else:
                    assert error is None and messages == 3
            trial_events = await events_for(logs, "trial", 8)
            assert sorted(e["worker"] for e in trial_events) == sorted(
                [bad.address] + [good.address] * 7
            )
            assert all(e["attempts"] == 1 for e in trial_events)
            await watch.wait_for(
                outlier_event(
                    bad.address, admin_pb.BREAKER_STATE_OPEN, admin_pb.BREAKER_STATE_HALF_OPEN
                ),
                WAIT_S,
            )
            # The trial failed: open again, for another cool-down.
            reopened_at, _ = await watch.wait_for(
                outlier_event(
                    bad.address, admin_pb.BREAKER_STATE_HALF_OPEN, admin_pb.BREAKER_STATE_OPEN
                ),
                WAIT_S,
            )
            assert (await list_workers(admin))[bad.address].breaker_state == (
                admin_pb.BREAKER_STATE_OPEN
            )

            # 5. A trial that succeeds (the request switches the failure off) closes it.
            await watch.wait_for(
                outlier_event(
                    bad.address, admin_pb.BREAKER_STATE_OPEN, admin_pb.BREAKER_STATE_OPEN
                ),
                COOLDOWN_S + WAIT_S,
                after=reopened_at,
            )
            healed = ("x-sim-fail-code", "ok")
            served = [(await call(stub, f"heal{i}", healed))[0] for i in range(4)]
            assert "bad" in served and "good" in served, served
            closed_at, _ = await watch.wait_for(
                outlier_event(
                    bad.address, admin_pb.BREAKER_STATE_HALF_OPEN, admin_pb.BREAKER_STATE_CLOSED
                ),
                WAIT_S,
            )
            assert (await list_workers(admin))[bad.address].breaker_state == (
                admin_pb.BREAKER_STATE_CLOSED
            )
            await watch.close()
    print(
        f"\n[outlier] opened after {THRESHOLD} failures (cause {opened.cause!r}); cool-down over "
        f"{cooled:.3f}s later; reopened by the failed trial; closed "
        f"{closed_at - reopened_at:.3f}s after the reopen by a good trial"
    )
