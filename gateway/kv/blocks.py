"""What a worker's KV events say about its cache, as the prefix index reads them: a stored
block's namespace (spelled as the adapters spell a request's), and whether a block sits in
the worker's own device memory (only those make a prompt cheap to prefill)."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2

DEVICE_TIERS = (common_pb2.KV_CACHE_TIER_UNSPECIFIED, common_pb2.KV_CACHE_TIER_DEVICE)


def namespace_of(stored: common_pb2.KvBlocksStored) -> str:
    """The cache namespace, spelled as the adapters spell a request's."""
    parts = []
    if stored.HasField("lora_name") and stored.lora_name:
        parts.append(f"lora:{stored.lora_name}")
    if stored.HasField("cache_salt") and stored.cache_salt:
        parts.append(f"salt:{stored.cache_salt}")
    return "|".join(parts)


def on_device(tier: int, cache_level: int | None, locality: int) -> bool:
    """Only blocks in the worker's own device memory make a prompt cheap to prefill."""
    if locality == common_pb2.KV_CACHE_LOCALITY_REMOTE:
        return False
    return tier in DEVICE_TIERS and not cache_level
