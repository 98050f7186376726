"""A Generate's usage: its completion and cached tokens, counted as its answers pass.

Its own module because the count outlives the adapter's part in it: the adapter says
how its engine counts (`Counting`) and reads one answer's figures (`Usage`); the `Tally`
adds them up per choice for the call's client side, bounded by what the call could have
used (`UsageBounds`), and its figures settle a tenant's token budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum


class Counting(Enum):
    """How an engine's Generate answers count a choice's completion tokens."""

    TOTALS = "totals"  # each message says the choice's count so far; the closing one, all
    DELTAS = "deltas"  # each chunk says its own tokens; a closing one repeats the last chunk


@dataclass(frozen=True, slots=True)
class Usage:
    """One Generate answer's figures for its choice, as its engine reported them."""

    index: int  # the choice
    completion_tokens: int
    cached_tokens: int
    closing: bool  # the choice's closing answer (a Complete), not a chunk


@dataclass(frozen=True, slots=True)
class UsageBounds:
    """What a call could have used: a worker's figure past it is not believed (a worker is
    untrusted, and its figures settle a tenant's token budget)."""

    completion_tokens: int  # its choices times the most each may generate
    cached_tokens: int  # its prompt's length


COMPLETION_TOKENS = "completion_tokens"
CACHED_TOKENS = "cached_tokens"


class Tally:
    """A call's completion and cached tokens as its answers pass, per choice, counted the
    engine's way (`read`: an answer's figures, None for neither chunk nor Complete). A
    choice index past the call's choices (a worker's stray one) counts as the last
    choice: the table never grows with what a worker sends. With `bounds`, a figure past
    its bound counts as the bound and is named in `rejected`."""

    __slots__ = (
        "_bounds",
        "_cached",
        "_chunked",
        "_closed",
        "_counting",
        "_read",
        "_tokens",
        "seen",
    )

    def __init__(
        self,
        counting: Counting,
        choices: int,
        read: Callable[[bytes], Usage | None],
        bounds: UsageBounds | None = None,
    ) -> None:
        self._counting = counting
        self._read = read
        self._bounds = bounds
        self._tokens = [0] * max(1, choices)  # per choice: what its answers counted so far
        self._chunked = [False] * max(1, choices)
        self._closed = 0  # totals of the choices closed (SGLang's unstreamed n > 1 says
        # index 0 in every Complete: each closing total counts once, whatever its index)
        self._cached = 0
        self.seen = False  # any answer with figures

    @property
    def last_only(self) -> bool:
        """One choice's running totals: its last answer says all."""
        return self._counting is Counting.TOTALS and len(self._tokens) == 1

    def see(self, message: bytes) -> None:
        """One of the call's answers, as its client gets it."""
        used = self._read(message)
        if used is not None:
            self.add(used)

    def add(self, used: Usage) -> None:
        self.seen = True
        slot = min(used.index, len(self._tokens) - 1) if used.index >= 0 else 0
        if self._counting is Counting.TOTALS:
            if used.closing:
                self._closed += used.completion_tokens
                self._tokens[slot] = 0
            else:
                self._tokens[slot] = used.completion_tokens
        elif not used.closing:
            self._tokens[slot] += used.completion_tokens
            self._chunked[slot] = True
        elif not self._chunked[slot]:  # a closing answer with no chunk before it
            self._tokens[slot] = used.completion_tokens
        # The prompt's, shared by its choices: each reports the same.
        self._cached = max(self._cached, used.cached_tokens)

    def prompt_cached(self, tokens: int) -> None:
        """What another leg found of the prompt cached (a PD prefill whose decode does
        not say it): the call's cached tokens at least."""
        self._cached = max(self._cached, tokens)
        self.seen = True

    @property
    def completion_tokens(self) -> int:
        counted = self._closed + sum(self._tokens)
        return counted if self._bounds is None else min(counted, self._bounds.completion_tokens)

    @property
    def cached_tokens(self) -> int:
        cached = self._cached
        return cached if self._bounds is None else min(cached, self._bounds.cached_tokens)

    @property
    def rejected(self) -> tuple[str, ...]:
        """The figures the worker reported past what the call could have used."""
        bounds = self._bounds
        if bounds is None:
            return ()
        over = (
            (COMPLETION_TOKENS, self._closed + sum(self._tokens) > bounds.completion_tokens),
            (CACHED_TOKENS, self._cached > bounds.cached_tokens),
        )
        return tuple(name for name, past in over if past)
