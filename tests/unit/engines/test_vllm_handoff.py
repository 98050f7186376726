"""vLLM's prefill -> decode hand-off as the gateway drives it: the prefill asked for one
unstreamed token and a remote decode, its `kv_transfer_params` handed to the decode, and
its cached prompt tokens made the call's (the decode's answers count the prompt as
computed remotely, and say 0)."""

from __future__ import annotations

import json

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from gateway.engines.handoff import AmendFirst
from gateway.engines.vllm import KvParamsHandoff

PARAMS = json.dumps({"remote_engine_id": "e", "remote_block_ids": [1, 2]})


class Drained:
    def __init__(self, messages: list[bytes]) -> None:
        self._messages = messages

    async def drain(self) -> list[bytes]:
        return self._messages


class Pair:
    """A placed pair that records what the hand-off asked of it."""

    prefill_host = "127.0.0.1"
    prefill_bootstrap_port: int | None = None
    return_logprob = False

    def __init__(self, prefill_answer: list[bytes]) -> None:
        request = pb.GenerateRequest(
            request_id="r",
            tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
            sampling_params=pb.SamplingParams(max_tokens=8),
            stream=True,
        )
        self.raw = bytes(request.SerializeToString())
        self._answer = prefill_answer
        self.prefilled: list[bytes] = []
        self.decoded: list[bytes] = []
        self.cached: list[int] = []

    def new_room(self) -> int:
        raise AssertionError("vLLM needs no bootstrap room")

    def prefill(self, request: bytes, *, background: bool) -> Drained:
        assert not background
        self.prefilled.append(request)
        return Drained(self._answer)

    async def decode(self, request: bytes, amend_first: AmendFirst | None = None) -> None:
        self.decoded.append(request)

    def prompt_cached(self, tokens: int) -> None:
        self.cached.append(tokens)

    def prefill_failed(self, reason: str, details: str) -> Exception:
        return RuntimeError(reason)


def complete(cached: int, params: str = PARAMS) -> bytes:
    answer = pb.GenerateResponse(
        complete=pb.GenerateComplete(
            output_ids=[7], prompt_tokens=3, cached_tokens=cached, kv_transfer_params_json=params
        )
    )
    return bytes(answer.SerializeToString())


async def test_the_prefills_cached_tokens_are_the_calls_and_its_params_the_decodes() -> None:
    pair = Pair([complete(cached=2)])
    await KvParamsHandoff().run(pair)
    (prefill,) = pair.prefilled
    asked = pb.GenerateRequest.FromString(prefill)
    assert (asked.sampling_params.max_tokens, asked.stream) == (1, False)
    assert json.loads(asked.kv_transfer_params_json)["do_remote_decode"] is True
    (decode,) = pair.decoded
    assert pb.GenerateRequest.FromString(decode).kv_transfer_params_json == PARAMS
    assert pair.cached == [2]


async def test_a_prefill_without_params_fails_before_any_decode() -> None:
    pair = Pair([complete(cached=0, params="")])
    try:
        await KvParamsHandoff().run(pair)
    except RuntimeError as failure:
        assert str(failure) == "missing_kv_params"
    else:
        raise AssertionError("no failure")
    assert pair.decoded == [] and pair.cached == []
