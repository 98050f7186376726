import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATUS_UNSPECIFIED: _ClassVar[WorkerStatus]
    WORKER_STATUS_PENDING: _ClassVar[WorkerStatus]
    WORKER_STATUS_READY: _ClassVar[WorkerStatus]
    WORKER_STATUS_NOT_READY: _ClassVar[WorkerStatus]
    WORKER_STATUS_DRAINING: _ClassVar[WorkerStatus]
    WORKER_STATUS_UNIDENTIFIED: _ClassVar[WorkerStatus]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_REGULAR: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_ENCODE: _ClassVar[Role]

class BreakerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BREAKER_STATE_UNSPECIFIED: _ClassVar[BreakerState]
    BREAKER_STATE_CLOSED: _ClassVar[BreakerState]
    BREAKER_STATE_HALF_OPEN: _ClassVar[BreakerState]
    BREAKER_STATE_OPEN: _ClassVar[BreakerState]

class ProbeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBE_KIND_UNSPECIFIED: _ClassVar[ProbeKind]
    PROBE_KIND_SERVING: _ClassVar[ProbeKind]
    PROBE_KIND_NOT_SERVING: _ClassVar[ProbeKind]
    PROBE_KIND_ERROR: _ClassVar[ProbeKind]

class WorkerEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_EVENT_KIND_UNSPECIFIED: _ClassVar[WorkerEventKind]
    WORKER_EVENT_KIND_SNAPSHOT: _ClassVar[WorkerEventKind]
    WORKER_EVENT_KIND_ADDED: _ClassVar[WorkerEventKind]
    WORKER_EVENT_KIND_REMOVED: _ClassVar[WorkerEventKind]
    WORKER_EVENT_KIND_STATUS: _ClassVar[WorkerEventKind]
    WORKER_EVENT_KIND_BREAKER: _ClassVar[WorkerEventKind]
WORKER_STATUS_UNSPECIFIED: WorkerStatus
WORKER_STATUS_PENDING: WorkerStatus
WORKER_STATUS_READY: WorkerStatus
WORKER_STATUS_NOT_READY: WorkerStatus
WORKER_STATUS_DRAINING: WorkerStatus
WORKER_STATUS_UNIDENTIFIED: WorkerStatus
ROLE_UNSPECIFIED: Role
ROLE_REGULAR: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_ENCODE: Role
BREAKER_STATE_UNSPECIFIED: BreakerState
BREAKER_STATE_CLOSED: BreakerState
BREAKER_STATE_HALF_OPEN: BreakerState
BREAKER_STATE_OPEN: BreakerState
PROBE_KIND_UNSPECIFIED: ProbeKind
PROBE_KIND_SERVING: ProbeKind
PROBE_KIND_NOT_SERVING: ProbeKind
PROBE_KIND_ERROR: ProbeKind
WORKER_EVENT_KIND_UNSPECIFIED: WorkerEventKind
WORKER_EVENT_KIND_SNAPSHOT: WorkerEventKind
WORKER_EVENT_KIND_ADDED: WorkerEventKind
WORKER_EVENT_KIND_REMOVED: WorkerEventKind
WORKER_EVENT_KIND_STATUS: WorkerEventKind
WORKER_EVENT_KIND_BREAKER: WorkerEventKind

class Probe(_message.Message):
    __slots__ = ("kind", "detail", "time")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    kind: ProbeKind
    detail: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, kind: _Optional[_Union[ProbeKind, str]] = ..., detail: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("running", "waiting", "token_usage", "time")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_USAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    token_usage: float
    time: _timestamp_pb2.Timestamp
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., token_usage: _Optional[float] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("id", "url", "model", "runtime", "role", "status", "status_cause", "inflight", "breaker_state", "last_probe", "load", "load_error", "connected", "bootstrap_port", "kv_index", "sources", "in_service", "lora_adapters")
    ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_CAUSE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    BREAKER_STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_PROBE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LOAD_ERROR_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    IN_SERVICE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    id: str
    url: str
    model: str
    runtime: str
    role: Role
    status: WorkerStatus
    status_cause: str
    inflight: int
    breaker_state: BreakerState
    last_probe: Probe
    load: Load
    load_error: str
    connected: bool
    bootstrap_port: int
    kv_index: KvIndexState
    sources: _containers.RepeatedScalarFieldContainer[str]
    in_service: bool
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., url: _Optional[str] = ..., model: _Optional[str] = ..., runtime: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., status: _Optional[_Union[WorkerStatus, str]] = ..., status_cause: _Optional[str] = ..., inflight: _Optional[int] = ..., breaker_state: _Optional[_Union[BreakerState, str]] = ..., last_probe: _Optional[_Union[Probe, _Mapping]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., load_error: _Optional[str] = ..., connected: _Optional[bool] = ..., bootstrap_port: _Optional[int] = ..., kv_index: _Optional[_Union[KvIndexState, _Mapping]] = ..., sources: _Optional[_Iterable[str]] = ..., in_service: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class KvIndexState(_message.Message):
    __slots__ = ("blocks", "subscription", "exact")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    subscription: str
    exact: bool
    def __init__(self, blocks: _Optional[int] = ..., subscription: _Optional[str] = ..., exact: _Optional[bool] = ...) -> None: ...

class AddWorkerRequest(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...

class AddWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: Worker
    def __init__(self, worker: _Optional[_Union[Worker, _Mapping]] = ...) -> None: ...

class RemoveWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "drain_timeout")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    drain_timeout: _duration_pb2.Duration
    def __init__(self, worker_id: _Optional[str] = ..., drain_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RemoveWorkerResponse(_message.Message):
    __slots__ = ("worker", "drained")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    worker: Worker
    drained: bool
    def __init__(self, worker: _Optional[_Union[Worker, _Mapping]] = ..., drained: _Optional[bool] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "wait")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    wait: _duration_pb2.Duration
    def __init__(self, worker_id: _Optional[str] = ..., wait: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("worker", "drained")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    worker: Worker
    drained: bool
    def __init__(self, worker: _Optional[_Union[Worker, _Mapping]] = ..., drained: _Optional[bool] = ...) -> None: ...

class ResumeWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class ResumeWorkerResponse(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: Worker
    def __init__(self, worker: _Optional[_Union[Worker, _Mapping]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers", "sessions")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    sessions: int
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., sessions: _Optional[int] = ...) -> None: ...

class WatchWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusChange(_message.Message):
    __slots__ = ("old_status", "new_status")
    OLD_STATUS_FIELD_NUMBER: _ClassVar[int]
    NEW_STATUS_FIELD_NUMBER: _ClassVar[int]
    old_status: WorkerStatus
    new_status: WorkerStatus
    def __init__(self, old_status: _Optional[_Union[WorkerStatus, str]] = ..., new_status: _Optional[_Union[WorkerStatus, str]] = ...) -> None: ...

class BreakerChange(_message.Message):
    __slots__ = ("old_state", "new_state")
    OLD_STATE_FIELD_NUMBER: _ClassVar[int]
    NEW_STATE_FIELD_NUMBER: _ClassVar[int]
    old_state: BreakerState
    new_state: BreakerState
    def __init__(self, old_state: _Optional[_Union[BreakerState, str]] = ..., new_state: _Optional[_Union[BreakerState, str]] = ...) -> None: ...

class WatchWorkersResponse(_message.Message):
    __slots__ = ("kind", "worker", "cause", "time", "status_change", "breaker_change")
    KIND_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STATUS_CHANGE_FIELD_NUMBER: _ClassVar[int]
    BREAKER_CHANGE_FIELD_NUMBER: _ClassVar[int]
    kind: WorkerEventKind
    worker: Worker
    cause: str
    time: _timestamp_pb2.Timestamp
    status_change: StatusChange
    breaker_change: BreakerChange
    def __init__(self, kind: _Optional[_Union[WorkerEventKind, str]] = ..., worker: _Optional[_Union[Worker, _Mapping]] = ..., cause: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., status_change: _Optional[_Union[StatusChange, _Mapping]] = ..., breaker_change: _Optional[_Union[BreakerChange, _Mapping]] = ...) -> None: ...

class ListQueuesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QueueDepth(_message.Message):
    __slots__ = ("model", "priority", "tenant", "waiting")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    model: str
    priority: str
    tenant: str
    waiting: int
    def __init__(self, model: _Optional[str] = ..., priority: _Optional[str] = ..., tenant: _Optional[str] = ..., waiting: _Optional[int] = ...) -> None: ...

class ListQueuesResponse(_message.Message):
    __slots__ = ("enabled", "queues")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    queues: _containers.RepeatedCompositeFieldContainer[QueueDepth]
    def __init__(self, enabled: _Optional[bool] = ..., queues: _Optional[_Iterable[_Union[QueueDepth, _Mapping]]] = ...) -> None: ...

class RouteTarget(_message.Message):
    __slots__ = ("model", "weight")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    model: str
    weight: int
    def __init__(self, model: _Optional[str] = ..., weight: _Optional[int] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("alias", "targets")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    alias: str
    targets: _containers.RepeatedCompositeFieldContainer[RouteTarget]
    def __init__(self, alias: _Optional[str] = ..., targets: _Optional[_Iterable[_Union[RouteTarget, _Mapping]]] = ...) -> None: ...

class ListRoutesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRoutesResponse(_message.Message):
    __slots__ = ("routes",)
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    def __init__(self, routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ...) -> None: ...

class SetRouteRequest(_message.Message):
    __slots__ = ("alias", "targets")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    alias: str
    targets: _containers.RepeatedCompositeFieldContainer[RouteTarget]
    def __init__(self, alias: _Optional[str] = ..., targets: _Optional[_Iterable[_Union[RouteTarget, _Mapping]]] = ...) -> None: ...

class SetRouteResponse(_message.Message):
    __slots__ = ("route",)
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    route: Route
    def __init__(self, route: _Optional[_Union[Route, _Mapping]] = ...) -> None: ...
