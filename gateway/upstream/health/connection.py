"""Connection watching: a worker whose channel leaves READY is unroutable at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from grpc import aio

from gateway.upstream.worker import Worker

_CAUSES = {
    grpc.ChannelConnectivity.IDLE: "connection closed",
    grpc.ChannelConnectivity.CONNECTING: "connecting",
    grpc.ChannelConnectivity.TRANSIENT_FAILURE: "connection failed",
    grpc.ChannelConnectivity.SHUTDOWN: "channel shut down",
}

SETTLED = frozenset(
    {
        grpc.ChannelConnectivity.READY,
        grpc.ChannelConnectivity.TRANSIENT_FAILURE,
        grpc.ChannelConnectivity.SHUTDOWN,
    }
)


async def watch_connection(
    worker: Worker,
    channel: aio.Channel,
    settled: asyncio.Event,
    on_connected: Callable[[], None],
) -> None:
    """Follow the channel's state for the worker's lifetime, reconnecting whenever it idles.

    `settled` is set once the first connection attempt has an outcome, so start-up can
    wait for it. A lost connection makes the worker prove itself to the prober again;
    `on_connected` asks for that proof at once instead of at the next interval.
    """
    state = channel.get_state(try_to_connect=True)
    while True:
        connected = state is grpc.ChannelConnectivity.READY
        if worker.set_connected(connected, _CAUSES.get(state, "connected")) and connected:
            on_connected()
        if state in SETTLED:
            settled.set()
        if state is grpc.ChannelConnectivity.SHUTDOWN:
            return
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)
