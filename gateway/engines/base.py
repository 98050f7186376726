"""What every engine adapter answers: the RPC table and the few fields the gateway reads.

The gateway relays request and response bytes untouched; an adapter decodes only
what routing needs (request id, n, multimodal items) and builds the few replies the
gateway answers itself (HealthCheck, Abort, merged fan-out answers). Beside it: how a
Generate's usage is counted (`usage`), the PD hand-off (`handoff`), and the RPC table's
vocabulary (`rpcs`).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, ServiceDescriptor
from google.protobuf.message import DecodeError

from gateway.core.roles import Role, Runtime
from gateway.core.wire import LENGTH_DELIMITED, VARINT, encode_varint, payload
from gateway.engines.handoff import Handoff
from gateway.engines.rpcs import MessageClass, RpcKind, RpcSpec
from gateway.engines.tokens import TokenIds, Unusual, highest, split_tokens
from gateway.engines.usage import Counting, Tally, Usage, UsageBounds

# A Generate request this long has its token ids decoded apart (numpy, off the loop).
SPLIT_MIN_BYTES = 256 * 1024
MAX_BLOCK_TOKENS = 4096  # a KV block size beyond this is not a real engine's


MAX_WINDOW = 1_000_000  # more than any engine runs at once: a bogus figure is no window


def window_ok(value: float) -> bool:
    """A running window a worker reports, taken only when it is a plausible count."""
    return 1 <= value <= MAX_WINDOW and float(value).is_integer()


def block_size_ok(size: float) -> bool:
    """A worker's reported KV block size is one a real engine has."""
    return 0 < size <= MAX_BLOCK_TOKENS


def _message_class(descriptor: Descriptor) -> MessageClass:
    return cast(MessageClass, message_factory.GetMessageClass(descriptor))


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What GetServerInfo says about a worker's part in disaggregated serving."""

    role: Role | None  # None: the worker does not say
    bootstrap_port: int | None = None
    pairing: str = ""
    block_size: int | None = None  # tokens per KV block (page), if the worker says
    window: int | None = None  # requests its scheduler runs at once (all its DP ranks)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What GetModelInfo says of the model a worker serves."""

    name: str  # "" if it names none
    vocab_size: int | None = None  # token ids are 0 .. vocab_size - 1; None: not said


@dataclass(frozen=True, slots=True)
class GenerateInfo:
    """The fields of a Generate request that routing reads."""

    request_id: str
    n: int
    multimodal: bool
    mm_items: tuple[str, ...] = ()  # items an encode worker can take (URLs), in order
    return_logprob: bool = False
    tokens: TokenIds = ()  # the prompt's token ids (not copied)
    highest_token: int = -1  # the largest of them (-1: none), for the vocabulary bound
    namespace: str = ""  # what else keys the prompt's KV cache (a LoRA adapter)
    max_new_tokens: int | None = None  # the most each choice may generate, if the call says
    stream: bool = True  # answered in chunks, not one closing message per choice
    min_new_tokens: int = 0  # what each choice must generate before it may stop
    # Why a continuation on another worker could not resume it ("": it could): the engine
    # cannot resume a grammar's state, nor give prompt logprobs for the original prompt.
    unresumable: str = ""
    text_prompt: bool = False  # the prompt is text for the engine to tokenize (vLLM's `text`)


class EngineAdapter(ABC):
    """One engine's protocol: everything that differs between SGLang and vLLM lives here.

    Request rewrites append fields to the client's bytes instead of re-encoding them: a
    protobuf parser merges a repeated embedded message and lets the last scalar win, so
    `raw + patch` is the client's request with the patch applied, at the cost of the patch.
    """

    runtime: Runtime
    handoff: Handoff  # how its prefill hands KV to its decode
    service: ServiceDescriptor
    kinds: Mapping[str, RpcKind]
    # SamplingParams' fields for the most and the least new tokens of a choice.
    max_tokens_field: str
    min_tokens_field: str

    def __init__(self) -> None:
        self.service_name: str = self.service.full_name
        self.rpcs: dict[str, RpcSpec] = {}
        for method in self.service.methods:
            self.rpcs[method.name] = RpcSpec(
                name=method.name,
                path=f"/{self.service_name}/{method.name}",
                kind=self.kinds.get(method.name, RpcKind.FORWARD_ONE),
                server_streaming=method.server_streaming,
                request_type=_message_class(method.input_type),
                response_type=_message_class(method.output_type),
            )

    def path(self, name: str) -> str:
        return self.rpcs[name].path

    @functools.cached_property
    def _token_field(self) -> tuple[int, int]:
        """Field numbers of `tokenized` in a GenerateRequest and of `input_ids` in it."""
        tokenized = self.rpcs["Generate"].request_type.DESCRIPTOR.fields_by_name["tokenized"]
        input_ids = tokenized.message_type.fields_by_name["input_ids"]  # type: ignore[union-attr]
        return tokenized.number, input_ids.number

    def generate_info(self, raw: bytes) -> GenerateInfo:
        """Decode a Generate request; raises google.protobuf.message.DecodeError. A long
        one's token ids are cut out and decoded apart, with numpy (see engines/tokens):
        what protobuf then decodes is small, so a thread can take the work off the loop."""
        request_type = self.rpcs["Generate"].request_type
        if len(raw) >= SPLIT_MIN_BYTES:
            try:
                rest, ids = split_tokens(raw, *self._token_field)
            except Unusual:
                pass  # any other shape: protobuf decodes all of it
            else:
                info = self._generate_info(request_type.FromString(rest), ids)
                return replace(info, highest_token=highest(ids))
        request: Any = request_type.FromString(raw)
        ids = request.tokenized.input_ids
        return replace(self._generate_info(request, ids), highest_token=highest(ids))

    @abstractmethod
    def _generate_info(self, request: Any, tokens: TokenIds) -> GenerateInfo:
        """The routing fields of a decoded Generate request, its prompt being `tokens`."""

    @abstractmethod
    def abort_ids(self, raw: bytes) -> list[str]:
        """The request ids an Abort names."""

    @abstractmethod
    def abort_request(self, request_ids: Sequence[str], raw: bytes) -> bytes:
        """The Abort to forward to one worker for the ids it holds."""

    @abstractmethod
    def abort_reply(self, found: bool, message: str) -> bytes:
        """The Abort answer the gateway gives when it decides itself."""

    def health_check_reply(self, healthy: bool, message: str) -> bytes:
        reply: Any = self.rpcs["HealthCheck"].response_type(healthy=healthy, message=message)
        return bytes(reply.SerializeToString())

    def health_check_answer(self, raw: bytes) -> tuple[bool, str]:
        reply: Any = self.rpcs["HealthCheck"].response_type.FromString(raw)
        return bool(reply.healthy), str(reply.message)

    def load_request(self) -> bytes:
        request: Any = self.rpcs["GetLoads"].request_type(include=["core"])
        return bytes(request.SerializeToString())

    def load_figures(self, raw: bytes) -> tuple[int, int, float, int | None]:
        """(running, waiting, KV token usage, KV cache tokens) over every DP rank: sums,
        the worst usage, the smallest cache (None: not reported)."""
        reply: Any = self.rpcs["GetLoads"].response_type.FromString(raw)
        loads = list(reply.loads)
        return (
            sum(x.num_running_reqs for x in loads),
            sum(x.num_waiting_reqs for x in loads),
            max((x.token_usage for x in loads), default=0.0),
            min((x.max_total_num_tokens for x in loads if x.max_total_num_tokens), default=None),
        )

    def single_choice(self, raw: bytes, request_id: str) -> bytes:
        """One sample (`n=1`) of a request under its own request id (n>1 is split)."""
        patch: Any = self.rpcs["Generate"].request_type(request_id=request_id)
        patch.sampling_params.n = 1
        return raw + bytes(patch.SerializeToString())

    def with_dp_rank(self, raw: bytes, rank: int) -> bytes:
        """The request pinned to one data-parallel rank of the worker."""
        patch: Any = self.rpcs["Generate"].request_type(data_parallel_rank=rank)
        return raw + bytes(patch.SerializeToString())

    def retag(self, message: bytes, index: int, request_id: str) -> bytes:
        """A choice's response as the client's: its `index`, the client's request id."""
        response: Any = self.rpcs["Generate"].response_type.FromString(message)
        part = getattr(response, response.WhichOneof("response") or "chunk")
        part.index = index
        self._set_response_id(response, request_id)
        return bytes(response.SerializeToString())

    # -- continuing a stream on another worker (migration) ----------------------------

    def relayed(self, messages: bytes) -> tuple[Sequence[int], bool]:
        """The new token ids of consecutive streamed answers (concatenated), and whether
        the last was the choice's closing one (whose ids repeat the last chunk's). One
        parse for them all: protobuf merges concatenated messages, so the chunks'
        repeated `token_ids` concatenate, at C speed, without a Python step per answer."""
        response: Any = self.rpcs["Generate"].response_type.FromString(messages)
        kind = response.WhichOneof("response")
        if kind == "chunk":
            return response.chunk.token_ids, False
        return (), kind == "complete"

    @functools.cached_property
    def _chunk_ids(self) -> tuple[Any, bytes]:
        """A Generate chunk's message class, and the tag of its packed `token_ids`."""
        chunk_type = type(self.rpcs["Generate"].response_type().chunk)  # type: ignore[attr-defined]
        number = chunk_type.DESCRIPTOR.fields_by_name["token_ids"].number
        return chunk_type, encode_varint(number << 3 | LENGTH_DELIMITED)

    def packed(self, ids: Sequence[int]) -> bytes:
        """Token ids as the varints of a chunk's packed `token_ids` (1 to 3 bytes each
        under 2^21): how a stream's ids are kept, made in C (no Python step per id)."""
        chunk_type, _ = self._chunk_ids
        out = bytes(chunk_type(token_ids=ids).SerializeToString())
        return out[payload(out, 0) :] if out else b""

    def unpacked(self, packed: bytes | bytearray) -> Sequence[int]:
        """The token ids `packed` made."""
        chunk_type, tag = self._chunk_ids
        message = chunk_type.FromString(tag + encode_varint(len(packed)) + packed)
        return message.token_ids  # type: ignore[no-any-return]

    def continuation(
        self, raw: bytes, info: GenerateInfo, generated: Sequence[int], request_id: str
    ) -> bytes:
        """The request that continues `raw` after `generated`: those tokens appended to
        its prompt, its most and least new tokens reduced by them, under `request_id`;
        every other field (sampling, stops, ...) as the client sent it. A patch appended
        to the bytes (repeated fields concatenate), so it costs what the new tokens do."""
        request_type = self.rpcs["Generate"].request_type
        patch: Any = request_type(request_id=request_id)
        patch.tokenized.input_ids.extend(generated)
        params = patch.sampling_params
        if info.max_new_tokens is not None:
            setattr(params, self.max_tokens_field, max(0, info.max_new_tokens - len(generated)))
        least = max(0, info.min_new_tokens - len(generated))
        if least:
            setattr(params, self.min_tokens_field, least)
        out = raw + bytes(patch.SerializeToString())
        if info.min_new_tokens and not least:  # 0 is not serialized: written by hand
            sampling = request_type.DESCRIPTOR.fields_by_name["sampling_params"]
            number = sampling.message_type.fields_by_name[self.min_tokens_field].number  # type: ignore[union-attr]
            inner = encode_varint(number << 3 | VARINT) + b"\x00"
            out += encode_varint(sampling.number << 3 | LENGTH_DELIMITED)
            out += encode_varint(len(inner)) + inner
        return out

    def response_id(self, message: bytes) -> str:
        """The request id a Generate answer carries ("" for engines whose answers carry
        none)."""
        return ""

    def continued(self, message: bytes, prompt_tokens: int, before: int, request_id: str) -> bytes:
        """A continuation's answer as the client's: the original prompt's length, the
        completion count going on from the `before` tokens relayed earlier (where the
        engine counts running totals), cached tokens as reported (at most the prompt),
        the original request id."""
        response: Any = self.rpcs["Generate"].response_type.FromString(message)
        kind = response.WhichOneof("response")
        if kind not in ("chunk", "complete"):
            return message
        part = getattr(response, kind)
        part.prompt_tokens = prompt_tokens
        part.cached_tokens = min(part.cached_tokens, prompt_tokens)
        if self.counting(True) is Counting.TOTALS:
            part.completion_tokens += before
        self._set_response_id(response, request_id)
        return bytes(response.SerializeToString())

    def counting(self, stream: bool) -> Counting:
        """How this engine's answers to a Generate (streamed or not) count its tokens."""
        return Counting.TOTALS

    def tally(self, stream: bool, choices: int, bounds: UsageBounds | None = None) -> Tally:
        """What a Generate of this engine (streamed or not, `choices` of them) used."""
        return Tally(self.counting(stream), choices, self.usage, bounds)

    def usage(self, message: bytes) -> Usage | None:
        """One Generate answer's figures (None: neither chunk nor Complete): a tenant's
        token budget is settled with them, and the cached tokens are set beside what the
        gateway's prefix index expected. `counting` says how they add up. An answer that
        does not decode has none (it is relayed as it came, as a direct client gets it)."""
        try:
            response: Any = self.rpcs["Generate"].response_type.FromString(message)
        except DecodeError:
            return None
        kind = response.WhichOneof("response")
        if kind not in ("chunk", "complete"):
            return None
        part = getattr(response, kind)
        return Usage(
            int(part.index),
            int(part.completion_tokens),
            int(part.cached_tokens),
            kind == "complete",
        )

    def _set_response_id(self, response: Any, request_id: str) -> None:  # noqa: B027
        """Engines whose responses carry the request id override this."""

    @abstractmethod
    def server_facts(self, server_info: bytes) -> ServerFacts:
        """Role, bootstrap port and pairing key from a GetServerInfo answer."""

    def model_facts(self, model_info: bytes) -> ModelFacts:
        """The model a worker serves and its vocabulary, from its GetModelInfo answer."""
        info: Any = self.rpcs["GetModelInfo"].response_type.FromString(model_info)
        vocab = int(info.vocab_size)
        return ModelFacts(str(info.served_model_name or info.model_path), vocab or None)

    def merge(self, name: str, parts: Sequence[bytes]) -> bytes:
        """Merge the answers of a fan-out RPC, one per worker, in worker order."""
        response_type = self.rpcs[name].response_type
        replies: list[Any] = [response_type.FromString(p) for p in parts]
        if name == "GetLoads":
            return self.merge_loads(replies)
        return merge_outcomes(response_type, replies)

    def merge_aborts(self, replies: Sequence[bytes]) -> bytes:
        """One answer for the aborts of every leg and choice: aborted if any worker had it
        (a prefill that already finished its part no longer holds the request)."""
        response_type = self.rpcs["Abort"].response_type
        parsed: list[Any] = [response_type.FromString(r) for r in replies]
        if "success" not in response_type.DESCRIPTOR.fields_by_name:
            return bytes(parsed[0].SerializeToString())
        done = [r for r in parsed if r.success]
        merged: Any = response_type(success=bool(done))
        merged.message = "; ".join(r.message for r in (done or parsed) if r.message)
        return bytes(merged.SerializeToString())

    def merge_loads(self, replies: Sequence[Any]) -> bytes:
        """GetLoads: one SchedulerLoad entry per worker and rank, in worker order."""
        merged: Any = replies[0].__class__()
        for reply in replies:
            merged.loads.extend(reply.loads)
            merged.version = merged.version or reply.version
            merged.timestamp = max(merged.timestamp, reply.timestamp)
        merged.dp_rank_count = len(merged.loads)
        return bytes(merged.SerializeToString())


def merge_outcomes(response_type: MessageClass, replies: Sequence[Any]) -> bytes:
    """Merge `{success, message, ...}` answers: success only if every worker succeeded.

    Repeated id lists (LoRA) keep the ids every worker reports: an adapter is usable
    through the gateway only where every worker can serve it.
    """
    merged: Any = response_type()
    fields = response_type.DESCRIPTOR.fields_by_name
    if "success" in fields:
        merged.success = all(r.success for r in replies)
    if "message" in fields:
        merged.message = "; ".join(r.message for r in replies if r.message)
    if "loaded_lora_ids" in fields and replies:
        common = set(replies[0].loaded_lora_ids).intersection(
            *(r.loaded_lora_ids for r in replies[1:])
        )
        merged.loaded_lora_ids.extend(sorted(common))
    if "loaded_adapters" in fields and replies:
        seen = [{a.lora_id: a for a in r.loaded_adapters} for r in replies]
        common_ids = set(seen[0]).intersection(*seen[1:])
        merged.loaded_adapters.extend(seen[0][i] for i in sorted(common_ids))
    return bytes(merged.SerializeToString())
