"""Fleet objects to admin API messages.

Kept apart from the servicer so the message shapes are tested without a server, and so the
watch listener (called synchronously inside fleet updates) does nothing but this copy.
"""

from __future__ import annotations

import math
import time
from urllib.parse import urlencode

from google.protobuf.timestamp_pb2 import Timestamp

from gateway.admin.v1 import admin_pb2 as pb
from gateway.core.roles import Role
from gateway.upstream.registry import FleetEvent, Unidentified
from gateway.upstream.signals.outlier import OutlierState
from gateway.upstream.signals.probe import ProbeKind
from gateway.upstream.worker import Worker, WorkerStatus

UINT32_MAX = 2**32 - 1

STATUS: dict[str, pb.WorkerStatus] = {
    WorkerStatus.PENDING.value: pb.WORKER_STATUS_PENDING,
    WorkerStatus.READY.value: pb.WORKER_STATUS_READY,
    WorkerStatus.NOT_READY.value: pb.WORKER_STATUS_NOT_READY,
    WorkerStatus.DRAINING.value: pb.WORKER_STATUS_DRAINING,
}
ROLE: dict[str, pb.Role] = {
    Role.REGULAR.value: pb.ROLE_REGULAR,
    Role.PREFILL.value: pb.ROLE_PREFILL,
    Role.DECODE.value: pb.ROLE_DECODE,
    Role.ENCODE.value: pb.ROLE_ENCODE,
}
# Outlier detection's state, in the admin API's published names (its BreakerState, the
# breaker_* fields and WORKER_EVENT_KIND_BREAKER: the wire keeps them).
OUTLIER: dict[str, pb.BreakerState] = {
    OutlierState.CLOSED.value: pb.BREAKER_STATE_CLOSED,
    OutlierState.HALF_OPEN.value: pb.BREAKER_STATE_HALF_OPEN,
    OutlierState.OPEN.value: pb.BREAKER_STATE_OPEN,
}
PROBE: dict[ProbeKind, pb.ProbeKind] = {
    ProbeKind.SERVING: pb.PROBE_KIND_SERVING,
    ProbeKind.NOT_SERVING: pb.PROBE_KIND_NOT_SERVING,
    ProbeKind.ERROR: pb.PROBE_KIND_ERROR,
    # The probe failed inside the gateway (a bug, logged): not the worker's error; the
    # detail says so.
    ProbeKind.INTERNAL: pb.PROBE_KIND_UNSPECIFIED,
}
EVENT: dict[str, pb.WorkerEventKind] = {
    "added": pb.WORKER_EVENT_KIND_ADDED,
    "removed": pb.WORKER_EVENT_KIND_REMOVED,
    "status": pb.WORKER_EVENT_KIND_STATUS,
    "outlier": pb.WORKER_EVENT_KIND_BREAKER,
}


def timestamp(unix_s: float) -> Timestamp:
    seconds = int(unix_s // 1)
    return Timestamp(seconds=seconds, nanos=int((unix_s - seconds) * 1e9))


def worker_url(worker: Worker) -> str:
    """The URL that registers this worker again as it is (discovered values filled in)."""
    spec = worker.spec
    query = {"model": worker.model, "runtime": str(worker.runtime), "role": str(worker.role)}
    if spec.bootstrap_port is not None:
        query["bootstrap_port"] = str(spec.bootstrap_port)
    return f"{spec.url}?{urlencode(query)}"


def worker_message(worker: Worker, kv: pb.KvIndexState | None = None) -> pb.Worker:
    """A copy of the worker's state now; unknown vocabulary maps to UNSPECIFIED."""
    message = pb.Worker(
        id=worker.id,
        url=worker_url(worker),
        model=worker.model,
        runtime=str(worker.runtime),
        role=ROLE.get(str(worker.role), pb.ROLE_UNSPECIFIED),
        status=STATUS.get(str(worker.status), pb.WORKER_STATUS_UNSPECIFIED),
        status_cause=worker.status_cause,
        inflight=max(0, worker.inflight),
        breaker_state=OUTLIER.get(str(worker.outlier.state), pb.BREAKER_STATE_UNSPECIFIED),
        load_error=worker.load_error or "",
        connected=worker.connected,
        sources=worker.sources,
        in_service=worker.in_service,
        lora_adapters=list(worker.loras),
    )
    if worker.spec.bootstrap_port is not None:
        message.bootstrap_port = worker.spec.bootstrap_port
    if kv is not None:
        message.kv_index.CopyFrom(kv)
    last = worker.probe.last
    if last is not None:
        message.last_probe.kind = PROBE.get(last.kind, pb.PROBE_KIND_UNSPECIFIED)
        message.last_probe.detail = last.detail
        if worker.probe.last_at:
            message.last_probe.time.CopyFrom(timestamp(worker.probe.last_at))
    load = worker.load
    if load is not None:
        # A worker's numbers never fail the answer: within the fields' uint32 range,
        # usage finite (reports are checked when made; this is the last guard).
        message.load.running = min(max(0, load.running), UINT32_MAX)
        message.load.waiting = min(max(0, load.waiting), UINT32_MAX)
        usage = load.token_usage
        message.load.token_usage = usage if math.isfinite(usage) else 0.0
        # The report carries monotonic time; the API speaks wall-clock time.
        message.load.time.CopyFrom(timestamp(time.time() - (time.monotonic() - load.at)))
    return message


def unidentified_message(entry: Unidentified) -> pb.Worker:
    """A named worker that has not said what it serves: what its URL says, and why the
    last question failed."""
    spec = entry.spec
    return pb.Worker(
        id=spec.address,
        url=spec.full_url(),
        model=spec.model or "",
        runtime=str(spec.runtime or ""),
        role=ROLE.get(str(spec.role), pb.ROLE_UNSPECIFIED),
        status=pb.WORKER_STATUS_UNIDENTIFIED,
        status_cause=entry.error or "being asked what it serves",
        sources=entry.sources,
    )


def snapshot_event(worker: Worker) -> pb.WatchWorkersResponse:
    return pb.WatchWorkersResponse(
        kind=pb.WORKER_EVENT_KIND_SNAPSHOT,
        worker=worker_message(worker),
        cause=worker.status_cause,
        time=timestamp(time.time()),
    )


def fleet_event(event: FleetEvent) -> pb.WatchWorkersResponse:
    """One FleetEvent, with the worker's state copied at the moment it happened."""
    message = pb.WatchWorkersResponse(
        kind=EVENT.get(event.kind, pb.WORKER_EVENT_KIND_UNSPECIFIED),
        worker=worker_message(event.worker),
        cause=event.cause,
        time=timestamp(time.time()),
    )
    if event.kind == "status":
        message.status_change.old_status = STATUS.get(event.old, pb.WORKER_STATUS_UNSPECIFIED)
        message.status_change.new_status = STATUS.get(event.new, pb.WORKER_STATUS_UNSPECIFIED)
    elif event.kind == "outlier":
        message.breaker_change.old_state = OUTLIER.get(event.old, pb.BREAKER_STATE_UNSPECIFIED)
        message.breaker_change.new_state = OUTLIER.get(event.new, pb.BREAKER_STATE_UNSPECIFIED)
    return message
