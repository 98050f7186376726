"""One client call at the front, as one object: what it asks (the method, its metadata
read once), who sent it, its record for the log and metrics, and its request once read.

Created when the stream opens; the handlers of every RPC kind take it whole, so a piece
of the call is read in one place and passed on, never fetched again from grpc.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.engines import RpcSpec
from gateway.proxy.dispatch import Context
from gateway.proxy.metadata import RequestMeta
from gateway.record import CallRecord


@dataclass(slots=True)
class Call:
    spec: RpcSpec
    context: Context
    record: CallRecord  # record.principal: who sent it (mTLS identity or API key name)
    meta: RequestMeta
    caller: str  # whose admission share it takes: the principal, else `peer:<address>`
    request: bytes = b""  # the request message, once read
