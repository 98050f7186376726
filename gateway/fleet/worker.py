"""A worker as the gateway sees it: identity, status, channel and in-flight count."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from grpc import aio

from gateway.config import WorkerSpec
from gateway.roles import Role, Runtime


class WorkerStatus(StrEnum):
    """`pending` until first seen healthy; only `ready` workers are routable."""

    PENDING = "pending"
    READY = "ready"
    NOT_READY = "not_ready"
    DRAINING = "draining"


@dataclass(eq=False, slots=True)
class Worker:
    """One registered worker. Identity is its address; everything else is live state."""

    spec: WorkerSpec
    model: str
    runtime: Runtime
    channel: aio.Channel
    status: WorkerStatus = WorkerStatus.PENDING
    inflight: int = 0
    status_cause: str = "not yet connected"
    requests: int = field(default=0)

    @property
    def id(self) -> str:
        return self.spec.address

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def available(self) -> bool:
        return self.status is WorkerStatus.READY

    def __repr__(self) -> str:
        return f"Worker({self.id} {self.runtime}/{self.model}/{self.role} {self.status})"
