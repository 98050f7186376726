"""Helpers the end-to-end tests share beyond the client's (gateway_sim.client): rich-status
decoding, the gateway's request log, a placement verdict's checks."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc import aio

from gateway_sim.client import POLL_S, trailers
from tests.support.waits import WAIT_S

# A simulated SGLang worker ends an aborted stream with a Complete `abort` (as vLLM does),
# for a test that waits on that end: a real SGLang worker's stream gets nothing more.
ABORT_COMPLETES = ("x-sim-abort-completes", "1")


def rich_status(error: aio.AioRpcError) -> tuple[status_pb2.Status, dict[str, Any]]:
    """Decode grpc-status-details-bin: the Status and its details by type name."""
    raw = trailers(error)["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(raw)
    details: dict[str, Any] = {}
    for packed in status.details:
        for kind in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.RetryInfo,
            error_details_pb2.BadRequest,
        ):
            if packed.Is(kind.DESCRIPTOR):
                message = kind()
                packed.Unpack(message)
                details[kind.DESCRIPTOR.name] = message
    return status, details


def logged_events(log_path: Path, name: str) -> list[dict[str, Any]]:
    """The gateway's log events called `name` (its JSON lines)."""
    events = []
    for line in log_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == name:
            events.append(event)
    return events


def request_events(log_path: Path, rpc: str | None = None) -> Sequence[dict[str, Any]]:
    """The gateway's per-request log events (JSON lines)."""
    return [e for e in logged_events(log_path, "request") if rpc is None or e.get("rpc") == rpc]


def wait_for_events(
    log_path: Path, count: int, rpc: str | None = None, request_id: str | None = None
) -> Sequence[dict[str, Any]]:
    """The request events once at least `count` are logged (the log line follows the reply).

    `request_id` picks one request's events out of a log that several tests share.
    """

    def matching() -> list[dict[str, Any]]:
        events = request_events(log_path, rpc)
        return [e for e in events if request_id is None or e.get("request_id") == request_id]

    deadline = time.monotonic() + WAIT_S
    events = matching()
    while len(events) < count and time.monotonic() < deadline:
        time.sleep(POLL_S)
        events = matching()
    assert len(events) >= count, f"expected {count} request events, got {events}"
    return events


def assert_verdict(
    error: aio.AioRpcError,
    code: grpc.StatusCode,
    reason: str,
    message: str,
    metadata: dict[str, str],
    *,
    retry_s: int | None = None,
    pushback_ms: int | None = None,
    retry_ms_exact: bool = False,
) -> None:
    """A placement verdict: code, message, ErrorInfo, RetryInfo and the plain trailers
    (`retry_ms_exact`: RetryInfo is `pushback_ms` to the millisecond, `retry-after` its
    seconds rounded up)."""
    assert error.code() is code
    assert error.details() == message
    status, details = rich_status(error)
    assert status.code == code.value[0]
    assert status.message == message
    info = details["ErrorInfo"]
    assert info.reason == reason
    assert info.domain == "model-gateway.grpc"
    assert dict(info.metadata) == metadata
    plain = trailers(error)
    assert plain["x-http-status"] == metadata["httpStatus"]
    if retry_s is None:
        assert "RetryInfo" not in details
        assert "retry-after" not in plain
    else:
        delay_ms = details["RetryInfo"].retry_delay.ToMilliseconds()
        assert delay_ms == (pushback_ms if retry_ms_exact else retry_s * 1000)
        assert plain["retry-after"] == str(retry_s)
    if pushback_ms is None:
        assert "grpc-retry-pushback-ms" not in plain
    else:
        assert plain["grpc-retry-pushback-ms"] == str(pushback_ms)
