"""Whether a real engine's gRPC server tolerates HTTP/2 keepalive pings while a call sends
nothing (docs/real-engines.md, Keepalive).

    .venv/bin/python scripts/engines/keepalive.py                  # vLLM
    .venv/bin/python scripts/engines/keepalive.py --engine sglang  # SGLang (its add-ons)

Starts one real worker on 127.0.0.1 (the engines venv, the tiny model), then sends it
Generates that write nothing until they end (unstreamed, `ignore_eos`, a few thousand
tokens: several seconds of silence) over a channel of its own that pings every
`--intervals` milliseconds, with no other call on the connection (nothing the server
writes in between clears its strike count, as the gateway's probes would), and prints,
per interval, how long the call was silent and how it ended: OK, or the GOAWAY
`too_many_pings` (UNAVAILABLE) of a server that counts the pings as strikes. The worker
is stopped on every path.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
import time
from pathlib import Path
from typing import Any

from grpc import aio

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc  # noqa: E402

from scripts.engines.worker import EngineWorker  # noqa: E402

PROMPT = [1, 5, 9]
CALL_TIMEOUT_S = 600.0


def silent_request(engine: str, tokens: int) -> Any:
    """A Generate that answers once, at its end."""
    if engine == "sglang":
        return sgl.GenerateRequest(
            request_id=f"ka-{time.monotonic_ns()}",
            tokenized=sgl.TokenizedInput(input_ids=PROMPT),
            sampling_params=sgl.SamplingParams(max_new_tokens=tokens, ignore_eos=True),
            stream=False,
        )
    return vllm.GenerateRequest(
        request_id=f"ka-{time.monotonic_ns()}",
        tokenized=vllm.TokenizedInput(input_ids=PROMPT),
        sampling_params=vllm.SamplingParams(max_tokens=tokens, ignore_eos=True),
        stream=False,
    )


async def silent_call(
    address: str, engine: str, tokens: int, ping_ms: int, calls: int
) -> tuple[float, str]:
    """Seconds `calls` concurrent silent calls on one connection took (more at once: a
    longer silence), and how they ended (the first failure, else OK)."""
    options = [
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),  # as the gateway's channels
        ("grpc.http2.bdp_probe", 0),
        # A connection of its own: grpc shares subchannels between channels of a process,
        # and one that got GOAWAY too_many_pings keeps its throttled (doubled) keepalive.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    async with aio.insecure_channel(address, options=options) as channel:
        stub: Any = (
            sgl_grpc.SglangSchedulerStub(channel)
            if engine == "sglang"
            else vllm_grpc.VllmEngineStub(channel)
        )

        async def one() -> str:
            request = silent_request(engine, tokens)
            try:
                async for _ in stub.Generate(request, timeout=CALL_TIMEOUT_S):
                    pass
            except aio.AioRpcError as error:
                return f"{error.code().name}: {error.details()}"
            return "OK"

        began = time.monotonic()
        ended = await asyncio.gather(*(one() for _ in range(calls)))
        failed = [outcome for outcome in ended if outcome != "OK"]
        return time.monotonic() - began, failed[0] if failed else "OK"


def start_worker(args: argparse.Namespace) -> Any:
    if args.engine == "sglang":
        module = importlib.import_module("scripts.engines.sglang_worker")
        worker: Any = module.SglangWorker(args.engines_python, args.model)
    else:
        worker = EngineWorker(args.engines_python, args.model)
    return worker


async def measure(args: argparse.Namespace) -> None:
    worker = start_worker(args)
    try:
        print(f"{args.engine} worker {worker.address}: started in {worker.start():.1f} s")
        for ping_ms in args.intervals:
            took, ended = await silent_call(
                worker.address, args.engine, args.tokens, ping_ms, args.calls
            )
            print(
                f"ping every {ping_ms} ms, {args.calls} x {args.tokens} tokens unstreamed: "
                f"silent {took:.1f} s, {ended}",
                flush=True,
            )
    finally:
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--engines-python", default=str(ROOT / ".venv-engines/bin/python"))
    parser.add_argument("--model", default=str(ROOT / ".engines/model"))
    parser.add_argument("--tokens", type=int, default=2000, help="tokens of each silent call")
    parser.add_argument(
        "--calls", type=int, default=1, help="silent calls at once on the connection"
    )
    parser.add_argument(
        "--intervals",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[10_000, 1_000, 200],
        help="ping intervals to try, in ms (comma-separated)",
    )
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
