"""The settings as the rest of the gateway uses them: the documented defaults, frozen and
hashable values, validation on construction and on `dataclasses.replace`, pickling (a
serving process gets its config pickled)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from pydantic import ValidationError

from gateway.config import (
    AdminConfig,
    AuthConfig,
    ConfigError,
    GatewayConfig,
    KvConfig,
    LimitsConfig,
    ModelSettings,
    PickerConfig,
    TlsConfig,
    WorkerSpec,
    build_config,
    picker_tls,
)
from gateway.core.roles import Role, Runtime

# Every default, as docs/configuration.md's example and reference table give them.
DEFAULTS: dict[str, object] = {
    "listen": "127.0.0.1:50051",
    "workers": (),
    "discovery": (),
    "flow": None,
    "tenants": {},
    "models": {},
    "default_policy": "round_robin",
    "model_headers": ("x-model-id", "x-gateway-model-name"),
    "routing_key_header": "x-routing-key",
    "target_worker_header": "x-target-worker",
    "max_attempts": 3,
    "retry_after_ms": 1000,
    "discovery_timeout_s": 5.0,
    "max_message_bytes": 64 * 1024 * 1024,
    "log_format": "console",
    "log_level": "info",
    "processes": 1,
}
SECTION_DEFAULTS = {
    "probe": dict(interval_s=1.0, timeout_s=1.0, success_threshold=2, failure_threshold=2),
    "outlier_detection": dict(failure_threshold=5, cooldown_s=5.0, success_threshold=2),
    "loads": dict(interval_s=1.0, timeout_s=1.0),
    "drain": dict(delay_s=5.0, grace_s=20.0, worker_timeout_s=60.0),
    "disagg": dict(abort_wait_s=30.0, decode_first_message_timeout_s=0.0),
    "migration": dict(
        enabled=True, max_migrations=2, max_resent_tokens=131_072, max_kept_tokens=32 * 1024**2
    ),
    "limits": dict(
        max_choices=16,
        max_inflight_requests=4096,
        max_concurrent_streams=256,
        stream_idle_timeout_s=300.0,
        connection_idle_timeout_s=300.0,
        max_connection_age_s=3600.0,
        connection_age_grace_s=600.0,
        max_inflight_per_principal=None,
        request_read_timeout_s=30.0,
        max_request_reads=32,
        max_request_reads_per_peer=2,
        max_connections=10_000,
        max_connections_per_peer=1_000,
        max_prompt_tokens=1_000_000,
        max_completion_tokens=131_072,
    ),
    "upstream": dict(
        keepalive_time_s=10.0,
        keepalive_timeout_s=5.0,
        stream_window_bytes=262144,
        max_relayed_metadata_bytes=4096,
        max_relayed_metadata_entries=64,
    ),
    "tls": dict(cert=None, key=None, client_ca=None),
    "upstream_tls": dict(ca=None, cert=None, key=None),
    "auth": dict(api_keys_file=None, failure_limit=20, failure_window_s=10.0, block_s=30.0),
    "kv": dict(
        events=True,
        block_size=16,
        prefill_cost_per_token=0.01,
        balance_ratio=1.5,
        balance_slack=4.0,
        share_window_s=10.0,
        assume_ttl_s=120.0,
        assume_capacity=100_000,
        pending_ttl_s=120.0,
        grace_s=10.0,
        max_ranks=256,
        max_block_sizes=4,
        max_blocks_per_worker=250_000,
        max_blocks=2_000_000,
        max_event_bytes=4 * 1024 * 1024,
        resubscribe_max_s=8.0,
    ),
    "affinity": dict(header=None, ttl_s=600.0, max_sessions=100_000),
    "slo": dict(ttft_header="x-slo-ttft-ms", tpot_header="x-slo-tpot-ms", sheddable=("batch",)),
    "lora": dict(
        adapters={},
        max_loaded_per_worker=4,
        load_on_demand=True,
        load_timeout_s=30.0,
        max_listed_per_worker=256,
    ),
    "admin": dict(listen="127.0.0.1:50052", token=None),
    "metrics": dict(listen="127.0.0.1:9464"),
    "tracing": dict(
        endpoint=None,
        insecure=None,
        sample_ratio=None,
        service_name=None,
        max_queue=2048,
        batch_size=512,
        schedule_delay_ms=1000,
        export_timeout_s=10.0,
    ),
    "orca": dict(
        trailers=True,
        min_interval_s=1.0,
        max_streams=256,
        max_streams_per_connection=4,
        max_streams_per_peer=None,
    ),
    "picker": dict(
        listen=None,
        relay_address=None,
        header="x-gateway-destination-endpoint",
        migrate_streams=False,
        max_body_bytes=1024 * 1024,
        trusted_proxies=(),
        tls=dict(cert=None, key=None, client_ca=None),
        plaintext=False,
    ),
    "state": dict(
        url=None,
        key_prefix="gateway:",
        timeout_s=0.25,
        retry_s=1.0,
        resync_s=1.0,
        max_value_bytes=65_536,
        max_connections=16,
        password_file=None,
    ),
}


def test_the_defaults_are_the_documented_ones() -> None:
    config = build_config()
    assert config == GatewayConfig()
    for name, value in DEFAULTS.items():
        assert getattr(config, name) == value, name
    for section, values in SECTION_DEFAULTS.items():
        assert dataclasses.asdict(getattr(config, section)) == values, section
    assert set(DEFAULTS) | set(SECTION_DEFAULTS) == {
        f.name for f in dataclasses.fields(GatewayConfig)
    }
    assert config.limits.principal_share == 1024
    assert config.loads.stale_after_s == 3.0
    assert not config.tls.enabled


def test_settings_are_frozen_and_hashable() -> None:
    spec = WorkerSpec("h", 1, "m", Runtime.SGLANG, Role.PREFILL, 8998)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.port = 2  # type: ignore[misc]
    assert {spec: 1}[WorkerSpec("h", 1, "m", Runtime.SGLANG, Role.PREFILL, 8998)] == 1
    assert len({spec, dataclasses.replace(spec), WorkerSpec("h", 2)}) == 2
    assert hash(LimitsConfig()) == hash(LimitsConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        build_config().limits.max_choices = 1  # type: ignore[misc]


def test_constructors_and_replace_validate_too() -> None:
    with pytest.raises(ValidationError):
        KvConfig(block_size=0)
    with pytest.raises(ValidationError):
        WorkerSpec("h", 0)
    with pytest.raises(ValidationError):
        dataclasses.replace(LimitsConfig(), max_inflight_requests=0)
    with pytest.raises(ValidationError):
        ModelSettings(policy="fastest")
    assert dataclasses.replace(LimitsConfig(), max_choices=4).max_choices == 4
    assert AuthConfig(None, 5, 2, 7) == AuthConfig(None, 5, 2.0, 7.0)  # ints are numbers


def test_a_serving_process_s_control_socket_is_an_admin_address() -> None:
    """`gateway.scale.member.serving_config` puts a `unix:` control socket there."""
    config = dataclasses.replace(build_config(), admin=AdminConfig(listen="unix:/run/gw/p0.sock"))
    assert config.admin.listen == "unix:/run/gw/p0.sock"


def test_a_model_without_settings_runs_with_the_default_policy() -> None:
    config = build_config({"default_policy": "least_inflight", "models": {"m": {}}})
    assert config.model("m").policy == config.model("n").policy == "least_inflight"
    assert config.model("n") is config.model("o")  # built once, not per request
    assert build_config({"models": {"m": {"policy": "manual"}}}).model("m").policy == "manual"


def test_model_headers_are_lowercased() -> None:
    config = build_config({"model_headers": ["X-Model", "x-other"]})
    assert config.model_headers == ("x-model", "x-other")


def test_a_config_survives_pickling() -> None:
    config = build_config(
        {"models": {"m": {"max_inflight": 2}}, "processes": 2},
        worker_urls=["grpcs://h:1?model=m&role=prefill&bootstrap_port=8998"],
    )
    assert pickle.loads(pickle.dumps(config)) == config


def test_trusted_proxies_are_addresses_or_ranges() -> None:
    assert PickerConfig(trusted_proxies=("127.0.0.1", "10.0.0.0/8", "::1")).trusted_proxies
    for bad in ("envoy.local", "10.0.0.0/33", ""):
        with pytest.raises(ValidationError, match="not an IP address or CIDR range"):
            PickerConfig(trusted_proxies=(bad,))
    with pytest.raises(ValidationError):
        PickerConfig(trusted_proxies=("10.0.0.1",) * 257)


def test_a_picker_port_past_loopback_needs_tls_or_says_the_network_encrypts() -> None:
    """The port tells worker addresses and places calls: never plaintext by accident."""
    with pytest.raises(ConfigError, match="is not loopback: serve the picker port with TLS"):
        build_config({"picker": {"listen": "0.0.0.0:9002"}})
    build_config({"picker": {"listen": "127.0.0.1:9002"}})  # loopback: Envoy beside it
    build_config({"picker": {"listen": "0.0.0.0:9002", "plaintext": True}})
    own = {"listen": "0.0.0.0:9002", "tls": {"cert": "c.pem", "key": "k.pem"}}
    assert picker_tls_of(build_config({"picker": own})).cert == "c.pem"
    main = build_config(
        {"picker": {"listen": "0.0.0.0:9002"}, "tls": {"cert": "m.pem", "key": "k.pem"}}
    )
    assert picker_tls_of(main).cert == "m.pem"  # the main port's, by default


def picker_tls_of(config: GatewayConfig) -> TlsConfig:
    return picker_tls(config.picker, config.tls)


def test_sizes_and_durations_take_their_units() -> None:
    config = build_config(
        {
            "max_message_bytes": "64MiB",
            "flow": {"queue": {"max_bytes": "1GB"}},
            "limits": {"stream_idle_timeout_s": "5m", "request_read_timeout_s": "1500ms"},
            "drain": {"grace_s": "1h"},
        }
    )
    assert config.max_message_bytes == 64 * 1024 * 1024
    assert config.flow is not None and config.flow.queue.max_bytes == 1_000_000_000
    assert config.limits.stream_idle_timeout_s == 300.0
    assert config.limits.request_read_timeout_s == 1.5
    assert config.drain.grace_s == 3600.0
    for bad in (
        {"max_message_bytes": "64"},
        {"max_message_bytes": 1.0},
        {"drain": {"grace_s": "1d"}},
    ):
        with pytest.raises(ConfigError):
            build_config(bad)
