"""One call's writes: its response headers sent with its first message (``Writer``),
and its chunks and Completes made in its engine's dialect (``Answers``), as the engine
produces the tokens of its plan.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpc.aio import ServicerContext

from gateway_sim.dialect import Dialect
from gateway_sim.plan import Finish, Plan, Sampling


class Writer:
    """A call's writes: the response headers ride with the first message, as a servicer
    that never sends them on its own has them sent."""

    __slots__ = ("_context", "_headers", "sent")

    def __init__(
        self,
        context: ServicerContext[Any, Any],
        headers: Callable[[], tuple[tuple[str, str], ...]],
    ) -> None:
        self._context = context
        self._headers: Callable[[], tuple[tuple[str, str], ...]] | None = headers
        self.sent = 0

    async def send_headers(self) -> None:
        """Send the headers now, if they have not gone."""
        if self._headers is not None:
            headers, self._headers = self._headers, None
            await self._context.send_initial_metadata(headers())

    async def write(self, message: Any) -> None:
        await self.send_headers()
        await self._context.write(message)
        self.sent += 1


class Answers:
    """One call's answers: chunks and Completes in its engine's dialect, for its prompt,
    cache hit and sampling, written through ``emit``; ``reported``: the completion_tokens
    every one of them says instead of the dialect's count (a lying worker), if set."""

    __slots__ = (
        "cached",
        "dialect",
        "emit",
        "plan",
        "prompt",
        "reported",
        "request_id",
        "sampling",
    )

    def __init__(
        self,
        dialect: Dialect,
        request_id: str,
        prompt: Sequence[int],
        cached: int,
        sampling: Sampling,
        plan: Plan,
        emit: Callable[[Any], Awaitable[None]],
        reported: int | None = None,
    ) -> None:
        self.dialect = dialect
        self.request_id = request_id
        self.prompt = prompt
        self.cached = cached
        self.sampling = sampling
        self.plan = plan
        self.emit = emit
        self.reported = reported

    def chunks(self) -> list[Any]:
        """A reusable chunk message per choice."""
        return [
            self.dialect.chunk(self.request_id, len(self.prompt), self.cached, index)
            for index in range(self.sampling.choices)
        ]

    async def chunk(self, message: Any, start: int, end: int) -> None:
        """Write ``message`` holding tokens [start, end) of its choice."""
        dialect = self.dialect
        dialect.fill(message, self.plan.tokens(start, end), end)
        if self.reported is not None:
            message.chunk.completion_tokens = self.reported
        if end > start:
            prompt = self.prompt if start == 0 else None
            dialect.annotate(message.chunk, self.plan, start, end, self.sampling, prompt)
        await self.emit(message)

    async def complete(
        self, index: int, start: int, end: int, finish: Finish, streamed: bool
    ) -> None:
        """Write choice ``index``'s Complete: streamed, tokens [start, end) (its last
        chunk's; none after an abort); unstreamed, all ``end`` tokens produced."""
        plan, dialect = self.plan, self.dialect
        if not streamed:
            start = 0
        ids = await plan.all_tokens(end) if start == 0 else plan.tokens(start, end)
        if streamed and finish.reason == "abort":
            ids, start = [], end
        message = dialect.complete(
            self.request_id, ids, end, finish, len(self.prompt), self.cached, index, streamed
        )
        if self.reported is not None:
            message.complete.completion_tokens = self.reported
        if end > start:
            prompt = self.prompt if start == 0 else None
            dialect.annotate(message.complete, plan, start, end, self.sampling, prompt)
        await self.emit(message)
