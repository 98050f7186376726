"""Several serving processes: their shares, rooms, the held port, and the control plane's
decisions (fan-out, all-or-nothing add, merged lists, catching a restarted process up)."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio

from gateway.admin.v1 import admin_pb2 as pb
from gateway.cli.main import build_parser, config_from_args
from gateway.config import ConfigError, build_config, parse_processes, usable_cores
from gateway.core.listen import CannotListen
from gateway.proxy.legs import MAX_ROOM, BootstrapRooms
from gateway.scale.control import ControlPlane, merge_workers
from gateway.scale.desired import DesiredFleet, reconcile
from gateway.scale.member import Member, serving_config
from gateway.scale.port import hold_port
from tests.support.fakes.context import Aborted, FakeContext

# ------------------------------------------------------------------ member and config


def test_a_member_knows_its_control_socket_and_its_siblings() -> None:
    member = Member(1, 3, "/run/gw")
    assert member.control_address() == "unix:/run/gw/p1.sock"
    assert member.siblings() == ["unix:/run/gw/p0.sock", "unix:/run/gw/p2.sock"]


@pytest.mark.parametrize(
    ("limit", "count", "share"), [(4096, 2, 2048), (5, 2, 3), (1, 4, 1), (7, 1, 7)]
)
def test_a_gateway_wide_limit_is_shared_rounding_up(limit: int, count: int, share: int) -> None:
    assert Member(0, count, "/d").share(limit) == share


def test_a_serving_process_runs_with_its_share_and_the_supervisors_port() -> None:
    config = build_config(
        {
            "listen": "0.0.0.0:0",
            "limits": {"max_inflight_requests": 5},
            "models": {"a": {"max_inflight": 1}, "b": {"max_inflight": 9}, "c": {}},
            "admin": {"listen": "127.0.0.1:50052", "token": "secret"},
            "tenants": {
                "t": {"max_inflight": 3, "requests_per_minute": 601, "tokens_per_minute": 10},
                "u": {"weight": 2.0},
            },
        },
        worker_urls=["grpc://w:1?model=a&runtime=sglang"],
    )
    added = build_config(worker_urls=["grpc://x:2?model=a&runtime=sglang"]).workers
    member = Member(1, 2, "/run/gw")
    served = serving_config(config, member, 4242, added)
    assert served.listen == "0.0.0.0:4242"
    assert [w.address for w in served.workers] == ["x:2"]
    assert served.limits.max_inflight_requests == 3
    assert {name: m.max_inflight for name, m in served.models.items()} == {
        "a": 1,  # at most count - 1 over the limit in total
        "b": 5,
        "c": None,
    }
    t, u = served.tenants["t"], served.tenants["u"]
    assert (t.max_inflight, t.requests_per_minute, t.tokens_per_minute) == (2, 301, 5)
    assert (u.max_inflight, u.requests_per_minute, u.weight) == (None, None, 2.0)
    assert (served.admin.listen, served.admin.token) == ("unix:/run/gw/p1.sock", None)
    assert served.metrics.listen is None and served.processes == 1
    assert served.max_attempts == config.max_attempts  # everything else as configured


def test_processes_is_a_count_or_auto() -> None:
    assert parse_processes("auto") == min(usable_cores(), 64)
    assert parse_processes(3) == 3 and parse_processes("2") == 2
    assert build_config({"processes": 4}).processes == 4
    assert build_config().processes == 1
    args = build_parser().parse_args(["serve", "--processes", "2"])
    assert config_from_args(args).processes == 2


@pytest.mark.parametrize(
    ("cpu_max", "v1", "cores"),
    [
        ("150000 100000\n", None, 2),  # a CPU limit of 1.5 rounds up
        ("100000 100000\n", None, 1),
        ("max 100000\n", None, None),  # no limit: the affinity
        (None, ("200000", "100000"), 2),  # cgroup v1
        (None, ("-1", "100000"), None),
        (None, None, None),  # no cgroup files at all
        ("garbage", None, None),
    ],
)
def test_auto_counts_a_containers_cpu_limit(
    tmp_path: Path, cpu_max: str | None, v1: tuple[str, str] | None, cores: int | None
) -> None:
    v2_file, v1_dir = tmp_path / "cpu.max", tmp_path / "cpu"
    if cpu_max is not None:
        v2_file.write_text(cpu_max)
    if v1 is not None:
        v1_dir.mkdir()
        (v1_dir / "cpu.cfs_quota_us").write_text(v1[0] + "\n")
        (v1_dir / "cpu.cfs_period_us").write_text(v1[1] + "\n")
    affinity = len(os.sched_getaffinity(0))
    expected = min(affinity, cores) if cores is not None else affinity
    assert usable_cores(v2_file, v1_dir) == expected


@pytest.mark.parametrize("value", [0, 65, "x", True, 2.5, "-1", None])
def test_a_bad_process_count_is_one_line(value: Any) -> None:
    with pytest.raises(ConfigError) as error:
        build_config({"processes": value})
    assert str(error.value) == f"processes must be auto or 1..64, not {value!r}"


# ------------------------------------------------------------------ rooms


def test_each_process_takes_only_its_own_rooms() -> None:
    """Rooms of process i of n are i mod n: no two processes ever pick the same room."""
    taken = [
        BootstrapRooms(random.Random(seed), index=i, count=3) for i, seed in enumerate((1, 1, 1))
    ]
    rooms = [[r.allocate() for _ in range(500)] for r in taken]
    for index, mine in enumerate(rooms):
        assert {room % 3 for room in mine} == {index}
        assert len(set(mine)) == 500
        assert all(0 <= room <= MAX_ROOM for room in mine)


def test_the_highest_room_stays_an_int32() -> None:
    class Top(random.Random):
        def randint(self, a: int, b: int) -> int:
            return b

    for index in range(3):
        assert BootstrapRooms(Top(), index=index, count=3).allocate() <= MAX_ROOM


# ------------------------------------------------------------------ the held port


def test_the_held_port_admits_only_sockets_that_share_it() -> None:
    holder, port = hold_port("127.0.0.1:0")
    try:
        assert port > 0
        plain = socket.socket()
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        plain.close()
        sharing = socket.socket()
        sharing.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sharing.bind(("127.0.0.1", port))
        sharing.listen()
        sharing.close()
    finally:
        holder.close()


@pytest.mark.parametrize("reuseport", [False, True])
def test_a_port_someone_listens_on_is_refused(reuseport: bool) -> None:
    busy = socket.socket()
    if reuseport:  # even a listener that would share: it is not ours
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    address = f"127.0.0.1:{busy.getsockname()[1]}"
    try:
        with pytest.raises(CannotListen) as error:
            hold_port(address)
        assert str(error.value) == f"cannot listen on {address}: Address already in use"
    finally:
        busy.close()


# ------------------------------------------------------------------ control plane


def worker(
    wid: str, inflight: int = 0, status: pb.WorkerStatus = pb.WORKER_STATUS_READY
) -> pb.Worker:
    return pb.Worker(id=wid, model="m", inflight=inflight, status=status)


def test_a_merged_list_shows_each_worker_once_with_inflight_summed() -> None:
    first = [worker("b:1", 2, pb.WORKER_STATUS_READY), worker("a:1", 1)]
    second = [worker("b:1", 3, pb.WORKER_STATUS_NOT_READY), worker("c:1", 4)]
    merged = merge_workers([first, second])
    assert [(w.id, w.inflight, w.status) for w in merged] == [
        ("a:1", 1, pb.WORKER_STATUS_READY),
        ("b:1", 5, pb.WORKER_STATUS_READY),  # as the first process sees it
        ("c:1", 4, pb.WORKER_STATUS_READY),
    ]
    assert first[0].inflight == 2  # the answers themselves are not changed


def rpc_error(code: grpc.StatusCode, details: str) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details)


@dataclass
class FakeAdmin:
    """One serving process's admin API: records calls, answers from its worker list."""

    workers: dict[str, pb.Worker] = field(default_factory=dict)
    fail_add: aio.AioRpcError | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)

    async def AddWorker(self, request: pb.AddWorkerRequest, **_: Any) -> pb.AddWorkerResponse:
        self.calls.append(("add", request.url))
        if self.fail_add is not None:
            raise self.fail_add
        wid = request.url.removeprefix("grpc://").partition("?")[0]
        self.workers[wid] = worker(wid)
        return pb.AddWorkerResponse(worker=self.workers[wid])

    async def RemoveWorker(
        self, request: pb.RemoveWorkerRequest, **_: Any
    ) -> pb.RemoveWorkerResponse:
        self.calls.append(("remove", request.worker_id))
        gone = self.workers.pop(request.worker_id, None)
        if gone is None:
            raise rpc_error(grpc.StatusCode.NOT_FOUND, "no such worker")
        return pb.RemoveWorkerResponse(worker=gone, drained=True)

    async def DrainWorker(self, request: pb.DrainWorkerRequest, **_: Any) -> pb.DrainWorkerResponse:
        self.calls.append(("drain", request.worker_id))
        seen = self.workers[request.worker_id]
        seen.status = pb.WORKER_STATUS_DRAINING
        return pb.DrainWorkerResponse(worker=seen, drained=seen.inflight == 0)

    async def ListWorkers(self, request: pb.ListWorkersRequest, **_: Any) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(workers=list(self.workers.values()))


URL = "grpc://127.0.0.1:7001?model=m&runtime=sglang"


@dataclass
class FakeProcess:
    admin: FakeAdmin
    running: bool = True


def plane(
    *admins: FakeAdmin, workers: tuple[str, ...] = (), dead: int | None = None
) -> tuple[ControlPlane, DesiredFleet]:
    config = build_config(worker_urls=[f"grpc://{w}?model=m&runtime=sglang" for w in workers])
    desired = DesiredFleet.of(config)
    processes = [FakeProcess(a, running=i != dead) for i, a in enumerate(admins)]
    return ControlPlane(config, desired, lambda: processes), desired


async def test_an_add_reaches_every_process_and_the_desired_fleet() -> None:
    admins = FakeAdmin(), FakeAdmin()
    control, desired = plane(*admins)
    reply = await control.AddWorker(pb.AddWorkerRequest(url=URL), FakeContext())
    assert reply.worker.id == "127.0.0.1:7001"
    assert [a.calls for a in admins] == [[("add", URL)], [("add", URL)]]
    assert list(desired.specs) == ["127.0.0.1:7001"] and desired.urls["127.0.0.1:7001"] == URL
    with pytest.raises(Aborted) as again:
        await control.AddWorker(pb.AddWorkerRequest(url=URL), FakeContext())
    assert (again.value.code, again.value.details) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "worker 127.0.0.1:7001 is already registered",
    )


async def test_an_add_one_process_refuses_is_undone_everywhere() -> None:
    refused = rpc_error(grpc.StatusCode.UNAVAILABLE, "worker did not tell its model")
    ok, failing = FakeAdmin(), FakeAdmin(fail_add=refused)
    control, desired = plane(ok, failing)
    with pytest.raises(Aborted) as error:
        await control.AddWorker(pb.AddWorkerRequest(url=URL), FakeContext())
    assert (error.value.code, error.value.details) == (
        grpc.StatusCode.UNAVAILABLE,
        "worker did not tell its model",
    )
    assert ok.workers == {} and ("remove", "127.0.0.1:7001") in ok.calls
    assert desired.specs == {} and desired.urls == {}


async def test_a_process_that_died_meanwhile_does_not_fail_an_add() -> None:
    """Its error is left out: it restarts from the desired fleet, which has the worker."""
    gone = rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    ok, dying = FakeAdmin(), FakeAdmin(fail_add=gone)
    control, desired = plane(ok, dying, dead=1)
    reply = await control.AddWorker(pb.AddWorkerRequest(url=URL), FakeContext())
    assert reply.worker.id == "127.0.0.1:7001"
    assert list(ok.workers) == ["127.0.0.1:7001"] and list(desired.specs) == ["127.0.0.1:7001"]


async def test_a_bad_url_or_an_unknown_worker_is_refused_before_any_process_is_asked() -> None:
    admin = FakeAdmin()
    control, _ = plane(admin)
    with pytest.raises(Aborted) as bad:
        await control.AddWorker(pb.AddWorkerRequest(url="http://x:1"), FakeContext())
    assert bad.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert bad.value.details == "worker 'http://x:1': scheme must be grpc:// or grpcs://"
    with pytest.raises(Aborted) as unknown:
        await control.DrainWorker(pb.DrainWorkerRequest(worker_id="n:1"), FakeContext())
    assert (unknown.value.code, unknown.value.details) == (
        grpc.StatusCode.NOT_FOUND,
        "no worker 'n:1' is registered",
    )
    assert admin.calls == []


async def test_remove_and_drain_reach_every_process_and_merge_their_answers() -> None:
    admins = FakeAdmin({"a:1": worker("a:1", 2)}), FakeAdmin({"a:1": worker("a:1", 3)})
    control, desired = plane(*admins, workers=("a:1",))
    drained = await control.DrainWorker(pb.DrainWorkerRequest(worker_id="a:1"), FakeContext())
    assert drained.worker.inflight == 5 and drained.drained is False
    assert desired.drained == {"a:1"}
    listed = await control.ListWorkers(pb.ListWorkersRequest(), FakeContext())
    assert [(w.id, w.inflight) for w in listed.workers] == [("a:1", 5)]
    removed = await control.RemoveWorker(pb.RemoveWorkerRequest(worker_id="a:1"), FakeContext())
    assert removed.worker.inflight == 5 and removed.drained is True
    assert desired.specs == {} and desired.drained == set()
    assert all(a.workers == {} for a in admins)


async def test_a_restarted_process_catches_up_with_the_desired_fleet() -> None:
    """It started from the desired fleet as it was; adds, removes and drains since then
    are replayed, and nothing else is touched."""
    desired = DesiredFleet.of(build_config(worker_urls=["grpc://a:1?model=m&runtime=sglang"]))
    desired.specs.pop("a:1")  # removed after the process started
    desired.add(build_config(worker_urls=[URL]).workers[0], URL)  # added after
    desired.specs["k:1"] = build_config(worker_urls=["grpc://k:1"]).workers[0]
    desired.drained.add("k:1")
    admin = FakeAdmin({"a:1": worker("a:1"), "k:1": worker("k:1")})
    await reconcile(admin, desired, 0)
    assert admin.calls == [("add", URL), ("remove", "a:1"), ("drain", "k:1")]
    assert sorted(admin.workers) == ["127.0.0.1:7001", "k:1"]
    admin.calls.clear()
    await reconcile(admin, desired, 0)
    assert admin.calls == []
