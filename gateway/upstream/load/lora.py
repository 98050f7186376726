"""Which LoRA adapters each worker holds: ListLoadedLoRAAdapters, polled with its loads.

Only engines with the RPC (SGLang; vLLM's protocol has no LoRA adapters) are asked, and
only once adapters matter to this gateway: `lora.adapters` is configured, or a call named
one (`AdapterWatch.seen`). A failed poll keeps what was known; the worker is the one
writer of what it holds (`Worker.loras_listed`), the gateway's own loads and unloads
reporting to it the same way.

A worker's answer is cut on the wire after `lora.max_listed_per_worker` adapters (`listed`:
a Python step per adapter kept, none for the rest), so a list of any length costs the
loop what the cap does; a list past it counts as a rejected load figure. With
`lora.adapters` set, only those adapters are kept of it (no other can be loaded or asked
for by name with a path the gateway knows).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from google.protobuf.message import DecodeError
from grpc import aio

from gateway.config.lora import LoraConfig
from gateway.core.wire import records
from gateway.engines import EngineAdapter
from gateway.upstream.worker import Worker

LIST_RPC = "ListLoadedLoRAAdapters"
LOADED, FAILED = "loaded", "failed"  # how a load the gateway made on demand ended


class AdapterWatch:
    """Whether workers' adapters are polled: from the start with `lora.adapters`, else
    from the first call that names an adapter; and what is kept of a worker's list (at
    most `cap` adapters, only the configured ones when `only` names some)."""

    __slots__ = ("cap", "only", "wanted")

    def __init__(self, configured: bool, cap: int = 256, only: Collection[str] = ()) -> None:
        self.wanted = configured
        self.cap = cap
        self.only = frozenset(only)

    @classmethod
    def of(cls, config: LoraConfig) -> AdapterWatch:
        return cls(config.enabled, config.max_listed_per_worker, config.adapters)

    def configure(self, config: LoraConfig) -> None:
        """A reload: what is kept of a worker's list (a watch once wanted stays)."""
        self.cap, self.only = config.max_listed_per_worker, frozenset(config.adapters)
        self.wanted = self.wanted or config.enabled

    def seen(self) -> None:
        """A call named an adapter."""
        self.wanted = True

    def polls(self, adapter: EngineAdapter) -> bool:
        return self.wanted and LIST_RPC in adapter.rpcs


def listed(raw: bytes, cap: int) -> tuple[bytes, bool]:
    """The answer cut after its first `cap` records (its adapters: its one field), and
    whether it had more; raises DecodeError."""
    end, more = 0, False
    for count, (_, _, _, stop) in enumerate(records(raw, 0, len(raw))):
        if count == cap:
            more = True
            break
        end = stop
    return raw[:end], more


async def poll_loras(
    worker: Worker,
    channel: aio.Channel,
    adapter: EngineAdapter,
    timeout_s: float,
    watch: AdapterWatch,
) -> bool:
    """One ListLoadedLoRAAdapters; False when it failed (what was known stays)."""
    spec = adapter.rpcs[LIST_RPC]
    as_of = worker.lora_changes
    try:
        raw = await channel.unary_unary(spec.path)(
            spec.request_type().SerializeToString(), timeout=timeout_s
        )
        kept, more = listed(raw, watch.cap)
        reply: Any = spec.response_type.FromString(kept)
    except (aio.AioRpcError, DecodeError):
        return False
    if more:
        worker.loras_rejected += 1
    ids = (str(a.lora_id) for a in reply.loaded_adapters)
    only = watch.only
    worker.loras_listed((i for i in ids if i in only) if only else ids, as_of)
    return True
