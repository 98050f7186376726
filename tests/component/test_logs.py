"""Log lines an operator alerts on and finds a call by, in process: the request line
names who sent the call (principal) and from where (peer); calls refused UNAUTHENTICATED
are logged at a bounded rate, the next line counting those held back; READY with no
usable worker for a model is a warning naming the models."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from structlog.testing import capture_logs

from gateway.observability.logs import Throttle
from gateway.proxy import call_log as calls
from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.extproc import headers_part, process
from tests.support.inproc import client, gateway, sim
from tests.support.waits import until

KEY = "alice-key-0123456789"
GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def requests(logged: Sequence[Mapping[str, Any]], code: str) -> list[Mapping[str, Any]]:
    return [e for e in logged if e["event"] == "request" and e["code"] == code]


async def test_request_lines_name_the_principal_and_the_peer_and_refusals_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    monkeypatch.setattr(calls, "REFUSED_LINES", Throttle(10.0, 20, clock))
    throttle = calls.REFUSED_LINES
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{KEY}\n")
    settings: dict[str, Any] = {"auth.api_keys_file": str(keys)}
    with capture_logs() as logged:
        async with (
            sim("--model", "m") as worker,
            gateway(worker.url(model="m", runtime="sglang"), **settings) as gw,
            client(gw) as ch,
        ):
            stub = sgl_grpc.SglangSchedulerStub(ch)
            keyed = model_md("m", ("authorization", f"Bearer {KEY}"))
            _, error = await collect(stub.Generate(sgl_generate("ok", 2), metadata=keyed))
            assert error is None
            await until(lambda: len(requests(logged, "OK")) == 1)
            (served,) = requests(logged, "OK")
            assert served["principal"] == "key:alice"
            assert served["peer"].startswith("ipv4:127.0.0.1:")
            assert "stage" not in served  # a refusal's line says where it was refused
            # A client without a key, as fast as it can: 20 lines, then 10 a second.
            for i in range(30):
                _, error = await collect(
                    stub.Generate(sgl_generate(f"no{i}", 2), metadata=model_md("m"))
                )
                assert error is not None and error.code() is grpc.StatusCode.UNAUTHENTICATED
            await until(lambda: throttle.suppressed == 10)  # every refused call's line ended
            refused = requests(logged, "UNAUTHENTICATED")
            assert len(refused) == 20
            assert {e["principal"] for e in refused} == {None}
            assert all(e["peer"].startswith("ipv4:127.0.0.1:") for e in refused)
            assert not [e for e in refused if "suppressed" in e]
            assert {e["stage"] for e in refused} == {"open_call"}
            clock.now += 0.1  # room for one more line, which counts the ten held back
            _, error = await collect(stub.Generate(sgl_generate("late", 2), metadata=model_md("m")))
            assert error is not None
            await until(lambda: len(requests(logged, "UNAUTHENTICATED")) == 21)
    last = requests(logged, "UNAUTHENTICATED")[-1]  # the call after the ten
    assert last["suppressed"] == 10  # refused unread: the request id is not known


async def test_ready_with_no_usable_worker_for_a_model_is_a_warning_naming_it() -> None:
    with capture_logs() as logged:
        async with (
            sim("--model", "m", "--not-serving") as down,
            gateway(down.url(model="m", runtime="sglang"), ready=False) as gw,
        ):
            assert gw.parts.health.status("models/m") == health_pb2.HealthCheckResponse.NOT_SERVING
    warned = [e for e in logged if e["event"] == "no_usable_workers"]
    assert [(e["log_level"], e["models"], e["workers"]) for e in warned] == [("warning", ["m"], 1)]


async def test_ready_with_no_worker_at_all_is_a_warning() -> None:
    with capture_logs() as logged:
        async with gateway():
            pass
    warned = [e for e in logged if e["event"] == "no_usable_workers"]
    assert [(e["log_level"], e["models"], e["workers"]) for e in warned] == [("warning", [], 0)]


async def test_a_gateway_with_every_model_served_says_nothing_of_it() -> None:
    with capture_logs() as logged:
        async with sim("--model", "m") as up, gateway(up.url(model="m", runtime="sglang")):
            pass
    assert not [e for e in logged if e["event"] == "no_usable_workers"]


async def test_the_pickers_refusals_are_logged_as_the_relays_bounded_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls without a key through the picker (Envoy's side spoken directly): one ending
    for both doors, so their request lines are bounded by the same throttle, say
    `via=picker` and where they were refused."""
    clock = Clock()
    monkeypatch.setattr(calls, "REFUSED_LINES", Throttle(10.0, 20, clock))
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{KEY}\n")
    settings: dict[str, Any] = {
        "auth.api_keys_file": str(keys),
        "picker.listen": "127.0.0.1:0",
        "auth.failure_limit": 0,  # every call refused for its key, none for its address
    }
    with capture_logs() as logged:
        async with (
            sim("--model", "m") as worker,
            gateway(worker.url(model="m", runtime="sglang"), **settings) as gw,
            aio.insecure_channel(f"127.0.0.1:{gw.picker_port}") as ch,
        ):
            for i in range(30):
                call = process(ch)()
                await call.write(headers_part(GENERATE, model_md("m")))
                answer = (await call.read()).immediate_response
                assert answer.grpc_status.status == grpc.StatusCode.UNAUTHENTICATED.value[0], i
                assert await call.read() is aio.EOF
            await until(lambda: calls.REFUSED_LINES.suppressed == 10)
    refused = requests(logged, "UNAUTHENTICATED")
    assert len(refused) == 20
    assert {(e["via"], e["stage"]) for e in refused} == {("picker", "open_call")}
