"""The flags of `gateway serve` and `gateway check-config` (the same set), their help
texts, and the configuration they make with the file (`config_from_args`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.config import (
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    GatewayConfig,
    build_config,
    load_file,
    parse_processes,
)
from gateway.core.policy_names import policy_names

WORKER_URL_HELP = """\
worker URL (--worker, a `workers:` entry, `gateway workers add`):
  grpc://HOST:PORT, or grpcs://HOST:PORT for TLS to the worker (see upstream_tls:), then
  query keys, each optional:
    model=NAME            the model it serves (default: asked from the worker)
    runtime=sglang|vllm   its engine's protocol (default: asked from the worker)
    role=regular|prefill|decode|encode
                          its part in disaggregated serving (default: asked from the
                          worker, else regular)
    bootstrap_port=N      a prefill's SGLang PD bootstrap port
    bootstrap_host=HOST   a prefill's bootstrap host (default: the URL's host)
    embedding_port=N      a prefill's port for encoder embeddings (EPD)
  e.g. grpc://10.0.0.5:30000?model=llama-3-8b&runtime=sglang
"""

ENVIRONMENT_HELP = """\
environment:
  GATEWAY_ADMIN_TOKEN   the admin token, unless --admin-token or --admin-token-file
                        gives one (it wins over admin.token in the file)
  GATEWAY_LOOP=uvloop   run on uvloop instead of asyncio's own event loop
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT
                        turn tracing on, exporting there over OTLP/gRPC
                        (tracing.endpoint wins)
  OTEL_SDK_DISABLED=true
                        tracing off, whatever is configured
  OTEL_SERVICE_NAME     the spans' service name (tracing.service_name wins; default
                        model-gateway)
  OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG
                        sampling, without tracing.sample_ratio (default: parent-based,
                        always on)
  OTEL_EXPORTER_OTLP_(TRACES_)INSECURE, _HEADERS, _CERTIFICATE, _TIMEOUT, _COMPRESSION
                        the OTLP exporter's other settings (read by the OpenTelemetry SDK)
  OTEL_RESOURCE_ATTRIBUTES
                        attributes added to every span's resource
  GRPC_VERBOSITY, GRPC_TRACE
                        grpc core's own logging (its lines are not throttled while
                        GRPC_TRACE is set)
  KUBECONFIG            kubernetes discovery's credentials outside a cluster, without
                        discovery[].kubeconfig (else ~/.kube/config)
"""

SERVE_EPILOG = WORKER_URL_HELP + "\n" + ENVIRONMENT_HELP

CHECK_CONFIG_DESCRIPTION = """\
Read and check a configuration exactly as `gateway serve` would (the same file, the same
flags, every check serve makes before it listens: the values, the addresses, the worker
URLs, the API keys file and the certificates read), without listening on any port or
starting anything; then print the effective configuration as YAML: every key, with its
value after the defaults and the flags (secrets such as admin.token shown as ***).
FILE is optional: without it (or --config), the flags and the defaults alone are
checked, as `gateway serve` without a file would run."""

CHECK_CONFIG_EPILOG = (
    """\
exit status:
  0  the configuration is valid: the effective configuration is on stdout (and on
     stderr, any warning serve would log, such as a renamed key)
  2  it is not: one line on stderr, the very line `gateway serve` would print
     (`gateway: config error: ...`), or a usage error

"""
    + ENVIRONMENT_HELP
)


def _add_serve_flags(
    p: argparse.ArgumentParser, files: argparse._ActionsContainer | None = None
) -> None:
    """The flags of `gateway serve`, which `gateway check-config` takes too (`files`: the
    group --config goes in, by default `p`)."""
    (files or p).add_argument(
        "--config", metavar="FILE", help="YAML config file (flags override it)"
    )
    p.add_argument(
        "--watch-config",
        action="store_true",
        help="reload the --config file when it changes, as SIGHUP does",
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="main port (default 127.0.0.1:50051)")
    p.add_argument(
        "--worker", metavar="URL", action="append", default=[], help="a worker (repeatable)"
    )
    p.add_argument("--policy", choices=policy_names(), help="default policy (default round_robin)")
    p.add_argument(
        "--max-attempts", type=int, metavar="N", help="upstream attempts per request (default 3)"
    )
    p.add_argument(
        "--probe-interval", type=float, metavar="S", help="worker probe interval (default 1 s)"
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        metavar="S",
        help="on SIGTERM, seconds to keep serving while NOT_SERVING (default 5)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        metavar="S",
        help="then, seconds in-flight calls get to finish (default 20)",
    )
    _tls_flags(p, "", "the main port", "client certificates")
    p.add_argument("--admin-listen", metavar="HOST:PORT", help="admin port (127.0.0.1:50052)")
    p.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help="bearer token the admin port requires (visible in the process list: prefer "
        "--admin-token-file or GATEWAY_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--admin-token-file", metavar="FILE", help="read the admin bearer token from FILE"
    )
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="Prometheus endpoint (127.0.0.1:9464; 'off' disables it)",
    )
    p.add_argument(
        "--picker-listen",
        metavar="HOST:PORT",
        help="also serve Envoy's external processing protocol here: the gateway as the "
        "endpoint picker of an Envoy that relays the calls itself (off by default)",
    )
    p.add_argument(
        "--picker-relay-address",
        metavar="IP:PORT",
        help="where the picker sends Envoy for the calls the relay runs (picker."
        "relay_address; default: the main port's listen address, a wildcard host as "
        "127.0.0.1)",
    )
    _tls_flags(p, "picker-", "the picker port", "Envoy's client certificate", inherits=True)
    p.add_argument(
        "--picker-plaintext",
        action="store_const",
        const=True,
        help="serve the picker port without TLS past loopback: only where the network "
        "encrypts the hop itself (a service mesh's mTLS)",
    )
    p.add_argument(
        "--processes",
        metavar="N|auto",
        help="serving processes sharing the main port (default 1; auto: usable cores, "
        "within the container's CPU limit)",
    )
    p.add_argument("--log-format", choices=LOG_FORMATS, help="log format (console)")
    p.add_argument("--log-level", choices=LOG_LEVELS, help="log level (info)")


def _tls_flags(
    p: argparse.ArgumentParser, prefix: str, port: str, client: str, inherits: bool = False
) -> None:
    """One port's TLS files: --{prefix}tls-cert, -key and -client-ca (`inherits`: the main
    port's files are the default)."""
    for key, what in (("cert", "certificate"), ("key", "private key")):
        default = f"; default: the main port's --tls-{key}" if inherits else ""
        p.add_argument(
            f"--{prefix}tls-{key}", metavar="FILE", help=f"TLS on {port}: {what} (PEM{default})"
        )
    p.add_argument(
        f"--{prefix}tls-client-ca",
        metavar="FILE",
        help=f"require {client} signed by this CA on {port} (mTLS)",
    )


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway in front of a fleet of workers",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_flags(p)


def add_check_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check-config",
        help="check a configuration as serve would, print it, start nothing",
        description=CHECK_CONFIG_DESCRIPTION,
        epilog=CHECK_CONFIG_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    files = p.add_mutually_exclusive_group()  # FILE or --config FILE, not both
    files.add_argument(
        "file", metavar="FILE", nargs="?", help="YAML config file (the same as --config FILE)"
    )
    _add_serve_flags(p, files)


def admin_token(args: argparse.Namespace) -> str | None:
    """The admin token: the flag, else the file, else GATEWAY_ADMIN_TOKEN."""
    if args.admin_token:
        return str(args.admin_token)
    if args.admin_token_file:
        try:
            token = Path(args.admin_token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"admin token file {args.admin_token_file!r}: {exc.strerror}"
            ) from None
        if not token:
            raise ConfigError(f"admin token file {args.admin_token_file!r} is empty")
        return token
    return os.environ.get("GATEWAY_ADMIN_TOKEN") or None


def config_from_args(
    args: argparse.Namespace, file_data: Mapping[str, Any] | None = None
) -> GatewayConfig:
    """`file_data`: the --config file already read (else it is read here)."""
    if file_data is None and args.config:
        file_data = load_file(args.config)
    return build_config(
        file_data,
        worker_urls=args.worker,
        overrides={
            "listen": args.listen,
            "default_policy": args.policy,
            "max_attempts": args.max_attempts,
            "log_format": args.log_format,
            "log_level": args.log_level,
            "probe.interval_s": args.probe_interval,
            "drain.delay_s": args.drain_delay,
            "drain.grace_s": args.shutdown_grace,
            "admin.listen": args.admin_listen,
            "admin.token": admin_token(args),
            "metrics.listen": args.metrics_listen,
            "picker.listen": args.picker_listen,
            "picker.relay_address": args.picker_relay_address,
            **tls_overrides(args, ""),
            **tls_overrides(args, "picker."),
            "picker.plaintext": args.picker_plaintext,
            "processes": parse_processes(args.processes) if args.processes else None,
        },
    )


def tls_overrides(args: argparse.Namespace, section: str) -> dict[str, str | None]:
    """`{section}tls.cert`, `.key`, `.client_ca` from their flags (see `_tls_flags`)."""
    flag = section.replace(".", "_")
    return {
        f"{section}tls.{key}": getattr(args, f"{flag}tls_{key}")
        for key in ("cert", "key", "client_ca")
    }
