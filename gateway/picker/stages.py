"""The picker's mode of the call pipeline (SMG's modes: the same stages, another
execution stage): the relay's table (`proxy/stages.py`) with the picker's own stages
beside its stages, and the hand-over to Envoy in place of the relay's dispatch."""

from __future__ import annotations

import functools
from collections.abc import Callable

from google.protobuf.message import DecodeError

from gateway.picker.context import ToRelay, picker_context
from gateway.picker.destinations import endpoint, literal
from gateway.picker.handover import HandOver
from gateway.proxy import (
    NO_REQUEST,
    OPENING,
    PLACED,
    REGULAR_ONLY,
    Call,
    Job,
    Stage,
    StageEnv,
    abort_invalid,
    stages,
)


class PickerStages:
    """The picker's stages, and the sequences they make with the table's."""

    __slots__ = ("_count", "_hand_over", "_migrate_streams", "opening", "placed")

    def __init__(
        self, hand_over: HandOver, migrate_streams: bool, count: Callable[[str], None]
    ) -> None:
        self._hand_over = hand_over
        self._migrate_streams = migrate_streams
        self._count = count
        # Every RPC kind's first stages, then Generate's and Embed's.
        self.opening: tuple[Stage, ...] = stages.in_mode(
            OPENING, before={stages.read: self.headers_read}
        )
        self.placed: tuple[Stage, ...] = stages.in_mode(
            PLACED,
            after={stages.resolve: self.regular_only},
            instead={stages.dispatch: self.hand_over},
        )

    async def headers_read(self, env: StageEnv, call: Call) -> None:
        """The headers answered, so Envoy sends the body (a call whose headers ended it
        has none: refused as the relay refuses it)."""
        context = picker_context(call)
        if context.bodiless:
            await abort_invalid(context, NO_REQUEST)
        await context.headers_read()

    async def regular_only(self, env: StageEnv, call: Call) -> None:
        """A call Envoy cannot run alone goes to the relay whole (a disaggregated pair;
        with `picker.migrate_streams`, any stream), before it is classified, charged or
        queued (the relay does that)."""
        info = call.info
        legs = env.routing.placer.legs(call.model, bool(info.mm_items) if info else False)
        if legs != REGULAR_ONLY or (self._migrate_streams and call.spec.server_streaming):
            raise ToRelay()

    async def hand_over(self, env: StageEnv, call: Call) -> None:
        """In place of the relay's dispatch: the dispatcher's one attempt loop places the
        call, and each attempt hands the worker to Envoy (a Generate's usage tallied as
        the relay tallies it, from the answer Envoy relays)."""
        attempt = functools.partial(self._hand_over.attempt, env)
        assert call.place is not None
        sink = call.client(env.tally(call))
        job = Job(call, env.adapter, call.request, sink, call.record.request_id)
        await env.routing.dispatcher.serve(job, call.place, attempt, call.placed_ahead)

    def abort_destination(self, env: StageEnv, call: Call) -> str:
        """Where an Abort goes: straight to the one worker that runs every request it
        names, if the picker placed them all there; else to the relay, which finds every
        holder (the picker's too) and asks the sibling processes."""
        try:
            ids = env.adapter.abort_ids(call.request)
        except DecodeError:
            raise ToRelay() from None  # it answers INVALID_ARGUMENT
        inflight = env.routing.dispatcher.upstreams.inflight
        holders = [h for i in ids for h in inflight.holders(i, call.record.principal)]
        workers = {h.worker for h in holders}
        found = {h.upstream_id for h in holders}
        if len(workers) != 1 or found != set(ids) or not all(h.direct for h in holders):
            raise ToRelay()
        (worker,) = workers
        ip = literal(worker.spec.host)
        if ip is None:
            raise ToRelay()
        self._count("worker")
        return endpoint(ip, worker.spec.port)
