"""The attacks of workers that send too much (issue 38's items 5-7; affinity and reload:
affinity_reload_scenarios.py): migration's memory over long streams and many streams, a
worker's answer that does not decode, a worker listing 200,000 LoRA adapters or hanging
its loads. The hostile workers run in this process (gateway_sim/hostile.py), the gateway
in its own."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import Any

from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from gateway.admin.v1 import admin_pb2 as admin_pb
from gateway_sim.client import (
    SGL,
    admin_address,
    collect,
    list_workers,
    model_md,
    wait_health,
)
from gateway_sim.hostile import Hostile, hostile
from gateway_sim.launch import Child
from scripts.attacks.harness import Scenario, until
from scripts.attacks.observe import MIB
from scripts.attacks.readings import metric, shown, tally

# (scenarios.py registers these: nothing of it is imported here, so either loads first.)
ISSUE_MIGRATION_MIB = 395.0  # 100 streams of 100,000 tokens, migration on, before the fix
WAIT_S = 20.0  # bound on every wait for the state an attack leaves
PER_CHANNEL = 125  # streams per connection, under grpc's 256


def request(request_id: str, tokens: int, lora: str = "") -> bytes:
    """A one-token-prompt streamed Generate of `tokens` new tokens, serialized."""
    message: Any = pb.GenerateRequest(
        request_id=request_id,
        tokenized=pb.TokenizedInput(input_ids=[1]),
        sampling_params=pb.SamplingParams(max_new_tokens=tokens),
        stream=True,
    )
    if lora:
        message.lora_id = lora
    return bytes(message.SerializeToString())


async def raw_call(
    ch: aio.Channel, model: str, body: bytes, extra: tuple[tuple[str, str], ...] = ()
) -> tuple[list[bytes], str]:
    """A Generate as a client that does not decode its answers: their bytes, its status."""
    call = ch.unary_stream(SGL + "Generate")(body, metadata=model_md(model, *extra), timeout=30)
    messages, error = await collect(call)
    return messages, "OK" if error is None else error.code().name


class HostileScenario(Scenario):
    """A scenario with hostile workers served in this process until it ends."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.stack = contextlib.AsyncExitStack()

    async def serve(self, worker: Hostile) -> Hostile:
        return await self.stack.enter_async_context(hostile(worker))

    async def end(self) -> None:
        await self.run.cancel_spawned()
        await self.run.close_channels()
        await self.stack.aclose()


# --------------------------------------------------------------------------- migration


class KeptTokens(HostileScenario):
    """A migration scenario: its streams' kept tokens all given back once they ended."""

    async def tokens_given_back(self) -> None:
        assert self.run.gw is not None
        gw = self.run.gw

        async def released() -> bool:
            return await metric(gw, "gateway_migration_kept_tokens") in (0.0, None)

        await until(released, WAIT_S)
        self.note(
            "tokens kept once the streams ended",
            shown(await metric(gw, "gateway_migration_kept_tokens")),
            await released(),
        )


class MigrationMemory(KeptTokens):
    name = "migration-memory"
    summary = (
        "100 Generate streams of 100,000 tokens each (100 a chunk) relayed, then held open: "
        "what migration keeps of them"
    )
    STREAMS, TOKENS, PER_CHUNK = 100, 100_000, 100

    async def prepare(self) -> Child:
        self.run.workers()
        self.worker = await self.serve(Hostile(per_chunk=self.PER_CHUNK, hold=True))
        return self.run.gateway({}, self.worker.url("long"))

    async def stream(self, ch: aio.Channel, n: int) -> None:
        call = ch.unary_stream(SGL + "Generate")(
            request(f"long-{n}", self.TOKENS), metadata=model_md("long")
        )
        async for _ in call:
            self.messages += 1

    async def begin(self) -> None:
        assert self.run.gw is not None and self.run.memory is not None
        gw, memory = self.run.gw, self.run.memory
        before, _ = memory.now()
        self.messages = 0
        ch = self.run.channel()
        for n in range(self.STREAMS):
            self.run.spawn(self.stream(ch, n))
        expected = self.STREAMS * self.TOKENS // self.PER_CHUNK

        async def relayed() -> bool:
            return self.messages >= expected and self.worker.held == self.STREAMS

        done = await until(relayed, 300)
        after, _ = memory.now()
        growth = after - before
        tokens = self.STREAMS * self.TOKENS
        self.note(
            "RSS with every token relayed, streams open",
            f"{growth:+.1f} MiB ({growth * MIB / tokens:.1f} B/token); before the fix: "
            f"+{ISSUE_MIGRATION_MIB:.0f} MiB",
            done and growth <= ISSUE_MIGRATION_MIB / 10,
        )
        self.note("tokens kept (gauge)", shown(await metric(gw, "gateway_migration_kept_tokens")))

    async def end(self) -> None:
        await super().end()
        await self.tokens_given_back()


class MigrationBudget(KeptTokens):
    name = "migration-budget"
    summary = (
        "4,096 Generate streams of 8,192 tokens (33.6 M tokens) held open, "
        "migration.max_kept_tokens 8 M: the process-wide budget"
    )
    # 128 answers of 64 tokens (~27 KB): a stream's first 16 KiB are read (~5,000 ids),
    # the rest kept raw until the stream ends (KEEP_BYTES)
    STREAMS, TOKENS, PER_CHUNK = 4_096, 8_192, 64
    BUDGET = 8 * 1024 * 1024

    async def prepare(self) -> Child:
        self.run.workers()
        self.worker = await self.serve(Hostile(per_chunk=self.PER_CHUNK, hold=True))
        config = {
            "migration": {"max_kept_tokens": self.BUDGET},
            # every stream from one address: room for them all, and the legit client's
            "limits": {"max_inflight_requests": 8192, "max_inflight_per_principal": 8192},
        }
        return self.run.gateway(config, self.worker.url("many"))

    async def stream(self, ch: aio.Channel, n: int) -> None:
        call = ch.unary_stream(SGL + "Generate")(
            request(f"many-{n}", self.TOKENS), metadata=model_md("many")
        )
        async for _ in call:
            pass

    async def begin(self) -> None:
        assert self.run.gw is not None and self.run.memory is not None
        gw, memory = self.run.gw, self.run.memory
        before, _ = memory.now()
        for n in range(self.STREAMS):
            if n % PER_CHANNEL == 0:
                ch = self.run.channel()
            self.run.spawn(self.stream(ch, n))
            if n % PER_CHANNEL == PER_CHANNEL - 1:
                await asyncio.sleep(0.1)  # a burst per connection (see RAMP_S)

        async def held() -> bool:
            return self.worker.held == self.STREAMS

        done = await until(held, 240)
        after, _ = memory.now()
        kept = await metric(gw, "gateway_migration_kept_tokens")
        self.note("streams relayed to the end and held", f"{self.worker.held:,}", done)
        self.note(
            "tokens kept at the peak",
            f"{shown(kept)} of {self.BUDGET:,} ({after - before:+.1f} MiB RSS)",
            kept is not None and kept <= self.BUDGET,
        )
        unfollowed = await metric(gw, "gateway_migration_unfollowed_total", reason="budget")
        self.note("streams no longer followed: budget", shown(unfollowed))

    async def end(self) -> None:
        await super().end()
        await self.tokens_given_back()


class WorkerGarbage(HostileScenario):
    name = "worker-garbage"
    summary = (
        "a worker whose 4th answer of a 2,000-token stream does not decode; two more that "
        "fail a stream after 5 answers and send garbage in its continuation"
    )
    CALLS = 20

    async def prepare(self) -> Child:
        self.run.workers()
        self.garbage = await self.serve(Hostile(garbage_at={0: 3}))
        self.flaky = [
            await self.serve(Hostile(fail_at={0: 5}, garbage_at={1: 3})) for _ in range(2)
        ]
        urls = [self.garbage.url("garbage"), *(w.url("flaky") for w in self.flaky)]
        gw = self.run.gateway({}, *urls)
        await wait_health(gw.address, "garbage")
        await wait_health(gw.address, "flaky")
        return gw

    async def begin(self) -> None:
        same, codes = 0, Counter[str]()
        ch = self.run.channel()
        async with aio.insecure_channel(self.garbage.address) as direct:
            for n in range(self.CALLS):
                body = request(f"g-{n}", 2_000)
                expected = await raw_call(direct, "garbage", body)
                got = await raw_call(ch, "garbage", body)
                same += got == expected
                codes[got[1]] += 1
        self.note(
            "undecodable answer: as a direct client gets it",
            f"{same}/{self.CALLS} identical ({tally(codes)})",
            same == self.CALLS,
        )
        whole, codes = 0, Counter()
        for n in range(self.CALLS):
            messages, code = await raw_call(ch, "flaky", request(f"f-{n}", 20))
            codes[code] += 1
            ids = [
                t
                for m in messages
                for t in pb.GenerateResponse.FromString(m).chunk.token_ids
                if code == "OK"
            ]
            whole += ids == list(range(100, 120))
        self.note(
            "undecodable continuation: went on elsewhere, no token lost",
            f"{whole}/{self.CALLS} ({tally(codes)})",
            whole == self.CALLS,
        )


# --------------------------------------------------------------------------- LoRA


class LoraList(HostileScenario):
    name = "lora-list"
    summary = "a worker that lists 200,000 LoRA adapters, polled every 0.2 s (a call named one)"
    CAP = 256  # lora.max_listed_per_worker's default

    async def prepare(self) -> Child:
        self.run.workers()
        self.worker = await self.serve(Hostile(adapters=200_000))
        gw = self.run.gateway({"loads": {"interval_s": 0.2}}, self.worker.url("lists"))
        await wait_health(gw.address, "lists")
        return gw

    async def begin(self) -> None:
        ch = self.run.channel()  # a call naming any adapter turns the polling on
        await raw_call(ch, "lists", request("l-0", 1, lora="any"))

    async def end(self) -> None:
        assert self.run.gw is not None
        listed = self.worker.lists
        workers = await list_workers(admin_address(self.run.gw))
        held = len(workers[self.worker.address].lora_adapters)
        await super().end()
        self.note("lists polled during the attack", f"{listed}")
        self.note("adapters the gateway kept", f"{held:,} of 200,000", held <= self.CAP)


class LoraHang(HostileScenario):
    name = "lora-hang"
    summary = (
        "a worker that never answers LoadLoRAAdapter; calls name 20 configured adapters "
        "in turn (lora.load_timeout_s 1)"
    )
    ADAPTERS = [f"x{i}" for i in range(20)]
    EJECTED_AFTER = 5  # outlier_detection.failure_threshold's default

    async def prepare(self) -> Child:
        self.run.workers()
        self.worker = await self.serve(Hostile(hold_loads=True))
        config = {
            "lora": {
                "adapters": {name: f"/loras/{name}" for name in self.ADAPTERS},
                "load_timeout_s": 1.0,
            }
        }
        gw = self.run.gateway(config, self.worker.url("hangs"))
        await wait_health(gw.address, "hangs")
        return gw

    async def begin(self) -> None:
        self.codes: Counter[str] = Counter()
        self.slow = 0  # calls that waited out a load's timeout
        self.run.spawn(self.attack())

    async def attack(self) -> None:
        ch = self.run.channel()
        loop = asyncio.get_running_loop()
        n = 0
        while True:
            started = loop.time()
            _, code = await raw_call(ch, "hangs", request(f"h-{n}", 1, self.ADAPTERS[n % 20]))
            self.codes[code] += 1
            self.slow += loop.time() - started >= 0.9
            n += 1

    async def end(self) -> None:
        assert self.run.gw is not None
        workers = await list_workers(admin_address(self.run.gw))
        breaker = admin_pb.BreakerState.Name(workers[self.worker.address].breaker_state)
        await super().end()
        calls = sum(self.codes.values())
        self.note("attacker's calls", tally(self.codes))
        self.note(
            "calls that waited out a load timeout",
            f"{self.slow} of {calls}; loads the worker was asked {len(self.worker.loads)}",
            self.slow <= self.EJECTED_AFTER,
        )
        self.note("the worker's outlier state (admin)", breaker, breaker == "BREAKER_STATE_OPEN")


WORKER_SCENARIOS: tuple[type[Scenario], ...] = (
    MigrationMemory,
    MigrationBudget,
    WorkerGarbage,
    LoraList,
    LoraHang,
)
