"""`slo:`: latency objectives a call may carry (llm-d's `x-slo-ttft-ms` and
`x-slo-tpot-ms`), and which calls may be refused when no worker is predicted to meet
them. Read by the `predicted_latency` policy; the other policies place as if none were
given (docs/routing.md, "Latency objectives")."""

from __future__ import annotations

from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, HeaderName, Name

DEFAULT_PRIORITY_HEADER = "x-priority"  # flow control's default, read for classes without it


@dataclass(frozen=True, slots=True, config=SETTINGS)
class SloConfig:
    """A call's objectives come in two headers, in milliseconds (a positive number up to
    an hour; anything else is INVALID_ARGUMENT). A call of a `sheddable` class (its flow
    control class, or without flow control the class its priority header names) that no
    worker is predicted to serve within them is refused RESOURCE_EXHAUSTED
    (`SLO_UNATTAINABLE`, with a time to retry); any other call is placed where the
    predictions give it the most headroom, never refused for its objectives."""

    ttft_header: HeaderName = Field(
        default="x-slo-ttft-ms", description="request header: time to first token, in ms"
    )
    tpot_header: HeaderName = Field(
        default="x-slo-tpot-ms",
        description="request header: time per output token after the first, in ms",
    )
    sheddable: tuple[Name, ...] = Field(
        default=("batch",),
        description="classes whose calls are refused when no worker is predicted to meet "
        "their objectives",
    )
