"""The per-call series from real calls, in process: a streamed Generate through the gateway
to a simulated worker is observed once in the duration and inter-token histograms (the
latter from the call's record: its end, its first message, its message count) and its
completion tokens counted; then /metrics scraped over HTTP shows the process's own
series, the build, the outlier state set, and no `_created`."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.record import mean_gap
from gateway_sim.client import collect, model_md, sgl_generate, sgl_grpc
from tests.support.inproc import client, gateway, idle, recorded, sim
from tests.support.waits import until

pytestmark = pytest.mark.timeout(60)

SGL = "sglang.grpc.scheduler.SglangScheduler"
TOKENS = 20
TOKEN_MS = 10


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


async def test_a_streamed_generate_is_timed_once_and_its_tokens_counted() -> None:
    async with (
        sim("--model", "m", "--token-ms", str(TOKEN_MS)) as worker,
        gateway(worker.url(model="m", runtime="sglang")) as gw,
        client(gw) as ch,
    ):
        records = recorded(gw)
        call = sgl_grpc.SglangSchedulerStub(ch).Generate(
            sgl_generate("r1", tokens=TOKENS), metadata=model_md("m")
        )
        messages, error = await collect(call)
        assert error is None and len(messages) == TOKENS + 1  # a chunk per token, Complete
        await until(lambda: len(records) == 1)
        await idle(gw)
        [record] = records
        assert record.messages == TOKENS + 1 and record.first_message_s is not None

        metric = gw.parts.metrics.prometheus.get_sample_value
        answered = {"model": "m", "service": SGL, "rpc": "Generate", "code": "OK"}
        where = {"model": "m", "service": SGL}
        assert metric("gateway_request_duration_seconds_count", answered) == 1
        duration = metric("gateway_request_duration_seconds_sum", answered)
        assert duration is not None and duration >= record.first_message_s
        assert metric("gateway_inter_token_seconds_count", where) == 1
        gap = metric("gateway_inter_token_seconds_sum", where)
        # The same end as the duration's: (end - first message) / (messages - 1).
        assert gap == pytest.approx(mean_gap(duration, record.first_message_s, record.messages))
        # 20 tokens 10 ms apart over 20 gaps (the Complete follows the last chunk at once):
        # at least 19/20 of 10 ms, whatever else the machine does.
        assert gap is not None and gap >= 0.9 * TOKEN_MS / 1000 * (TOKENS - 1) / TOKENS
        assert metric("gateway_generated_tokens_total", {"model": "m"}) == TOKENS

        port = gw.parts.metrics.serve("127.0.0.1:0")
        try:
            text = await asyncio.to_thread(fetch, port)
        finally:
            gw.parts.metrics.close()
    assert "_created" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    unlabelled = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    for name in (
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ):
        assert unlabelled[name] > 0, name
    [info] = families["gateway_build_info"].samples
    assert info.value == 1 and set(info.labels) == {"version", "python", "grpcio"}
    outlier = {s.labels["state"]: s.value for s in families["gateway_worker_outlier"].samples}
    assert outlier == {"closed": 1.0, "half_open": 0.0, "open": 0.0}
    assert families["gateway_request_duration_seconds"].type == "histogram"
    assert families["gateway_inter_token_seconds"].type == "histogram"
