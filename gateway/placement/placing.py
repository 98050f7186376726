"""How each attempt of one call is placed: what dispatch calls with the workers that
failed the call so far. With session affinity on, each leg goes back to the worker its
session is bound to when it can, and the session is bound to where the call went."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

from gateway.core.roles import Role, Runtime
from gateway.core.verdicts import Verdict
from gateway.placement.affinity import NO_BINDING
from gateway.placement.decision import Decision
from gateway.placement.placer import Placer
from gateway.placement.policies import Hints


class Placing:
    """How each attempt of one call is placed (what dispatch calls with the workers that
    failed it so far): every leg its model needs, or the receiver only (a call that is not
    a disaggregated Generate). With `session` (affinity on), each leg goes to the worker
    the session is bound to when it can, and the session is bound to where it went."""

    __slots__ = (
        "_hints",
        "_items",
        "_legs",
        "_model",
        "_placer",
        "_receiver_only",
        "_runtime",
        "_session",
    )

    def __init__(
        self,
        placer: Placer,
        model: str,
        runtime: Runtime,
        hints: Hints,
        items: Sequence[str],
        legs: tuple[Role, ...],
        *,
        receiver_only: bool,
        session: str | None = None,
    ) -> None:
        self._placer, self._model, self._runtime = placer, model, runtime
        self._hints, self._items, self._legs = hints, items, legs
        self._receiver_only = receiver_only
        self._session = session if placer.affinity is not None else None

    def __call__(self, tried: Collection[str]) -> Decision | Verdict:
        affinity, session, model = self._placer.affinity, self._session, self._model
        now = time.monotonic()
        bound = NO_BINDING
        if affinity is not None and session is not None:
            bound = affinity.bound(session, model, self._legs, now)
        decided = self._placer.place(
            model, self._runtime, self._hints, self._items, tried, self._legs, bound
        )
        if isinstance(decided, Verdict):
            return decided
        if self._receiver_only:
            decided = decided.only(decided.receiver)
        if affinity is not None and session is not None:
            affinity.placed(session, model, decided.workers, bound, now)
        return decided
