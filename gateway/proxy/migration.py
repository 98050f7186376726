"""Migration: a Generate stream whose worker fails or leaves after tokens reached the
client goes on on another worker, and the client's stream with it.

Clients send token ids and workers stream token ids, so the gateway knows exactly what
to re-send: the continuation is the client's request with the tokens relayed so far
appended to its prompt, its most and least new tokens reduced by them, under a new
upstream request id (which the client's request id still reaches: Abort follows it).
Its answers are rewritten so every counter the client reads goes on (the engine adapter
knows how its engine counts): one uninterrupted stream, no token twice, none lost.

What a stream relayed is kept raw (no message is parsed as it passes: each is copied to
one buffer of at most KEEP_BYTES) and read for its token ids in batches, one parse each,
or when a migration needs them, so the relay costs next to nothing more when no worker
fails. The ids are kept packed, as the varints of a chunk's packed `token_ids` field
(`EngineAdapter.packed`: 3 bytes an id under 2^21, made in C with no Python step per
id), and all streams together keep at most `migration.max_kept_tokens` of them
(`TokenBudget`): a stream past it, or past its own bound, or one whose worker sent an
answer that does not decode, is no longer followed (`Progress.lost` says why, counted in
`gateway_migration_unfollowed_total`) and goes on relaying raw. A stream that cannot be
continued ends as it would without migration, with the worker's status, and the reason
is logged and counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace

import grpc
import structlog
from google.protobuf.message import DecodeError

from gateway.config.gateway import MigrationConfig
from gateway.core.allowance import Allowance
from gateway.engines import EngineAdapter
from gateway.proxy.failures import UNDECODABLE, UpstreamFailure
from gateway.proxy.job import Job
from gateway.proxy.metadata import Metadata
from gateway.proxy.upstream_call import Sink

log = structlog.get_logger("gateway.migration")

# A worker's failure after tokens flowed: its connection broke or it shut down under the
# call (UNAVAILABLE, CANCELLED by the worker: the client's own cancel never arrives as a
# status), or it failed (INTERNAL). Any other status is an answer given on purpose.
MIGRATABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}
)
KEEP_BYTES = 16 * 1024  # answers kept raw (concatenated) before they are read
PIECE_BYTES = 256 * 1024  # packed token ids frozen in pieces of this size
# Why a stream is no longer followed (`Progress.lost`): past its own bound, past the
# process's budget, or an answer of its worker that does not decode.
TOO_LONG, BUDGET = "too_long", "budget"
UNFOLLOWED = (TOO_LONG, BUDGET, UNDECODABLE)


class TokenBudget(Allowance):
    """The relayed token ids all of a process's streams keep, bounded: a stream takes
    room as its ids are read and gives it all back when it ends or stops being followed.
    `unfollowed` counts the streams no longer followed, by why (read at scrape time)."""

    __slots__ = ("unfollowed",)

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.unfollowed: Counter[str] = Counter()


class Progress:
    """What one job's stream has relayed: its token ids (read in batches from the raw
    answers kept meanwhile, concatenated in `pending`; packed, `count` of them), whether
    a closing answer went, and the first answer (its request id is the one the client
    knows). At most `room` token ids are kept, and only while the budget has room: past
    either, or at an answer that does not decode, the stream is no longer followed
    (`lost` says why) and what it kept is given back at once."""

    __slots__ = (
        "_adapter",
        "_budget",
        "_room",
        "closed",
        "count",
        "first",
        "lost",
        "packed",
        "pending",
        "raw",
        "tail",
        "upstream_id",
    )

    def __init__(self, adapter: EngineAdapter, job: Job, room: int, budget: TokenBudget) -> None:
        self._adapter = adapter
        self.raw = job.raw  # the client's request (one choice's, when n>1 is split)
        self.upstream_id = job.upstream_id  # the id its first worker knew it by
        self._room = room
        self._budget = budget
        self.pending = bytearray()  # relayed, not read yet (`Relayed.write` adds)
        # The token ids relayed, as varints (`tokens()`): grown in `tail`, frozen in
        # pieces of PIECE_BYTES (one buffer grown whole would leave the heap in holes).
        self.packed: list[bytes] = []
        self.tail = bytearray()
        self.count = 0
        self.closed = False
        self.lost = ""  # why it is no longer followed ("": it is)
        self.first: bytes | None = None

    def read(self) -> None:
        """The kept answers read for their token ids (one parse for them all)."""
        pending = self.pending
        if not pending:
            return
        try:
            ids, closing = self._adapter.relayed(bytes(pending))
        except DecodeError:
            self.stop(UNDECODABLE)
            return
        pending.clear()
        if closing:
            self.closed = True
        elif self.lost:
            return
        elif self.count + len(ids) > self._room:
            self.stop(TOO_LONG)
        elif not self._budget.take(len(ids)):
            self.stop(BUDGET)
        else:
            tail = self.tail
            tail += self._adapter.packed(ids)
            if len(tail) >= PIECE_BYTES:
                self.packed.append(bytes(tail))
                tail.clear()
            self.count += len(ids)

    def tokens(self) -> Sequence[int]:
        """The token ids kept (unpacked: a continuation needs them)."""
        return self._adapter.unpacked(b"".join((*self.packed, self.tail)))

    def stop(self, why: str) -> None:
        """No longer followed: what it kept given back, nothing more kept (counted once)."""
        if not self.lost:
            self.lost = why
            self._budget.unfollowed[why] += 1
        self.release()
        self.pending.clear()

    def release(self) -> None:
        """Its token ids given back to the budget (the stream ended, or is not followed)."""
        self._budget.give(self.count)
        self.packed, self.tail, self.count = [], bytearray(), 0


class Relayed:
    """One stretch of a job's stream on its way to the client (the first worker's, or a
    continuation's): each answer kept, a continuation's rewritten so the client's
    counters go on. `delivered` is this stretch's: a continuation that fails before its
    first answer is tried again on another worker like any first attempt."""

    __slots__ = ("_rewrite", "client", "delivered", "progress")

    def __init__(
        self, client: Sink, progress: Progress, rewrite: Callable[[bytes], bytes] | None = None
    ) -> None:
        self.client = client
        self.progress = progress
        self._rewrite = rewrite
        self.delivered = False

    async def headers(self, metadata: Metadata, *, always: bool = False) -> None:
        await self.client.headers(metadata, always=always)

    def write(self, message: bytes) -> Awaitable[None]:
        """Kept (an append: nothing is parsed here, once per message), then written (the
        client's awaitable returned as it is). A continuation's answer that does not
        decode raises DecodeError before anything reaches the client: the relay makes it
        its worker's failure."""
        rewrite = self._rewrite
        out = message if rewrite is None else rewrite(message)
        self.delivered = True
        progress = self.progress
        if progress.first is None:
            progress.first = message
        if not progress.lost:
            pending = progress.pending
            pending += message
            if len(pending) >= KEEP_BYTES:
                progress.read()
        return self.client.write(out)

    def trailers(self, metadata: Metadata) -> None:
        self.client.trailers(metadata)

    def prompt_cached(self, tokens: int) -> None:
        self.client.prompt_cached(tokens)


class Migrations:
    """When a job's stream may go on elsewhere, and its continuation."""

    def __init__(self, config: MigrationConfig, max_prompt_tokens: int) -> None:
        self._config = config
        self._max_prompt_tokens = max_prompt_tokens
        self.budget = TokenBudget(config.max_kept_tokens)

    def configure(self, config: MigrationConfig, max_prompt_tokens: int) -> None:
        """A reload: whether and how far streams go on elsewhere, from the next stream on
        (the kept-token budget is the process's memory bound: read at start-up)."""
        self._config, self._max_prompt_tokens = config, max_prompt_tokens

    def refusal(self, job: Job) -> str | None:
        """Why the job's stream could never be continued ("" if it could; None: it is
        not a stream of tokens at all)."""
        info = job.call.info
        if info is None or not info.stream:
            return None
        config = self._config
        if not config.enabled or not config.max_migrations:
            return "disabled"
        if job.choices > 1:  # one upstream stream interleaves them
            return "choices"
        if info.unresumable:
            return info.unresumable
        if len(info.tokens) >= min(config.max_resent_tokens, self._max_prompt_tokens):
            return "too_long"
        return ""

    def watch(self, job: Job) -> Job:
        """The job with what its stream relays kept, if it could be continued. A stream
        that starts while the budget is spent is not followed (the older ones keep
        theirs). `done` gives back what it kept."""
        if self.refusal(job) != "":
            return job
        info = job.call.info
        assert info is not None
        room = self._config.max_resent_tokens - len(info.tokens)
        progress = Progress(job.adapter, job, room, self.budget)
        if self.budget.held >= self.budget.limit:
            progress.stop(BUDGET)
        return replace(job, sink=Relayed(job.sink, progress))

    @staticmethod
    def done(job: Job) -> None:
        """The job's stream ended (however): what it kept goes back to the budget."""
        sink = job.sink
        if isinstance(sink, Relayed):
            sink.progress.release()

    def verdict(self, job: Job, failure: UpstreamFailure, migrated: int) -> str | None:
        """Whether a job whose worker failed after its stream reached the client goes on
        elsewhere (`migrated`: how often it went on before): "" if it may, else why not;
        None if the failure is no migration's business (an answer given on purpose)."""
        if failure.code not in MIGRATABLE:
            return None
        sink = job.sink
        if not isinstance(sink, Relayed):
            return self.refusal(job) or "disabled"
        sink.progress.read()
        return self._limit(job, sink.progress, migrated)

    def note(self, job: Job, failure: UpstreamFailure, outcome: str) -> None:
        """What became of a stream whose worker failed: `continued` on another worker,
        `unplaced` (no other worker could take it), or why it could not go on."""
        sink, call = job.sink, job.call
        relayed = sink.progress.count if isinstance(sink, Relayed) else 0
        cause = failure.cause or failure.code.name.lower()
        continued = outcome == "continued"
        resent = len(call.info.tokens) + relayed if continued and call.info is not None else 0
        call.migrated(failure.worker.id, cause, outcome, relayed, resent)
        (log.info if continued else log.warning)(
            "migration" if continued else "migration_refused",
            request_id=call.record.request_id or None,
            model=call.model,
            worker=failure.worker.id,
            cause=cause,
            outcome=outcome,
            relayed_tokens=relayed,
        )

    def continuation(self, job: Job, migrated: int) -> Job:
        """The job that goes on from what its stream relayed (`verdict` said it may): the
        continued request under `<id>~<k>`, its answers rewritten for the client."""
        sink, info = job.sink, job.call.info
        assert isinstance(sink, Relayed) and info is not None
        progress, adapter = sink.progress, job.adapter
        upstream_id = f"{progress.upstream_id}~{migrated + 1}"
        raw = adapter.continuation(progress.raw, info, progress.tokens(), upstream_id)
        prompt_tokens, before = len(info.tokens), progress.count
        assert progress.first is not None  # it delivered
        client_id = adapter.response_id(progress.first)
        continued = adapter.continued

        def rewrite(message: bytes) -> bytes:
            return continued(message, prompt_tokens, before, client_id)

        stretch = Relayed(sink.client, progress, rewrite)  # the same client, a new stretch
        return replace(job, raw=raw, upstream_id=upstream_id, sink=stretch)

    def _limit(self, job: Job, progress: Progress, migrated: int) -> str:
        """Why a stream that could be continued cannot be now ("" if it can)."""
        info = job.call.info
        assert info is not None
        generated = progress.count
        if progress.closed:
            return "finished"  # its closing answer went: nothing is left to generate
        if info.max_new_tokens is not None and generated >= info.max_new_tokens:
            return "finished"
        if migrated >= self._config.max_migrations:
            return "limit"
        if progress.lost:
            return progress.lost
        if len(info.tokens) + generated > self._max_prompt_tokens:
            return TOO_LONG
        return ""
