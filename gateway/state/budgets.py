"""Tenants' budgets charged once for the whole fleet: the token buckets of
gateway.flow.budget kept in the store, so that N replicas (and their serving processes)
admit what one would.

Each budget is a hash `{prefix}budget:{tenant digest}:{budget}` holding the bucket's level
and when it was filled, changed only by the two scripts below, which run atomically in
the store on the store's own clock (replicas' clocks need not agree). The rules are
TokenBucket's: a call is checked against both of its tenant's buckets and takes from both
only if both allow it; a call larger than a minute's allowance waits for a full bucket
and then runs into debt; a debt is at most one minute's allowance; the settlement gives
back what the call did not use. A bucket untouched for two minutes is full, the same as
none: its key expires.

A value that is no bucket of ours (another type, a level that is no number) is replaced
by a full bucket and reported. While the store is away, calls are charged to this
process's own buckets (`RateLimits`), as without a store.

Tenant names are the client's (behind a trusted proxy, whatever its header says): each
process charges at most `max_buckets` tenants in the store within two minutes; past that,
new tenants share one budget, as they do locally."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gateway.flow.budget import (
    MAX_BUCKETS,
    OVERFLOW,
    REQUESTS,
    TOKENS,
    Charge,
    Limits,
    OverBudget,
    RateLimits,
)
from gateway.state.store import Store, StoreAway, digest

IDLE_S = 120.0  # a bucket untouched this long is full again: its key goes

# KEYS: the buckets; ARGV: per bucket its size (a minute's allowance) and the amount.
# Returns {0} when taken, else {i, wait in seconds as text} for the first bucket short;
# a third element 1 when a key held junk (replaced by a full bucket).
TAKE = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) + tonumber(now_parts[2]) / 1e6
local junk = 0
local levels = {}
for i = 1, #KEYS do
  local size = tonumber(ARGV[2 * i - 1])
  local amount = tonumber(ARGV[2 * i])
  local kind = redis.call('TYPE', KEYS[i])['ok']
  local level, at = size, now
  if kind == 'hash' then
    local saved = redis.call('HMGET', KEYS[i], 'level', 'at')
    level, at = tonumber(saved[1]), tonumber(saved[2])
    if level == nil or at == nil or level ~= level or at ~= at then
      level, at, junk = size, now, 1
    end
  elseif kind ~= 'none' then
    redis.call('DEL', KEYS[i])
    junk = 1
  end
  level = math.max(-size, math.min(size, level))
  if now > at then level = math.min(size, level + (now - at) * size / 60) end
  levels[i] = level
  local missing = math.min(amount, size) - level
  if missing > 0 then return {i, tostring(missing * 60 / size), junk} end
end
for i = 1, #KEYS do
  local size = tonumber(ARGV[2 * i - 1])
  local level = math.max(-size, levels[i] - tonumber(ARGV[2 * i]))
  redis.call('HSET', KEYS[i], 'level', tostring(level), 'at', tostring(now), 'size', size)
  redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[#ARGV]))
end
return {0, '0', junk}
"""

# KEYS[1]: a bucket; ARGV: the amount back (negative: a debt), the expiry. A bucket gone
# (expired: full) or junk takes nothing back.
GIVE = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) + tonumber(now_parts[2]) / 1e6
if redis.call('TYPE', KEYS[1])['ok'] ~= 'hash' then return 0 end
local saved = redis.call('HMGET', KEYS[1], 'level', 'at', 'size')
local level, at, size = tonumber(saved[1]), tonumber(saved[2]), tonumber(saved[3])
if level == nil or at == nil or size == nil or size <= 0 then return 0 end
level = math.max(-size, math.min(size, level))
if now > at then level = math.min(size, level + (now - at) * size / 60) end
level = math.max(-size, math.min(size, level + tonumber(ARGV[1])))
redis.call('HSET', KEYS[1], 'level', tostring(level), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""


class TenantBudgets:
    """The tenants' budgets: in the store when there is one (this process's own as the
    fallback), else this process's own."""

    def __init__(
        self,
        limits: Limits,
        store: Store | None = None,
        max_buckets: int = MAX_BUCKETS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._limits = limits
        self._store = store
        # Some tenant has a limit: written by the assembly and a reload (a config without
        # one charges nothing, and its calls' tenants are not shown).
        self.active = True
        self.local = RateLimits(limits, max_buckets)
        self._max_buckets = max_buckets
        self._clock = clock
        self._recent: OrderedDict[str, float] = OrderedDict()  # tenant -> last charged
        if store is not None:
            self._take = store.client.register_script(TAKE)
            self._give = store.client.register_script(GIVE)

    async def take(self, tenant: str, tokens: int) -> Charge | OverBudget | None:
        """As RateLimits.take, fleet-wide; this process's own buckets if the store is away."""
        if self._store is None:
            return self.local.take(tenant, tokens, self._clock())
        per_request, per_token = self._limits(tenant)
        if per_request is None and per_token is None:
            return None
        owner = self._owner(tenant)
        wanted = [
            (budget, size, amount)
            for budget, size, amount in ((REQUESTS, per_request, 1), (TOKENS, per_token, tokens))
            if size is not None
        ]
        keys = [self._key(owner, budget) for budget, _, _ in wanted]
        args: list[Any] = [x for _, size, amount in wanted for x in (size, amount)]
        args.append(int(IDLE_S * 1000))
        store = self._store
        try:
            answer = await store.run(
                "budget_take", lambda client: self._take(keys=keys, args=args, client=client)
            )
        except StoreAway:
            return self.local.take(tenant, tokens, self._clock())
        read = _answer(answer)
        if read is None:
            store.invalid("budget_take", f"an answer that is none: {answer!r:.64}")
            return self.local.take(tenant, tokens, self._clock())
        short, wait, junk = read
        if junk:
            store.invalid("budget_take", f"a budget of tenant {tenant[:64]!r} was junk")
        if short is None:
            return Charge(owner, tokens, shared=True)
        budget, size, _ = wanted[short]
        assert size is not None
        return OverBudget(budget, size, wait)

    def settle(self, charge: Charge, used_tokens: int | None) -> None:
        """As RateLimits.settle: what the call did not use goes back (in the background)."""
        if not charge.shared or self._store is None:
            self.local.settle(charge, used_tokens, self._clock())
            return
        store = self._store
        back = [(TOKENS, charge.tokens - (used_tokens or 0))]
        if used_tokens is None:
            back.append((REQUESTS, 1))
        for budget, amount in back:
            if not amount:
                continue
            key = self._key(charge.tenant, budget)
            args = [amount, int(IDLE_S * 1000)]

            async def give(client: Any, key: str = key, args: list[int] = args) -> object:
                return await self._give(keys=[key], args=args, client=client)

            store.write("budget_settle", give)

    def _key(self, owner: str, budget: str) -> str:
        assert self._store is not None
        name = "overflow" if owner == OVERFLOW else digest(owner)
        return self._store.key("budget", name, budget)

    def _owner(self, tenant: str) -> str:
        """The tenant itself, unless this process charged `max_buckets` others in the last
        two minutes (then the shared overflow budget)."""
        now = self._clock()
        recent = self._recent
        if tenant in recent:
            recent.move_to_end(tenant)
            recent[tenant] = now
            return tenant
        while recent and next(iter(recent.values())) < now - IDLE_S:
            recent.popitem(last=False)
        if len(recent) >= self._max_buckets:
            return OVERFLOW
        recent[tenant] = now
        return tenant


def _answer(answer: object) -> tuple[int | None, float, bool] | None:
    """TAKE's answer: the short bucket's index (None: taken), the wait, junk found; None
    if it is no answer of TAKE's."""
    if not isinstance(answer, list) or len(answer) != 3:
        return None
    try:
        first, wait, junk = int(answer[0]), float(answer[1]), int(answer[2])
    except (TypeError, ValueError):
        return None
    if first < 0 or not 0 <= wait <= 2 * IDLE_S:
        return None
    return (first - 1 if first else None), wait, bool(junk)
