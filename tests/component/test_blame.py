"""A failure the gateway's own channel makes (metadata grpc refuses to send) is never the
worker's: it neither counts towards ejecting it nor decides a half-open trial."""

from __future__ import annotations

import grpc
import pytest

from gateway.core.roles import Role
from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.upstream import Outbound
from gateway.upstream.signals.outlier import OutlierState
from gateway_sim.client import SGL, sgl_generate
from tests.support.inproc import gateway, idle, sim, worker


class Nowhere:
    delivered = False

    async def headers(self, metadata: object, *, always: bool = False) -> None:
        return None

    async def write(self, message: bytes) -> None:
        raise AssertionError("nothing to relay")

    def trailers(self, metadata: object) -> None:
        return None

    def prompt_cached(self, tokens: int) -> None:
        return None


async def test_the_gateways_own_channel_failure_is_not_the_workers() -> None:
    async with sim("--model", "m") as w, gateway(w.url(model="m", runtime="sglang")) as gw:
        target = worker(gw, w)
        request = sgl_generate("r").SerializeToString()
        for _ in range(2 * gw.config.outlier_detection.failure_threshold):
            reservation = gw.parts.upstreams.reserve(target)
            outbound = Outbound(SGL + "Generate", request, (("x-odd", "café"),), 5.0, True)
            with gw.parts.upstreams.call(reservation, Role.REGULAR, outbound) as call:
                with pytest.raises(UpstreamFailure) as failed:
                    await call.first(Nowhere())
                assert failed.value.code is grpc.StatusCode.INTERNAL
                assert failed.value.details == "Invalid metadata"
        await idle(gw)
        assert target.outlier.state is OutlierState.CLOSED
        assert target.outlier.failures == 0
