"""Tenant rate limits: requests and tokens per minute, as token buckets (pure bookkeeping,
the caller passes the clock).

A bucket holds up to one minute's allowance and refills continuously. A call is checked
against both of its tenant's buckets and takes from both only if both allow it, so a
refused call costs nothing. Tokens are reserved at admission (the prompt, which is known,
plus what the call may generate) and settled when it ends from what it did generate: the
difference goes back, or is taken as debt when the worker generated more than reserved.
A call the gateway answered itself without reaching a worker gives everything back.

A call larger than a whole minute's allowance waits for a full bucket and then runs into
debt, rather than never running; a debt is at most one minute's allowance, whatever a call
or a worker's usage figure says. Memory: a full bucket is the same as no bucket, so full
buckets are dropped whenever the table grows past its last high-water mark; past
`max_buckets` (tenant names behind a trusted proxy are whatever its header says), tenants
without a bucket share one per budget, so a flood of new names is refused together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.bucket import TokenBucket

REQUESTS = "requests_per_minute"
TOKENS = "tokens_per_minute"


@dataclass(frozen=True, slots=True)
class OverBudget:
    """Over budget: which one (REQUESTS or TOKENS), its size, and when the call fits."""

    budget: str
    per_minute: int
    wait_s: float


@dataclass(frozen=True, slots=True)
class Charge:
    """What an admitted call took, to settle when it ends: `tenant` names the buckets it
    was taken from (the caller's own, or the shared OVERFLOW ones); `shared`: in the
    store every replica charges (gateway.state.budgets), else in this process."""

    tenant: str
    tokens: int
    shared: bool = False


OVERFLOW = "\0overflow"  # the buckets tenants past `max_buckets` share (no real name)
MAX_BUCKETS = 65_536


Limits = Callable[[str], tuple[int | None, int | None]]  # tenant -> (requests, tokens)/min


class RateLimits:
    def __init__(self, limits: Limits, max_buckets: int = MAX_BUCKETS) -> None:
        self._limits = limits
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._max_buckets = max_buckets
        self._prune_at = min(1024, max_buckets)

    def take(self, tenant: str, tokens: int, now: float) -> Charge | OverBudget | None:
        """Charge one call of `tenant` reserving `tokens`; None: the tenant has no limits."""
        per_request, per_token = self._limits(tenant)
        if per_request is None and per_token is None:
            return None
        wanted = ((REQUESTS, per_request, 1), (TOKENS, per_token, tokens))
        owner = self._owner(tenant, now)
        buckets = [
            (budget, self._bucket(owner, budget, size, now), amount)
            for budget, size, amount in wanted
            if size is not None
        ]
        for budget, bucket, amount in buckets:
            wait = bucket.wait_s(amount)
            if wait > 0:
                return OverBudget(budget, round(bucket.capacity), wait)
        for _budget, bucket, amount in buckets:
            bucket.take(amount)
        return Charge(owner, tokens)

    def settle(self, charge: Charge, used_tokens: int | None, now: float) -> None:
        """`charge`'s call ended: `used_tokens` it really cost (None: it never reached a
        worker, and the request goes back too)."""
        if used_tokens is None:
            self._give(charge.tenant, REQUESTS, 1, now)
        self._give(charge.tenant, TOKENS, charge.tokens - (used_tokens or 0), now)

    def _give(self, tenant: str, budget: str, amount: float, now: float) -> None:
        bucket = self._buckets.get((tenant, budget))
        if bucket is not None and amount:
            bucket.fill(now)
            bucket.give(amount)

    def _owner(self, tenant: str, now: float) -> str:
        """Whose buckets `tenant`'s call uses: its own, unless it has none and the table
        is at its bound even after dropping the full ones (so it holds at most
        `max_buckets` + 3: a tenant's second budget, the shared two)."""
        buckets = self._buckets
        if (tenant, REQUESTS) in buckets or (tenant, TOKENS) in buckets:
            return tenant
        if len(buckets) >= self._prune_at:
            self._prune(now)
        return tenant if len(self._buckets) < self._max_buckets else OVERFLOW

    def _bucket(self, owner: str, budget: str, per_minute: int, now: float) -> TokenBucket:
        key = (owner, budget)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(per_minute / 60, per_minute, now)
        elif bucket.capacity != per_minute:  # the tenant's limit was reloaded
            bucket.resize(per_minute / 60, per_minute, now)
        else:
            bucket.fill(now)
        return bucket

    def _prune(self, now: float) -> None:
        """Full buckets go (the same as none); the next prune once the table doubles."""
        self._buckets = {k: b for k, b in self._buckets.items() if not b.full(now)}
        self._prune_at = min(self._max_buckets, max(1024, 2 * len(self._buckets)))

    def __len__(self) -> int:
        return len(self._buckets)
