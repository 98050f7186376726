"""Helpers several tests share (no test imports another test module)."""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import common_pb2 as kv


def blocks(tokens: list[int], first_hash: int, size: int = 16) -> list[Any]:
    return [
        kv.KvBlock(
            block_hash=first_hash + i, token_ids=tokens[i * size : (i + 1) * size], block_size=size
        )
        for i in range(len(tokens) // size)
    ]


def batch(sequence: int, *events: Any, rank: int | None = None, **load: Any) -> Any:
    message = kv.KvEventBatch(sequence_number=sequence, events=list(events))
    if rank is not None:
        message.dp_rank = rank
    if load:
        message.load.CopyFrom(kv.EngineLoad(**load))
    return message


def stored(block_list: list[Any], parent: int | None = None) -> Any:
    event = kv.KvBlocksStored(blocks=block_list)
    if parent is not None:
        event.parent_block_hash = parent
    return kv.KvCacheEvent(stored=event)
