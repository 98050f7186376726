"""Simulated SGLang/vLLM gRPC worker serving the real smg-grpc-proto contracts.

Used for demos, end-to-end tests and benchmarks: ``gateway sim ...`` or
``python -m gateway.sim ...``. It prints ``READY <port>`` on stdout once listening,
followed by ``name=<port>`` for each side channel its role serves (``bootstrap=`` and
``embedding=`` for an SGLang prefill, ``kv=`` for a vLLM prefill).
"""

from gateway.sim.config import SimConfig, add_sim_arguments
from gateway.sim.server import run_sim, serve

__all__ = ["SimConfig", "add_sim_arguments", "run_sim", "serve"]
