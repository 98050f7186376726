"""Which gRPC servicer a ``--runtime``/``--role`` pair serves, and the TCP side servers
(bootstrap, embedding, KV channel) it needs running before the worker is READY."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from smg_grpc_proto.generated import sglang_encoder_pb2_grpc as enc_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc

from gateway_sim import encoder, sglang, sglang_pd, vllm, vllm_pd
from gateway_sim.engine import SimEngine
from gateway_sim.lines import LineServer


@dataclass(frozen=True, slots=True)
class Wiring:
    """What ``serve`` registers and starts for one worker."""

    service_name: str
    register: Callable[[grpc.aio.Server], None]
    side_servers: list[LineServer] = field(default_factory=list)


def wire(engine: SimEngine) -> Wiring:
    config = engine.config
    role = config.role
    if role == "encode":
        servicer: Any = encoder.EncoderServicer(engine)
        return Wiring(
            encoder.SERVICE_NAME,
            lambda server: enc_grpc.add_SglangEncoderServicer_to_server(servicer, server),
        )
    if config.runtime == "vllm":
        if role == "prefill":
            servicer = vllm_pd.VllmPrefillServicer(engine)
        elif role == "decode":
            servicer = vllm_pd.VllmDecodeServicer(engine)
        else:
            servicer = vllm.VllmServicer(engine)
        return Wiring(
            vllm.SERVICE_NAME,
            lambda server: vllm_grpc.add_VllmEngineServicer_to_server(servicer, server),
            list(getattr(servicer, "side_servers", [])),
        )
    if role == "prefill":
        servicer = sglang_pd.SglangPrefillServicer(engine)
    elif role == "decode":
        servicer = sglang_pd.SglangDecodeServicer(engine)
    else:
        servicer = sglang.SglangServicer(engine)
    return Wiring(
        sglang.SERVICE_NAME,
        lambda server: sgl_grpc.add_SglangSchedulerServicer_to_server(servicer, server),
        list(getattr(servicer, "side_servers", [])),
    )
