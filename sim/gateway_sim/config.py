"""The simulated worker process's configuration (``SimConfig``), resolved from its
command-line flags (flags.py); ``split_listen`` reads its listen address.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from gateway_sim.behaviour import Behaviour
from gateway_sim.timing import PROFILES


def split_listen(value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` too) so the name can use the bound port."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything the simulated worker process needs, resolved from the flags."""

    listen: str = "127.0.0.1:0"
    runtime: str = "sglang"
    model: str = "sim-model"
    model_path: str = "sim/sim-model"
    name: str | None = None
    behaviour: Behaviour = field(default_factory=Behaviour)
    not_serving: bool = False
    grpc_health: bool = True
    dp_ranks: int = 1
    max_running: int | None = None
    log_level: str = "warning"
    health_delay_s: float | None = 0.0  # None: never answer
    load_waiting: int = 0
    load_token_usage: float = 0.0
    role: str = "regular"
    bootstrap_port: int = 0
    bootstrap_timeout_s: float = 3.0
    embedding_port: int = 0
    embedding_timeout_s: float = 3.0
    kv_port: int = 0
    kv_timeout_s: float = 3.0
    omit_kv_params: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    max_model_len: int = 2048
    vocab_size: int = 512
    block_size: int = 128
    kv_blocks: int = 4096
    prefill_s_per_token: float = 0.0
    kv_relay: str = "python"
    kv_history: int = 1024
    kv_drop_rate: float = 0.0
    kv_heartbeat_s: float = 1.0  # 0: no heartbeats
    kv_heartbeat_backoff_s: float = 5.0
    kv_queue: int = 1024
    kv_events: bool = True
    max_loras: int | None = None  # None: any lora_id is taken, loads never refused
    lora_load_s: float = 0.0
    timing: str | None = None  # a timing profile's name (timing.py); None: the fixed knobs
    speed: float = 1.0  # every duration the worker takes is divided by it
    max_batch: int | None = None  # calls running at once per DP rank; None: no limit
    max_queue: int = 1024  # calls waiting for a slot per DP rank, past it refused

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SimConfig:
        """Build the config from parsed ``add_sim_arguments`` flags."""
        return cls(
            listen=args.listen,
            runtime=args.runtime,
            model=args.model,
            model_path=args.model_path or f"sim/{args.model}",
            name=args.name,
            behaviour=Behaviour(
                tokens=args.tokens,
                ttft_ms=args.ttft_ms,
                token_ms=args.token_ms,
                fail_code=args.fail_code,
                fail_after=args.fail_after,
                exit_after=args.exit_after,
                stall=args.stall,
                tokens_per_chunk=args.tokens_per_chunk,
                headers_first=args.headers_first,
                completion_tokens=args.usage_completion_tokens,
                abort_completes=args.abort_completes,
            ),
            not_serving=args.not_serving,
            grpc_health=args.grpc_health,
            dp_ranks=args.dp_ranks,
            max_running=args.max_running,
            health_delay_s=None if args.health_hang else args.health_delay_ms / 1000.0,
            load_waiting=args.load_waiting,
            load_token_usage=args.load_token_usage,
            log_level=args.log_level,
            role=args.role,
            bootstrap_port=args.bootstrap_port,
            bootstrap_timeout_s=args.bootstrap_timeout_ms / 1000.0,
            embedding_port=args.embedding_port,
            embedding_timeout_s=args.embedding_timeout_ms / 1000.0,
            kv_port=args.kv_port,
            kv_timeout_s=args.kv_timeout_ms / 1000.0,
            omit_kv_params=args.omit_kv_params,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            max_model_len=args.max_model_len,
            vocab_size=args.vocab_size,
            block_size=args.block_size,
            kv_blocks=args.kv_blocks,
            prefill_s_per_token=args.prefill_us_per_token / 1_000_000.0,
            kv_relay=args.kv_relay,
            kv_history=args.kv_history,
            kv_drop_rate=args.kv_drop_rate,
            kv_heartbeat_s=args.kv_heartbeat_ms / 1000.0,
            kv_heartbeat_backoff_s=args.kv_heartbeat_backoff_ms / 1000.0,
            kv_queue=args.kv_queue,
            kv_events=args.kv_events,
            max_loras=args.max_loras,
            lora_load_s=args.lora_load_ms / 1000.0,
            timing=args.timing,
            speed=args.speed,
            max_batch=args.max_batch
            if args.max_batch is not None or args.timing is None
            else PROFILES[args.timing].max_batch,
            max_queue=args.max_queue,
        )

    def worker_name(self, port: int) -> str:
        """The name once the port is known: ``--name`` or ``<runtime>@<host>:<port>``
        (``encoder@...`` for an encoder, which speaks neither runtime)."""
        if self.name:
            return self.name
        host, _ = split_listen(self.listen)
        kind = "encoder" if self.role == "encode" else self.runtime
        return f"{kind}@{host}:{port}"
