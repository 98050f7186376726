"""SGLang's PD roles: a prefill that serves the bootstrap rendezvous (and receives EPD
embeddings), and a decode that waits for its room there.

Both take the request the router sends to both legs at once, with the same
``disaggregated_params``. What fails, and how (details in the module docstrings of
``rendezvous`` and ``embeddings``):

- no ``disaggregated_params`` (either role): INVALID_ARGUMENT;
- n > 1 (either role): INVALID_ARGUMENT;
- prefill named by a bootstrap address that is not its own: FAILED_PRECONDITION (in
  production the KV would go nowhere; here the mistake is loud at once);
- prefill without all embedding parts in time: INTERNAL;
- decode whose room does not arrive (wrong room, wrong or dead prefill): INTERNAL,
  as SGLang fails a request whose KV transfer failed; "KV transfer failed: ..." names
  the room and the bootstrap address.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
from grpc.aio import ServicerContext
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl_pb2

from gateway_sim.config import split_listen
from gateway_sim.disagg import Start, check_single_sample, reject, run_leg
from gateway_sim.embeddings import EmbeddingReceiver, EmbeddingsMissing
from gateway_sim.engine import SimEngine
from gateway_sim.lines import LineServer, address
from gateway_sim.rendezvous import BootstrapServer, Room, wait_room
from gateway_sim.sglang import (
    DEFAULT_BOOTSTRAP_PORT,
    DIALECT,
    SglangServicer,
    sampling_of,
    tokenized_ids,
)

# A prefill listening on every address is named by any of them.
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})


def mm_item_count(request: Any) -> int:
    """Multimodal items an encoder must have encoded for this request (URLs and raw
    data; preprocessed ``pixel_values`` need no encoder)."""
    if not request.HasField("mm_inputs"):
        return 0
    mm = request.mm_inputs
    return sum(
        len(items)
        for items in (
            mm.image_urls,
            mm.video_urls,
            mm.audio_urls,
            mm.image_data,
            mm.video_data,
            mm.audio_data,
        )
    )


async def disaggregated_params(request: Any, context: ServicerContext[Any, Any], role: str) -> Any:
    """The request's ``disaggregated_params``; INVALID_ARGUMENT when absent or incomplete."""
    if not request.HasField("disaggregated_params"):
        await reject(
            context, grpc.StatusCode.INVALID_ARGUMENT, f"{role} worker needs disaggregated_params"
        )
    params = request.disaggregated_params
    if not params.bootstrap_host or not 0 < params.bootstrap_port < 65536:
        await reject(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            "disaggregated_params need bootstrap_host and bootstrap_port "
            f"(got {params.bootstrap_host!r}:{params.bootstrap_port})",
        )
    if params.bootstrap_room < 0:
        await reject(
            context,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"bootstrap_room must not be negative (got {params.bootstrap_room})",
        )
    await check_single_sample(context, request.sampling_params.n)
    return params


class _PdServicer(SglangServicer):
    """Reports the role in GetServerInfo and GetLoads."""

    mode = "null"

    @property
    def side_servers(self) -> list[LineServer]:
        return []

    def bootstrap_port(self) -> int:
        return DEFAULT_BOOTSTRAP_PORT  # a decode's: SGLang's default, used by no one

    def _metrics(self) -> Any:
        return sgl_pb2.DisaggregationMetrics(mode=self.mode)

    async def GetServerInfo(self, request: Any, context: ServicerContext[Any, Any]) -> Any:
        response = await super().GetServerInfo(request, context)
        response.server_args.update(
            {
                "disaggregation_mode": self.mode,
                "disaggregation_bootstrap_port": self.bootstrap_port(),
                "disaggregation_transfer_backend": "sim",
            }
        )
        return response

    def _scheduler_load(self, rank: int) -> Any:
        load = super()._scheduler_load(rank)
        # The rendezvous traffic is counted on rank 0 (requests on their own rank).
        if rank == 0:
            load.disaggregation.CopyFrom(self._metrics())
        else:
            load.disaggregation.mode = self.mode
        return load


class SglangPrefillServicer(_PdServicer):
    """``--role prefill``: marks the request's room ready after its time to first token
    and answers as a regular worker asked for one token would (SGLang 0.5.23: streamed,
    a chunk and a Complete; logprobs when asked, the prompt's included)."""

    mode = "prefill"

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        config = engine.config
        host, _ = split_listen(config.listen)
        self._host = host.strip("[]")
        self.bootstrap = BootstrapServer(host, config.bootstrap_port)
        self.embeddings = EmbeddingReceiver(host, config.embedding_port)

    @property
    def side_servers(self) -> list[LineServer]:
        return [self.bootstrap.server, self.embeddings.server]

    def bootstrap_port(self) -> int:
        return self.bootstrap.port

    def _metrics(self) -> Any:
        return sgl_pb2.DisaggregationMetrics(
            mode=self.mode,
            prefill_prealloc_queue_reqs=self.embeddings.waiting,
            prefill_inflight_queue_reqs=self.bootstrap.published,
        )

    async def Generate(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        params = await disaggregated_params(request, context, "prefill")
        named = params.bootstrap_host.strip("[]")
        if (
            named != self._host and self._host not in _WILDCARD_HOSTS
        ) or params.bootstrap_port != self.bootstrap.port:
            await reject(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"bootstrap address {address(params.bootstrap_host, params.bootstrap_port)} "
                f"is not this prefill's ({address(self._host, self.bootstrap.port)})",
            )
        room = params.bootstrap_room
        request_id = request.request_id
        prompt = tokenized_ids(request)
        items = mm_item_count(request)
        timeout_s = self._engine.config.embedding_timeout_s

        def publish(message: Any) -> None:
            if message.HasField("chunk"):
                first = message.chunk.token_ids
            elif message.complete.finish_reason != "abort":
                first = message.complete.output_ids
            else:
                return
            if first:
                self.bootstrap.mark_ready(room, Room(first[0]))

        async def prepare() -> Start:
            if items:
                parts = await self.embeddings.wait_all(request_id, timeout_s)
                if parts.item_count != items:
                    raise EmbeddingsMissing(
                        f"embeddings for request {request_id}: got {parts.item_count} items "
                        f"for {items} multimodal inputs"
                    )
            return Start(amend=publish)

        # The prefill computes the prompt and samples one token, whatever was asked.
        await run_leg(
            self._engine,
            context,
            DIALECT,
            request_id,
            prompt,
            dataclasses.replace(sampling_of(request), max_tokens=1),
            prepare,
            self._engine.rank_of(request),
            request.lora_id,
        )


class SglangDecodeServicer(_PdServicer):
    """``--role decode``: waits for its room on the prefill's bootstrap server, then
    streams from the prefill's first token."""

    mode = "decode"

    def __init__(self, engine: SimEngine) -> None:
        super().__init__(engine)
        self.transferring = 0

    def _metrics(self) -> Any:
        return sgl_pb2.DisaggregationMetrics(
            mode=self.mode, decode_transfer_queue_reqs=self.transferring
        )

    async def Generate(self, request: Any, context: ServicerContext[Any, Any]) -> None:
        params = await disaggregated_params(request, context, "decode")
        host, port, room = params.bootstrap_host, params.bootstrap_port, params.bootstrap_room
        timeout_s = self._engine.config.bootstrap_timeout_s

        async def prepare() -> Start:
            self.transferring += 1
            try:
                handoff = await wait_room(host, port, room, timeout_s)
            finally:
                self.transferring -= 1
            # Like SGLang's decode server: the prompt logprobs stay with the prefill that
            # computed them; the gateway puts them into the client's first message.
            return Start(first_token=handoff.first_token)

        await run_leg(
            self._engine,
            context,
            DIALECT,
            request.request_id,
            tokenized_ids(request),
            dataclasses.replace(sampling_of(request), prompt_logprobs=None),  # see above
            prepare,
            self._engine.rank_of(request),
            request.lora_id,
        )
