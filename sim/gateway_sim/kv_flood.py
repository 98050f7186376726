"""A hostile SGLang worker for tests/e2e/test_kv_flood.py and the attack scripts (its own
process, started by `KvFlooder`).

Serves grpc.health (SERVING), GetLoads (always out of range: 13 ranks of 2**31 - 1
running, about 3 x 2**32 in all, negative waiting, NaN usage) and SubscribeKvEvents, on
which it floods what its stdin asks, one command a line:

    blocks N      N stored blocks (distinct content), in batches of 20,000, rank 0
    snapshot N    one snapshot batch of N blocks (32 bytes each): over the gateway's cap
    sizes N       N ranks, each storing one block of its own block size (1..N tokens)
    ranks N       N dp ranks, one stored block each
    loads         a KV load record of 2**32 - 1 running and NaN usage
    marker M      a load-only batch on rank 0 whose running count is M

and answers `DONE <command>` once the last batch of a command was handed to grpc.
Batches are encoded by hand (numpy), so flooding costs this process little.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from smg_grpc_proto.generated import common_pb2 as kv
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

from gateway.core.wire import encode_varint

SERVICE = "sglang.grpc.scheduler.SglangScheduler"
BATCH_BLOCKS = 20_000
HASH_BASE = 1 << 56  # block hashes from here take 9 varint bytes: fixed-size records


def field(number: int, payload: bytes) -> bytes:
    return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


def block_records(first_hash: int, count: int, rng: np.random.Generator) -> bytes:
    """`count` KvBlock records (field 1 of KvBlocksStored), 16 tokens each, 32 bytes."""
    rows = np.zeros((count, 32), dtype=np.uint8)
    rows[:, 0], rows[:, 1] = 0x0A, 30  # KvBlocksStored.blocks, length 30
    rows[:, 2] = 0x08  # KvBlock.block_hash
    hashes = np.arange(first_hash, first_hash + count, dtype=np.uint64) + np.uint64(HASH_BASE)
    for k in range(9):
        part = (hashes >> np.uint64(7 * k)) & np.uint64(0x7F)
        rows[:, 3 + k] = part.astype(np.uint8) | (0x80 if k < 8 else 0)
    rows[:, 12], rows[:, 13] = 0x12, 16  # KvBlock.token_ids, packed, 16 bytes
    rows[:, 14:30] = rng.integers(0, 128, (count, 16), dtype=np.uint8)
    rows[:, 30], rows[:, 31] = 0x18, 16  # KvBlock.block_size = 16
    return rows.tobytes()


def batch(
    sequence: int,
    stored: bytes = b"",
    rank: int | None = None,
    snapshot: bool = False,
    load: Any = None,
) -> bytes:
    out = encode_varint(1 << 3) + encode_varint(sequence)
    if stored:
        out += field(3, field(2, stored))  # events: KvCacheEvent.stored
    if rank is not None:
        out += encode_varint(4 << 3) + encode_varint(rank)
    if snapshot:
        out += field(7, kv.KvSnapshotChunk(index=0, count=1).SerializeToString())
    if load is not None:
        out += field(8, load.SerializeToString())
    return out


class Flood:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=8)
        self.sequences: dict[int, int] = {}
        self.next_hash = 0
        self.rng = np.random.default_rng(7)

    def sequence(self, rank: int) -> int:
        self.sequences[rank] = self.sequences.get(rank, 0) + 1
        return self.sequences[rank]

    def hashes(self, count: int) -> int:
        first = self.next_hash
        self.next_hash += count
        return first

    async def run(self, command: str) -> None:
        verb, _, arg = command.partition(" ")
        n = int(arg) if arg else 0
        put = self.queue.put
        if verb == "blocks":
            for start in range(0, n, BATCH_BLOCKS):
                count = min(BATCH_BLOCKS, n - start)
                records = block_records(self.hashes(count), count, self.rng)
                await put(batch(self.sequence(0), records))
        elif verb == "snapshot":
            records = block_records(self.hashes(n), n, self.rng)
            # Refused by the gateway: it takes no sequence number (the next batch follows).
            await put(batch(self.sequences.get(0, 0) + 1, records, snapshot=True))
        elif verb == "sizes":
            for rank in range(n):
                size = rank + 1
                block = kv.KvBlock(
                    block_hash=self.hashes(1), token_ids=[rank % 100] * size, block_size=size
                )
                stored = kv.KvBlocksStored(blocks=[block]).SerializeToString()
                await put(batch(self.sequence(rank), stored, rank=rank))
        elif verb == "ranks":
            for rank in range(n):
                records = block_records(self.hashes(1), 1, self.rng)
                await put(batch(self.sequence(rank), records, rank))
        elif verb == "loads":
            load = kv.EngineLoad(running_requests=2**32 - 1, token_usage=math.nan)
            await put(batch(self.sequence(0), load=load))
        elif verb == "marker":
            load = kv.EngineLoad(running_requests=n, load_only=True)
            await put(batch(self.sequences.get(0, 0), load=load))
        await self.queue.join()  # every batch handed to grpc

    async def subscribe(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        while True:
            raw = await self.queue.get()
            try:
                yield raw
            finally:
                self.queue.task_done()


def get_loads(request: bytes, context: Any) -> bytes:
    over = sgl.SchedulerLoad(num_running_reqs=2**31 - 1, num_waiting_reqs=-5)
    over.token_usage = math.nan
    return bytes(sgl.GetLoadsResponse(loads=[over] * 13).SerializeToString())


async def main() -> None:
    flood = Flood()
    server = aio.server()
    handlers = {
        "SubscribeKvEvents": grpc.unary_stream_rpc_method_handler(flood.subscribe),
        "GetLoads": grpc.unary_unary_rpc_method_handler(get_loads),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in ("", SERVICE):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY {port}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        await flood.run(line)
        print(f"DONE {line}", flush=True)
    await server.stop(0)


class KvFlooder:
    """The hostile worker started as a process of its own, its floods asked for one at a
    time (`flood` returns once the worker handed the last batch to grpc)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway_sim.kv_flood"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert self.process.stdout is not None
            line = self.process.stdout.readline().split()  # [] if it dies first
            assert line[:1] == ["READY"], line
            self.port = int(line[1])
        except BaseException:
            self.stop()
            raise

    async def flood(self, command: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        done = await asyncio.to_thread(self.process.stdout.readline)
        assert done.strip() == f"DONE {command}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


if __name__ == "__main__":
    asyncio.run(main())
