"""One ending for every call, whichever door it came through: `async with call` maps how
it ended to the record's code, sets the load report while the call still counts, gives
back what the stages took (each callback runs, whatever another raised) and has its
door's call log tell of it; the call's context protocol is what grpc's servicer context,
the picker's and ORCA's provide."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import grpc
import pytest
from grpc import aio

from gateway.engines import engine_adapters
from gateway.observability.record import CallRecord
from gateway.picker.context import PickerContext
from gateway.proxy.call import Call
from gateway.proxy.call_log import CallLog
from gateway.proxy.context import Context
from gateway.proxy.metadata import UNREAD
from gateway.proxy.reporting import OrcaContext

PROTOCOL = [name for name, _ in inspect.getmembers(Context, callable) if not name.startswith("_")]


class FakeContext:
    def __init__(self, left: float | None = None) -> None:
        self.left = left
        self.status: grpc.StatusCode | None = None

    def time_remaining(self) -> float | None:
        return self.left

    def code(self) -> grpc.StatusCode | None:
        return self.status


class Ends:
    def __init__(self, order: list[str]) -> None:
        self.order = order

    def end(self) -> None:
        self.order.append("orca")


def make_call(context: Any, logged: list[CallRecord], order: list[str]) -> Call:
    spec = next(iter(engine_adapters().values())).rpcs["Generate"]
    record = CallRecord(rpc="Generate", service="s")
    return Call(
        spec,
        context,
        record,
        UNREAD,
        "",
        orca=Ends(order),
        call_log=CallLog(logged.append, "warning"),
    )


async def test_every_callback_runs_in_reverse_whatever_another_raised() -> None:
    logged: list[CallRecord] = []
    order: list[str] = []
    call = make_call(FakeContext(), logged, order)

    def fails(name: str) -> None:
        order.append(name)
        raise ValueError(name)

    call.on_end(lambda: order.append("first"))
    call.on_end(lambda: fails("second"))
    call.on_end(lambda: fails("third"))
    with pytest.raises(ValueError, match="second"):  # the last one raised goes on
        async with call:
            pass
    assert order == ["orca", "third", "second", "first"]  # the report while still counted
    assert [r.code for r in logged] == ["OK"]  # told of once, even so


@pytest.mark.parametrize(
    ("error", "left", "code"),
    [
        (asyncio.CancelledError(), None, "CANCELLED"),
        (asyncio.CancelledError(), 0.0, "DEADLINE_EXCEEDED"),  # the client's deadline
        (RuntimeError("bug"), None, "UNKNOWN"),
    ],
)
async def test_how_a_call_ended_is_its_code(
    error: BaseException, left: float | None, code: str
) -> None:
    logged: list[CallRecord] = []
    call = make_call(FakeContext(left), logged, [])
    with pytest.raises(type(error)):
        async with call:
            raise error
    assert [r.code for r in logged] == [code]


async def test_a_call_handed_to_the_relay_is_the_relays_to_tell_of() -> None:
    logged: list[CallRecord] = []
    call = make_call(FakeContext(), logged, [])
    async with call:
        call.handed_over()
    assert logged == []


def test_grpcs_context_and_the_stand_ins_have_what_the_protocol_names() -> None:
    """mypy checks the stand-ins against `Context`; grpc ships no type hints, so its
    servicer context is checked here, by name."""
    assert {"abort", "peer", "read", "write", "time_remaining"} <= set(PROTOCOL)
    for kind in (aio.ServicerContext, PickerContext, OrcaContext):
        members = set(dir(kind)) | set(getattr(kind, "__slots__", ()))
        assert [name for name in PROTOCOL if name not in members] == [], kind
