"""Placement: from (model, protocol, hints) to a worker, or to a verdict saying why not.

The decision is a function of the registry snapshot, the clock and the policy state;
nothing here awaits, so a placement and the dispatch's in-flight increment that follows
it happen without another request in between.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence

from gateway.config import ModelSettings
from gateway.engines import ADAPTERS
from gateway.fleet.registry import Registry
from gateway.fleet.worker import Worker
from gateway.placement import verdicts
from gateway.placement.overload import Limits, overload_reason
from gateway.placement.policies import Hints, Policy, RoundRobin, make_policy
from gateway.placement.verdicts import Verdict
from gateway.roles import Role, Runtime

Placement = Worker | Verdict


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
        return verdicts.leg_not_deployed(model, leg.value)
    if not available:
        return verdicts.workers_unavailable(model, leg.value, len(pool), retry_after_ms)
    if not fitting:
        return verdicts.workers_overloaded(model, leg.value, len(available), overload_retry_ms)
    return None


class Placer:
    """Holds one policy instance per (model, runtime, leg) so legs never share a rotation."""

    def __init__(
        self,
        registry: Registry,
        model_settings: Callable[[str], ModelSettings],
        retry_after_ms: int,
        load_interval_s: float,
        stale_after_s: float,
    ) -> None:
        self._registry = registry
        self._model_settings = model_settings
        self._retry_after_ms = retry_after_ms
        self._overload_retry_ms = round(load_interval_s * 1000)
        self._stale_after_s = stale_after_s
        self._policies: dict[tuple[str, Runtime, Role], Policy] = {}
        self._limits: dict[str, Limits] = {}
        self._any: dict[tuple[str, Runtime], RoundRobin] = {}

    def resolve(self, model: str | None, runtime: Runtime) -> str | Verdict:
        """The model a call is for: the named one, or the protocol's only model."""
        if model is not None:
            if model in self._registry.models(runtime):
                return model
            return self._not_found(model, runtime)
        models = self._registry.models(runtime)
        if len(models) == 1:
            return models[0]
        if not models:
            return verdicts.Verdict(
                verdicts.Reason.MODEL_NOT_FOUND,
                f"No model is served over {ADAPTERS[runtime].service_name}",
            )
        return verdicts.model_required(models)

    def _not_found(self, model: str, runtime: Runtime) -> Verdict:
        elsewhere = [ADAPTERS[r].service_name for r in self._registry.runtimes(model)]
        return verdicts.model_not_found(model, ADAPTERS[runtime].service_name, elsewhere)

    def policy(self, model: str, runtime: Runtime, leg: Role) -> Policy:
        key = (model, runtime, leg)
        policy = self._policies.get(key)
        if policy is None:
            policy = self._policies[key] = make_policy(self._model_settings(model).policy)
        return policy

    def limits(self, model: str) -> Limits:
        limits = self._limits.get(model)
        if limits is None:
            s = self._model_settings(model)
            limits = self._limits[model] = Limits(s.max_inflight, s.max_waiting, s.max_token_usage)
        return limits

    def place(
        self,
        model: str,
        runtime: Runtime,
        hints: Hints,
        exclude: Collection[str] = (),
    ) -> Placement:
        """Pick a regular worker for one request, never one in `exclude` (already failed)."""
        leg = Role.REGULAR
        now = time.monotonic()
        pool = self._registry.pool(model, runtime, leg)
        available = [w for w in pool if w.available(now) and w.id not in exclude]
        limits = self.limits(model)
        fitting = (
            [w for w in available if overload_reason(w, limits, now, self._stale_after_s) is None]
            if limits.any
            else available
        )
        verdict = classify_leg(
            model, leg, pool, available, fitting, self._retry_after_ms, self._overload_retry_ms
        )
        if verdict is not None:
            return verdict
        policy = self.policy(model, runtime, leg)
        chosen = policy.pick(fitting, hints)
        if chosen is None:
            return verdicts.policy_declined(model, leg.value, policy.name, self._retry_after_ms)
        return chosen

    def any_worker(self, model: str, runtime: Runtime, exclude: Collection[str] = ()) -> Placement:
        """One available worker of any leg, for fleet-wide facts (model info, tokenizer)."""
        now = time.monotonic()
        workers = self._registry.workers_of(model, runtime)
        available = [w for w in workers if w.available(now) and w.id not in exclude]
        if not available:
            return verdicts.workers_unavailable(model, "", len(workers), self._retry_after_ms)
        rotation = self._any.setdefault((model, runtime), RoundRobin())
        chosen = rotation.pick(available, Hints())
        assert chosen is not None
        return chosen

    def every_worker(self, model: str, runtime: Runtime) -> list[Worker] | Verdict:
        """Every available worker of the model, for per-worker admin RPCs."""
        now = time.monotonic()
        workers = self._registry.workers_of(model, runtime)
        available = [w for w in workers if w.available(now)]
        if not available:
            return verdicts.workers_unavailable(model, "", len(workers), self._retry_after_ms)
        return available

    def servable(self, model: str, runtime: Runtime | None = None) -> bool:
        """Every leg the model needs has an available worker (on some runtime)."""
        now = time.monotonic()
        runtimes = [runtime] if runtime is not None else self._registry.runtimes(model)
        return any(
            w.available(now)
            for rt in runtimes
            for w in self._registry.pool(model, rt, Role.REGULAR)
        )
