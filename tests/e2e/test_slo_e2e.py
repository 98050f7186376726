"""Latency objectives against real processes, with grpcurl (server reflection): an
objective header that names no time is INVALID_ARGUMENT naming it, one that does is
served and counted in `gateway_slo_calls_total`; a generous objective is met."""

from __future__ import annotations

import json

import grpc

from gateway_sim.client import SGL_SERVICE
from gateway_sim.launch import worker_url
from tests.support.availability import labels, samples, scrape
from tests.support.helpers import wait_for_events
from tests.support.launch import Launcher, grpcurl

REQUEST = json.dumps(
    {
        "request_id": "slo-1",
        "tokenized": {"input_ids": [1, 2, 3]},
        "sampling_params": {"max_new_tokens": 4},
        "stream": True,
    }
)


def generate(address: str, *headers: str) -> tuple[int, str, str]:
    flags = [arg for header in ("x-model-id: m", *headers) for arg in ("-H", header)]
    done = grpcurl("-plaintext", *flags, "-d", REQUEST, address, f"{SGL_SERVICE}/Generate")
    return done.returncode, done.stdout, done.stderr


async def test_objective_headers_through_grpcurl(sim: Launcher, gateway: Launcher) -> None:
    worker = sim("--model", "m")
    gw = gateway(
        "--worker", worker_url(worker, model="m", runtime="sglang"), "--policy", "predicted_latency"
    )
    code, out, err = generate(gw.address, "x-slo-ttft-ms: soon")
    assert code == 64 + grpc.StatusCode.INVALID_ARGUMENT.value[0], err
    assert "Code: InvalidArgument" in err and "x-slo-ttft-ms" in err
    code, out, err = generate(gw.address, "x-slo-tpot-ms: 0")
    assert code == 64 + grpc.StatusCode.INVALID_ARGUMENT.value[0], err
    for _ in range(3):
        code, out, err = generate(gw.address, "x-slo-ttft-ms: 60000", "x-slo-tpot-ms: 5000")
        assert code == 0, err
        assert '"finish_reason": "length"' in out
    wait_for_events(gw.log_path, 5, rpc="Generate")
    counted = samples(scrape(gw), "gateway_slo_calls_total")
    assert counted == {labels(model="m", **{"class": ""}, outcome="met"): 3.0}
