"""What a Generate request asks for (``Sampling``) and what the engine makes of it
(``Plan``: how many tokens each choice produces and how it ends, ``Finish``).

Pure: the engine checks the request in its dialect, then ``plan_for`` bounds its output
by the context, the model's own stop and the request's stop tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from gateway_sim.model import EOS_TOKEN_IDS, first_output

# Tokens made at once for an unstreamed answer before letting the loop run.
_SLICE_TOKENS = 65_536


@dataclass(frozen=True, slots=True)
class Sampling:
    """What a Generate request asks for that the simulated engine honours."""

    n: int = 1
    max_tokens: int | None = None  # None: until the model stops or the context ends
    stream: bool = True
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    temperature: float | None = None  # None: unset
    logprobs: int | None = None  # the top logprobs per output token asked for, if any
    prompt_logprobs: int | None = None  # ... per prompt token

    @property
    def choices(self) -> int:
        return max(self.n, 1)


@dataclass(frozen=True, slots=True)
class Finish:
    """How a choice ended: ``stop`` (EOS or a stop token, ``matched`` naming the token
    when the engine reports it), ``length`` or ``abort``."""

    reason: str
    matched: int | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """A request the engine took: how many tokens each choice produces and why it ends.
    Token k is ``(base + k) % vocab`` (the last one EOS when the model stops by itself),
    made when it is sent: a long output costs nothing up front."""

    count: int
    finish: Finish
    base: int
    vocab: int
    eos_last: bool = False

    def tokens(self, start: int, end: int) -> list[int]:
        base, vocab = self.base, self.vocab
        ids = [(base + k) % vocab for k in range(start, end)]
        if self.eos_last and end == self.count and ids:
            ids[-1] = EOS_TOKEN_IDS[0]
        return ids

    async def all_tokens(self, count: int | None = None) -> list[int]:
        """The first ``count`` tokens (all by default), made in slices that let the
        event loop run between them."""
        end = self.count if count is None else count
        ids: list[int] = []
        for start in range(0, end, _SLICE_TOKENS):
            if start:
                await asyncio.sleep(0)
            ids.extend(self.tokens(start, min(start + _SLICE_TOKENS, end)))
        return ids


def plan_for(
    input_ids: Sequence[int],
    sampling: Sampling,
    room: int,
    natural: int,
    vocab: int,
    names_eos: bool,
    first_token: int | None = None,
) -> Plan:
    """Each choice's tokens for a request the engine took, bounded by the ``room`` its
    context leaves; ``natural``: the tokens after which the model stops by itself,
    ``names_eos``: whether that stop names the EOS token; a PD decode's ``first_token``
    continues the output from it.

    A request that sets no maximum ends where the model stops by itself (``--tokens``,
    its last token EOS: ``stop``), or where the context ends (``length``), or never
    on EOS with ``ignore_eos``; one that does ends at its maximum (``length``). A
    stop token in the output ends it there (``stop``, the token named)."""
    stops_by_itself = sampling.max_tokens is None and not sampling.ignore_eos and natural <= room
    if stops_by_itself:
        count = natural
    elif sampling.max_tokens is None:
        count = room
    else:
        count = min(sampling.max_tokens, room)
    base = first_output(input_ids) if first_token is None else first_token
    finish = Finish("length")
    if stops_by_itself:
        finish = Finish("stop", EOS_TOKEN_IDS[0] if names_eos else None)
    # The output repeats every `vocab` tokens: a stop token's first place is known.
    limit = count - 1 if stops_by_itself else count
    places = [(stop - base) % vocab for stop in sampling.stop_token_ids if 0 <= stop < vocab]
    first_stop = min((k for k in places if k < limit), default=None)
    if first_stop is not None:
        count, stops_by_itself = first_stop + 1, False
        finish = Finish("stop", (base + first_stop) % vocab)
    return Plan(count, finish, base, vocab, stops_by_itself)
