"""Handlers that decide a call before its request is read: one that only refuses, and
one that admits (or refuses) and then runs the method's own behavior."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

Refusal = Callable[[aio.ServicerContext], Awaitable[None]]


def refusing(handler: grpc.RpcMethodHandler, refuse: Refusal) -> grpc.RpcMethodHandler:
    """A handler for `handler`'s method that only runs `refuse` (which aborts the call).

    Request-streaming whatever the method's shape, and it never reads: a handler of the
    method's own shape would have grpc read the whole request (up to `max_message_bytes`)
    before the refusal. The wire is the same for the client; its sending is cut short."""

    async def run(_requests: Any, context: aio.ServicerContext) -> None:
        await refuse(context)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            run, response_serializer=handler.response_serializer
        )
    return grpc.stream_unary_rpc_method_handler(
        run, response_serializer=handler.response_serializer
    )


def deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler for `handler`'s method that refuses the call (UNAUTHENTICATED `message`)
    without reading its request."""

    async def refuse(context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return refusing(handler, refuse)


def gated(handler: grpc.RpcMethodHandler, admit: Refusal) -> grpc.RpcMethodHandler:
    """`handler` behind `admit(context)` (which aborts the call or returns), run before
    the request is read: request-streaming whatever the method's shape, a unary request
    read here after `admit` and handed to the method's own behavior."""
    behavior = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    streaming_request = handler.request_streaming

    async def request_of(requests: Any, context: aio.ServicerContext) -> Any:
        if streaming_request:
            return requests
        async for request in requests:
            return request
        await context.abort(grpc.StatusCode.INTERNAL, "half-closed without a request")

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.response_streaming and inspect.isasyncgenfunction(behavior):

        async def relay(requests: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            await admit(context)
            async for response in behavior(await request_of(requests, context), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(relay, **codecs)

    async def run(requests: Any, context: aio.ServicerContext) -> Any:
        await admit(context)
        result = behavior(await request_of(requests, context), context)
        return await result if inspect.isawaitable(result) else result

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(run, **codecs)
    return grpc.stream_unary_rpc_method_handler(run, **codecs)
