"""Simulated SGLang/vLLM gRPC worker serving the real smg-grpc-proto contracts.

Its own distribution (``grpc-model-gateway-sim``, in the repository's ``sim/``), not part
of the gateway's wheel; it imports nothing from the gateway (only ``gateway_sim.demo``
does). Used for the demo, end-to-end tests and benchmarks: ``gateway sim ...``,
``gateway-sim ...`` or ``python -m gateway_sim ...``. It prints ``READY <port>`` on stdout
once listening, followed by ``name=<port>`` for each side channel its role serves
(``bootstrap=`` and ``embedding=`` for an SGLang prefill, ``kv=`` for a vLLM prefill).
"""

from gateway_sim.config import SimConfig
from gateway_sim.flags import add_sim_arguments
from gateway_sim.server import run_sim, serve

__all__ = ["SimConfig", "add_sim_arguments", "run_sim", "serve"]
