"""Live configuration in process: every key the configuration reference marks `reload`
is changed by a reload (SIGHUP's path: the file read again off the loop, merged, put in
force) and checked where the gateway reads it: the policy or limits of the cluster, the
admission bounds, the stages' config, the queue's classes, the session table, the LoRA
loader. A call streaming across a reload ends whole; a key that needs a restart is
listed and left alone; a file that does not check out changes nothing."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc
from structlog.testing import capture_logs

from gateway.app.server import Gateway
from gateway.config import GatewayConfig, build_config
from gateway.config.reload import reloads
from gateway.core.roles import Role, Runtime
from gateway_sim.client import model_md, sgl_generate
from scripts.docs_gen.config_keys import config_keys
from tests.support.inproc import client, gateway, idle, sim
from tests.support.waits import until

BASE: dict[str, Any] = {
    "flow": {
        "classes": [{"name": "interactive", "ttl_s": 30}, {"name": "batch", "ttl_s": 300}],
        "default_class": "interactive",
    },
    "tenants": {"default": {"requests_per_minute": 1000, "tokens_per_minute": 1_000_000}},
    "models": {"chat": {"route": [{"model": "m", "weight": 1}]}, "m2": {}},
    "affinity": {"header": "x-session"},
    "lora": {"adapters": {"a1": "/adapters/a1"}},
}
IN_PROCESS = {
    "listen": "127.0.0.1:0",
    "admin.listen": "127.0.0.1:0",
    "metrics.listen": "off",
    "probe.interval_s": 0.05,
    "probe.success_threshold": 1,
}


class File:
    """What SIGHUP reads: the file as it is now (BASE with some keys changed)."""

    def __init__(self, urls: tuple[str, ...]) -> None:
        self.urls = urls
        self.config = self.with_changes({})
        self.broken: dict[str, Any] | None = None  # changes the next read fails on

    def with_changes(self, changes: dict[str, Any]) -> GatewayConfig:
        data = copy.deepcopy(BASE)
        for path, value in changes.items():
            *sections, name = path.split(".")
            into = data
            for section in sections:
                into = into.setdefault(section, {})
            into[name] = value
        return build_config(data, worker_urls=self.urls, overrides=IN_PROCESS)

    def read(self) -> GatewayConfig:
        if self.broken is not None:
            return self.with_changes(self.broken)  # raises ConfigError
        return self.config


async def reload_to(gw: Gateway, file: File, changes: dict[str, Any]) -> list[Any]:
    """The file changed, then SIGHUP's reload, to its end: its log lines."""
    file.config = file.with_changes(changes)
    with capture_logs() as logs:
        gw.reload()
        await until(lambda: not gw.reloader.running)
    return logs


def cluster(gw: Gateway, model: str = "m") -> Any:
    (found,) = gw.parts.fleet.registry.clusters(model, Role.REGULAR)
    return found


def env(gw: Gateway) -> Any:
    return gw.parts.fronts[0].env


def loader(gw: Gateway) -> Any:
    assert gw.parts.loras is not None
    return gw.parts.loras._config


def rooms(gw: Gateway) -> Any:
    assert gw.parts.rooms is not None
    return gw.parts.rooms


def table(gw: Gateway) -> Any:
    assert gw.parts.placer.affinity is not None
    return gw.parts.placer.affinity.table


Check = Callable[[Gateway], bool]
ROUTE_M = [{"model": "m", "weight": 3}]
ROUTE_M2 = [{"model": "m2", "weight": 1}]
TENANT = {"max_class": "batch", "weight": 3, "max_inflight": 5}
TENANT_RATES = {"requests_per_minute": 7, "tokens_per_minute": 700}

# key (as the reference writes it) -> the file's change, and where the gateway shows it.
CASES: dict[str, tuple[dict[str, Any], Check]] = {
    "models": (
        {"models.m.policy": "least_inflight"},
        lambda g: cluster(g).policy.name == "least_inflight",
    ),
    "models.<model>.policy": (
        {"models.m.policy": "random"},
        lambda g: cluster(g).policy.name == "random",
    ),
    "models.<model>.encode_leg": (
        {"models.m.encode_leg": True},
        lambda g: Role.ENCODE in g.parts.placer.legs("m", multimodal=True),
    ),
    "models.<model>.max_inflight": (
        {"models.m.max_inflight": 2},
        lambda g: cluster(g).limits.max_inflight == 2,
    ),
    "models.<model>.max_waiting": (
        {"models.m.max_waiting": 3},
        lambda g: cluster(g).limits.max_waiting == 3,
    ),
    "models.<model>.max_token_usage": (
        {"models.m.max_token_usage": 0.5},
        lambda g: cluster(g).limits.max_token_usage == 0.5,
    ),
    "models.<model>.route": (
        {"models.chat.route": ROUTE_M},
        lambda g: g.parts.routes.route("chat") == (("m", 3),),
    ),
    "models.<model>.route[].model": (
        {"models.chat.route": ROUTE_M2},
        lambda g: g.parts.routes.route("chat") == (("m2", 1),),
    ),
    "models.<model>.route[].weight": (
        {"models.chat.route": ROUTE_M},
        lambda g: (
            g.parts.routes.leaves("chat") == ("m",) and g.parts.routes.route("chat") == (("m", 3),)
        ),
    ),
    "models.<model>.vocab_size": (
        {"models.m.vocab_size": 10},
        lambda g: g.parts.placer.vocabulary("m", Runtime.SGLANG) == (10, "models.m.vocab_size"),
    ),
    "default_policy": (
        {"default_policy": "power_of_two"},
        lambda g: cluster(g).policy.name == "power_of_two",
    ),
    "max_attempts": ({"max_attempts": 1}, lambda g: g.parts.dispatcher._max_attempts == 1),
    "retry_after_ms": (
        {"retry_after_ms": 77},
        lambda g: g.parts.placer._retry_after_ms == 77 and rooms(g)._retry_after_ms == 77,
    ),
    "limits.max_choices": (
        {"limits.max_choices": 2},
        lambda g: env(g).config.limits.max_choices == 2,
    ),
    "limits.max_prompt_tokens": (
        {"limits.max_prompt_tokens": 50},
        lambda g: (
            env(g).config.limits.max_prompt_tokens == 50
            and g.parts.migrations._max_prompt_tokens == 50
        ),
    ),
    "limits.max_completion_tokens": (
        {"limits.max_completion_tokens": 99},
        lambda g: env(g).config.limits.max_completion_tokens == 99,
    ),
    "limits.max_inflight_requests": (
        {"limits.max_inflight_requests": 40},
        lambda g: g.parts.admission.limit == 40 and g.parts.admission.per_caller == 10,
    ),
    "limits.max_inflight_per_principal": (
        {"limits.max_inflight_per_principal": 6},
        lambda g: g.parts.admission.per_caller == 6,
    ),
    "limits.request_read_timeout_s": (
        {"limits.request_read_timeout_s": 7},
        lambda g: env(g).config.limits.request_read_timeout_s == 7,
    ),
    "limits.stream_idle_timeout_s": (
        {"limits.stream_idle_timeout_s": 9},
        lambda g: g.parts.idle.idle_s == 9,
    ),
    "tenants": ({"tenants.alice": TENANT}, lambda g: rooms(g)._tenant("alice").weight == 3),
    "tenants.<tenant>.max_class": (
        {"tenants.alice": TENANT},
        lambda g: env(g).config.tenant("alice").max_class == "batch",
    ),
    "tenants.<tenant>.weight": (
        {"tenants.alice": TENANT},
        lambda g: rooms(g)._tenant("alice").weight == 3,
    ),
    "tenants.<tenant>.max_inflight": (
        {"tenants.alice": TENANT},
        lambda g: rooms(g)._tenant("alice").max_inflight == 5,
    ),
    "tenants.<tenant>.requests_per_minute": (
        {"tenants.alice": TENANT_RATES},
        lambda g: g.parts.budgets._limits("alice") == (7, 700),
    ),
    "tenants.<tenant>.tokens_per_minute": (
        {"tenants.alice": TENANT_RATES},
        lambda g: g.parts.budgets._limits("alice") == (7, 700),
    ),
    "flow.classes": (
        {"flow.classes": [{"name": "interactive"}, {"name": "standard"}, {"name": "batch"}]},
        lambda g: [c.name for c in rooms(g).classes] == ["interactive", "standard", "batch"],
    ),
    "flow.classes[].name": (
        {"flow.classes": [{"name": "interactive"}, {"name": "bulk"}], "tenants.default": {}},
        lambda g: [c.name for c in rooms(g).classes] == ["interactive", "bulk"],
    ),
    "flow.classes[].ttl_s": (
        {"flow.classes": [{"name": "interactive", "ttl_s": 5}, {"name": "batch", "ttl_s": 300}]},
        lambda g: rooms(g).classes[0].ttl_s == 5,
    ),
    "flow.classes[].starvation_s": (
        {
            "flow.classes": [
                {"name": "interactive", "ttl_s": 30},
                {"name": "batch", "starvation_s": 4},
            ]
        },
        lambda g: rooms(g).classes[1].starvation_s == 4,
    ),
    "flow.default_class": (
        {"flow.default_class": "batch"},
        lambda g: env(g).config.flow.default_class == "batch",
    ),
    "flow.priority_header": (
        {"flow.priority_header": "x-class"},
        lambda g: env(g).config.flow.priority_header == "x-class",
    ),
    "flow.queue.max_requests": (
        {"flow.queue": {"max_requests": 11}},
        lambda g: rooms(g).settings.queue.max_requests == 11,
    ),
    "flow.queue.max_bytes": (
        {"flow.queue": {"max_bytes": "1MiB"}},
        lambda g: rooms(g).settings.queue.max_bytes == 1 << 20,
    ),
    "flow.trust_tenant_header": (
        {"flow.trust_tenant_header": True},
        lambda g: env(g).config.flow.trust_tenant_header is True,
    ),
    "flow.tenant_header": (
        {"flow.tenant_header": "x-team"},
        lambda g: env(g).config.flow.tenant_header == "x-team",
    ),
    "flow.cost_tokens": ({"flow.cost_tokens": 33}, lambda g: env(g).estimate == 33),
    "affinity.header": (
        {"affinity.header": "x-conversation"},
        lambda g: env(g).config.affinity.header == "x-conversation",
    ),
    "affinity.ttl_s": ({"affinity.ttl_s": 12}, lambda g: table(g).ttl_s == 12),
    "slo.ttft_header": (
        {"slo.ttft_header": "x-ttft"},
        lambda g: env(g).config.slo.ttft_header == "x-ttft",
    ),
    "slo.tpot_header": (
        {"slo.tpot_header": "x-tpot"},
        lambda g: env(g).config.slo.tpot_header == "x-tpot",
    ),
    "slo.sheddable": (
        {"slo.sheddable": ["standard", "batch"]},
        lambda g: env(g).config.slo.sheddable == ("standard", "batch"),
    ),
    "affinity.max_sessions": ({"affinity.max_sessions": 13}, lambda g: table(g).max_sessions == 13),
    "lora.adapters": (
        {"lora.adapters": {"a2": "/adapters/a2"}},
        lambda g: (
            loader(g).adapters == {"a2": "/adapters/a2"} and g.parts.fleet.lora_watch.only == {"a2"}
        ),
    ),
    "lora.max_loaded_per_worker": (
        {"lora.max_loaded_per_worker": 2},
        lambda g: loader(g).max_loaded_per_worker == 2,
    ),
    "lora.load_on_demand": (
        {"lora.load_on_demand": False},
        lambda g: loader(g).load_on_demand is False,
    ),
    "lora.load_timeout_s": ({"lora.load_timeout_s": 3}, lambda g: loader(g).load_timeout_s == 3),
    "lora.max_listed_per_worker": (
        {"lora.max_listed_per_worker": 8},
        lambda g: g.parts.fleet.lora_watch.cap == 8,
    ),
    "migration.enabled": (
        {"migration.enabled": False},
        lambda g: g.parts.migrations._config.enabled is False,
    ),
    "migration.max_migrations": (
        {"migration.max_migrations": 5},
        lambda g: g.parts.migrations._config.max_migrations == 5,
    ),
    "migration.max_resent_tokens": (
        {"migration.max_resent_tokens": 1000},
        lambda g: g.parts.migrations._config.max_resent_tokens == 1000,
    ),
}


def test_every_key_the_reference_marks_reload_has_a_case() -> None:
    marked = {key.path for key in config_keys() if reloads(key.path)}
    assert marked == set(CASES)


async def test_every_reload_key_takes_effect_and_goes_back() -> None:
    async with sim("--model", "m") as w:
        urls = (w.url(model="m", runtime="sglang"),)
        file = File(urls)
        async with gateway(*urls, reread=file.read, **_nested(BASE)) as gw:
            for key, (changes, took) in CASES.items():
                assert not took(gw), key  # the base differs
                logs = await reload_to(gw, file, changes)
                assert took(gw), key
                (line,) = [e for e in logs if e["event"] == "reloaded"]
                assert line["applied"], key
                await reload_to(gw, file, {})
                assert not took(gw), f"{key}: back to the base"


async def test_a_stream_across_a_reload_ends_whole_and_the_next_call_sees_the_new_limit() -> None:
    async with sim("--model", "m", "--token-ms", "20") as w:
        urls = (w.url(model="m", runtime="sglang"),)
        file = File(urls)
        async with gateway(*urls, reread=file.read, **_nested(BASE)) as gw, client(gw) as ch:
            stub = sgl_grpc.SglangSchedulerStub(ch)
            stream = stub.Generate(sgl_generate("long", tokens=30), metadata=model_md("m"))
            first = await stream.read()
            assert first is not grpc.aio.EOF
            await reload_to(gw, file, {"limits.max_prompt_tokens": 2})
            last = first
            while (message := await stream.read()) is not grpc.aio.EOF:
                last = message
            assert last.HasField("complete")
            assert await stream.code() is grpc.StatusCode.OK
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(sgl_generate("after"), metadata=model_md("m")).read()
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "limits.max_prompt_tokens" in (refused.value.details() or "")
            await idle(gw)


async def test_keys_that_need_a_restart_are_listed_and_left_alone() -> None:
    async with sim("--model", "m") as w:
        urls = (w.url(model="m", runtime="sglang"),)
        file = File(urls)
        async with gateway(*urls, reread=file.read, **_nested(BASE)) as gw:
            changes = {"limits.max_connections": 5, "affinity.header": None, "max_attempts": 2}
            logs = await reload_to(gw, file, changes)
            (warned,) = [e for e in logs if e["event"] == "config_needs_restart"]
            assert warned["keys"] == ["limits.max_connections", "affinity.header"]
            assert gw.config.limits.max_connections != 5
            assert gw.config.affinity.header == "x-session"
            assert gw.parts.dispatcher._max_attempts == 2  # the rest applied


async def test_a_file_that_does_not_check_out_changes_nothing() -> None:
    async with sim("--model", "m") as w:
        urls = (w.url(model="m", runtime="sglang"),)
        file = File(urls)
        async with gateway(*urls, reread=file.read, **_nested(BASE)) as gw:
            before = gw.config
            file.broken = {"models.chat.route": [{"model": "nobody", "weight": 1}]}
            with capture_logs() as logs:
                gw.reload()
                await until(lambda: not gw.reloader.running)
            (failed,) = [e for e in logs if e["event"] == "config_reload_failed"]
            assert "nobody" in failed["error"]
            assert gw.config is before


def _nested(data: dict[str, Any]) -> dict[str, Any]:
    """BASE as the in-process gateway's overrides (a whole section per key)."""
    return dict(data)
