"""In-flight request tracking, shared by both engines: GetLoads counts it, Abort reaches it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


class ActiveRequest:
    """One in-flight call. Abort flips ``aborted`` and wakes any delay the call sleeps in."""

    __slots__ = ("_wake", "aborted", "generated", "rank", "request_id")

    def __init__(self, request_id: str, rank: int = 0) -> None:
        self.request_id = request_id
        self.rank = rank  # the DP rank it runs on
        self.aborted = False
        self.generated = 0  # tokens produced so far (they sit in the KV cache)
        # Made on first sleep only: the zero-delay hot path never needs it.
        self._wake: asyncio.Event | None = None

    def abort(self) -> None:
        """Idempotent: a second Abort of the same call changes nothing."""
        self.aborted = True
        if self._wake is not None:
            self._wake.set()

    async def sleep(self, seconds: float | None) -> bool:
        """Sleep ``seconds`` (None: until aborted or cancelled); True if aborted."""
        if self.aborted:
            return True
        if self._wake is None:
            self._wake = asyncio.Event()
        try:
            async with asyncio.timeout(seconds):
                await self._wake.wait()
        except TimeoutError:
            pass
        return self.aborted

    def signal(self) -> None:
        """Wake a ``wait_signal`` (the call was given a running slot)."""
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()

    async def wait_signal(self) -> None:
        """Wait for ``signal`` or an Abort; the event is cleared again unless aborted, so
        a later ``sleep`` sleeps its full time."""
        if self._wake is None:
            self._wake = asyncio.Event()
        if not self.aborted:
            await self._wake.wait()
        if not self.aborted:
            self._wake.clear()


class ActiveRequests:
    """Calls in flight, by request id. Two calls may share an id; both are tracked."""

    def __init__(self, ranks: int = 1) -> None:
        self._by_id: dict[str, list[ActiveRequest]] = {}
        self._count = 0
        self._per_rank = [0] * ranks

    def __len__(self) -> int:
        return self._count

    def on_rank(self, rank: int) -> int:
        """Calls running on one DP rank (GetLoads and the KV events' load records)."""
        return self._per_rank[rank]

    def add(self, request_id: str, rank: int = 0) -> ActiveRequest:
        entry = ActiveRequest(request_id, rank)
        entries = self._by_id.get(request_id)
        if entries is None:
            self._by_id[request_id] = [entry]
        else:
            entries.append(entry)
        self._count += 1
        self._per_rank[rank] += 1
        return entry

    def remove(self, entry: ActiveRequest) -> None:
        entries = self._by_id.get(entry.request_id)
        if entries is None or entry not in entries:
            return
        entries.remove(entry)
        if not entries:
            del self._by_id[entry.request_id]
        self._count -= 1
        self._per_rank[entry.rank] -= 1

    def generated(self, rank: int | None = None) -> int:
        """Tokens the running calls (of one rank, or all) have produced (a stalled
        client's calls stop adding)."""
        return sum(
            e.generated
            for entries in self._by_id.values()
            for e in entries
            if rank is None or e.rank == rank
        )

    def abort(self, request_ids: Iterable[str]) -> int:
        """Abort every call with one of these ids; returns how many were found."""
        found = 0
        for request_id in request_ids:
            for entry in self._by_id.get(request_id, ()):
                entry.abort()
                found += 1
        return found
