"""Helpers several tests share (no test imports another test module)."""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import common_pb2 as kv

from gateway.config import KvConfig
from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.kv.index import KvIndex
from gateway.upstream.load.kv_events import KvFollower
from tests.support.factories import worker_on
from tests.support.fakes.channel import FakeChannel

PROMPT = list(range(1000, 1512))  # 512 tokens, 32 blocks


def follower(index: KvIndex) -> KvFollower:
    settings = KvConfig(block_size=index.block_size)
    return KvFollower(
        worker_on(1),
        engine_adapters()[Runtime.SGLANG],
        index,
        settings=settings,
        connect=lambda limit: FakeChannel(),
    )


def stored(sequence: int, engine_hashes: list[int], tokens: list[int], **extra: Any) -> Any:
    blocks = [
        kv.KvBlock(block_hash=h, token_ids=tokens[i * 16 : (i + 1) * 16], block_size=16)
        for i, h in enumerate(engine_hashes)
    ]
    event = kv.KvCacheEvent(event_id=sequence, stored=kv.KvBlocksStored(blocks=blocks, **extra))
    return kv.KvEventBatch(
        sequence_number=sequence, events=[event], load=kv.EngineLoad(running_requests=2)
    )
