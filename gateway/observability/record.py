"""The call record: what one client call did, for its log line and its metrics.

It keeps three things apart that are easy to conflate: *attempts* (placements tried;
a retry on another worker adds one), *legs* (the upstream calls one placement makes:
regular, or prefill + decode, plus encoders) and *targets* (the workers a fan-out or an
abort reached). Only retries count as retries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from urllib.parse import unquote

from gateway.core.roles import Role
from gateway.core.slo import Slo
from gateway.core.verdicts import Verdict


@dataclass(frozen=True, slots=True)
class PlacedOn:
    """What a policy saw of the worker it placed a leg on, for that worker's latency
    model (`gateway.upstream.latency`): its load, its prefill backlog (tokens), and the
    time to first message `predicted_latency` predicted there."""

    load: float
    backlog: int
    predicted_s: float | None = None


@dataclass(slots=True)
class CallRecord:
    rpc: str
    service: str
    model: str = ""  # the model the call named
    target: str | None = None  # the model an alias sent it to (named an alias: only then)
    request_id: str = ""
    code: str = "OK"
    started: float = field(default_factory=time.perf_counter)
    first_message_s: float | None = None
    messages: int = 0
    verdict: Verdict | None = None  # the placement verdict the call was refused with
    attempts: int = 0  # placements tried (n>1: summed over the choices)
    retries: int = 0  # attempts after a retryable failure, always on another worker
    legs: dict[Role, list[str]] = field(default_factory=dict)  # leg -> workers called
    targets: list[str] = field(default_factory=list)  # fan-out and abort: workers reached
    worker: str | None = None  # the worker whose answer the client got
    rooms: list[int] = field(default_factory=list)  # SGLang PD bootstrap rooms, per choice
    handoff_failure: str = ""  # why a PD hand-off failed, for metrics (missing_kv_params)
    prompt_tokens: int = 0  # Generate: the prompt's length
    choices: int = 1  # Generate: the choices it asked for (n)
    expected_cached_tokens: int | None = None  # cache-aware placement's expected hit
    placed_on: PlacedOn | None = None  # its prompt's worker as a cache-aware policy saw it
    paced_on: PlacedOn | None = None  # its decode worker (PD) as predicted_latency saw it
    # Generate: what its engine reported in its closing answers (completion tokens summed
    # over the choices; cached tokens are the prompt's, the most any choice reported).
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # beside expected_cached_tokens: was the index right?
    usage_rejected: tuple[str, ...] = ()  # figures the worker reported past their bounds
    principal: str | None = None  # who called (API key, client certificate), if known
    peer: str = ""  # the client's address, as grpc names it (`ipv4:10.0.0.1:5555`)
    suppressed: int | None = 0  # like lines held back before this one; None: held back
    # Flow control (a `flow:` section): the tenant and class it waited as, how long.
    tenant: str | None = None
    priority: str | None = None
    lowered: bool = False  # asked for a class above its tenant's max_class
    queued_s: float | None = None
    # Latency objectives it stated (`x-slo-ttft-ms`, `x-slo-tpot-ms`), and its class as
    # their metrics name it (flow control's; without it, a sheddable class it named).
    slo: Slo | None = None
    slo_class: str = ""
    trace_id: str | None = None  # tracing on: the call's trace, to find it from its log line
    # Streams whose worker failed after tokens reached the client: (cause, outcome) each,
    # outcome `continued` (on another worker) or why not; and the tokens re-sent for them.
    migrations: list[tuple[str, str]] = field(default_factory=list)
    resent_tokens: int = 0
    # Placed by the endpoint picker, answered through Envoy: the gateway counted no
    # message of the answer, and read its usage from the messages Envoy kept.
    picked: bool = False
    # The stage of the call pipeline it was in last (`proxy/stages.py`), or the kind of
    # RPC its handler serves: where a refusal came from.
    stage: str = ""

    @property
    def continued(self) -> int:
        """How many times its stream went on on another worker."""
        return sum(1 for _, outcome in self.migrations if outcome == "continued")

    def called(self, leg: Role, worker: str) -> None:
        self.legs.setdefault(leg, []).append(worker)

    def duration_s(self) -> float:
        """From the call's start until now (the call ended: its line and its metrics)."""
        return time.perf_counter() - self.started

    def log_fields(self) -> dict[str, object]:
        first = self.first_message_s
        fields: dict[str, object] = {
            "model": self.model,
            "service": self.service,
            "rpc": self.rpc,
            "principal": self.principal,
            "peer": unquote(self.peer) if "%" in self.peer else self.peer,
            "worker": self.worker,
            "attempts": self.attempts,
            "retries": self.retries,
            "legs": {leg.value: workers for leg, workers in self.legs.items()} or None,
            "targets": self.targets or None,
            "code": self.code,
            "reason": self.verdict.reason.name if self.verdict else None,
            "first_message_ms": round(first * 1000, 3) if first is not None else None,
            "duration_ms": round(self.duration_s() * 1000, 3),
            "messages": self.messages,
            "request_id": self.request_id or None,
            "rooms": self.rooms or None,
            "expected_cached_tokens": self.expected_cached_tokens,
            "predicted_first_message_ms": (
                round(self.placed_on.predicted_s * 1000, 3)
                if self.placed_on is not None and self.placed_on.predicted_s is not None
                else None
            ),
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "migrations": self.continued,
        }
        if self.target is not None:  # the call named an alias
            fields["target"] = self.target
        if self.code != "OK" and self.stage:  # where it was refused, or failed
            fields["stage"] = self.stage
        if self.picked:  # answered through Envoy: its messages were not counted here
            fields["via"] = "picker"
        if self.trace_id is not None:  # tracing on
            fields["trace_id"] = self.trace_id
        if self.suppressed:  # refused calls' lines, bounded (gateway.proxy.front)
            fields["suppressed"] = self.suppressed
        if self.tenant is not None:  # flow control or rate limits: only then
            fields["tenant"] = self.tenant
        if self.priority is not None:  # flow control: only then
            fields.update(
                priority=self.priority,
                lowered=self.lowered,
                queued_ms=round((self.queued_s or 0.0) * 1000, 3),
            )
        return fields


def mean_gap(duration_s: float, first_message_s: float, messages: int) -> float | None:
    """The mean time between a stream's messages after the first (its end counts as the
    last message's time), or None under 2 messages: one figure per call, so relaying a
    message costs nothing more."""
    if messages < 2:
        return None
    return max(0.0, duration_s - first_message_s) / (messages - 1)
