"""One client call at the front, as one object: what it asks (the method, its metadata
read once), who sent it, its record for the log and metrics, its request once read, and
each placement made for it with its reservations.

Created when the stream opens; the handlers of every RPC kind take it whole, so a piece
of the call is read in one place and passed on, never fetched again from grpc.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from grpc import aio

from gateway.engines import RpcSpec
from gateway.observability.record import CallRecord
from gateway.observability.tracing import CallTrace
from gateway.proxy.metadata import RequestMeta
from gateway.proxy.upstream import Reserved

Context: TypeAlias = aio.ServicerContext  # grpc ships no type hints: Any to mypy


@dataclass(slots=True)
class Call:
    spec: RpcSpec
    context: Context
    record: CallRecord  # record.principal: who sent it (mTLS identity or API key name)
    meta: RequestMeta
    caller: str  # whose admission share it takes: the principal, else `peer:<address>`
    request: bytes = b""  # the request message, once read
    # Every placement, in order (a retry's, each choice's of n>1), with its reservations:
    # written by dispatch only, as it places.
    placements: list[Reserved] = field(default_factory=list)
    trace: CallTrace | None = None  # tracing on: its spans (the front starts and ends them)
