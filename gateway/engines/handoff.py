"""The PD hand-off: how an engine hands a request from its prefill to its decode.

Its own module because it is the one interface between the engines and the proxy that
runs both ways: each adapter's `Handoff` (SGLang's bootstrap rooms, vLLM's KV
parameters) drives a `PlacedPair`, which the proxy implements, each of its methods one
upstream call with all of its accounting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Protocol


class PrefillStream(Protocol):
    def drain(self) -> Awaitable[list[bytes]]:
        """Every message of the prefill's answer (read once, however often asked)."""


AmendFirst = Callable[[bytes], Awaitable[bytes]]


class PlacedPair(Protocol):
    """The prefill + decode pair placement picked, as a hand-off drives it. The proxy
    implements it: each method is one upstream call with all of its accounting."""

    raw: bytes  # the client's request (one choice's, when n>1 is split)
    prefill_host: str  # where the prefill takes KV rendezvous (its bootstrap host)
    prefill_bootstrap_port: int | None  # its configured or discovered bootstrap port
    return_logprob: bool

    def new_room(self) -> int:
        """A bootstrap room unique among requests in flight, released with the request."""

    def prefill(self, request: bytes, *, background: bool) -> PrefillStream:
        """Start the prefill leg. `background`: drained by the gateway while the decode
        runs; its failure before the decode's first message is the request's answer."""

    async def decode(self, request: bytes, amend_first: AmendFirst | None = None) -> None:
        """Start the decode leg and relay it to the client (its first message amended)."""

    def prompt_cached(self, tokens: int) -> None:
        """The prompt tokens the prefill found cached (its answer's figure), when the
        decode's answers, which the client gets, do not carry them."""

    def prefill_failed(self, reason: str, details: str) -> Exception:
        """The failure to raise when the prefill's answer cannot be handed over."""


class Handoff(ABC):
    """How one engine hands a request from its prefill to its decode."""

    @abstractmethod
    async def run(self, pair: PlacedPair) -> None:
        """Drive the pair's legs; the client gets the decode's stream."""
