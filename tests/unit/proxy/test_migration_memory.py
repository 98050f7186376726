"""What migration keeps of a stream: its token ids packed (3 bytes each), all streams
together within the process's budget (`migration.max_kept_tokens`), the budget given
back as streams end or stop being followed, and an answer that does not decode ending
the following, never the stream."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace
from typing import Any, cast

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from gateway.core.roles import Runtime
from gateway.engines import engine_adapters
from gateway.proxy.failures import UNDECODABLE
from gateway.proxy.job import Job
from gateway.proxy.migration import BUDGET, TOO_LONG, Progress, TokenBudget

SGLANG = engine_adapters()[Runtime.SGLANG]
JOB = cast(Job, SimpleNamespace(raw=b"", upstream_id="r"))


def chunk(start: int, count: int) -> bytes:
    ids = list(range(150_000 + start, 150_000 + start + count))  # a large vocabulary's
    message: Any = pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=ids))
    return bytes(message.SerializeToString())


def relay(progress: Progress, tokens: int, per_chunk: int = 1000) -> None:
    """`tokens` relayed in chunks, read as the relay reads them (a batch at a time)."""
    for start in range(0, tokens, per_chunk):
        progress.pending += chunk(start, per_chunk)
        progress.read()


def test_token_ids_are_kept_packed() -> None:
    budget = TokenBudget(10**9)
    progress = Progress(SGLANG, JOB, 10**6, budget)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        relay(progress, 100_000)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert list(progress.tokens()) == list(range(150_000, 250_000))
    assert kept <= 3.5 * 100_000  # ids under 2^21: 3 bytes at most, and the growth
    assert budget.held == progress.count == 100_000
    progress.release()
    assert budget.held == progress.count == 0 and not progress.packed


def test_streams_past_the_budget_are_no_longer_followed() -> None:
    """A budget of 2.5 streams: the third and the fourth stop at their first read past
    it (the first two keep theirs); every stream's room back once it ends."""
    budget = TokenBudget(25_000)
    streams = [Progress(SGLANG, JOB, 10**6, budget) for _ in range(4)]
    for progress in streams:
        relay(progress, 10_000)
        assert budget.held <= budget.limit
    assert [p.lost for p in streams] == ["", "", BUDGET, BUDGET]
    assert budget.held == 20_000 and budget.unfollowed == {BUDGET: 2}
    assert streams[2].count == 0 and not streams[2].packed  # given back at once
    for progress in streams:
        progress.release()
    assert budget.held == 0


def test_a_stream_past_its_own_room_is_no_longer_followed() -> None:
    budget = TokenBudget(10**6)
    progress = Progress(SGLANG, JOB, 5_000, budget)
    relay(progress, 10_000)
    assert progress.lost == TOO_LONG and budget.held == 0


def test_an_undecodable_answer_ends_the_following_not_the_stream() -> None:
    budget = TokenBudget(10**6)
    progress = Progress(SGLANG, JOB, 10**6, budget)
    relay(progress, 2_000)
    progress.pending += b"\xff\xff\xff"
    progress.read()  # no raise: the relay goes on
    assert progress.lost == UNDECODABLE and budget.held == 0 and not progress.pending
    assert budget.unfollowed == {UNDECODABLE: 1}
