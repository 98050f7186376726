"""What the engine reported for each Generate (its closing answers' completion and cached
tokens) goes into the record and the request log beside what the gateway's prefix index
expected, and into `gateway_engine_cached_tokens_total` beside
`gateway_prefix_hit_tokens_total`."""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway.observability.record import CallRecord
from gateway_sim.client import collect, model_md
from tests.support.inproc import client, gateway, idle, recorded, sim

# Four full blocks of 16 and a token (an engine's hit stops short of the last token).
PROMPT = list(range(100, 165))


def generate(request_id: str, n: int = 1, stream: bool = True) -> Any:
    return sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(input_ids=PROMPT),
        sampling_params=sgl.SamplingParams(max_new_tokens=3, n=n),
        stream=stream,
    )


async def test_engine_reported_tokens_are_recorded_beside_the_expected_ones() -> None:
    async with (
        sim("--model", "m", "--block-size", "16") as w,
        gateway(w.url(model="m", runtime="sglang"), default_policy="cache_aware") as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        records: list[CallRecord] = recorded(gw)
        for request_id, n, stream in (("cold", 1, True), ("warm", 1, False), ("two", 2, True)):
            _, error = await collect(
                stub.Generate(generate(request_id, n, stream), metadata=model_md("m"))
            )
            assert error is None
        await idle(gw)
        by_id = {r.request_id: r for r in records}
        figures = {
            i: (r.expected_cached_tokens, r.cached_tokens, r.completion_tokens)
            for i, r in by_id.items()
        }
        # The first call finds nothing; then the index and the engine agree: all 64 cached
        # (n = 2: the prompt once, the completions of both choices).
        assert figures == {"cold": (0, 0, 3), "warm": (64, 64, 3), "two": (64, 64, 6)}
        fields = by_id["warm"].log_fields()
        assert (fields["expected_cached_tokens"], fields["cached_tokens"]) == (64, 64)
        sample = gw.parts.metrics.prometheus.get_sample_value
        assert sample("gateway_engine_cached_tokens_total", {"model": "m"}) == 128
        assert sample("gateway_prefix_hit_tokens_total", {"model": "m"}) == 128
