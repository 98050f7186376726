"""Verdicts become Trailers-Only statuses with rich details and plain trailers."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from gateway.core import verdicts
from gateway.core.verdicts import Reason
from gateway.proxy.aborts import named
from gateway.proxy.metadata import clean, read_request_meta
from gateway.proxy.status import DOMAIN, verdict_trailers


def decode(
    trailers: tuple[tuple[str, str | bytes], ...],
) -> tuple[dict[str, str | bytes], status_pb2.Status]:
    plain = dict(trailers)
    raw = plain.pop("grpc-status-details-bin")
    assert isinstance(raw, bytes)
    return plain, status_pb2.Status.FromString(raw)


@pytest.mark.parametrize(
    ("reason", "code", "http", "error_code", "retryable", "pushback"),
    [
        (Reason.MODEL_NOT_FOUND, grpc.StatusCode.NOT_FOUND, 404, "model_not_found", False, False),
        (Reason.LEG_NOT_DEPLOYED, grpc.StatusCode.NOT_FOUND, 404, "leg_not_deployed", False, False),
        (
            Reason.NO_COMPATIBLE_PAIR,
            grpc.StatusCode.NOT_FOUND,
            404,
            "no_compatible_pair",
            False,
            False,
        ),
        (
            Reason.WORKERS_UNAVAILABLE,
            grpc.StatusCode.UNAVAILABLE,
            503,
            "no_available_workers",
            True,
            True,
        ),
        (Reason.POLICY_DECLINED, grpc.StatusCode.UNAVAILABLE, 503, "policy_declined", True, False),
        (
            Reason.WORKERS_OVERLOADED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            429,
            "workers_overloaded",
            True,
            True,
        ),
        (
            Reason.MODEL_REQUIRED,
            grpc.StatusCode.INVALID_ARGUMENT,
            400,
            "model_required",
            False,
            False,
        ),
        (
            Reason.GATEWAY_OVERLOADED,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            429,
            "gateway_overloaded",
            True,
            True,
        ),
        (
            Reason.REQUEST_OVER_LIMIT,
            grpc.StatusCode.INVALID_ARGUMENT,
            400,
            "request_over_limit",
            False,
            False,
        ),
    ],
)
def test_reason_table_is_the_contract(
    reason: Reason,
    code: grpc.StatusCode,
    http: int,
    error_code: str,
    retryable: bool,
    pushback: bool,
) -> None:
    assert (reason.code, reason.http_status, reason.error_code) == (code, http, error_code)
    assert (reason.retryable, reason.pushback) == (retryable, pushback)


def test_unavailable_carries_retry_info_pushback_and_retry_after() -> None:
    verdict = verdicts.workers_unavailable("m", "decode", 2, retry_after_ms=1500)
    plain, status = decode(verdict_trailers(verdict))
    assert plain == {"x-http-status": "503", "retry-after": "2", "grpc-retry-pushback-ms": "1500"}
    assert status.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert status.message == verdict.message
    info, retry = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info) and status.details[1].Unpack(retry)
    assert info.reason == "WORKERS_UNAVAILABLE"
    assert info.domain == DOMAIN
    assert dict(info.metadata) == {
        "model": "m",
        "leg": "decode",
        "httpStatus": "503",
        "code": "no_available_workers",
    }
    assert retry.retry_delay.ToMilliseconds() == 1500


def test_policy_declined_has_retry_info_but_no_pushback() -> None:
    plain, status = decode(
        verdict_trailers(verdicts.policy_declined("m", "regular", "manual", 1000))
    )
    assert plain == {"x-http-status": "503", "retry-after": "1"}
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    assert info.metadata["policy"] == "manual"
    assert len(status.details) == 2


def test_permanent_verdicts_have_no_retry_hints() -> None:
    plain, status = decode(verdict_trailers(verdicts.leg_not_deployed("m", "encode")))
    assert plain == {"x-http-status": "404"}
    assert len(status.details) == 1


def test_metadata_hygiene_and_hints() -> None:
    incoming = (
        ("x-gateway-model-name", "fallback"),
        ("x-model-id", "m"),
        ("user-agent", "grpc-python"),
        ("grpc-accept-encoding", "gzip"),
        ("te", "trailers"),
        ("traceparent", "00-abc-def-01"),
        ("x-routing-key", "session-1"),
        ("x-blob-bin", b"\x00\x01"),
    )
    meta = read_request_meta(
        incoming, ("x-model-id", "x-gateway-model-name"), "x-routing-key", "x-target-worker"
    )
    assert meta.model == "m"  # x-model-id wins over the alias whatever the order
    assert meta.hints.routing_key == "session-1"
    assert meta.hints.target_worker is None
    assert [k for k, _ in meta.forward] == [
        "x-gateway-model-name",
        "x-model-id",
        "traceparent",
        "x-routing-key",
        "x-blob-bin",
    ]
    assert clean((("grpc-status", "0"), ("x-a", "1"), (":path", "/x"))) == (("x-a", "1"),)


def test_a_request_over_a_limit_carries_a_bad_request_field_violation() -> None:
    verdict = verdicts.over_limit("m", "sampling_params.n", 17, 16, "limits.max_choices")
    plain, status = decode(verdict_trailers(verdict))
    assert plain == {"x-http-status": "400"}
    assert (
        status.message
        == "sampling_params.n = 17 is over this gateway's limit of 16 (limits.max_choices)"
    )
    info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    assert status.details[0].Unpack(info) and status.details[1].Unpack(bad)
    assert info.reason == "REQUEST_OVER_LIMIT"
    assert dict(info.metadata)["field"] == "sampling_params.n"
    assert [(v.field, v.description) for v in bad.field_violations] == [
        ("sampling_params.n", "must be at most 16 (limits.max_choices)")
    ]
    assert len(status.details) == 2  # no RetryInfo: the same request fails the same way


def test_a_client_supplied_model_name_is_repeated_at_most_256_characters() -> None:
    """A 7 KiB model name must not come back three times in the trailers (21 KB made the
    client see RESOURCE_EXHAUSTED instead of the NOT_FOUND it was sent)."""
    name = "x" * 7 * 1024
    verdict = verdicts.model_not_found(name, "S", [])
    assert verdict.message == f"Model '{'x' * 256}...' is not served by any worker"
    assert verdict.model == "x" * 256 + "..."
    total = sum(len(k) + len(v) for k, v in verdict_trailers(verdict))
    assert total < 2048


def test_abort_answers_repeat_a_few_bounded_ids() -> None:
    assert named(["a"]) == "'a'"
    many = named([f"id-{i}" for i in range(20)])
    assert many.endswith("'id-7' and 12 more") and "'id-8'" not in many
    assert len(named(["x" * 100_000])) < 300
