"""Per-model settings (`models:`): routing policy and per-worker limits, or a `route`
that makes the name an alias of other models (weighted splits, canaries)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from pydantic import Field
from pydantic.dataclasses import dataclass

from gateway.config.fields import SETTINGS, AtLeastOne, Flag, Fraction, ModelName, Whole
from gateway.core.policy_names import PolicyName

Target = tuple[str, int]  # (model, weight)
Route = tuple[Target, ...]
Where = tuple[int | str, ...]  # a key path under `models:` (`chat`, `route`, 1, `model`)


@dataclass(frozen=True, slots=True, config=SETTINGS)
class RouteTarget:
    """One model an alias sends calls to, with its share of them (weight / the sum)."""

    model: ModelName = Field(
        description="a target: a model the config names, or an alias one level deep"
    )
    weight: Whole = Field(description="its share of the calls (at least one above 0)")


@dataclass(frozen=True, slots=True, config=SETTINGS)
class ModelSettings:
    """Per-model routing and limits (limits apply per worker; None means no limit).

    `encode_leg`: multimodal requests need the encode leg even while no encode worker is
    registered (so a missing encoder is LEG_NOT_DEPLOYED, not a silent text-only answer).
    `route`: the name is an alias; each call goes to one of these models, by weight (the
    alias's other settings are unused: each target's own apply).
    `vocab_size`: prompt token ids must be below it (an engine may crash on one past its
    vocabulary); None: the smallest its workers report (GetModelInfo).
    """

    policy: PolicyName = Field(default="round_robin", description="the model's placement policy")
    encode_leg: Flag = Field(
        default=False, description="multimodal calls need the encode leg even with no encoder up"
    )
    max_inflight: Whole | None = Field(
        default=None, description="calls the gateway runs at once on one worker of the model"
    )
    max_waiting: Whole | None = Field(
        default=None, description="a worker reporting more waiting requests takes no more calls"
    )
    max_token_usage: Fraction | None = Field(
        default=None, description="a worker reporting more KV usage takes no more calls"
    )
    route: tuple[RouteTarget, ...] | None = Field(
        default=None,
        description=(
            "makes the name an alias: each call goes to one of these "
            "models by weight (see docs/routing.md, model aliases)"
        ),
    )
    vocab_size: AtLeastOne | None = Field(
        default=None,
        description=(
            "prompt token ids must be below it, else INVALID_ARGUMENT "
            "(default: the smallest vocabulary its workers report)"
        ),
    )


def routes_of(models: Mapping[str, ModelSettings]) -> dict[str, Route]:
    """Alias -> its (model, weight) targets, for the models that have a `route`."""
    return {
        name: tuple((t.model, t.weight) for t in settings.route)
        for name, settings in models.items()
        if settings.route is not None
    }


def named_models(
    models: Mapping[str, ModelSettings], served: Iterable[str | None]
) -> frozenset[str]:
    """The models a route may send to: `models:` keys that are no alias, and `served`
    (the configured workers' and discovery sources' models)."""
    own = {name for name, settings in models.items() if settings.route is None}
    return frozenset(own | {m for m in served if m})


def route_problem(
    routes: Mapping[str, Route], named: Collection[str], served: Collection[str]
) -> tuple[Where, str] | None:
    """The first thing wrong with the routes (where, under `models:`, and what), or None.

    A target is a named model or another alias whose own targets are no aliases (one
    level of nesting); weights are whole numbers, at least one above 0; no cycle."""
    for alias, route in routes.items():
        if alias in served:
            return (alias, "route"), (
                f"{alias!r} is also the model of a worker or discovery source: an alias "
                "needs a name of its own"
            )
        problem = _own_problem(alias, route, routes, named)
        if problem is not None:
            return problem
    return None


def _own_problem(
    alias: str, route: Sequence[Target], routes: Mapping[str, Route], named: Collection[str]
) -> tuple[Where, str] | None:
    if not route:
        return (alias, "route"), "must name at least one target"
    if not any(weight > 0 for _, weight in route):
        return (alias, "route"), "needs a weight above 0 (every weight is 0)"
    seen: set[str] = set()
    for i, (model, weight) in enumerate(route):
        if weight < 0:
            return (alias, "route", i, "weight"), f"must be at least 0, not {weight}"
        if model in seen:
            return (alias, "route", i, "model"), f"{model!r} is listed twice"
        seen.add(model)
        chain = _chain(alias, model, routes)
        if chain is not None:
            return (alias, "route", i, "model"), chain
        if model not in routes and model not in named:
            return (alias, "route", i, "model"), (
                f"unknown model {model!r} (not a models: key, a worker's model or a "
                "discovery source's model)"
            )
    return None


def _chain(alias: str, target: str, routes: Mapping[str, Route]) -> str | None:
    """A cycle, or an alias of an alias of an alias, reached from `alias` via `target`."""
    if target == alias:
        return f"cycle: {alias} -> {alias}"
    inner = routes.get(target)
    if inner is None:
        return None
    for model, _ in inner:
        if model in (alias, target):
            return f"cycle: {alias} -> {target} -> {model}"
        if model in routes:
            return (
                f"too deep: {alias} -> {target} -> {model} is an alias of an alias of an "
                "alias (a target may be an alias only one level deep)"
            )
    return None
