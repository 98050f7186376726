"""Bounded work per request, in process (tests/component/harness): the subject is what the
front refuses before anything goes upstream, which crosses a real gRPC connection either
way. (Protection that needs processes, signals or raw HTTP/2 clients against a gateway
process: tests/e2e/test_protection.py.)"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway_sim.client import collect, model_md, sgl_generate, sgl_grpc
from tests.support.helpers import assert_verdict, rich_status
from tests.support.inproc import client, gateway, pd_urls, sim


# Serial from its start: run_alone() mid-test would block this event loop (gateway and
# workers included) while it waits; the refusal is timed.
@pytest.mark.serial
async def test_n_over_max_choices_is_refused_at_once_and_others_are_served(
    strict: bool,
) -> None:
    """n = 2^32-1 on a PD model used to split into that many prefill + decode pairs and
    stop the event loop; now it is INVALID_ARGUMENT before anything goes upstream, while
    a concurrent call to another model streams on. At once: within 1 s in the timing
    tier, else within 5 times a whole PD call of n = 1 timed here and 2 s."""
    async with (
        sim("--role", "prefill", "--model", "m") as prefill,
        sim("--role", "decode", "--model", "m") as decode,
        sim("--model", "other", "--token-ms", "5") as regular,
        gateway(*pd_urls(prefill, decode), regular.url(model="other", runtime="sglang")) as gw,
        client(gw) as ch,
    ):
        stub = sgl_grpc.SglangSchedulerStub(ch)
        started = time.monotonic()
        _, error = await collect(stub.Generate(sgl_generate("pd-1"), metadata=model_md("m")))
        assert error is None
        pd_call_s = time.monotonic() - started
        other = asyncio.ensure_future(
            collect(stub.Generate(sgl_generate("o-1", tokens=40), metadata=model_md("other")))
        )
        started = time.monotonic()
        _, error = await collect(
            stub.Generate(sgl_generate("huge", n=2**32 - 1), metadata=model_md("m"))
        )
        elapsed = time.monotonic() - started
        messages, other_error = await other
    assert elapsed < (1.0 if strict else 5 * pd_call_s + 2.0)
    assert error is not None
    message = (
        "sampling_params.n = 4294967295 is over this gateway's limit of 16 (limits.max_choices)"
    )
    assert_verdict(
        error,
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_OVER_LIMIT",
        message,
        {
            "model": "",
            "leg": "",
            "httpStatus": "400",
            "code": "request_over_limit",
            "field": "sampling_params.n",
            "limit": "16",
        },
    )
    _, details = rich_status(error)
    (violation,) = details["BadRequest"].field_violations
    assert (violation.field, violation.description) == (
        "sampling_params.n",
        "must be at most 16 (limits.max_choices)",
    )
    assert other_error is None and len(messages) == 41
