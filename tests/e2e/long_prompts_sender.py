"""Sends N concurrent Generate calls with a long prompt, from its own process (so the
measuring test's event loop is not the one serializing megabytes): `python -m
tests.e2e.long_prompts_sender ADDRESS MODEL API_KEY TOKENS N`. Prints `ready` once the
request is built (its start-up is not part of what a test measures), sends on a line
on stdin, prints `sent` once every call is under way, then holds them until it is
killed. It runs at nice 19: it stands for
clients on other machines, so its CPU must not be taken from the gateway's."""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

from gateway_sim.client import channel

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"


async def main(address: str, model: str, key: str, tokens: int, calls: int) -> None:
    ids = np.random.default_rng(1).integers(0, 150_000, tokens, dtype=np.uint32)
    request = sgl.GenerateRequest(
        request_id="long",
        tokenized=sgl.TokenizedInput(input_ids=ids),
        sampling_params=sgl.SamplingParams(max_new_tokens=1),
        stream=True,
    ).SerializeToString()
    metadata = (("x-model-id", model), ("authorization", f"Bearer {key}"))
    async with channel(address) as ch:
        generate = ch.unary_stream(GENERATE)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        running = [generate(request, metadata=metadata, timeout=120) for _ in range(calls)]
        print("sent", flush=True)
        await asyncio.gather(*(call.wait_for_connection() for call in running))
        await asyncio.sleep(3600)


if __name__ == "__main__":
    address, model, key, tokens, calls = sys.argv[1:6]
    os.nice(19)
    asyncio.run(main(address, model, key, int(tokens), int(calls)))
