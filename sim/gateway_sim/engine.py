"""The simulated engine both wire protocols share: token generation, failure injection,
request tracking and health.

The two servicers only translate their protos to and from this; anything that decides
*what* a worker does lives here, once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc
from grpc.aio import ServicerContext
from smg_grpc_proto.generated import common_pb2

from gateway_sim.active import ActiveRequest, ActiveRequests
from gateway_sim.behaviour import BadOverride, Behaviour, RequestView, read_request
from gateway_sim.config import SimConfig
from gateway_sim.kv_events import KvEvents

log = logging.getLogger("gateway_sim")

# Response headers and trailers the tests read.
WORKER_HEADER = "x-sim-worker"
DEADLINE_HEADER = "x-sim-deadline-ms"
SEEN_METADATA_HEADER = "x-sim-seen-metadata"
TRACEPARENT_HEADER = "x-sim-traceparent"  # the trace context the call came with, if any
RUNNING_HEADER = "x-sim-running"  # calls running here as this one's headers leave, itself too
FAILURE_TRAILER = "x-sim-failure"
FAILURE_DETAILS = "simulated failure"

VOCAB_SIZE = 32000
EMBEDDING_DIM = 8
MAX_CONTEXT_LENGTH = 8192
EOS_TOKEN_IDS = (2,)
MAX_RUNNING_REQUESTS = 256
MAX_TOTAL_NUM_TOKENS = 100_000

# How long a dying worker waits for its last written messages to leave the socket.
_EXIT_FLUSH_S = 0.05


def output_tokens(input_ids: Sequence[int], count: int) -> list[int]:
    """Deterministic output: token k is (sum(input_ids) + k) % VOCAB_SIZE."""
    base = sum(input_ids)
    return [(base + k) % VOCAB_SIZE for k in range(count)]


def tokens_from(first_token: int, count: int) -> list[int]:
    """The same output continued from its first token alone, as a PD decode must:
    it never computes the prompt, it only has what the prefill handed over."""
    return [(first_token + k) % VOCAB_SIZE for k in range(count)]


def input_logprobs_for(input_ids: Sequence[int]) -> list[float | None]:
    """Deterministic prompt logprobs, the first one None as in SGLang; multiples of
    1/64 so they survive float32 and JSON exactly."""
    return [None] + [-((token % 97) + 1) / 64.0 for token in input_ids[1:]]


def embedding_for(input_ids: Sequence[int]) -> list[float]:
    """Deterministic embedding; multiples of 1/1024 so they survive float32 exactly."""
    seed = sum(input_ids) + len(input_ids)
    return [((seed * (j + 1) * 2_654_435_761) % 1024) / 1024.0 for j in range(EMBEDDING_DIM)]


class Codec:
    """Builds one runtime's Generate responses; the engine decides what goes in them.

    Both protos shape `GenerateResponse{chunk | complete}` alike; SGLang's also carries
    the request id on every message (`with_request_id`).
    """

    def __init__(self, pb: Any, with_request_id: bool) -> None:
        self._pb = pb
        self._with_request_id = with_request_id

    def _response(self, request_id: str) -> Any:
        if self._with_request_id:
            return self._pb.GenerateResponse(request_id=request_id)
        return self._pb.GenerateResponse()

    def chunk(
        self, request_id: str, prompt_tokens: int, index: int, cached_tokens: int = 0
    ) -> tuple[Any, Any]:
        """A reusable response and its stream chunk, holding one token id.

        The engine overwrites ``token_ids[0]`` and ``completion_tokens`` before each
        write: gRPC serializes a message when it is written, so one object serves the
        whole stream and the hot loop allocates nothing.
        """
        message = self._response(request_id)
        chunk = message.chunk
        chunk.token_ids.append(0)
        chunk.prompt_tokens = prompt_tokens
        chunk.cached_tokens = cached_tokens
        chunk.index = index
        return message, chunk

    def complete(
        self,
        request_id: str,
        output_ids: list[int],
        finish_reason: str,
        prompt_tokens: int,
        index: int,
        cached_tokens: int = 0,
    ) -> Any:
        """The final response of choice ``index``."""
        message = self._response(request_id)
        complete = message.complete
        complete.output_ids.extend(output_ids)
        complete.finish_reason = finish_reason
        complete.prompt_tokens = prompt_tokens
        complete.completion_tokens = len(output_ids)
        complete.cached_tokens = cached_tokens
        complete.index = index
        return message


class SimEngine:
    """State and behaviour of one simulated worker."""

    def __init__(self, name: str, config: SimConfig) -> None:
        self.name = name
        self.config = config
        self.behaviour: Behaviour = config.behaviour
        self.active = ActiveRequests(config.dp_ranks)
        self.kv = KvEvents(config, self.engine_load)
        self.healthy = not config.not_serving
        self.started_at = time.time()
        self._failure_trailer = ((FAILURE_TRAILER, name),)

    # ----------------------------------------------------------------- per request

    async def read(self, context: ServicerContext[Any, Any]) -> RequestView:
        """This request's behaviour and metadata keys; INVALID_ARGUMENT on a bad override.
        A W3C `traceparent` is logged (with the worker's name): what a tracing engine would
        continue, so a test can check each leg's parent span."""
        try:
            view = read_request(self.behaviour, context.invocation_metadata() or ())
        except BadOverride as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc
        if view.traceparent:
            log.info("traceparent %s %s", self.name, view.traceparent)
        return view

    def headers(
        self, context: ServicerContext[Any, Any], view: RequestView
    ) -> tuple[tuple[str, str], ...]:
        """Response headers telling a test which worker answered, what deadline it saw,
        which metadata reached it, and how many calls this worker ran at that moment (the
        call included: it is tracked before its headers are sent), so a test can check
        from the worker's own count that the gateway kept it within `max_inflight`."""
        remaining = context.time_remaining()
        deadline = "none" if remaining is None else str(int(remaining * 1000))
        return (
            (WORKER_HEADER, self.name),
            (DEADLINE_HEADER, deadline),
            (SEEN_METADATA_HEADER, view.seen_keys),
            (RUNNING_HEADER, str(len(self.active))),
            *(((TRACEPARENT_HEADER, view.traceparent),) if view.traceparent else ()),
        )

    def rank_of(self, request: Any) -> int:
        """The DP rank a GenerateRequest runs on: its ``data_parallel_rank`` when set
        and valid, else rank 0."""
        if request.HasField("data_parallel_rank"):
            rank = request.data_parallel_rank
            if 0 <= rank < self.config.dp_ranks:
                return int(rank)
        return 0

    async def generate(
        self,
        context: ServicerContext[Any, Any],
        codec: Codec,
        request_id: str,
        input_ids: Sequence[int],
        n: int,
        max_tokens: int | None,
        stream: bool,
        rank: int = 0,
        namespace: str = "",
    ) -> None:
        """Serve one Generate call by writing its responses to ``context``."""
        view = await self.read(context)
        entry = self.active.add(request_id, rank)
        try:
            await self.respond(
                context,
                codec,
                entry,
                view,
                input_ids,
                n,
                max_tokens,
                stream,
                namespace=namespace,
            )
        finally:
            self.active.remove(entry)

    async def respond(
        self,
        context: ServicerContext[Any, Any],
        codec: Codec,
        entry: ActiveRequest,
        view: RequestView,
        input_ids: Sequence[int],
        n: int,
        max_tokens: int | None,
        stream: bool,
        first_token: int | None = None,
        namespace: str = "",
    ) -> None:
        """Write the responses of a tracked call; a PD decode passes the ``first_token``
        its prefill handed over and the output continues from it.

        The prompt runs on ``entry.rank``'s prefix cache under ``namespace``: its cached
        full blocks are reported as ``cached_tokens`` and spare their prefill time, its
        other full blocks are stored once the prefill is done.
        """
        behaviour = view.behaviour
        trigger = behaviour.trigger_at
        if trigger == 0:
            await self._trigger(context, behaviour, 0)
        request_id = entry.request_id
        prompt_tokens = len(input_ids)
        choices = max(n, 1)
        write = context.write
        if behaviour.stall:
            await entry.sleep(None)  # only an Abort gets past this; a cancel raises
            await context.send_initial_metadata(self.headers(context, view))
            for index in range(choices):
                await write(codec.complete(request_id, [], "abort", prompt_tokens, index))
            return

        await context.send_initial_metadata(self.headers(context, view))
        tokens = behaviour.tokens if max_tokens is None else max_tokens
        output = (
            output_tokens(input_ids, tokens)
            if first_token is None
            else tokens_from(first_token, tokens)
        )
        cache = self.kv.caches[entry.rank]
        lease = cache.admit(namespace, input_ids)
        cached = lease.cached_tokens
        produced = tokens
        sent = 0
        ttft = behaviour.ttft_ms / 1000.0
        if first_token is None:  # a PD decode has its KV handed over: no prefill
            ttft += self.config.prefill_s_per_token * (prompt_tokens - cached)
        gap = behaviour.token_ms / 1000.0
        try:
            if tokens and ttft and await entry.sleep(ttft):
                produced = 0  # aborted in the prefill: nothing computed, nothing stored
            else:
                cache.store(lease)
                if stream or ttft or gap:
                    chunks = (
                        [codec.chunk(request_id, prompt_tokens, i, cached) for i in range(choices)]
                        if stream
                        else []
                    )
                    for k in range(tokens):
                        if k and gap:
                            if await entry.sleep(gap):
                                produced = k
                                break
                        elif entry.aborted:
                            produced = k
                            break
                        if not stream:
                            continue
                        token = output[k]
                        entry.generated = k + 1
                        for message, chunk in chunks:
                            chunk.token_ids[0] = token
                            chunk.completion_tokens = k + 1
                            await write(message)
                            sent += 1
                            if sent == trigger:
                                await self._trigger(context, behaviour, sent)

            reason = "abort" if entry.aborted else "length"
            done = output if produced == tokens else output[:produced]
            for index in range(choices):
                await write(codec.complete(request_id, done, reason, prompt_tokens, index, cached))
                sent += 1
                if sent == trigger:
                    await self._trigger(context, behaviour, sent)
            if trigger > sent:
                # A stream shorter than the trigger point still never ends OK.
                await self._trigger(context, behaviour, sent)
        finally:
            cache.release(lease)

    async def embed(
        self, context: ServicerContext[Any, Any], request_id: str, input_ids: Sequence[int]
    ) -> list[float]:
        """Serve one Embed call; returns the embedding, or fails/stalls as configured."""
        await self.unary(context, request_id)
        return embedding_for(input_ids)

    async def unary(
        self,
        context: ServicerContext[Any, Any],
        request_id: str,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Play the configured behaviour for one unary call (Embed, Encode): fail or
        stall as told, send the headers (plus ``headers``), take ``--ttft-ms``."""
        view = await self.read(context)
        behaviour = view.behaviour
        entry = self.active.add(request_id)
        try:
            if behaviour.fail_code is not None and behaviour.fail_after == 0:
                await self._fail(context, behaviour.fail_code)
            if behaviour.stall:
                await entry.sleep(None)
                await context.abort(grpc.StatusCode.ABORTED, "aborted")
            await context.send_initial_metadata(self.headers(context, view) + headers)
            if behaviour.fail_code is not None:
                # A unary call has no message to fail after: fail after the headers.
                await self._fail(context, behaviour.fail_code)
            if behaviour.ttft_ms and await entry.sleep(behaviour.ttft_ms / 1000.0):
                await context.abort(grpc.StatusCode.ABORTED, "aborted")
        finally:
            self.active.remove(entry)

    async def _trigger(
        self, context: ServicerContext[Any, Any], behaviour: Behaviour, sent: int
    ) -> None:
        """Fire whichever of exit/failure owns the trigger point (exit on a tie)."""
        if behaviour.exit_after is not None and behaviour.exit_after == behaviour.trigger_at:
            await self._exit(sent)
        if behaviour.fail_code is not None:
            await self._fail(context, behaviour.fail_code)

    async def _fail(self, context: ServicerContext[Any, Any], code: grpc.StatusCode) -> NoReturn:
        await context.abort(code, FAILURE_DETAILS, self._failure_trailer)
        raise AssertionError("unreachable")

    async def _exit(self, sent: int) -> NoReturn:
        """Die like a crashed worker: no graceful shutdown, connections reset."""
        if sent:
            await asyncio.sleep(_EXIT_FLUSH_S)
        log.warning("%s: simulated crash after %d messages", self.name, sent)
        for handler in log.handlers:
            handler.flush()
        sys.stdout.flush()
        os._exit(1)

    # ------------------------------------------------------------------ reporting

    def model_info_fields(self) -> dict[str, Any]:
        """GetModelInfo fields named alike in both protos."""
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.model_path,
            "served_model_name": self.config.model,
            "is_generation": True,
            "max_context_length": MAX_CONTEXT_LENGTH,
            "vocab_size": VOCAB_SIZE,
            "eos_token_ids": list(EOS_TOKEN_IDS),
            "model_type": "sim",
            "architectures": ["SimForCausalLM"],
        }

    def running_on(self, dp_rank: int) -> int:
        """Requests running on a DP rank: the one they asked for, else rank 0."""
        return self.active.on_rank(dp_rank)

    def engine_load(self, dp_rank: int) -> Any:
        """The load record a KV event batch of this rank carries."""
        cache = self.kv.caches[dp_rank]
        return common_pb2.EngineLoad(
            running_requests=self.active.on_rank(dp_rank),
            waiting_requests=self.config.load_waiting if dp_rank == 0 else 0,
            token_usage=max(cache.usage, self.config.load_token_usage),
            active_token_usage=cache.active_usage,
            max_running_requests=MAX_RUNNING_REQUESTS,
        )

    @staticmethod
    def token_usage(running: int) -> float:
        return min(running / MAX_RUNNING_REQUESTS, 1.0)

    @property
    def kv_tokens(self) -> int:
        """The KV cache's size in tokens (per DP rank): what an engine reports as
        `max_total_num_tokens`, and what its prefix cache holds at most."""
        return self.config.kv_blocks * self.config.block_size

    def uptime(self) -> float:
        return time.time() - self.started_at
