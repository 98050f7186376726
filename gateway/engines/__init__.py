"""One adapter per engine protocol; nothing else in the gateway names an engine."""

from __future__ import annotations

from gateway.engines.base import EngineAdapter, GenerateInfo, RpcKind, RpcSpec
from gateway.engines.sglang import SglangAdapter
from gateway.engines.vllm import VllmAdapter
from gateway.roles import Runtime

ADAPTERS: dict[Runtime, EngineAdapter] = {
    Runtime.SGLANG: SglangAdapter(),
    Runtime.VLLM: VllmAdapter(),
}

__all__ = ["ADAPTERS", "EngineAdapter", "GenerateInfo", "RpcKind", "RpcSpec"]
