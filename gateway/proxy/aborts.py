"""Abort: routed by request id to where the named requests run, in this process and in
its sibling processes (`--processes N`) for the ones it does not hold. Only the
requests the caller's own principal started are reached."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from google.protobuf.message import DecodeError

from gateway.core.verdicts import shown
from gateway.engines import EngineAdapter
from gateway.proxy.call import Call
from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.inflight import InflightCall
from gateway.proxy.metadata import Metadata
from gateway.proxy.status import abort_invalid
from gateway.proxy.upstream import Outbound, Upstreams

SHOWN_IDS = 8  # request ids an answer repeats (a vLLM Abort may name any number)


class AbortPeers(Protocol):
    """The other serving processes of this gateway (`--processes N`)."""

    async def abort_held(
        self,
        service: str,
        request: bytes,
        principal: str | None,
        forward: Metadata,
        time_left: float | None,
    ) -> list[bytes]:
        """The replies of the siblings that held a named request."""


def named(ids: list[str]) -> str:
    """Client-supplied ids as an answer repeats them: a few, each bounded."""
    shown_ids = ", ".join(repr(shown(i)) for i in ids[:SHOWN_IDS])
    more = len(ids) - SHOWN_IDS
    return shown_ids + (f" and {more} more" if more > 0 else "")


class Aborts:
    """One engine protocol's Aborts (`path`: its Abort method)."""

    def __init__(
        self,
        adapter: EngineAdapter,
        upstreams: Upstreams,
        path: str,
        abort_wait_s: float,
        siblings: AbortPeers | None = None,
    ) -> None:
        self.adapter = adapter
        self._upstreams = upstreams
        self._path = path
        self._abort_wait_s = abort_wait_s  # `disagg.abort_wait_s`: a decode's start
        self._siblings = siblings

    async def _abort_one(
        self,
        path: str,
        request: bytes,
        holder: InflightCall,
        forward: Metadata,
        time_left: float | None,
    ) -> bytes:
        """Abort one upstream call; a decode leg only once it has started (bounded), so the
        KV handoff from its prefill is not torn in the middle. An abort says nothing about
        the worker's health: it is counted in flight, never judged."""
        if holder.started is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._abort_wait_s):
                    await holder.started.wait()
        upstreams = self._upstreams
        abort = self.adapter.abort_request([holder.upstream_id], request)
        reservation = upstreams.reserve(holder.worker, judge=False)
        with upstreams.ask(reservation, Outbound(path, abort, forward, time_left)) as call:
            return await call.response()

    async def abort_held(
        self,
        request: bytes,
        ids: list[str],
        principal: str | None,
        forward: Metadata,
        time_left: float | None,
    ) -> bytes | None:
        """Abort what this process holds of `ids` for `principal`: the merged engine reply,
        or None if it holds none of them (the peer service asks the same of siblings)."""
        holders, _ = self._held(ids, principal)
        return await self._abort_holders(request, holders, forward, time_left)

    def _held(self, ids: list[str], principal: str | None) -> tuple[list[InflightCall], bool]:
        """The upstream calls this process holds for the named requests, and whether it
        holds every one of them."""
        inflight = self._upstreams.inflight
        found = [inflight.holders(request_id, principal) for request_id in ids]
        return [h for holders in found for h in holders], all(found)

    async def _abort_holders(
        self,
        request: bytes,
        holders: list[InflightCall],
        forward: Metadata,
        time_left: float | None,
    ) -> bytes | None:
        if not holders:
            return None
        path = self._path
        results = await asyncio.gather(
            *(self._abort_one(path, request, h, forward, time_left) for h in holders),
            return_exceptions=True,
        )
        replies = [r for r in results if isinstance(r, bytes)]
        if not replies:
            failure = next(r for r in results if isinstance(r, BaseException))
            detail = failure.details if isinstance(failure, UpstreamFailure) else str(failure)
            return self.adapter.abort_reply(False, f"abort failed: {detail}")
        return self.adapter.merge_aborts(replies)

    async def abort(self, call: Call) -> bytes:
        """Abort where the requests run: in this process, and in sibling processes for
        the ones it does not hold."""
        request, context, record = call.request, call.context, call.record
        try:
            ids = self.adapter.abort_ids(request)
        except DecodeError:
            await abort_invalid(context, "Request bytes are not a valid AbortRequest")
        call.named(",".join(ids))
        principal, forward = record.principal, call.meta.forward
        timeout = context.time_remaining()
        holders, all_here = self._held(ids, principal)  # before any await
        reached = [h.worker.id for h in holders]
        call.reached(reached)
        local = await self._abort_holders(request, holders, forward, timeout)
        replies = [local] if local is not None else []
        if self._siblings is not None and not all_here:
            # Some named request runs elsewhere (a vLLM Abort may name several): the
            # siblings abort what they hold of them, nothing this process holds.
            remote = await self._siblings.abort_held(
                self.adapter.service_name, request, principal, forward, timeout
            )
            if remote:
                call.reached([*reached, "sibling process"])
            replies += remote
        if not replies:
            return self.adapter.abort_reply(False, f"request {named(ids)} is not in flight here")
        return replies[0] if len(replies) == 1 else self.adapter.merge_aborts(replies)
