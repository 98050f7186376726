"""What placement decided for one request, as a value nothing changes afterwards.

A policy answers with a `Choice` per leg (`gateway.placement.policies`); the placer
assembles them into a `Decision`. The proxy reads only the
decision: which worker takes which leg, on which rank, and what to log. Nothing is
written back into the request's hints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gateway.core.roles import Role
from gateway.observability.record import PlacedOn
from gateway.placement.policies import Choice
from gateway.upstream.worker import Worker

NO_RANKS: Mapping[str, int] = MappingProxyType({})


def ranks(chosen: Iterable[Choice[Worker]]) -> Mapping[str, int]:
    """Worker id -> the data-parallel rank placement chose on it (most calls: none)."""
    found = {c.worker.id: c.rank for c in chosen if c.rank is not None}
    return MappingProxyType(found) if found else NO_RANKS


@dataclass(frozen=True, slots=True)
class Decision:
    """The workers one request goes to: regular, or prefill + decode; plus the encode
    workers with the items each one encodes (EPD). `ranks`: worker id -> data-parallel
    rank, for the workers placement put on a rank; `expected_cached_tokens` and `policy`
    are the prompt-receiving leg's."""

    workers: Mapping[Role, Worker]
    encoders: tuple[tuple[Worker, tuple[str, ...]], ...] = ()
    ranks: Mapping[str, int] = field(default_factory=lambda: NO_RANKS)
    expected_cached_tokens: int | None = None
    policy: str = ""
    candidates: int = 0  # the workers that could take the prompt-receiving leg (traces)
    placed_on: PlacedOn | None = None  # the prompt-receiving leg's worker as its policy saw it
    paced_on: PlacedOn | None = None  # the decode leg's worker as its policy saw it

    @property
    def primary(self) -> Worker:
        """The worker whose stream the client gets."""
        return self.workers.get(Role.DECODE) or self.workers[Role.REGULAR]

    @property
    def receiver(self) -> Worker:
        """The worker that takes the prompt (and an encoder's embeddings)."""
        return self.workers.get(Role.PREFILL) or self.workers[Role.REGULAR]

    @property
    def lone(self) -> Worker:
        """The one worker of a call that a single worker answers."""
        (worker,) = self.workers.values()
        return worker

    @classmethod
    def single(cls, worker: Worker, policy: str = "") -> Decision:
        return cls(MappingProxyType({worker.role: worker}), policy=policy)

    def only(self, worker: Worker) -> Decision:
        """This decision narrowed to one of its workers (keeping its rank): itself when
        that is all it holds (a regular call's, every time)."""
        if not self.encoders and len(self.workers) == 1 and worker in self.workers.values():
            return self
        rank = self.ranks.get(worker.id)
        return Decision(
            MappingProxyType({worker.role: worker}),
            ranks=NO_RANKS if rank is None else MappingProxyType({worker.id: rank}),
            expected_cached_tokens=self.expected_cached_tokens,
            policy=self.policy,
            candidates=self.candidates,
            placed_on=self.placed_on,
        )

    def rank_of(self, worker: Worker) -> int | None:
        return self.ranks.get(worker.id)

    def all(self) -> list[Worker]:
        return [*self.workers.values(), *(w for w, _ in self.encoders)]
