"""The seed's rule while workers are unknown: a model the configuration declares (a
`models:` entry, a worker URL's `model=`, a discovery source's model, an alias target)
with no worker registered yet is UNAVAILABLE (503, retry info), never NOT_FOUND; a leg a
worker still being identified may turn out to serve is unavailable, not undeployed; only
what nobody declares or serves is NOT_FOUND. And the vocabulary bound placement reports."""

from __future__ import annotations

from types import MappingProxyType

from gateway.config import ModelSettings, WorkerSpec, build_config, declared_models
from gateway.core.roles import Role, Runtime
from gateway.core.verdicts import Reason, Verdict
from gateway.placement.policies import Hints
from tests.support.factories import make_placer, make_registry, worker_on

NOW = 0.0


def test_the_configuration_declares_models_by_entry_worker_url_and_source() -> None:
    config = build_config(
        {
            "workers": [
                "grpc://10.0.0.1:1?model=a&runtime=sglang",
                "grpc://10.0.0.2:1?model=a&runtime=vllm",
                "grpc://10.0.0.3:1?model=b",
                "grpc://10.0.0.4:1",
            ],
            "models": {"c": {}, "chat": {"route": [{"model": "c", "weight": 1}]}},
            "discovery": [
                {"source": "dns", "name": "w.local", "port": 1, "model": "d", "runtime": "vllm"}
            ],
        }
    )
    declared = declared_models(config)
    assert dict(declared) == {
        "a": frozenset({Runtime.SGLANG, Runtime.VLLM}),
        "b": None,  # no runtime named: any
        "c": None,
        "d": frozenset({Runtime.VLLM}),
    }  # the alias is a name of its own, resolved to its (declared) targets


def test_a_declared_model_with_no_worker_is_unavailable_not_unknown() -> None:
    registry = make_registry()
    placer = make_placer(registry, declared=MappingProxyType({"m": None}))
    verdict = placer.resolve("m", Runtime.VLLM)
    assert isinstance(verdict, Verdict)
    assert verdict.reason is Reason.WORKERS_UNAVAILABLE
    assert verdict.retry_after_ms == 1000
    assert "Model 'm' has no worker up or identified yet" in verdict.message
    unknown = placer.resolve("nope", Runtime.VLLM)
    assert isinstance(unknown, Verdict) and unknown.reason is Reason.MODEL_NOT_FOUND


def test_declared_on_one_protocol_is_unknown_on_the_other() -> None:
    registry = make_registry()
    placer = make_placer(registry, declared=MappingProxyType({"m": frozenset({Runtime.SGLANG})}))
    on_sglang, on_vllm = placer.resolve("m", Runtime.SGLANG), placer.resolve("m", Runtime.VLLM)
    assert isinstance(on_sglang, Verdict) and on_sglang.reason is Reason.WORKERS_UNAVAILABLE
    assert isinstance(on_vllm, Verdict) and on_vllm.reason is Reason.MODEL_NOT_FOUND


def test_a_model_served_on_another_protocol_stays_not_found_there() -> None:
    registry = make_registry()
    registry.add(worker_on(1, "m", Runtime.SGLANG))
    placer = make_placer(registry, declared=MappingProxyType({"m": None}))
    verdict = placer.resolve("m", Runtime.VLLM)
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.MODEL_NOT_FOUND
    assert "it is served over" in verdict.message


def test_no_model_named_while_the_only_declared_one_has_no_worker() -> None:
    registry = make_registry()
    placer = make_placer(registry, declared=MappingProxyType({"m": None}))
    verdict = placer.resolve(None, Runtime.SGLANG)
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.WORKERS_UNAVAILABLE
    assert verdict.model == "m"
    bare = make_placer(make_registry()).resolve(None, Runtime.SGLANG)
    assert isinstance(bare, Verdict) and bare.reason is Reason.MODEL_NOT_FOUND


def test_a_worker_being_identified_makes_an_unnamed_call_unavailable() -> None:
    registry = make_registry()
    registry.identifying(WorkerSpec("10.0.0.9", 1), ("static",), NOW)
    placer = make_placer(registry)
    verdict = placer.resolve(None, Runtime.VLLM)
    assert isinstance(verdict, Verdict) and verdict.reason is Reason.WORKERS_UNAVAILABLE
    assert "1 being asked" in verdict.message
    registry.identified("10.0.0.9:1")
    gone = placer.resolve(None, Runtime.VLLM)
    assert isinstance(gone, Verdict) and gone.reason is Reason.MODEL_NOT_FOUND


def test_a_leg_a_worker_being_identified_may_serve_is_unavailable_not_undeployed() -> None:
    registry = make_registry()
    registry.add(worker_on(1, "m", Runtime.VLLM, role=Role.DECODE))
    placer = make_placer(registry, declared=MappingProxyType({"m": None}))
    missing = placer.place("m", Runtime.VLLM, Hints())
    assert isinstance(missing, Verdict) and missing.reason is Reason.LEG_NOT_DEPLOYED
    registry.identifying(WorkerSpec("10.0.0.9", 1, "m", role=Role.PREFILL), ("static",), NOW)
    waiting = placer.place("m", Runtime.VLLM, Hints())
    assert isinstance(waiting, Verdict) and waiting.reason is Reason.WORKERS_UNAVAILABLE
    assert (waiting.leg, waiting.retry_after_ms) == ("prefill", 1000)
    assert "has no prefill worker up or identified yet; 1 named worker is still" in (
        waiting.message
    )
    # one that names another model, or another leg, is no prefill of this one
    registry.identified("10.0.0.9:1")
    registry.identifying(WorkerSpec("10.0.0.9", 1, "other"), ("static",), NOW)
    registry.identifying(WorkerSpec("10.0.0.9", 2, "m", role=Role.DECODE), ("static",), NOW)
    still = placer.place("m", Runtime.VLLM, Hints())
    assert isinstance(still, Verdict) and still.reason is Reason.LEG_NOT_DEPLOYED


def test_the_vocabulary_bound_is_the_setting_or_the_smallest_reported() -> None:
    registry = make_registry()
    small, large = worker_on(1, "m"), worker_on(2, "m")
    registry.add(small)
    registry.add(large)
    settings = {"m": ModelSettings(), "n": ModelSettings(vocab_size=100)}
    placer = make_placer(registry, lambda model: settings.get(model, ModelSettings()))
    assert placer.vocabulary("m", Runtime.SGLANG) is None  # none has said
    small.vocab_size, large.vocab_size = 0, 0  # asked: they do not say
    assert placer.vocabulary("m", Runtime.SGLANG) is None
    small.vocab_size, large.vocab_size = 512, 1024
    assert placer.vocabulary("m", Runtime.SGLANG) == (512, "as its workers report")
    assert placer.vocabulary("n", Runtime.SGLANG) == (100, "models.n.vocab_size")
