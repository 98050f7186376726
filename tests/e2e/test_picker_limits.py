"""The picker port held to the main port's rules, spoken to directly as Envoy would (a
raw ext_proc client, real processes): streams that stop after their headers end within
the read timeout and never take the main port's turns; a placed call nobody answers
gives its worker's slot back at its deadline; a stream handed to the relay ends after
its answer; a header bomb is refused at once; wrong keys sent through the picker never
lock a client out of the main port."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from grpc import aio

from gateway.config.picker import DESTINATION_HEADER
from gateway_sim.client import (
    SGL,
    channel,
    collect,
    model_md,
    sgl_generate,
    sgl_grpc,
    wait_health,
    write_config,
)
from gateway_sim.launch import Child, worker_url
from tests.support.extproc import body_part, headers_part, process
from tests.support.launch import Launcher
from tests.support.processes import scrape
from tests.support.waits import until

READ_S = 2.0  # limits.request_read_timeout_s of these gateways
GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
KEY = "alice-key-0123456789"
WAIT_S = 20.0


def picker_gateway(
    gateway: Launcher, tmp_path: Path, workers: Sequence[Child], **settings: object
) -> Child:
    limits = {"request_read_timeout_s": READ_S, "max_request_reads": 4}
    config = {
        "limits": limits | dict(settings.pop("limits", {})),  # type: ignore[call-overload]
        "workers": [worker_url(w, model="m", runtime="sglang") for w in workers],
        **settings,
    }
    return gateway("--picker-listen", "127.0.0.1:0", "--config", write_config(tmp_path, config))


async def main_port_ok(gw: Child, count: int, md: Sequence[tuple[str, str]] = ()) -> list[str]:
    """`count` Generate calls on the main port, their codes."""
    async with channel(gw.address) as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        calls = [
            stub.Generate(sgl_generate(f"main{i}"), metadata=(*model_md("m"), *md), timeout=10)
            for i in range(count)
        ]
        results = await asyncio.gather(*(collect(call) for call in calls))
    return ["OK" if error is None else error.code().name for _, error in results]


async def test_header_only_streams_end_within_the_read_timeout_and_leave_the_main_port_alone(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """40 streams that send a Generate's headers and never its body: the main port (4
    read turns in all) serves every call meanwhile, and each stream is answered
    DEADLINE_EXCEEDED (408) once its read timeout has passed, then ended."""
    gw = picker_gateway(gateway, tmp_path, [sim("--model", "m")])
    await wait_health(gw.address, "m", "sglang")
    async with channel(gw.extra["picker"]) as ch:
        opened = time.monotonic()
        calls = [process(ch)() for _ in range(40)]
        for call in calls:
            await call.write(headers_part(GENERATE, model_md("m")))
        firsts = [await call.read() for call in calls]
        assert all(a.WhichOneof("response") == "request_headers" for a in firsts)
        assert await main_port_ok(gw, 8) == ["OK"] * 8  # while all 40 wait for a body
        lasts = [await call.read() for call in calls]
        ended = time.monotonic() - opened
        for answer in lasts:
            immediate = answer.immediate_response
            assert immediate.grpc_status.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            assert "request_read_timeout_s" in immediate.body
        assert [await call.read() for call in calls] == [aio.EOF] * 40
        assert [await call.code() for call in calls] == [grpc.StatusCode.OK] * 40
    print(f"\n[header-only picker streams] 40 ended {ended:.2f} s after opening (read {READ_S} s)")
    assert ended >= READ_S  # ended by the timeout, not before
    assert await main_port_ok(gw, 4) == ["OK"] * 4


async def test_a_placed_call_nobody_answers_gives_its_slot_back_at_its_deadline(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """Two placed calls on a model that runs two at once, never followed by a response
    (Envoy would have sent the response's headers): main-port calls are refused while
    they hold the slots, and served once their deadline (3 s) has passed and the picker
    gave them up, ending their streams itself."""
    worker = sim("--model", "m")
    gw = picker_gateway(gateway, tmp_path, [worker], models={"m": {"max_inflight": 2}})
    await wait_health(gw.address, "m", "sglang")
    request = sgl_generate("held").SerializeToString()
    async with channel(gw.extra["picker"]) as ch:
        held = []
        for i in range(2):
            call = process(ch)()
            md = (*model_md("m"), ("grpc-timeout", "3S"), ("x-request-id", f"held{i}"))
            await call.write(headers_part(GENERATE, md))
            assert (await call.read()).WhichOneof("response") == "request_headers"
            await call.write(body_part(request))
            placed = await call.read()
            assert placed.request_body.response.header_mutation.set_headers, placed
            held.append(call)
        placed_at = time.monotonic()
        assert await main_port_ok(gw, 1) == ["RESOURCE_EXHAUSTED"]

        async def served_again() -> bool:
            return await main_port_ok(gw, 1) == ["OK"]

        await until(served_again, WAIT_S, what="a main-port call served", every_s=0.25)
        freed = time.monotonic() - placed_at
        for call in held:  # the picker gave them up and ended their streams: not Envoy
            assert await call.read() is aio.EOF
            assert await call.code() is grpc.StatusCode.OK
    print(f"\n[held picker calls] the worker's slots came back {freed:.2f} s after placing")
    assert freed >= 2.0  # at their deadline (3 s after their headers), not before
    inflight = f'gateway_worker_inflight{{worker="{worker.address}"}}'
    assert scrape(gw)[inflight] == 0


async def test_a_call_handed_to_the_relay_ends_its_stream_after_the_answer(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """A HealthCheck (the relay's to run) gets its destination, and then the picker ends
    the stream: Envoy goes on alone, and nothing of the call stays in the picker."""
    gw = picker_gateway(gateway, tmp_path, [sim("--model", "m")])
    async with channel(gw.extra["picker"]) as ch:
        call = process(ch)()
        await call.write(headers_part(SGL + "HealthCheck"))
        answer = await call.read()
        mutation = answer.request_headers.response.header_mutation
        assert [h.header.key for h in mutation.set_headers] == [DESTINATION_HEADER]
        assert await call.read() is aio.EOF
        assert await call.code() is grpc.StatusCode.OK


async def test_a_header_bomb_is_refused_at_once(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """200,000 headers (3 MB, past the picker's message bound too) and 2,000 small ones
    (under it, past the count): each refused at once, the gateway serving on."""
    gw = picker_gateway(gateway, tmp_path, [sim("--model", "m")])
    await wait_health(gw.address, "m", "sglang")
    async with channel(gw.extra["picker"]) as ch:
        bomb = process(ch)()
        await bomb.write(headers_part(GENERATE, [(f"x-{i}", "v" * 8) for i in range(200_000)]))
        with pytest.raises(aio.AioRpcError) as raised:
            await bomb.read()
        assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # grpc's own bound
        many = process(ch)()
        await many.write(headers_part(GENERATE, [(f"x{i}", "") for i in range(2_000)]))
        answer = (await many.read()).immediate_response
        assert answer.grpc_status.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "2002 headers" in answer.body
        assert await many.read() is aio.EOF
    assert await main_port_ok(gw, 2) == ["OK", "OK"]


async def test_wrong_keys_through_the_picker_never_lock_out_the_main_port(
    sim: Launcher, gateway: Launcher, tmp_path: Path
) -> None:
    """25 wrong keys through the picker, claiming to come from 127.0.0.1 too: the
    picker blocks the address on its own port (a right key is refused there too), and a
    main-port client on 127.0.0.1 with the right key is served."""
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{KEY}\n")
    gw = picker_gateway(gateway, tmp_path, [sim("--model", "m")], auth={"api_keys_file": str(keys)})
    good = (("authorization", f"Bearer {KEY}"),)

    async def served() -> bool:
        return await main_port_ok(gw, 1, good) == ["OK"]

    await until(served, WAIT_S, what="the worker ready")
    codes = []
    async with channel(gw.extra["picker"]) as ch:
        for i in range(26):
            md = (*model_md("m"), ("authorization", f"Bearer wrong{i}"))
            md += (("x-forwarded-for", "127.0.0.1"),)
            if i == 25:
                md = (*model_md("m"), *good)
            call = process(ch)()
            await call.write(headers_part(GENERATE, md))
            answer = (await call.read()).immediate_response
            codes.append((answer.grpc_status.status, answer.body))
            call.cancel()
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert {code for code, _ in codes} == {unauthenticated}
    assert codes[-1][1] == "too many failed attempts, retry later"  # the right key too
    assert await main_port_ok(gw, 2, good) == ["OK", "OK"]
    samples = scrape(gw)
    assert samples['gateway_auth_failures_total{reason="throttled"}'] >= 1
