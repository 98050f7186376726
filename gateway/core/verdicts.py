"""Placement verdicts: why a request cannot be placed, as data the front turns into a status.

The table is a contract docs/routing.md publishes: every reason has one gRPC code, one
HTTP-equivalent status, one snake_case HTTP error code, and says whether retrying helps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import grpc

from gateway.core.slo import MAX_SLO_MS, Slo


class Reason(Enum):
    # (gRPC code, HTTP status, HTTP error code, retryable, grpc-retry-pushback-ms)
    MODEL_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, 404, "model_not_found", False, False)
    LEG_NOT_DEPLOYED = (grpc.StatusCode.NOT_FOUND, 404, "leg_not_deployed", False, False)
    NO_COMPATIBLE_PAIR = (grpc.StatusCode.NOT_FOUND, 404, "no_compatible_pair", False, False)
    WORKERS_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, 503, "no_available_workers", True, True)
    POLICY_DECLINED = (grpc.StatusCode.UNAVAILABLE, 503, "policy_declined", True, False)
    WORKERS_OVERLOADED = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "workers_overloaded", True, True)
    MODEL_REQUIRED = (grpc.StatusCode.INVALID_ARGUMENT, 400, "model_required", False, False)
    GATEWAY_OVERLOADED = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "gateway_overloaded", True, True)
    REQUEST_OVER_LIMIT = (grpc.StatusCode.INVALID_ARGUMENT, 400, "request_over_limit", False, False)
    BAD_METADATA = (grpc.StatusCode.INVALID_ARGUMENT, 400, "bad_metadata", False, False)
    CALLER_OVER_SHARE = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "caller_over_share", True, True)
    QUEUE_FULL = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "queue_full", True, True)
    QUEUE_TIMEOUT = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "queue_timeout", True, True)
    SHUTTING_DOWN = (grpc.StatusCode.UNAVAILABLE, 503, "shutting_down", True, True)
    RATE_LIMITED = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limited", True, True)
    ADAPTER_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, 404, "adapter_not_found", False, False)
    ADAPTER_LOAD_FAILED = (grpc.StatusCode.UNAVAILABLE, 503, "adapter_load_failed", True, True)
    SLO_UNATTAINABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "slo_unattainable", True, True)

    def __init__(
        self, code: grpc.StatusCode, http_status: int, error_code: str, retryable: bool, push: bool
    ) -> None:
        self.code = code
        self.http_status = http_status
        self.error_code = error_code
        self.retryable = retryable
        self.pushback = push


@dataclass(frozen=True, slots=True)
class Verdict:
    """A placement failure: the reason, a sentence a person can act on, and its context."""

    reason: Reason
    message: str
    model: str = ""
    leg: str = ""
    extra: Mapping[str, str] = field(default_factory=dict)
    retry_after_ms: int = 0
    violation: tuple[str, str] | None = None  # (field path, description): a BadRequest


MAX_SHOWN = 256  # characters of a client-supplied name that a message repeats


def shown(name: str) -> str:
    """A client-supplied name as a message repeats it: bounded, so an answer's trailers
    stay small whatever the client sent."""
    return name if len(name) <= MAX_SHOWN else name[:MAX_SHOWN] + "..."


def model_required(models: list[str]) -> Verdict:
    return Verdict(
        Reason.MODEL_REQUIRED,
        f"Several models are served here ({', '.join(models)}); "
        "name one with the 'x-model-id' request metadata",
    )


def model_not_found(model: str, service: str, elsewhere: list[str]) -> Verdict:
    model = shown(model)
    if elsewhere:
        where = " and ".join(elsewhere)
        message = f"Model '{model}' is not served over {service}; it is served over {where}"
    else:
        message = f"Model '{model}' is not served by any worker"
    return Verdict(Reason.MODEL_NOT_FOUND, message, model=model)


def not_yet_up(model: str, leg: str, waiting: int, retry_after_ms: int) -> Verdict:
    """A model the configuration declares, or a leg a worker being identified may turn
    out to serve, with no worker registered for it yet: its workers are down or have not
    answered yet, so it is unavailable (503), not unknown (404). `leg` empty: the model."""
    what = f"no {leg} worker" if leg else "no worker"
    asking = f"; {waiting} named worker{'s are' if waiting != 1 else ' is'} still being asked "
    asking += "what it serves" if waiting == 1 else "what they serve"
    return Verdict(
        Reason.WORKERS_UNAVAILABLE,
        f"Model '{shown(model)}' has {what} up or identified yet"
        + (asking if waiting else " (its workers are down or not yet discovered)"),
        model=shown(model),
        leg=leg,
        retry_after_ms=retry_after_ms,
    )


def nothing_served_yet(service: str, waiting: int, retry_after_ms: int) -> Verdict:
    """A call that names no model while no model is served over its protocol but some
    worker may still turn out to serve one (being identified) or one is declared."""
    return Verdict(
        Reason.WORKERS_UNAVAILABLE,
        f"No model is served over {service} yet: its workers are down or not yet "
        f"identified ({waiting} being asked what they serve)",
        retry_after_ms=retry_after_ms,
    )


def leg_not_deployed(model: str, leg: str) -> Verdict:
    return Verdict(
        Reason.LEG_NOT_DEPLOYED,
        f"Model '{model}' has no {leg} workers registered",
        model=model,
        leg=leg,
    )


def workers_unavailable(model: str, leg: str, total: int, retry_after_ms: int) -> Verdict:
    """`leg` empty: the request needed any worker of the model (fleet-wide RPCs)."""
    workers = f"{leg} workers" if leg else "workers"
    return Verdict(
        Reason.WORKERS_UNAVAILABLE,
        f"All {total} {workers} for model '{model}' are unavailable "
        "(not connected, unhealthy or ejected by outlier detection)",
        model=model,
        leg=leg,
        retry_after_ms=retry_after_ms,
    )


def policy_declined(model: str, leg: str, policy: str, retry_after_ms: int) -> Verdict:
    return Verdict(
        Reason.POLICY_DECLINED,
        f"The {policy} policy picked none of the available {leg} workers for model '{model}'",
        model=model,
        leg=leg,
        extra={"policy": policy},
        retry_after_ms=retry_after_ms,
    )


def workers_overloaded(model: str, leg: str, available: int, retry_after_ms: int) -> Verdict:
    return Verdict(
        Reason.WORKERS_OVERLOADED,
        f"All {available} available {leg} workers for model '{model}' are overloaded",
        model=model,
        leg=leg,
        retry_after_ms=retry_after_ms,
    )


def no_compatible_pair(model: str, where: dict[str, list[str]]) -> Verdict:
    """`where`: leg -> the runtimes/pairing groups it has available workers in."""
    found = "; ".join(f"{leg} on {', '.join(groups) or 'none'}" for leg, groups in where.items())
    return Verdict(
        Reason.NO_COMPATIBLE_PAIR,
        f"The prefill and decode workers for model '{model}' share no runtime "
        f"or KV transfer setup ({found})",
        model=model,
        leg="prefill,decode",
    )


def gateway_overloaded(limit: int, retry_after_ms: int) -> Verdict:
    return Verdict(
        Reason.GATEWAY_OVERLOADED,
        f"The gateway is at its limit of {limit} concurrent requests",
        retry_after_ms=retry_after_ms,
    )


def over_limit(model: str, path: str, value: int, limit: int, setting: str) -> Verdict:
    """A client-controlled number above its configured bound, refused before any work."""
    return Verdict(
        Reason.REQUEST_OVER_LIMIT,
        f"{path} = {value} is over this gateway's limit of {limit} ({setting})",
        model=model,
        extra={"field": path, "limit": str(limit)},
        violation=(path, f"must be at most {limit} ({setting})"),
    )


def out_of_vocabulary(model: str, token_id: int, vocab_size: int, source: str) -> Verdict:
    """A prompt token id no worker of the model knows: refused before it reaches one (an
    engine may crash on it, SGLang's whole scheduler does). `source`: where the bound
    comes from (the setting, or the workers' GetModelInfo)."""
    path = "tokenized.input_ids"
    return Verdict(
        Reason.REQUEST_OVER_LIMIT,
        f"{path} holds token id {token_id}, outside the vocabulary of model "
        f"'{shown(model)}' ({vocab_size} ids, 0 to {vocab_size - 1}: {source})",
        model=shown(model),
        extra={"field": path, "limit": str(vocab_size - 1), "token_id": str(token_id)},
        violation=(path, f"token ids must be below the vocabulary size {vocab_size}"),
    )


def bad_metadata(key: str) -> Verdict:
    """A request header whose value grpc would refuse to send upstream: refused at the
    front, so it never reaches a worker channel (whose local failure would otherwise look
    like the worker's)."""
    key = shown(key)
    return Verdict(
        Reason.BAD_METADATA,
        f"Metadata '{key}' has a value that cannot be forwarded: only printable ASCII is "
        "allowed, except in keys ending in -bin",
        extra={"key": key},
        violation=(key, "must be printable ASCII (binary values go in keys ending in -bin)"),
    )


def bad_slo(key: str) -> Verdict:
    """A latency objective header that names no time: refused, not guessed at."""
    key = shown(key)
    return Verdict(
        Reason.BAD_METADATA,
        f"Metadata '{key}' must be a positive number of milliseconds, at most "
        f"{MAX_SLO_MS:.0f} (an hour)",
        extra={"key": key},
        violation=(key, f"must be a positive number of milliseconds up to {MAX_SLO_MS:.0f}"),
    )


def slo_unattainable(
    model: str, leg: str, slo: Slo, ttft_s: float | None, tpot_s: float | None, retry_after_ms: int
) -> Verdict:
    """A sheddable call no worker is predicted to serve within its latency objectives
    (`ttft_s`, `tpot_s`: the best predictions against them)."""
    best = []
    if slo.ttft_s is not None and ttft_s is not None:
        best.append(f"time to first token {ttft_s * 1000:.0f} ms for {slo.ttft_s * 1000:g} ms")
    if slo.tpot_s is not None and tpot_s is not None:
        best.append(f"time per output token {tpot_s * 1000:.1f} ms for {slo.tpot_s * 1000:g} ms")
    return Verdict(
        Reason.SLO_UNATTAINABLE,
        f"No {leg} worker for model '{model}' is predicted to meet this call's latency "
        f"objectives (the best: {', '.join(best)}); it is sheddable, so it is refused "
        "rather than served late",
        model=model,
        leg=leg,
        extra={} if ttft_s is None else {"predicted_ttft_ms": f"{ttft_s * 1000:.0f}"},
        retry_after_ms=retry_after_ms,
    )


def caller_over_share(caller: str, share: int, retry_after_ms: int) -> Verdict:
    return Verdict(
        Reason.CALLER_OVER_SHARE,
        f"This caller ({shown(caller)}) already has {share} requests in flight, its share "
        "of this gateway (limits.max_inflight_per_principal)",
        retry_after_ms=retry_after_ms,
    )


def queue_full(model: str, waiting: int, limit: str, retry_after_ms: int) -> Verdict:
    """`limit`: which bound was reached (`flow.queue.max_requests` or `max_bytes`)."""
    return Verdict(
        Reason.QUEUE_FULL,
        f"Every worker for model '{model}' is busy and its queue is full "
        f"({waiting} waiting, {limit})",
        model=model,
        retry_after_ms=retry_after_ms,
    )


def queue_timeout(model: str, klass: str, waited_s: float, retry_after_ms: int) -> Verdict:
    return Verdict(
        Reason.QUEUE_TIMEOUT,
        f"Waited {waited_s:.1f} s for a worker for model '{model}' (class {klass}) "
        "without one becoming free",
        model=model,
        extra={"class": klass},
        retry_after_ms=retry_after_ms,
    )


def rate_limited(
    model: str, tenant: str, budget: str, per_minute: int, retry_after_ms: int
) -> Verdict:
    """`budget`: `requests_per_minute` or `tokens_per_minute`; the retry hint is when the
    tenant's budget allows the call."""
    return Verdict(
        Reason.RATE_LIMITED,
        f"Tenant '{shown(tenant)}' is over its rate limit ({budget} {per_minute}); "
        f"its budget allows this call in {retry_after_ms} ms",
        model=model,
        extra={"tenant": shown(tenant), "limit": budget},
        retry_after_ms=retry_after_ms,
    )


def shutting_down(model: str, retry_after_ms: int) -> Verdict:
    """A call still queued when the gateway's drain ended: another replica can take it."""
    return Verdict(
        Reason.SHUTTING_DOWN,
        f"The gateway is shutting down; this call for model '{model}' was still waiting "
        "for a worker",
        model=model,
        retry_after_ms=retry_after_ms,
    )


def adapter_not_found(model: str, adapter: str) -> Verdict:
    """A LoRA adapter the gateway has no path for (`lora.adapters`) and no worker holds."""
    adapter = shown(adapter)
    return Verdict(
        Reason.ADAPTER_NOT_FOUND,
        f"LoRA adapter '{adapter}' is not loaded on any worker of model '{model}' and "
        "the gateway cannot load it (not in lora.adapters, or lora.load_on_demand off)",
        model=model,
        extra={"adapter": adapter},
    )


def adapter_load_failed(model: str, adapter: str, why: str, retry_after_ms: int) -> Verdict:
    """Every worker that could take the adapter failed to load it (`why`: the last error)."""
    adapter = shown(adapter)
    return Verdict(
        Reason.ADAPTER_LOAD_FAILED,
        f"LoRA adapter '{adapter}' could not be loaded on any worker of model '{model}' "
        f"({shown(why)})",
        model=model,
        extra={"adapter": adapter},
        retry_after_ms=retry_after_ms,
    )
