"""The RPC kinds the pipeline does not place: the engine HealthCheck, answered from the
gateway's state; the fleet-wide facts, forwarded to one worker (the one the call names,
if it can); the per-worker admin calls, fanned out to every worker and merged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection

from gateway.core.roles import Role
from gateway.core.verdicts import Verdict
from gateway.placement.decision import Decision
from gateway.proxy import stages
from gateway.proxy.call import Call, abort_with_failure
from gateway.proxy.env import StageEnv
from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.job import Job
from gateway.proxy.upstream import Outbound


class FleetCalls:
    """One engine protocol's calls for the fleet as a whole."""

    def __init__(self, env: StageEnv) -> None:
        self.env = env
        self.adapter = env.adapter
        routing = env.routing
        self._registry = routing.registry
        self._placer = routing.placer
        self._dispatcher = routing.dispatcher
        self._upstreams = routing.dispatcher.upstreams
        self._draining = False  # `drain()`: the engine HealthCheck then says unhealthy

    def drain(self) -> None:
        """SIGTERM: from now on the engine HealthCheck answers unhealthy, so a client's
        own health checking moves it elsewhere while calls in flight finish."""
        self._draining = True

    async def _model(self, call: Call) -> str:
        await stages.resolve(self.env, call)
        return call.model

    async def forward_one(self, call: Call) -> bytes | None:
        meta = call.meta
        model = await self._model(call)
        runtime = self.adapter.runtime
        target = meta.hints.target_worker

        def pick(tried: Collection[str]) -> Decision | Verdict:
            if target is not None and target not in tried:
                worker = self._registry.get(target)
                if (
                    worker is not None
                    and worker.model == model
                    and worker.role is not Role.ENCODE
                    and worker.available(time.monotonic())
                ):
                    return Decision.single(worker)
            placed = self._placer.any_worker(model, runtime, tried)
            return placed if isinstance(placed, Verdict) else Decision.single(placed)

        attempt = self._dispatcher.attempt(call.spec.server_streaming)
        job = Job(call, self.adapter, call.request, call.client(), call.record.request_id)
        return await self._dispatcher.serve(job, pick, attempt)

    async def fan_out(self, call: Call) -> bytes:
        spec, request, context, record, meta = (
            call.spec, call.request, call.context, call.record, call.meta
        )  # fmt: skip
        model = await self._model(call)
        workers = self._placer.every_worker(model, self.adapter.runtime)
        if isinstance(workers, Verdict):
            await call.refuse(workers)
        call.reached([w.id for w in workers])
        upstreams = self._upstreams
        outbound = Outbound(spec.path, request, meta.forward, context.time_remaining())
        legs = [upstreams.ask(upstreams.reserve(w), outbound) for w in workers]
        try:
            results = await asyncio.gather(*(c.response() for c in legs), return_exceptions=True)
        finally:
            for leg in legs:
                leg.close()
        for result in results:
            if isinstance(result, UpstreamFailure):
                await abort_with_failure(context, result)
            elif isinstance(result, BaseException):
                raise result
        await context.send_initial_metadata((("x-gateway-workers", ",".join(record.targets)),))
        return self.adapter.merge(spec.name, [r for r in results if isinstance(r, bytes)])

    async def health_check(self, call: Call) -> bytes:
        model = await self._model(call)
        if self._draining:
            return self.adapter.health_check_reply(False, "the gateway is shutting down")
        if self._placer.servable(model, self.adapter.runtime):
            return self.adapter.health_check_reply(True, f"model '{model}' is servable")
        return self.adapter.health_check_reply(False, f"model '{model}' has no available workers")
