"""What the contract compares of every call (compare.py): its code, header and trailer keys
(but the simulator's own `x-sim-*`), status details and, where they are the worker's own
words, its details, and whether its headers come ahead of the first message; and of a
unary call's answer: which fields are present, some by value (model and server info, the
server_args the gateway reads), load figures and timestamps by presence only."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from tests.contract.calls import DETAILS, HEADER_TIMING, Call

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
