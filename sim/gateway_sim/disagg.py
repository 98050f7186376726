"""What the PD legs of both runtimes share: the checks every leg makes, and running a leg
on the engine once its KV (or embeddings) are in place.

A leg is a normal simulated Generate with two additions: a ``prepare`` step before the
first token (the decode's KV fetch, the prefill's wait for embeddings), which an Abort
cuts short, and a hook on the first message written (the prefill publishes its handoff
there, the decode adds the prompt logprobs it was handed). The engine's streaming code
stays the regular worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

import grpc
from grpc.aio import ServicerContext

from gateway_sim.dialect import Dialect
from gateway_sim.embeddings import EmbeddingsMissing
from gateway_sim.engine import SimEngine
from gateway_sim.handoff import KvTransferError
from gateway_sim.plan import Finish, Sampling

N_NOT_SUPPORTED = "n>1 is not supported in disaggregated mode"

Amend = Callable[[Any], None]


async def reject(
    context: ServicerContext[Any, Any], code: grpc.StatusCode, message: str
) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("unreachable")


async def check_single_sample(context: ServicerContext[Any, Any], n: int) -> None:
    """Real PD engines take one sample per request; the router splits n upstream."""
    if n > 1:
        await reject(context, grpc.StatusCode.INVALID_ARGUMENT, N_NOT_SUPPORTED)


@dataclass(frozen=True, slots=True)
class Start:
    """What ``prepare`` found: the first token handed over (decode), and changes to the
    first message written (``amend`` before it is written, ``restore`` after)."""

    first_token: int | None = None
    amend: Amend | None = None
    restore: Amend | None = None


class _FirstWrite:
    """A ServicerContext whose first ``write`` is amended (and restored after: the engine
    reuses its chunk messages); everything else goes to the real context."""

    def __init__(self, context: ServicerContext[Any, Any], start: Start) -> None:
        self._context = context
        self._start: Start | None = start

    async def write(self, message: Any) -> None:
        start, self._start = self._start, None
        if start is None:
            await self._context.write(message)
            return
        if start.amend is not None:
            start.amend(message)
        await self._context.write(message)  # serialized here, so restoring after is safe
        if start.restore is not None:
            start.restore(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


async def _unless_aborted(abort: Awaitable[bool], work: Awaitable[Start]) -> Start | None:
    """``work``'s result (or its error), or None if the request is aborted first (however
    the abort's wait ends: it only cuts the work short)."""
    done: list[Start] = []
    failed: list[Exception] = []

    async def run_work() -> None:
        try:
            done.append(await work)
        except Exception as error:  # raised below, as it was (not wrapped by the group)
            failed.append(error)

    async def wait_abort() -> None:
        with contextlib.suppress(Exception):
            await abort

    async with asyncio.TaskGroup() as both:
        work_task = both.create_task(run_work())
        abort_task = both.create_task(wait_abort())
        await asyncio.wait((work_task, abort_task), return_when=asyncio.FIRST_COMPLETED)
        work_task.cancel()  # whichever is still waiting: the group awaits its end
        abort_task.cancel()
    if failed:
        raise failed[0]
    return done[0] if done else None  # none: the abort came first and cut the work short


async def run_leg(
    engine: SimEngine,
    context: ServicerContext[Any, Any],
    dialect: Dialect,
    request_id: str,
    input_ids: Sequence[int] | None,
    sampling: Sampling,
    prepare: Callable[[], Awaitable[Start]],
    rank: int = 0,
    namespace: str = "",
) -> None:
    """Serve one PD leg: the engine's checks, ``prepare`` (bounded by its own timeouts;
    INTERNAL when the KV or embeddings do not come, as the engines fail such a
    request), then the engine's regular responses, starting from the handed-over first
    token if any."""
    view = await engine.read(context)
    entry = engine.active.add(request_id, rank)
    try:
        await engine.plan(context, dialect, view, input_ids, sampling)  # refused first
        try:
            start = await _unless_aborted(entry.sleep(None), prepare())
        except (KvTransferError, EmbeddingsMissing) as exc:
            await reject(context, grpc.StatusCode.INTERNAL, str(exc))
        if start is None:  # aborted while waiting: the stream ends with nothing produced
            prompt_tokens = len(input_ids or ())
            out = engine.writer(context, view)
            if sampling.stream:
                message = dialect.chunk(request_id, prompt_tokens, 0, 0)
                dialect.fill(message, (), 0)
                await out.write(message)
            await out.write(
                dialect.complete(
                    request_id, (), 0, Finish("abort"), prompt_tokens, 0, 0, sampling.stream
                )
            )
            return
        target = context
        if start.amend is not None or start.restore is not None:
            target = cast("ServicerContext[Any, Any]", _FirstWrite(context, start))
        await engine.respond(
            target, dialect, entry, view, input_ids, sampling, start.first_token, namespace
        )
    finally:
        engine.active.remove(entry)
