"""One adapter per engine protocol; nothing else in the gateway names an engine.

The serving process builds the adapters once (`engine_adapters()`) and hands the mapping
to whatever needs one (the fleet, placement, health, the fronts): no module reaches for
a shared instance.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from gateway.core.roles import Runtime
from gateway.engines.base import EngineAdapter, GenerateInfo
from gateway.engines.rpcs import RpcKind, RpcSpec
from gateway.engines.sglang import SglangAdapter
from gateway.engines.vllm import VllmAdapter

Adapters = Mapping[Runtime, EngineAdapter]  # every engine protocol's adapter, by runtime


def engine_adapters() -> Adapters:
    """A fresh, read-only mapping with one adapter per engine protocol, in a fixed order
    (SGLang first: runtime detection asks in this order)."""
    return MappingProxyType({Runtime.SGLANG: SglangAdapter(), Runtime.VLLM: VllmAdapter()})


__all__ = ["Adapters", "EngineAdapter", "GenerateInfo", "RpcKind", "RpcSpec", "engine_adapters"]
