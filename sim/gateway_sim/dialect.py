"""How each engine's servicer shapes its answers: ``Dialect``, the counting rules,
validation and logprobs both protos' ``GenerateResponse`` share, which ``vllm.py`` and
``sglang.py`` each subclass with their engine's differences; ``Refused``, a request an
engine refuses as its caller's mistake.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from gateway_sim.config import SimConfig
from gateway_sim.model import fill_top, logprob_of
from gateway_sim.plan import Finish, Plan, Sampling

MAX_RUNNING_REQUESTS = 256  # the running window, unless the engine's dialect says


class Refused(ValueError):
    """The engine refuses the request as its caller's mistake: INVALID_ARGUMENT."""


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
