"""A token bucket: up to `capacity` tokens, refilled continuously at `rate` a second (pure;
the caller passes the clock). Tenants' rate limits (gateway.flow.budget) and log lines a
flood could cause (gateway.observability.logs.Throttle) are both bounded by one."""

from __future__ import annotations


class TokenBucket:
    """Starts full. Taking more than is there leaves a debt that refills like the rest; a
    debt is at most one capacity, so no figure (a huge call, a worker's usage) holds a
    bucket empty for longer than two refills."""

    __slots__ = ("at", "capacity", "level", "rate")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self.level = float(capacity)
        self.at = now

    def resize(self, rate: float, capacity: float, now: float) -> None:
        """A new allowance (a reload): what is there kept, within the new bounds."""
        self.fill(now)
        self.rate, self.capacity = rate, capacity
        self.level = max(-capacity, min(capacity, self.level))

    def fill(self, now: float) -> None:
        if now > self.at:
            self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
            self.at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` (at most the capacity) is there; 0: it is now."""
        missing = min(amount, self.capacity) - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float) -> None:
        self.level = max(-self.capacity, self.level - amount)

    def give(self, amount: float) -> None:
        """Tokens back (a negative amount: a debt), never past the capacity either way."""
        self.level = max(-self.capacity, min(self.capacity, self.level + amount))

    def full(self, now: float) -> bool:
        self.fill(now)
        return self.level >= self.capacity
