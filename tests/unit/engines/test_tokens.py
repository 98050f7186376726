"""Long prompts' token ids decoded apart from protobuf: always the same answer as a full
decode, whatever the request; other shapes fall back to protobuf."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm

from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.engines.base import SPLIT_MIN_BYTES
from gateway.engines.tokens import Unusual, decode_varints, split_tokens

TOKENIZED, INPUT_IDS = 2, 2


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    text=st.text(max_size=20),
    request_id=st.text(max_size=10),
    n=st.integers(0, 5),
    lora=st.text(max_size=5),
)
def test_the_split_decodes_what_protobuf_decodes(
    ids: list[int], text: str, request_id: str, n: int, lora: str
) -> None:
    request = sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(original_text=text, input_ids=ids),
        sampling_params=sgl.SamplingParams(n=n, max_new_tokens=3),
        lora_id=lora,
        stream=True,
    )
    raw = request.SerializeToString()
    try:
        rest, tokens = split_tokens(raw, TOKENIZED, INPUT_IDS)
    except Unusual:
        assert not ids  # only an absent field is not split
        return
    assert tokens.tolist() == ids
    decoded = sgl.GenerateRequest.FromString(rest)
    decoded.tokenized.input_ids.extend(ids)
    assert decoded == request


def test_varints_of_every_width() -> None:
    values = [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28, 2**32 - 1]
    raw = sgl.TokenizedInput(input_ids=values).SerializeToString()
    assert decode_varints(raw[2:]).tolist() == values  # after the tag and length bytes


@pytest.mark.parametrize(
    "data",
    [
        b"\x80",  # truncated
        b"\xff\xff\xff\xff\xff\x01",  # six bytes: wider than uint32
        b"\xff\xff\xff\xff\x7f",  # five bytes over 2^32
    ],
)
def test_varints_out_of_shape_are_unusual(data: bytes) -> None:
    with pytest.raises(Unusual):
        decode_varints(data)


def test_unpacked_or_repeated_fields_are_left_to_protobuf() -> None:
    packed = sgl.GenerateRequest(tokenized=sgl.TokenizedInput(input_ids=[5, 6])).SerializeToString()
    twice = (
        packed
        + sgl.GenerateRequest(tokenized=sgl.TokenizedInput(input_ids=[7])).SerializeToString()
    )
    with pytest.raises(Unusual):
        split_tokens(twice, TOKENIZED, INPUT_IDS)  # protobuf merges the two
    # input_ids unpacked: tag 0x10 (field 2, varint) per element, inside tokenized
    unpacked = b"\x12\x04\x10\x05\x10\x06"
    with pytest.raises(Unusual):
        split_tokens(unpacked, TOKENIZED, INPUT_IDS)
    assert list(sgl.GenerateRequest.FromString(unpacked).tokenized.input_ids) == [5, 6]


@pytest.mark.parametrize("runtime", [Runtime.SGLANG, Runtime.VLLM])
def test_adapters_read_a_long_prompt_through_the_split(runtime: Runtime) -> None:
    ids = np.arange(SPLIT_MIN_BYTES, dtype=np.uint32)  # ~3 bytes each: over the threshold
    pb = sgl if runtime is Runtime.SGLANG else vllm
    request = pb.GenerateRequest(request_id="long", tokenized=pb.TokenizedInput(input_ids=ids))
    info = engine_adapters()[runtime].generate_info(request.SerializeToString())
    assert isinstance(info.tokens, np.ndarray)
    assert np.array_equal(info.tokens, ids)
    assert info.request_id == "long"


def test_long_garbage_is_still_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        engine_adapters()[Runtime.SGLANG].generate_info(b"\xff" * SPLIT_MIN_BYTES)
