"""An Envoy configuration that runs the gateway as its endpoint picker (`gateway
envoy-config`): one listener whose calls pass the external processing filter (the
picker: request headers, the request body buffered up to Envoy's limit, response headers
and trailers; never the response body), then go to the address the picker named,
through an original destination cluster that reads it from the request's header. A Lua
filter between them keeps the last message (or each one) of the answers of the
Generates the picker marked, and hands them to the picker on the answer's trailers:
their usage (`answer_lua`). Envoy health-checks the picker (the gateway's gRPC health
service on the picker's port)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config.picker import DESTINATION_HEADER, MAX_BODY_BYTES
from gateway.picker import answer_lua
from gateway.picker.wire import LB_NAMESPACE, PICKER_NAMESPACE

TYPES = "type.googleapis.com/envoy.extensions."
PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
HTTP2 = {
    PROTOCOL_OPTIONS: {
        "@type": f"type.googleapis.com/{PROTOCOL_OPTIONS}",
        "explicit_http_config": {"http2_protocol_options": {}},
    }
}
# Envoy's default circuit breakers (1,024 requests per cluster) would cap the streams in
# flight far below what a fleet runs; the gateway's own limits bound them instead.
WIDE_OPEN = {"thresholds": [{"max_connections": 100_000, "max_pending_requests": 100_000,
                             "max_requests": 100_000, "max_retries": 1_000}]}  # fmt: skip
PICKED, PICKER = "picked", "gateway_picker"
MIN_WINDOW_BYTES = 65_535  # HTTP/2's smallest stream window
# What the filter sends the picker: everything it needs to place a call and see how it
# ended, and never a response message (relaying those is Envoy's job). The request body
# whole, up to Envoy's buffer limit: a longer one comes cut short, and the picker sends
# it to the relay, which reads it as it comes.
PROCESSING_MODE = {
    "request_header_mode": "SEND",
    "request_body_mode": "BUFFERED_PARTIAL",
    "request_trailer_mode": "SKIP",
    "response_header_mode": "SEND",
    "response_body_mode": "NONE",
    "response_trailer_mode": "SEND",
}


@dataclass(frozen=True, slots=True)
class PickerTls:
    """How Envoy reaches a picker port that serves TLS: `ca` verifies the picker's
    certificate (for the name `sni`, else the picker's host); `cert` and `key` are
    Envoy's own, where the port requires a client certificate (mTLS)."""

    ca: str
    cert: str | None = None
    key: str | None = None
    sni: str | None = None


def _transport_socket(tls: PickerTls, host: str) -> dict[str, Any]:
    common: dict[str, Any] = {"validation_context": {"trusted_ca": {"filename": tls.ca}}}
    if tls.cert is not None and tls.key is not None:
        common["tls_certificates"] = [
            {"certificate_chain": {"filename": tls.cert}, "private_key": {"filename": tls.key}}
        ]
    context: dict[str, Any] = {
        "@type": f"{TYPES}transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
        "sni": tls.sni or host,
    }
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def _address(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def envoy_config(
    listen: str,
    picker: str,
    *,
    admin: str | None = "127.0.0.1:9901",
    header: str = DESTINATION_HEADER,
    message_timeout_s: float = 330.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    picker_tls: PickerTls | None = None,
    token_counts: bool = True,
) -> dict[str, Any]:
    """Envoy's bootstrap: `listen` for clients, `picker` (HOST:PORT) the gateway's picker
    port. `message_timeout_s` bounds each answer of the picker, so it must cover a call's
    wait in its model's queue (with flow control: its class's `ttl_s`). Envoy buffers
    `max_body_bytes` of a request at most (`picker.max_body_bytes`: the picker port takes
    no longer message); a longer one reaches the picker cut short and goes to the relay.
    `picker_tls`: the picker port serves TLS (mTLS with Envoy's own certificate).
    `token_counts`: the Lua filter that hands the picker the messages of the answers it
    marked (their usage; without it, the picker's calls carry none)."""
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{TYPES}filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER}},
            "failure_mode_allow": False,
            "processing_mode": dict(PROCESSING_MODE),
            "message_timeout": f"{message_timeout_s:g}s",
            # Calls the picker hands to the relay whole need nothing more sent.
            "allow_mode_override": True,
            # `envoy.lb`: the worker, for the cluster; `gateway.picker`: the Lua's mark.
            "metadata_options": {
                "receiving_namespaces": {"untyped": [LB_NAMESPACE, PICKER_NAMESPACE]}
            },
        },
    }
    # Answers pass it before the picker's filter: it adds the trailer the picker reads.
    usage = {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": f"{TYPES}filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": answer_lua.SOURCE},
        },
    }
    router = {
        "name": "envoy.filters.http.router",
        # No x-envoy-* headers of its own on answers: a client sees what the relay sends.
        "typed_config": {
            "@type": f"{TYPES}filters.http.router.v3.Router",
            "suppress_envoy_headers": True,
        },
    }
    route = {
        "cluster": PICKED,
        "timeout": "0s",  # streams may be long: the client's deadline bounds a call
        # A call reset before it reached the worker is tried once more (nothing ran).
        "retry_policy": {"retry_on": "reset-before-request,connect-failure", "num_retries": 1},
    }
    manager = {
        "@type": f"{TYPES}filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        # The client's address goes into x-forwarded-for: the gateway's per-caller
        # shares are then the clients', not Envoy's.
        "use_remote_address": True,
        "server_header_transformation": "PASS_THROUGH",  # no `server: envoy` of its own
        # A gRPC call's buffer limit is its HTTP/2 stream window (16 MiB by default).
        "http2_protocol_options": {
            "initial_stream_window_size": max(max_body_bytes, MIN_WINDOW_BYTES)
        },
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "models",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                }
            ]
        },
        "http_filters": [ext_proc, usage, router] if token_counts else [ext_proc, router],
    }
    picked = {
        "name": PICKED,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": header},
        "connect_timeout": "1s",
        "typed_extension_protocol_options": HTTP2,
        "circuit_breakers": WIDE_OPEN,
    }
    picker_cluster = {
        "name": PICKER,
        "type": "STRICT_DNS",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": HTTP2,
        "circuit_breakers": WIDE_OPEN,
        "load_assignment": {
            "cluster_name": PICKER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(picker)}}]}],
        },
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "2s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {},
            }
        ],
    }
    if picker_tls is not None:
        host = picker.rpartition(":")[0].strip("[]")
        picker_cluster["transport_socket"] = _transport_socket(picker_tls, host)
    listener = {
        "name": "models",
        "address": _address(listen),
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
    bootstrap: dict[str, Any] = {
        "static_resources": {"listeners": [listener], "clusters": [picked, picker_cluster]}
    }
    if admin is not None:
        bootstrap = {"admin": {"address": _address(admin)}, **bootstrap}
    return bootstrap
