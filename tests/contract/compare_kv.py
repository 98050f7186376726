"""What the contract compares of the KV event stream (compare.py): the kinds of its batches
(snapshot, events, load only) with runs collapsed, each event's shape, EngineLoad's fields
by presence, the cadence of load records in units of the configured heartbeat, and how the
stream behaves across a worker's restart (KvRestart)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from tests.contract.calls import KvRestart

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
