"""A call's share of its worker's prefill backlog: the prompt tokens the worker is
expected to prefill for it (uncached there), counted on the worker from the call's
placement until its first message comes back (or it ends first). The sum, per worker, is
what queues a new call's prefill there: a feature of the worker's latency model
(`gateway.upstream.latency`). Counted only for calls a cache-aware policy placed on a
regular leg (their uncached tokens are known)."""

from __future__ import annotations

from gateway.upstream.worker import Worker


class PrefillHold:
    """`tokens` on `worker`'s backlog until `done` (once, however often it is called)."""

    __slots__ = ("_worker", "tokens")

    def __init__(self, worker: Worker, tokens: int) -> None:
        self._worker: Worker | None = worker
        self.tokens = tokens
        worker.prefill_backlog += tokens

    def done(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.prefill_backlog -= self.tokens
