"""An engine service's RPC table, as the front reads it: each RPC's kind and spec.

Its own module because the table is read far from the adapters that build it (the
fronts, the picker, the call, the stages): `RpcKind` says how the front treats an RPC,
`RpcSpec` its path, streaming and message classes (`MessageClass`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message


class RpcKind(Enum):
    """How the front treats one RPC of an engine service."""

    GENERATE = "generate"  # placed per request, server-streaming, relayed
    EMBED = "embed"  # placed per request, unary
    ABORT = "abort"  # routed to the workers holding the request id
    HEALTH_CHECK = "health_check"  # answered from the gateway's own state
    FORWARD_ONE = "forward_one"  # fleet-wide facts: any one available worker answers
    FAN_OUT = "fan_out"  # per-worker admin: every worker of the model, answers merged


class MessageClass(Protocol):
    """A generated message class as the gateway uses it: its messages are made with
    their fields as keywords (the protobuf stubs type `Message()` as taking none)."""

    DESCRIPTOR: Descriptor

    def __call__(self, **fields: Any) -> Message: ...

    def FromString(self, s: bytes) -> Message: ...


@dataclass(frozen=True, slots=True)
class RpcSpec:
    name: str
    path: str  # "/package.Service/Method"
    kind: RpcKind
    server_streaming: bool
    request_type: MessageClass
    response_type: MessageClass
