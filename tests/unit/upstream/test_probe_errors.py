"""A probe that fails inside the gateway (a bug) is logged with its traceback and is no
verdict on the worker; an RPC error, a timeout or an undecodable answer still is one."""

from __future__ import annotations

from typing import Any

import grpc
from grpc import aio
from structlog.testing import capture_logs

from gateway.admin.convert import worker_message
from gateway.admin.v1 import admin_pb2 as pb
from gateway.config import ProbeConfig, WorkerSpec
from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.upstream.health.active import ProbeLoop
from gateway.upstream.signals.probe import ProbeKind, ProbeResult, ProbeState, judge
from gateway.upstream.worker import Worker, WorkerStatus, derive_status
from tests.support.factories import make_worker

SETTINGS = ProbeConfig(interval_s=1.0, timeout_s=1.0, success_threshold=1, failure_threshold=1)
SGLANG = engine_adapters()[Runtime.SGLANG]


class Channel:
    """A worker channel whose every unary call answers `answer` (raised if an exception)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def unary_unary(self, path: str, **_: Any) -> Any:
        async def call(request: Any, **options: Any) -> Any:
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

        return call


def worker(healthy: bool | None = True) -> Worker:
    spec = WorkerSpec("h", 1, "m", Runtime.SGLANG)
    w = make_worker(spec)
    w.probe.healthy = healthy
    return w


def rpc_error(code: grpc.StatusCode, details: str) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details=details)


async def test_a_bug_in_the_probe_is_logged_with_its_traceback_and_judges_nothing() -> None:
    w = worker()
    prober = ProbeLoop(w, None, SGLANG, SETTINGS)  # None.unary_unary: a bug
    with capture_logs() as logs:
        results = [await prober.probe() for _ in range(3)]
    assert {r.kind for r in results} == {ProbeKind.INTERNAL}
    assert results[0].detail == (
        "gateway error (not a verdict on the worker): "
        "AttributeError(\"'NoneType' object has no attribute 'unary_unary'\")"
    )
    # Error level, with the traceback (exc_info), once while the same error repeats.
    assert logs == [
        {
            "event": "probe_internal_error",
            "worker": "h:1",
            "error": "AttributeError(\"'NoneType' object has no attribute 'unary_unary'\")",
            "exc_info": True,
            "log_level": "error",
        }
    ]
    for result in results:
        assert judge(w.probe, result, SETTINGS) is True  # still healthy: no verdict
    assert (w.probe.failures, w.probe.successes) == (0, 0)
    assert w.probe.last is results[-1] and w.probe.last_at > 0
    assert derive_status(False, True, w.probe.healthy) is WorkerStatus.READY
    # The admin API tells it apart from a worker's error.
    w.connected = True
    shown = worker_message(w).last_probe
    assert shown.kind == pb.PROBE_KIND_UNSPECIFIED and shown.detail.startswith("gateway error")


async def test_a_new_worker_whose_probe_has_a_bug_stays_pending_not_unhealthy() -> None:
    w = worker(healthy=None)
    result = await ProbeLoop(w, None, SGLANG, SETTINGS).probe()
    assert judge(w.probe, result, SETTINGS) is None
    assert derive_status(False, True, w.probe.healthy) is WorkerStatus.PENDING


async def test_the_bug_is_logged_again_once_it_changes_or_after_a_good_probe() -> None:
    channel = Channel(TypeError("first"))
    prober = ProbeLoop(worker(), channel, SGLANG, SETTINGS)
    with capture_logs() as logs:
        await prober.probe()
        await prober.probe()
        channel.answer = TypeError("second")
        await prober.probe()
        channel.answer = b""  # an empty HealthCheckResponse: UNKNOWN status, a verdict
        assert (await prober.probe()).kind is ProbeKind.NOT_SERVING
        channel.answer = TypeError("second")
        await prober.probe()
    assert [e["error"] for e in logs] == [
        "TypeError('first')",
        "TypeError('second')",
        "TypeError('second')",
    ]


async def test_rpc_errors_timeouts_and_bad_answers_stay_verdicts() -> None:
    cases = [
        (rpc_error(grpc.StatusCode.UNAVAILABLE, "down"), ProbeKind.ERROR, "UNAVAILABLE: down"),
        (
            rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
            ProbeKind.ERROR,
            "DEADLINE_EXCEEDED: Deadline Exceeded",
        ),
        (rpc_error(grpc.StatusCode.NOT_FOUND, "x"), ProbeKind.NOT_SERVING, "grpc.health: "),
        (b"\xff", ProbeKind.ERROR, "bad answer: DecodeError("),
    ]
    for answer, kind, detail in cases:
        w = worker()
        with capture_logs() as logs:
            result = await ProbeLoop(w, Channel(answer), SGLANG, SETTINGS).probe()
        assert result.kind is kind and result.detail.startswith(detail), result
        assert logs == []  # a worker's failure is no gateway error
        assert judge(w.probe, result, SETTINGS) is False  # failure_threshold 1: unhealthy


def test_judge_counts_nothing_for_an_internal_result() -> None:
    state = ProbeState(healthy=True, successes=1, failures=0)
    settings = ProbeConfig(success_threshold=2, failure_threshold=2)
    judge(state, ProbeResult(ProbeKind.ERROR, "UNAVAILABLE"), settings)
    assert (state.healthy, state.failures) == (True, 1)
    judge(state, ProbeResult(ProbeKind.INTERNAL, "bug"), settings)
    assert (state.healthy, state.failures, state.successes) == (True, 1, 0)
    judge(state, ProbeResult(ProbeKind.ERROR, "UNAVAILABLE"), settings)
    assert (state.healthy, state.failures) == (False, 2)
