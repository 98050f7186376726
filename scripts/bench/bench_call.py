#!/usr/bin/env python3
"""The gateway's own cost per call, in process: what `scripts/bench/bench.py`'s gateway/bare
ratio is made of, measured without its noise. Not a test.

grpc's own work per call and per message (HTTP/2, the core's batches) is the same for the
gateway and for the bare grpc.aio relay; what differs is the Python each runs per call. So
this starts a simulated worker and the gateway in this process, puts a fake stream in
place of every upstream call (it answers at once: headers, N+1 messages, trailers) and a
fake client context in place of grpc's, and runs the gateway's Generate handler C calls at
a time, then the bare relay's handler (`scripts/bench/bare_relay.py`'s, line for line) against
the same fakes, in alternation. It prints the CPU per call of each and the difference:
the gateway's own cost per call, in microseconds, and per relayed message.

    python scripts/bench/bench_call.py --calls 20000 --tokens 16 [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bare_relay import relaying
from load_clients import request_bytes

from gateway.app.server import Gateway
from gateway.config import build_config
from gateway.upstream.worker import WorkerStatus
from gateway_sim.config import SimConfig
from gateway_sim.flags import add_sim_arguments
from gateway_sim.server import serve as serve_sim

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"
METADATA = (("user-agent", "grpc-c/1.0 bench"), ("content-type", "application/grpc"))
Handler = Callable[[Any, Any], Awaitable[Any]]


def answer_messages(tokens: int) -> list[bytes]:
    """A streamed answer as the simulated SGLang worker gives it: a chunk per token, then
    the Complete."""
    chunks = [
        sgl.GenerateResponse(
            request_id="bench",
            chunk=sgl.GenerateStreamChunk(token_ids=[7], prompt_tokens=64, completion_tokens=i),
        ).SerializeToString()
        for i in range(1, tokens + 1)
    ]
    complete = sgl.GenerateResponse(
        request_id="bench",
        complete=sgl.GenerateComplete(
            output_ids=[7] * tokens,
            finish_reason="length",
            prompt_tokens=64,
            completion_tokens=tokens,
        ),
    ).SerializeToString()
    return [*chunks, complete]


class FakeStream:
    """An upstream server-streaming call that answers at once (each read yields to the
    loop once, as a real one waits for its message)."""

    def __init__(self, messages: list[bytes]) -> None:
        self._messages = iter(messages)
        self._done = False

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("content-type", "application/grpc"),)

    async def read(self) -> Any:
        await asyncio.sleep(0)
        message = next(self._messages, aio.EOF)
        if message is aio.EOF:
            self._done = True
        return message

    async def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def code(self) -> Any:
        import grpc

        return grpc.StatusCode.OK

    async def details(self) -> str:
        return ""

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        return False


class FakeContext:
    """A client call as the handler sees grpc's context: one request message, writes that
    yield to the loop once."""

    def __init__(self, request: bytes) -> None:
        self._request: bytes | None = request
        self.trailers: Any = ()
        self.messages = 0

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return METADATA

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"

    def time_remaining(self) -> float | None:
        return None

    async def read(self) -> Any:
        request, self._request = self._request, None
        return aio.EOF if request is None else request

    async def write(self, message: bytes) -> None:
        self.messages += 1
        await asyncio.sleep(0)

    async def send_initial_metadata(self, metadata: Any) -> None:
        pass

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailers = metadata

    def code(self) -> Any:
        return None

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        raise RuntimeError(f"aborted: {code} {details}")


def bare_handler(messages: list[bytes]) -> Handler:
    """`scripts/bench/bare_relay.py`'s handler, on the fake upstream stream."""
    stream = relaying(lambda request, metadata, timeout: FakeStream(messages))

    async def handler(_requests: Any, context: Any) -> None:
        await stream(await context.read(), context)  # grpc reads a unary request itself

    return handler


async def run_calls(handler: Handler, request: bytes, calls: int, concurrency: int) -> float:
    """CPU seconds for `calls` calls of `handler`, `concurrency` at a time."""

    async def lane(count: int) -> None:
        for _ in range(count):
            await handler(None, FakeContext(request))

    gc.collect()
    began = time.process_time()
    share, extra = divmod(calls, concurrency)
    await asyncio.gather(*(lane(share + (i < extra)) for i in range(concurrency)))
    return time.process_time() - began


async def main_async(args: argparse.Namespace) -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    sim_config = SimConfig.from_args(parser.parse_args(["--listen", "127.0.0.1:0"]))
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    sim = asyncio.ensure_future(serve_sim(sim_config, ready=lambda port, _: ready.set_result(port)))
    port = await ready
    config = build_config(
        worker_urls=[f"grpc://127.0.0.1:{port}?model=bench&runtime=sglang"],
        overrides={
            "listen": "127.0.0.1:0",
            "admin.listen": "127.0.0.1:0",
            "metrics.listen": "off",
            "log_level": "warning",
        },
    )
    gw = Gateway(config)
    await gw.start()
    try:
        for _ in range(200):  # bounded: the worker identified and probed ready
            if all(w.status is WorkerStatus.READY for w in gw.parts.fleet.registry):
                break
            await asyncio.sleep(0.05)
        else:
            raise SystemExit("the simulated worker did not become ready")
        messages = answer_messages(args.tokens)
        gw.parts.fleet.method = lambda worker, path, streaming: (  # type: ignore[method-assign,misc]
            lambda request, metadata, timeout: FakeStream(messages)
        )
        front = next(f for f in gw.parts.fronts if f.adapter.service_name.startswith("sglang"))
        gateway = front._make(front.adapter.rpcs["Generate"])  # its handler
        bare = bare_handler(messages)
        request = request_bytes(args.tokens)
        await run_calls(gateway, request, args.calls // 10, args.concurrency)  # warm both
        await run_calls(bare, request, args.calls // 10, args.concurrency)
        own: list[float] = []
        for round_ in range(args.rounds):
            order = [("bare", bare), ("gateway", gateway)]
            seconds = {}
            for name, handler in order if round_ % 2 == 0 else order[::-1]:
                seconds[name] = await run_calls(handler, request, args.calls, args.concurrency)
            per_call = {name: s / args.calls * 1e6 for name, s in seconds.items()}
            own.append(per_call["gateway"] - per_call["bare"])
            print(
                f"round {round_ + 1}: gateway {per_call['gateway']:.1f} us/call, bare "
                f"{per_call['bare']:.1f} us/call: the gateway's own {own[-1]:.1f} us/call",
                flush=True,
            )
        median = statistics.median(own)
        print(
            f"\ncalls={args.calls} tokens={args.tokens} concurrency={args.concurrency}: the "
            f"gateway's own cost {median:.1f} us per call (median of {args.rounds}), "
            f"{median / (args.tokens + 1):.1f} us per relayed message"
        )
    finally:
        await gw.close()
        sim.cancel()
        with contextlib.suppress(asyncio.CancelledError, SystemExit):
            await sim


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20000, help="calls per phase")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per call")
    parser.add_argument("--concurrency", type=int, default=32, help="calls at a time")
    parser.add_argument("--rounds", type=int, default=3, help="bare/gateway rounds")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
