"""Turning verdicts and upstream failures into the gRPC status a client receives.

A verdict travels as a Trailers-Only response: `grpc-status-details-bin` carries a
`google.rpc.Status` with `ErrorInfo` (and `RetryInfo` when retrying can help), and plain
`x-http-status` / `retry-after` / `grpc-retry-pushback-ms` trailers let header-based
tooling (grpcurl -v, meshes) act on it without decoding anything.
"""

from __future__ import annotations

import math
from typing import NoReturn, TypeAlias

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc import aio

from gateway.core.verdicts import Verdict

DOMAIN = "model-gateway.grpc"

Trailers = tuple[tuple[str, str | bytes], ...]


Detail: TypeAlias = (
    error_details_pb2.ErrorInfo | error_details_pb2.RetryInfo | error_details_pb2.BadRequest
)


def _packed(message: Detail) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def verdict_trailers(verdict: Verdict) -> Trailers:
    reason = verdict.reason
    info = error_details_pb2.ErrorInfo(
        reason=reason.name,
        domain=DOMAIN,
        metadata={
            "model": verdict.model,
            "leg": verdict.leg,
            "httpStatus": str(reason.http_status),
            "code": reason.error_code,
            **verdict.extra,
        },
    )
    details = [_packed(info)]
    if verdict.violation is not None:
        path, description = verdict.violation
        violation = error_details_pb2.BadRequest.FieldViolation(field=path, description=description)
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    trailers: list[tuple[str, str | bytes]] = [("x-http-status", str(reason.http_status))]
    if reason.retryable:
        delay = duration_pb2.Duration()
        delay.FromMilliseconds(verdict.retry_after_ms)
        details.append(_packed(error_details_pb2.RetryInfo(retry_delay=delay)))
        trailers.append(("retry-after", str(max(1, math.ceil(verdict.retry_after_ms / 1000)))))
        if reason.pushback:
            trailers.append(("grpc-retry-pushback-ms", str(verdict.retry_after_ms)))
    status = status_pb2.Status(code=reason.code.value[0], message=verdict.message, details=details)
    trailers.append(("grpc-status-details-bin", status.SerializeToString()))
    return tuple(trailers)


async def abort_with_verdict(context: aio.ServicerContext, verdict: Verdict) -> NoReturn:
    await context.abort(verdict.reason.code, verdict.message, verdict_trailers(verdict))
    raise AssertionError("unreachable: abort raises")


async def abort_invalid(context: aio.ServicerContext, message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message, (("x-http-status", "400"),))
    raise AssertionError("unreachable: abort raises")
