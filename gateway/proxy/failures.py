"""Upstream failures: the one failure type of every upstream path, and whose fault one is.

A module of its own because far more reads a failure than raises one (dispatch's
retries, the legs, migration, the client's ending): which failures another worker may
take, which are the client's own deadline or the gateway's channel (no worker's fault),
and how a failure names its worker.
"""

from __future__ import annotations

import grpc

from gateway.core.roles import Role
from gateway.proxy.metadata import Metadata
from gateway.upstream.worker import Worker

# Before the first message, these say the worker could not take the call: no connection,
# UNAVAILABLE, or CANCELLED by the worker itself (a gRPC server shutting down cancels calls
# that arrive as it stops; the client's own cancel never reaches this code as a status).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
# The cause of a failure the gateway makes of a worker's answer that does not decode where
# it must be read (a continuation's, rewritten for its client): INTERNAL, the worker's.
UNDECODABLE = "undecodable"

# Failures the gateway's own channel makes before anything reaches the worker: grpc core
# refusing metadata the gateway built. They say nothing about the worker (the front
# refuses such metadata first; this keeps any that slips through out of outlier detection).
LOCAL_FAILURES = frozenset({(grpc.StatusCode.INTERNAL, "Invalid metadata")})

# An upstream DEADLINE_EXCEEDED this close to the client's own deadline (which the call
# carries) is the client's deadline: it says nothing about the worker.
CLIENT_DEADLINE_SLACK_S = 0.05


def clients_deadline(left_s: float | None) -> bool:
    """Whether a call with `left_s` of its deadline left (None: it has none) ends by the
    client's own deadline: the one rule that keeps it from being any worker's fault."""
    return left_s is not None and left_s <= CLIENT_DEADLINE_SLACK_S


class UpstreamFailure(Exception):
    """An upstream call failed: the one failure type of every path.

    `label` names the worker in the message where the client could not otherwise tell
    which of several calls failed ("decode worker HOST:PORT"); a lone forwarded call
    passes the worker's own message through unchanged.
    """

    def __init__(
        self,
        leg: Role,
        worker: Worker,
        code: grpc.StatusCode,
        details: str,
        trailers: Metadata = (),
        label: str = "",
        cause: str = "",
    ) -> None:
        self.leg, self.worker, self.code = leg, worker, code
        self.details, self.trailers, self.label = details, trailers, label
        self.cause = cause  # why, when the status alone does not say (`worker_removed`)
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"{self.label}: {self.details}" if self.label else self.details


def retryable(failure: UpstreamFailure) -> bool:
    """Whether another worker may take the call when nothing reached the client yet: the
    worker's connection or shutdown, or an answer of its that did not decode."""
    return failure.code in RETRYABLE or failure.cause == UNDECODABLE


def label(worker: Worker) -> str:
    """How a failure names a worker when the call went to several."""
    role = "" if worker.role is Role.REGULAR else f"{worker.role.value} "
    return f"{role}worker {worker.id}"
