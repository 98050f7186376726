"""Unit tests of the sim's knobs: flag parsing and per-request overrides."""

from __future__ import annotations

import argparse

import grpc
import pytest

from gateway_sim import SimConfig, add_sim_arguments
from gateway_sim.active import ActiveRequests
from gateway_sim.behaviour import BadOverride, Behaviour, read_request


def parse(*argv: str) -> SimConfig:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return SimConfig.from_args(parser.parse_args(argv))


def test_defaults() -> None:
    config = parse()
    assert config.listen == "127.0.0.1:0"
    assert (config.runtime, config.model, config.model_path) == (
        "sglang",
        "sim-model",
        "sim/sim-model",
    )
    assert config.behaviour == Behaviour()
    assert config.worker_name(4242) == "sglang@127.0.0.1:4242"
    assert config.grpc_health and not config.not_serving and config.dp_ranks == 1
    # The tiny Llama the real-engine tests serve, on vLLM's CPU backend.
    assert (config.max_model_len, config.vocab_size) == (2048, 512)
    assert (config.block_size, config.kv_blocks, config.prefill_s_per_token) == (128, 4096, 0.0)
    assert config.kv_relay == "python"
    assert (config.kv_history, config.kv_heartbeat_s, config.kv_queue) == (1024, 1.0, 1024)
    assert config.kv_heartbeat_backoff_s == 5.0
    assert config.kv_events
    assert config.behaviour.tokens_per_chunk == 1


def test_cache_flags() -> None:
    config = parse(
        "--block-size=4",
        "--kv-blocks=9",
        "--prefill-us-per-token=250",
        "--kv-history=3",
        "--kv-heartbeat-ms=0",
        "--kv-queue=2",
        "--no-kv-events",
        "--kv-relay=rust",
        "--kv-heartbeat-backoff-ms=250",
    )
    assert (config.block_size, config.kv_blocks, config.prefill_s_per_token) == (4, 9, 0.00025)
    assert (config.kv_history, config.kv_heartbeat_s, config.kv_queue) == (3, 0.0, 2)
    assert (config.kv_relay, config.kv_heartbeat_backoff_s) == ("rust", 0.25)
    assert not config.kv_events


def test_model_flags() -> None:
    config = parse(
        "--max-model-len=64", "--vocab-size=32000", "--tokens-per-chunk=3", "--headers-first"
    )
    assert (config.max_model_len, config.vocab_size) == (64, 32000)
    assert config.behaviour.tokens_per_chunk == 3 and config.behaviour.headers_first


def test_flags() -> None:
    config = parse(
        "--runtime=vllm",
        "--listen=[::1]:0",
        "--model=m",
        "--tokens=3",
        "--ttft-ms=1.5",
        "--fail-code=unavailable",
        "--fail-after=2",
        "--exit-after=5",
        "--stall",
        "--no-grpc-health",
        "--dp-ranks=4",
    )
    assert config.model_path == "sim/m"
    assert config.worker_name(1) == "vllm@[::1]:1"
    assert config.behaviour == Behaviour(
        tokens=3,
        ttft_ms=1.5,
        fail_code=grpc.StatusCode.UNAVAILABLE,
        fail_after=2,
        exit_after=5,
        stall=True,
    )
    assert not config.grpc_health and config.dp_ranks == 4


@pytest.mark.parametrize(
    "argv",
    [
        ["--fail-code=OK"],
        ["--fail-code=NOPE"],
        ["--tokens=-1"],
        ["--listen=nohost"],
        ["--block-size=0"],
        ["--kv-blocks=0"],
        ["--kv-history=0"],
        ["--prefill-us-per-token=-1"],
        ["--kv-relay=go"],
        ["--max-model-len=0"],
        ["--vocab-size=0"],
        ["--tokens-per-chunk=0"],
        ["--usage-completion-tokens=4294967296"],
    ],
)
def test_bad_flags(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)


def test_no_overrides_keeps_base_object() -> None:
    base = Behaviour()
    view = read_request(base, [("user-agent", "x"), ("b", "1"), ("a", "2")])
    assert view.behaviour is base
    assert view.seen_keys == "a,b,user-agent"


def test_overrides() -> None:
    base = Behaviour(fail_code=grpc.StatusCode.INTERNAL, stall=True, exit_after=1)
    view = read_request(
        base,
        [
            ("x-sim-tokens", "7"),
            ("x-sim-ttft-ms", "2.5"),
            ("x-sim-token-ms", "1"),
            ("x-sim-fail-code", "none"),
            ("x-sim-stall", "0"),
            ("x-sim-exit-after", "none"),
            ("x-sim-tokens-per-chunk", "4"),
            ("x-sim-headers-first", "yes"),
            ("x-sim-unknown", "ignored"),
        ],
    )
    assert view.behaviour == Behaviour(
        tokens=7, ttft_ms=2.5, token_ms=1.0, tokens_per_chunk=4, headers_first=True
    )
    failing = read_request(base, [("x-sim-fail-code", "unavailable"), ("x-sim-fail-after", "4")])
    assert failing.behaviour.fail_code == grpc.StatusCode.UNAVAILABLE
    assert failing.behaviour.trigger_at == 1  # the exit comes first


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("x-sim-tokens", "x"),
        ("x-sim-tokens", "-2"),
        ("x-sim-token-ms", "nan"),
        ("x-sim-fail-code", "BOGUS"),
        ("x-sim-stall", "maybe"),
        ("x-sim-tokens-per-chunk", "0"),
        ("x-sim-completion-tokens", "4294967296"),
        ("x-sim-completion-tokens", "-1"),
    ],
)
def test_bad_overrides(key: str, value: str) -> None:
    with pytest.raises(BadOverride, match=key):
        read_request(Behaviour(), [(key, value)])


def test_reported_usage_flag_and_override() -> None:
    """A lying worker's usage figure: from the flag, overridden or switched off per
    request, up to the protos' uint32."""
    lying = parse("--usage-completion-tokens=4294967295").behaviour
    assert lying.completion_tokens == 2**32 - 1
    assert parse().behaviour.completion_tokens is None
    assert read_request(lying, [("x-sim-completion-tokens", "7")]).behaviour.completion_tokens == 7
    honest = read_request(lying, [("x-sim-completion-tokens", "off")]).behaviour
    assert honest.completion_tokens is None


def test_trigger_at() -> None:
    assert Behaviour().trigger_at == -1
    assert Behaviour(fail_after=3).trigger_at == -1  # no code, no failure
    assert Behaviour(fail_code=grpc.StatusCode.INTERNAL, fail_after=3).trigger_at == 3
    assert Behaviour(exit_after=0).trigger_at == 0


def test_active_requests_share_ids() -> None:
    active = ActiveRequests()
    first, second = active.add("r"), active.add("r")
    assert len(active) == 2
    assert active.abort(["r", "missing"]) == 2
    assert first.aborted and second.aborted
    active.remove(first)
    active.remove(first)  # idempotent
    active.remove(second)
    assert len(active) == 0
    assert active.abort(["r"]) == 0
