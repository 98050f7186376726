"""LoRA adapters: the gateway's loads and evictions, and what each worker holds, read at
scrape time (the loader counts as it loads, the worker's poll and the loader's own loads
keep what it holds: the only writers)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.core.roles import Runtime
from gateway.upstream.load.lora import FAILED, LOADED
from gateway.upstream.metrics import workers_of
from gateway.upstream.registry import Registry


class LoraCounts(Protocol):
    """What the loader counts (proxy/lora.py's `LoraLoader`)."""

    @property
    def loads(self) -> Mapping[tuple[str, str], int]: ...  # (model, outcome) -> loads

    @property
    def evictions(self) -> Mapping[str, int]: ...  # model -> adapters unloaded for room


class LoraCollector(Collector):
    def __init__(self, loader: LoraCounts, registry: Registry) -> None:
        self._loader = loader
        self._registry = registry

    def describe(self) -> Iterable[Any]:
        return self._families()

    @staticmethod
    def _families() -> list[Any]:
        return [
            CounterMetricFamily(
                "gateway_lora_loads",
                "LoRA adapter loads the gateway made on demand (lora.adapters), by outcome: "
                "loaded, failed (refused, failed or timed out: the call tried another worker)",
                labels=["model", "outcome"],
            ),
            CounterMetricFamily(
                "gateway_lora_evictions",
                "LoRA adapters the gateway unloaded to make room for another "
                "(lora.max_loaded_per_worker)",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "gateway_worker_lora_adapters",
                "LoRA adapters the worker holds (its last ListLoadedLoRAAdapters and the "
                "gateway's own loads since), SGLang workers only",
                labels=["worker"],
            ),
        ]

    def collect(self) -> Iterable[Any]:
        loads, evictions, held = families = self._families()
        counts = dict(self._loader.loads)  # one C call: safe against the loop's writes
        for model in sorted({model for model, _ in counts}):
            for outcome in (LOADED, FAILED):  # both shown, at 0 too, for rate()
                loads.add_metric([model, outcome], float(counts.get((model, outcome), 0)))
        for model, count in sorted(dict(self._loader.evictions).items()):
            evictions.add_metric([model], float(count))
        for worker in self._workers():
            if worker.runtime is Runtime.SGLANG:
                held.add_metric([worker.id], float(len(worker.loras)))
        return families

    def _workers(self) -> list[Any]:
        return workers_of(self._registry)
