"""The gateway's own load on every engine call's trailers: ORCA's in-band report, the
`endpoint-load-metrics-bin` trailer that Envoy's and gRPC's weighted round robin read.

A call ends in one of three ways, and each must carry the report once:
- its handler returns (an answer; trailers relayed from the worker, or none);
- it aborts with a status of its own (a placement verdict, a relayed upstream failure,
  an authentication, read or idle refusal), sent at once by grpc, Trailers-Only when no
  message went out;
- its handler raises (grpc answers UNKNOWN with the trailers set so far).

grpc sends the trailers it holds when the call ends, from `set_trailing_metadata` or from
`abort`'s argument, whichever came last. So the front wraps a call's context in
`OrcaContext`, which keeps the trailers the code sets and adds the report to them exactly
once, as the call ends, whichever way it ends. A worker's own load trailer is dropped
from what is relayed: the balancer in front weighs gateway replicas, and the one trailer
of that name must describe this one.

The report is serialized elsewhere (gateway.orca), at most every refresh period, never
per call: a call only takes the cached trailer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NoReturn, Protocol

import grpc

from gateway.proxy.context import Context
from gateway.proxy.metadata import Metadata

LOAD_TRAILER = "endpoint-load-metrics-bin"


class OrcaTrailer(Protocol):
    def trailer(self) -> tuple[str, bytes]:
        """(LOAD_TRAILER, the serialized report): current within its refresh period."""


class OrcaContext:
    """A call's context whose trailers end with the load report, however the call ends.
    Everything but the trailers goes to the context as it is; the methods a call uses
    per message are bound once here, so they cost what the context's own do."""

    __slots__ = (
        "_context",
        "_ended",
        "_load",
        "_trailers",
        "invocation_metadata",
        "peer",
        "read",
        "send_initial_metadata",
        "time_remaining",
        "write",
    )

    def __init__(self, context: Context, load: OrcaTrailer) -> None:
        self._context = context
        self._load = load
        self._trailers: Metadata = ()
        self._ended = False
        self.write = context.write
        self.read = context.read
        self.send_initial_metadata = context.send_initial_metadata
        self.time_remaining = context.time_remaining
        self.invocation_metadata = context.invocation_metadata
        self.peer = context.peer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def auth_context(self) -> Mapping[str, Sequence[bytes]]:
        return self._context.auth_context()

    def code(self) -> grpc.StatusCode | int | None:
        return self._context.code()

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        """Kept until the call ends (`end`), when they go out with the report."""
        self._trailers = metadata

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()
    ) -> NoReturn:
        """As grpc's: the trailers given, else those set before; the report after them."""
        self._ended = True
        trailers = self._with_load(trailing_metadata or self._trailers)
        await self._context.abort(code, details, trailers)
        raise AssertionError("unreachable: abort raises")

    def end(self) -> None:
        """The handler returns or raises: its trailers, and the report, are set for grpc
        to send (nothing more once the call aborted: its status went out then)."""
        if not self._ended:
            self._ended = True
            self._context.set_trailing_metadata(self._with_load(self._trailers))

    def _with_load(self, trailers: Metadata) -> Metadata:
        load = self._load.trailer()
        if not trailers:
            return (load,)
        return (*[kv for kv in trailers if kv[0] != LOAD_TRAILER], load)
