"""Migration: a Generate stream whose worker fails or leaves after tokens reached the
client goes on on another worker, and the client's stream with it.

Clients send token ids and workers stream token ids, so the gateway knows exactly what
to re-send: the continuation is the client's request with the tokens relayed so far
appended to its prompt, its most and least new tokens reduced by them, under a new
upstream request id (which the client's request id still reaches: Abort follows it).
Its answers are rewritten so every counter the client reads goes on (the engine adapter
knows how its engine counts): one uninterrupted stream, no token twice, none lost.

What a stream relayed is kept raw (no message is parsed as it passes) and read for its
token ids in batches, one parse each, or when a migration needs them, so the relay costs
next to nothing more when no worker fails. A stream that cannot be continued ends as it
would without migration, with the worker's status, and the reason is logged and counted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace

import grpc
import structlog

from gateway.config.gateway import MigrationConfig
from gateway.engines import EngineAdapter
from gateway.proxy.job import Job
from gateway.proxy.metadata import Metadata
from gateway.proxy.upstream import Sink, UpstreamFailure

log = structlog.get_logger("gateway.migration")

# A worker's failure after tokens flowed: its connection broke or it shut down under the
# call (UNAVAILABLE, CANCELLED by the worker: the client's own cancel never arrives as a
# status), or it failed (INTERNAL). Any other status is an answer given on purpose.
MIGRATABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.CANCELLED}
)
KEEP_MESSAGES = 256  # answers kept raw before they are read for their token ids
KEEP_BYTES = 64 * 1024  # ... or this many bytes of them


class Progress:
    """What one job's stream has relayed: its token ids (read in batches from the raw
    answers kept meanwhile, `pending`), whether a closing answer went, and the first
    answer (its request id is the one the client knows). At most `room` token ids are
    kept: past them the stream can no longer be continued (`overflow`)."""

    __slots__ = (
        "_adapter",
        "_room",
        "closed",
        "first",
        "overflow",
        "pending",
        "pending_bytes",
        "raw",
        "tokens",
        "upstream_id",
    )

    def __init__(self, adapter: EngineAdapter, job: Job, room: int) -> None:
        self._adapter = adapter
        self.raw = job.raw  # the client's request (one choice's, when n>1 is split)
        self.upstream_id = job.upstream_id  # the id its first worker knew it by
        self._room = room
        self.pending: list[bytes] = []  # relayed, not read yet (`Relayed.write` adds)
        self.pending_bytes = 0
        self.tokens: list[int] = []
        self.closed = False
        self.overflow = False
        self.first: bytes | None = None

    def read(self) -> None:
        """The kept answers read for their token ids (one parse for them all)."""
        pending = self.pending
        if not pending:
            return
        if self.first is None:
            self.first = pending[0]
        ids, closing = self._adapter.relayed(pending)
        pending.clear()
        self.pending_bytes = 0
        tokens = self.tokens
        if closing:
            self.closed = True
        elif len(tokens) + len(ids) > self._room:
            self.overflow = True
        elif not self.overflow:
            tokens.extend(ids)


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
        client's awaitable returned as it is)."""
        self.delivered = True
        progress = self.progress
        pending = progress.pending
        pending.append(message)
        progress.pending_bytes += len(message)
        if len(pending) >= KEEP_MESSAGES or progress.pending_bytes >= KEEP_BYTES:
            progress.read()
        rewrite = self._rewrite
        return self.client.write(message if rewrite is None else rewrite(message))

    def trailers(self, metadata: Metadata) -> None:
        self.client.trailers(metadata)

    def prompt_cached(self, tokens: int) -> None:
        self.client.prompt_cached(tokens)


class Migrations:
    """When a job's stream may go on elsewhere, and its continuation."""

    def __init__(self, config: MigrationConfig, max_prompt_tokens: int) -> None:
        self._config = config
        self._max_prompt_tokens = max_prompt_tokens

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
        """The job with what its stream relays kept, if it could be continued."""
        if self.refusal(job) != "":
            return job
        info = job.call.info
        assert info is not None
        room = self._config.max_resent_tokens - len(info.tokens)
        return replace(job, sink=Relayed(job.sink, Progress(job.adapter, job, room)))

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
        relayed = len(sink.progress.tokens) if isinstance(sink, Relayed) else 0
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
        raw = adapter.continuation(progress.raw, info, progress.tokens, upstream_id)
        prompt_tokens, before = len(info.tokens), len(progress.tokens)
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
        generated = len(progress.tokens)
        if progress.closed:
            return "finished"  # its closing answer went: nothing is left to generate
        if info.max_new_tokens is not None and generated >= info.max_new_tokens:
            return "finished"
        if migrated >= self._config.max_migrations:
            return "limit"
        if progress.overflow or len(info.tokens) + generated > self._max_prompt_tokens:
            return "too_long"
        return ""
