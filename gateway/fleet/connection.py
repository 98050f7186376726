"""Connection watching: a worker whose channel leaves READY is unroutable at once."""

from __future__ import annotations

import asyncio

import grpc

from gateway.fleet.registry import Registry
from gateway.fleet.worker import Worker, WorkerStatus

_CAUSES = {
    grpc.ChannelConnectivity.IDLE: "connection closed",
    grpc.ChannelConnectivity.CONNECTING: "connecting",
    grpc.ChannelConnectivity.TRANSIENT_FAILURE: "connection failed",
    grpc.ChannelConnectivity.SHUTDOWN: "channel shut down",
}


def status_for(state: grpc.ChannelConnectivity, current: WorkerStatus) -> WorkerStatus:
    """READY routes; any other state does not. `pending` lasts until the first READY."""
    if current is WorkerStatus.DRAINING:
        return current
    if state is grpc.ChannelConnectivity.READY:
        return WorkerStatus.READY
    return WorkerStatus.PENDING if current is WorkerStatus.PENDING else WorkerStatus.NOT_READY


SETTLED = frozenset(
    {
        grpc.ChannelConnectivity.READY,
        grpc.ChannelConnectivity.TRANSIENT_FAILURE,
        grpc.ChannelConnectivity.SHUTDOWN,
    }
)


async def watch_connection(worker: Worker, registry: Registry, settled: asyncio.Event) -> None:
    """Follow the channel's state for the worker's lifetime, reconnecting whenever it idles.

    `settled` is set once the first connection attempt has an outcome, so start-up can
    wait for it instead of answering its first requests with a verdict.
    """
    channel = worker.channel
    state = channel.get_state(try_to_connect=True)
    while True:
        status = status_for(state, worker.status)
        registry.set_status(worker, status, _CAUSES.get(state, "connected"))
        if state in SETTLED:
            settled.set()
        if state is grpc.ChannelConnectivity.SHUTDOWN:
            return
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=True)
