"""The series fed by each finished call's record: answers by code and their duration,
placement's verdicts, time to first message and between messages, retries, migrations, PD
hand-off failures, prompt, cached and generated tokens."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.core.verdicts import Reason
from gateway.observability.record import CallRecord, mean_gap

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
# A whole call: an Embed or a refusal takes milliseconds, a long generation minutes.
DURATION_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
# Between two messages of a stream: a decode step is a few to a hundred milliseconds; a
# message may carry several tokens, and a loaded engine stalls streams for seconds.
INTER_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
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
        self._duration = Histogram(
            "gateway_request_duration_seconds",
            "calls answered: time from the call's start to its end, by final gRPC status code",
            ["model", "service", "rpc", "code"],
            buckets=DURATION_BUCKETS,
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
        self._inter_token = Histogram(
            "gateway_inter_token_seconds",
            "Generate streams of 2 or more messages, one observation per call: the mean gap "
            "between its messages after the first, (end - first message) / (messages - 1) "
            "(a message may carry several tokens)",
            ["model", "service"],
            buckets=INTER_TOKEN_BUCKETS,
            registry=prometheus,
        )
        self._generated = Counter(
            "gateway_generated_tokens",
            "completion tokens of Generate calls, as the engines reported them",
            ["model"],
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
            "prompt tokens of Generate calls placed on a worker, every policy (beside "
            "gateway_prefix_hit_tokens_total for the cache-aware ones)",
            ["model"],
            registry=prometheus,
        )
        self._hit_tokens = Counter(
            "gateway_prefix_hit_tokens",
            "prompt tokens the gateway's prefix index expected cached where it placed "
            "(cache_aware placements)",
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
        self._route_decisions = Counter(
            "gateway_route_decisions",
            "calls for a model alias, by the alias and the target it sent the call to (both "
            "names from the config)",
            ["alias", "target"],
            registry=prometheus,
        )
        self._slo = Counter(
            "gateway_slo_calls",
            "Generate calls that stated latency objectives (x-slo-ttft-ms, x-slo-tpot-ms), "
            "by class (flow control's) and outcome: met (every objective stated), missed, "
            "shed (refused SLO_UNATTAINABLE: sheddable, predicted to miss), failed",
            ["model", "class", "outcome"],
            registry=prometheus,
        )
        self._slo_children: dict[tuple[str, ...], Any] = {}
        self._route_children: dict[tuple[str, ...], Any] = {}
        self._prompt_children: dict[tuple[str, ...], Any] = {}
        self._hit_children: dict[tuple[str, ...], Any] = {}
        self._request_children: dict[tuple[str, ...], Any] = {}
        self._duration_children: dict[tuple[str, ...], Any] = {}
        self._inter_token_children: dict[tuple[str, ...], Any] = {}
        self._generated_children: dict[tuple[str, ...], Any] = {}
        self._verdict_children: dict[tuple[str, ...], Any] = {}
        self._first_children: dict[tuple[str, ...], Any] = {}
        self._retry_children: dict[tuple[str, ...], Any] = {}

    def observe(self, record: CallRecord) -> None:
        """Count one finished call (a few cached lookups, no allocation beyond the key
        tuples)."""
        verdict = record.verdict
        # A call for an alias is counted as its target's (where it ran: a canary's
        # series beside the stable one's), and once as the alias's decision.
        model = record.model if record.target is None else record.target
        if record.target is not None:
            decided = (record.model, record.target)
            child(self._route_children, self._route_decisions, decided).inc()
        if verdict is not None and verdict.reason in CLIENT_NAMED:
            model = ""
        answered = (model, record.service, record.rpc, record.code)
        child(self._request_children, self._requests, answered).inc()
        duration = record.duration_s()
        child(self._duration_children, self._duration, answered).observe(duration)
        if verdict is not None:
            reason = (model, verdict.reason.name, verdict.leg)
            child(self._verdict_children, self._verdicts, reason).inc()
        first = record.first_message_s
        streamed = record.rpc == STREAMING_RPC
        if first is not None and streamed:
            where = (model, record.service)
            child(self._first_children, self._first_message, where).observe(first)
            gap = mean_gap(duration, first, record.messages)
            if gap is not None:
                child(self._inter_token_children, self._inter_token, where).observe(gap)
        if record.completion_tokens is not None and streamed:
            tokens = child(self._generated_children, self._generated, (model,))
            tokens.inc(record.completion_tokens)
        if record.retries:
            child(self._retry_children, self._retries, (model, record.service)).inc(record.retries)
        if streamed and record.attempts and record.prompt_tokens:
            child(self._prompt_children, self._prompt_tokens, (model,)).inc(record.prompt_tokens)
        expected = record.expected_cached_tokens
        if expected is not None:
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
        if record.slo is not None:
            fared = slo_outcome(record, duration)
            if fared is not None:
                key = (model, record.slo_class, fared)
                child(self._slo_children, self._slo, key).inc()


def slo_outcome(record: CallRecord, duration_s: float) -> str | None:
    """How a call with latency objectives fared: met, missed, shed or failed; None when
    an objective it stated was not observed (a pace, in a stream of one message)."""
    assert record.slo is not None
    if record.verdict is not None and record.verdict.reason is Reason.SLO_UNATTAINABLE:
        return "shed"
    first = record.first_message_s
    if record.code != "OK" or first is None:
        return "failed"
    met = record.slo.met(first, mean_gap(duration_s, first, record.messages))
    return None if met is None else ("met" if met else "missed")


def child(cache: dict[tuple[str, ...], Any], metric: Any, key: tuple[str, ...]) -> Any:
    """The labelled child of `metric` for `key`, looked up once and cached."""
    labelled = cache.get(key)
    if labelled is None:
        labelled = cache[key] = metric.labels(*key)
    return labelled
