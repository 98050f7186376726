"""With --processes N, the supervisor's SetRoute reaches every serving process, a refusal
is told as the processes told it, and a restarted process is given the last route."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
import pytest
from grpc import aio

from gateway.admin.v1 import admin_pb2 as pb
from gateway.config import build_config
from gateway.scale.control import ControlPlane
from gateway.scale.desired import DesiredFleet, reconcile


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Refused(code, details)


@dataclass
class Process:
    """One serving process's admin API, as far as routes go."""

    refuse: grpc.StatusCode | None = None
    routes: dict[str, pb.SetRouteRequest] = field(default_factory=dict)
    running: bool = True

    @property
    def admin(self) -> Process:
        return self

    async def SetRoute(self, request: pb.SetRouteRequest, **_: Any) -> pb.SetRouteResponse:
        if self.refuse is not None:
            raise aio.AioRpcError(self.refuse, aio.Metadata(), aio.Metadata(), "no")
        self.routes[request.alias] = request
        return pb.SetRouteResponse(route=pb.Route(alias=request.alias, targets=request.targets))

    async def ListRoutes(self, request: pb.ListRoutesRequest, **_: Any) -> pb.ListRoutesResponse:
        routes = [pb.Route(alias=a, targets=r.targets) for a, r in self.routes.items()]
        return pb.ListRoutesResponse(routes=routes)

    async def ListWorkers(self, request: pb.ListWorkersRequest, **_: Any) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse()


REQUEST = pb.SetRouteRequest(alias="chat", targets=[pb.RouteTarget(model="v3", weight=1)])


def plane(*processes: Process) -> tuple[ControlPlane, DesiredFleet]:
    config = build_config()
    desired = DesiredFleet.of(config)
    return ControlPlane(config, desired, lambda: processes), desired


async def test_set_route_reaches_every_process_and_a_restarted_one() -> None:
    first, second = Process(), Process()
    control, desired = plane(first, second)
    answer = await control.SetRoute(REQUEST, Context())
    assert answer.route.alias == "chat"
    assert first.routes == second.routes == {"chat": REQUEST}
    listed = await control.ListRoutes(pb.ListRoutesRequest(), Context())
    assert [r.alias for r in listed.routes] == ["chat"]
    restarted = Process()
    await reconcile(restarted, desired, 1)
    assert restarted.routes == {"chat": REQUEST}


async def test_a_refusal_is_told_as_the_processes_told_it() -> None:
    control, desired = plane(Process(refuse=grpc.StatusCode.NOT_FOUND))
    with pytest.raises(Refused) as refused:
        await control.SetRoute(REQUEST, Context())
    assert refused.value.code is grpc.StatusCode.NOT_FOUND
    assert desired.routes == {}
