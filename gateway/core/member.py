"""Where a serving process stands among its siblings: its index, their count, and the
private directory where each one's control socket lives.

A leaf module (the standard library only): the serving process (`gateway.app.server`) reads
it, the supervisor (`gateway.scale`, above the server) makes it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Member:
    """One serving process of `gateway serve --processes N` (index 0..count-1)."""

    index: int
    count: int
    control_dir: str  # mode 0700, made by the supervisor: only the gateway's user gets in

    def socket_path(self, index: int) -> Path:
        return Path(self.control_dir) / f"p{index}.sock"

    def control_address(self, index: int | None = None) -> str:
        """The gRPC address of a process's control socket (admin and peer services)."""
        return f"unix:{self.socket_path(self.index if index is None else index)}"

    def siblings(self) -> list[str]:
        """The other processes' control addresses."""
        return [self.control_address(i) for i in range(self.count) if i != self.index]

    def share(self, limit: int) -> int:
        """This process's share of a limit: the shares add up to at least the limit and to
        at most limit + count - 1 (a positive limit gives each at least 1; 0 stays 0)."""
        return -(-limit // self.count)
