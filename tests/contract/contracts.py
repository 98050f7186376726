"""The worker contracts: vLLM's and SGLang's, each with one worker and with a prefill/decode
pair; each names its engine's service, its calls (calls_*.py), the form of its Abort, its
KV scenario and the transcript of a real worker's answers."""

from __future__ import annotations

from tests.contract.calls import (
    BLOCK_SIZE,
    DECODE,
    PREFILL,
    SGLANG_SERVICE,
    VLLM_SERVICE,
    Contract,
    KvRestart,
)
from tests.contract.calls_pd import SGLANG_PD_CALLS, VLLM_PD_CALLS
from tests.contract.calls_sglang import SGLANG_CALLS, SGLANG_PAGE_SIZE
from tests.contract.calls_vllm import VLLM_CALLS

KV_RESTART = KvRestart()


VLLM = Contract(
    name="vllm",
    engine="vllm",
    service=VLLM_SERVICE,
    calls=VLLM_CALLS,
    transcript="vllm-0.32.0.json",
    block_size=BLOCK_SIZE,
    abort=lambda request_id: {"request_ids": [request_id]},
    kv=KV_RESTART,
)
SGLANG = Contract(
    name="sglang",
    engine="sglang",
    service=SGLANG_SERVICE,
    calls=SGLANG_CALLS,
    transcript="sglang-0.5.23.json",
    block_size=SGLANG_PAGE_SIZE,
    abort=lambda request_id: {"request_id": request_id},
)
VLLM_PD = Contract(
    name="vllm-pd",
    engine="vllm",
    service=VLLM_SERVICE,
    calls=VLLM_PD_CALLS,
    transcript="vllm-pd-0.32.0.json",
    block_size=BLOCK_SIZE,
    abort=VLLM.abort,
    legs=(PREFILL, DECODE),
)
SGLANG_PD = Contract(
    name="sglang-pd",
    engine="sglang",
    service=SGLANG_SERVICE,
    calls=SGLANG_PD_CALLS,
    transcript="sglang-pd-0.5.23.json",
    block_size=SGLANG_PAGE_SIZE,
    abort=SGLANG.abort,
    legs=(PREFILL, DECODE),
)
CONTRACTS: dict[str, Contract] = {
    contract.name: contract for contract in (VLLM, SGLANG, VLLM_PD, SGLANG_PD)
}
