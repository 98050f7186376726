"""The simulated engine both wire protocols share: token generation, failure injection,
request tracking and health.

The servicers translate their protos to and from this; anything that decides *what* a
worker does lives here, once, with its parts beside it: the model's output
(``model.py``), a request's plan (``plan.py``), a call's writes (``answers.py``) and
the failures it injects (``failure.py``). How each engine's servicer shapes its answers
(how a chunk counts its tokens, what a streamed Complete repeats, which requests it
refuses and with what words) is that engine's ``Dialect`` (``dialect.py``), subclassed
beside its servicer (``vllm.py``, ``sglang.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc.aio import ServicerContext
from smg_grpc_proto.generated import common_pb2

from gateway_sim.active import ActiveRequest, ActiveRequests
from gateway_sim.answers import Answers, Writer
from gateway_sim.behaviour import BadOverride, Behaviour, RequestView, read_request
from gateway_sim.config import SimConfig
from gateway_sim.dialect import MAX_RUNNING_REQUESTS, Dialect, Refused
from gateway_sim.failure import fail, fire
from gateway_sim.kv_events import KvEvents
from gateway_sim.model import (
    ARCHITECTURES,
    BOS_TOKEN_ID,
    EOS_TOKEN_IDS,
    MODEL_TYPE,
    PAD_TOKEN_ID,
    embedding_for,
)
from gateway_sim.plan import Finish, Plan, Sampling, plan_for
from gateway_sim.timing import PROFILES, Profile, QueueFull, Scheduler, loop_time

log = logging.getLogger("gateway_sim")

# Response headers the tests read.
WORKER_HEADER = "x-sim-worker"
DEADLINE_HEADER = "x-sim-deadline-ms"
SEEN_METADATA_HEADER = "x-sim-seen-metadata"
TRACEPARENT_HEADER = "x-sim-traceparent"  # the trace context the call came with, if any
RUNNING_HEADER = "x-sim-running"  # calls running here as this one's headers leave, itself too

# Chunks a stream with no delay between tokens writes before letting the loop run.
_YIELD_EVERY = 64


def shown_ids(ids: Sequence[int], most: int = 64) -> str:
    """Token ids as a log line shows them: all of a short list, else both ends."""
    if len(ids) <= most:
        return str(list(ids))
    half = most // 2
    return f"{list(ids[:half])} ... {list(ids[-half:])}"


class SimEngine:
    """State and behaviour of one simulated worker."""

    def __init__(self, name: str, config: SimConfig) -> None:
        self.name = name
        self.config = config
        self.behaviour: Behaviour = config.behaviour
        self.active = ActiveRequests(config.dp_ranks)
        self.max_running = MAX_RUNNING_REQUESTS  # the servicer sets its engine's
        # --timing: the published figures; None: --ttft-ms, --token-ms, --prefill-us-...
        self.profile: Profile | None = PROFILES[config.timing] if config.timing else None
        self.schedulers = [
            Scheduler(config.max_batch, config.max_queue) for _ in range(config.dp_ranks)
        ]
        self.kv = KvEvents(config, self.engine_load)
        self.healthy = not config.not_serving
        self.started_at = time.time()
        self.last_received = self.started_at  # when the last Generate came

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

    def writer(self, context: ServicerContext[Any, Any], view: RequestView) -> Writer:
        """Writes for one call, its headers sent with its first message."""
        return Writer(context, lambda: self.headers(context, view))

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
        dialect: Dialect,
        request_id: str,
        input_ids: Sequence[int] | None,
        sampling: Sampling,
        rank: int = 0,
        namespace: str = "",
    ) -> None:
        """Serve one Generate call by writing its responses to ``context`` (``input_ids``
        None: the request has no tokenized prompt, which the engine may refuse)."""
        view = await self.read(context)
        self.last_received = time.time()
        entry = self.active.add(request_id, rank)
        try:
            await self.respond(
                context, dialect, entry, view, input_ids, sampling, namespace=namespace
            )
        finally:
            self.active.remove(entry)

    async def plan(
        self,
        context: ServicerContext[Any, Any],
        dialect: Dialect,
        view: RequestView,
        input_ids: Sequence[int] | None,
        sampling: Sampling,
        first_token: int | None = None,
    ) -> Plan:
        """What the engine makes of the request: refused (INVALID_ARGUMENT, the engine's
        words), or each choice's tokens, bounded by the context (``plan_for``)."""
        try:
            dialect.check(self.config, input_ids, sampling)
        except Refused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc
        input_ids = input_ids or ()
        room = max(0, dialect.room(self.config, self.kv_tokens, len(input_ids)))
        return plan_for(
            input_ids,
            sampling,
            room,
            max(1, view.behaviour.tokens),
            self.config.vocab_size,
            dialect.names_eos,
            first_token,
        )

    async def respond(
        self,
        context: ServicerContext[Any, Any],
        dialect: Dialect,
        entry: ActiveRequest,
        view: RequestView,
        input_ids: Sequence[int] | None,
        sampling: Sampling,
        first_token: int | None = None,
        namespace: str = "",
        plan: Plan | None = None,
    ) -> None:
        """Write the responses of a tracked call; a PD decode passes the ``first_token``
        its prefill handed over and the output continues from it (and the ``plan`` it
        made before waiting for its KV).

        The call first takes a running slot on ``entry.rank`` (``--max-batch``: it may
        wait for one). The prompt runs on that rank's prefix cache under ``namespace``:
        its cached full blocks are reported as ``cached_tokens`` and spare their prefill
        time, its other full blocks are stored once the prefill is done.
        """
        behaviour = view.behaviour
        if log.isEnabledFor(logging.INFO):  # `--log-level info`: what each call was given
            log.info(
                "%s: generate %s: %d input tokens %s",
                self.name,
                entry.request_id,
                len(input_ids or ()),
                shown_ids(input_ids or ()),
            )
        trigger = behaviour.trigger_at
        if trigger == 0:
            await fire(context, behaviour, 0, self.name)
        if plan is None:
            plan = await self.plan(context, dialect, view, input_ids, sampling, first_token)
        prompt: Sequence[int] = input_ids or ()
        out = self.writer(context, view)
        if behaviour.headers_first:
            await out.send_headers()

        async def emit(message: Any) -> None:
            await out.write(message)
            if out.sent == trigger:
                await fire(context, behaviour, out.sent, self.name)

        scheduler = self.schedulers[entry.rank]
        try:
            queued_out = await scheduler.admit(entry)  # aborted while waiting for a slot
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"queue full: {exc}")
            raise AssertionError("unreachable") from exc
        try:
            left_open = await self._run(
                context,
                dialect,
                entry,
                behaviour,
                answers_for=(prompt, sampling, plan),
                emit=emit,
                out=out,
                trigger=trigger,
                namespace=namespace,
                first_token=first_token,
                queued_out=queued_out,
            )
        finally:
            if not queued_out:
                scheduler.leave()
        if left_open:
            # SGLang's servicer: the scheduler dropped the request (it no longer counts as
            # running), but its stream gets no Complete and no status until the call's
            # deadline or its client's cancel ends it.
            self.active.remove(entry)
            await asyncio.Event().wait()

    async def _run(
        self,
        context: ServicerContext[Any, Any],
        dialect: Dialect,
        entry: ActiveRequest,
        behaviour: Behaviour,
        answers_for: tuple[Sequence[int], Sampling, Plan],
        emit: Any,
        out: Writer,
        trigger: int,
        namespace: str,
        first_token: int | None,
        queued_out: bool,
    ) -> bool:
        """A call holding a running slot (``queued_out``: aborted before it got one):
        its prefill, its tokens, its final answers; True when aborted and left open."""
        prompt, sampling, plan = answers_for
        request_id = entry.request_id
        prompt_tokens = len(prompt)
        stream = sampling.stream
        count = plan.count
        cache = self.kv.caches[entry.rank]
        lease = cache.admit(namespace, prompt)
        answers = Answers(
            dialect,
            request_id,
            prompt,
            lease.cached_tokens,
            sampling,
            plan,
            emit,
            behaviour.completion_tokens,
        )
        produced = 0
        done = False  # every token produced (else: aborted in the queue, prefill or decode)
        left_open = False  # aborted, and the engine sends nothing more (SGLang)
        try:
            if queued_out:
                pass
            elif behaviour.stall:
                await entry.sleep(None)  # only an Abort gets past this; a cancel raises
            else:
                # A PD decode has its KV handed over: no prefill.
                prefilled = count and first_token is None
                uncached = prompt_tokens - answers.cached if prefilled else 0
                ttft = self._first_token_s(entry, behaviour, uncached)
                if not (count and ttft and await entry.sleep(ttft)):
                    cache.store(lease)
                    if dialect.prefix_pass and sampling.choices > 1:
                        answers.cached = cache.hit_tokens(lease)
                    gap = self._gap(entry, behaviour)
                    produced = await self._tokens(entry, answers, behaviour.tokens_per_chunk, gap)
                    done = produced == count
            ends = dialect.abort_ends_stream or behaviour.abort_completes
            left_open = not done and not ends
            if not done and ends:
                # Aborted: each choice's final answer from what it had produced.
                for index in range(sampling.choices):
                    if stream:
                        chunk = dialect.chunk(request_id, prompt_tokens, answers.cached, index)
                        await answers.chunk(chunk, produced, produced)
                    await answers.complete(index, produced, produced, Finish("abort"), stream)
            elif not stream:
                for index in range(sampling.choices):
                    await answers.complete(index, 0, count, plan.finish, False)
            if trigger > out.sent and not left_open:
                # A stream shorter than the trigger point still never ends OK.
                await fire(context, behaviour, out.sent, self.name)
        finally:
            cache.release(lease)
        return left_open

    def _first_token_s(self, entry: ActiveRequest, behaviour: Behaviour, uncached: int) -> float:
        """Seconds from the slot to the first token: ``--ttft-ms`` and the prefill of
        ``uncached`` prompt tokens (``--timing``: on the rank's prefill lane, after the
        prefills booked before it), all over ``--speed``."""
        speed = self.config.speed
        if self.profile is None:
            return (behaviour.ttft_ms / 1000.0 + self.config.prefill_s_per_token * uncached) / speed
        prefill = self.profile.prefill_s(uncached) / speed
        lane = self.schedulers[entry.rank].lane(prefill, loop_time()) if prefill else 0.0
        return behaviour.ttft_ms / 1000.0 / speed + lane

    def _gap(self, entry: ActiveRequest, behaviour: Behaviour) -> Callable[[], float]:
        """Seconds between two output tokens, read as each chunk starts: ``--token-ms``,
        or (``--timing``) the profile's inter-token time at the rank's running batch;
        over ``--speed``."""
        speed = self.config.speed
        profile = self.profile
        if profile is None:
            gap = behaviour.token_ms / 1000.0 / speed
            return lambda: gap
        scheduler = self.schedulers[entry.rank]
        return lambda: profile.itl_s(scheduler.running) / speed

    async def _tokens(
        self,
        entry: ActiveRequest,
        answers: Answers,
        tokens_per_chunk: int,
        gap_now: Callable[[], float],
    ) -> int:
        """Produce the plan's tokens at the pace ``gap_now`` gives (streamed: in chunks
        of ``tokens_per_chunk``, each choice's last chunk followed by its Complete); the
        tokens produced, fewer when an Abort cut them short."""
        count = answers.plan.count
        stream = answers.sampling.stream
        gap = gap_now()
        if not stream and not gap:
            entry.generated = count
            return count
        per = tokens_per_chunk if stream else 1
        chunks = answers.chunks() if stream else []
        start = 0
        written = 0
        while start < count or (stream and not count and not written):
            end = min(start + per, count)
            gap = gap_now()
            # Token k is ready at ttft + k * gap: a chunk leaves with its last token.
            wait = (end - start if start else max(end - 1, 0)) * gap
            if wait:
                if await entry.sleep(wait):
                    return start
            elif entry.aborted:
                return start
            elif written and written % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
            entry.generated = end
            written += 1
            for index, chunk in enumerate(chunks):
                await answers.chunk(chunk, start, end)
                if end == count:
                    await answers.complete(index, start, end, answers.plan.finish, True)
            start = end
        return count

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
        stall as told, send the headers (plus ``headers``), take ``--ttft-ms`` (over
        ``--speed``)."""
        view = await self.read(context)
        behaviour = view.behaviour
        entry = self.active.add(request_id)
        try:
            if behaviour.fail_code is not None and behaviour.fail_after == 0:
                await fail(context, behaviour.fail_code, self.name)
            if behaviour.stall:
                await entry.sleep(None)
                await context.abort(grpc.StatusCode.ABORTED, "aborted")
            await context.send_initial_metadata(self.headers(context, view) + headers)
            if behaviour.fail_code is not None:
                # A unary call has no message to fail after: fail after the headers.
                await fail(context, behaviour.fail_code, self.name)
            delay = behaviour.ttft_ms / 1000.0 / self.config.speed
            if delay and await entry.sleep(delay):
                await context.abort(grpc.StatusCode.ABORTED, "aborted")
        finally:
            self.active.remove(entry)

    # ------------------------------------------------------------------ reporting

    def model_info_fields(self) -> dict[str, Any]:
        """GetModelInfo fields named alike in both protos."""
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.model_path,
            "served_model_name": self.config.model,
            "is_generation": True,
            "max_context_length": self.config.max_model_len,
            "vocab_size": self.config.vocab_size,
            "supports_vision": False,
            "eos_token_ids": list(EOS_TOKEN_IDS),
            "pad_token_id": PAD_TOKEN_ID,
            "bos_token_id": BOS_TOKEN_ID,
            "model_type": MODEL_TYPE,
            "architectures": list(ARCHITECTURES),
        }

    def running_on(self, dp_rank: int) -> int:
        """Requests running on a DP rank (the one they asked for, else rank 0): those in
        flight there but waiting for a slot (``--max-batch``)."""
        return self.active.on_rank(dp_rank) - self.schedulers[dp_rank].waiting

    def waiting_on(self, dp_rank: int) -> int:
        """Requests waiting for a slot on a DP rank, plus ``--load-waiting`` on rank 0."""
        extra = self.config.load_waiting if dp_rank == 0 else 0
        return self.schedulers[dp_rank].waiting + extra

    def engine_load(self, dp_rank: int) -> Any:
        """The load record a KV event batch of this rank carries (``--kv-relay rust``)."""
        cache = self.kv.caches[dp_rank]
        return common_pb2.EngineLoad(
            running_requests=self.running_on(dp_rank),
            waiting_requests=self.waiting_on(dp_rank),
            token_usage=max(cache.usage, self.config.load_token_usage),
            active_token_usage=cache.active_usage,
            max_running_requests=self.max_running,
        )

    def token_usage(self, running: int) -> float:
        return min(running / self.max_running, 1.0)

    @property
    def kv_tokens(self) -> int:
        """The KV cache's size in tokens (per DP rank): what an engine reports as
        `max_total_num_tokens`, and what its prefix cache holds at most."""
        return self.config.kv_blocks * self.config.block_size

    def uptime(self) -> float:
        return time.time() - self.started_at
