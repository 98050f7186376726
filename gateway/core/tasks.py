"""Tasks with an owner: every task the gateway starts belongs to a `TaskScope`.

A scope's `close` cancels its tasks and waits until each has ended, so nothing outlives
what started it: no loop that probes a removed worker, no push still running once the
process it pushes to is gone, no task garbage-collected half-way. This module is the
only place that creates tasks (tests/architecture/test_task_hygiene.py holds the rest of the
package to it).

`TaskScope.supervise` is the one restart loop for background work: a loop that raises is
logged (once while it keeps failing the same way) and started again after a pause, so a
bug hit by one worker's probe or one discovery source never silently ends that work,
nor floods the log.

Where one child's failure should cancel its siblings (the legs of one request), use
`asyncio.TaskGroup`; a scope is for children that fail, or are cancelled, on their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Self, TypeVar

import structlog

log = structlog.get_logger("gateway.tasks")

T = TypeVar("T")

RESTART_S = 1.0  # a supervised loop that raised starts again after this pause
# A run this long since its (re)start ends a streak of failures: its failure is logged
# even if it is the same as the last one logged (a new occurrence, not the same repeating).
RECOVERED_S = 60.0


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel the tasks and wait until every one has ended, however long its own cleanup
    takes (a task may catch its cancellation to finish something first).

    A task's own cancellation or exception is not raised here: it is the task's (a scope
    logged its failure already). A cancellation of the caller while it waits does
    propagate, not swallowed (`gather` passes it on to the tasks, waits for them, then
    raises it), which `with suppress(CancelledError): await task` would get wrong.
    """
    pending = list(tasks)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


async def _supervised(
    name: str, run: Callable[[], Awaitable[None]], pause_s: float | None, context: dict[str, object]
) -> None:
    """`run()` until it returns; an exception is logged unless it repeats the last one
    logged, then `run()` starts again after the pause (RESTART_S unless given: read when
    it is due, so a test can shorten it)."""
    logged = ""
    while True:
        started = time.monotonic()
        try:
            await run()
            return
        except Exception as exc:
            if time.monotonic() - started >= RECOVERED_S:
                logged = ""
            if repr(exc) != logged:
                logged = repr(exc)
                log.error("loop_failed", loop=name, **context, error=logged, exc_info=exc)
        await asyncio.sleep(RESTART_S if pause_s is None else pause_s)


class TaskScope:
    """The tasks one owner started (a fleet, a source runner, one call of a function),
    cancelled and awaited together by `close`, or on leaving `async with scope:`.

    A task leaves the scope when it ends. One that fails is logged (`task_failed`, with
    its name and context) at once: nobody may ever await it. `log_failures=False` is for
    an owner that reads each child's outcome itself (an exception is then its answer).
    """

    def __init__(self, *, log_failures: bool = True) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._log_failures = log_failures

    def __len__(self) -> int:
        """How many of its tasks are still running."""
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str, **context: object) -> asyncio.Task[T]:
        """Run `coro` in a task of this scope; `name` and `context` (`worker=...`) say
        whose it is in the logs."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)

        def ended(done: asyncio.Task[T]) -> None:
            self._tasks.discard(done)
            error = None if done.cancelled() else done.exception()
            if error is not None and self._log_failures:
                log.error("task_failed", task=name, **context, error=repr(error), exc_info=error)

        task.add_done_callback(ended)
        return task

    def supervise(
        self,
        name: str,
        run: Callable[[], Awaitable[None]],
        *,
        pause_s: float | None = None,
        **context: object,
    ) -> asyncio.Task[None]:
        """Run the background loop `run()` in a task of this scope until it returns: if it
        raises, it is logged (`loop_failed`, once while it fails the same way) and started
        again after `pause_s` (RESTART_S by default)."""
        return self.spawn(_supervised(name, run, pause_s, context), name, **context)

    async def close(self) -> None:
        """Cancel every task and wait until all have ended (see `cancel_and_wait`); a task
        started meanwhile (by one that was ending) is cancelled too."""
        while self._tasks:
            tasks = list(self._tasks)
            await cancel_and_wait(tasks)
            self._tasks.difference_update(tasks)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


__all__ = ["RESTART_S", "TaskScope", "cancel_and_wait"]
