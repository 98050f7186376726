"""What of a worker's answers the contract compares: each transcript entry (runner.py) cut
down to its features, with what legitimately differs between a real worker and the
simulator normalised away:

- token id values (a random-weight model's, against the simulator's own): only counts;
- the split of tokens across stream chunks: per choice, the tokens of all its chunks
  together, the sum of the chunks' completion_tokens, whether each chunk counts its own
  tokens (a delta), and the Complete's fields;
- timestamps, request ids, uptimes, load figures, paths, machine ids: presence only, or
  nothing;
- a transport error's or a deadline's text (the client library's): its code only;
- how many messages an aborted call got before its end: the abort's timing;
- time: KV load-record cadence in units of the configured heartbeat, rounded.

Everything else must be the same: status codes, the status message of validation errors,
which fields are present, the Complete's usage and finish reason, where headers come, the
header and trailer keys (but the simulator's own `x-sim-*`), and how the KV event stream
behaves across a restart.
"""

from __future__ import annotations

import datetime
import itertools
import json
from collections.abc import Iterable, Mapping
from typing import Any

from tests.contract.calls import (
    DECODE,
    DETAILS,
    HEADER_TIMING,
    PAIR,
    PREFILL,
    Call,
    Contract,
    KvRestart,
)

# Headers ahead of the first message by this much: sent on their own (the simulator is
# told to be this slow to its first token, a real worker's first token is slow enough).
EARLY_HEADERS_MS = 100.0
# Codes whose text is not the worker's own: none, or the client library's (a transport
# error's, a deadline's).
NOT_THE_WORKERS_WORDS = ("OK", "UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED")


def protocol_keys(pairs: Iterable[list[str]]) -> list[str]:
    return sorted({key for key, _ in pairs if not key.startswith("x-sim-")})


def common(entry: Mapping[str, Any], call: Call | None) -> dict[str, Any]:
    checks = call.checks if call is not None else frozenset()
    features: dict[str, Any] = {
        "code": entry["code"],
        "header_keys": protocol_keys(entry["headers"]),
        "trailer_keys": protocol_keys(entry["trailers"]),
        "status_details": sorted((entry.get("status_details") or {}).keys()),
        # how many came before an aborted call's deadline is the abort's timing
        "messages": len(entry["messages"])
        if entry["code"] != "OK" and (call is None or call.abort_after is None)
        else "-",
    }
    if DETAILS in checks or entry["code"] not in NOT_THE_WORKERS_WORDS:
        features["details"] = entry["details"]
    if HEADER_TIMING in checks:
        lead = entry.get("headers_lead_ms")
        features["headers_before_first_message"] = lead is not None and lead >= EARLY_HEADERS_MS
    return features


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


# --------------------------------------------------------------------------- unary RPCs

MODEL_INFO_VALUES = ("is_generation", "max_context_length", "vocab_size", "max_req_input_len")
SERVER_INFO_VALUES = (
    "server_type",
    "max_total_num_tokens",
    "kv_connector",
    "kv_role",
    "data_parallel_size",
    "block_size",
    "kv_cache_dtype",
    "max_num_seqs",
)
# SGLang's server_args the gateway reads (gateway/engines/sglang.py), by value. Not its
# page_size: the recorded worker runs without --page-size (null), the simulator reports
# its --block-size, as a worker started with --page-size does.
SERVER_ARGS_VALUES = (
    "disaggregation_mode",
    "disaggregation_bootstrap_port",
    "max_running_requests",
)
BOOTSTRAP_PORT = "disaggregation_bootstrap_port"
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998


def bootstrap_port_kind(port: float) -> float | str:
    """SGLang's default port by value; a prefill's own (a free port of each run) as such."""
    return port if port in (0, SGLANG_DEFAULT_BOOTSTRAP_PORT) else "a port of its own"


# what a busy worker reports and an idle one does not: not a field's presence to compare
LOAD_FIGURES = {
    "num_running_reqs",
    "num_waiting_reqs",
    "num_total_reqs",
    "num_used_tokens",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "num_waiting_uncached_tokens",
}


def only_message(entry: Mapping[str, Any]) -> dict[str, Any]:
    messages = entry["messages"]
    return dict(messages[0]) if len(messages) == 1 else {}


def unary_features(entry: Mapping[str, Any], call: Call) -> dict[str, Any]:
    features = common(entry, call)
    body = only_message(entry)
    rpc = call.method.rpartition("/")[2]
    if rpc == "Check" or rpc == "Abort":
        features["reply"] = body
    elif rpc == "HealthCheck":
        features["fields"] = sorted(body)
        features["healthy"] = body.get("healthy", False)
        features["message"] = body.get("message")
    elif rpc == "GetModelInfo":
        features["fields"] = sorted(body)
        features["values"] = {key: body.get(key) for key in MODEL_INFO_VALUES}
    elif rpc == "GetServerInfo":
        features["fields"] = sorted(set(body) - {"active_requests"})
        features["values"] = {key: body.get(key) for key in SERVER_INFO_VALUES}
        args = dict(body.get("server_args", {}))
        if BOOTSTRAP_PORT in args:
            args[BOOTSTRAP_PORT] = bootstrap_port_kind(args[BOOTSTRAP_PORT])
        features["server_args"] = {key: args.get(key) for key in SERVER_ARGS_VALUES if args}
    elif rpc == "GetLoads":
        loads = body.get("loads", [])
        features["fields"] = sorted(body)
        features["dp_rank_count"] = body.get("dp_rank_count", 0)
        features["loads"] = len(loads)
        features["load_fields"] = sorted({key for load in loads for key in load} - LOAD_FIGURES)
        features["max_running_requests"] = sorted(
            {load.get("max_running_requests") for load in loads}
        )
        features["timestamp_iso_with_zone"] = iso_with_zone(body.get("timestamp", ""))
    return features


def iso_with_zone(text: str) -> bool:
    try:
        return datetime.datetime.fromisoformat(text).tzinfo is not None
    except ValueError:
        return False


# --------------------------------------------------------------------------- KV events


def batch_kind(batch: Mapping[str, Any]) -> str:
    if "snapshot" in batch:
        return "snapshot"
    if batch.get("events"):
        return "events"
    if batch.get("load", {}).get("load_only"):
        return "load_only"
    return "empty"


def collapsed(kinds: list[str]) -> list[str]:
    """Runs of one kind as one: ['events', 'load_only', 'load_only'] -> [events, load_only+]."""
    runs: list[str] = []
    for kind in kinds:
        if runs and runs[-1].rstrip("+") == kind:
            runs[-1] = kind + "+"
        else:
            runs.append(kind)
    return runs


# EngineLoad's plain fields: present when not zero, whatever the worker knows (compared
# by value where it matters); its optional ones are present when the worker reports them.
ENGINE_LOAD_PLAIN = {
    "running_requests",
    "waiting_requests",
    "token_usage",
    "gen_throughput",
    "max_running_requests",
    "age_ms",
    "sample",
    "load_only",
}


def event_shape(batch: Mapping[str, Any]) -> dict[str, Any]:
    events = batch.get("events", [])
    blocks = [block for event in events for block in event.get("stored", {}).get("blocks", [])]
    return {
        # (sequence_number is a plain uint64: absent when 0, whatever its meaning)
        "batch_fields": sorted(set(batch) - {"sequence_number"}),
        "events": [sorted(event) for event in events],
        "stored_fields": sorted({k for e in events for k in e.get("stored", {})}),
        "blocks": len(blocks),
        "block_fields": sorted({key for block in blocks for key in block}),
        "block_sizes": sorted({block.get("block_size", 0) for block in blocks}),
        "block_tokens": sorted({len(block.get("token_ids", [])) for block in blocks}),
    }


def gap_class(units: float) -> str:
    """A gap between load records, in heartbeat units, with room for a busy machine's
    jitter: about one unit, about five (the servicer's backoff), or itself."""
    if 0.5 <= units < 2.5:
        return "1 unit"
    if 3.5 <= units < 7.5:
        return "5 units"
    return f"{units:.1f} units"


def subscription_features(
    entry: Mapping[str, Any], unit_s: float, idle_until_ms: float
) -> dict[str, Any]:
    batches: list[dict[str, Any]] = entry["messages"]
    arrivals: list[float] = entry.get("arrival_ms", [])
    kinds = [batch_kind(batch) for batch in batches]
    features: dict[str, Any] = {
        "code": entry["code"],
        "batches": collapsed(kinds),
        "while_idle": collapsed(
            [k for k, at in zip(kinds, arrivals, strict=True) if at < idle_until_ms]
        ),
        "every_batch_has_load": all("load" in batch for batch in batches),
        "dp_rank_present": sorted({"dp_rank" in batch for batch in batches}),
        "load_reported_fields": sorted(
            {key for batch in batches for key in batch.get("load", {})} - ENGINE_LOAD_PLAIN
        ),
        "load_max_running_requests": sorted(
            {batch.get("load", {}).get("max_running_requests", 0) for batch in batches}
        ),
    }
    numbers = [int(batch.get("sequence_number", 0)) for batch in batches]
    events = [i for i, kind in enumerate(kinds) if kind == "events"]
    features["event_sequence_numbers_increase"] = all(
        numbers[a] < numbers[b] for a, b in itertools.pairwise(events)
    )
    # a load-only batch repeats the last sequence number sent on its stream
    last: int | None = None
    repeats = []
    for kind, number in zip(kinds, numbers, strict=True):
        if kind == "load_only":
            repeats.append(number == (last if last is not None else 0))
        else:
            last = number
    features["load_only_repeats_last_sequence"] = all(repeats)
    if events:
        features["event_batch"] = event_shape(batches[events[0]])
        first_event_at = arrivals[events[0]]
        after = [
            at
            for at, kind in zip(arrivals, kinds, strict=True)
            if kind == "load_only" and at > first_event_at
        ]
        # the record of the call's completion, sent at once (not at the next heartbeat)
        features["load_record_within_300ms_of_events"] = bool(after) and (
            after[0] - first_event_at < 300.0
        )
        gaps = [(b - a) / (1000.0 * unit_s) for a, b in itertools.pairwise(after)]
        features["heartbeat_gaps"] = sorted({gap_class(gap) for gap in gaps})
    return features


def kv_features(entry: Mapping[str, Any], scenario: KvRestart) -> dict[str, Any]:
    unit_s = float(entry["unit_s"])
    idle_ms = scenario.idle_units * unit_s * 1000.0
    first = subscription_features(entry["first"], unit_s, idle_ms)
    after = subscription_features(entry["after_restart"], unit_s, idle_ms)
    features: dict[str, Any] = {
        "first": first,
        "first_generate": entry["first_generate"]["code"],
        "after_restart": after,
        "after_restart_generate": entry["after_restart_generate"]["code"],
    }
    for label in ("resume_from_1", "resume_after_last"):
        resume = entry[label]
        features[label] = {
            "code": resume["code"],
            "details": resume["details"],
            "batches": collapsed([batch_kind(b) for b in resume["messages"]]),
        }

    def first_event_number(sub: Mapping[str, Any]) -> int | None:
        for batch in sub["messages"]:
            if batch_kind(batch) == "events":
                return int(batch.get("sequence_number", 0))
        return None

    before, again = first_event_number(entry["first"]), first_event_number(entry["after_restart"])
    features["sequence_starts_over_after_restart"] = (
        before is not None and again is not None and again <= before
    )
    return features


# --------------------------------------------------------------------------- all


def features(contract: Contract, name: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    if contract.kv is not None and name == contract.kv.name:
        return kv_features(entry, contract.kv)
    call = contract.call(name)
    if call is None:
        raise KeyError(f"{contract.engine}'s contract has no call {name!r}")
    if call.method == "Generate" and call.leg == PAIR:
        return {leg: generate_features(entry[leg], call) for leg in (PREFILL, DECODE)}
    if call.method == "Generate":
        return generate_features(entry, call)
    return unary_features(entry, call)


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Where two feature trees differ, one line each: `path: expected X, got Y`."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        lines = []
        for key in sorted(set(expected) | set(actual), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in actual:
                lines.append(f"{where}: expected {expected[key]!r}, missing")
            elif key not in expected:
                lines.append(f"{where}: not expected, got {actual[key]!r}")
            else:
                lines.extend(differences(expected[key], actual[key], where))
        return lines
    if expected != actual:
        return [f"{path}: expected {expected!r}, got {actual!r}"]
    return []
