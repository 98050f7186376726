"""The series fed by each finished call's record: answers by code, placement's verdicts,
time to first message, retries, migrations, PD hand-off failures, prompt and cached
tokens."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.observability.record import CallRecord
from gateway.placement.verdicts import Reason

# Time to first message of an LLM stream: prefill of a short prompt on an idle GPU is a few
# milliseconds; long prompts, queueing and PD handoff take seconds.
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.35,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    4.0,
    6.0,
    10.0,
    15.0,
    20.0,
    30.0,
)
# A model no worker serves is named by the client: labelling it would let any client
# create series, so such calls carry model="" (the log line has the name).
CLIENT_NAMED = frozenset({Reason.MODEL_NOT_FOUND, Reason.MODEL_REQUIRED})
STREAMING_RPC = "Generate"


class CallSeries:
    """The per-call counters and histogram, their label children cached."""

    def __init__(self, prometheus: CollectorRegistry) -> None:
        self._requests = Counter(
            "gateway_requests",
            "calls answered, by final gRPC status code",
            ["model", "service", "rpc", "code"],
            registry=prometheus,
        )
        self._verdicts = Counter(
            "gateway_verdicts",
            "calls refused by placement, by verdict reason and leg",
            ["model", "reason", "leg"],
            registry=prometheus,
        )
        self._first_message = Histogram(
            "gateway_first_message_seconds",
            "time from call start to the first response message relayed (Generate)",
            ["model", "service"],
            buckets=TTFT_BUCKETS,
            registry=prometheus,
        )
        self._retries = Counter(
            "gateway_retries",
            "placements tried again on another worker after a retryable upstream failure",
            ["model", "service"],
            registry=prometheus,
        )
        self._handoff_failures = Counter(
            "gateway_pd_handoff_failures",
            "disaggregated requests failed by their KV hand-off (e.g. a vLLM prefill that "
            "returned no kv_transfer_params)",
            ["model", "reason"],
            registry=prometheus,
        )
        self._prompt_tokens = Counter(
            "gateway_prompt_tokens",
            "prompt tokens of requests placed cache-aware",
            ["model"],
            registry=prometheus,
        )
        self._hit_tokens = Counter(
            "gateway_prefix_hit_tokens",
            "of those, the tokens the gateway's prefix index expected cached where it placed",
            ["model"],
            registry=prometheus,
        )
        self._engine_cached = Counter(
            "gateway_engine_cached_tokens",
            "prompt tokens the engines reported cached in their answers, every Generate (set "
            "beside gateway_prefix_hit_tokens_total: what the index expected)",
            ["model"],
            registry=prometheus,
        )
        self._engine_cached_children: dict[tuple[str, ...], Any] = {}
        self._usage_rejected = Counter(
            "gateway_worker_usage_rejected",
            "Generate answers whose usage figure was past what the call could have used "
            "(counted as the bound instead), by figure: completion_tokens, cached_tokens",
            ["model", "figure"],
            registry=prometheus,
        )
        self._migrations = Counter(
            "gateway_migrations",
            "Generate streams whose worker failed or left after tokens reached the client, "
            "by cause (unavailable, internal, cancelled, worker_removed) and outcome "
            "(continued on another worker, unplaced, refused_by_worker, or why not: "
            "constrained, prompt_logprobs, choices, too_long, limit, finished, disabled, ...)",
            ["model", "reason", "outcome"],
            registry=prometheus,
        )
        self._prompt_children: dict[tuple[str, ...], Any] = {}
        self._hit_children: dict[tuple[str, ...], Any] = {}
        self._request_children: dict[tuple[str, ...], Any] = {}
        self._verdict_children: dict[tuple[str, ...], Any] = {}
        self._first_children: dict[tuple[str, ...], Any] = {}
        self._retry_children: dict[tuple[str, ...], Any] = {}

    def observe(self, record: CallRecord) -> None:
        """Count one finished call (a few cached lookups, no allocation beyond the key
        tuples)."""
        verdict = record.verdict
        model = record.model
        if verdict is not None and verdict.reason in CLIENT_NAMED:
            model = ""
        child(
            self._request_children, self._requests, (model, record.service, record.rpc, record.code)
        ).inc()
        if verdict is not None:
            reason = (model, verdict.reason.name, verdict.leg)
            child(self._verdict_children, self._verdicts, reason).inc()
        first = record.first_message_s
        if first is not None and record.rpc == STREAMING_RPC:
            where = (model, record.service)
            child(self._first_children, self._first_message, where).observe(first)
        if record.retries:
            child(self._retry_children, self._retries, (model, record.service)).inc(record.retries)
        expected = record.expected_cached_tokens
        if expected is not None:
            child(self._prompt_children, self._prompt_tokens, (model,)).inc(record.prompt_tokens)
            child(self._hit_children, self._hit_tokens, (model,)).inc(expected)
        if record.cached_tokens is not None:
            counter = child(self._engine_cached_children, self._engine_cached, (model,))
            counter.inc(record.cached_tokens)
        for figure in record.usage_rejected:
            self._usage_rejected.labels(model, figure).inc()
        for cause, outcome in record.migrations:
            self._migrations.labels(model, cause, outcome).inc()
        if record.handoff_failure:
            self._handoff_failures.labels(model, record.handoff_failure).inc()


def child(cache: dict[tuple[str, ...], Any], metric: Any, key: tuple[str, ...]) -> Any:
    """The labelled child of `metric` for `key`, looked up once and cached."""
    labelled = cache.get(key)
    if labelled is None:
        labelled = cache[key] = metric.labels(*key)
    return labelled
