"""The connection to the shared store, and the one rule for its trouble.

Every operation is bounded by `state.timeout_s` (connecting included). One that fails
(refused, timed out, an answer that is no answer) marks the store away: a warning is
logged once, `gateway_state_store_up` drops to 0, and for `retry_s` no operation is
tried at all, so calls pay nothing for a store that is down. The first operation after
that tries again; its success logs the store back (the route follower then writes what
changed meanwhile and reads the store's). Callers catch `StoreAway` and go on with their
own process's state: the store's trouble never becomes a call's. `listen` is the one
way to follow a channel."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import structlog
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from gateway.config import ConfigError, StateConfig
from gateway.core.tasks import TaskScope

log = structlog.get_logger("gateway.state")

T = TypeVar("T")
REASONS = ("unreachable", "timeout", "invalid")
MAX_WORKER_ID = 512  # bytes of a worker id read back from the store (a URL with its keys)
MAX_PENDING_WRITES = 1024  # writes in flight at once; past it one is dropped (counted)

Heard = Callable[[object], Awaitable[None]]  # a message's data, or None: nothing came


class StoreAway(Exception):
    """The store could not answer this operation (or is left alone for a while)."""


def digest(text: str) -> str:
    """A key part for a name a client controls: 32 hex characters, whatever its length."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def password(config: StateConfig) -> str | None:
    """`state.password_file`'s first line; ConfigError naming the file if unreadable."""
    if config.password_file is None:
        return None
    try:
        return Path(config.password_file).read_text().strip() or None
    except OSError as exc:
        raise ConfigError(f"state.password_file {config.password_file!r}: {exc.strerror}") from None


class Store:
    """One serving process's client of the shared store (a bounded pool of connections)."""

    def __init__(self, config: StateConfig, clock: Callable[[], float] = time.monotonic) -> None:
        assert config.url is not None
        self.config = config
        self.prefix = config.key_prefix
        self.timeout_s = config.timeout_s
        self._clock = clock
        pool = BlockingConnectionPool.from_url(
            config.url,
            password=password(config),
            max_connections=config.max_connections,
            timeout=config.timeout_s,  # waiting for a free connection
            socket_timeout=config.timeout_s,
            socket_connect_timeout=config.timeout_s,
        )
        # No retries of its own: one bounded try, then the store is away for `retry_s`.
        self.client = Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))
        self.up = True  # until an operation says otherwise
        self._retry_at = 0.0
        self.errors: Counter[tuple[str, str]] = Counter()  # (operation, reason)
        self.dropped_writes = 0
        self._writes = TaskScope()
        self._followers = TaskScope()  # the channels followed, and the publisher

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def run(self, operation: str, work: Callable[[Redis], Awaitable[T]]) -> T:
        """`work(client)`, bounded; StoreAway if the store is away or fails it."""
        if not self.up and self._clock() < self._retry_at:
            raise StoreAway(operation)
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await work(self.client)
        except TimeoutError:
            self._away(operation, "timeout", "no answer within state.timeout_s")
            raise StoreAway(operation) from None
        except ResponseError as exc:  # it answered: an error of the data, not of the store
            self.invalid(operation, str(exc))
            raise StoreAway(operation) from None
        except (RedisError, OSError) as exc:
            self._away(operation, "unreachable", str(exc) or type(exc).__name__)
            raise StoreAway(operation) from None
        if not self.up:
            self._back()
        return result

    def write(self, operation: str, work: Callable[[Redis], Awaitable[object]]) -> None:
        """`work` in the background (a call's settlement, a binding): nobody waits for it;
        lost if the store is away, dropped (counted) past MAX_PENDING_WRITES."""
        if len(self._writes) >= MAX_PENDING_WRITES:
            self.dropped_writes += 1
            return
        self._writes.spawn(self._quietly(operation, work), "state_write")

    async def _quietly(self, operation: str, work: Callable[[Redis], Awaitable[object]]) -> None:
        with contextlib.suppress(StoreAway):
            await self.run(operation, work)

    def invalid(self, operation: str, why: str) -> None:
        """A value in the store that is no value of ours: refused (logged, counted)."""
        self.errors[(operation, "invalid")] += 1
        log.warning("state_store_invalid", operation=operation, error=why[:200])

    def _away(self, operation: str, reason: str, why: str) -> None:
        self.errors[(operation, reason)] += 1
        self._retry_at = self._clock() + self.config.retry_s
        if self.up:
            self.up = False
            log.warning(
                "state_store_away",
                operation=operation,
                reason=reason,
                error=why[:200],
                note="serving on each process's own state; tried again every "
                f"{self.config.retry_s:g} s",
            )

    def _back(self) -> None:
        self.up = True
        log.info("state_store_back")

    async def listen(self, channel: str, heard: Heard) -> None:
        """Until cancelled: `heard(data)` for each message published on `channel`, and
        `heard(None)` once subscribed and after every `resync_s` without a message (a
        periodic re-read heals a missed one). A subscription that fails, or is refused,
        is made again `retry_s` later, after one `heard(None)` (a reader of the store
        finds it away, and says so once, through `run`)."""
        while True:
            try:
                async with self.client.pubsub() as notices:
                    async with asyncio.timeout(self.timeout_s):
                        await notices.subscribe(channel)
                    await heard(None)
                    while True:
                        message = await notices.get_message(
                            ignore_subscribe_messages=True, timeout=self.config.resync_s
                        )
                        await heard(message.get("data") if message is not None else None)
            except (RedisError, OSError, TimeoutError):
                # A cancel the client turned into its own error (a connection torn down
                # mid-read) still ends the follower: else closing it would wait forever.
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from None
                await heard(None)
                await asyncio.sleep(self.config.retry_s)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """A follower the store ends with it (`listen` on a channel, the publisher)."""
        return self._followers.spawn(coro, name)

    async def close(self) -> None:
        """The followers and writes ended, then the connections. A follower parked in the
        client's read may miss its cancel (seen once in 30 runs under load: redis-py's
        read went on waiting): the connections are closed under it first, which ends
        every read, and its end is awaited a bounded time, then left to the loop."""
        with contextlib.suppress(RedisError, OSError):
            await self.client.connection_pool.disconnect()
        try:
            async with asyncio.timeout(self.timeout_s + self.config.retry_s + 1.0):
                await self._followers.close()
        except TimeoutError:
            log.warning("state_follower_stuck", note="left to end with the event loop")
        await self._writes.close()
        await self.client.aclose()
