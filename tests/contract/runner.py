"""Send the contract's calls (calls.py) to a worker and write down everything it answered:
the status code and message, the initial headers (and how long before the first message
they came), the trailers, and every message as protobuf JSON (field presence kept: a
set field holding its default is written, an unset one is not).

Shared by tests/contract/record.py (a real vLLM or SGLang worker) and
tests/contract/test_transcripts.py (the simulator); grpc.aio, one event loop.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from google.protobuf import json_format, message_factory
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc import aio
from grpc_health.v1 import health_pb2
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2, vllm_engine_pb2

from tests.contract.calls import (
    DECODE,
    PAIR,
    PREFILL,
    SGLANG_SERVICE,
    VLLM_SERVICE,
    WORKER,
    Call,
    Contract,
    KvRestart,
)

# The status details' Any payloads decode through the default pool.
_ = error_details_pb2
DEADLINE_GRACE_S = 1.0  # how late a call's own deadline may fire before it is cancelled
SERVICES = {
    VLLM_SERVICE: vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"],
    SGLANG_SERVICE: sglang_scheduler_pb2.DESCRIPTOR.services_by_name["SglangScheduler"],
    "grpc.health.v1.Health": health_pb2.DESCRIPTOR.services_by_name["Health"],
}
OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]

Restart = Callable[[], Awaitable[None]]


def method_types(full_method: str) -> tuple[type[Message], type[Message], bool]:
    """The request and response classes of `/Service/Method`, and whether it streams."""
    service, rpc = full_method.strip("/").split("/")
    method = SERVICES[service].methods_by_name[rpc]
    return (
        message_factory.GetMessageClass(method.input_type),
        message_factory.GetMessageClass(method.output_type),
        method.server_streaming,
    )


def to_json(message: Message) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def metadata_pairs(metadata: Any) -> list[list[str]]:
    pairs = []
    for key, value in metadata or ():
        text = base64.b64encode(value).decode() if isinstance(value, bytes) else str(value)
        pairs.append([key, text])
    return pairs


def status_details(trailers: Any) -> dict[str, Any] | None:
    for key, value in trailers or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            return to_json(status_pb2.Status.FromString(value))
    return None


def encoded(full_method: str, request: Mapping[str, Any]) -> bytes:
    """`request` (protobuf JSON) as the method's request message."""
    request_type, _, _ = method_types(full_method)
    return bytes(json_format.ParseDict(dict(request), request_type()).SerializeToString())


Bootstrap = tuple[str, int]  # an SGLang prefill's bootstrap host and port


def request_bytes(
    call: Call,
    engine_service: str,
    results: Mapping[str, Any],
    bootstrap: Bootstrap | None = None,
) -> bytes:
    """The call's request, with what a router adds to a PD leg's: the kv_transfer_params
    an earlier prefill call answered, or the bootstrap and room."""
    if call.raw is not None:
        return call.raw
    request = dict(call.request)
    if call.kv_from is not None:
        request["kv_transfer_params_json"] = kv_transfer_params(results[call.kv_from])
    if call.bootstrap_room is not None:
        if bootstrap is None:
            raise ValueError(f"{call.name}: no prefill bootstrap to name")
        host, port = bootstrap
        request["disaggregated_params"] = {
            "bootstrap_host": host,
            "bootstrap_port": port,
            "bootstrap_room": call.bootstrap_room,
        }
    return encoded(call.full_method(engine_service), request)


def kv_transfer_params(entry: Mapping[str, Any]) -> str:
    """What a vLLM prefill's Complete handed on ('' if it handed nothing)."""
    for message in reversed(entry["messages"]):
        params = message.get("complete", {}).get("kv_transfer_params_json")
        if params:
            return str(params)
    return ""


async def bootstrap_of(channel: aio.Channel) -> Bootstrap:
    """An SGLang prefill's bootstrap, as a router finds it: the port from its
    GetServerInfo's server_args (every worker here is on 127.0.0.1)."""
    method = f"/{SGLANG_SERVICE}/GetServerInfo"
    request_type, response_type, _ = method_types(method)
    ask = channel.unary_unary(
        method,
        request_serializer=lambda message: message.SerializeToString(),
        response_deserializer=response_type.FromString,
    )
    reply: Any = await ask(request_type(), timeout=30.0)
    port = reply.server_args.fields["disaggregation_bootstrap_port"].number_value
    return "127.0.0.1", int(port)


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 1)


class Stream:
    """One server-streaming (or unary) call under way, read in the background; `entry()`
    once it ended."""

    def __init__(
        self,
        channel: aio.Channel,
        full_method: str,
        payload: bytes,
        metadata: Sequence[tuple[str, str]] = (),
        timeout: float | None = None,
    ) -> None:
        _, response_type, streaming = method_types(full_method)
        self.method = full_method
        self.streaming = streaming
        self.began = time.monotonic()
        self.messages: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self.headers_at: float | None = None
        self.first_message = asyncio.Event()
        self.cancelled_by_client = False
        kwargs: dict[str, Any] = {
            "request_serializer": None,
            "response_deserializer": response_type.FromString,
        }
        if streaming:
            self.call: Any = channel.unary_stream(full_method, **kwargs)(
                payload, metadata=tuple(metadata), timeout=timeout
            )
        else:
            self.call = channel.unary_unary(full_method, **kwargs)(
                payload, metadata=tuple(metadata), timeout=timeout
            )
        self._headers = asyncio.ensure_future(self.call.initial_metadata())
        self._headers.add_done_callback(self._mark_headers)
        self.task = asyncio.ensure_future(self._read())

    def _mark_headers(self, _: object) -> None:
        self.headers_at = time.monotonic()

    async def _read(self) -> None:
        try:
            if self.streaming:
                async for message in self.call:
                    self._add(message)
            else:
                self._add(await self.call)
        except aio.AioRpcError:
            pass  # its code and details are the call's
        except asyncio.CancelledError:
            self.cancelled_by_client = True

    def _add(self, message: Message) -> None:
        self.arrivals.append(time.monotonic())
        self.messages.append(to_json(message))
        self.first_message.set()

    def cancel(self) -> None:
        self.cancelled_by_client = True
        self.call.cancel()

    async def wait(self, within_s: float) -> None:
        """Until the call ends; past `within_s`, cancelled (and written down so)."""
        try:
            await asyncio.wait_for(asyncio.shield(self.task), within_s)
        except TimeoutError:
            self.cancel()
            await self.task

    async def entry(self, with_arrivals: bool = False) -> dict[str, Any]:
        await self.task
        code = await self.call.code()
        try:
            headers = await asyncio.wait_for(asyncio.shield(self._headers), 5.0)
        except (asyncio.CancelledError, TimeoutError, aio.AioRpcError):
            headers = None
        trailers = await self.call.trailing_metadata()
        entry: dict[str, Any] = {
            "method": self.method,
            "code": code.name,
            "details": await self.call.details() or "",
            "headers": metadata_pairs(headers),
            "headers_lead_ms": (
                ms(self.arrivals[0] - self.headers_at)
                if self.arrivals and self.headers_at is not None
                else None
            ),
            "trailers": metadata_pairs(trailers),
            "status_details": status_details(trailers),
            "messages": self.messages,
        }
        if self.cancelled_by_client:
            entry["cancelled_by_client"] = True
        if with_arrivals:
            entry["arrival_ms"] = [ms(at - self.began) for at in self.arrivals]
        return entry


async def run_call(
    channels: Mapping[str, aio.Channel],
    call: Call,
    contract: Contract,
    results: Mapping[str, Any],
    bootstrap: Bootstrap | None = None,
) -> dict[str, Any]:
    """One call's entry; a PAIR call's is each leg's, by leg."""
    method = call.full_method(contract.service)
    payload = request_bytes(call, contract.service, results, bootstrap)
    if call.leg == PAIR:
        pair = {
            leg: Stream(channels[leg], method, payload, call.metadata, call.timeout_s)
            for leg in (PREFILL, DECODE)
        }
        return {leg: await stream.entry() for leg, stream in pair.items()}
    channel = channels[call.leg]
    stream = Stream(channel, method, payload, call.metadata, call.timeout_s)
    if call.abort_after is None:
        return await stream.entry()
    # Abort the request once it is running: after `abort_after` messages.
    deadline = time.monotonic() + call.timeout_s
    while len(stream.messages) < call.abort_after and not stream.task.done():
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.005)
    abort_method = f"/{contract.service}/Abort"
    abort = Stream(
        channel,
        abort_method,
        encoded(abort_method, contract.abort(call.request["request_id"])),
        timeout=10.0,
    )
    aborted = await abort.entry()
    aborted_after = len(stream.messages)
    # A stream the abort does not end (SGLang's) ends at the call's deadline: waited for
    # with a grace, since gRPC fires a deadline some tens of ms late (5.058 s for a 5 s one,
    # measured), and a wait of timeout_s begun ~30 ms into the call cancelled it first.
    await stream.wait(stream.began + call.timeout_s - time.monotonic() + DEADLINE_GRACE_S)
    entry = await stream.entry()
    entry["abort"] = aborted
    entry["messages_before_abort_answer"] = aborted_after
    return entry


def kv_request(start: int) -> bytes:
    """From `start`, with load records before the first batch, as the gateway asks."""
    request = common_pb2.SubscribeKvEventsRequest(
        start_sequence_number=start, load_records_before_first_batch=True
    )
    return bytes(request.SerializeToString())


def last_sequence(stream: Stream) -> int:
    numbers = [int(m.get("sequence_number", 0)) for m in stream.messages]
    return max(numbers, default=0)


async def generate_entry(
    channel: aio.Channel, service: str, scenario: KvRestart, request_id: str
) -> dict[str, Any]:
    method = f"/{service}/Generate"
    request = encoded(method, scenario.generate_request(request_id))
    return await Stream(channel, method, request, timeout=60.0).entry()


async def run_kv_restart(
    address: str, service: str, scenario: KvRestart, restart: Restart, unit_s: float
) -> dict[str, Any]:
    """The KV events scenario of calls.KvRestart; `restart` kills the worker (kill -9) and
    starts it again on the same port."""
    kv_method = f"/{service}/SubscribeKvEvents"
    marks: dict[str, float] = {}
    # The first subscription has a channel of its own, open across the restart.
    first_channel = aio.insecure_channel(address, options=OPTIONS)
    try:
        first = Stream(first_channel, kv_method, kv_request(0))
        began = first.began
        async with aio.insecure_channel(address, options=OPTIONS) as channel:
            await asyncio.sleep(scenario.idle_units * unit_s)  # a window: what comes while idle
            generated = await generate_entry(channel, service, scenario, "kv_first")
            marks["generate_done_ms"] = ms(time.monotonic() - began)
            await asyncio.sleep(scenario.after_units * unit_s)  # a window: the load records
            resumes = {}
            for label, start in (
                ("resume_from_1", 1),
                ("resume_after_last", last_sequence(first) + 1),
            ):
                resume = Stream(channel, kv_method, kv_request(start))
                await resume.wait(2.0 * unit_s + 1.0)
                resumes[label] = {"start_sequence_number": start, **await resume.entry()}
        marks["restart_ms"] = ms(time.monotonic() - began)
        await restart()
        marks["restarted_ms"] = ms(time.monotonic() - began)
        await first.wait(30.0)
        marks["first_ended_ms"] = ms(time.monotonic() - began)
        first_entry = await first.entry(with_arrivals=True)
    finally:
        await first_channel.close()
    async with aio.insecure_channel(address, options=OPTIONS) as channel:
        again = Stream(channel, kv_method, kv_request(0))
        await asyncio.sleep(scenario.idle_units * unit_s)
        generated_again = await generate_entry(channel, service, scenario, "kv_after_restart")
        await asyncio.sleep(scenario.after_restart_units * unit_s)
        again.cancel()
        await again.wait(5.0)
        return {
            "unit_s": unit_s,
            "marks": marks,
            "first": first_entry,
            "first_generate": generated,
            **resumes,
            "after_restart": await again.entry(with_arrivals=True),
            "after_restart_generate": generated_again,
        }


async def run_all(
    addresses: Mapping[str, str], contract: Contract, restart: Restart | None, unit_s: float
) -> dict[str, Any]:
    """Every call of the contract in order, each to its leg's worker (`addresses`, by
    leg), then its KV scenario (when it has one and `restart` is given)."""
    results: dict[str, Any] = {}
    channels = {leg: aio.insecure_channel(addresses[leg], options=OPTIONS) for leg in contract.legs}
    try:
        bootstrap = None
        if contract.service == SGLANG_SERVICE and PREFILL in channels:
            bootstrap = await bootstrap_of(channels[PREFILL])
        for call in contract.calls:
            results[call.name] = await run_call(channels, call, contract, results, bootstrap)
    finally:
        for channel in channels.values():
            await channel.close()
    if contract.kv is not None and restart is not None:
        results[contract.kv.name] = await run_kv_restart(
            addresses[WORKER], contract.service, contract.kv, restart, unit_s
        )
    return results
