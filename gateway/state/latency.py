"""What each gateway's latency models learned of a worker, shared: a gateway that starts
(a new replica, a restarted one, another serving process) predicts its workers' times to
first token from its first call instead of after each worker's first MIN_SEEN calls
(gateway.upstream.latency), which it would otherwise place without predictions.

Every `PUBLISH_S`, each process writes the model of every worker it has learned more of
since its last write (those whose own model predicts): `{prefix}latency:{digest(worker)}`,
a JSON object (the worker's id, and each fit's sums: `gateway.upstream.latency.FitState`)
that expires `TTL_S` after the last write, so a model nobody refreshes (the worker gone,
or idle for an hour) is not adopted. Every `EVERY_S`, and as soon as a worker joins, it
reads the models of its workers whose own model is still cold (each at most once per
`LOOK_AGAIN_S`), and a cold model adopts what it finds (the last writer's, of any
gateway). From then on each gateway's model of the worker learns from its own calls. A
value that is no model is refused (counted, logged). A store that is away costs nothing
but the warm start: the models are looked for again once it is back.

Bounded: one key per worker, each at most `state.max_value_bytes` (checked before it is
parsed); at most `BATCH` models written or read per store operation, with the event loop
given back between batches."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.state.store import MAX_WORKER_ID, Store, StoreAway, digest
from gateway.upstream.latency import FitState, LatencyModel
from gateway.upstream.registry import FleetEvent
from gateway.upstream.worker import Worker

log = structlog.get_logger("gateway.state")

EVERY_S = 1.0  # cold workers' models looked for this often
LOOK_AGAIN_S = 30.0  # a worker still cold is looked for again after this long
PUBLISH_S = 5.0  # learned models written this often
TTL_S = 3600  # a model not written again for this long expires from the store
BATCH = 32  # models per store operation (and between yields of the event loop)
MAX_FEATURES = 4  # the largest fit's features (time to first token's)

Finite = Annotated[float, Field(allow_inf_nan=False)]
Row = Annotated[list[Finite], Field(max_length=MAX_FEATURES)]


class SharedFit(BaseModel):
    """A fit's sums, as the store holds them (shapes checked by `Fit.adopt`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    a: Annotated[list[Row], Field(max_length=MAX_FEATURES)]
    b: Row
    counted: Finite
    mass: Finite
    seen: Annotated[int, Field(ge=0)]

    @classmethod
    def of(cls, state: FitState) -> SharedFit:
        return cls(
            a=[list(row) for row in state.a],
            b=list(state.b),
            counted=state.counted,
            mass=state.mass,
            seen=state.seen,
        )

    def state(self) -> FitState:
        return FitState(
            tuple(tuple(row) for row in self.a), tuple(self.b), self.counted, self.mass, self.seen
        )


class SharedModel(BaseModel):
    """One worker's latency model in the store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker: Annotated[str, Field(max_length=MAX_WORKER_ID)]
    ttft: SharedFit
    pace: SharedFit


def encode(worker: str, model: LatencyModel) -> bytes | None:
    """The worker's model as the store holds it; None while it predicts nothing."""
    fits = model.export()
    if fits is None:
        return None
    shared = SharedModel(worker=worker, ttft=SharedFit.of(fits[0]), pace=SharedFit.of(fits[1]))
    return shared.model_dump_json().encode()


def decode(data: bytes, worker: str, limit: int) -> SharedModel:
    """A stored value as the model of `worker`; ValueError if it is none (too long, not
    JSON of a model, or another worker's)."""
    if len(data) > limit:
        raise ValueError(f"{len(data)} bytes, past state.max_value_bytes")
    try:
        shared = SharedModel.model_validate_json(data)
    except ValidationError as exc:
        raise ValueError(f"no latency model: {exc.errors()[0]['msg']}") from None
    if shared.worker != worker:
        raise ValueError("another worker's model under its key")
    return shared


class SharedLatency:
    """One process's latency models written to the store, and read into cold ones."""

    def __init__(self, store: Store, workers: Callable[[], Iterable[Worker]]) -> None:
        self._store = store
        self._workers = workers
        self._max = store.config.max_value_bytes
        self._written: dict[str, int] = {}  # worker -> its model's observations when written
        self._looked: dict[str, float] = {}  # worker -> when its stored model was looked for
        self.adopted = 0  # models that started from the store's
        self._added = asyncio.Event()  # a worker joined: look for its model now

    def key(self, worker: str) -> str:
        return self._store.key("latency", digest(worker))

    def on_fleet_event(self, event: FleetEvent) -> None:
        """The registry's: a worker that joins has its stored model looked for at once
        (a gateway that just started places its first calls on it)."""
        if event.kind == "added":
            self._added.set()

    async def run(self) -> None:
        """Until cancelled: cold models looked for every EVERY_S and as workers join,
        learned ones written every PUBLISH_S."""
        loop = asyncio.get_running_loop()
        publish_at = loop.time() + PUBLISH_S
        while True:
            self._added.clear()
            await self.read()
            if loop.time() >= publish_at:
                publish_at = loop.time() + PUBLISH_S
                await self.write()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EVERY_S):
                    await self._added.wait()

    async def read(self) -> int:
        """The stored models of this process's cold workers not looked for yet, adopted
        (how many). A store that is away leaves them to be looked for again."""
        now = asyncio.get_running_loop().time()
        cold = [w for w in self._workers() if _cold(w) and not self._looked_since(w.id, now)]
        adopted = 0
        for at in range(0, len(cold), BATCH):
            batch = cold[at : at + BATCH]
            keys = [self.key(w.id) for w in batch]

            async def work(client: Any, keys: list[str] = keys) -> list[object]:
                return list(await client.mget(keys))

            try:
                values = await self._store.run("latency_read", work)
            except StoreAway:
                return adopted
            for worker, value in zip(batch, values, strict=True):
                self._looked[worker.id] = now
                if value is not None:
                    adopted += self._adopt(worker, value)
            await asyncio.sleep(0)
        present = {w.id for w in self._workers()}
        for gone in self._looked.keys() - present:
            del self._looked[gone]
        if adopted:
            self.adopted += adopted
            log.info("latency_models_adopted", count=adopted)
        return adopted

    def _looked_since(self, worker: str, now: float) -> bool:
        looked = self._looked.get(worker)
        return looked is not None and now - looked < LOOK_AGAIN_S

    def _adopt(self, worker: Worker, value: object) -> bool:
        if not isinstance(value, bytes):
            self._store.invalid("latency_read", "a value that is no bytes")
            return False
        try:
            shared = decode(value, worker.id, self._max)
        except ValueError as exc:
            self._store.invalid("latency_read", f"{self.key(worker.id)}: {exc}")
            return False
        if not worker.latency.adopt(shared.ttft.state(), shared.pace.state()):
            if _cold(worker):  # not taken for want of learning since: it is no fit
                self._store.invalid("latency_read", f"{self.key(worker.id)}: no usable fit")
            return False
        self._written[worker.id] = worker.latency.seen  # the store has it: not written back
        return True

    async def write(self) -> int:
        """The models learned more of since they were last written (how many written)."""
        changed = [
            w for w in self._workers() if not _cold(w) and self._written.get(w.id) != w.latency.seen
        ]
        written = 0
        for at in range(0, len(changed), BATCH):
            batch = [(w, encode(w.id, w.latency)) for w in changed[at : at + BATCH]]
            entries = [(w, v) for w, v in batch if v is not None and len(v) <= self._max]

            async def work(client: Any, entries: list[tuple[Worker, bytes]] = entries) -> object:
                async with client.pipeline(transaction=False) as pipe:
                    for worker, value in entries:
                        pipe.set(self.key(worker.id), value, ex=TTL_S)
                    return await pipe.execute()

            try:
                await self._store.run("latency_write", work)
            except StoreAway:
                return written
            for worker, _ in entries:
                self._written[worker.id] = worker.latency.seen
            written += len(entries)
            await asyncio.sleep(0)
        present = {w.id for w in self._workers()}
        for gone in self._written.keys() - present:
            del self._written[gone]
        return written


def _cold(worker: Worker) -> bool:
    return not worker.latency.warm
