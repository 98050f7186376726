"""Which LoRA adapters each worker holds: ListLoadedLoRAAdapters, polled with its loads.

Only engines with the RPC (SGLang; vLLM's protocol has no LoRA adapters) are asked, and
only once adapters matter to this gateway: `lora.adapters` is configured, or a call named
one (`AdapterWatch.seen`). A failed poll keeps what was known; the worker is the one
writer of what it holds (`Worker.loras_listed`), the gateway's own loads and unloads
reporting to it the same way.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError
from grpc import aio

from gateway.engines import EngineAdapter
from gateway.upstream.worker import Worker

LIST_RPC = "ListLoadedLoRAAdapters"
LOADED, FAILED = "loaded", "failed"  # how a load the gateway made on demand ended


class AdapterWatch:
    """Whether workers' adapters are polled: from the start with `lora.adapters`, else
    from the first call that names an adapter."""

    __slots__ = ("wanted",)

    def __init__(self, configured: bool) -> None:
        self.wanted = configured

    def seen(self) -> None:
        """A call named an adapter."""
        self.wanted = True

    def polls(self, adapter: EngineAdapter) -> bool:
        return self.wanted and LIST_RPC in adapter.rpcs


async def poll_loras(
    worker: Worker, channel: aio.Channel, adapter: EngineAdapter, timeout_s: float
) -> bool:
    """One ListLoadedLoRAAdapters; False when it failed (what was known stays)."""
    spec = adapter.rpcs[LIST_RPC]
    as_of = worker.lora_changes
    try:
        raw = await channel.unary_unary(spec.path)(
            spec.request_type().SerializeToString(), timeout=timeout_s
        )
        reply: Any = spec.response_type.FromString(raw)
    except (aio.AioRpcError, DecodeError):
        return False
    worker.loras_listed((str(a.lora_id) for a in reply.loaded_adapters), as_of)
    return True
