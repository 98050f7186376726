"""The simulated engine both wire protocols share: token generation, failure injection,
request tracking and health.

The servicers translate their protos to and from this; anything that decides *what* a
worker does lives here, once. How each engine's servicer shapes its answers (how a chunk
counts its tokens, what a streamed Complete repeats, which requests it refuses and with
what words) is that engine's ``Dialect``, defined beside its servicer (``vllm.py``,
``sglang.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

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

# The served model's facts: those of the tiny Llama the real-engine tests serve
# (scripts/engines/make_model.py), its vocabulary and context from the flags.
DEFAULT_VOCAB_SIZE = 512
BOS_TOKEN_ID = 1
EOS_TOKEN_IDS = (2,)
PAD_TOKEN_ID = 3
MODEL_TYPE = "llama"
ARCHITECTURES = ("LlamaForCausalLM",)
EMBEDDING_DIM = 8
MAX_RUNNING_REQUESTS = 256  # the running window, unless the engine's dialect says

# How long a dying worker waits for its last written messages to leave the socket.
_EXIT_FLUSH_S = 0.05
# Chunks a stream with no delay between tokens writes before letting the loop run.
_YIELD_EVERY = 64
# Tokens made at once for an unstreamed answer before letting the loop run.
_SLICE_TOKENS = 65_536


def output_tokens(
    input_ids: Sequence[int], count: int, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[int]:
    """Deterministic output, as a greedy model's: token k is (first_output(input_ids) + k)
    % vocab_size, so the output continued from any point (the prompt and the tokens so
    far sent again) is the same output."""
    base = first_output(input_ids)
    return [(base + k) % vocab_size for k in range(count)]


def first_output(input_ids: Sequence[int]) -> int:
    """The first output token: the prompt's first token plus its length. The output goes
    up by one a token, so a prompt that ends with the first j outputs gets output j next."""
    return (input_ids[0] + len(input_ids)) if len(input_ids) else 0


def tokens_from(first_token: int, count: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> list[int]:
    """The same output continued from its first token alone, as a PD decode must:
    it never computes the prompt, it only has what the prefill handed over."""
    return [(first_token + k) % vocab_size for k in range(count)]


def shown_ids(ids: Sequence[int], most: int = 64) -> str:
    """Token ids as a log line shows them: all of a short list, else both ends."""
    if len(ids) <= most:
        return str(list(ids))
    half = most // 2
    return f"{list(ids[:half])} ... {list(ids[-half:])}"


def input_logprobs_for(input_ids: Sequence[int]) -> list[float | None]:
    """The prompt logprobs a simulated worker reports (`Dialect.logprobs`), the first
    one None as in both engines."""
    return [None] + [logprob_of(token, -k - 1) for k, token in enumerate(input_ids) if k]


def embedding_for(input_ids: Sequence[int]) -> list[float]:
    """Deterministic embedding; multiples of 1/1024 so they survive float32 exactly."""
    seed = sum(input_ids) + len(input_ids)
    return [((seed * (j + 1) * 2_654_435_761) % 1024) / 1024.0 for j in range(EMBEDDING_DIM)]


def logprob_of(token: int, position: int) -> float:
    """A deterministic log probability; multiples of 1/64 survive float32 exactly."""
    return -(((token + position) % 61) + 1) / 64.0


def fill_top(top: Any, token: int, value: float, size: int, vocab_size: int) -> None:
    """A position's first ``size`` top logprobs (either proto's TopLogProbs): the token
    itself, then the runners-up after it, each a little less likely."""
    others = [(token + j) % vocab_size for j in range(1, max(size - 1, 0) + 1)]
    top.token_ids.extend([token, *others][:size])
    top.values.extend([value - j / 64.0 for j in range(len(others) + 1)][:size])


class Refused(ValueError):
    """The engine refuses the request as its caller's mistake: INVALID_ARGUMENT."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a Generate request asks for that the simulated engine honours."""

    n: int = 1
    max_tokens: int | None = None  # None: until the model stops or the context ends
    stream: bool = True
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    temperature: float | None = None  # None: unset
    logprobs: int | None = None  # the top logprobs per output token asked for, if any
    prompt_logprobs: int | None = None  # ... per prompt token

    @property
    def choices(self) -> int:
        return max(self.n, 1)


@dataclass(frozen=True, slots=True)
class Finish:
    """How a choice ended: ``stop`` (EOS or a stop token, ``matched`` naming the token
    when the engine reports it), ``length`` or ``abort``."""

    reason: str
    matched: int | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """A request the engine took: how many tokens each choice produces and why it ends.
    Token k is ``(base + k) % vocab`` (the last one EOS when the model stops by itself),
    made when it is sent: a long output costs nothing up front."""

    count: int
    finish: Finish
    base: int
    vocab: int
    eos_last: bool = False

    def tokens(self, start: int, end: int) -> list[int]:
        base, vocab = self.base, self.vocab
        ids = [(base + k) % vocab for k in range(start, end)]
        if self.eos_last and end == self.count and ids:
            ids[-1] = EOS_TOKEN_IDS[0]
        return ids

    async def all_tokens(self, count: int | None = None) -> list[int]:
        """The first ``count`` tokens (all by default), made in slices that let the
        event loop run between them."""
        end = self.count if count is None else count
        ids: list[int] = []
        for start in range(0, end, _SLICE_TOKENS):
            if start:
                await asyncio.sleep(0)
            ids.extend(self.tokens(start, min(start + _SLICE_TOKENS, end)))
        return ids


class Dialect(ABC):
    """One engine servicer's way of answering Generate: the counting rules below, its
    validation (``check``) and the room its context leaves (``room``).

    Both protos shape ``GenerateResponse{chunk | complete}`` alike; SGLang's also
    carries the request id on every message.
    """

    # A chunk's completion_tokens: the choice's running total (else the chunk's own).
    chunk_counts_total: ClassVar[bool]
    # A streamed Complete's completion_tokens: the total (else its repeated last delta).
    complete_counts_total: ClassVar[bool]
    # A stop on EOS names the token (matched_token_id).
    names_eos: ClassVar[bool]
    # Unstreamed n>1 Completes carry their choice's index (else all say 0).
    indexes_unstreamed: ClassVar[bool]
    # n>1 prefills the shared prompt once before the choices, which then find it cached.
    prefix_pass: ClassVar[bool]
    # The scheduler's running window (vLLM's max_num_seqs).
    max_running_requests: ClassVar[int] = MAX_RUNNING_REQUESTS
    # An Abort ends the aborted stream with a Complete `abort` (else the stream gets
    # nothing more and stays open until its deadline or a cancel).
    abort_ends_stream: ClassVar[bool] = True
    # HealthCheck's message while healthy.
    health_message: ClassVar[str] = "ok"
    # SubscribeKvEvents' UNIMPLEMENTED message when KV events are off.
    kv_events_disabled: ClassVar[str] = "KV events are disabled"

    def __init__(self, pb: Any, with_request_id: bool) -> None:
        self.pb = pb
        self._with_request_id = with_request_id

    @abstractmethod
    def check(self, config: SimConfig, input_ids: Sequence[int] | None, sampling: Sampling) -> None:
        """Raise ``Refused`` with the engine's words for a request it refuses (``None``:
        it carries no tokenized prompt)."""

    @abstractmethod
    def room(self, config: SimConfig, kv_tokens: int, prompt_tokens: int) -> int:
        """The most tokens a choice may generate after a prompt this long."""

    def annotate(
        self,
        part: Any,
        plan: Plan,
        start: int,
        end: int,
        sampling: Sampling,
        prompt: Sequence[int] | None,
    ) -> None:
        """Logprobs beside tokens [start, end) of a chunk or Complete (``part``), as both
        servicers convert their engine's: each output token's own value and (``logprobs``
        > 0) its top list; with ``prompt_logprobs``, every prompt position's (the first
        without a value, its top list empty) on the part that carries the prompt's
        (``prompt`` given): a stream's first chunk, a Complete holding the whole output."""
        vocab = plan.vocab
        part.ClearField("output_logprobs")
        part.ClearField("input_logprobs")
        if sampling.logprobs is not None:
            out = part.output_logprobs
            for k, token in zip(range(start, end), plan.tokens(start, end), strict=True):
                value = logprob_of(token, k)
                out.token_logprobs.append(value)
                out.token_ids.append(token)
                if sampling.logprobs:
                    fill_top(out.top_logprobs.add(), token, value, sampling.logprobs, vocab)
        if sampling.prompt_logprobs is not None and prompt is not None and len(prompt):
            into = part.input_logprobs
            for k, token in enumerate(prompt):
                entry = into.token_logprobs.add()
                value = logprob_of(token, -k - 1)
                if k:
                    entry.value = value
                into.token_ids.append(token)
                if sampling.prompt_logprobs:
                    top = into.top_logprobs.add()
                    if k:
                        fill_top(top, token, value, sampling.prompt_logprobs, vocab)

    def response(self, request_id: str) -> Any:
        if self._with_request_id:
            return self.pb.GenerateResponse(request_id=request_id)
        return self.pb.GenerateResponse()

    def chunk(self, request_id: str, prompt_tokens: int, cached_tokens: int, index: int) -> Any:
        """A reusable response for one choice's chunks (``fill`` sets each chunk's
        tokens): gRPC serializes a message when it is written, so one object serves
        the whole stream and the hot loop allocates little."""
        message = self.response(request_id)
        chunk = message.chunk
        chunk.prompt_tokens = prompt_tokens
        chunk.cached_tokens = cached_tokens
        chunk.index = index
        return message

    def fill(self, message: Any, delta: Sequence[int], total: int) -> None:
        chunk = message.chunk
        ids = chunk.token_ids
        if len(delta) == 1 and len(ids) == 1:
            ids[0] = delta[0]
        else:
            del ids[:]
            ids.extend(delta)
        chunk.completion_tokens = total if self.chunk_counts_total else len(delta)

    def complete(
        self,
        request_id: str,
        output_ids: Sequence[int],
        total: int,
        finish: Finish,
        prompt_tokens: int,
        cached_tokens: int,
        index: int,
        streamed: bool,
    ) -> Any:
        """Choice ``index``'s closing answer: streamed, it repeats the last chunk's
        tokens (``output_ids``); unstreamed, it holds them all."""
        message = self.response(request_id)
        complete = message.complete
        complete.output_ids.extend(output_ids)
        complete.finish_reason = finish.reason
        complete.prompt_tokens = prompt_tokens
        complete.completion_tokens = (
            total if (self.complete_counts_total or not streamed) else len(output_ids)
        )
        complete.cached_tokens = cached_tokens
        complete.index = index if (streamed or self.indexes_unstreamed) else 0
        if finish.matched is not None:
            complete.matched_token_id = finish.matched
        return message


class _Writer:
    """A call's writes: the response headers ride with the first message, as a servicer
    that never sends them on its own has them sent."""

    __slots__ = ("_context", "_headers", "sent")

    def __init__(
        self,
        context: ServicerContext[Any, Any],
        headers: Callable[[], tuple[tuple[str, str], ...]],
    ) -> None:
        self._context = context
        self._headers: Callable[[], tuple[tuple[str, str], ...]] | None = headers
        self.sent = 0

    async def send_headers(self) -> None:
        """Send the headers now, if they have not gone."""
        if self._headers is not None:
            headers, self._headers = self._headers, None
            await self._context.send_initial_metadata(headers())

    async def write(self, message: Any) -> None:
        await self.send_headers()
        await self._context.write(message)
        self.sent += 1


class _Answers:
    """One call's answers: chunks and Completes in its engine's dialect, for its prompt,
    cache hit and sampling, written through ``emit``; ``reported``: the completion_tokens
    every one of them says instead of the dialect's count (a lying worker), if set."""

    __slots__ = (
        "cached",
        "dialect",
        "emit",
        "plan",
        "prompt",
        "reported",
        "request_id",
        "sampling",
    )

    def __init__(
        self,
        dialect: Dialect,
        request_id: str,
        prompt: Sequence[int],
        cached: int,
        sampling: Sampling,
        plan: Plan,
        emit: Callable[[Any], Awaitable[None]],
        reported: int | None = None,
    ) -> None:
        self.dialect = dialect
        self.request_id = request_id
        self.prompt = prompt
        self.cached = cached
        self.sampling = sampling
        self.plan = plan
        self.emit = emit
        self.reported = reported

    def chunks(self) -> list[Any]:
        """A reusable chunk message per choice."""
        return [
            self.dialect.chunk(self.request_id, len(self.prompt), self.cached, index)
            for index in range(self.sampling.choices)
        ]

    async def chunk(self, message: Any, start: int, end: int) -> None:
        """Write ``message`` holding tokens [start, end) of its choice."""
        dialect = self.dialect
        dialect.fill(message, self.plan.tokens(start, end), end)
        if self.reported is not None:
            message.chunk.completion_tokens = self.reported
        if end > start:
            prompt = self.prompt if start == 0 else None
            dialect.annotate(message.chunk, self.plan, start, end, self.sampling, prompt)
        await self.emit(message)

    async def complete(
        self, index: int, start: int, end: int, finish: Finish, streamed: bool
    ) -> None:
        """Write choice ``index``'s Complete: streamed, tokens [start, end) (its last
        chunk's; none after an abort); unstreamed, all ``end`` tokens produced."""
        plan, dialect = self.plan, self.dialect
        if not streamed:
            start = 0
        ids = await plan.all_tokens(end) if start == 0 else plan.tokens(start, end)
        if streamed and finish.reason == "abort":
            ids, start = [], end
        message = dialect.complete(
            self.request_id, ids, end, finish, len(self.prompt), self.cached, index, streamed
        )
        if self.reported is not None:
            message.complete.completion_tokens = self.reported
        if end > start:
            prompt = self.prompt if start == 0 else None
            dialect.annotate(message.complete, plan, start, end, self.sampling, prompt)
        await self.emit(message)


class SimEngine:
    """State and behaviour of one simulated worker."""

    def __init__(self, name: str, config: SimConfig) -> None:
        self.name = name
        self.config = config
        self.behaviour: Behaviour = config.behaviour
        self.active = ActiveRequests(config.dp_ranks)
        self.max_running = MAX_RUNNING_REQUESTS  # the servicer sets its engine's
        self.kv = KvEvents(config, self.engine_load)
        self.healthy = not config.not_serving
        self.started_at = time.time()
        self.last_received = self.started_at  # when the last Generate came
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

    def writer(self, context: ServicerContext[Any, Any], view: RequestView) -> _Writer:
        """Writes for one call, its headers sent with its first message."""
        return _Writer(context, lambda: self.headers(context, view))

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
        words), or each choice's tokens, bounded by the context.

        A request that sets no maximum ends where the model stops by itself (``--tokens``,
        its last token EOS: ``stop``), or where the context ends (``length``), or never
        on EOS with ``ignore_eos``; one that does ends at its maximum (``length``). A
        stop token in the output ends it there (``stop``, the token named)."""
        try:
            dialect.check(self.config, input_ids, sampling)
        except Refused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable") from exc
        input_ids = input_ids or ()
        room = max(0, dialect.room(self.config, self.kv_tokens, len(input_ids)))
        natural = max(1, view.behaviour.tokens)
        stops_by_itself = (
            sampling.max_tokens is None and not sampling.ignore_eos and natural <= room
        )
        if stops_by_itself:
            count = natural
        elif sampling.max_tokens is None:
            count = room
        else:
            count = min(sampling.max_tokens, room)
        vocab = self.config.vocab_size
        base = first_output(input_ids) if first_token is None else first_token
        finish = Finish("length")
        if stops_by_itself:
            finish = Finish("stop", EOS_TOKEN_IDS[0] if dialect.names_eos else None)
        # The output repeats every `vocab` tokens: a stop token's first place is known.
        limit = count - 1 if stops_by_itself else count
        places = [(stop - base) % vocab for stop in sampling.stop_token_ids if 0 <= stop < vocab]
        first_stop = min((k for k in places if k < limit), default=None)
        if first_stop is not None:
            count, stops_by_itself = first_stop + 1, False
            finish = Finish("stop", (base + first_stop) % vocab)
        return Plan(count, finish, base, vocab, stops_by_itself)

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

        The prompt runs on ``entry.rank``'s prefix cache under ``namespace``: its cached
        full blocks are reported as ``cached_tokens`` and spare their prefill time, its
        other full blocks are stored once the prefill is done.
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
            await self._trigger(context, behaviour, 0)
        if plan is None:
            plan = await self.plan(context, dialect, view, input_ids, sampling, first_token)
        prompt: Sequence[int] = input_ids or ()
        request_id = entry.request_id
        prompt_tokens = len(prompt)
        stream = sampling.stream
        out = self.writer(context, view)
        if behaviour.headers_first:
            await out.send_headers()

        async def emit(message: Any) -> None:
            await out.write(message)
            if out.sent == trigger:
                await self._trigger(context, behaviour, out.sent)

        count = plan.count
        cache = self.kv.caches[entry.rank]
        lease = cache.admit(namespace, prompt)
        answers = _Answers(
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
            if behaviour.stall:
                await entry.sleep(None)  # only an Abort gets past this; a cancel raises
            else:
                ttft = behaviour.ttft_ms / 1000.0
                if first_token is None:  # a PD decode has its KV handed over: no prefill
                    ttft += self.config.prefill_s_per_token * (prompt_tokens - answers.cached)
                if not (count and ttft and await entry.sleep(ttft)):
                    cache.store(lease)
                    if dialect.prefix_pass and sampling.choices > 1:
                        answers.cached = cache.hit_tokens(lease)
                    produced = await self._tokens(entry, behaviour, answers)
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
                await self._trigger(context, behaviour, out.sent)
        finally:
            cache.release(lease)
        if left_open:
            # SGLang's servicer: the scheduler dropped the request (it no longer counts as
            # running), but its stream gets no Complete and no status until the call's
            # deadline or its client's cancel ends it.
            self.active.remove(entry)
            await asyncio.Event().wait()

    async def _tokens(self, entry: ActiveRequest, behaviour: Behaviour, answers: _Answers) -> int:
        """Produce the plan's tokens at the configured pace (streamed: in chunks of
        ``tokens_per_chunk``, each choice's last chunk followed by its Complete); the
        tokens produced, fewer when an Abort cut them short."""
        count = answers.plan.count
        stream = answers.sampling.stream
        gap = behaviour.token_ms / 1000.0
        if not stream and not gap:
            entry.generated = count
            return count
        per = behaviour.tokens_per_chunk if stream else 1
        chunks = answers.chunks() if stream else []
        start = 0
        written = 0
        while start < count or (stream and not count and not written):
            end = min(start + per, count)
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
        """Requests running on a DP rank: the one they asked for, else rank 0."""
        return self.active.on_rank(dp_rank)

    def engine_load(self, dp_rank: int) -> Any:
        """The load record a KV event batch of this rank carries (``--kv-relay rust``)."""
        cache = self.kv.caches[dp_rank]
        return common_pb2.EngineLoad(
            running_requests=self.active.on_rank(dp_rank),
            waiting_requests=self.config.load_waiting if dp_rank == 0 else 0,
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
