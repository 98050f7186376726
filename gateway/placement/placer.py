"""Placement: from (model, protocol, hints) to a worker, or to a verdict saying why not.

Each leg is placed within its cluster (the model's workers of that role on the call's
runtime), by the cluster's own policy and limits. The decision is a function of the
registry snapshot, the clock and the policy state;
nothing here awaits, so a placement and the dispatch's in-flight increment that follows
it happen without another request in between. A call's attempts are placed through
`placing.Placing` (session affinity); a leg's own verdict is `legs.classify_leg`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from types import MappingProxyType
from typing import cast

from gateway.config import Declared, ModelSettings
from gateway.config.lora import LoraConfig
from gateway.core import verdicts
from gateway.core.roles import ENGINE_ROLES, Role, Runtime
from gateway.core.verdicts import Verdict
from gateway.engines import Adapters
from gateway.placement.affinity import NO_BINDING, Affinity
from gateway.placement.decision import Decision, ranks
from gateway.placement.legs import PD_LEGS, classify_leg, demanded_legs, most_permanent
from gateway.placement.lora import Holding, adapter_of, preferred
from gateway.placement.policies import Choice, Hints, Policy, Unattainable, rendezvous_pick
from gateway.placement.policies.cache_aware import CacheAware
from gateway.placement.policies.round_robin import RoundRobin
from gateway.upstream.cluster import Cluster
from gateway.upstream.load.limits import overload_reason
from gateway.upstream.load.lora import AdapterWatch
from gateway.upstream.registry import Registry
from gateway.upstream.worker import Worker

Placement = Worker | Verdict


def _group(worker: Worker) -> str:
    return f"{worker.runtime}" + (f" [{worker.pairing}]" if worker.pairing else "")


def spread_items(
    items: Sequence[str], encoders: Sequence[Worker]
) -> tuple[tuple[Worker, tuple[str, ...]], ...]:
    """Each item to the encoder its content hashes to (the same image keeps hitting the same
    encoder's cache); one part per encoder, in order of first appearance."""
    parts: dict[Worker, list[str]] = {}
    for item in items:
        parts.setdefault(rendezvous_pick(encoders, item), []).append(item)
    return tuple((worker, tuple(part)) for worker, part in parts.items())


class Placer:
    """Places calls on the registry's clusters; `model_settings` says which models need
    the encode leg, `adapters` the engine service names verdicts speak of."""

    def __init__(
        self,
        registry: Registry,
        model_settings: Callable[[str], ModelSettings],
        retry_after_ms: int,
        load_interval_s: float,
        stale_after_s: float,
        adapters: Adapters,
        affinity: Affinity | None = None,
        lora: LoraConfig | None = None,
        lora_watch: AdapterWatch | None = None,
        declared: Declared = MappingProxyType({}),
    ) -> None:
        self.affinity = affinity  # session bindings (`affinity:` on), written by `Placing`
        self._lora = lora or LoraConfig()
        self._lora_watch = lora_watch
        self._adapters = adapters
        self._registry = registry
        self._model_settings = model_settings
        self._retry_after_ms = retry_after_ms
        self._overload_retry_ms = round(load_interval_s * 1000)
        self._stale_after_s = stale_after_s
        self._any: dict[tuple[str, Runtime], RoundRobin] = {}
        self._declared = declared  # model -> the runtimes the config declares it on

    def configure(
        self,
        model_settings: Callable[[str], ModelSettings],
        retry_after_ms: int,
        lora: LoraConfig,
        declared: Declared,
    ) -> None:
        """A reload: the models' settings, the retry hint, the LoRA settings and the
        declared models now (each read at its next use)."""
        self._model_settings, self._retry_after_ms = model_settings, retry_after_ms
        self._lora, self._declared = lora, declared

    def resolve(self, model: str | None, runtime: Runtime) -> str | Verdict:
        """The model a call is for: the named one, or the protocol's only model. A model
        no worker serves yet is unavailable, not unknown, when the configuration declares
        it (its workers down or not yet identified)."""
        registry = self._registry
        if model is not None:
            if registry.serves(model, runtime):
                return model
            if not registry.runtimes(model) and self.declared(model, runtime):
                waiting = registry.awaits(model, runtime)
                return verdicts.not_yet_up(model, "", waiting, self._retry_after_ms)
            return self._not_found(model, runtime)
        models = registry.models(runtime)
        if len(models) == 1:
            return models[0]
        if models:
            return verdicts.model_required(models)
        service = self._adapters[runtime].service_name
        declared = [m for m in self._declared if self.declared(m, runtime)]
        if len(declared) == 1:
            (only,) = declared
            waiting = registry.awaits(only, runtime)
            return verdicts.not_yet_up(only, "", waiting, self._retry_after_ms)
        waiting = sum(1 for u in registry.unidentified() if u.spec.runtime in (None, runtime))
        if declared or waiting:
            return verdicts.nothing_served_yet(service, waiting, self._retry_after_ms)
        return verdicts.Verdict(
            verdicts.Reason.MODEL_NOT_FOUND, f"No model is served over {service}"
        )

    def declared(self, model: str, runtime: Runtime) -> bool:
        """The configuration names `model` on `runtime`'s protocol (or on any)."""
        if model not in self._declared:
            return False
        runtimes = self._declared[model]
        return runtimes is None or runtime in runtimes

    def vocabulary(self, model: str, runtime: Runtime) -> tuple[int, str] | None:
        """The bound on a prompt's token ids for `model` and where it comes from: its
        `vocab_size` setting, else the smallest vocabulary its engine workers report (a
        call may land on any of them); None while none has said."""
        configured = self._model_settings(model).vocab_size
        if configured is not None:
            return configured, f"models.{model}.vocab_size"
        reported = [
            w.vocab_size
            for w in self._registry.workers_of(model, runtime, ENGINE_ROLES)
            if w.vocab_size
        ]
        return (min(reported), "as its workers report") if reported else None

    def _not_found(self, model: str, runtime: Runtime) -> Verdict:
        adapters = self._adapters
        elsewhere = [adapters[r].service_name for r in self._registry.runtimes(model)]
        return verdicts.model_not_found(model, adapters[runtime].service_name, elsewhere)

    def block_sizes(self, model: str, runtime: Runtime, legs: Sequence[Role]) -> set[int]:
        """The block sizes cache-aware placement of this model will hash the prompt by
        (none for a model placed by another policy): the caller hashes ahead, off the
        event loop when the prompt is long, so placement itself (synchronous) only looks
        the keys up and its loop time grows with the prompt's cached blocks."""
        leg = Role.PREFILL if Role.PREFILL in legs else Role.REGULAR
        cluster = self._registry.cluster(model, runtime, leg)
        policy = None if cluster is None else cluster.policy
        if cluster is None or not isinstance(policy, CacheAware):
            return set()
        reported = {w.block_size for w in cluster.workers if w.block_size}
        return policy.block_sizes() | reported

    def place(
        self,
        model: str,
        runtime: Runtime,
        hints: Hints,
        items: Sequence[str] = (),
        exclude: Collection[str] = (),
        legs: tuple[Role, ...] | None = None,
        bound: Mapping[Role, str] = NO_BINDING,
    ) -> Decision | Verdict:
        """Pick a worker for every leg the request demands (`legs`, when the caller already
        knows them), never one in `exclude` (workers that already failed this request); or
        the verdict saying why not. `bound`: a leg's worker (id) to keep when it is among
        the leg's candidates and its policy takes it (session affinity)."""
        now = time.monotonic()
        registry = self._registry
        if legs is None:
            legs = self.legs(model, bool(items))
        adapter = adapter_of(hints.prefix.namespace) if hints.prefix is not None else ""
        if adapter and self._lora_watch is not None:
            self._lora_watch.seen()
        refusals: list[Verdict] = []
        elsewhere: list[Role] = []
        fitting: dict[Role, list[Worker]] = {}
        for leg in legs:
            if leg is Role.ENCODE:  # encoders serve every runtime's calls
                clusters = registry.clusters(model, leg)
            else:
                cluster = registry.cluster(model, runtime, leg)
                clusters = [cluster] if cluster is not None else []
                if cluster is None and registry.has_role(model, leg):
                    elsewhere.append(leg)  # deployed, but not on this protocol's runtime
                    continue
            pool: Sequence[Worker] = ()
            available: list[Worker] = []
            fits: list[Worker] = []
            for cluster in clusters:
                up = [w for w in cluster.workers if w.available(now) and w.id not in exclude]
                pool = cluster.workers if not pool else [*pool, *cluster.workers]
                available += up
                fits += self._fitting(cluster, up, now)
            verdict = classify_leg(
                model, leg, pool, available, fits, self._retry_after_ms, self._overload_retry_ms
            )
            if verdict is not None and verdict.reason is verdicts.Reason.LEG_NOT_DEPLOYED:
                waiting = registry.awaits(model, None if leg is Role.ENCODE else runtime, leg)
                if waiting:  # the leg may yet turn up: unavailable, not missing
                    verdict = verdicts.not_yet_up(model, leg.value, waiting, self._retry_after_ms)
            if verdict is None and adapter and leg is not Role.ENCODE:
                narrowed = self._for_adapter(model, leg, adapter, pool, fits)
                verdict, fits = (
                    (narrowed, fits) if isinstance(narrowed, Verdict) else (None, narrowed)
                )
            if verdict is None:
                fitting[leg] = fits
            else:
                refusals.append(verdict)
        if elsewhere:
            refusals.append(self._incompatible(model, runtime, legs))
        if refusals:
            return most_permanent(refusals)
        return self._pick(model, runtime, legs, fitting, hints, items, bound)

    def _fitting(self, cluster: Cluster, available: list[Worker], now: float) -> list[Worker]:
        """The available workers the cluster's limits let take one more request."""
        limits = cluster.limits
        if not limits.any:
            return available
        stale = self._stale_after_s
        return [w for w in available if overload_reason(w, limits, now, stale) is None]

    def _for_adapter(
        self, model: str, leg: Role, adapter: str, pool: Sequence[Worker], fits: list[Worker]
    ) -> list[Worker] | Verdict:
        """The fitting workers a call for a LoRA adapter goes to (see placement/lora.py).
        An adapter the gateway cannot load (not in `lora.adapters`, or loading off) goes
        only where it is held; with no `lora.adapters` at all the gateway manages none,
        and holders are only preferred."""
        config = self._lora
        holders = [w for w in fits if adapter in w.loras]
        if config.load_on_demand and adapter in config.adapters:
            holdings = [Holding(w.loras, w.lora_calls) for w in fits]
            return preferred(adapter, fits, holdings, config.max_loaded_per_worker).workers
        if holders or not config.enabled:
            return holders or fits
        held = [w for w in pool if adapter in w.loras]
        if not held:
            return verdicts.adapter_not_found(model, adapter)
        return verdicts.workers_unavailable(model, leg.value, len(held), self._retry_after_ms)

    def legs(self, model: str, multimodal: bool) -> tuple[Role, ...]:
        registry = self._registry
        disaggregated = any(registry.has_role(model, leg) for leg in PD_LEGS)
        encode_leg = self._model_settings(model).encode_leg or registry.has_role(model, Role.ENCODE)
        return demanded_legs(disaggregated, multimodal, encode_leg)

    def _incompatible(self, model: str, runtime: Runtime, legs: Sequence[Role]) -> Verdict:
        where = {
            leg.value: sorted({_group(w) for w in self._registry.role_pool(model, leg)})
            for leg in legs
            if leg is not Role.ENCODE
        }
        return verdicts.no_compatible_pair(model, where)

    def _pick(
        self,
        model: str,
        runtime: Runtime,
        legs: Sequence[Role],
        fitting: dict[Role, list[Worker]],
        hints: Hints,
        items: Sequence[str],
        bound: Mapping[Role, str],
    ) -> Decision | Verdict:
        chosen: dict[Role, Choice[Worker]] = {}
        if Role.REGULAR in fitting:
            regular = fitting[Role.REGULAR]
            picked = self._choose(model, runtime, Role.REGULAR, regular, hints, bound)
            if isinstance(picked, Verdict):
                return picked
            chosen[Role.REGULAR] = picked
        else:
            pair = self._pair(model, runtime, fitting, hints, bound)
            if isinstance(pair, Verdict):
                return pair
            chosen.update(pair)
        encoders: tuple[tuple[Worker, tuple[str, ...]], ...] = ()
        if Role.ENCODE in legs:
            encoders = spread_items(items, fitting[Role.ENCODE])
        receiver = chosen.get(Role.PREFILL) or chosen[Role.REGULAR]
        receiving_leg = Role.PREFILL if Role.PREFILL in chosen else Role.REGULAR
        return Decision(
            MappingProxyType({leg: c.worker for leg, c in chosen.items()}),
            encoders,
            ranks(chosen.values()),
            receiver.expected_cached,
            self._cluster(model, runtime, receiving_leg).policy.name,
            len(fitting[receiving_leg]),
            receiver.placed_on,
            chosen[Role.DECODE].placed_on if Role.DECODE in chosen else None,
        )

    def _pair(
        self,
        model: str,
        runtime: Runtime,
        fitting: dict[Role, list[Worker]],
        hints: Hints,
        bound: Mapping[Role, str],
    ) -> dict[Role, Choice[Worker]] | Verdict:
        """A prefill and a decode that can hand KV to each other: search every pairing
        group that has both legs, not just the group of whichever prefill comes first (the
        groups of the bound workers first)."""
        kept = (
            {w.pairing for leg in PD_LEGS for w in fitting[leg] if w.id == bound.get(leg)}
            if bound
            else set()
        )
        groups = sorted(
            {w.pairing for w in fitting[Role.PREFILL]} & {w.pairing for w in fitting[Role.DECODE]},
            key=lambda group: (group not in kept, group),
        )
        if not groups:
            return self._incompatible(model, runtime, PD_LEGS)
        declined: Verdict | None = None
        for group in groups:
            pair: dict[Role, Choice[Worker]] = {}
            for leg in PD_LEGS:
                candidates = [w for w in fitting[leg] if w.pairing == group]
                picked = self._choose(model, runtime, leg, candidates, hints, bound)
                if isinstance(picked, Verdict):
                    declined = declined or picked
                    break
                pair[leg] = picked
            else:
                return pair
        assert declined is not None
        return declined

    def _choose(
        self,
        model: str,
        runtime: Runtime,
        leg: Role,
        candidates: list[Worker],
        hints: Hints,
        bound: Mapping[Role, str] = NO_BINDING,
    ) -> Choice[Worker] | Verdict:
        """The policy's choice among the candidates; the bound worker's when it is one of
        them and the policy, offered it alone, takes it (so a cache-aware policy still
        picks its rank and remembers the prompt there); SLO_UNATTAINABLE for a sheddable
        call the policy predicts no candidate serves within its objectives."""
        # Every cluster's policy was built by placement (the fleet's `build_policy`).
        policy = cast("Policy", self._cluster(model, runtime, leg).policy)
        picked = None
        kept_id = bound.get(leg)
        if kept_id is not None:
            kept = [w for w in candidates if w.id == kept_id]
            picked = policy.choose(kept, hints) if kept else None
        if not isinstance(picked, Choice):  # not kept, or not in time: any candidate
            picked = policy.choose(candidates, hints)
        if picked is None:
            return verdicts.policy_declined(model, leg.value, policy.name, self._retry_after_ms)
        if isinstance(picked, Unattainable):
            retry_ms = max(self._retry_after_ms, math.ceil(picked.late_s() * 1000))
            slo, ttft_s, tpot_s = picked.slo, picked.ttft_s, picked.tpot_s
            return verdicts.slo_unattainable(model, leg.value, slo, ttft_s, tpot_s, retry_ms)
        return picked

    def _cluster(self, model: str, runtime: Runtime, leg: Role) -> Cluster:
        """A leg's cluster, once placement found candidates in it (so it exists)."""
        cluster = self._registry.cluster(model, runtime, leg)
        assert cluster is not None
        return cluster

    def any_worker(self, model: str, runtime: Runtime, exclude: Collection[str] = ()) -> Placement:
        """One available worker that speaks the engine protocol (any leg but encode), for
        fleet-wide facts (model info, tokenizer)."""
        now = time.monotonic()
        workers = self._registry.workers_of(model, runtime, ENGINE_ROLES)
        available = [w for w in workers if w.available(now) and w.id not in exclude]
        if not available:
            return verdicts.workers_unavailable(model, "", len(workers), self._retry_after_ms)
        rotation = self._any.setdefault((model, runtime), RoundRobin())
        chosen = rotation.pick(available, Hints())
        assert chosen is not None
        return chosen

    def every_worker(self, model: str, runtime: Runtime) -> list[Worker] | Verdict:
        """Every available worker of the model that speaks the engine protocol (encoders
        do not), for per-worker admin RPCs."""
        now = time.monotonic()
        workers = self._registry.workers_of(model, runtime, ENGINE_ROLES)
        available = [w for w in workers if w.available(now)]
        if not available:
            return verdicts.workers_unavailable(model, "", len(workers), self._retry_after_ms)
        return available

    def servable(self, model: str, runtime: Runtime | None = None) -> bool:
        """A text request could be placed now: every leg it needs has a routable worker
        (and, disaggregated, a prefill and a decode that pair). Load limits aside."""
        now = time.monotonic()
        legs = self.legs(model, multimodal=False)
        runtimes = [runtime] if runtime is not None else self._registry.runtimes(model)
        for rt in runtimes:
            up = {
                leg: {w.pairing for w in self._registry.pool(model, rt, leg) if w.available(now)}
                for leg in legs
            }
            if all(up.values()) and set.intersection(*up.values()):
                return True
        return False
