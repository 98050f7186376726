"""What the contract compares of a Generate call (compare.py): beyond what every call has
(compare_unary.common), per choice the count of its tokens over all its chunks, the sum of
the chunks' completion_tokens, whether each chunk counts its own tokens (a delta), the
shape of its logprobs, and the Complete's fields (usage, finish reason); token id values
only by count."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tests.contract.calls import Call
from tests.contract.compare_unary import common

# --------------------------------------------------------------------------- Generate


def logprob_shape(logprobs: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Lengths and presence, no values."""
    if logprobs is None:
        return None
    values = logprobs.get("token_logprobs", [])
    return {
        "fields": sorted(logprobs.keys()),
        "positions": len(values),
        "ids": len(logprobs.get("token_ids", [])),
        # prompt logprobs: the first prompt token has none (an empty wrapper)
        "without_value": [i for i, v in enumerate(values) if isinstance(v, dict) and not v],
        "top_sizes": sorted(
            {len(top.get("values", [])) for top in logprobs.get("top_logprobs", [])}
        ),
    }


def parts(message: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A GenerateResponse's oneof part (chunk, complete, ...), without the request id
    SGLang's carries beside it."""
    return [(kind, body) for kind, body in message.items() if isinstance(body, dict)]


def choice_features(
    messages: list[dict[str, Any]], index: int, stream: bool, abort: bool
) -> dict[str, Any]:
    own = [
        (position, kind, body)
        for position, message in enumerate(messages)
        for kind, body in parts(message)
        if body.get("index", 0) == index
    ]
    chunks = [body for _, kind, body in own if kind == "chunk"]
    completes = [(position, body) for position, kind, body in own if kind == "complete"]
    tokens = sum(len(chunk.get("token_ids", [])) for chunk in chunks)
    features: dict[str, Any] = {
        "chunks": bool(chunks),
        "chunk_fields": sorted({key for chunk in chunks for key in chunk}),
        "empty_chunks": sum(1 for chunk in chunks if not chunk.get("token_ids")),
        # an aborted call's count is the abort's timing: how many came is not compared
        "chunk_tokens": tokens if not abort else "-",
        "chunk_completion_tokens_sum": (
            sum(chunk.get("completion_tokens", 0) for chunk in chunks) if not abort else "-"
        ),
        "chunk_counts_own_tokens": all(
            chunk.get("completion_tokens", 0) == len(chunk.get("token_ids", [])) for chunk in chunks
        ),
        "chunk_prompt_tokens": sorted({chunk.get("prompt_tokens", 0) for chunk in chunks}),
        "chunk_cached_tokens": sorted({chunk.get("cached_tokens", 0) for chunk in chunks}),
        "chunk_output_logprobs_per_token": all(
            len(chunk.get("output_logprobs", {}).get("token_logprobs", []))
            == len(chunk.get("token_ids", []))
            for chunk in chunks
            if "output_logprobs" in chunk
        ),
        "chunk_output_logprobs_top_sizes": sorted(
            {
                len(top.get("values", []))
                for chunk in chunks
                for top in chunk.get("output_logprobs", {}).get("top_logprobs", [])
            }
        ),
        "chunks_with_input_logprobs": [
            n for n, chunk in enumerate(chunks) if "input_logprobs" in chunk
        ],
        "chunk_input_logprobs": logprob_shape(
            next((c["input_logprobs"] for c in chunks if "input_logprobs" in c), None)
        ),
        "completes": len(completes),
    }
    if not completes:
        return features
    position, complete = completes[-1]
    output_ids = complete.get("output_ids", [])
    last_chunk = next((c for c in reversed(chunks) if c.get("token_ids")), None)
    features["complete"] = {
        "fields": sorted(complete.keys()),
        "finish_reason": complete.get("finish_reason"),
        "prompt_tokens": complete.get("prompt_tokens", 0),
        "cached_tokens": complete.get("cached_tokens", 0),
        "completion_tokens": complete.get("completion_tokens", 0) if not abort else "-",
        "output_ids": len(output_ids) if not abort else "-",
        "completion_tokens_counts_output_ids": complete.get("completion_tokens", 0)
        == len(output_ids),
        "is_last_of_its_choice": all(p < position for p, _, _ in own if p != position),
        "output_logprobs": logprob_shape(complete.get("output_logprobs")),
        "input_logprobs": logprob_shape(complete.get("input_logprobs")),
    }
    if "kv_transfer_params_json" in complete:
        # a vLLM prefill's hand-off: the decode's connector reads these keys
        params = json.loads(complete["kv_transfer_params_json"])
        features["complete"]["kv_transfer_params"] = {
            key: type(value).__name__ for key, value in sorted(params.items())
        }
    if stream:
        # a streamed Complete repeats the last chunk (vLLM's delta), or carries totals
        features["complete"]["output_ids_are"] = (
            "empty"
            if not output_ids
            else "last_chunk"
            if last_chunk is not None and output_ids == last_chunk.get("token_ids")
            else "all_chunks"
            if output_ids == [t for c in chunks for t in c.get("token_ids", [])]
            else "other"
        )
        features["complete"]["chunk_tokens_total"] = tokens if not abort else "-"
    if "matched_token_id" in complete:
        everything = [t for c in chunks for t in c.get("token_ids", [])] if stream else output_ids
        features["complete"]["matched_token_id_is_last_token"] = bool(everything) and (
            complete["matched_token_id"] == everything[-1]
        )
    return features


def generate_features(entry: Mapping[str, Any], call: Call) -> dict[str, Any]:
    features = common(entry, call)
    messages: list[dict[str, Any]] = entry["messages"]
    stream = bool(call.request.get("stream"))
    abort = call.abort_after is not None
    indices = sorted({body.get("index", 0) for m in messages for _, body in parts(m)})
    features["kinds"] = sorted({kind for m in messages for kind, _ in parts(m)})
    # SGLang's responses name their request; vLLM's do not
    features["request_id_echoed"] = sorted(
        {m.get("request_id") == call.request.get("request_id") for m in messages}
    )
    features["indices"] = indices
    features["choices"] = {
        str(index): choice_features(messages, index, stream, abort) for index in indices
    }
    if messages:
        features["last_message"] = next(kind for kind, _ in parts(messages[-1]))
    if abort:
        answer = entry["abort"]
        features["abort"] = {"code": answer["code"], "messages": answer["messages"]}
        features["cancelled_by_client"] = bool(entry.get("cancelled_by_client"))
    return features
