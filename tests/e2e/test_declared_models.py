"""The seed's rule end to end: a model the configuration declares whose workers are down
or not yet identified answers UNAVAILABLE (WORKERS_UNAVAILABLE, 503, retry info), never
NOT_FOUND: a worker URL's `model=`, a `models:` entry, an alias target, and a PD leg
whose worker has not answered yet. The unidentified worker is listed as such by the
admin API and joins once it listens. And the vocabulary bound: a prompt token id past
the model's vocabulary is refused at the gateway (the worker never sees it)."""

from __future__ import annotations

import grpc
from smg_grpc_proto import sglang_scheduler_pb2 as sgl
from smg_grpc_proto import vllm_engine_pb2 as vllm

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway.services.health import NOT_SERVING
from gateway_sim.client import (
    admin_address,
    channel,
    closed_port,
    collect,
    dead_worker_url,
    health_check,
    model_md,
    sgl_generate,
    stub_for,
    vllm_generate,
    wait_health,
    write_config,
)
from gateway_sim.launch import worker_url
from tests.support.availability import is_ready, wait_worker
from tests.support.helpers import assert_verdict
from tests.support.launch import Launcher

DOWN_MESSAGE = (
    "Model '{model}' has no {what} up or identified yet; 1 named worker is still being "
    "asked what it serves"
)
UNAVAILABLE = {"httpStatus": "503", "code": "no_available_workers"}


async def generate_error(
    address: str, model: str, runtime: str = "sglang", request: object = None
) -> grpc.aio.AioRpcError:
    async with channel(address) as ch:
        call = stub_for(ch, runtime).Generate(
            request or (vllm_generate("d1") if runtime == "vllm" else sgl_generate("d1")),
            metadata=model_md(model),
            timeout=10,
        )
        messages, error = await collect(call)
    assert messages == []
    assert error is not None
    return error


async def test_a_declared_model_whose_only_worker_is_down_is_unavailable_until_it_joins(
    sim: Launcher, gateway: Launcher
) -> None:
    sock = closed_port()
    port = sock.getsockname()[1]
    gw = gateway("--worker", dead_worker_url(sock, model="m"), "--admin-listen", "127.0.0.1:0")
    error = await generate_error(gw.address, "m")
    assert_verdict(
        error,
        grpc.StatusCode.UNAVAILABLE,
        "WORKERS_UNAVAILABLE",
        DOWN_MESSAGE.format(model="m", what="worker"),
        {"model": "m", "leg": "", **UNAVAILABLE},
        retry_s=1,
        pushback_ms=1000,
    )
    unknown = await generate_error(gw.address, "nope")  # nobody declares it: unknown
    assert unknown.code() is grpc.StatusCode.NOT_FOUND
    assert await health_check(gw.address, "models/m") == NOT_SERVING  # known, not unknown

    listed = await wait_worker(
        admin_address(gw),
        f"127.0.0.1:{port}",
        lambda w: w.status == admin_pb.WORKER_STATUS_UNIDENTIFIED and "failed" in w.status_cause,
    )
    assert (listed.model, listed.runtime, listed.sources) == ("m", "", ["static"])

    sock.close()  # the worker comes up on its port: identified, registered, served
    sim("--model", "m", "--listen", f"127.0.0.1:{port}")
    await wait_worker(admin_address(gw), f"127.0.0.1:{port}", is_ready)
    await wait_health(gw.address, "m")
    async with channel(gw.address) as ch:
        messages, error = await collect(
            stub_for(ch).Generate(sgl_generate("d2"), metadata=model_md("m"), timeout=10)
        )
    assert error is None and messages


async def test_a_models_entry_and_an_alias_target_with_no_worker_are_unavailable(
    sim: Launcher, gateway: Launcher, tmp_path: object
) -> None:
    served = sim("--model", "other")
    config = write_config(
        tmp_path,  # type: ignore[arg-type]
        {
            "workers": [worker_url(served, model="other", runtime="sglang")],
            "models": {"m": {}, "chat": {"route": [{"model": "m", "weight": 1}]}},
        },
    )
    gw = gateway("--config", config)
    await wait_health(gw.address, "other")
    error = await generate_error(gw.address, "m")
    message = "Model 'm' has no worker up or identified yet (its workers are down or not yet "
    message += "discovered)"
    metadata = {"model": "m", "leg": "", **UNAVAILABLE}
    assert_verdict(
        error, grpc.StatusCode.UNAVAILABLE, "WORKERS_UNAVAILABLE", message, metadata,
        retry_s=1, pushback_ms=1000,
    )  # fmt: skip
    aliased = await generate_error(gw.address, "chat")
    assert_verdict(
        aliased,
        grpc.StatusCode.UNAVAILABLE,
        "WORKERS_UNAVAILABLE",
        "Model 'chat' routes to m, and none can take a call now: " + message,
        {"model": "chat", "leg": "", **UNAVAILABLE},
        retry_s=1,
        pushback_ms=1000,
    )


async def test_a_pd_leg_whose_worker_is_not_identified_yet_is_unavailable(
    sim: Launcher, gateway: Launcher
) -> None:
    decode = sim("--runtime", "vllm", "--role", "decode", "--model", "m")
    sock = closed_port()
    port = sock.getsockname()[1]
    gw = gateway(
        "--worker",
        worker_url(decode, model="m", runtime="vllm", role="decode"),
        "--worker",
        dead_worker_url(sock, model="m", role="prefill"),  # runtime asked: it is down
    )
    error = await generate_error(gw.address, "m", "vllm")
    assert_verdict(
        error,
        grpc.StatusCode.UNAVAILABLE,
        "WORKERS_UNAVAILABLE",
        DOWN_MESSAGE.format(model="m", what="prefill worker"),
        {"model": "m", "leg": "prefill", **UNAVAILABLE},
        retry_s=1,
        pushback_ms=1000,
    )
    sock.close()
    sim("--runtime", "vllm", "--role", "prefill", "--model", "m", "--listen", f"127.0.0.1:{port}")
    await wait_health(gw.address, "m", "vllm")
    async with channel(gw.address) as ch:
        messages, error = await collect(
            stub_for(ch, "vllm").Generate(vllm_generate("d3"), metadata=model_md("m"), timeout=10)
        )
    assert error is None and messages


async def test_a_token_id_past_the_vocabulary_is_refused_before_any_worker(
    sim: Launcher, gateway: Launcher, tmp_path: object
) -> None:
    # vLLM reports its model's vocabulary (SGLang's servicer a default one, 128,256).
    reported = sim("--runtime", "vllm", "--model", "m", "--vocab-size", "512")
    bounded = sim("--runtime", "vllm", "--model", "b", "--vocab-size", "512")
    config = write_config(
        tmp_path,  # type: ignore[arg-type]
        {
            "workers": [
                worker_url(reported, model="m", runtime="vllm"),
                worker_url(bounded, model="b", runtime="vllm"),
            ],
            "models": {"b": {"vocab_size": 100}},
        },
    )
    gw = gateway("--config", config)
    await wait_health(gw.address, "m", "vllm")
    await wait_health(gw.address, "b", "vllm")
    prompt = vllm.GenerateRequest(
        request_id="v1",
        tokenized=vllm.TokenizedInput(input_ids=[1, 600, 2]),
        sampling_params=vllm.SamplingParams(max_tokens=2),
        stream=True,
    )
    error = await generate_error(gw.address, "m", "vllm", prompt)  # asked as it joined
    assert_verdict(
        error,
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_OVER_LIMIT",
        "tokenized.input_ids holds token id 600, outside the vocabulary of model 'm' "
        "(512 ids, 0 to 511: as its workers report)",
        {
            "model": "m",
            "leg": "",
            "field": "tokenized.input_ids",
            "limit": "511",
            "token_id": "600",
            "httpStatus": "400",
            "code": "request_over_limit",
        },
    )
    configured = vllm.GenerateRequest(
        request_id="v2",
        tokenized=vllm.TokenizedInput(input_ids=[1, 150]),
        sampling_params=vllm.SamplingParams(max_tokens=2),
        stream=True,
    )
    refused = await generate_error(gw.address, "b", "vllm", configured)
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().endswith("(100 ids, 0 to 99: models.b.vocab_size)")
    async with channel(gw.address) as ch:  # in bounds: served
        inside = vllm.GenerateRequest(
            request_id="v3",
            tokenized=vllm.TokenizedInput(input_ids=[1, 99]),
            sampling_params=vllm.SamplingParams(max_tokens=2),
            stream=True,
        )
        messages, error = await collect(
            stub_for(ch, "vllm").Generate(inside, metadata=model_md("b"), timeout=10)
        )
    assert error is None and messages


async def test_an_empty_prompt_is_refused_before_any_worker(
    sim: Launcher, gateway: Launcher
) -> None:
    """SGLang's scheduler crashes on an empty prompt (and a retry would take the next
    worker down too): refused at the gateway, for every engine; a model nobody serves is
    still NOT_FOUND first (the README's `-d '{}'`)."""
    worker = sim("--model", "m")
    gw = gateway("--worker", worker_url(worker, model="m", runtime="sglang"))
    await wait_health(gw.address, "m")
    empty = sgl.GenerateRequest(
        request_id="e1", sampling_params=sgl.SamplingParams(max_new_tokens=2), stream=True
    )
    error = await generate_error(gw.address, "m", request=empty)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "The prompt is empty: tokenized.input_ids holds no token id"
    unknown = await generate_error(gw.address, "nope", request=empty)
    assert unknown.code() is grpc.StatusCode.NOT_FOUND
