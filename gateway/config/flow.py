"""Flow control (`flow:`, `tenants:`): queues instead of refusals when every worker is busy."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Annotated

from pydantic import Field, Strict, model_validator
from pydantic.dataclasses import dataclass

from gateway.config.errors import ConfigError, field_error
from gateway.config.fields import (
    SETTINGS,
    AtLeastOne,
    Flag,
    HeaderName,
    Interval,
    Name,
    Size,
    Whole,
)

# -- flow control: queues instead of refusals when every worker is busy --------------------


@dataclass(frozen=True, slots=True, config=SETTINGS)
class FlowClassConfig:
    """A priority class; `starvation_s`: waited this long, served next, ahead of every
    class (so even a flood of higher classes cannot hold it back longer)."""

    name: Name = Field(description="the class's name, as clients ask for it")
    ttl_s: Interval = Field(
        default=60.0, description="a call waits at most this long: then QUEUE_TIMEOUT"
    )
    starvation_s: Interval | None = Field(
        default=None, description="waited this long: served next, ahead of every class"
    )


@dataclass(frozen=True, slots=True, config=SETTINGS)
class FlowQueueConfig:
    """Per model: requests waiting, and the bytes of their requests."""

    max_requests: AtLeastOne = Field(
        default=2048, description="calls waiting per model; past it: QUEUE_FULL"
    )
    max_bytes: Size = Field(
        default=256 * 1024 * 1024,
        description="bytes of waiting requests per model; past it: QUEUE_FULL",
    )


DEFAULT_COST_TOKENS = 256
DEFAULT_TENANT_LABELS = 20


def _standard_classes() -> tuple[FlowClassConfig, ...]:
    return (
        FlowClassConfig("interactive", ttl_s=30.0),
        FlowClassConfig("standard", ttl_s=60.0),
        FlowClassConfig("batch", ttl_s=300.0, starvation_s=60.0),
    )


@dataclass(frozen=True, slots=True, config=SETTINGS)
class FlowConfig:
    """When every worker of a model is at its limits, requests wait (see
    docs/flow-control.md) instead of being refused at once; without a `flow:` section they
    are."""

    classes: tuple[FlowClassConfig, ...] = Field(
        default_factory=_standard_classes, description="priority classes, highest first"
    )
    default_class: Name = Field(
        default="standard", description="the class of a call that names none (or an unknown one)"
    )
    priority_header: HeaderName = Field(
        default="x-priority", description="the request header naming a call's class"
    )
    queue: FlowQueueConfig = dataclasses.field(default_factory=FlowQueueConfig)
    trust_tenant_header: Flag = Field(
        default=False,
        description="true: `tenant_header` names the tenant (behind a trusted proxy only)",
    )
    tenant_header: HeaderName = Field(
        default="x-tenant-id", description="the request header naming the tenant, when trusted"
    )
    cost_tokens: AtLeastOne = Field(
        default=DEFAULT_COST_TOKENS,
        description="a call's output when it sets no max new tokens (its cost, its charge)",
    )
    tenant_labels: Whole = Field(
        default=DEFAULT_TENANT_LABELS,
        description="tenants named in per-tenant metrics at once; the rest `other`",
    )

    @model_validator(mode="after")
    def _known_classes(self) -> FlowConfig:
        names = [c.name for c in self.classes]
        if not names:
            raise field_error("classes: give at least one class")
        if len(set(names)) != len(names):
            raise field_error(f"classes: a class is named twice ({', '.join(names)})")
        if self.default_class not in names:
            raise field_error(f"default_class: {self.default_class!r} is not one of {names}")
        return self

    def index(self, name: str) -> int | None:
        return next((i for i, c in enumerate(self.classes) if c.name == name), None)


@dataclass(frozen=True, slots=True, config=SETTINGS)
class TenantConfig:
    """A tenant (an API key's name, a client certificate's identity; `default` for the
    rest): the highest class it may ask for, and its share within a class."""

    max_class: Name | None = Field(
        default=None, description="the highest class it may ask for; null: any"
    )
    weight: Annotated[float, Strict(), Field(gt=0)] = Field(
        default=1.0, description="its share within a class, against other tenants"
    )
    max_inflight: AtLeastOne | None = Field(
        default=None,
        description="its calls in flight; past it, its calls wait (with `flow:` only)",
    )
    requests_per_minute: AtLeastOne | None = Field(
        default=None, description="token bucket of calls; past it: RATE_LIMITED"
    )
    tokens_per_minute: AtLeastOne | None = Field(
        default=None,
        description="token bucket of prompt + generated tokens; past it: RATE_LIMITED",
    )

    def shared(self, share: Callable[[int], int], budgets: bool = True) -> TenantConfig:
        """One serving process's part of the tenant's limits (`--processes N`); with
        `budgets` False (a shared store charges them for the fleet), its budgets whole."""
        whole: Callable[[int], int] = share if budgets else int
        return dataclasses.replace(
            self,
            max_inflight=_maybe(share, self.max_inflight),
            requests_per_minute=_maybe(whole, self.requests_per_minute),
            tokens_per_minute=_maybe(whole, self.tokens_per_minute),
        )


def _maybe(share: Callable[[int], int], limit: int | None) -> int | None:
    return None if limit is None else share(limit)


def check_tenant_classes(flow: FlowConfig | None, tenants: Mapping[str, TenantConfig]) -> None:
    """Every tenant's `max_class` is a class of `flow:`."""
    for name, tenant in tenants.items():
        if tenant.max_class is not None and (flow is None or flow.index(tenant.max_class) is None):
            known = [c.name for c in flow.classes] if flow is not None else []
            raise ConfigError(
                f"tenants.{name}.max_class: {tenant.max_class!r} is not a flow class {known}"
            )
