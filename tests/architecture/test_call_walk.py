"""One call's walk through the gateway goes down the layers: along every call stack of a
streaming Generate no gateway module appears twice, so no code returns up into a module it
already left (a callback into the stages, a placement closure the dispatch calls back
into). A prefill + decode Generate returns once, and only once: the engine's hand-off (the
adapter's, where engine differences live) drives the attempt's legs. An object's methods
count as its class's module (a base class calling its subclass's override is one object's
business).

The walk is traced with `sys.setprofile` on the event loop's thread while one call runs
in process (tests/support/inproc): every function the gateway enters, and the modules on
its stack at that moment. A call the endpoint picker places walks the same way: the
picker's stages run in the relay's pipeline, its attempt in the relay's dispatch."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from grpc import aio

import gateway
from gateway_sim.client import collect, model_md, sgl, sgl_grpc
from tests.support.extproc import placed_call
from tests.support.inproc import client, pd_urls, sim
from tests.support.inproc import gateway as in_process

ROOT = str(Path(gateway.__file__).parent) + "/"


def module_of(frame: FrameType) -> str | None:
    """The gateway module a frame runs in (its object's class's module, for a method)."""
    if not frame.f_code.co_filename.startswith(ROOT):
        return None
    me = frame.f_locals.get("self")
    if me is not None and type(me).__module__.startswith("gateway."):
        return str(type(me).__module__)
    return "gateway." + frame.f_code.co_filename[len(ROOT) :].removesuffix(".py").replace("/", ".")


def stack(frame: FrameType | None) -> Iterator[str]:
    """The gateway modules on the stack, innermost first, each run of one module once."""
    last = None
    while frame is not None:
        module = module_of(frame)
        if module is not None and module != last:
            yield module
            last = module
        frame = frame.f_back


class Walk:
    """Every stack on which a gateway module appears more than once, while installed."""

    def __init__(self) -> None:
        self.returns: list[str] = []
        self.most = 1  # the most times one module appears on one stack
        self.repeated: set[str] = set()  # the modules that did
        self.entered = 0
        self._seen: set[FrameType] = set()  # kept: a resumed coroutine is no new call

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame in self._seen:
            return
        self._seen.add(frame)
        modules = list(stack(frame))
        if not modules:
            return
        self.entered += 1
        if len(modules) != len(set(modules)):
            self.returns.append(f"{frame.f_code.co_name}: " + " <- ".join(modules))
            self.most = max(self.most, *(modules.count(m) for m in modules))
            self.repeated |= {m for m in modules if modules.count(m) > 1}

    def __enter__(self) -> Walk:
        sys.setprofile(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.setprofile(None)


def request(request_id: str) -> Any:
    return sgl.GenerateRequest(
        request_id=request_id,
        tokenized=sgl.TokenizedInput(input_ids=list(range(1, 33))),
        sampling_params=sgl.SamplingParams(max_new_tokens=3),
        stream=True,
    )


async def walk(urls: list[str]) -> Walk:
    async with in_process(*urls) as gw, client(gw) as channel:
        stub = sgl_grpc.SglangSchedulerStub(channel)
        await collect(stub.Generate(request("warm"), metadata=model_md("m")))  # imports done
        with Walk() as traced:
            answers, error = await collect(stub.Generate(request("walked"), metadata=model_md("m")))
        assert error is None and answers[-1].HasField("complete")
        return traced


async def test_a_generate_walks_down_the_layers() -> None:
    async with sim("--model", "m") as worker:
        traced = await walk([worker.url(model="m", runtime="sglang")])
    assert traced.entered > 50  # the walk was seen
    assert traced.returns == []


async def test_a_prefill_decode_generate_walks_down_the_layers() -> None:
    async with (
        sim("--role", "prefill", "--model", "m") as prefill,
        sim("--role", "decode", "--model", "m") as decode,
    ):
        traced = await walk(pd_urls(prefill, decode))
    assert traced.entered > 50
    assert traced.most == 2, traced.returns  # back into a module it left: once at most
    assert traced.repeated == {"gateway.proxy.legs"}, traced.returns  # under the hand-off


async def test_a_picker_call_walks_down_the_layers() -> None:
    """Placed through the picker (Envoy's side spoken directly): no more returns than
    the relay's own Generate (none)."""
    path = "/sglang.grpc.scheduler.SglangScheduler/Generate"
    picker: dict[str, Any] = {"picker.listen": "127.0.0.1:0"}
    async with (
        sim("--model", "m") as worker,
        in_process(worker.url(model="m", runtime="sglang"), **picker) as gw,
        aio.insecure_channel(f"127.0.0.1:{gw.picker_port}") as channel,
    ):
        body = request("warm").SerializeToString()
        assert await placed_call(channel, path, body, model_md("m")) == worker.address
        with Walk() as traced:
            body = request("walked").SerializeToString()
            assert await placed_call(channel, path, body, model_md("m")) == worker.address
    assert traced.entered > 50
    assert traced.returns == []
