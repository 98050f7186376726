"""PeerService in a serving process: abort what this process holds, show its metrics."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeAlias

from google.protobuf.message import DecodeError
from grpc import aio
from prometheus_client import CollectorRegistry, generate_latest

from gateway.config import ConfigError, parse_worker_url
from gateway.discovery.membership import Membership
from gateway.discovery.source import Discovered
from gateway.peer.v1 import peer_pb2 as pb
from gateway.peer.v1 import peer_pb2_grpc
from gateway.proxy import EngineFront, Metadata, abort_invalid

Context: TypeAlias = aio.ServicerContext


def headers_to_metadata(headers: Iterable[pb.Header]) -> Metadata:
    """Peer headers back to gRPC metadata: text values decoded, `-bin` values kept."""
    return tuple(
        (h.key, h.value if h.key.endswith("-bin") else h.value.decode(errors="replace"))
        for h in headers
    )


def metadata_to_headers(metadata: Metadata) -> list[pb.Header]:
    return [pb.Header(key=k, value=v if isinstance(v, bytes) else v.encode()) for k, v in metadata]


class PeerService(peer_pb2_grpc.PeerServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        fronts: Mapping[str, EngineFront],
        metrics: CollectorRegistry,
        membership: Membership,
    ) -> None:
        self._fronts = fronts
        self._metrics = metrics
        self._membership = membership

    async def AbortHeld(
        self, request: pb.AbortHeldRequest, context: Context
    ) -> pb.AbortHeldResponse:
        front = self._fronts.get(request.service)
        if front is None:
            await abort_invalid(context, "no such engine service")
        try:
            ids = front.adapter.abort_ids(request.request)
        except DecodeError:
            await abort_invalid(context, "not a valid AbortRequest")
        principal = request.principal if request.HasField("principal") else None
        reply = await front.aborts.abort_held(
            request.request,
            ids,
            principal,
            headers_to_metadata(request.headers),
            context.time_remaining(),
        )
        if reply is None:
            return pb.AbortHeldResponse(held=False)
        return pb.AbortHeldResponse(held=True, response=reply)

    async def Metrics(self, request: pb.MetricsRequest, context: Context) -> pb.MetricsResponse:
        return pb.MetricsResponse(text=generate_latest(self._metrics).decode())

    async def Discovered(
        self, request: pb.DiscoveredRequest, context: Context
    ) -> pb.DiscoveredResponse:
        """A discovery source's hosts, from the supervisor that runs it."""
        try:
            source, hosts = discovered_from_message(request)
        except ConfigError as exc:  # the supervisor checked them: a bug if it happens
            await abort_invalid(context, str(exc))
        self._membership.apply(source, hosts)
        return pb.DiscoveredResponse()


def discovered_message(source: str, hosts: Iterable[Discovered]) -> pb.DiscoveredRequest:
    """A source's report as the supervisor sends it to a serving process."""
    return pb.DiscoveredRequest(
        source=source,
        hosts=[
            pb.DiscoveredHost(url=h.spec.full_url(), origin=h.origin, in_service=h.in_service)
            for h in hosts
        ],
    )


def discovered_from_message(request: pb.DiscoveredRequest) -> tuple[str, list[Discovered]]:
    hosts = [Discovered(parse_worker_url(h.url), h.origin, h.in_service) for h in request.hosts]
    return request.source, hosts


def add_peer_service(server: aio.Server, service: PeerService) -> None:
    peer_pb2_grpc.add_PeerServiceServicer_to_server(service, server)
