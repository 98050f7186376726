"""vLLM's PD roles (NIXL style): a prefill that keeps the KV for a remote decode and
says where in its Complete's ``kv_transfer_params_json``, and a decode that fetches it.

What fails, and how (protocol in ``kv_channel``):

- prefill without ``kv_transfer_params_json`` ``{"do_remote_decode": true}``:
  INVALID_ARGUMENT; decode without ``{"do_remote_prefill": true}``: INVALID_ARGUMENT;
- n > 1 (either role): INVALID_ARGUMENT;
- decode whose params lack the remote address or request id, or whose KV cannot be
  fetched (refused, unknown request, no answer in ``--kv-timeout-ms``, other engine):
  INTERNAL "KV transfer failed: request R from HOST:PORT: ...".

``--omit-kv-params`` makes the prefill answer without transfer params (a connector that
is misconfigured), so the router's error for that can be tested.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from grpc.aio import ServicerContext

from gateway_sim.config import split_listen
from gateway_sim.disagg import Start, check_single_sample, reject, run_leg
from gateway_sim.engine import SimEngine
from gateway_sim.kv_channel import CONNECTOR, KvChannel, Remote, fetch, parse_params
from gateway_sim.lines import LineServer
from gateway_sim.plan import Sampling
from gateway_sim.vllm import DIALECT, VllmServicer, input_ids_of, sampling_of


async def transfer_params(
    request: Any, context: ServicerContext[Any, Any], role: str, flag: str
) -> dict[str, Any]:
    """The request's ``kv_transfer_params_json``, which must set ``flag`` to true;
    INVALID_ARGUMENT otherwise."""
    raw = request.kv_transfer_params_json if request.HasField("kv_transfer_params_json") else ""
    params = parse_params(raw) if raw else None
    if params is None or params.get(flag) is not True:
        await reject(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{role} worker expects kv_transfer_params {flag} (got {raw[:200]!r})",
        )
    await check_single_sample(context, request.sampling_params.n)
    return params


class _PdServicer(VllmServicer):
    """Reports the role in GetServerInfo."""

    @property
    def side_servers(self) -> list[LineServer]:
        return []

    async def GetServerInfo(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        response = await super().GetServerInfo(request, context)
        response.kv_role = self.kv_role
        response.kv_connector = CONNECTOR
        response.kv_engine_id = self._engine.name
        return response


class VllmPrefillServicer(_PdServicer):
    """``--role prefill``: one Complete with the first token and the transfer params."""

    kv_role = "kv_producer"

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        host, _ = split_listen(engine.config.listen)
        self.kv = KvChannel(host, engine.config.kv_port, engine.name, engine.config.block_size)

    @property
    def side_servers(self) -> list[LineServer]:
        return [self.kv.server]

    async def Generate(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        await transfer_params(request, context, "prefill", "do_remote_decode")
        request_id = request.request_id
        input_ids = input_ids_of(request)
        omit = self._engine.config.omit_kv_params

        def hand_over(message: Any) -> None:
            complete = message.complete
            if complete.finish_reason == "abort" or not complete.output_ids:
                return
            params = self.kv.hand_over(
                request_id, complete.output_ids[0], len(input_ids), complete.cached_tokens
            )
            if not omit:
                complete.kv_transfer_params_json = json.dumps(params)
                complete.kv_transfer_params.remote_host = params["remote_host"]
                complete.kv_transfer_params.remote_port = params["remote_port"]

        async def prepare() -> Start:
            return Start(amend=hand_over)

        await run_leg(
            self._engine,
            context,
            DIALECT,
            request_id,
            input_ids,
            Sampling(max_tokens=1, stream=False),
            prepare,
            self._engine.rank_of(request),
        )


class VllmDecodeServicer(_PdServicer):
    """``--role decode``: fetches the KV its params name, then generates as a regular
    worker would, from the prefill's first token."""

    kv_role = "kv_consumer"

    async def Generate(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        params = await transfer_params(request, context, "decode", "do_remote_prefill")
        timeout_s = self._engine.config.kv_timeout_s

        async def prepare() -> Start:
            return Start(first_token=await fetch(Remote.of(params), timeout_s))

        await run_leg(
            self._engine,
            context,
            DIALECT,
            request.request_id,
            input_ids_of(request),
            sampling_of(request),
            prepare,
            self._engine.rank_of(request),
        )
