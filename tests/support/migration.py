"""What the in-process migration tests share (tests/component/test_migration*.py): the
requests they send, two simulated workers behind a gateway (two_workers), two calls at once
(both), and what the gateway counted, logged and recorded of its migrations."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from grpc import aio

from gateway.app.server import Gateway
from gateway.observability.record import CallRecord
from gateway_sim.client import collect, model_md, sgl
from tests.support.inproc import Sim, client, gateway, sim

PROMPT = [1, 2, 3]
TOKENS = 200
FAILS = ("--fail-code", "UNAVAILABLE", "--fail-after", "20")


def sgl_request(request_id: str, tokens: int = TOKENS, **extra: Any) -> Any:
    sampling = extra.pop("sampling", {})
    return sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(input_ids=extra.pop("prompt", PROMPT)),
        sampling_params=sgl.SamplingParams(max_new_tokens=tokens, **sampling),
        stream=True,
        **extra,
    )


def url(worker: Sim, runtime: str = "sglang", **query: str) -> str:
    return worker.url(model="m", runtime=runtime, **query)


def tokens_of(messages: Sequence[Any]) -> list[int]:
    return [t for m in messages if m.HasField("chunk") for t in m.chunk.token_ids]


def migration_lines(logs: Sequence[Mapping[str, Any]], event: str) -> list[Mapping[str, Any]]:
    return [e for e in logs if e.get("event") == event]


@contextlib.asynccontextmanager
async def two_workers(
    a_flags: Sequence[str], b_flags: Sequence[str], **config: Any
) -> AsyncIterator[tuple[Sim, Sim, Gateway, aio.Channel]]:
    """Simulated SGLang workers `a` and `b` of model m (with their flags) behind a gateway
    (with `config`), and a client channel to it."""
    async with (
        sim("--model", "m", "--name", "a", *a_flags) as a,
        sim("--model", "m", "--name", "b", *b_flags) as b,
        gateway(url(a), url(b), **config) as gw,
        client(gw) as ch,
    ):
        yield a, b, gw, ch


def migrations(gw: Gateway, reason: str, outcome: str) -> float:
    labels = {"model": "m", "reason": reason, "outcome": outcome}
    return gw.parts.metrics.prometheus.get_sample_value("gateway_migrations_total", labels) or 0.0


async def both(stub: Any, make: Any) -> list[Any]:
    """Two calls at once (`r1`, `r2`): each one's messages and error."""
    calls = [stub.Generate(make(f"r{i}"), metadata=model_md("m")) for i in (1, 2)]
    return list(await asyncio.gather(*(collect(c) for c in calls)))


def migrated(records: Sequence[CallRecord]) -> list[CallRecord]:
    return [r for r in records if r.migrations]
