"""Legs: what a request demands, each leg's own verdict, and which single verdict answers
when several legs fail.

A model is served by regular workers, or by prefill + decode workers (disaggregated);
multimodal requests to a model with an encode leg also demand encode. Each demanded leg
is judged by its own pool, so a healthy leg is never blamed for another's failure; when
several legs fail, the most permanent cause wins: a client retrying a NOT_FOUND would
retry forever, a RESOURCE_EXHAUSTED passes with the load, an UNAVAILABLE may pass soonest.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from gateway.core.roles import Role
from gateway.core.verdicts import (
    Verdict,
    leg_not_deployed,
    workers_overloaded,
    workers_unavailable,
)
from gateway.upstream.worker import Worker

PD_LEGS = (Role.PREFILL, Role.DECODE)

# Lower sorts first: more permanent.
PERMANENCE = {
    grpc.StatusCode.NOT_FOUND: 0,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 1,
    grpc.StatusCode.UNAVAILABLE: 2,
}


def demanded_legs(disaggregated: bool, multimodal: bool, encode_leg: bool) -> tuple[Role, ...]:
    """The legs one request needs, in the order they are judged and reported."""
    legs = PD_LEGS if disaggregated else (Role.REGULAR,)
    return (Role.ENCODE, *legs) if multimodal and encode_leg else legs


def most_permanent(verdicts: Sequence[Verdict]) -> Verdict:
    """The verdict to answer with; ties go to the first leg in demand order."""
    return min(verdicts, key=lambda v: PERMANENCE.get(v.reason.code, 3))


def classify_leg(
    model: str,
    leg: Role,
    pool: Sequence[Worker],
    available: Sequence[Worker],
    fitting: Sequence[Worker],
    retry_after_ms: int,
    overload_retry_ms: int,
) -> Verdict | None:
    """A leg's own verdict, judged only by its own pool."""
    if not pool:
        return leg_not_deployed(model, leg.value)
    if not available:
        return workers_unavailable(model, leg.value, len(pool), retry_after_ms)
    if not fitting:
        return workers_overloaded(model, leg.value, len(available), overload_retry_ms)
    return None
