"""A worker as the gateway sees it: identity, and the live signals that decide its status.

The worker is the one writer of its signals: the fleet's loops, the KV follower and the
proxy's reservations tell it what they saw through its methods (`set_connected`,
`reported`, `load_failed`, `reserve`/`release`, `begin_drain`, the `lora_*` and `loras_listed`
ones for its LoRA adapters), and it derives its own
status (`restatus`); nothing else assigns its fields (tests/architecture/test_one_writer.py
checks the source).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.config import ProbeConfig, WorkerSpec
from gateway.core.roles import Role, Runtime
from gateway.observability.metrics.calls import INTER_TOKEN_BUCKETS, TTFT_BUCKETS
from gateway.upstream.call_stats import CallStats
from gateway.upstream.latency import LatencyModel
from gateway.upstream.signals.load import LoadReport
from gateway.upstream.signals.outlier import OutlierDetector
from gateway.upstream.signals.probe import ProbeResult, ProbeState, judge

# Where a worker came from that no discovery report can take away: flags and the config
# file, and the admin API. Any other source is a discovery source.
PERMANENT_SOURCES = frozenset({"static", "admin"})


def discovered_sources(sources: tuple[str, ...]) -> list[str]:
    """The discovery sources among a worker's `sources`."""
    return [s for s in sources if s not in PERMANENT_SOURCES]


class WorkerStatus(StrEnum):
    """`pending` until its first probe; only `ready` workers are routable."""

    PENDING = "pending"
    READY = "ready"
    NOT_READY = "not_ready"
    DRAINING = "draining"


def derive_status(
    draining: bool, connected: bool, healthy: bool | None, in_service: bool = True
) -> WorkerStatus:
    """The status follows from the signals; nothing else sets it. `in_service`: what the
    worker's discovery source says (a Kubernetes pod that is not Ready is out of service)."""
    if draining:
        return WorkerStatus.DRAINING
    if healthy is None:
        return WorkerStatus.PENDING
    return WorkerStatus.READY if healthy and connected and in_service else WorkerStatus.NOT_READY


StatusTold = Callable[["Worker", "WorkerStatus", str], None]  # (worker, old status, cause)


@dataclass(eq=False, slots=True)
class Worker:
    """One registered worker: a host, in Envoy's terms. Identity is its address;
    everything else is live state. Its connection (the channel) is not here: the fleet
    keeps it, so placement, policies and their tests deal in workers without channels."""

    spec: WorkerSpec
    model: str
    runtime: Runtime
    outlier: OutlierDetector  # its own, from the fleet's outlier detection settings
    role: Role = Role.REGULAR
    bootstrap_port: int | None = None  # prefill: its rendezvous port (SGLang PD)
    pairing: str = ""  # prefill and decode pair only with equal keys (same KV transfer setup)
    block_size: int | None = None  # tokens per KV block, as its GetServerInfo says
    vocab_size: int | None = None  # as its GetModelInfo says; 0: it does not; None: not asked
    window: int | None = None  # requests its scheduler runs at once, as its GetServerInfo says
    # Where it came from: `static` (flags, config file), `admin`, or discovery sources
    # (`dns:NAME`, `kubernetes:NAMESPACE/POD`, `file:PATH`); several name one address.
    sources: tuple[str, ...] = ("static",)
    status: WorkerStatus = WorkerStatus.PENDING
    status_cause: str = "not yet probed"
    connected: bool = False
    draining: bool = False
    in_service: bool = True
    probe: ProbeState = field(default_factory=ProbeState)
    load: LoadReport | None = None
    load_error: str | None = None
    inflight: int = 0
    loras: tuple[str, ...] = ()  # LoRA adapters it holds, the least recently used first
    lora_calls: dict[str, int] = field(default_factory=dict)  # running calls per adapter
    lora_changes: int = 0  # the gateway's own loads and unloads here, counted
    loras_rejected: int = 0  # its adapter lists cut at lora.max_listed_per_worker
    idle: asyncio.Event | None = None  # set when in-flight reaches zero, while draining
    removing: bool = False  # on its way out (RemoveWorker, or its source let it go)
    # The calls it answered, as clients saw them (per-worker series; the metrics write it).
    calls: CallStats = field(default_factory=lambda: CallStats(TTFT_BUCKETS, INTER_TOKEN_BUCKETS))
    # What its time to first token costs (`latency_learn` writes it; policies predict).
    latency: LatencyModel = field(default_factory=LatencyModel)
    # Uncached prompt tokens of its calls not yet at their first message (proxy.backlog's).
    prefill_backlog: int = 0
    # Its address, built once (the spec is frozen): a call's path reads it many times.
    id: str = field(init=False)
    # Who hears its status change (its registry, while it holds the worker).
    _told: StatusTold | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.id = self.spec.address

    @property
    def bootstrap_host(self) -> str:
        return self.spec.bootstrap_host or self.spec.host

    def reserve(self) -> None:
        """One request placed on this worker."""
        self.inflight += 1

    def release(self) -> None:
        """One request finished on this worker."""
        self.inflight -= 1
        if self.inflight == 0 and self.idle is not None:
            self.idle.set()

    def told(self, told: StatusTold | None) -> None:
        """`told(worker, old, cause)` as its status changes from now on (None: nobody)."""
        self._told = told

    def signalled(self, cause: str) -> bool:
        """Its signals changed: its status derived again, and told if it changed."""
        old = self.restatus(cause)
        if old is None:
            return False
        if self._told is not None:
            self._told(self, old, cause)
        return True

    def set_connected(self, connected: bool, cause: str) -> bool:
        """The channel's state; True if it changed. A lost connection makes the worker
        prove itself to the prober again."""
        if connected == self.connected:
            return False
        self.connected = connected
        if not connected:
            self.probe.reset_for_reconnect()
        self.signalled(cause)
        return True

    def probed(self, result: ProbeResult, settings: ProbeConfig) -> None:
        """A probe's result, judged against the probe settings."""
        judge(self.probe, result, settings)
        self.signalled(f"probe: {result.detail}")

    def named_by(self, sources: tuple[str, ...]) -> None:
        """The sources that list this worker now (discovery keeps them current)."""
        self.sources = sources

    def set_in_service(self, in_service: bool, cause: str) -> None:
        """What its discovery source says of it. Out of service, it takes no new
        requests; those in flight finish."""
        if in_service != self.in_service:
            self.in_service = in_service
            self.signalled(cause)

    def reported(self, report: LoadReport) -> None:
        """A load report (GetLoads, or a KV event stream's load record)."""
        self.load, self.load_error = report, None

    def load_failed(self, reason: str) -> None:
        """A load poll that failed: the last report stays (aging), the reason is shown."""
        self.load_error = reason

    def loras_listed(self, ids: Iterable[str], as_of: int) -> None:
        """The adapters it says it holds (a poll asked when `lora_changes` was `as_of`):
        known ones keep their recency, new ones count as the most recently used. A list
        the gateway's own load or unload overtook is dropped (it may miss the load)."""
        if as_of != self.lora_changes:
            return
        listed = set(ids)
        kept = [a for a in self.loras if a in listed]
        self.loras = (*kept, *sorted(listed.difference(kept)))

    def lora_loaded(self, adapter: str) -> None:
        """The gateway loaded it here: the most recently used."""
        self._touch(adapter)
        self.lora_changes += 1

    def lora_unloaded(self, adapter: str) -> None:
        self.loras = tuple(a for a in self.loras if a != adapter)
        self.lora_changes += 1

    def _touch(self, adapter: str) -> None:
        self.loras = (*(a for a in self.loras if a != adapter), adapter)

    def lora_used(self, adapter: str) -> None:
        """A call for the adapter starts here (counted before its load: nothing evicts
        it meanwhile); a held adapter becomes the most recently used."""
        self.lora_calls[adapter] = self.lora_calls.get(adapter, 0) + 1
        if adapter in self.loras:
            self._touch(adapter)

    def lora_freed(self, adapter: str) -> None:
        """A call for the adapter ended here."""
        left = self.lora_calls.get(adapter, 0) - 1
        if left > 0:
            self.lora_calls[adapter] = left
        else:
            self.lora_calls.pop(adapter, None)

    def begin_drain(self) -> asyncio.Event | None:
        """No new requests from now on; the event set once in-flight ones are done (None:
        none in flight)."""
        self.draining = True
        self.signalled("draining")
        if not self.inflight:
            return None
        if self.idle is None:
            self.idle = asyncio.Event()
        return self.idle

    def end_drain(self) -> None:
        """New requests again (ResumeWorker), as soon as its other signals allow."""
        self.draining = False
        self.idle = None
        self.signalled("resumed")

    def restatus(self, cause: str) -> WorkerStatus | None:
        """Derive the status from the signals; the previous status if it changed."""
        status = derive_status(self.draining, self.connected, self.probe.healthy, self.in_service)
        if status is self.status:
            return None
        old, self.status, self.status_cause = self.status, status, cause
        return old

    def available(self, now: float) -> bool:
        """Routable: ready, and outlier detection admits a request (not ejected)."""
        return self.status is WorkerStatus.READY and self.outlier.admits(now)

    def __repr__(self) -> str:
        return f"Worker({self.id} {self.runtime}/{self.model}/{self.role} {self.status})"
