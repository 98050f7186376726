"""What each gateway learns from its own placements, shared: where it just sent a prompt
(the blocks cache-aware placement assumes cached there, until the worker's KV events say
so, or for `kv.assume_ttl_s` on workers that send none) reaches every other replica and
serving process through the store, so approximate cache-aware routing decides alike
everywhere, and a new prefix placed by one gateway is known to the others before the
worker's event arrives.

Block keys are the gateway's own, salted with a secret (clients must not choose prompts
whose keys collide): the gateways sharing a store agree on one, `{prefix}kv:seed`, written
by the first to start and read by the others before they hash anything (`agree`). A
process that could not read it keeps a secret of its own, and its messages (tagged with
their secret's fingerprint) are left aside by the others.

Each process batches its placements for `FLUSH_S` and publishes one message on
`{prefix}kv:assumed`: a 16-byte origin (its own messages are skipped), the secret's
8-byte fingerprint, then per placement
the worker, its rank, block size, cache size if reported, and the block keys (at most
`kv.assume_capacity`, and ASSUME_BLOCKS, as the index keeps). A message is at most
`state.max_value_bytes`; a placement that does not fit goes in the next. Received
messages are checked to the byte (junk is refused and reported) and applied only for
workers this process knows. A store that is away loses the messages meanwhile: each
process then learns alone, as without a store."""

from __future__ import annotations

import asyncio
import os
import secrets
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.kv.index import KvIndex
from gateway.kv.prefix import seed_tag, use_seed
from gateway.kv.slots import Slot
from gateway.state.store import MAX_WORKER_ID, Store, StoreAway

FLUSH_S = 0.02  # placements batched this long into one message
MAX_PENDING = 64  # messages' worth kept while publishing lags; past it the oldest go
HEAD = struct.Struct("!16s8sI")  # origin, seed tag, entries
SEED_BYTES = 32
ENTRY = struct.Struct("!HIIqI")  # worker id bytes, rank, block size, kv tokens (-1), keys
KEYS = struct.Struct("!Q")


class SharedAssumptions:
    """One process's placements published, the others' applied to its index."""

    def __init__(self, index: KvIndex, store: Store, known: Callable[[str], bool]) -> None:
        self._index = index
        self._store = store
        self._known = known
        self._channel = store.key("kv", "assumed")
        self._origin = os.urandom(16)
        self._max = store.config.max_value_bytes
        self._entries: list[bytes] = []
        self._size = HEAD.size
        self._ready: list[tuple[int, bytes]] = []  # (entries, body) full messages to send
        self.dropped = 0  # placements not shared: publishing lagged
        index.on_assume = self._placed

    def _placed(
        self, slot: Slot, block_size: int, keys: Sequence[int], kv_tokens: int | None
    ) -> None:
        worker = slot[0].encode()
        if len(worker) > MAX_WORKER_ID:
            return
        entry = ENTRY.pack(len(worker), slot[1], block_size, kv_tokens or -1, len(keys))
        entry += worker + struct.pack(f"!{len(keys)}Q", *keys)
        if HEAD.size + len(entry) > self._max:
            return  # one placement past a message: not shared (tiny state.max_value_bytes)
        if self._size + len(entry) > self._max:
            self._seal()
        self._entries.append(entry)
        self._size += len(entry)

    def _seal(self) -> None:
        if not self._entries:
            return
        self._ready.append((len(self._entries), b"".join(self._entries)))
        self._entries, self._size = [], HEAD.size
        if len(self._ready) > MAX_PENDING:
            self.dropped += self._ready.pop(0)[0]

    async def publish(self) -> None:
        """Until cancelled: every FLUSH_S, what was placed since, one message each."""
        while True:
            await asyncio.sleep(FLUSH_S)
            self._seal()
            while self._ready:
                count, body = self._ready.pop(0)
                self._send(HEAD.pack(self._origin, seed_tag(), count) + body)

    def _send(self, message: bytes) -> None:
        async def publish(client: Any) -> object:
            return await client.publish(self._channel, message)

        self._store.write("kv_share", publish)

    async def agree(self) -> bool:
        """Use the secret every gateway sharing the store uses for block keys (writing it
        if this one is the first); False, keeping this process's own, if the store is away
        or holds junk there (then what this process learns is not shared)."""
        key = self._store.key("kv", "seed")

        async def work(client: Any) -> object:
            await client.set(key, secrets.token_bytes(SEED_BYTES), nx=True)
            return await client.get(key)

        try:
            secret = await self._store.run("kv_seed", work)
        except StoreAway:
            return False
        if not isinstance(secret, bytes) or len(secret) != SEED_BYTES:
            self._store.invalid("kv_seed", f"{key} is no secret of {SEED_BYTES} bytes")
            return False
        use_seed(secret)
        return True

    async def follow(self) -> None:
        """Until cancelled: the other gateways' placements applied as they come."""
        await self._store.listen(self._channel, self._heard)

    async def _heard(self, data: object) -> None:
        if data is not None:
            self.apply(data)

    def apply(self, data: object) -> int:
        """One message's placements applied (the count); junk refused whole."""
        if not isinstance(data, bytes) or not HEAD.size <= len(data) <= self._max:
            self._store.invalid("kv_share", "a message that is no batch of placements")
            return 0
        try:
            parsed = parse(data, self._origin, seed_tag())
        except (struct.error, ValueError, UnicodeDecodeError) as exc:
            self._store.invalid("kv_share", f"a batch that does not parse: {exc}")
            return 0
        now = time.monotonic()
        applied = 0
        for worker, rank, block_size, kv_tokens, keys in parsed:
            if self._known(worker):
                self._index.assumed((worker, rank), block_size, keys, now, kv_tokens)
                applied += 1
        return applied


def parse(
    data: bytes, own: bytes, tag: bytes
) -> list[tuple[str, int, int, int | None, tuple[int, ...]]]:
    """A message's placements (none if it is this process's own, or keyed by another
    secret); ValueError or struct.error if it is not exactly a batch."""
    origin, keyed_by, count = HEAD.unpack_from(data)
    if origin == own or keyed_by != tag:
        return []
    found = []
    at = HEAD.size
    for _ in range(count):
        length, rank, block_size, kv_tokens, keys = ENTRY.unpack_from(data, at)
        at += ENTRY.size
        if not 0 < length <= MAX_WORKER_ID or block_size <= 0 or keys > len(data):
            raise ValueError("an entry out of bounds")
        worker = data[at : at + length].decode()
        at += length
        hashes = struct.unpack_from(f"!{keys}Q", data, at)
        at += keys * KEYS.size
        found.append((worker, rank, block_size, kv_tokens if kv_tokens > 0 else None, hashes))
    if at != len(data):
        raise ValueError("bytes past the last entry")
    return found
