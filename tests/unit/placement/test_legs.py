"""Placement over legs: each leg judged by its own pool, the most permanent cause wins."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from gateway.config import ModelSettings, WorkerSpec
from gateway.core.roles import Role, Runtime
from gateway.core.verdicts import Reason, Verdict, leg_not_deployed, workers_overloaded
from gateway.core.verdicts import workers_unavailable as unavailable
from gateway.placement.decision import Decision
from gateway.placement.legs import demanded_legs, most_permanent
from gateway.placement.policies import Hints
from gateway.upstream.worker import Worker
from tests.support.factories import make_placer, make_registry, make_worker

SGL, VLLM = Runtime.SGLANG, Runtime.VLLM
P, D, E, R = Role.PREFILL, Role.DECODE, Role.ENCODE, Role.REGULAR
IMAGE = ("http://img/1.png",)


class Fleet:
    def __init__(self, **settings: Any) -> None:
        self.registry = make_registry(lambda model: ModelSettings(**settings))
        self.placer = make_placer(self.registry, lambda model: ModelSettings(**settings))
        self._port = 0

    def add(self, role: Role, runtime: Runtime = SGL, up: bool = True, pairing: str = "") -> Worker:
        self._port += 1
        spec = WorkerSpec("h", self._port, "m", runtime, role)
        worker = make_worker(spec, runtime=runtime, role=role, pairing=pairing)
        self.registry.add(worker)
        worker.connected, worker.probe.healthy = True, up
        worker.signalled("test")
        return worker

    def place(self, runtime: Runtime = SGL, items: tuple[str, ...] = ()) -> Decision | Verdict:
        return self.placer.place("m", runtime, Hints(), items)


def verdict_of(placed: Decision | Verdict) -> Verdict:
    assert isinstance(placed, Verdict), placed
    return placed


def test_demanded_legs() -> None:
    assert demanded_legs(False, False, False) == (R,)
    assert demanded_legs(True, False, True) == (P, D)
    assert demanded_legs(True, True, True) == (E, P, D)
    assert demanded_legs(False, True, True) == (E, R)
    assert demanded_legs(True, True, False) == (P, D)


@pytest.mark.parametrize(
    ("reasons", "winner"),
    [
        ([Reason.WORKERS_UNAVAILABLE, Reason.LEG_NOT_DEPLOYED], Reason.LEG_NOT_DEPLOYED),
        ([Reason.WORKERS_UNAVAILABLE, Reason.WORKERS_OVERLOADED], Reason.WORKERS_OVERLOADED),
        ([Reason.WORKERS_OVERLOADED, Reason.NO_COMPATIBLE_PAIR], Reason.NO_COMPATIBLE_PAIR),
        ([Reason.POLICY_DECLINED, Reason.WORKERS_OVERLOADED], Reason.WORKERS_OVERLOADED),
        ([Reason.WORKERS_UNAVAILABLE, Reason.POLICY_DECLINED], Reason.WORKERS_UNAVAILABLE),
        ([Reason.LEG_NOT_DEPLOYED, Reason.NO_COMPATIBLE_PAIR], Reason.LEG_NOT_DEPLOYED),
    ],
)
def test_most_permanent_cause_wins(reasons: list[Reason], winner: Reason) -> None:
    verdicts = [Verdict(reason, reason.name) for reason in reasons]
    assert most_permanent(verdicts).reason is winner


def test_most_permanent_prefers_the_first_leg_on_a_tie() -> None:
    a, b = unavailable("m", "prefill", 1, 1000), unavailable("m", "decode", 1, 1000)
    assert most_permanent([a, b]) is a
    assert (
        most_permanent(
            [workers_overloaded("m", "decode", 1, 1), leg_not_deployed("m", "encode")]
        ).leg
        == "encode"
    )


def test_pd_pair_is_placed_on_its_legs() -> None:
    fleet = Fleet()
    p, d = fleet.add(P), fleet.add(D)
    placed = fleet.place()
    assert isinstance(placed, Decision)
    assert placed.workers == {P: p, D: d}
    assert placed.primary is d and placed.receiver is p


def test_healthy_prefill_and_every_decode_down_names_decode_only() -> None:
    fleet = Fleet()
    fleet.add(P)
    fleet.add(D, up=False)
    fleet.add(D, up=False)
    verdict = verdict_of(fleet.place())
    assert verdict.reason is Reason.WORKERS_UNAVAILABLE
    assert verdict.leg == "decode"
    assert verdict.message.startswith("All 2 decode workers for model 'm' are unavailable")


def test_prefill_without_decode_is_leg_not_deployed() -> None:
    fleet = Fleet()
    fleet.add(P)
    verdict = verdict_of(fleet.place())
    assert (verdict.reason, verdict.leg) == (Reason.LEG_NOT_DEPLOYED, "decode")
    assert verdict.reason.code is grpc.StatusCode.NOT_FOUND


def test_missing_encode_leg_for_a_multimodal_request_is_not_deployed_never_unavailable() -> None:
    fleet = Fleet(encode_leg=True)
    fleet.add(P)
    fleet.add(D, up=False)  # another leg down too: the permanent cause still wins
    verdict = verdict_of(fleet.place(items=IMAGE))
    assert (verdict.reason, verdict.leg) == (Reason.LEG_NOT_DEPLOYED, "encode")
    assert verdict.message == "Model 'm' has no encode workers registered"


def test_text_requests_are_served_when_the_encode_leg_is_missing() -> None:
    fleet = Fleet(encode_leg=True)
    fleet.add(P)
    fleet.add(D)
    assert isinstance(fleet.place(), Decision)


def test_encode_leg_spreads_items_and_names_the_receiver() -> None:
    fleet = Fleet()
    p, _ = fleet.add(P), fleet.add(D)
    e1, e2 = fleet.add(E), fleet.add(E)
    items = tuple(f"http://img/{i}.png" for i in range(12))
    placed = fleet.place(items=items)
    assert isinstance(placed, Decision)
    assert placed.receiver is p
    parts = dict(placed.encoders)
    assert set(parts) == {e1, e2}  # 12 items hash onto both encoders
    assert sorted(i for part in parts.values() for i in part) == sorted(items)
    again = fleet.place(items=items)
    assert isinstance(again, Decision) and dict(again.encoders) == parts  # content-stable


def test_encoders_all_down_is_unavailable_for_the_encode_leg() -> None:
    fleet = Fleet()
    fleet.add(P)
    fleet.add(D)
    fleet.add(E, up=False)
    verdict = verdict_of(fleet.place(items=IMAGE))
    assert (verdict.reason, verdict.leg) == (Reason.WORKERS_UNAVAILABLE, "encode")


def test_prefill_and_decode_on_different_runtimes_is_no_compatible_pair() -> None:
    fleet = Fleet()
    fleet.add(P, SGL)
    fleet.add(D, VLLM)
    for runtime in (SGL, VLLM):
        verdict = verdict_of(fleet.place(runtime))
        assert verdict.reason is Reason.NO_COMPATIBLE_PAIR
        assert verdict.reason.code is grpc.StatusCode.NOT_FOUND
        assert "prefill on sglang; decode on vllm" in verdict.message


def test_pairing_search_covers_every_group_not_the_first_prefills() -> None:
    fleet = Fleet()
    fleet.add(P, VLLM, pairing="nixl|a")  # sorts first, has no decode in its group
    p_b = fleet.add(P, VLLM, pairing="nixl|b")
    d_b = fleet.add(D, VLLM, pairing="nixl|b")
    placed = fleet.place(VLLM)
    assert isinstance(placed, Decision)
    assert placed.workers == {P: p_b, D: d_b}


def test_legs_fine_alone_but_no_shared_group_is_no_compatible_pair() -> None:
    fleet = Fleet()
    fleet.add(P, VLLM, pairing="nixl|a")
    fleet.add(D, VLLM, pairing="nixl|b")
    verdict = verdict_of(fleet.place(VLLM))
    assert verdict.reason is Reason.NO_COMPATIBLE_PAIR


def test_overloaded_decode_is_reported_for_decode() -> None:
    fleet = Fleet(max_inflight=1)
    fleet.add(P)
    d = fleet.add(D)
    d.inflight = 1
    verdict = verdict_of(fleet.place())
    assert (verdict.reason, verdict.leg) == (Reason.WORKERS_OVERLOADED, "decode")


def test_policy_declined_names_the_leg_and_policy() -> None:
    fleet = Fleet(policy="manual")
    fleet.add(P)
    fleet.add(D)
    verdict = verdict_of(fleet.placer.place("m", SGL, Hints(target_worker="h:99")))
    assert (verdict.reason, verdict.leg, dict(verdict.extra)) == (
        Reason.POLICY_DECLINED,
        "prefill",
        {"policy": "manual"},
    )


def test_each_leg_rotates_on_its_own() -> None:
    fleet = Fleet()
    p1, p2 = fleet.add(P), fleet.add(P)
    d1, d2 = fleet.add(D), fleet.add(D)
    picks = [fleet.place() for _ in range(4)]
    assert [a.workers[P] for a in picks if isinstance(a, Decision)] == [p1, p2, p1, p2]
    assert [a.workers[D] for a in picks if isinstance(a, Decision)] == [d1, d2, d1, d2]


def test_servable_needs_a_compatible_pair() -> None:
    fleet = Fleet()
    fleet.add(P, VLLM, pairing="x")
    fleet.add(D, VLLM, pairing="y")
    assert not fleet.placer.servable("m")
    fleet.add(D, VLLM, pairing="x")
    assert fleet.placer.servable("m")


def test_fleet_wide_and_fan_out_rpcs_never_pick_an_encoder() -> None:
    """Encoders serve SglangEncoder only: a GetModelInfo or GetLoads sent to one would
    answer UNIMPLEMENTED, so only prefill, decode and regular workers are candidates."""
    fleet = Fleet()
    encoder = fleet.add(E)
    prefill, decode = fleet.add(P), fleet.add(D)
    everyone = fleet.placer.every_worker("m", SGL)
    assert everyone == [decode, prefill]
    picks = {fleet.placer.any_worker("m", SGL) for _ in range(6)}
    assert picks and picks <= {prefill, decode}
    assert fleet.placer.any_worker("m", SGL, exclude=[prefill.id, decode.id]) == unavailable(
        "m", "", 2, 1000
    )
    assert encoder not in picks


def test_a_model_with_only_encoders_up_has_no_worker_for_engine_rpcs() -> None:
    fleet = Fleet()
    fleet.add(E)
    fleet.add(P, up=False)
    verdict = fleet.placer.any_worker("m", SGL)
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.WORKERS_UNAVAILABLE
    assert fleet.placer.every_worker("m", SGL) == unavailable("m", "", 1, 1000)
