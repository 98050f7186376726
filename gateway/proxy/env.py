"""What the stages run with: the serving process as one engine front's stages see it.

Its own module because more than the pipeline's table reads it: each group of stages
(`proxy/stages.py`, `proxy/tenant.py`), the fronts that build it, the fleet-wide calls,
and the picker's own stages. `Entrance` is what a call passes before it is placed,
`Routing` where and how it is placed, `StageEnv` both with the adapter and the
configuration, and `Stage` the shape of every step.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.config import DEFAULT_COST_TOKENS, GatewayConfig
from gateway.core.current import Current
from gateway.core.offload import Offload
from gateway.engines import EngineAdapter
from gateway.engines.usage import Tally, UsageBounds
from gateway.placement.placer import Placer
from gateway.placement.routes import RouteTable
from gateway.proxy.admission import Admission
from gateway.proxy.call import Call
from gateway.proxy.disagg import DisaggregatedDispatch
from gateway.proxy.dispatch import Dispatcher
from gateway.proxy.idle import IdleWatch
from gateway.proxy.intake import ReadGate
from gateway.proxy.reporting import OrcaTrailer
from gateway.proxy.waiting import WaitingRooms
from gateway.security.identity import Identities
from gateway.state.budgets import TenantBudgets
from gateway.state.sessions import SharedSessions
from gateway.upstream.registry import Registry


@dataclass(frozen=True, slots=True)
class Entrance:
    """What every engine call passes before it is placed (one of each per serving
    process, shared by its engine fronts): who sent it, the admission bounds, and the
    gate its request is read through; and what it leaves with: the process's load report
    on its trailers."""

    identities: Identities
    admission: Admission
    gate: ReadGate
    idle: IdleWatch  # the process's streams, each ended once idle too long
    rates: TenantBudgets | None = None  # tenants' requests and tokens per minute
    load: OrcaTrailer | None = None  # ORCA trailers on (see proxy/reporting.py)


@dataclass(frozen=True, slots=True)
class Routing:
    """Where a call goes and how it gets there: the workers, placement, the regular and
    the disaggregated dispatch, and the thread a long prompt is decoded and hashed in."""

    registry: Registry
    placer: Placer
    dispatcher: Dispatcher
    disagg: DisaggregatedDispatch
    offload: Offload
    rooms: WaitingRooms | None = None  # flow control: where busy models' calls wait
    routes: RouteTable = field(default_factory=lambda: RouteTable({}))  # model aliases
    sessions: SharedSessions | None = None  # session bindings in the shared store


@dataclass(frozen=True, slots=True)
class StageEnv:
    """What the stages read of the serving process: one per engine front."""

    adapter: EngineAdapter
    settings: Current[GatewayConfig]  # read at each use: a reload replaces it
    door: Entrance
    routing: Routing
    private_keys: frozenset[str]  # metadata keys never forwarded upstream

    @property
    def config(self) -> GatewayConfig:
        return self.settings.value

    @property
    def estimate(self) -> int:
        """A call's output in tokens, when it does not say."""
        flow = self.settings.value.flow
        return flow.cost_tokens if flow is not None else DEFAULT_COST_TOKENS

    def tally(self, call: Call) -> Tally | None:
        """A Generate's usage, read off its answers the engine's way and bounded by what
        it could have used (None for the other RPCs). One for every Generate, whoever
        relays its answer: the relay, or Envoy (the picker reads Envoy's copy)."""
        info = call.info
        if info is None:
            return None
        most = info.max_new_tokens or self.config.limits.max_completion_tokens
        prompt = call.record.prompt_tokens
        bounds = UsageBounds(completion_tokens=info.n * most, cached_tokens=prompt)
        return self.adapter.tally(info.stream, info.n, bounds)


class Stage(Protocol):
    """One step of the pipeline: a small function of the call and its door's `StageEnv`."""

    __name__: str

    def __call__(self, env: StageEnv, call: Call, /) -> Awaitable[None]: ...
