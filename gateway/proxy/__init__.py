"""The proxy: the engine fronts, the call pipeline and its stages, dispatch and the
upstream calls. What the rest of the gateway (the serving process's assembly, the
endpoint picker, the peer service, ORCA) may use of it is named here; its modules are
its own business."""

from gateway.proxy import stages
from gateway.proxy.admission import Admission
from gateway.proxy.call import Call, Downstream
from gateway.proxy.disagg import DisaggregatedDispatch
from gateway.proxy.dispatch import Dispatcher
from gateway.proxy.env import Entrance, Routing, Stage, StageEnv
from gateway.proxy.failures import clients_deadline
from gateway.proxy.front import EngineFront
from gateway.proxy.idle import IdleWatch
from gateway.proxy.inflight import InflightTable
from gateway.proxy.intake import NO_REQUEST, ReadGate, ReadTimeout
from gateway.proxy.job import Job
from gateway.proxy.legs import BootstrapRooms
from gateway.proxy.lora import LoraLoader
from gateway.proxy.metadata import UNREAD, Metadata, MetadataRelay
from gateway.proxy.migration import UNFOLLOWED, Migrations
from gateway.proxy.reporting import LOAD_TRAILER
from gateway.proxy.reservation import Reservation, ReservedPlacement
from gateway.proxy.stages import OPENING, PLACED, REGULAR_ONLY
from gateway.proxy.status import abort_invalid
from gateway.proxy.upstream import Upstreams
from gateway.proxy.waiting import WaitingRooms

__all__ = [
    "LOAD_TRAILER",
    "NO_REQUEST",
    "OPENING",
    "PLACED",
    "REGULAR_ONLY",
    "UNFOLLOWED",
    "UNREAD",
    "Admission",
    "BootstrapRooms",
    "Call",
    "DisaggregatedDispatch",
    "Dispatcher",
    "Downstream",
    "EngineFront",
    "Entrance",
    "IdleWatch",
    "InflightTable",
    "Job",
    "LoraLoader",
    "Metadata",
    "MetadataRelay",
    "Migrations",
    "ReadGate",
    "ReadTimeout",
    "Reservation",
    "ReservedPlacement",
    "Routing",
    "Stage",
    "StageEnv",
    "Upstreams",
    "WaitingRooms",
    "abort_invalid",
    "clients_deadline",
    "stages",
]
