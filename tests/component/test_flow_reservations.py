"""A reservation a waiting room made is never left behind: whatever raises between the
room's answer and the first upstream call, the workers' slots and the tenant's count go
back (the next call still runs, every in-flight count returns to zero)."""

from __future__ import annotations

from typing import Any

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from gateway_sim.client import collect, model_md, sgl_generate
from tests.support.inproc import client, gateway, idle, sim


class Broken(Exception):
    pass


async def test_a_raise_before_the_first_upstream_call_returns_the_reservation() -> None:
    overrides: dict[str, Any] = {
        "models": {"m": {"max_inflight": 1}},
        "flow": {},
        "tenants": {"default": {"max_inflight": 1}},
    }
    async with (
        sim("--model", "m") as w,
        gateway(w.url(model="m", runtime="sglang"), **overrides) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        front = gw.parts.fronts[0]
        dispatcher = front.env.routing.dispatcher
        serve = dispatcher.serve
        calls = 0

        def breaks_once(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise Broken("between the room and the upstream call")
            return serve(*args, **kwargs)

        dispatcher.serve = breaks_once  # type: ignore[method-assign]
        try:
            _, error = await collect(stub.Generate(sgl_generate("broken"), metadata=model_md("m")))
            assert error is not None and error.code() is grpc.StatusCode.UNKNOWN
            await idle(gw)  # the worker's slot is back
            assert gw.parts.rooms is not None and not gw.parts.rooms._inflight  # and the tenant's
            # With one slot and a tenant limit of one, a leak would hold this one forever.
            _, error = await collect(
                stub.Generate(sgl_generate("next"), metadata=model_md("m"), timeout=20)
            )
            assert error is None
        finally:
            dispatcher.serve = serve  # type: ignore[method-assign]
        await idle(gw)
